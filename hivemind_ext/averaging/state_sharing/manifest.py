"""The state-download wire format: messages, the manifest, chunk digests, and their strict parsing.

One download is one streaming call to the donor's ``load_state`` handler (namespace
``<prefix>.state``, see :mod:`hivemind_ext.p2p` for frames)::

    newcomer -> {"op": "manifest", "format": 1}
    donor    -> {"status": "ok", "manifest_sha256": <32 bytes>} + payload: the manifest (msgpack)
             |  {"status": "busy" | "refused" | "rejected", "reason": str}, then END
    newcomer -> {"op": "chunks", "snapshot": <id>, "indices": [i, ...]}       (any number of times)
    donor    -> {"chunk": i, "tensor": <compressed tensor header>} + payload   (one per index, in order)
    newcomer -> END                                                           donor -> END

The manifest (msgpack map, format 2) describes one snapshot::

    {"format": 2, "version": int, "snapshot": str, "metadata": bin (msgpack of the user's metadata),
     "tensors": [[[dims...], dtype name], ...],
     "chunks": [[tensor index, start, end, payload bytes, sha256], ...]}

The tensor list and the chunks are those of the layout the all-reduce uses too
(:mod:`hivemind_ext.averaging.tensor_layout`: same specs, same encoding and parsing of the tensor
list, same chunker). Format 2 is format 1 with each tensor entry in that shared order. Chunks are
element ranges of the flattened tensors; they tile every tensor in order (a tensor with no
elements has no chunk). A chunk's digest is the SHA-256 of its compressed tensor header (as
:meth:`CompressedTensor.header_bytes` writes it, so codec parameters are covered) followed by its
payload. The manifest's own digest travels in the response header. A newcomer checks every field
before it allocates anything, and every chunk against the manifest of the donor that sent it:
donors of the same version need not hold bitwise-identical states, only the same layout.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from hivemind_ext.averaging.tensor_layout import (
    ChunkSpec,
    TensorSpec,
    encode_tensor_list,
    parse_tensor_list,
    tensor_offsets,
)
from hivemind_ext.compression import CompressedTensor
from hivemind_ext.errors import CompressionError, ProtocolError

FORMAT = 2
DIGEST_BYTES = 32  # SHA-256: the fastest of hashlib's strong digests on CPUs with SHA extensions
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_METADATA_BYTES = 32 * 1024 * 1024
MAX_CHUNKS = 1 << 21
MAX_CHUNK_PAYLOAD_BYTES = 256 * 1024 * 1024
MAX_INDICES_PER_REQUEST = 4096
MAX_REASON_CHARS = 500
_SNAPSHOT_ID = re.compile(r"[0-9a-f]{16,64}")


class CorruptStateError(ProtocolError):
    """A donor's manifest or chunk failed validation: bad digest, wrong size, shape or dtype, or missing chunks."""


@dataclass(frozen=True)
class ManifestChunk(ChunkSpec):
    """A chunk of the shared layout, and its compressed payload as the donor encoded it: ``nbytes``
    bytes whose :func:`chunk_digest` is ``digest``."""

    nbytes: int
    digest: bytes

    @classmethod
    def of(cls, chunk: ChunkSpec, nbytes: int, digest: bytes) -> ManifestChunk:
        return cls(chunk.tensor, chunk.start, chunk.end, chunk.piece, chunk.offset, nbytes, digest)


@dataclass(frozen=True, eq=False)
class Manifest:
    version: int
    snapshot: str
    metadata: Any
    tensors: tuple[TensorSpec, ...]
    chunks: tuple[ManifestChunk, ...]
    #: SHA-256 of everything in the manifest but the snapshot id (version, metadata, tensors, chunk
    #: ranges, sizes and digests): two donors with the same content digest serve bitwise the same
    #: state, since every chunk is checked against its digest (empty when not parsed from the wire)
    content_digest: bytes = b""

    def layout(self) -> tuple[Any, ...]:
        """What must match for chunks of two donors to be combined: version, tensors and chunk ranges."""
        return self.version, self.tensors, tuple((c.tensor, c.start, c.end) for c in self.chunks)

    def raw_chunk_bytes(self, index: int) -> int:
        """Bytes of chunk ``index`` once decoded (what it costs the newcomer, whatever the codec)."""
        chunk = self.chunks[index]
        return chunk.numel * self.tensors[chunk.tensor].dtype.itemsize


# ----- chunk digests (donor and newcomer)


def chunk_digest(chunk: CompressedTensor) -> bytes:
    digest = hashlib.sha256(chunk.header_bytes())
    digest.update(chunk.payload_view())
    return digest.digest()


def manifest_digest(payload: bytes | bytearray | memoryview) -> bytes:
    return hashlib.sha256(payload).digest()


