"""Codecs that turn tensors into compact messages and back, computed on the tensor's own device.

Every codec keeps hivemind's class name where hivemind has one, so ``grad_compression=...`` in a
user's script keeps working with one import changed. See :mod:`hivemind_ext.compression.base` for
the message format.
"""

from hivemind_ext.compression.adaptive import (
    AdaptiveCompressionBase,
    PerTensorCompression,
    RoleAdaptiveCompression,
    SizeAdaptiveCompression,
)
from hivemind_ext.compression.base import (
    CODECS,
    Codec,
    CompressedTensor,
    CompressionInfo,
    TensorRole,
    decompress,
    decompress_into,
)
from hivemind_ext.compression.error_feedback import ErrorFeedback
from hivemind_ext.compression.floating import (
    BFloat16Compression,
    Float16Compression,
    NoCompression,
    ScaledFloat16Compression,
)
from hivemind_ext.compression.minmax import MinMaxUInt4, MinMaxUInt8
from hivemind_ext.compression.minmax16 import Float16OrMinMax16
from hivemind_ext.compression.quantization import (
    BlockwiseQuantization,
    Quantile8BitQuantization,
    Uniform8BitQuantization,
)
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.compression.sparse import SparseTopK

CompressionBase = Codec  # hivemind's name for the base class

__all__ = [
    "CODECS",
    "AdaptiveCompressionBase",
    "BFloat16Compression",
    "BlockwiseQuantization",
    "Codec",
    "CompressedTensor",
    "CompressionBase",
    "CompressionInfo",
    "ErrorFeedback",
    "Float16Compression",
    "Float16OrMinMax16",
    "MinMaxUInt4",
    "MinMaxUInt8",
    "NoCompression",
    "PerTensorCompression",
    "Quantile8BitQuantization",
    "RoleAdaptiveCompression",
    "ScaledFloat16Compression",
    "SizeAdaptiveCompression",
    "SparseTopK",
    "TensorRole",
    "Uniform8BitQuantization",
    "as_codec",
    "decompress",
    "decompress_into",
]
