"""Helpers for codecs that keep statistics per fixed-size chunk of a flattened tensor."""

from __future__ import annotations

import torch


def num_chunks(numel: int, chunk_size: int) -> int:
    return -(-numel // chunk_size)


def split_chunks(flat: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views a 1-D tensor as (full chunks [k, chunk_size], tail [r]) with no copies; r < chunk_size."""
    full = flat.numel() // chunk_size * chunk_size
    return flat[:full].view(-1, chunk_size), flat[full:]


def chunk_amin_amax(flat: torch.Tensor, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-chunk minimum and maximum, each of shape [num_chunks]; NaN in a chunk propagates to both."""
    body, tail = split_chunks(flat, chunk_size)
    # amin and amax separately: on CPU, aminmax(dim=1) is about 5x slower than the two reductions
    mins, maxs = (body.amin(dim=1), body.amax(dim=1)) if body.numel() else (body.new_empty(0), body.new_empty(0))
    if tail.numel():
        tail_min, tail_max = torch.aminmax(tail)
        mins, maxs = torch.cat([mins, tail_min.view(1)]), torch.cat([maxs, tail_max.view(1)])
    return mins, maxs


def expand_per_chunk(stats: torch.Tensor, numel: int, chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Broadcastable views of per-chunk stats matching split_chunks: ([k, 1], scalar-or-empty for the tail)."""
    full_chunks = numel // chunk_size
    return stats[:full_chunks].view(-1, 1), stats[full_chunks:]
