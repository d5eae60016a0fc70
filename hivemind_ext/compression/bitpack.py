"""Packing integer codes of a fixed bit width (1 to 25 bits) into a byte stream and back, with torch ops.

Code ``i`` occupies bits ``i * width`` .. ``(i + 1) * width - 1`` of the stream, least significant bit
first (bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``); the unused high bits of the last
byte are zero.

Eight codes fill exactly ``width`` bytes, so the codes are processed as rows of eight: code ``j`` of
a row starts at bit ``j * width`` of the row's bytes and, being at most 25 bits long and starting at
most 7 bits into its first byte, touches at most 4 of them. Packing ORs (adds: codes never share a
bit) each code's part into each byte it touches, one column of the rows at a time; unpacking
assembles each code from its bytes the same way. That is a few dozen whole-column ops whatever the
number of codes: no Python loop over values, no scatter, and everything on the codes' device.
"""

from __future__ import annotations

import torch

MAX_WIDTH = 25  # a code of at most 25 bits starting at most 7 bits into a byte spans at most 4 bytes
_ROW = 8  # codes per row: 8 codes of `width` bits fill exactly `width` bytes


def packed_nbytes(count: int, width: int) -> int:
    return -(-count * width // 8)


def _check_width(width: int) -> None:
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width must be in [1, {MAX_WIDTH}], got {width}")


def _spans(width: int) -> list[tuple[int, int, int]]:
    """(code j, byte b, shift) for every byte b of a row that code j touches: the code's bits seen from
    byte b are ``code << shift`` (shift = 8 b - j width is negative or up to -7 .. 24 the other way)."""
    spans = []
    for j in range(_ROW):
        first_bit = j * width
        for b in range(first_bit // 8, (first_bit + width - 1) // 8 + 1):
            spans.append((j, b, first_bit - 8 * b))
    return spans


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Packs non-negative integer ``codes`` (1-D, each below ``2**width``) into a uint8 tensor of
    ``packed_nbytes(len(codes), width)`` bytes, on the codes' device."""
    _check_width(width)
    count = codes.numel()
    rows = -(-count // _ROW)
    padded = torch.zeros(rows * _ROW, dtype=torch.int64, device=codes.device)
    padded[:count] = codes
    table = padded.view(rows, _ROW)  # [rows, 8]
    out = torch.zeros(rows, width, dtype=torch.int64, device=codes.device)  # [rows, width bytes]
    for j, b, shift in _spans(width):
        part = table[:, j] << shift if shift >= 0 else table[:, j] >> -shift
        out[:, b] |= part & 0xFF
    return out.view(-1)[: packed_nbytes(count, width)].to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The ``count`` codes of ``width`` bits in ``packed`` (uint8, at least ``packed_nbytes`` long), as int64."""
    _check_width(width)
    rows = -(-count // _ROW)
    nbytes = packed_nbytes(count, width)
    stream = torch.zeros(rows * width, dtype=torch.int64, device=packed.device)
    stream[:nbytes] = packed[:nbytes]
    table = stream.view(rows, width)  # [rows, width bytes]
    codes = torch.zeros(rows, _ROW, dtype=torch.int64, device=packed.device)
    for j, b, shift in _spans(width):
        codes[:, j] |= table[:, b] >> shift if shift >= 0 else table[:, b] << -shift
    return (codes & ((1 << width) - 1)).view(-1)[:count]


__all__ = ["MAX_WIDTH", "pack_bits", "packed_nbytes", "unpack_bits"]
