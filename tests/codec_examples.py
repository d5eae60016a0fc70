"""Example instances of every codec and wrapper, for tests that must cover all of them.

``test_compression_fuzz.py`` checks that every codec id in ``hivemind_ext.compression.CODECS`` has an
example here, so a new codec cannot be forgotten: add its default instance and one with small
non-default parameters (tiny chunks make every chunk boundary and tail case appear in small tensors).
"""

from __future__ import annotations

from collections.abc import Callable

import hivemind_ext.compression as compression
from hivemind_ext.compression import (
    BFloat16Compression,
    Codec,
    ErrorFeedback,
    Float16Compression,
    Float16OrMinMax16,
    NoCompression,
    PerTensorCompression,
    RoleAdaptiveCompression,
    ScaledFloat16Compression,
    SizeAdaptiveCompression,
    SparseTopK,
)

# Codecs that may not exist yet in this tree: (class name, factories given the class). Each factory
# builds one example; the list fills in as soon as the class is exported by hivemind_ext.compression.
OPTIONAL_CODECS: list[tuple[str, list[Callable[[type[Codec]], Codec]]]] = [
    ("Uniform8BitQuantization", [lambda cls: cls(), lambda cls: cls(range_in_sigmas=3.0)]),
    ("Quantile8BitQuantization", [lambda cls: cls()]),
    ("BlockwiseQuantization", [lambda cls: cls(), lambda cls: cls(block_size=5)]),
    ("MinMaxUInt8", [lambda cls: cls(), lambda cls: cls(chunk_size=3)]),
    ("MinMaxUInt4", [lambda cls: cls(), lambda cls: cls(chunk_size=3), lambda cls: cls(chunk_size=4)]),
    (
        "SparseTopK",
        [lambda cls: cls(), lambda cls: cls(density=0.25, bits=3, chunk_size=8), lambda cls: cls(1.0, 8, chunk_size=3)],
    ),
]


def float_codec_examples() -> list[Codec]:
    return [
        NoCompression(),
        Float16Compression(),
        Float16OrMinMax16(),
        BFloat16Compression(),
        ScaledFloat16Compression(),
        ScaledFloat16Compression(chunk_size=1),
        ScaledFloat16Compression(chunk_size=7),
    ]


def optional_codec_examples() -> list[Codec]:
    examples = []
    for name, factories in OPTIONAL_CODECS:
        cls = getattr(compression, name, None)
        if cls is not None:
            examples.extend(factory(cls) for factory in factories)
    return examples


def wrapper_examples() -> list[Codec]:
    """Wrappers that work without ``info`` (PerTensorCompression then looks up the key None)."""
    return [
        SizeAdaptiveCompression(8, less=NoCompression(), greater_equal=ScaledFloat16Compression(chunk_size=5)),
        RoleAdaptiveCompression(gradient=Float16Compression(), default=BFloat16Compression()),
        PerTensorCompression({None: Float16Compression(), "weight": ScaledFloat16Compression(chunk_size=3)}),
        ErrorFeedback(ScaledFloat16Compression(chunk_size=3)),
        ErrorFeedback(Float16Compression()),
        ErrorFeedback(SparseTopK(density=0.2, chunk_size=10)),
    ]


def codec_examples() -> list[Codec]:
    """Example instances of every registered codec (defaults and small non-default parameters) and of the wrappers."""
    return float_codec_examples() + optional_codec_examples() + wrapper_examples()