# ----- the manifest


def encode_manifest(manifest: Manifest, packed_metadata: bytes) -> bytes:
    return msgpack.packb(
        {
            "format": FORMAT,
            "version": manifest.version,
            "snapshot": manifest.snapshot,
            "metadata": packed_metadata,
            "tensors": encode_tensor_list(manifest.tensors),
            "chunks": [[c.tensor, c.start, c.end, c.nbytes, c.digest] for c in manifest.chunks],
        },
        use_bin_type=True,
    )


def pack_metadata(metadata: Any) -> bytes:
    try:
        packed = msgpack.packb(metadata, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise ProtocolError(f"state metadata is not msgpack-serializable: {e}") from e
    if len(packed) > MAX_METADATA_BYTES:
        raise ProtocolError(f"state metadata of {len(packed)} bytes exceeds {MAX_METADATA_BYTES}")
    return packed


def parse_manifest(payload: bytes | bytearray, declared_digest: Any, *, max_state_bytes: int) -> Manifest:
    """The manifest a donor sent, fully validated; raises :class:`CorruptStateError` otherwise."""
    if len(payload) > MAX_MANIFEST_BYTES:
        raise CorruptStateError(f"manifest of {len(payload)} bytes exceeds {MAX_MANIFEST_BYTES}")
    if not isinstance(declared_digest, bytes) or manifest_digest(payload) != declared_digest:
        raise CorruptStateError("manifest digest mismatch")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:  # msgpack raises several unrelated types on malformed input
        raise CorruptStateError(f"manifest is not valid msgpack: {type(e).__name__}") from None
    expected_keys = {"format", "version", "snapshot", "metadata", "tensors", "chunks"}
    if not isinstance(raw, dict) or set(raw) != expected_keys:
        raise CorruptStateError(f"manifest must be a map with keys {sorted(expected_keys)}")
    if raw["format"] != FORMAT:
        raise CorruptStateError(f"unsupported manifest format {raw['format']!r:.20} (this peer reads {FORMAT})")
    version = _int_in(raw["version"], 0, 2**63 - 1, "version")
    snapshot = raw["snapshot"]
    if not isinstance(snapshot, str) or not _SNAPSHOT_ID.fullmatch(snapshot):
        raise CorruptStateError(f"malformed snapshot id {snapshot!r:.80}")
    tensors = _parse_tensors(raw["tensors"], max_state_bytes)
    chunks = _parse_chunks(raw["chunks"], tensors)
    metadata = _unpack_metadata(raw["metadata"])
    return Manifest(version, snapshot, metadata, tensors, chunks, content_digest(raw))


def content_digest(raw: Mapping[str, Any]) -> bytes:
    """The digest of a parsed manifest's content: its fields but the snapshot id (a random label),
    packed again in a fixed order."""
    content = [raw["format"], raw["version"], raw["metadata"], raw["tensors"], raw["chunks"]]
    return hashlib.sha256(msgpack.packb(content, use_bin_type=True)).digest()


def _parse_tensors(rows: Any, max_state_bytes: int) -> tuple[TensorSpec, ...]:
    try:
        return tuple(parse_tensor_list(rows, max_total_bytes=max_state_bytes))
    except ProtocolError as e:
        raise CorruptStateError(f"manifest tensors: {e}") from None


def _parse_chunks(rows: Any, tensors: Sequence[TensorSpec]) -> tuple[ManifestChunk, ...]:
    """Chunks, checked to tile every tensor in order: each starts where the previous one of its
    tensor stopped, and the last one stops at the tensor's end."""
    if not isinstance(rows, list) or len(rows) > MAX_CHUNKS:
        raise CorruptStateError(f"chunks must be a list of at most {MAX_CHUNKS} entries")
    chunks: list[ManifestChunk] = []
    offsets = tensor_offsets(tensors)
    tensor, position, piece = 0, 0, 0  # the next chunk must cover element `position` of tensor `tensor`
    for row in rows:
        if not isinstance(row, list) or len(row) != 5:
            raise CorruptStateError(f"a chunk entry must have 5 fields, got {row!r:.80}")
        while tensor < len(tensors) and position == tensors[tensor].numel:
            tensor, position, piece = tensor + 1, 0, 0  # skip finished (and empty) tensors
        if tensor == len(tensors) or not (type(row[0]) is type(row[1]) is int and row[:2] == [tensor, position]):
            raise CorruptStateError(
                f"chunks do not tile the tensors: got {row[:3]!r:.80}, expected [{tensor}, {position}, ...]"
            )
        end = _int_in(row[2], position + 1, tensors[tensor].numel, "chunk end")
        nbytes = _int_in(row[3], 0, MAX_CHUNK_PAYLOAD_BYTES, "chunk size")
        digest = row[4]
        if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
            raise CorruptStateError("a chunk digest must be 32 bytes")
        chunks.append(ManifestChunk(tensor, position, end, piece, offsets[tensor] + position, nbytes, digest))
        position, piece = end, piece + 1
    while tensor < len(tensors) and position == tensors[tensor].numel:
        tensor, position = tensor + 1, 0
    if tensor != len(tensors):
        raise CorruptStateError(f"chunks end before tensor {tensor} is covered")
    return tuple(chunks)


def _unpack_metadata(packed: Any) -> Any:
    if not isinstance(packed, bytes) or len(packed) > MAX_METADATA_BYTES:
        raise CorruptStateError(f"metadata must be at most {MAX_METADATA_BYTES} bytes of msgpack")
    try:
        # non-string keys are allowed (optimizer state dicts use integer keys); ext types are not
        return msgpack.unpackb(packed, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as e:
        raise CorruptStateError(f"metadata is not valid msgpack: {type(e).__name__}") from None


def _int_in(value: Any, low: int, high: int, what: str) -> int:
    if type(value) is not int or not low <= value <= high:
        raise CorruptStateError(f"{what} must be an integer in [{low}, {high}], got {value!r:.40}")
    return value


# ----- requests (newcomer -> donor)


def manifest_request() -> dict[str, Any]:
    return {"op": "manifest", "format": FORMAT}


def chunks_request(snapshot: str, indices: Sequence[int]) -> dict[str, Any]:
    return {"op": "chunks", "snapshot": snapshot, "indices": list(indices)}


def parse_manifest_request(header: Mapping[str, Any]) -> None:
    if header.get("op") != "manifest" or header.get("format") != FORMAT:
        raise ProtocolError(f"expected a format-{FORMAT} manifest request, got {dict(header)!r:.100}")


def parse_chunks_request(header: Mapping[str, Any], snapshot: str, num_chunks: int) -> list[int]:
    """The chunk indices asked for, checked against the snapshot this stream serves."""
    if header.get("op") != "chunks" or header.get("snapshot") != snapshot:
        raise ProtocolError(f"expected a chunks request for snapshot {snapshot}, got {dict(header)!r:.100}")
    indices = header.get("indices")
    if not isinstance(indices, list) or not 1 <= len(indices) <= MAX_INDICES_PER_REQUEST:
        raise ProtocolError(f"indices must be a list of 1 to {MAX_INDICES_PER_REQUEST} chunk indices")
    if not all(type(index) is int and 0 <= index < num_chunks for index in indices):
        raise ProtocolError(f"chunk indices must be integers in [0, {num_chunks})")
    return indices


# ----- responses (donor -> newcomer)


def manifest_response(digest: bytes) -> dict[str, Any]:
    return {"status": "ok", "manifest_sha256": digest}


def refusal_response(status: str, reason: str) -> dict[str, Any]:
    """``busy`` (try another donor; this one may serve later), ``refused`` (not sharing) or
    ``rejected`` (the request was malformed)."""
    return {"status": status, "reason": reason[:MAX_REASON_CHARS]}


def chunk_response(index: int, tensor_header: Mapping[str, Any]) -> dict[str, Any]:
    return {"chunk": index, "tensor": tensor_header}


def check_chunk(
    manifest: Manifest, donor_chunk: ManifestChunk, index: int, header: Mapping[str, Any], payload: Any
) -> CompressedTensor:
    """The compressed chunk a donor sent for ``index``, after checking it against that donor's manifest."""
    if header.get("chunk") != index:
        raise CorruptStateError(f"expected chunk {index}, got {header.get('chunk')!r:.40}")
    tensor_header = header.get("tensor")
    if not isinstance(tensor_header, Mapping):
        raise CorruptStateError(f"chunk {index} has no tensor header")
    try:
        chunk = CompressedTensor.from_wire(tensor_header, payload if payload is not None else b"")
    except CompressionError as e:
        raise CorruptStateError(f"chunk {index}: {e}") from None
    spec = manifest.tensors[donor_chunk.tensor]
    if chunk.dtype != spec.dtype or chunk.shape != (donor_chunk.numel,):
        raise CorruptStateError(
            f"chunk {index} is {chunk.dtype} {list(chunk.shape)}, the manifest says {spec.dtype} [{donor_chunk.numel}]"
        )
    if chunk.payload.numel() != donor_chunk.nbytes:
        raise CorruptStateError(
            f"chunk {index} has {chunk.payload.numel()} payload bytes, expected {donor_chunk.nbytes}"
        )
    if chunk_digest(chunk) != donor_chunk.digest:
        raise CorruptStateError(f"chunk {index} digest mismatch")
    return chunk
