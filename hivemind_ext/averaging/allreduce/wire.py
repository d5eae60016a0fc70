"""The all-reduce wire protocol: the messages on one (sender, owner) stream, built and parsed here.

One streaming call per (sender, owner) pair, handler ``"allreduce"`` of the averager's namespace
(see :mod:`hivemind_ext.p2p.framing` for frames). The sender is the caller; the owner serves. Both
directions flow at once: the owner streams each chunk of the average back as soon as every sender
still in the part has delivered that chunk, while later chunks are still arriving::

    sender -> owner:  JOIN, CHUNK x n, END
    owner  -> sender: RESULT, AVERAGE x n, END     (RESULT once every sender joined or was excluded)
                  or  REFUSED, END                 (at any time: the sender is not / no longer in the part)

    JOIN     header {"v": 2, "group": bytes, "layout": bytes[16], "weight": float}
             payload msgpack {"gather": bin (the sender's packed gather data), "tensors": [[shape, dtype], ...]}
    CHUNK    header {"tensor": CompressedTensor header, "i": chunk index within the part}, payload: its bytes
    RESULT   header {"contributors": [base58 peer id, ...], "chunks": n}
             payload msgpack {base58 peer id: bin gather data} (every gather the owner holds, its own included)
    AVERAGE  header {"tensor": ..., "i": chunk index, "from": [position in RESULT's contributors, ...]}
             payload: the averaged chunk's bytes
    REFUSED  header {"refused": reason}

RESULT's ``contributors`` are the senders in the part when its first chunk was averaged (for a part
without chunks, those that joined); each AVERAGE says, by strictly increasing positions in that
list, whose values are in that chunk: a sender that drops out mid-part stays in the chunks averaged
before, and is missing from the later ones. Averaged chunks come in order.

The sender's identity is the stream's authenticated libp2p peer id, never a header field. The
owner checks ``layout`` against its own layout fingerprint (peers that disagree on shapes, dtypes,
part sizes or chunk size are refused at once); an owner with no tensors of its own (auxiliary)
builds its layout from ``tensors`` and then checks the fingerprint. Gather data is relayed as the
bytes its author packed, so the owner never re-encodes (or can alter the meaning of) a peer's data.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from hivemind_ext.averaging.allreduce.layout import FINGERPRINT_BYTES
from hivemind_ext.averaging.tensor_layout import TensorSpec, encode_tensor_list, parse_tensor_list
from hivemind_ext.compression import CompressedTensor
from hivemind_ext.errors import CompressionError, ConfigurationError, ProtocolError
from hivemind_ext.p2p import Message, pack_tensor, unpack_tensor

PROTOCOL_VERSION = 2  # 2: averaged chunks stream back with their own contributor lists
HANDLER_NAME = "allreduce"
MAX_GROUP_ID_BYTES = 256
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Join:
    """A sender's first message to an owner."""

    group_id: bytes
    fingerprint: bytes
    weight: float
    gather: bytes  # packed by the sender
    tensors: list[TensorSpec]


@dataclass(frozen=True)
class ResultHead:
    """The owner's first message after reducing: who contributed, how many chunks follow, who gathered what."""

    contributors: tuple[str, ...]
    num_chunks: int
    gathered: dict[str, bytes]


