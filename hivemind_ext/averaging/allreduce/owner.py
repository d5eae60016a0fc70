"""The owner's side of a round: reducing the part this member owns and sending the average back.

Life of the part (:meth:`OwnedPart.run`)::

    own slice reduced locally (no network)     -- if this member contributes values
    wait until every sender is done or excluded, excluding
      - senders that have not joined by the join deadline (start + next_chunk_timeout),
      - senders still sending at the collect deadline (start + collect_timeout)
    finalize: weighted mean (or the configured robust aggregate) over the senders that delivered
      the whole part, less those the norm bound rejects (PartReducer)
    publish: start compressing each chunk of the average once (with Float16OrMinMax16 where the
      round's codec is Float16Compression: same bytes, float16's error or less, see
      round_state.chunk_codec); every sender's stream handler sends each of these messages as soon
      as it is ready
    decode the same messages into this member's own outputs, so that every member ends the
      round with identical values (the round then waits, until its deadline, for the senders
      to hang up: only then has the average surely left this machine)

Each incoming stream runs :meth:`OwnedPart.serve`: join, then receive the sender's chunks, reducing
each chunk as it arrives, until the collect deadline; a sender whose stream moves no byte for
``next_chunk_timeout`` while a chunk is due is cut (one that keeps sending, however slowly, is not);
then wait for the publication and stream the result. A sender that breaks the protocol, sends
invalid values or stalls is excluded: what it added is retracted, it gets a REFUSED message and
its stream is closed, and the part goes on without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import torch
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.api import PartOutcome
from hivemind_ext.averaging.allreduce.layout import PartSpec
from hivemind_ext.averaging.allreduce.reducer import PartReducer, ReducedPart
from hivemind_ext.averaging.allreduce.round_state import RoundContext
from hivemind_ext.averaging.allreduce.wire import (
    Join,
    chunk_message,
    parse_chunk,
    refusal_message,
    result_message,
)
from hivemind_ext.averaging.tensor_layout import ChunkSpec
from hivemind_ext.compression import CompressedTensor, NoCompression, decompress
from hivemind_ext.errors import (
    AllreduceError,
    DeadlineExceededError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.p2p import Message, RequestStream, now, wait_until
from hivemind_ext.p2p.idle import IdleStreamError

logger = logging.getLogger(__name__)

_LOCAL = NoCompression()


class OwnedPart:
    """The part this member owns in one round, from the first chunk to the last result sent."""

    def __init__(self, context: RoundContext, spec: PartSpec) -> None:
        self.context, self.spec = context, spec
        self.senders = context.senders()
        # weights are set when each sender joins; a sender that never joins never contributes
        weights = dict.fromkeys(self.senders, 0.0)
        self.reducer = PartReducer(
            spec.size,
            1,
            weights,
            context.tensors.device,
            bounds=spec.bounds,
            aggregator=context.config.aggregator,
            norm_bound=context.config.norm_bound,
        )
        self._lock = asyncio.Lock()  # reducer calls (in worker threads if offloaded) run one at a time
        self._pending = set(self.senders)  # neither done nor excluded
        self._joined: set[PeerID] = set()
        self._delivered: set[PeerID] = set()
        self._settled = asyncio.Event()
        self._published = asyncio.Event()
        self._average: torch.Tensor | None = None  # float32 [part size], once finalized
        self._results: list[asyncio.Future[CompressedTensor] | None] = []  # its chunks, compressed on first use
        self._contributors: tuple[PeerID, ...] = ()
        self._gathered: dict[str, bytes] = {}
        self._refusal: str | None = None

    # ----- the part's life

    async def run(self) -> PartOutcome:
        """Reduces the part and publishes the average (the handlers send it back)."""
        context = self.context
        if context.sends:
            await self._reduce_own_slice()
        await self._wait_settled(context.join_deadline)
        for sender in self._pending - self._joined:
            await self.exclude(sender, "did not join within next_chunk_timeout")
        await self._wait_settled(context.collect_deadline)
        for sender in list(self._pending):
            await self.exclude(sender, "did not deliver its slice before the collect deadline")
        return await self._publish()

    async def _wait_settled(self, deadline: float) -> None:
        if self._pending and now() < deadline:
            try:
                await wait_until(self._settled.wait(), deadline, "waiting for senders")
            except DeadlineExceededError:
                pass

    async def _reduce_own_slice(self) -> None:
        """This member's own values enter the sum directly, as zero-copy messages (never retracted)."""
        me = self.context.my_peer
        self._join(me, self.context.weight)
        try:
            for index, chunk in enumerate(self.spec.chunks):
                local = _LOCAL.encode(self.context.tensors.input_chunk(chunk), allow_inplace=True)
                await self._accept(me, index, local)
        except ProtocolError:  # its own values are not finite: it keeps them and the others average
            pass

    async def _publish(self) -> PartOutcome:
        """Finalizes the mean, starts compressing it (once for all senders), and releases the senders."""
        context = self.context
        try:
            reduced = await self._finalize()
        except AllreduceError as e:
            self._refusal = f"part {self.spec.owner} could not be averaged: {e}"
            self._published.set()
            context.tensors.keep_local(self.spec)
            return context.not_averaged(self.spec, str(e))
        contributors = self._delivered if reduced is None else set(reduced.contributors)
        self._contributors = tuple(sender for sender in self.senders if sender in contributors)
        for sender, reason in reduced.rejected.items() if reduced is not None else ():
            context.exclude(sender, reason)  # delivered, but its values were left out (norm bound)
        if reduced is not None:
            self._average, self._results = reduced.values, [None] * len(self.spec.chunks)
        self._gathered = context.all_gathered()
        self._published.set()  # each handler sends chunk i as soon as it is compressed
        return await self._own_outcome()

    def _result(self, index: int) -> asyncio.Future[CompressedTensor]:
        """Chunk ``index`` of the average, compressed once (by whichever side needs it first)."""
        result = self._results[index]
        if result is None:
            result = self._results[index] = self.context.runner.submit(self._compress, self.spec.chunks[index])
        return result

    async def _own_outcome(self) -> PartOutcome:
        """This member's copy of the average: decoded from the very messages the senders get, so that
        every member ends the round with identical values."""
        context, me = self.context, self.context.my_peer
        results = []
        try:
            for index in range(len(self._results)):
                await asyncio.sleep(0)  # the senders first: their copies are on the round's critical path
                results.append(await self._result(index))
        except HivemindExtError as e:  # the average could not be compressed (e.g. it overflowed)
            context.tensors.keep_local(self.spec)
            return context.not_averaged(self.spec, f"the average could not be compressed: {e}")
        if context.sends and me not in self._contributors:  # its own values were refused: it keeps them
            context.tensors.keep_local(self.spec)
            return context.not_averaged(self.spec, self.reducer.excluded.get(me, "own values excluded"))
        if context.tensors.present:
            for chunk, message in zip(self.spec.chunks, results, strict=True):
                await context.runner.run(_write_decoded, context, chunk, message)
        return PartOutcome(me, self.spec.start, self.spec.end, True, self._contributors)

    async def _finalize(self) -> ReducedPart | None:
        """The reduced part (None for an empty part, which is "averaged" by whoever joined it)."""
        if not self.spec.chunks:
            if not self._delivered:
                raise AllreduceError("no sender joined")
            return None
        async with self._lock:
            return await self.context.runner.run(self.reducer.finalize)

    def _compress(self, chunk: ChunkSpec) -> CompressedTensor:
        if self._average is None:
            raise AllreduceError("the part was compressed before it was averaged")
        segment = self._average[chunk.offset : chunk.offset + chunk.numel]
        # Float16OrMinMax16 where the round's codec is float16; error feedback keeps the average's residual apart
        codec, info = self.context.codec_for(chunk, aggregate=True)
        # the average is ours and read-only from here: the codec may alias or reuse it
        return codec.compress(segment, info, True)

    # ----- bookkeeping

    def _join(self, sender: PeerID, weight: float) -> None:
        if self._published.is_set():
            raise ProtocolError(f"part {self.spec.owner} was already averaged without this sender")
        if sender not in self._pending:
            raise ProtocolError(f"not expected in part {self.spec.owner} (excluded, or not a contributing member)")
        if sender in self._joined:
            raise ProtocolError(f"joined part {self.spec.owner} twice")
        self.reducer.set_weight(sender, weight)
        self._joined.add(sender)
        if not self.spec.chunks:
            self._settle(sender, delivered=True)

    async def _accept(self, sender: PeerID, index: int, message: CompressedTensor) -> None:
        """Reduces one chunk; raises ProtocolError (the reducer has excluded the sender) if it is invalid."""
        async with self._lock:
            try:
                done = await self.context.runner.run(_accept_chunk, self.reducer, sender, index, message)
            except ProtocolError as e:
                if sender in self.reducer.excluded:
                    self.context.exclude(sender, str(e))
                    self._settle(sender, delivered=False)
                raise
        if done:
            self._settle(sender, delivered=True)

    async def exclude(self, sender: PeerID, reason: str) -> None:
        """Excludes a sender that has not delivered its whole slice, retracting what it added
        (a sender that has delivered everything stays in)."""
        if sender not in self._pending:
            return
        if self.spec.chunks:
            async with self._lock:
                await self.context.runner.run(self.reducer.exclude, sender, reason)
            if sender not in self.reducer.excluded:
                return  # its last chunk was reduced while we waited for the lock: it stays in
        if sender in self._pending:
            self.context.exclude(sender, reason)
            self._settle(sender, delivered=False)

    def _settle(self, sender: PeerID, *, delivered: bool) -> None:
        if sender in self._pending:
            self._pending.discard(sender)
            if delivered:
                self._delivered.add(sender)
        if not self._pending:
            self._settled.set()

    # ----- one sender's stream

    async def serve(self, sender: PeerID, join: Join, requests: RequestStream) -> AsyncIterator[Message]:
        """Serves one sender's stream after its JOIN: its chunks in, the average (or a refusal) out."""
        try:
            self._join(sender, join.weight)
        except ProtocolError as e:
            yield refusal_message(str(e))
            return
        self.context.gathered[sender.to_base58()] = join.gather
        try:
            await self._receive_slice(sender, requests)
        except HivemindExtError as e:  # a deadline, a broken stream, or a protocol violation
            await self.exclude(sender, _reason(e))
            if not isinstance(e, PeerUnreachableError):  # else there is no one left to tell
                yield refusal_message(_reason(e))
            return
        except Exception as e:  # e.g. a fault injected by a hook: the stream fails as if the network had
            logger.warning(f"stream from {sender} to part {self.spec.owner} failed: {type(e).__name__}: {e}")
            await self.exclude(sender, f"{type(e).__name__}: {e}")
            return
        async for response in self._send_result(sender):
            yield response

    async def _receive_slice(self, sender: PeerID, requests: RequestStream) -> None:
        context, part = self.context, self.spec.owner
        while sender in self._pending:
            # a sender whose bytes keep coming is waited for (until the collect deadline), however thin
            # its link; one that sends nothing for the idle window is cut (IdleStreamError)
            message = await wait_until(
                requests.receive(idle_timeout=context.idle_timeout),
                context.collect_deadline,
                "delivering its slice before the collect deadline",
            )
            if message is None:
                raise ProtocolError("ended its stream before sending its whole slice")
            context.traffic.received += _payload_bytes(message)
            index, compressed = parse_chunk(message)
            await context.hooks.after_receive_chunk(sender, part, index, message)
            await self._accept(sender, index, compressed)

    async def _send_result(self, sender: PeerID) -> AsyncIterator[Message]:
        context, part = self.context, self.spec.owner
        try:
            await wait_until(self._published.wait(), context.deadline, "waiting for the average")
        except DeadlineExceededError:
            return
        if self._refusal is not None:
            yield refusal_message(self._refusal)
            return
        contributors = [peer.to_base58() for peer in self._contributors]
        head = result_message(contributors, len(self._results), self._gathered)
        yield self._counted(await context.hooks.before_send_result(sender, part, None, head))
        for index in range(len(self._results)):
            try:
                compressed = await self._result(index)
            except HivemindExtError:
                return  # the average could not be compressed: the sender keeps its own values
            message = await context.hooks.before_send_result(sender, part, index, chunk_message(compressed, index))
            yield self._counted(message)

    def _counted(self, message: Message) -> Message:
        self.context.traffic.sent += _payload_bytes(message)
        return message


def _accept_chunk(reducer: PartReducer, sender: PeerID, index: int, message: CompressedTensor) -> bool:
    """Adds one chunk (in a worker thread); returns whether the sender has now delivered its whole part."""
    reducer.accept(sender, index, message)
    return sender not in reducer.active_senders()


def _write_decoded(context: RoundContext, chunk: ChunkSpec, message: CompressedTensor) -> None:
    context.tensors.write(chunk, decompress(message, device=context.tensors.device))


def _payload_bytes(message: Message) -> int:
    return message.payload_view().nbytes


def _reason(error: BaseException) -> str:
    if isinstance(error, IdleStreamError):
        return f"stalled: {error} (its next chunk)"
    if isinstance(error, DeadlineExceededError):
        return f"too slow: {error}"
    if isinstance(error, PeerUnreachableError):
        return f"disconnected: {error}"
    return f"{type(error).__name__}: {error}"
