"""Codecs that turn tensors into compact messages and back, computed on the tensor's own device.

Every codec keeps hivemind's class name where hivemind has one, so ``grad_compression=...`` in a
user's script keeps working with one import changed. See :mod:`hivemind_ext.compression.base` for
the message format.
"""

from hivemind_ext.compression.base import (
    CODECS,
    Codec,
    CompressedTensor,
    CompressionInfo,
    TensorRole,
    decompress,
)
from hivemind_ext.compression.floating import (
    BFloat16Compression,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
)

CompressionBase = Codec  # hivemind's name for the base class

__all__ = [
    "CODECS",
    "BFloat16Compression",
    "Codec",
    "CompressedTensor",
    "CompressionBase",
    "CompressionInfo",
    "Float16Compression",
    "NoCompression",
    "ScaledFloat16Compression",
    "TensorRole",
    "decompress",
]
