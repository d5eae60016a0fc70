"""decompress_into: every codec's message decoded into a caller's tensor gives exactly decompress's
values, in place (the all-reduce decodes averaged chunks straight into its outputs this way), and a
hostile message raises CompressionError before anything is written."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from codec_examples import float_codec_examples, optional_codec_examples

from hivemind_ext.compression import (
    Codec,
    CompressedTensor,
    Float16Compression,
    Float16OrMinMax16,
    MinMaxUInt8,
    decompress,
    decompress_into,
)
from hivemind_ext.errors import CompressionError

N = 1000


def values(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(seed)).to(dtype)


# every codec in float32; the codecs that decode straight into the output (decodes_into_output) in every float dtype
CASES = [(codec, torch.float32) for codec in float_codec_examples() + optional_codec_examples()] + [
    (codec, dtype)
    for codec in (Float16OrMinMax16(), MinMaxUInt8(), Float16Compression())
    for dtype in (torch.float64, torch.float16)
]


@pytest.mark.parametrize(("codec", "dtype"), CASES, ids=lambda case: repr(case).replace("torch.", ""))
def test_decoding_into_a_slice_gives_decompress_values_in_place(codec: Codec, dtype: torch.dtype) -> None:
    x = values(dtype)
    message = CompressedTensor.from_bytes(codec.compress(x).to_bytes())  # as read from the wire
    expected = decompress(message)
    canvas = torch.full((N + 20,), 7.0, dtype=dtype)
    out = canvas[10 : 10 + N]  # an output chunk inside a larger tensor
    assert decompress_into(message, out) is out
    assert torch.equal(out, expected)
    assert bool((canvas[:10] == 7).all()) and bool((canvas[-10:] == 7).all())  # nothing written outside


@pytest.mark.parametrize("codec", [Float16OrMinMax16(), MinMaxUInt8(), Float16Compression()], ids=repr)
def test_an_output_of_another_dtype_gets_converted_values(codec: Codec) -> None:
    message = codec.compress(values())
    out = torch.empty(N, dtype=torch.float64)
    decompress_into(message, out)
    assert torch.equal(out, decompress(message).double())


def test_an_output_of_the_wrong_size_or_layout_is_refused() -> None:
    message = MinMaxUInt8().compress(values())
    with pytest.raises(CompressionError):
        decompress_into(message, torch.empty(N + 1))
    with pytest.raises(CompressionError):
        decompress_into(message, torch.empty(2 * N)[::2])  # not contiguous


@pytest.mark.parametrize("codec", [Float16OrMinMax16(), MinMaxUInt8(), Float16Compression()], ids=repr)
def test_a_hostile_message_raises_before_writing(codec: Codec) -> None:
    message = codec.compress(values())
    out = torch.full((N,), 7.0)
    truncated = dataclasses.replace(message, payload=message.payload[:-8])
    with pytest.raises(CompressionError):
        decompress_into(truncated, out)
    lying = dataclasses.replace(message, params={**message.params, "unexpected": 1})
    with pytest.raises(CompressionError):
        decompress_into(lying, out)
    assert bool((out == 7).all())
