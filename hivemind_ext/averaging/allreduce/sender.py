"""The sender's side of a round: this member's slice of one part to its owner, the average back.

One stream per owner, all owners at once. On each, a background task sends JOIN and the chunks
(with ``offload_codecs``, chunk i + 1 is compressed in a worker thread while chunk i is written),
while the calling task waits for the owner's RESULT and decodes each averaged chunk straight into
the output tensors as it arrives (the owner sends each averaged chunk as soon as every sender
still in the part has delivered it, so averages come back while this member is still sending). A
NoCompression chunk is written from the caller's tensor itself: no copy is made on the way out.
Every wait ends by the round's deadline, and writes must also keep moving: a stream on which no
byte of ours moves for ``next_chunk_timeout`` is given up (a slow link that keeps moving is not).
The averaged chunks depend on the part's slowest sender, so only the round's deadline bounds the
wait for each of them. Each one says whose values are in it; the part's contributors are the
senders in every chunk.

A sender also stays at most :data:`MAX_LEAD_CHUNKS` chunks ahead of the averages its owner has sent
back (:class:`Lead`). Running further ahead gains nothing: the owner averages chunk i only once its
slowest sender has delivered it. It costs link time wherever a link is shared: measured on the
``nat`` case of ``benchmarks/wan.py`` (3 public peers and a client-mode peer that owns no part, all
at 100 Mbit/s), the client, which has 16.8 MB to send against the owners' 28, sent its whole slice in the
first 1.4 s of a 2.7 s round, taking a third of every owner's downlink, so the owners' slices to each
other (and so every average) came in slower and the owners' uplinks ran at ~80% for that half of the
round and their downlinks at ~80% for the other. The pacing is only an optimization, never a wait
that changes who is averaged: each wait for an average ends after half the idle window (an owner cuts
a stream that moves nothing for the whole window) and pacing stops for good then, and it stops at
half-way to the collect deadline (where an owner averages whatever has arrived), leaving a sender
held back by a slow one the other half to deliver the rest.

Whatever goes wrong with the owner (it is unreachable, refuses, stalls, breaks the protocol or
sends an invalid average), the part keeps this member's own values and the outcome says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.api import PartOutcome
from hivemind_ext.averaging.allreduce.layout import RoundLayout
from hivemind_ext.averaging.allreduce.paths import direct_path_pays
from hivemind_ext.averaging.allreduce.reducer import all_finite
from hivemind_ext.averaging.allreduce.round_state import RoundContext
from hivemind_ext.averaging.allreduce.wire import (
    HANDLER_NAME,
    chunk_message,
    join_message,
    parse_average,
    parse_result_head,
)
from hivemind_ext.averaging.tensor_layout import ChunkSpec
from hivemind_ext.compression import (
    BFloat16Compression,
    CompressedTensor,
    Float16Compression,
    Float16OrMinMax16,
    NoCompression,
    decompress,
    decompress_into,
)
from hivemind_ext.errors import (
    AllreduceError,
    CompressionError,
    DeadlineExceededError,
    HivemindExtError,
    ProtocolError,
)
from hivemind_ext.p2p import ClientStream, Message, RPCClient, TaskOwner, now, wait_until

logger = logging.getLogger(__name__)

READ_ONLY_CODECS = (NoCompression, Float16Compression, Float16OrMinMax16, BFloat16Compression)
# How many chunks a sender may send beyond the averages it has received back from the owner (see the
# module docstring). It must cover the chunks in flight between a sender's write and its average's
# arrival (buffers, the owner's wait for its other senders, the average's way back), or the sender
# would idle on a link it could fill. Measured on benchmarks/wan.py's nat:none (16 MiB per peer,
# 128-192 KiB chunks, 43 per part; alternating runs of 3 rounds, load ~2): medians 1.21-1.26x of
# t_opt unpaced, 1.18-1.20x at 8 chunks, 1.16-1.19x at 6, 1.12-1.17x at 4, 1.12-1.18x at 3, and at 2
# (2.48-2.77 s rounds) the owners' links idle waiting for chunks. With 4, 20:8bit (64 KiB chunks)
# went from 1.27-1.30x to 1.11-1.13x and hetero:none from 1.17-1.19x to 1.10x; 100:none (1.13-1.15x)
# and loopback rounds (2 MiB chunks, 8 per part) did not change beyond the noise.
MAX_LEAD_CHUNKS = 4
# how long a sender waits, after the last average, for the owner's END (which makes its connection reusable)
OWNER_END_GRACE = 0.1


class Lead:
    """How far one sender's chunks run ahead of the averages its owner has sent back: the sending
    task waits in :meth:`wait_to_send` until chunk ``index`` is at most ``limit`` chunks ahead; the
    receiving task counts each average with :meth:`averaged`. Each wait ends at ``give_up_after``
    seconds or at ``until`` (loop time), whichever is first; after the first wait that ends so,
    the lead is no longer limited."""

    def __init__(self, limit: int, give_up_after: float, until: float) -> None:
        self.limit, self.give_up_after, self.until = limit, give_up_after, until
        self.received = 0
        self.paced = True
        self._changed = asyncio.Event()

    def averaged(self) -> None:
        self.received += 1
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_to_send(self, index: int) -> None:
        while self.paced and index - self.received >= self.limit:
            deadline = min(now() + self.give_up_after, self.until)
            if deadline <= now():
                self.paced = False
                return
            try:
                await wait_until(self._changed.wait(), deadline, "waiting for the owner's averages")
            except DeadlineExceededError:
                self.paced = False


async def exchange_with_owner(context: RoundContext, client: RPCClient, owner: int) -> PartOutcome:
    """Averages part ``owner`` with its owner; never raises but CancelledError."""
    layout = _layout(context)
    peer, part = context.peers[owner], layout.parts[owner]
    try:
        first, chunks = await _exchange(context, client, owner)
    except Exception as e:  # typed errors from the network and the protocol, or an injected fault
        reason = f"{type(e).__name__}: {e}"
        if not isinstance(e, HivemindExtError):  # not a network or protocol failure: make it visible
            logger.warning(f"exchange with the owner of part {owner} failed: {reason}", exc_info=e)
        context.tensors.keep_local(part)
        context.exclude(peer, f"owner of part {owner}: {reason}")
        return context.not_averaged(part, reason)
    return context.averaged(part, first, chunks)


async def _exchange(
    context: RoundContext, client: RPCClient, owner: int
) -> tuple[tuple[PeerID, ...], list[tuple[PeerID, ...]]]:
    peer, layout = context.peers[owner], _layout(context)
    slice_bytes = sum(chunk.numel * layout.tensors[chunk.tensor].dtype.itemsize for chunk in layout.parts[owner].chunks)
    direct = direct_path_pays(context.members[context.me], context.members[owner], slice_bytes)  # see .paths
    stream = await client.open_stream(
        peer, HANDLER_NAME, deadline=context.deadline, limits=context.limits, direct=direct
    )
    lead = Lead(MAX_LEAD_CHUNKS, context.idle_timeout / 2, _pacing_until(context))
    async with stream, TaskOwner(f"allreduce: sending part {owner} to {peer}") as tasks:
        sending = tasks.spawn(_send_slice(context, stream, owner, lead), report_errors=False)
        try:
            contributors = await _receive_average(context, stream, owner, lead)
        except HivemindExtError as e:
            failure = _failure_of(sending)
            if failure is not None and failure is not e:
                raise failure from e  # the send failed first (e.g. a write timed out): that is the cause
            raise
        if not sending.done():  # the END frame may still be on its way out
            await asyncio.wait([sending], timeout=max(0.0, min(context.idle_timeout, context.deadline - now())))
        if stream.direct and sending.done() and _failure_of(sending) is None and not sending.cancelled():
            # the owner's END follows its last average at once: reading it lets the direct connection
            # carry the next round's stream to this peer (see p2p.direct_wire, reuse); never waited long
            with contextlib.suppress(HivemindExtError):
                await stream.receive(deadline=min(context.deadline, now() + OWNER_END_GRACE))
        return contributors


def _pacing_until(context: RoundContext) -> float:
    """Senders stop pacing half-way to the collect deadline (see the module docstring)."""
    return context.started + (context.collect_deadline - context.started) / 2


def _failure_of(task: asyncio.Task[None]) -> BaseException | None:
    if not task.done() or task.cancelled():
        return None
    return task.exception()


async def _send_slice(context: RoundContext, stream: ClientStream, owner: int, lead: Lead) -> None:
    """JOIN, then every chunk of this member's slice of the part (each at most ``lead.limit`` chunks
    ahead of the averages received), then END."""
    layout = _layout(context)
    peer, part, hooks = context.peers[owner], layout.parts[owner], context.hooks
    upcoming: asyncio.Future[CompressedTensor] | None = None
    try:
        join = join_message(context.group_id, layout.fingerprint, context.weight, context.gather, list(layout.tensors))
        await _send(context, stream, await hooks.before_join(peer, owner, join))
        chunks = part.chunks
        upcoming = _compress(context, chunks[0]) if chunks else None
        for index in range(len(chunks)):
            compressed = await upcoming  # type: ignore[misc]
            # start the next chunk's compression (in a worker thread if offloaded) before writing this one
            upcoming = _compress(context, chunks[index + 1]) if index + 1 < len(chunks) else None
            await lead.wait_to_send(index)
            message = await hooks.before_send_chunk(peer, owner, index, chunk_message(compressed, index))
            await _send(context, stream, message)
        await stream.end(deadline=context.deadline, idle_timeout=context.idle_timeout)
    except BaseException:
        if upcoming is not None:  # its outcome no longer matters; don't let asyncio report it as lost
            upcoming.add_done_callback(_discard_outcome)
        await stream.aclose()  # aborts: the owner must see this sender fail now, not at its next timeout
        raise


def _compress(context: RoundContext, chunk: ChunkSpec) -> asyncio.Future[CompressedTensor]:
    codec, info = context.codec_for(chunk)  # Float16OrMinMax16 where the round's codec is float16
    values = context.tensors.input_chunk(chunk)
    # a codec known never to write into its input may alias it (no defensive copy): NoCompression
    # then sends straight from the caller's tensor, which nothing modifies until the round returns
    return context.runner.submit(codec.compress, values, info, type(codec) in READ_ONLY_CODECS)


def _discard_outcome(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()


async def _send(context: RoundContext, stream: ClientStream, message: Message) -> None:
    await stream.send(message, deadline=context.deadline, idle_timeout=context.idle_timeout)
    context.traffic.sent += message.payload_view().nbytes


async def _receive_average(
    context: RoundContext, stream: ClientStream, owner: int, lead: Lead
) -> tuple[tuple[PeerID, ...], list[tuple[PeerID, ...]]]:
    """Reads RESULT and the averaged chunks, decoding each into the outputs in a worker thread
    while the next one arrives; returns the contributors RESULT names and those of each chunk."""
    part = _layout(context).parts[owner]
    me = context.names[context.me]
    # RESULT comes once every sender of the part has joined, and each averaged chunk once every
    # sender still in the part has delivered it: silence until then is normal
    head = parse_result_head(await _receive(context, stream), context.name_set)
    if me not in head.contributors:
        raise ProtocolError("the owner's RESULT does not include this member, which joined the part")
    if head.num_chunks != len(part.chunks):
        raise ProtocolError(f"RESULT announces {head.num_chunks} chunks, the part has {len(part.chunks)}")
    context.learn_gathered(head.gathered)
    chunks: list[tuple[str, ...]] = []
    decoding: list[asyncio.Future[None]] = []
    try:
        for index, chunk in enumerate(part.chunks):
            compressed, present = parse_average(await _receive(context, stream), head, index)
            if me not in present:  # an owner that leaves a sender out refuses it instead
                raise ProtocolError(f"averaged chunk {index} leaves out this member, which delivered it")
            chunks.append(present)
            lead.averaged()
            decoding.append(context.runner.submit(_decode_into_output, context, chunk, compressed))
        for job in decoding:
            await job
    except Exception:
        if decoding:  # no decoding job may write into the outputs after the caller restores them
            await asyncio.wait(decoding)
        raise
    peers = context.peer_by_name  # every name in RESULT is a member's (parse_result_head checked it)
    return tuple(peers[name] for name in head.contributors), [tuple(peers[name] for name in chunk) for chunk in chunks]


async def _receive(context: RoundContext, stream: ClientStream) -> Message:
    message = await stream.receive(deadline=context.deadline)
    if message is None:
        raise ProtocolError("the owner ended the stream before sending the whole average")
    context.traffic.received += message.payload_view().nbytes
    return message


def _decode_into_output(context: RoundContext, chunk: ChunkSpec, message: CompressedTensor) -> None:
    """Decodes an averaged chunk straight into the output tensor, then validates it there (runs in a
    worker thread). Invalid values written meanwhile do no harm: a failed part is restored from the
    inputs (``keep_local``) before the round returns."""
    if message.shape != (chunk.numel,) or not message.dtype.is_floating_point:
        raise ProtocolError(f"averaged chunk of shape {message.shape} {message.dtype}, expected ({chunk.numel},)")
    output = context.tensors.output_chunk(chunk)
    try:
        values = (
            decompress(message, device=context.tensors.device)
            if output is None
            else decompress_into(message, output)  # no decoded temporary to copy: one pass less
        )
    except CompressionError as e:
        raise ProtocolError(f"undecodable averaged chunk: {e}") from e
    if not all_finite(values):  # the chunk was just written: still in cache
        raise ProtocolError("averaged chunk holds NaN or Inf")


def _layout(context: RoundContext) -> RoundLayout:
    if context.layout is None:
        raise AllreduceError("this member has no layout: it cannot send")
    return context.layout
