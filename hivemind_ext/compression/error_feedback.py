"""Error feedback: carries each tensor's compression error over to its next compression.

With a lossy codec ``C``, sending ``C(x_t)`` every step loses ``x_t - C(x_t)`` each time, and the
losses add up. Error feedback keeps a residual ``r`` per tensor and sends ``C(x_t + r_t)`` with
``r_{t+1} = (x_t + r_t) - C(x_t + r_t)``, so the sum of what was sent equals the sum of the inputs up
to the last residual, which stays bounded by one step's compression error.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Collection, Hashable
from typing import Any

import torch

from hivemind_ext.compression.adaptive import CodecWrapper
from hivemind_ext.compression.base import Codec, CompressedTensor, CompressionInfo, Key, decompress
from hivemind_ext.compression.floating import to_half_clamped
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import CompressionError, ConfigurationError

HALF_DTYPES = (torch.float16, torch.bfloat16)
Snapshot = dict[tuple[Hashable, Hashable], tuple[torch.Tensor, torch.dtype]]  # ErrorFeedback.snapshot()


@dataclasses.dataclass
class _Slot:
    """The residual of one (key, part) and the lock that serialises its updates."""

    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    residual: torch.Tensor | None = None  # in promote_types(dtype, float32), on the tensor's device
    dtype: torch.dtype | None = None  # the dtype of the tensors this residual belongs to


class ErrorFeedback(CodecWrapper):
    """Wraps any codec (typically a lossy one) with per-tensor error feedback.

    Residuals are kept on the tensor's device, in float32 (float64 for float64 tensors), so the error of
    casting float16/bfloat16 tensors is fed back as well. Where ``info.part_offset`` says where a part
    lies in its tensor (as in an all-reduce), each tensor key has one residual of the whole (flattened)
    tensor and each part uses its own slice of it, so residuals stay with their values when the parts
    are cut differently from one round to the next (an all-reduce's part sizes follow the members'
    bandwidths); the average an all-reduce owner sends back (``info.aggregate``) has a residual of its
    own. Otherwise residuals are kept per ``(info.key, info.part_index)``. Memory, in an all-reduce: one
    float32 copy of each tensor for this peer's contributions, and one more once it has owned a part
    (the residual of its averages), allocated on first use.
    Compressing without ``info`` uses the key None: all such tensors share one residual, which suits
    one tensor compressed repeatedly; pass ``CompressionInfo(key=...)`` to keep several apart.
    If the shape, dtype or device of a key's tensor changes, its residual is dropped with a warning.
    Non-floating tensors pass through to the inner codec without error feedback.

    Non-finite values never enter a residual: where the corrected input or its decoded value is NaN or
    Inf (or their difference overflows), the residual is set to zero, so a NaN step is sent as the inner
    codec sends it (carried, or raised as :class:`~hivemind_ext.errors.NonFiniteTensorError`) and later
    steps are unaffected. If the inner codec raises, the residual is left as it was before the call.
    Float16/bfloat16 values that ``x + residual`` pushes beyond the dtype's range are clamped to its
    largest finite value; only sums beyond float32's (float64's) own range, near 3.4e38, become Inf.

    Thread-safe: concurrent calls for one key are serialised, calls for different keys run in parallel.
    """

    def __init__(self, codec: Codec):
        try:
            self.codec = as_codec(codec)
        except ConfigurationError as e:
            raise ConfigurationError(f"ErrorFeedback(codec=...): {e}") from None
        self._lock = threading.Lock()  # guards _slots (the dict, not the residuals)
        self._slots: dict[tuple[Hashable, Hashable], _Slot] = {}

    def check_tensor(self, tensor: Any) -> None:
        self.codec.check_tensor(tensor)

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> CompressedTensor:
        """Compresses ``tensor`` plus its key's residual and updates the residual; payload in host memory."""
        return self.encode(tensor, info, allow_inplace).to_host()

    def encode(
        self, tensor: torch.Tensor, info: CompressionInfo | None = None, allow_inplace: bool = False
    ) -> CompressedTensor:
        """Like :meth:`compress`, but the payload stays on the tensor's device.

        ``tensor`` is never modified (``allow_inplace`` is accepted for interface compatibility).
        """
        self.codec.check_tensor(tensor)
        if not tensor.is_floating_point():
            return self.codec.encode(tensor, info, allow_inplace)
        slot = self._slot(_slot_key(info))
        with slot.lock:
            return self._encode_with_feedback(tensor.detach(), info, slot)

    def _encode_with_feedback(self, x: torch.Tensor, info: CompressionInfo | None, slot: _Slot) -> CompressedTensor:
        work_dtype = torch.promote_types(x.dtype, torch.float32)
        location = _location(info, x)  # (tensor numel, part offset), or None: one residual per part
        residual = self._usable_residual(x, info, slot, location)  # [x.shape] work_dtype, or None
        corrected = x.to(work_dtype, copy=True) if residual is None else x + residual  # [x.shape], work_dtype
        # the same tensor for float32/float64 inputs; half inputs near their largest value plus a residual
        # must not overflow to Inf when cast back, so finite values are clamped to the dtype's range
        to_send = to_half_clamped(corrected, x.dtype) if x.dtype in HALF_DTYPES else corrected.to(x.dtype)
        # a half-precision to_send is a temporary of ours: the codec may reuse it; `corrected` is needed below
        message = self.codec.encode(to_send, info, allow_inplace=to_send is not corrected)
        decoded = decompress(message, device=x.device)  # while the payload is still on the device
        if _shares_storage(message.payload, corrected) or _shares_storage(decoded, corrected):
            new_residual = corrected - decoded  # e.g. NoCompression: the payload is `corrected` itself
        else:
            new_residual = corrected.sub_(decoded)
        # NaN / Inf at a position (in the input, the decoded value, or an overflowing difference): drop its error
        new_residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        if location is None:
            slot.residual, slot.dtype = new_residual, x.dtype
        else:
            numel, offset = location
            if slot.residual is None:
                slot.residual, slot.dtype = torch.zeros(numel, dtype=work_dtype, device=x.device), x.dtype
            slot.residual[offset : offset + x.numel()].copy_(new_residual.view(-1))
        return message

    @staticmethod
    def _usable_residual(
        x: torch.Tensor, info: CompressionInfo | None, slot: _Slot, location: tuple[int, int] | None
    ) -> torch.Tensor | None:
        """The residual to add to ``x`` (a view of the tensor's residual where parts are located), or None;
        a residual of another shape, dtype or device is dropped with a warning."""
        residual = slot.residual
        if residual is None:
            return None
        expected = (location[0],) if location is not None else x.shape
        if residual.shape == expected and residual.device == x.device and slot.dtype == x.dtype:
            return residual if location is None else residual[location[1] : location[1] + x.numel()].view(x.shape)
        warnings.warn(
            f"ErrorFeedback: tensor key {info.key if info else None!r} changed from "
            f"{list(residual.shape)} {slot.dtype} on {residual.device} to {list(expected)} {x.dtype} on {x.device}; "
            f"its residual is dropped",
            RuntimeWarning,
            stacklevel=5,
        )
        slot.residual = slot.dtype = None
        return None

    def _slot(self, key: tuple[Hashable, Hashable]) -> _Slot:
        with self._lock:
            slot = self._slots.get(key)
            if slot is None:
                slot = self._slots[key] = _Slot()
            return slot

    def residual(self, key: Key = None, part_index: int = 0) -> torch.Tensor | None:
        """The current residual of a tensor key (and part), or None if it has none."""
        return self._residual_of(_slot_key(CompressionInfo(key=key, part_index=part_index)))

    def tensor_residual(self, key: Key, *, aggregate: bool = False) -> torch.Tensor | None:
        """The residual of a whole tensor whose parts were compressed with ``info.part_offset`` (flattened;
        ``aggregate``: of the averages this peer sent back as an all-reduce owner), or None."""
        return self._residual_of(_slot_key(CompressionInfo(key=key, part_offset=0, aggregate=aggregate)))

    def _residual_of(self, slot_key: tuple[Hashable, Hashable]) -> torch.Tensor | None:
        with self._lock:
            slot = self._slots.get(slot_key)
        if slot is None:
            return None
        with slot.lock:
            return slot.residual

    def set_residual(self, key: Key, residual: torch.Tensor, *, dtype: torch.dtype, part_index: int = 0) -> None:
        """Sets the residual of a tensor key (and part), e.g. to restore one read with :meth:`residual`.

        ``dtype`` is the dtype of the tensors the residual belongs to; the residual itself must be in
        ``promote_types(dtype, float32)`` and lie on their device, with their shape: otherwise the next
        compression of that key drops it with a warning. The residual is copied.
        """
        if not dtype.is_floating_point:
            raise ConfigurationError(
                f"ErrorFeedback.set_residual: {dtype} tensors have no residual (they pass through)"
            )
        work_dtype = torch.promote_types(dtype, torch.float32)
        if residual.dtype != work_dtype:
            raise ConfigurationError(
                f"ErrorFeedback.set_residual: a residual of {dtype} tensors must be {work_dtype}, got {residual.dtype}"
            )
        slot = self._slot(_slot_key(CompressionInfo(key=key, part_index=part_index)))
        with slot.lock:
            slot.residual, slot.dtype = residual.detach().clone(), dtype

    def reset(self, key: Key = None) -> None:
        """Drops the residuals of ``key`` (all its parts), or of every key if ``key`` is None.

        Residuals of tensors compressed without ``info`` (key None) are dropped by ``reset()``.
        """
        with self._lock:
            slots = [slot for (slot_key, _), slot in self._slots.items() if key is None or slot_key == key]
        for slot in slots:
            with slot.lock:
                slot.residual = slot.dtype = None

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.codec.estimate_compression_ratio(info)

    def snapshot(self, keys: Collection[Hashable] | None = None) -> Snapshot:
        """Copies of all residuals (with ``keys``: of those tensor keys only), for :meth:`restore`.

        For algorithms that send the same values again after a round failed: DiLoCo retries with
        ``anchor - params``, which still holds the failed round's pseudo-gradient. Compressing it on top of
        the residuals that round left behind would count the part of it the failed messages "sent" twice
        (for a sparse codec, nearly all of it); restoring the snapshot taken before the round avoids that.
        """
        return self._residuals(copy=True, keys=keys)

    def restore(self, snapshot: Snapshot, keys: Collection[Hashable] | None = None) -> None:
        """Puts back the residuals of a :meth:`snapshot` (copied); residuals made since are dropped. With
        ``keys``, only those tensor keys' residuals change (another key's round may be in flight meanwhile,
        e.g. another fragment's in streaming DiLoCo). Call it while no compression of these keys is in flight."""
        with self._lock:
            for key in snapshot.keys() - self._slots.keys():
                if keys is None or key[0] in keys:
                    self._slots[key] = _Slot()
            slots = [(key, slot) for key, slot in self._slots.items() if keys is None or key[0] in keys]
        for key, slot in slots:
            with slot.lock:
                residual, dtype = snapshot.get(key, (None, None))
                slot.residual, slot.dtype = (None if residual is None else residual.clone()), dtype

    def _residuals(self, *, copy: bool, keys: Collection[Hashable] | None = None) -> Snapshot:
        with self._lock:
            slots = [(key, slot) for key, slot in self._slots.items() if keys is None or key[0] in keys]
        residuals = {}
        for key, slot in slots:
            with slot.lock:
                if slot.residual is not None:
                    residuals[key] = (slot.residual.clone() if copy else slot.residual, slot.dtype)
        return residuals

    def __getstate__(self) -> dict[str, Any]:
        """Pickles the codec and a snapshot of the residuals (locks are not picklable, and not shared)."""
        return {"codec": self.codec, "residuals": self._residuals(copy=False)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.codec = state["codec"]
        self._lock = threading.Lock()
        self._slots = {
            key: _Slot(residual=residual, dtype=dtype) for key, (residual, dtype) in state["residuals"].items()
        }


def find_error_feedback(codec: Any, depth: int = 8) -> ErrorFeedback | None:
    """The :class:`ErrorFeedback` that ``codec`` is, or wraps through ``.codec`` (e.g. a codec that
    records or counts what passes), or None: what an algorithm snapshots and restores around a round."""
    for _ in range(depth):
        if isinstance(codec, ErrorFeedback) or codec is None:
            return codec
        codec = getattr(codec, "codec", None)
    return None


def _slot_key(info: CompressionInfo | None) -> tuple[Hashable, Hashable]:
    """(tensor key, which residual of it): a part index, or a whole tensor's (for located parts)."""
    if info is None:
        return (None, 0)
    if not isinstance(info, CompressionInfo):
        raise CompressionError(f"info must be a CompressionInfo or None, got {type(info).__name__}")
    try:
        hash(info.key)
    except TypeError:
        raise CompressionError(f"ErrorFeedback needs hashable tensor keys, got {info.key!r:.100}") from None
    if info.part_offset is not None:
        return (info.key, ("tensor", bool(info.aggregate)))
    return (info.key, ("aggregate", info.part_index) if info.aggregate else info.part_index)


def _location(info: CompressionInfo | None, x: torch.Tensor) -> tuple[int, int] | None:
    """(numel of the whole tensor, offset of x in it) where info locates the part x, else None."""
    if info is None or info.part_offset is None:
        return None
    numel, offset = info.numel(), info.part_offset
    if type(offset) is not int or not 0 <= offset <= numel - x.numel():
        raise CompressionError(
            f"ErrorFeedback: a part of {x.numel()} values at offset {offset!r} does not fit its tensor of {numel}"
        )
    return numel, offset


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


__all__ = ["ErrorFeedback", "find_error_feedback"]
