"""Wrappers that pick an inner codec per tensor: by size, by role, or by key.

They keep hivemind's class names and constructor signatures, so a script that builds them keeps
working with one import changed. A wrapper has no wire format of its own: it returns the chosen
inner codec's message, whose codec id is in the header, so a receiver decodes it with
:func:`~hivemind_ext.compression.decompress` without knowing the sender's configuration.
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

import torch

from hivemind_ext.compression.base import ALL_DTYPES, Codec, CompressedTensor, CompressionInfo, Key, TensorRole
from hivemind_ext.compression.floating import NoCompression
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import CompressionError, ConfigurationError


class CodecWrapper(Codec):
    """A codec that delegates to other codecs and has no wire format (and no ``codec_id``) of its own.

    Subclasses implement :meth:`encode` and :meth:`compress`; the per-format hooks of :class:`Codec`
    are never reached, because messages always carry the inner codec's id.
    """

    supported_dtypes = ALL_DTYPES  # the inner codec decides

    def _encode(self, flat: torch.Tensor, allow_inplace: bool) -> NoReturn:
        raise TypeError(f"{type(self).__name__} is a wrapper; it encodes through its inner codec")

    @classmethod
    def payload_nbytes(cls, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> NoReturn:
        raise CompressionError(f"{cls.__name__} has no wire format of its own")

    @classmethod
    def _decode(cls, payload: torch.Tensor, numel: int, dtype: torch.dtype, params: Mapping[str, Any]) -> NoReturn:
        raise CompressionError(f"{cls.__name__} has no wire format of its own")


def _info_for(codec: Codec, tensor: torch.Tensor, info: CompressionInfo | None) -> CompressionInfo:
    codec.check_tensor(tensor)
    if info is None:
        return CompressionInfo.from_tensor(tensor)
    if not isinstance(info, CompressionInfo):
        raise CompressionError(f"info must be a CompressionInfo or None, got {type(info).__name__}")
    return info


def _inner(obj: Any, what: str) -> Codec:
    try:
        return as_codec(obj)
    except ConfigurationError as e:
        raise ConfigurationError(f"{what}: {e}") from None


class AdaptiveCompressionBase(CodecWrapper):
    """Chooses one inner codec per tensor from its :class:`CompressionInfo` and delegates to it."""

    @abstractmethod
    def choose_compression(self, info: CompressionInfo) -> Codec:
        """The inner codec for a tensor described by ``info``."""

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> CompressedTensor:
        """The chosen codec's message; without ``info``, the tensor is described by ``CompressionInfo.from_tensor``."""
        info = _info_for(self, tensor, info)
        return self.choose_compression(info).compress(tensor, info, allow_inplace)

    def encode(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> CompressedTensor:
        info = _info_for(self, tensor, info)
        return self.choose_compression(info).encode(tensor, info, allow_inplace)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.choose_compression(info).estimate_compression_ratio(info)


class SizeAdaptiveCompression(AdaptiveCompressionBase):
    """``greater_equal`` for tensors of at least ``threshold`` elements (of the whole tensor), ``less`` otherwise."""

    def __init__(self, threshold: int, less: Codec, greater_equal: Codec):
        try:
            threshold = operator.index(threshold)
        except TypeError:
            raise ConfigurationError(f"threshold must be an integer, got {threshold!r}") from None
        if threshold < 0:
            raise ConfigurationError(f"threshold must be non-negative, got {threshold}")
        self.threshold = threshold
        self.less = _inner(less, "SizeAdaptiveCompression(less=...)")
        self.greater_equal = _inner(greater_equal, "SizeAdaptiveCompression(greater_equal=...)")

    def choose_compression(self, info: CompressionInfo) -> Codec:
        return self.greater_equal if info.numel() >= self.threshold else self.less


class RoleAdaptiveCompression(AdaptiveCompressionBase):
    """One codec per :class:`TensorRole`; roles left as None use ``default`` (also used for UNSPECIFIED)."""

    def __init__(
        self,
        *,
        activation: Codec | None = None,
        parameter: Codec | None = None,
        gradient: Codec | None = None,
        optimizer: Codec | None = None,
        default: Codec = NoCompression(),  # noqa: B008 - stateless, hivemind's signature
    ):
        default = _inner(default, "RoleAdaptiveCompression(default=...)")
        chosen = {
            TensorRole.ACTIVATION: activation,
            TensorRole.PARAMETER: parameter,
            TensorRole.GRADIENT: gradient,
            TensorRole.OPTIMIZER: optimizer,
        }
        self.role_compressions: dict[TensorRole, Codec] = {
            role: default if codec is None else _inner(codec, f"RoleAdaptiveCompression({role.name.lower()}=...)")
            for role, codec in chosen.items()
        }
        self.role_compressions[TensorRole.UNSPECIFIED] = default

    def choose_compression(self, info: CompressionInfo) -> Codec:
        role = info.role
        if not isinstance(role, TensorRole):  # e.g. hivemind's TensorRole: same member names
            role = TensorRole.__members__.get(getattr(role, "name", None), role)
        try:
            return self.role_compressions[role]
        except (KeyError, TypeError):
            raise CompressionError(f"RoleAdaptiveCompression: unknown tensor role {info.role!r}") from None

    def __repr__(self) -> str:
        fields = ", ".join(f"{role.name.lower()}={codec!r}" for role, codec in self.role_compressions.items())
        return f"{type(self).__name__}({fields})"


class PerTensorCompression(AdaptiveCompressionBase):
    """A codec per tensor key (``info.key``): a sequence indexed by integer keys, or a mapping.

    A tensor whose key has no codec (including a tensor compressed without ``info``, whose key is
    None) raises :class:`CompressionError`.
    """

    def __init__(self, tensor_compressions: Sequence[Codec] | Mapping[Key, Codec]):
        what = "PerTensorCompression(tensor_compressions=...)"
        if isinstance(tensor_compressions, Mapping):
            self.tensor_compressions: Sequence[Codec] | Mapping[Key, Codec] = {
                key: _inner(codec, f"{what}[{key!r}]") for key, codec in tensor_compressions.items()
            }
        elif isinstance(tensor_compressions, Sequence) and not isinstance(tensor_compressions, str | bytes):
            self.tensor_compressions = tuple(
                _inner(codec, f"{what}[{index}]") for index, codec in enumerate(tensor_compressions)
            )
        else:
            raise ConfigurationError(
                f"{what} must be a sequence or a mapping of codecs, got {type(tensor_compressions).__name__}"
            )

    def choose_compression(self, info: CompressionInfo) -> Codec:
        key = info.key
        codecs = self.tensor_compressions
        if isinstance(codecs, Mapping):
            try:
                return codecs[key]
            except (KeyError, TypeError):  # TypeError: an unhashable key
                pass
        elif type(key) is int and 0 <= key < len(codecs):
            return codecs[key]
        if isinstance(codecs, Mapping):
            keys = list(codecs)
            known = ", ".join(map(repr, keys[:10])) + (f", ... ({len(keys)} in all)" if len(keys) > 10 else "")
        else:
            known = f"integers 0..{len(codecs) - 1}"
        hint = " (compress with info=CompressionInfo(key=...))" if key is None else ""
        raise CompressionError(f"PerTensorCompression has no codec for tensor key {key!r}{hint}; known keys: {known}")


__all__ = [
    "AdaptiveCompressionBase",
    "CodecWrapper",
    "PerTensorCompression",
    "RoleAdaptiveCompression",
    "SizeAdaptiveCompression",
]