def pack_gather(gather: Any, max_bytes: int) -> bytes:
    """The caller's gather data as msgpack bytes (checked once, before the round starts)."""
    try:
        packed = msgpack.packb(gather, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ConfigurationError(f"gather must be msgpack-serializable: {e}") from e
    if len(packed) > max_bytes:
        raise ConfigurationError(f"gather data takes {len(packed)} bytes packed, the limit is {max_bytes}")
    return packed


def unpack_gather(packed: bytes) -> Any:
    """A peer's gather data; raises ProtocolError if it is not valid msgpack."""
    try:
        return msgpack.unpackb(packed, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as e:  # msgpack raises many unrelated types on malformed input
        raise ProtocolError(f"gather data is not valid msgpack: {type(e).__name__}") from None


def join_message(
    group_id: bytes, fingerprint: bytes, weight: float, gather: bytes, tensors: list[TensorSpec]
) -> Message:
    header = {"v": PROTOCOL_VERSION, "group": group_id, "layout": fingerprint, "weight": weight}
    body = msgpack.packb({"gather": gather, "tensors": encode_tensor_list(tensors)}, use_bin_type=True)
    return Message(header, body)


def parse_group_id(message: Message) -> bytes:
    """The group id of a JOIN, read first so that the stream can be routed to its round (which
    validates the rest, so that a member whose JOIN is invalid is excluded at once)."""
    group_id = message.header.get("group")
    if not isinstance(group_id, bytes) or not 0 < len(group_id) <= MAX_GROUP_ID_BYTES:
        raise ProtocolError("JOIN needs a 'group' id of 1..256 bytes")
    return group_id


def parse_join(message: Message, max_gather_bytes: int) -> Join:
    if message.header.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported all-reduce protocol version {message.header.get('v')!r:.20}")
    group_id = parse_group_id(message)
    fingerprint, weight = message.header.get("layout"), message.header.get("weight")
    if not isinstance(fingerprint, bytes) or len(fingerprint) != FINGERPRINT_BYTES:
        raise ProtocolError(f"JOIN needs a 'layout' fingerprint of {FINGERPRINT_BYTES} bytes")
    if type(weight) not in (int, float) or not 0 <= weight < math.inf:
        raise ProtocolError(f"JOIN declares weight {weight!r:.50}, expected a finite non-negative number")
    body = _unpack_map(message.payload, "JOIN")
    gather, tensors = body.get("gather"), body.get("tensors")
    if not isinstance(gather, bytes) or len(gather) > max_gather_bytes:
        raise ProtocolError(f"JOIN needs 'gather' bytes (at most {max_gather_bytes})")
    return Join(group_id, fingerprint, float(weight), gather, parse_tensor_list(tensors, floats_only=True))


def chunk_message(message: CompressedTensor, index: int) -> Message:
    return pack_tensor(message, i=index)


def parse_chunk(message: Message) -> tuple[int, CompressedTensor]:
    """(chunk index, compressed chunk) from a CHUNK; the tensor is validated when decoded."""
    index = message.header.get("i")
    if type(index) is not int:
        raise ProtocolError(f"CHUNK needs an integer index 'i', got {index!r:.30}")
    try:
        return index, unpack_tensor(message, CompressedTensor)
    except CompressionError as e:
        raise ProtocolError(f"malformed chunk {index}: {e}") from e


def average_message(message: CompressedTensor, index: int, positions: list[int]) -> Message:
    """Chunk ``index`` of the average; ``positions``: its contributors, as positions in RESULT's list."""
    return pack_tensor(message, i=index, **{"from": positions})


def parse_average(message: Message, head: ResultHead, expected_index: int) -> tuple[CompressedTensor, tuple[str, ...]]:
    """(averaged chunk, its contributors) from an AVERAGE that must be chunk ``expected_index``; a
    REFUSED message raises ProtocolError with the owner's reason."""
    _raise_if_refused(message)
    index, compressed = parse_chunk(message)
    if index != expected_index:
        raise ProtocolError(f"expected averaged chunk {expected_index}, got {index}")
    positions = message.header.get("from")
    if not isinstance(positions, list) or not all(type(p) is int for p in positions):
        raise ProtocolError(f"averaged chunk {index} needs 'from': a list of contributor positions")
    in_range = all(0 <= p < len(head.contributors) for p in positions)
    if not in_range or any(a >= b for a, b in itertools.pairwise(positions)):
        raise ProtocolError(
            f"averaged chunk {index} lists contributor positions unsorted, twice or outside "
            f"0..{len(head.contributors) - 1}"
        )
    return compressed, tuple(head.contributors[p] for p in positions)


def result_message(contributors: list[str], num_chunks: int, gathered: Mapping[str, bytes]) -> Message:
    body = msgpack.packb(dict(gathered), use_bin_type=True)
    return Message({"contributors": contributors, "chunks": num_chunks}, body)


def refusal_message(reason: str) -> Message:
    return Message({"refused": reason[:MAX_REASON_CHARS]})


def parse_result_head(message: Message, members: frozenset[str]) -> ResultHead:
    """The owner's RESULT; a REFUSED message raises ProtocolError with the owner's reason."""
    _raise_if_refused(message)
    header = message.header
    contributors, num_chunks = header.get("contributors"), header.get("chunks")
    if not isinstance(contributors, list) or not all(isinstance(c, str) and c in members for c in contributors):
        raise ProtocolError("RESULT needs 'contributors': a list of members of the group")
    if len(set(contributors)) != len(contributors):
        raise ProtocolError("RESULT lists a contributor twice")
    if type(num_chunks) is not int or num_chunks < 0:
        raise ProtocolError(f"RESULT needs a chunk count, got {num_chunks!r:.30}")
    gathered = _unpack_map(message.payload, "RESULT")
    if not all(
        isinstance(peer, str) and peer in members and isinstance(data, bytes) for peer, data in gathered.items()
    ):
        raise ProtocolError("RESULT gathered data must map members of the group to bytes")
    return ResultHead(tuple(contributors), num_chunks, gathered)


def _raise_if_refused(message: Message) -> None:
    if "refused" in message.header:
        reason = message.header["refused"]
        raise ProtocolError(f"refused: {reason[:MAX_REASON_CHARS] if isinstance(reason, str) else '?'}")


def _unpack_map(payload: Any, what: str) -> dict[Any, Any]:
    try:
        body = msgpack.unpackb(bytes(payload or b""), raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:  # msgpack raises many unrelated types on malformed input
        raise ProtocolError(f"{what} payload is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"{what} payload must be a msgpack map")
    return body
