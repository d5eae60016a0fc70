"""Turns what a user passed as a compression setting into one of our codecs.

Users migrating from hivemind may still hand us instances of hivemind's compression classes
(``hivemind.compression.Float16Compression()``, adaptive wrappers around them, ...). They are
recognised by module and class name, without importing ``hivemind.compression`` (the library does
not depend on hivemind's codecs), and replaced by our codec of the same name with the same settings.

Settings that hivemind hard-codes map to our defaults: ScaledFloat16Compression scales fixed-size
chunks instead of rows, BlockwiseQuantization uses blocks of 4096 as hivemind does, and a
Uniform8BitQuantization left at hivemind's default range (6 sigmas) gets ours; a range set explicitly
on the instance (``RANGE_IN_SIGMAS``) is kept.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hivemind_ext.compression.base import Codec, TensorRole
from hivemind_ext.compression.floating import Float16Compression, NoCompression, ScaledFloat16Compression
from hivemind_ext.errors import ConfigurationError

HIVEMIND_MODULE = "hivemind.compression"
HIVEMIND_UNIFORM8BIT_RANGE_IN_SIGMAS = 6


def as_codec(obj: Any) -> Codec:
    """Returns ``obj`` if it is one of our codecs, or our equivalent of a hivemind compression instance.

    hivemind's adaptive wrappers are converted recursively, with their thresholds, roles and keys.

    :raises ConfigurationError: for anything else (with a hint at what to pass instead)
    """
    return _convert(obj, active=set())


def _convert(obj: Any, active: set[int]) -> Codec:
    if isinstance(obj, Codec):
        return obj
    cls = type(obj)
    if cls.__module__ == HIVEMIND_MODULE or cls.__module__.startswith(HIVEMIND_MODULE + "."):
        converter = _HIVEMIND_CONVERTERS.get(cls.__name__)
        if converter is None:
            raise ConfigurationError(
                f"hivemind's {cls.__module__}.{cls.__name__} has no hivemind_ext equivalent; "
                f"supported hivemind codecs: {sorted(_HIVEMIND_CONVERTERS)}"
            )
        if id(obj) in active:
            raise ConfigurationError(f"hivemind {cls.__name__} contains itself; cannot convert a cyclic configuration")
        active.add(id(obj))
        try:
            return converter(obj, lambda inner: _convert(inner, active))
        finally:
            active.discard(id(obj))
    if isinstance(obj, type) and issubclass(obj, Codec):
        raise ConfigurationError(f"expected a codec instance, got the class {obj.__name__}; pass {obj.__name__}()")
    if isinstance(obj, type) and obj.__module__.startswith(HIVEMIND_MODULE):
        raise ConfigurationError(f"expected a codec instance, got hivemind's class {obj.__name__}; pass an instance")
    raise ConfigurationError(
        f"expected a hivemind_ext.compression codec (e.g. hivemind_ext.compression.Float16Compression()), "
        f"got {cls.__module__}.{cls.__qualname__}: {obj!r:.100}"
    )


def _our_class(name: str) -> type[Codec]:
    """Our codec class of that name, looked up in the package (the quantization codecs and the adaptive
    wrappers live in modules that depend on this one: the wrappers convert their inner codecs here)."""
    package = importlib.import_module("hivemind_ext.compression")
    cls = getattr(package, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Codec)):
        raise ConfigurationError(f"hivemind's {name} has no hivemind_ext equivalent in this version")
    return cls


Convert = Callable[[Any], Codec]


def _hivemind_attribute(obj: Any, name: str) -> Any:
    try:
        return getattr(obj, name)
    except AttributeError:
        raise ConfigurationError(
            f"hivemind {type(obj).__name__} has no attribute {name!r}; unsupported hivemind version?"
        ) from None


def _uniform8bit(obj: Any, convert: Convert) -> Codec:
    cls = _our_class("Uniform8BitQuantization")
    range_in_sigmas = getattr(obj, "RANGE_IN_SIGMAS", HIVEMIND_UNIFORM8BIT_RANGE_IN_SIGMAS)
    if range_in_sigmas == HIVEMIND_UNIFORM8BIT_RANGE_IN_SIGMAS:
        return cls()
    if "range_in_sigmas" in inspect.signature(cls).parameters:
        return cls(range_in_sigmas=range_in_sigmas)
    raise ConfigurationError(
        f"hivemind Uniform8BitQuantization with RANGE_IN_SIGMAS={range_in_sigmas!r} has no equivalent; "
        f"use hivemind_ext.compression.Uniform8BitQuantization()"
    )


def _size_adaptive(obj: Any, convert: Convert) -> Codec:
    return _our_class("SizeAdaptiveCompression")(
        _hivemind_attribute(obj, "threshold"),
        less=convert(_hivemind_attribute(obj, "less")),
        greater_equal=convert(_hivemind_attribute(obj, "greater_equal")),
    )


def _role_adaptive(obj: Any, convert: Convert) -> Codec:
    by_name = {
        getattr(role, "name", role): codec for role, codec in _hivemind_attribute(obj, "role_compressions").items()
    }
    missing = [role for role in TensorRole.__members__ if role not in by_name]
    if missing:
        raise ConfigurationError(f"hivemind RoleAdaptiveCompression has no codec for roles {missing}")
    return _our_class("RoleAdaptiveCompression")(
        activation=convert(by_name["ACTIVATION"]),
        parameter=convert(by_name["PARAMETER"]),
        gradient=convert(by_name["GRADIENT"]),
        optimizer=convert(by_name["OPTIMIZER"]),
        default=convert(by_name["UNSPECIFIED"]),
    )


def _per_tensor(obj: Any, convert: Convert) -> Codec:
    codecs = _hivemind_attribute(obj, "tensor_compressions")
    if isinstance(codecs, Mapping):
        return _our_class("PerTensorCompression")({key: convert(codec) for key, codec in codecs.items()})
    if isinstance(codecs, Sequence) and not isinstance(codecs, str | bytes):
        return _our_class("PerTensorCompression")([convert(codec) for codec in codecs])
    raise ConfigurationError(
        f"hivemind PerTensorCompression holds a {type(codecs).__name__}, expected a sequence or a mapping"
    )


def _by_name(name: str) -> Callable[[Any, Convert], Codec]:
    return lambda obj, convert: _our_class(name)()


_HIVEMIND_CONVERTERS: dict[str, Callable[[Any, Convert], Codec]] = {
    "NoCompression": lambda obj, convert: NoCompression(),
    "Float16Compression": lambda obj, convert: Float16Compression(),
    # hivemind scales each row of the last axis; ours scales fixed-size chunks of the flattened tensor
    "ScaledFloat16Compression": lambda obj, convert: ScaledFloat16Compression(),
    "Uniform8BitQuantization": _uniform8bit,
    "Quantile8BitQuantization": _by_name("Quantile8BitQuantization"),
    "BlockwiseQuantization": _by_name("BlockwiseQuantization"),
    "SizeAdaptiveCompression": _size_adaptive,
    "RoleAdaptiveCompression": _role_adaptive,
    "PerTensorCompression": _per_tensor,
}

__all__ = ["as_codec"]
