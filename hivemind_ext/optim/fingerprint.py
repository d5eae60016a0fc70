"""The run fingerprint: what must be the same on every peer of one run, so that they can average.

A fingerprint is a few named fields, each a short canonical string: the model's tensors (names,
shapes, dtypes), ``target_batch_size``, the wrapped optimizer, the codecs, the algorithm and its
hyperparameters. Every peer publishes its fields in its progress record (see
:mod:`hivemind_ext.optim.progress`), and its :attr:`RunFingerprint.digest` in its matchmaking
declarations, where peers of another digest are never grouped with it. A peer that knows only some
fields (an auxiliary peer has no model and no codecs) leaves the others out; a field compares only
where both sides have it (:meth:`RunFingerprint.compatible`).

Which side is "the swarm" is :func:`swarm_fingerprint`: among the complete fingerprints of the live
peers, the one whose peers reached the highest epoch (the run they have been training), then the one
most peers share. A lone first peer therefore defines the run, and a newcomer that differs from it
is told so (:meth:`RunFingerprint.difference`) with :class:`~hivemind_ext.errors.RunMismatchError`.

Everything here is pure and computed once per peer: honest peers compare digests (short strings),
never re-hash tensors.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hivemind_ext.compression import NoCompression
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import ProtocolError

MAX_FIELDS = 32
MAX_FIELD_CHARS = 4096  # a tensor list longer than this is published as its count and digest
MAX_NAME_CHARS = 64
TENSORS = "tensors"
TARGET_BATCH_SIZE = "target_batch_size"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # default reprs hold memory addresses: not stable across processes
_ITEM_SEPARATOR = "; "
_DIGEST_LIST = re.compile(r"(\d+) tensors, sha256 ([0-9a-f]+)")


@dataclass(frozen=True)
class RunFingerprint:
    """The fields of one peer's run (sorted by name); ``complete`` is False for a peer that leaves
    fields out on purpose (an auxiliary peer), which then never defines the swarm's fingerprint."""

    fields: tuple[tuple[str, str], ...]
    complete: bool = True
    digest: str = field(init=False, compare=False)

    def __post_init__(self) -> None:
        fields = tuple(sorted((str(k), str(v)) for k, v in self.fields))
        object.__setattr__(self, "fields", fields)
        text = json.dumps([fields, self.complete], separators=(",", ":"))
        object.__setattr__(self, "digest", hashlib.sha256(text.encode()).hexdigest()[:32])

    @classmethod
    def of(cls, fields: Mapping[str, Any], *, complete: bool = True) -> RunFingerprint:
        return cls(tuple((name, str(value)) for name, value in fields.items()), complete)

    def get(self, name: str) -> str | None:
        return dict(self.fields).get(name)

    def compatible(self, other: RunFingerprint) -> bool:
        """Whether every field that both have is equal (a peer may train with the other's swarm)."""
        if self.digest == other.digest:
            return True
        theirs = dict(other.fields)
        return all(theirs.get(name, value) == value for name, value in self.fields)

    def difference(self, swarm: RunFingerprint, run_id: str) -> str | None:
        """None if compatible with ``swarm``, else one line naming the first field that differs."""
        if self.compatible(swarm):
            return None
        theirs = dict(swarm.fields)
        for name, mine in self.fields:
            if name in theirs and theirs[name] != mine:
                if name == TENSORS:
                    return f"{describe_tensor_difference(mine, theirs[name])} (run {run_id!r})"
                return f"{name} {mine} here, {theirs[name]} in the swarm (run {run_id!r})"
        return None  # unreachable: incompatible means some shared field differs

    def to_wire(self) -> dict[str, Any]:
        return {"fields": [list(item) for item in self.fields], "complete": self.complete}

    @classmethod
    def from_wire(cls, value: Any) -> RunFingerprint:
        """Parses what :meth:`to_wire` wrote; raises :class:`ProtocolError` on anything malformed."""
        if not isinstance(value, dict) or not isinstance(value.get("complete"), bool):
            raise ProtocolError("a run fingerprint must be a map with a boolean 'complete'")
        rows = value.get("fields")
        if not isinstance(rows, list) or len(rows) > MAX_FIELDS:
            raise ProtocolError(f"a run fingerprint has a list of at most {MAX_FIELDS} fields")
        fields = []
        for row in rows:
            if not (isinstance(row, list | tuple) and len(row) == 2 and all(isinstance(x, str) for x in row)):
                raise ProtocolError("a fingerprint field is a [name, value] pair of strings")
            if len(row[0]) > MAX_NAME_CHARS or len(row[1]) > MAX_FIELD_CHARS:
                raise ProtocolError("a fingerprint field is too long")
            fields.append((row[0], row[1]))
        if len({name for name, _ in fields}) != len(fields):
            raise ProtocolError("a fingerprint names a field twice")
        return cls(tuple(fields), value["complete"])


def swarm_fingerprint(peers: Iterable[tuple[RunFingerprint | None, int]]) -> RunFingerprint | None:
    """The fingerprint that defines the run among live peers given as ``(fingerprint, epoch)`` (this
    peer included): of the complete ones, the one whose peers reached the highest epoch, then the one
    most peers share, then (for a deterministic choice that every peer makes alike) the smallest
    digest. None if no peer publishes a complete fingerprint."""
    best: dict[str, list[Any]] = {}  # digest -> [max epoch, count, fingerprint]
    for fingerprint, epoch in peers:
        if fingerprint is None or not fingerprint.complete:
            continue
        entry = best.setdefault(fingerprint.digest, [epoch, 0, fingerprint])
        entry[0], entry[1] = max(entry[0], epoch), entry[1] + 1
    if not best:
        return None
    digest = min(best, key=lambda d: (-best[d][0], -best[d][1], d))
    return best[digest][2]


