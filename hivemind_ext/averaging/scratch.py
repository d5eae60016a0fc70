"""ScratchBuffers: the tensors an averager's rounds work in, kept from one round to the next.

A round needs two scratch tensors per averaged tensor: the values at the round's start (the
all-reduce's inputs) and the all-reduce's outputs. They are reused because fresh memory is
expensive: filling a new 64 MiB tensor page-faults 16,384 times, which took 7x longer than copying
into one already paged in (27 ms vs 4 ms on the benchmark machine), and a round needed three of them
per averaged tensor. They are lent to one round at a time: a round that overlaps another one gets
fresh tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# (the values at the round's start, the all-reduce's outputs), one tensor per averaged tensor each
RoundBuffers = tuple[list[torch.Tensor], list[torch.Tensor]]


class ScratchBuffers:
    """One averager's scratch tensors. The averager lends them with its lock held; giving them back
    is one assignment."""

    def __init__(self) -> None:
        self._kept: RoundBuffers | None = None

    @property
    def kept(self) -> RoundBuffers | None:
        """The tensors the next round will get (None before the first round and while one holds them)."""
        return self._kept

    def lend(self, tensors: Sequence[torch.Tensor]) -> RoundBuffers:
        """Scratch tensors like ``tensors``: the kept ones if they match, else fresh ones."""
        buffers = self._kept
        if buffers is not None and all(
            (b.shape, b.dtype, b.device) == (t.shape, t.dtype, t.device)
            for group in buffers
            for b, t in zip(group, tensors, strict=True)
        ):
            self._kept = None  # lent: an overlapping round must not write into them
            return buffers
        return (
            [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors],
            [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors],
        )

    def give_back(self, buffers: RoundBuffers) -> None:
        """Keeps a finished round's tensors for the next round (once nothing writes into them any more)."""
        self._kept = buffers
