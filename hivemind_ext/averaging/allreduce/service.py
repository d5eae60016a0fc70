"""Fault-tolerant butterfly all-reduce for one group round.

API::

    service = AllreduceService(rpc_server, rpc_client)   # one per averager: registers ONE handler
    await service.start()
    result = await service.run_round(
        group,                    # GroupInfo from matchmaking (ordered members, group id)
        tensors,                  # float tensors, same shapes and dtypes on every member
        weight=1.0,               # this member's weight in the mean
        gather={"batch": 32},     # small msgpack-able data that every member receives
        config=AllreduceConfig(compression=Float16Compression(), allreduce_timeout=30),
        deadline=None,            # optional absolute deadline (loop clock); the earlier one wins
        hooks=None,               # RoundHooks: fault injection for tests
        tensor_infos=None,        # CompressionInfo per tensor (keys, roles) for adaptive codecs
    )
    result.tensors                # new tensors: the weighted mean where averaged, own values elsewhere
    result.parts                  # PartOutcome per owned part: averaged?, contributors, reason
    result.excluded, result.gathered, result.bytes_sent, result.bytes_received
    await service.shutdown()

Roles: every member that is not in client mode owns a part of the flattened tensors, sized by
its declared bandwidth (see :mod:`.layout`); client-mode members own none and only open
streams. Auxiliary members own a part and contribute nothing (they may pass no tensors at all:
they learn the layout from the senders' JOIN); every other member contributes its values with its
weight. Each contributing member streams its slice of every part to the part's owner over one
stream per (sender, owner) pair, which then carries the average back (:mod:`.wire`).

Pipelining: a member sends to all owners at once; an owner reduces each chunk as it arrives
(decode straight from the received buffer, validate, weighted add), its own slice included
without the network; as soon as every sender still in the part has delivered chunk i, it
compresses chunk i of the average once and every sender's handler streams it back, while the
next chunks are still arriving (so the owner's uplink works while its downlink does, as with
hivemind's reducers); senders decode the averaged chunks straight into the output tensors as they
arrive. No copy is made that the codec does
not need: NoCompression chunks go out from the caller's tensors and are reduced from the received
bytes. ``AllreduceConfig.offload_codecs`` moves codec work to worker threads (see there why it is
off by default).

Codecs: every chunk travels both ways with the round's codec, except that where it is
Float16Compression (itself, or an adaptive wrapper's pick for the chunk) and the tensor is float32
or float64, chunks travel as :class:`~hivemind_ext.compression.Float16OrMinMax16`: the same 2 bytes
per value, and for each chunk float16 or 16-bit codes over the chunk's [min, max], whichever has the
smaller squared error (:func:`.round_state.chunk_codec`). The owner still sends ONE message per chunk
of the average, which every member decodes to identical values; hivemind instead sends each sender
float16 of the average minus what it sent, which leaves members with different values. Measured
with hivemind's test_allreduce_compression tensors (a client and a full peer), the mean squared
error is 7.8e-9 (hivemind: 3.9e-6, plain float16 both ways: 2.0e-5).

Faults (see :mod:`.owner` and :mod:`.sender`): a sender that does not join
within ``next_chunk_timeout`` of the round's start, sends no byte for ``next_chunk_timeout`` while
a chunk is due (an idle window: a chunk that keeps coming, however slowly, is waited for), is still
sending at ``collect_timeout``, breaks the protocol or sends invalid values (wrong shape or dtype,
undecodable, oversized, NaN / Inf) is excluded from that part and retracted from every chunk not
averaged yet: each chunk is the exact weighted mean over the senders it names (a sender that drops
out mid-part stays in the chunks already sent back; ``PartOutcome.runs`` lists them), and the
result says who is missing where (``AllreduceResult.missing`` / ``complete`` say whether the whole
group is in every part).
A sender whose owner fails keeps its own values for that part. Every wait is bounded by the
round's deadline (``allreduce_timeout`` from the start, or the caller's ``deadline`` if earlier),
so a round returns by then plus a fraction of a second, whatever the other members do. Only
typed errors leave ``run_round``: ConfigurationError for bad arguments, AllreduceError when this
member cannot take part (not in the group, ...); failures of other members are reported in the
result, never raised. Cancelling ``run_round`` cancels and awaits everything it started,
including the handlers serving its part.

Gather: every sender puts its (packed) gather data into its JOIN to every owner; every owner
echoes all the gather data it holds (its own, its senders', what other owners echoed to it) in
its RESULT. So every member receives the data of every member that reached it directly or through
an owner: a client-mode member through the owners, an auxiliary member from its senders (two
auxiliary members never learn each other's data: neither opens a stream; the result still lists
every member, with None for data that did not arrive, as hivemind's does). Parts of size zero
still carry JOIN and RESULT, so gather works with any sizes.

Routing: the service registers one stream handler (``"allreduce"``) on the RPC server and routes
each stream by the group id in its JOIN to the local round. A stream that arrives a little before
the local round starts waits (up to ``round_wait_timeout``) for it, if :mod:`.admission` lets it
(members the matchmaking board lists have slots that outsiders cannot take); a stream for an
unknown or finished group, or from a peer that is not a contributing member, is answered with REFUSED. The
sender's identity is the stream's authenticated libp2p peer id.

Measured with benchmarks/allreduce.py (4 peers x 16M float32 values, each peer with its own
daemon, 2-core machine shared with other jobs, 2 MiB chunks; median round, no matchmaking): one
process per peer: none 0.78 s, float16 0.57 s, MinMaxUInt8 0.43 s; all four peers in one process
(one GIL): 1.06 s, 0.68 s, 0.50 s. Each peer sends exactly the butterfly minimum 2(N-1)/N x size
(times the codec's ratio) plus its gather data. For "none" the four daemons (encryption, copies)
use more CPU than the four Python peers together, so the round is bound by the machine's 2 cores.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import math
import random
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import torch
from hivemind.p2p import PeerID

from hivemind_ext.averaging.allreduce.admission import AdmissionConfig, EarlyAdmission
from hivemind_ext.averaging.allreduce.api import (
    DEFAULT_PART_SIZE_BYTES,
    AllreduceConfig,
    AllreduceResult,
    PartOutcome,
    RoundHooks,
)
from hivemind_ext.averaging.allreduce.layout import check_float_tensors, plan_round_layout
from hivemind_ext.averaging.allreduce.round_state import CodecRunner, RoundContext, RoundTensors
from hivemind_ext.averaging.allreduce.round_time import MAX_ROUND_SECONDS, predict_round_seconds, round_timeout
from hivemind_ext.averaging.allreduce.run import MAX_GATHER_BYTES, RoundRun
from hivemind_ext.averaging.allreduce.wire import (
    HANDLER_NAME,
    MAX_GROUP_ID_BYTES,
    pack_gather,
    parse_group_id,
    refusal_message,
)
from hivemind_ext.averaging.matchmaking.group import GroupInfo
from hivemind_ext.compression import CompressionInfo
from hivemind_ext.errors import (
    AllreduceError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    ProtocolError,
)
from hivemind_ext.p2p import (
    HandlerConfig,
    Limits,
    Message,
    RequestStream,
    RPCClient,
    RPCContext,
    RPCServer,
    now,
    wait_until,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_ROUND_WAIT_TIMEOUT = 5.0
FIRST_MESSAGE_TIMEOUT = 10.0

REFUSAL_DELAY = 0.5  # a stream refused a wait for its round is answered after 1-2x this long
FINISHED_GROUPS_KEPT = 256

__all__ = [
    "DEFAULT_PART_SIZE_BYTES",
    "AllreduceConfig",
    "AllreduceResult",
    "AllreduceService",
    "PartOutcome",
    "RoundHooks",
]


class AllreduceService:
    """Runs all-reduce rounds for one peer and serves the parts it owns.

    :param rpc_server: where the ``"allreduce"`` stream handler is registered (by :meth:`start`)
    :param rpc_client: opens streams to other members; must use the server's namespace
    :param peer_id: this peer (default: the server's daemon's peer id)
    :param max_message_bytes: largest chunk or RESULT a stream accepts; must exceed twice any
      ``part_size_bytes`` used
    :param round_wait_timeout: how long a stream that arrives before its round starts waits for it
    :param codec_threads: worker threads for codec work (0: run it on the event loop)
    :param admission: who may wait for rounds that have not started here (see :mod:`.admission`);
      set ``service.admission.is_listed`` to the matchmaking board's view of the swarm, so that
      members get slots that outsiders cannot take
    """

    def __init__(
        self,
        rpc_server: RPCServer,
        rpc_client: RPCClient,
        *,
        peer_id: PeerID | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        round_wait_timeout: float = DEFAULT_ROUND_WAIT_TIMEOUT,
        codec_threads: int = 2,
        admission: AdmissionConfig | None = None,
    ) -> None:
        if rpc_client.namespace != rpc_server.namespace:
            raise ConfigurationError(
                f"the client's namespace {rpc_client.namespace!r} differs from the server's {rpc_server.namespace!r}"
            )
        if not isinstance(round_wait_timeout, int | float) or not 0 < round_wait_timeout < math.inf:
            raise ConfigurationError(f"round_wait_timeout must be a positive number, got {round_wait_timeout!r}")
        if type(codec_threads) is not int or codec_threads < 0:
            raise ConfigurationError(f"codec_threads must be a non-negative int, got {codec_threads!r}")
        self.rpc_server, self.rpc_client = rpc_server, rpc_client
        self.peer_id = peer_id if peer_id is not None else rpc_server.p2p.peer_id
        self.limits = Limits(max_payload_bytes=max_message_bytes)
        self.round_wait_timeout = float(round_wait_timeout)
        self._executor = (
            concurrent.futures.ThreadPoolExecutor(codec_threads, thread_name_prefix="allreduce-codec")
            if codec_threads
            else None
        )
        self._rounds: dict[bytes, RoundRun] = {}
        self._arrivals: dict[bytes, asyncio.Event] = {}  # group id -> set when its round starts
        self._waiting: collections.Counter[bytes] = collections.Counter()
        self._finished: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._registered = False
        self.admission = EarlyAdmission(admission if admission is not None else AdmissionConfig())
        # called with a group id when a stream arrives before the local round of that group starts
        # (a groupmate began its round: the averager tells the step that waits for its trigger)
        self.on_early_stream: Callable[[bytes], None] | None = None

    async def start(self) -> None:
        """Registers the ``"allreduce"`` handler on the server."""
        config = HandlerConfig(
            limits=self.limits, max_timeout=MAX_ROUND_SECONDS, max_concurrent_calls=1024, max_calls_per_peer=64
        )
        await self.rpc_server.add_stream(HANDLER_NAME, self._handle, config=config)
        self._registered = True

    async def shutdown(self) -> None:
        """Removes the handler and stops the worker threads; idempotent. Rounds still running fail
        their remaining codec work with ClosedError (their callers should cancel them first)."""
        if self._registered:
            self._registered = False
            try:
                await self.rpc_server.remove(HANDLER_NAME)
            except (HivemindExtError, ConfigurationError, OSError) as e:  # the server or daemon may be gone
                logger.debug(f"could not remove the all-reduce handler: {e}")
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> AllreduceService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ----- running a round

    async def run_round(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        *,
        weight: float = 1.0,
        gather: Any = None,
        config: AllreduceConfig | None = None,
        deadline: float | None = None,
        hooks: RoundHooks | None = None,
        tensor_infos: Sequence[CompressionInfo] | None = None,
        out: Sequence[torch.Tensor] | None = None,
    ) -> AllreduceResult:
        """Averages ``tensors`` with the other members of ``group`` (see the module docstring).

        ``tensors`` are only read, and must not change until the round returns. The result holds
        new tensors, or ``out`` if given: tensors like the inputs (not overlapping them) to write
        the result into, which saves allocating (and page-faulting) fresh memory every round.

        :raises ConfigurationError: invalid arguments (non-float tensors, bad weight, unpackable gather)
        :raises AllreduceError: this peer is not a member of the group, or a round for it is running
        """
        context = self._new_context(group, tensors, weight, gather, config, deadline, hooks, tensor_infos, out)
        round_ = RoundRun(context, self.rpc_client)
        self._register(round_)
        try:
            result = await round_.run()
            predicted = predict_round_seconds(context.layout, group.members)
            return dataclasses.replace(
                result, predicted_seconds=predicted, timeout_seconds=context.config.allreduce_timeout
            )
        finally:
            self._unregister(round_)
            await round_.close()

    def _new_context(
        self,
        group: GroupInfo,
        tensors: Sequence[torch.Tensor],
        weight: float,
        gather: Any,
        config: AllreduceConfig | None,
        deadline: float | None,
        hooks: RoundHooks | None,
        tensor_infos: Sequence[CompressionInfo] | None,
        out: Sequence[torch.Tensor] | None,
    ) -> RoundContext:
        config = config if config is not None else AllreduceConfig()
        if not isinstance(config, AllreduceConfig):
            raise ConfigurationError(f"config must be an AllreduceConfig, got {type(config).__name__}")
        if not isinstance(weight, int | float) or isinstance(weight, bool) or not 0 <= weight < math.inf:
            raise ConfigurationError(f"weight must be a finite non-negative number, got {weight!r}")
        if deadline is not None and (not isinstance(deadline, int | float) or math.isnan(deadline)):
            raise ConfigurationError(f"deadline must be a number on the loop clock, got {deadline!r}")
        if 2 * config.part_size_bytes + 4096 > self.limits.max_payload_bytes:
            raise ConfigurationError(
                f"part_size_bytes={config.part_size_bytes} needs max_message_bytes of at least "
                f"{2 * config.part_size_bytes + 4096} (the service has {self.limits.max_payload_bytes})"
            )
        if not isinstance(group, GroupInfo) or not 0 < len(group.group_id) <= MAX_GROUP_ID_BYTES:
            raise ConfigurationError(f"group must be a GroupInfo with a group id of 1..{MAX_GROUP_ID_BYTES} bytes")
        me = _my_index(group, self.peer_id)
        specs = check_float_tensors(tensors)
        infos = _checked_infos(tensor_infos, len(specs))
        started = now()
        layout = None
        if specs or not group.members[me].auxiliary:  # an auxiliary member without tensors learns them
            try:
                layout = plan_round_layout(specs, group.members, config.part_size_bytes)
            except ConfigurationError as e:
                raise AllreduceError(f"group {group.group_id.hex()} cannot run: {e}") from e
        if config.adaptive_deadline:
            config = _with_round_timeout(config, predict_round_seconds(layout, group.members))
        return RoundContext(
            group_id=group.group_id,
            members=group.members,
            peers=group.peer_ids,
            me=me,
            config=config,
            hooks=hooks if hooks is not None else RoundHooks(),
            weight=float(weight),
            gather=pack_gather(gather, MAX_GATHER_BYTES),
            started=started,
            deadline=min(started + config.allreduce_timeout, deadline if deadline is not None else math.inf),
            tensors=RoundTensors(tensors, out),
            tensor_infos=infos,
            layout=layout,
            runner=CodecRunner(self._executor if config.offload_codecs else None),
            limits=self.limits,
        )

    def _register(self, round_: RoundRun) -> None:
        group_id = round_.context.group_id
        if group_id in self._rounds:
            raise AllreduceError(f"a round for group {group_id.hex()} is already running")
        self._rounds[group_id] = round_
        arrival = self._arrivals.pop(group_id, None)
        if arrival is not None:
            arrival.set()

    def _unregister(self, round_: RoundRun) -> None:
        group_id = round_.context.group_id
        if self._rounds.get(group_id) is round_:
            del self._rounds[group_id]
        self._finished[group_id] = None
        while len(self._finished) > FINISHED_GROUPS_KEPT:
            self._finished.popitem(last=False)

    # ----- serving streams

    async def _handle(self, requests: RequestStream, rpc: RPCContext) -> AsyncIterator[Message]:
        """The ``"allreduce"`` handler: routes a stream to its round by the group id in its JOIN."""
        try:
            first = await wait_until(
                requests.receive(), min(rpc.deadline, now() + FIRST_MESSAGE_TIMEOUT), "waiting for JOIN"
            )
        except HivemindExtError:
            return  # the stream broke or stayed silent: the serving layer reports what it can
        if first is None:
            return
        try:
            deadline = min(rpc.deadline, now() + self.round_wait_timeout)
            round_ = await self._find_round(parse_group_id(first), rpc.peer_id, deadline)
        except ProtocolError as e:
            yield refusal_message(str(e))
            return
        async for response in round_.serve(rpc.peer_id, first, requests):
            yield response

    async def _find_round(self, group_id: bytes, peer: PeerID, deadline: float) -> RoundRun:
        """The local round of ``group_id``, waiting until ``deadline`` for it to start if ``peer`` is
        admitted to wait (see :mod:`.admission`)."""
        round_ = self._rounds.get(group_id)
        if round_ is not None:
            return round_
        if group_id in self._finished:
            raise ProtocolError(f"the round of group {group_id.hex()} is over")
        ticket = self.admission.admit(peer, now())
        if ticket is None:
            # answered late, so that a requester that reopens at once costs little (its stream holds
            # one of its own call slots meanwhile, see HandlerConfig.max_calls_per_peer)
            delay = REFUSAL_DELAY * (1.0 + random.random())  # jittered: refused floods do not come back in step
            await asyncio.sleep(max(0.0, min(delay, deadline - now())))
            raise ProtocolError("too many streams from this peer for rounds that have not started here")
        try:
            return await self._wait_for_round(group_id, deadline)
        finally:
            self.admission.leave(ticket)

    async def _wait_for_round(self, group_id: bytes, deadline: float) -> RoundRun:
        while True:
            round_ = self._rounds.get(group_id)
            if round_ is not None:
                return round_
            if group_id in self._finished:
                raise ProtocolError(f"the round of group {group_id.hex()} is over")
            arrival = self._arrivals.get(group_id)
            if arrival is None:
                arrival = self._arrivals[group_id] = asyncio.Event()
                if self.on_early_stream is not None:
                    self.on_early_stream(group_id)
            self._waiting[group_id] += 1
            try:
                await wait_until(arrival.wait(), deadline, "waiting for the round to start")
            except DeadlineExceededError:
                raise ProtocolError(f"no round of group {group_id.hex()} started here in time") from None
            finally:
                self._waiting[group_id] -= 1
                if not self._waiting[group_id]:
                    del self._waiting[group_id]
                    if not arrival.is_set():
                        self._arrivals.pop(group_id, None)


def _with_round_timeout(config: AllreduceConfig, predicted: float | None) -> AllreduceConfig:
    """``config`` with the whole-round deadline the prediction sets (see :mod:`.round_time`), and the
    owners' collect deadline stretched in proportion."""
    seconds = round_timeout(predicted, config.allreduce_timeout)
    if seconds <= config.allreduce_timeout:
        return config
    scale = seconds / config.allreduce_timeout
    return dataclasses.replace(config, allreduce_timeout=seconds, collect_timeout=config.collect_timeout * scale)


def _my_index(group: GroupInfo, peer_id: PeerID) -> int:
    names = [member.peer_id for member in group.members]
    if len(set(names)) != len(names):
        raise AllreduceError(f"group {group.group_id.hex()} lists a member twice")
    try:
        return group.index_of(peer_id)
    except ValueError as e:
        raise AllreduceError(str(e)) from None


def _checked_infos(infos: Sequence[CompressionInfo] | None, count: int) -> Sequence[CompressionInfo] | None:
    if infos is None:
        return None
    infos = tuple(infos)
    if not all(isinstance(info, CompressionInfo) for info in infos):
        raise ConfigurationError("tensor_infos must be CompressionInfo objects")
    if count and len(infos) != count:
        raise ConfigurationError(f"{len(infos)} tensor_infos for {count} tensors")
    return infos