# ----- describing a run


def describe_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """``name: dtype shape`` of each tensor, in order; past :data:`MAX_FIELD_CHARS`, their count and digest."""
    items = [f"{name}: {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}" for name, t in named]
    text = _ITEM_SEPARATOR.join(items)
    if len(text) <= MAX_FIELD_CHARS:
        return text
    return f"{len(items)} tensors, sha256 {hashlib.sha256(text.encode()).hexdigest()[:16]}"


def describe_tensor_difference(mine: str, theirs: str) -> str:
    """The first tensor that differs between two :func:`describe_tensors` texts, in words."""
    if _DIGEST_LIST.fullmatch(mine) or _DIGEST_LIST.fullmatch(theirs):
        return f"the model's tensors differ: {_count(mine)} tensors here, {_count(theirs)} in the swarm"
    my_items, their_items = mine.split(_ITEM_SEPARATOR), theirs.split(_ITEM_SEPARATOR)
    for index, (a, b) in enumerate(zip(my_items, their_items, strict=False)):
        if a != b:
            name, _, spec = a.rpartition(": ")
            their_name, _, their_spec = b.rpartition(": ")
            if name != their_name:
                return f"tensor {index} is {a!r} here, {b!r} in the swarm"
            dtype, _, shape = spec.partition(" ")
            their_dtype, _, their_shape = their_spec.partition(" ")
            if dtype == their_dtype:
                return f"tensor {index} {name!r}: shape {shape} here, {their_shape} in the swarm"
            return f"tensor {index} {name!r}: {dtype} {shape} here, {their_dtype} {their_shape} in the swarm"
    return f"the model has {len(my_items)} tensors here, {len(their_items)} in the swarm"


def _count(text: str) -> str:
    match = _DIGEST_LIST.fullmatch(text)
    return match.group(1) if match else str(len(text.split(_ITEM_SEPARATOR)))


def describe_setting(value: Any) -> str:
    """A stable text for a setting (a codec, an algorithm's hyperparameter): the same on every
    process for equal settings, with no memory addresses."""
    if value is None or isinstance(value, bool | int | float | str):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(describe_setting(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {describe_setting(v)}" for k, v in sorted(value.items(), key=str)) + "}"
    return _ADDRESS.sub("", repr(value))


def describe_codec(codec: Any) -> str:
    """A codec as the swarm must agree on it (None and hivemind's codecs resolved to ours)."""
    return describe_setting(as_codec(codec if codec is not None else NoCompression()))


def describe_algorithm(algorithm: Any) -> str:
    """The algorithm's class and its hyperparameters: its public attributes, except callables (such as
    optimizer factories, which cannot be compared across processes)."""
    params = {
        name: value
        for name, value in sorted(getattr(algorithm, "__dict__", {}).items())
        if not name.startswith("_") and not callable(value)
    }
    inner = ", ".join(f"{name}={describe_setting(value)}" for name, value in params.items())
    return f"{type(algorithm).__name__}({inner})"


def trainer_fingerprint(
    state: Any,
    *,
    target_batch_size: int,
    grad_compression: Any,
    state_averaging_compression: Any,
    algorithm: Any,
    use_local_updates: bool,
    average_state_every: int,
    grad_averaging_hops: int | str = 1,
) -> RunFingerprint:
    """A training peer's fingerprint: everything that must match for it to average with the swarm.
    ``state`` is its :class:`~hivemind_ext.optim.training_state.TrainingState` (the model's parameters,
    the extra tensors, the wrapped optimizer and the averaged statistics)."""
    named_tensors = [
        *((f"parameter {i}", p) for i, p in enumerate(state.main_params)),
        *((f"extra tensor {i}", t) for i, t in enumerate(state.extra_tensors)),
    ]
    optimizer_cls = type(state.optimizer)
    return RunFingerprint.of(
        {
            TENSORS: describe_tensors(named_tensors),
            TARGET_BATCH_SIZE: target_batch_size,
            "optimizer": f"{optimizer_cls.__module__}.{optimizer_cls.__qualname__}",
            "grad_compression": describe_codec(grad_compression),
            "state_averaging_compression": describe_codec(state_averaging_compression),
            "algorithm": describe_algorithm(algorithm),
            "use_local_updates": use_local_updates,
            "average_state_every": average_state_every,
            # peers that average in different numbers of hops would meet on boards the others never read
            "grad_averaging_hops": describe_setting(grad_averaging_hops),
            "average_opt_statistics": describe_setting(sorted(state.average_opt_statistics)),
        }
    )


def auxiliary_fingerprint(target_batch_size: int) -> RunFingerprint:
    """An auxiliary peer's: it has no model and no codecs, only the swarm's target batch size."""
    return RunFingerprint.of({TARGET_BATCH_SIZE: target_batch_size}, complete=False)


__all__ = [
    "RunFingerprint",
    "auxiliary_fingerprint",
    "describe_algorithm",
    "describe_codec",
    "describe_setting",
    "describe_tensor_difference",
    "describe_tensors",
    "swarm_fingerprint",
    "trainer_fingerprint",
]
