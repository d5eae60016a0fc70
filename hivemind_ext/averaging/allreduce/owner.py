"""The owner's side of a round: reducing the part this member owns and streaming the average back.

Life of the part (:meth:`OwnedPart.run`)::

    own slice reduced locally (no network)     -- if this member contributes values
    for each chunk, in order:
      wait until every sender still in the part has delivered it, excluding
        - senders that have not joined by the join deadline (start + next_chunk_timeout),
        - senders still sending at the collect deadline (start + collect_timeout)
      finalize it: weighted mean (or the configured robust aggregate) over those senders, less
        those the norm bound rejects (PartReducer.finalize_chunk)
      publish it: compress it once (with Float16OrMinMax16 where the round's codec is
        Float16Compression: same bytes, float16's error or less, see round_state.chunk_codec) and
        wake every sender's stream handler, which sends it at once with its contributor list
    decode the same messages into this member's own outputs, so that every member ends the
      round with identical values (the round then waits, until its deadline, for the senders
      to hang up: only then has the average surely left this machine)

So the owner's uplink carries averaged chunk i while chunk i + 1 is still coming in (as
hivemind's reducers do), instead of idling until the whole part is in: on a link where sending
and receiving take equal time, that halves the owner's share of the round.

Each incoming stream runs :meth:`OwnedPart.serve`: after the JOIN, a task receives the sender's
chunks (each reduced as it arrives) until the collect deadline, while the handler streams RESULT
and every averaged chunk as it is published. A sender whose stream moves no byte for
``next_chunk_timeout`` while a chunk is due is cut (one that keeps sending, however slowly, is
not). A sender that breaks the protocol, sends invalid values or stalls is excluded: it is
retracted from the chunks not averaged yet (it stays in those already sent back, and every
AVERAGE says whose values it holds), gets a REFUSED message and its stream is closed, and the
part goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Callable

import torch
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.api import PartOutcome
from hivemind_ext.averaging.allreduce.layout import PartSpec
from hivemind_ext.averaging.allreduce.reducer import PartReducer, ReducedChunk
from hivemind_ext.averaging.allreduce.round_state import RoundContext
from hivemind_ext.averaging.allreduce.wire import (
    Join,
    average_message,
    parse_chunk,
    refusal_message,
    result_message,
)
from hivemind_ext.averaging.tensor_layout import ChunkSpec
from hivemind_ext.compression import CompressedTensor, NoCompression, decompress_into
from hivemind_ext.errors import (
    AllreduceError,
    DeadlineExceededError,
    HivemindExtError,
    PeerUnreachableError,
    ProtocolError,
)
from hivemind_ext.p2p import Message, RequestStream, TaskOwner, now, wait_until
from hivemind_ext.p2p.idle import IdleStreamError

logger = logging.getLogger(__name__)

_LOCAL = NoCompression()


@dataclasses.dataclass(frozen=True)
class PublishedChunk:
    """One averaged chunk, as every sender's handler sends it."""

    contributors: tuple[PeerID, ...]
    positions: list[int]  # the contributors' positions in the RESULT head's list
    message: asyncio.Future[CompressedTensor]  # compressed once, for every sender and this member


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
        self._changed = asyncio.Event()  # set (and replaced) whenever anything below changes
        self._head: Message | None = None  # RESULT, once every sender joined or was excluded
        self._head_contributors: tuple[PeerID, ...] = ()
        self._chunks: list[PublishedChunk] = []  # the averaged chunks published so far, in order
        self._refused: dict[PeerID, str | None] = {}  # excluded senders: what to tell them (None: nothing)
        self._failure: str | None = None  # why the part could not be averaged (every stream is refused)

    # ----- the part's life

    async def run(self) -> PartOutcome:
        """Reduces the part chunk by chunk, publishing each average as soon as it is final."""
        context = self.context
        if context.sends:
            await self._reduce_own_slice()
        try:
            if not self.spec.chunks:
                await self._wait_for(lambda: not self._pending)
                if not self._joined - set(self._refused):
                    raise AllreduceError("no sender joined")
                self._open()
            for index in range(len(self.spec.chunks)):
                await self._wait_for(lambda index=index: self.reducer.chunk_ready(index))
                reduced = await self._finalize_chunk(index)
                if index == 0:
                    self._open()
                self._publish(reduced)
        except AllreduceError as e:
            self._failure = f"part {self.spec.owner} could not be averaged: {e}"
            self._notify()
            context.tensors.keep_local(self.spec)
            return context.not_averaged(self.spec, str(e))
        return await self._own_outcome()

    async def _wait_for(self, ready: Callable[[], bool]) -> None:
        """Waits until ``ready()``, excluding the senders that miss the join or collect deadline."""
        context = self.context
        while not ready():
            unjoined = self._pending - self._joined
            if unjoined and now() >= context.join_deadline:
                for sender in unjoined:
                    await self.exclude(sender, "did not join within next_chunk_timeout")
                continue
            if now() >= context.collect_deadline:
                for sender in list(self._pending):
                    await self.exclude(sender, "did not deliver its slice before the collect deadline")
                if not ready():  # cannot happen: every sender is now done or excluded
                    raise AllreduceError("the part is stuck after the collect deadline")
                return
            changed = self._changed
            deadline = context.join_deadline if unjoined else context.collect_deadline
            try:
                await wait_until(changed.wait(), deadline, "waiting for senders")
            except DeadlineExceededError:
                pass

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _reduce_own_slice(self) -> None:
        """This member's own values enter the sum directly, as zero-copy messages."""
        me = self.context.my_peer
        self._join(me, self.context.weight)
        try:
            for index, chunk in enumerate(self.spec.chunks):
                local = _LOCAL.encode(self.context.tensors.input_chunk(chunk), allow_inplace=True)
                await self._accept(me, index, local)
        except ProtocolError:  # its own values are not finite: it keeps them and the others average
            pass

    async def _finalize_chunk(self, index: int) -> ReducedChunk:
        async with self._lock:
            reduced = await self.context.runner.run(self.reducer.finalize_chunk, index)
        for sender, reason in reduced.rejected.items():  # delivered, but its values were left out (norm bound)
            self._excluded(sender, reason, tell=True)
        return reduced

    def _open(self) -> None:
        """RESULT can go: every sender joined or was excluded, so the gather data is all in."""
        excluded = self.reducer.excluded
        self._head_contributors = tuple(s for s in self.senders if s in self._joined and s not in excluded)
        contributors = [peer.to_base58() for peer in self._head_contributors]
        self._head = result_message(contributors, len(self.spec.chunks), self.context.all_gathered())
        self._notify()

    def _publish(self, reduced: ReducedChunk) -> None:
        """Starts compressing the averaged chunk (once for all senders) and wakes the senders' handlers."""
        members = set(reduced.contributors)
        positions = [position for position, peer in enumerate(self._head_contributors) if peer in members]
        contributors = tuple(self._head_contributors[position] for position in positions)
        chunk = self.spec.chunks[reduced.index]
        message = self.context.runner.submit(self._compress, chunk, reduced.values)
        message.add_done_callback(_discard_outcome)  # awaited by whoever needs it; never "lost"
        self._chunks.append(PublishedChunk(contributors, positions, message))
        self._notify()

    async def _own_outcome(self) -> PartOutcome:
        """This member's copy of the average: decoded from the very messages the senders get, so that
        every member ends the round with identical values."""
        context, me = self.context, self.context.my_peer
        results = []
        try:
            for published in self._chunks:
                results.append(await published.message)
        except HivemindExtError as e:  # the average could not be compressed (e.g. it overflowed)
            context.tensors.keep_local(self.spec)
            return context.not_averaged(self.spec, f"the average could not be compressed: {e}")
        outcome = context.averaged(self.spec, self._head_contributors, [c.contributors for c in self._chunks])
        if context.sends and me not in outcome.contributors:  # its own values were refused: it keeps them
            context.tensors.keep_local(self.spec)
            return context.not_averaged(self.spec, self.reducer.excluded.get(me, "own values excluded"))
        if context.tensors.present:
            for chunk, message in zip(self.spec.chunks, results, strict=True):
                await context.runner.run(_write_decoded, context, chunk, message)
        return outcome

    def _compress(self, chunk: ChunkSpec, average: torch.Tensor) -> CompressedTensor:
        # Float16OrMinMax16 where the round's codec is float16; error feedback keeps the average's residual apart
        codec, info = self.context.codec_for(chunk, aggregate=True)
        # the average is ours and read-only from here: the codec may alias or reuse it
        return codec.compress(average, info, True)

    # ----- bookkeeping

    def _join(self, sender: PeerID, weight: float) -> None:
        if self._head is not None or self._failure is not None:
            raise ProtocolError(f"part {self.spec.owner} is already being averaged without this sender")
        if sender not in self._pending:
            raise ProtocolError(f"not expected in part {self.spec.owner} (excluded, or not a contributing member)")
        if sender in self._joined:
            raise ProtocolError(f"joined part {self.spec.owner} twice")
        self.reducer.set_weight(sender, weight)
        self._joined.add(sender)
        if not self.spec.chunks:
            self._settle(sender)
        self._notify()

    async def _accept(self, sender: PeerID, index: int, message: CompressedTensor) -> None:
        """Reduces one chunk; raises ProtocolError (the reducer has excluded the sender) if it is invalid."""
        async with self._lock:
            try:
                await self.context.runner.run(self.reducer.accept, sender, index, message)
            except ProtocolError as e:
                if sender in self.reducer.excluded:
                    self._excluded(sender, str(e), tell=True)
                raise
        if self.reducer.done(sender):
            self._settle(sender)
        self._notify()

    async def exclude(self, sender: PeerID, reason: str, *, tell: bool = True) -> None:
        """Excludes a sender that has not delivered its whole slice from the chunks not averaged yet
        (a sender that has delivered everything stays in); ``tell``: its stream gets REFUSED."""
        if sender not in self._pending:
            return
        if self.spec.chunks:
            async with self._lock:
                await self.context.runner.run(self.reducer.exclude, sender, reason)
            if sender not in self.reducer.excluded:
                return  # its last chunk was reduced while we waited for the lock: it stays in
        self._excluded(sender, reason, tell=tell)

    def _excluded(self, sender: PeerID, reason: str, *, tell: bool) -> None:
        self.context.exclude(sender, reason)
        self._refused.setdefault(sender, reason if tell else None)
        self._settle(sender)
        self._notify()

    def _settle(self, sender: PeerID) -> None:
        self._pending.discard(sender)

    # ----- one sender's stream

    async def serve(self, sender: PeerID, join: Join, requests: RequestStream) -> AsyncIterator[Message]:
        """Serves one sender's stream after its JOIN: its chunks in and, at the same time, each
        averaged chunk out as soon as it is published (or a refusal)."""
        try:
            self._join(sender, join.weight)
        except ProtocolError as e:
            yield refusal_message(str(e))
            return
        self.context.gathered[sender.to_base58()] = join.gather
        async with TaskOwner(f"allreduce: part {self.spec.owner} from {sender}") as tasks:
            tasks.spawn(self._receive(sender, requests), report_errors=False)
            async for response in self._send_result(sender):
                yield response

    async def _receive(self, sender: PeerID, requests: RequestStream) -> None:
        """Receives the sender's slice; on failure, excludes it (its handler then refuses it)."""
        try:
            await self._receive_slice(sender, requests)
        except HivemindExtError as e:  # a deadline, a broken stream, or a protocol violation
            # a disconnected sender needs no explanation (there is no one left to tell)
            await self.exclude(sender, _reason(e), tell=not isinstance(e, PeerUnreachableError))
        except Exception as e:  # e.g. a fault injected by a hook: the stream fails as if the network had
            logger.warning(f"stream from {sender} to part {self.spec.owner} failed: {type(e).__name__}: {e}")
            await self.exclude(sender, f"{type(e).__name__}: {e}", tell=False)

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
        # the sender's END follows its last chunk: reading it (best effort) lets a direct connection
        # carry the sender's next stream to this peer (see p2p.direct_wire, reuse)
        with contextlib.suppress(HivemindExtError):
            await wait_until(requests.receive(idle_timeout=context.idle_timeout), context.collect_deadline, "END")

    async def _send_result(self, sender: PeerID) -> AsyncIterator[Message]:
        """RESULT, then each averaged chunk as soon as it is published; REFUSED as soon as the sender
        is out of the part or the part failed."""
        context, part = self.context, self.spec.owner
        head_sent, index = False, 0
        while True:
            changed = self._changed
            if sender in self._refused:
                reason = self._refused[sender]
                if reason is not None:
                    yield refusal_message(reason)
                return
            if self._failure is not None:
                yield refusal_message(self._failure)
                return
            if self._head is not None and not head_sent:
                head_sent = True
                yield self._counted(await context.hooks.before_send_result(sender, part, None, self._head))
                continue  # the sender may have been excluded meanwhile
            if head_sent and index < len(self._chunks):
                published = self._chunks[index]
                try:
                    compressed = await published.message
                except HivemindExtError:
                    return  # the average could not be compressed: the sender keeps its own values
                message = average_message(compressed, index, published.positions)
                yield self._counted(await context.hooks.before_send_result(sender, part, index, message))
                index += 1
                continue
            if head_sent and index == len(self.spec.chunks):
                return
            try:
                await wait_until(changed.wait(), context.deadline, "waiting for the average")
            except DeadlineExceededError:
                return

    def _counted(self, message: Message) -> Message:
        self.context.traffic.sent += _payload_bytes(message)
        return message


def _discard_outcome(future: asyncio.Future[object]) -> None:
    if not future.cancelled():
        future.exception()


def _write_decoded(context: RoundContext, chunk: ChunkSpec, message: CompressedTensor) -> None:
    output = context.tensors.output_chunk(chunk)
    if output is not None:  # the owner's own copy of the average it sends: decoded straight into the output
        decompress_into(message, output)


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
