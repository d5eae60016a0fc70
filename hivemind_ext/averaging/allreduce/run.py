"""One member's run of one all-reduce round: its exchange with every owner, and the part it owns.

:class:`RoundRun` starts one task per owner (:mod:`.sender`) and, if this member owns a
part, the part's life (:mod:`.owner`); serves the streams that the service routes to it;
assembles the result; and, when it closes, stops everything it started or served. The service
(:mod:`.service`) creates one per ``run_round`` call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.api import AllreduceResult, PartOutcome
from hivemind_ext.averaging.allreduce.layout import member_roles, plan_layout, round_chunk_bytes
from hivemind_ext.averaging.allreduce.owner import OwnedPart
from hivemind_ext.averaging.allreduce.round_state import RoundContext
from hivemind_ext.averaging.allreduce.sender import exchange_with_owner
from hivemind_ext.averaging.allreduce.wire import Join, parse_join, refusal_message, unpack_gather
from hivemind_ext.averaging.tensor_layout import chunk_numel
from hivemind_ext.compression.chunks import num_chunks
from hivemind_ext.errors import DeadlineExceededError, ProtocolError
from hivemind_ext.p2p import Message, RequestStream, RPCClient, TaskOwner, now, wait_until

logger = logging.getLogger(__name__)

MAX_GATHER_BYTES = 64 * 1024
RETURN_MARGIN = 0.5  # a round's tasks that outlive its deadline by this much are cancelled
CLOSE_TIMEOUT = 5.0
# An auxiliary member builds its layout from a JOIN; this bounds what a lying JOIN can make it allocate.
MAX_LEARNED_CHUNKS = 2**20


class RoundRun:
    """One member's run of one round: its exchanges with every owner, and the part it owns."""

    def __init__(self, context: RoundContext, client: RPCClient) -> None:
        self.context, self.client = context, client
        self.part: OwnedPart | None = None
        self._part_ready = asyncio.Event()
        me = context.me
        if context.layout is not None and context.is_owner(me):
            self._adopt_part(OwnedPart(context, context.layout.parts[me]))
        self._tasks = TaskOwner(f"allreduce round {context.group_id.hex()[:12]}")
        self._handlers: set[asyncio.Task[Any]] = set()  # serving a stream of this round right now
        self._streams: set[asyncio.Future[Any]] = set()  # their calls, until each has ended
        self.closed = False

    def _adopt_part(self, part: OwnedPart) -> None:
        self.part = part
        self._part_ready.set()

    async def run(self) -> AllreduceResult:
        context, me = self.context, self.context.me
        jobs: dict[int, asyncio.Task[PartOutcome | None]] = {}
        async with self._tasks:
            if context.is_owner(me):
                jobs[me] = self._tasks.spawn(self._run_own_part(), name="own part")
            if context.sends and context.layout is not None:
                for owner in context.owners():
                    if owner != me:
                        jobs[owner] = self._tasks.spawn(exchange_with_owner(context, self.client, owner), name="send")
            if jobs:
                await asyncio.wait(jobs.values(), timeout=max(0.0, context.deadline + RETURN_MARGIN - now()))
        # leaving the block cancelled whatever was still running; a worker thread may still be writing
        await context.runner.drain()
        outcomes = {owner: outcome_of(task) for owner, task in jobs.items()}
        return self._result({owner: outcome for owner, outcome in outcomes.items() if outcome is not None})

    async def _run_own_part(self) -> PartOutcome | None:
        if self.part is None and not self.context.senders():
            return None  # nobody contributes, so nobody will JOIN: the round is over (as in hivemind)
        if self.part is None:  # an auxiliary member without tensors: the first valid JOIN brings the layout
            try:
                await wait_until(self._part_ready.wait(), self.context.join_deadline, "waiting for a sender")
            except DeadlineExceededError:
                return None
        if self.part is None:
            return None
        outcome = await self.part.run()
        await self._wait_for_delivery()
        return outcome

    async def _wait_for_delivery(self) -> None:
        """Waits (until the deadline) for every stream of this part to end. A handler is done once
        its last message is queued, but only the end of the call - the sender hangs up once it has
        everything - says the average was delivered: returning earlier could let the caller shut
        the daemon down with the average still in a buffer."""
        while self._streams and now() < self.context.deadline:
            await asyncio.wait(list(self._streams), timeout=self.context.deadline - now())

    def _result(self, outcomes: dict[int, PartOutcome]) -> AllreduceResult:
        context, layout = self.context, self.context.layout
        parts = []
        for owner in context.owners() if layout is not None else ():
            outcome = outcomes.get(owner)
            if outcome is None:
                part = layout.parts[owner]
                context.tensors.keep_local(part)
                reason = "auxiliary members only reduce their own part" if not context.sends else "no result in time"
                outcome = context.not_averaged(part, reason)
            parts.append(outcome)
        return AllreduceResult(
            tensors=context.tensors.results(),
            parts=tuple(parts),
            excluded=dict(context.excluded),
            # every member is listed, as in hivemind; None where its data did not reach this member
            # (two auxiliary members exchange nothing)
            gathered={**dict.fromkeys(context.peers), **_decode_gathered(context.all_gathered(), context.peer_by_name)},
            bytes_sent=context.traffic.sent,
            bytes_received=context.traffic.received,
            members=tuple(context.senders()),
            receive_rate=context.traffic.receive_rate(context.started),
            chunk_bytes=layout.part_size_bytes if layout is not None else None,
        )

    async def serve(self, sender: PeerID, first: Message, requests: RequestStream) -> AsyncIterator[Message]:
        """One sender's stream to the part this member owns; the round cancels it when it closes."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        ended = requests.call_ended()  # not the task's end: a direct connection's task serves the next call
        self._streams.add(ended)
        ended.add_done_callback(self._streams.discard)
        try:
            try:
                join = parse_join(first, MAX_GATHER_BYTES)
                part = self._part_for(sender, join)
            except ProtocolError as e:
                if self.part is not None:  # a member that breaks the protocol is out at once (no-op for others)
                    await self.part.exclude(sender, f"refused JOIN: {e}")
                yield refusal_message(str(e))
                return
            async for response in part.serve(sender, join, requests):
                yield response
        finally:
            self._handlers.discard(task)  # type: ignore[arg-type]

    def _part_for(self, sender: PeerID, join: Join) -> OwnedPart:
        context = self.context
        if self.closed:
            raise ProtocolError("the round is over")
        name = sender.to_base58()
        if name not in context.name_set:
            raise ProtocolError(f"{name} is not a member of group {context.group_id.hex()}")
        if not context.is_sender(context.names.index(name)):
            raise ProtocolError("auxiliary members contribute no values")
        if not context.is_owner(context.me):
            raise ProtocolError("this member is in client mode and owns no part")
        if self.part is None:
            self._learn_layout(join)
        if context.layout is None or self.part is None:
            raise ProtocolError("this member has no part to reduce")
        if join.fingerprint != context.layout.fingerprint:
            raise ProtocolError("layout mismatch: members disagree on tensor shapes, dtypes or part_size_bytes")
        return self.part

    def _learn_layout(self, join: Join) -> None:
        """An auxiliary member without tensors takes the layout from the first JOIN whose fingerprint
        matches the layout it describes (a member that lies about it can only spoil this one part:
        the honest senders' JOINs then fail the fingerprint check)."""
        context = self.context
        chunk_bytes = round_chunk_bytes(context.members, context.config.part_size_bytes)
        chunks = sum(num_chunks(spec.numel, chunk_numel(spec.dtype, chunk_bytes)) for spec in join.tensors)
        if chunks > MAX_LEARNED_CHUNKS:
            raise ProtocolError(f"the JOIN describes {chunks} chunks, more than the {MAX_LEARNED_CHUNKS} accepted")
        layout = plan_layout(join.tensors, member_roles(context.members), chunk_bytes)  # the chunk size checked above
        if layout.fingerprint != join.fingerprint:
            raise ProtocolError("the JOIN's tensor description does not match its layout fingerprint")
        if context.tensor_infos is not None and len(context.tensor_infos) != len(layout.tensors):
            context.tensor_infos = None  # infos for other tensors: use the default per-tensor infos
        context.layout = layout
        self._adopt_part(OwnedPart(context, layout.parts[context.me]))

    async def close(self) -> None:
        """Cancels the handlers still serving this round and every task it started, and waits for them."""
        self.closed = True
        current = asyncio.current_task()
        handlers = [task for task in self._handlers if task is not current and not task.done()]
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.wait(handlers, timeout=CLOSE_TIMEOUT)
        await self._tasks.aclose()
        await self.context.runner.drain()


def outcome_of(task: asyncio.Task[PartOutcome | None]) -> PartOutcome | None:
    if not task.done() or task.cancelled() or task.exception() is not None:
        return None  # a failure was logged by the task owner; the part keeps local values
    return task.result()


def _decode_gathered(gathered: dict[str, bytes], members: dict[str, PeerID]) -> dict[PeerID, Any]:
    decoded = {}
    for name, packed in gathered.items():
        try:
            peer = members.get(name)
            decoded[peer if peer is not None else PeerID.from_base58(name)] = unpack_gather(packed)
        except (ProtocolError, ValueError) as e:
            logger.debug(f"dropping undecodable gather data of {name}: {e}")
    return decoded
