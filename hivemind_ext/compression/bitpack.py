"""Packing integer codes of a fixed bit width (1 to 25 bits) into a byte stream and back, with torch ops.

Code ``i`` occupies bits ``i * width`` .. ``(i + 1) * width - 1`` of the stream, least significant bit
first (bit ``j`` of the stream is bit ``j % 8`` of byte ``j // 8``); the unused high bits of the last
byte are zero. A code of at most 25 bits, shifted by its offset inside its first byte (at most 7
bits), spans at most 4 bytes: packing adds each code's up-to-4 bytes into the stream (codes never
share a bit, so adding is OR), unpacking reads them back. Every step is one vectorized op over all
codes on their own device: no Python loop over values, and no [codes, width] bit matrix.
"""

from __future__ import annotations

import torch

MAX_WIDTH = 25  # width + 7 offset bits must fit the 32 bits read back by unpack_bits
_SPAN = 4  # bytes one code can touch


def packed_nbytes(count: int, width: int) -> int:
    return -(-count * width // 8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Packs non-negative integer ``codes`` (1-D, each below ``2**width``) into a uint8 tensor of
    ``packed_nbytes(len(codes), width)`` bytes, on the codes' device."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width must be in [1, {MAX_WIDTH}], got {width}")
    count, device = codes.numel(), codes.device
    nbytes = packed_nbytes(count, width)
    if count == 0:
        return torch.zeros(nbytes, dtype=torch.uint8, device=device)
    offsets = torch.arange(count, dtype=torch.int64, device=device).mul_(width)  # bit offset of each code
    first = offsets >> 3  # [count] the byte each code starts in
    shifted = codes.to(torch.int64) << (offsets & 7)  # < 2**32: the code at its place in its 4-byte window
    stream = torch.zeros(nbytes + _SPAN, dtype=torch.int32, device=device)  # sums of disjoint bits stay < 256
    for byte in range(_SPAN):
        stream.index_add_(0, first + byte, ((shifted >> (8 * byte)) & 0xFF).to(torch.int32))
    return stream[:nbytes].to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, width: int) -> torch.Tensor:
    """The ``count`` codes of ``width`` bits in ``packed`` (uint8, at least ``packed_nbytes`` long), as int64."""
    if not 1 <= width <= MAX_WIDTH:
        raise ValueError(f"width must be in [1, {MAX_WIDTH}], got {width}")
    device = packed.device
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=device)
    nbytes = packed_nbytes(count, width)
    stream = torch.zeros(nbytes + _SPAN, dtype=torch.int64, device=device)
    stream[:nbytes] = packed[:nbytes]
    offsets = torch.arange(count, dtype=torch.int64, device=device).mul_(width)
    first = offsets >> 3
    window = stream[first]  # [count] the first byte, then the next three shifted into place
    for byte in range(1, _SPAN):
        window |= stream[first + byte] << (8 * byte)
    return (window >> (offsets & 7)) & ((1 << width) - 1)


__all__ = ["MAX_WIDTH", "pack_bits", "packed_nbytes", "unpack_bits"]
