"""DecentralizedAverager: average a set of tensors with whichever peers are online, again and again.

A drop-in for ``hivemind.averaging.DecentralizedAverager``: the same constructor keywords and the
methods a user calls (``step``, ``get_tensors``, ``get_current_state``, ``load_state_from_peers``,
``shutdown``, use as a context manager). Inside, it runs on a background thread's event loop
(hivemind uses a separate process): the peer's :class:`~hivemind_ext.p2p.runtime.PeerRuntime`,
shared with the peer's other averagers and its progress tracker, with one replica of the DHT's
libp2p daemon and one RPC server, on which it serves its handlers under ``averager.<prefix>``. Each step is matchmaking
(:mod:`.matchmaking`), then one butterfly all-reduce round (:mod:`.allreduce`) whose result is
applied to the tensors as ``tensor += alpha * (average - tensor_at_round_start)``, so updates the
user made to the tensors during the round are kept.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import torch
from hivemind import DHT
from hivemind.utils import get_dht_time

from hivemind_ext.averaging.allreduce.aggregators import DEFAULT_NORM_BOUND
from hivemind_ext.averaging.allreduce.service import (
    DEFAULT_PART_SIZE_BYTES,
    AllreduceConfig,
    AllreduceResult,
    AllreduceService,
)
from hivemind_ext.averaging.allreduce.throughput import ThroughputEstimator
from hivemind_ext.averaging.control import AveragingMode, AveragingStage, StepControl
from hivemind_ext.averaging.delta import apply_average
from hivemind_ext.averaging.matchmaking.confirmation import Confirmations
from hivemind_ext.averaging.matchmaking.group import GroupInfo
from hivemind_ext.averaging.matchmaking.group_key import check_group_bits, next_group_bits_of
from hivemind_ext.averaging.matchmaking.matchmaker import Matchmaker, MatchmakingConfig
from hivemind_ext.averaging.matchmaking.rotation import Coordinates, digits_without_group, next_digits
from hivemind_ext.averaging.round_stats import round_stats_of
from hivemind_ext.averaging.scratch import RoundBuffers, ScratchBuffers
from hivemind_ext.averaging.state_sharing import StateDonor, StateLoader, StateSharingConfig
from hivemind_ext.averaging.tensor_layout import TensorSpec
from hivemind_ext.compression import Codec, CompressionInfo, NoCompression
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import (
    AllreduceError,
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    HivemindExtError,
    MatchmakingError,
    StateLoadError,
)
from hivemind_ext.p2p.client import RPCClient
from hivemind_ext.p2p.deadlines import now as loop_now
from hivemind_ext.p2p.direct_server import DirectConfig
from hivemind_ext.p2p.direct_settings import DirectSettings
from hivemind_ext.p2p.runtime import PeerRuntime
from hivemind_ext.p2p.server import RPCServer
from hivemind_ext.p2p.tasks import TaskOwner

logger = logging.getLogger(__name__)

T = TypeVar("T")
NO_DEADLINE = 365 * 24 * 3600.0  # "no timeout": a step still gives up eventually
SIGNING_SETUP_TIMEOUT = 10.0  # how long the start waits for the DHT to take the record signing set-up


@dataclasses.dataclass(frozen=True)
class RoundReport:
    """What the last finished round did (for logs, tests and benchmarks).

    ``complete`` is False when the result is not the mean over every contributing member of the
    group: ``missing`` then says whose values are missing from some part, and why (a peer excluded
    as too slow, broken or hostile, or an owner whose part kept local values). Such a round still
    counts as a success (its step returns normally), as in hivemind, and is logged at WARNING.
    """

    group_size: int
    contributors: tuple[tuple[str, ...], ...]  # per part
    excluded: dict[str, str]
    bytes_sent: int
    bytes_received: int
    seconds: float
    missing: dict[str, str] = dataclasses.field(default_factory=dict)  # contributing members left out, why
    part_sizes: dict[str, int] = dataclasses.field(default_factory=dict)  # values each owner reduced
    receive_rate: float | None = None  # bytes/s this peer received at (None: too little data to tell)
    # the round's duration predicted from the members' declared throughputs (None: nobody declared
    # one), and how long it was allowed to take (allreduce_timeout, or 3x the prediction if longer)
    predicted_seconds: float | None = None
    timeout_seconds: float | None = None
    chunk_bytes: int | None = None  # the round's chunk size: part_size_bytes, or less on thin links
    # groupmate -> the path this peer's streams to it took: "direct" (encrypted), "direct-plaintext" or
    # "libp2p"; groupmates it opened no stream to (client-mode peers own no part) are not listed
    transports: dict[str, str] = dataclasses.field(default_factory=dict)
    # groupmate -> why the direct path to it failed (the typed error), for the pairs that fell back to libp2p
    direct_failures: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.missing


class DecentralizedAverager:
    """Averages ``averaged_tensors`` with peers found through ``dht`` under ``prefix``.

    :param averaged_tensors: the tensors to average; they are updated in place after each round
    :param dht: a running ``hivemind.DHT``; its libp2p daemon carries the all-reduce traffic
    :param start: start the background loop now (else call :meth:`run_in_background`)
    :param prefix: peers average only with peers that use the same prefix
    :param target_group_size: a group forms as soon as this many peers are ready
    :param min_group_size: after ``min_matchmaking_time``, a group of at least this many forms
    :param initial_group_bits: a string of '0' and '1': peers only average with peers whose prefix and
      group bits are the same; the bits move after every round (see :meth:`get_group_bits`). Without
      bits and with a ``target_group_size``, groups rotate on their own (Moshpit averaging, see
      :mod:`.matchmaking.rotation`): pass the swarm's size to :meth:`step` as ``expected_group_size``
      and peers also read only their shard's matchmaking board
    :param min_matchmaking_time: how long to wait for a full group (when step() has no scheduled_time)
    :param request_timeout: how long a peer may take to answer during matchmaking
    :param averaging_alpha: step size toward the average (1.0 = replace by the average)
    :param part_size_bytes: largest all-reduce chunk: parts are streamed and reduced in chunks of this
      size (default 2 MiB, larger than hivemind's 512 KiB: fewer, larger frames measured 20-30% faster on
      loopback), or smaller ones where the group declares thin links, so that the pipeline's tail stays
      short (``last_round.chunk_bytes``; see ``allreduce/layout.py``)
    :param allreduce_timeout: an all-reduce round gives up on missing peers after this many seconds,
      or after 3x its duration predicted from the group's measured throughputs where that is longer
      (``last_round.predicted_seconds`` / ``timeout_seconds``; see ``allreduce/round_time.py``)
    :param next_chunk_timeout: a peer whose stream moves no byte for this long while one is due is
      excluded from the round's part (an idle window: a slow link that keeps moving is waited for, up
      to ``allreduce_timeout``; see ``AllreduceConfig.next_chunk_timeout``). A round that leaves anyone
      out still succeeds, says so in ``last_round.missing`` / ``last_round.complete`` and logs a WARNING
    :param compression: the codec for all-reduce traffic (ours, or a hivemind codec object)
    :param state_compression: the codec for state downloads
    :param tensor_infos: CompressionInfo per tensor (keys and roles for adaptive codecs)
    :param bandwidth: this peer's bandwidth in Mbit/s, declared to its groups, whose part sizes
      minimize the round's predicted time (a slow peer gets a smaller part, or none). ``None`` (the
      default): the throughput this peer measured in its recent rounds (:attr:`throughput`), or,
      before its first round large enough to measure, the group's mean. A group where every peer
      passes it may use any common unit, as in hivemind. Bandwidths within a factor 2 of the
      group's median count as equal (measurements are that noisy), see ``allreduce/partition.py``.
      At most ``MAX_BANDWIDTH`` (1e9; a larger, non-finite or negative value is a ConfigurationError
      here; a larger one declared by another peer counts as 1e9)
    :param auxiliary: help reduce without contributing tensors
    :param allow_state_sharing: serve state to newcomers (default: unless client mode or auxiliary)
    :param client_mode: accept no incoming connections (default: the DHT's mode)
    :param shutdown_timeout: how long shutdown waits for background work
    :param direct_data_path: on by default (``True``): all-reduce streams and state downloads go
      over direct TCP connections between peers that can reach each other, encrypted (AES-GCM)
      with session keys handed out over their authenticated libp2p channel (see
      ``hivemind_ext.p2p.direct_records``),
      and over libp2p for every pair where no direct connection can be made (client mode, NAT, a
      firewall), or where either peer declared a thin link (below 150 Mbit/s: there libp2p's
      long-lived connections share the link better, see ``allreduce/paths.py``);
      ``last_round.transports`` says which pair used which. It saves the daemons' copies,
      which dominate the CPU cost of large rounds on fast links. ``True`` listens on the address of
      the DHT's ``host_maddrs`` and offers its ``announce_maddrs`` (see
      ``hivemind_ext.p2p.direct_address``); an IP address string listens there; a ``DirectConfig``
      sets everything; ``False`` or ``None`` turns it off (libp2p only). A client-mode peer listens
      on nothing but still dials others directly.
    :param direct_plaintext: explicit opt-in to plain TCP on the direct path, for loopback or
      trusted networks only: this peer serves plaintext and also uses peers that serve plaintext
      (still authenticated through libp2p, but anyone on the path can read and alter the data).
      Peers without it reach this one over libp2p.
    :param fingerprint: the run's fingerprint digest: matchmaking groups this peer only with peers
      that declare the same one (or none); see ``MatchmakingConfig.fingerprint``
    :param require_agreement: download a state only if several donors serve it bitwise identical
      (see ``StateSharingConfig.require_agreement``); for peers whose states should be identical
    :param reject_non_finite_state: a downloaded chunk holding NaN or Inf bans its donor (see
      ``StateSharingConfig.reject_non_finite``)
    :param aggregator: how the owner of each part combines the group's contributions: None (the
      weighted mean), or a robust one: ``CenteredClip()`` (radius from each part's spread) or ``CenteredClip(tau=...)``,
      ``TrimmedMean(trim=...)`` (from ``hivemind_ext.averaging``); every member of a group should
      use the same. From an Optimizer: ``averager_opts=dict(aggregator=...)``
    :param norm_bound: a contribution whose norm on a part exceeds this many times the median of
      the group's norms is excluded from that part (reported in ``last_round.excluded``, logged at
      WARNING); on by default (100x) with any aggregator, ``None`` turns it off
    :param rotation: rotation coordinates (rotating groups, see :mod:`.matchmaking.rotation`) shared
      with this peer's other averagers whose rounds take turns with this one's: every round of any of
      them moves them (the Optimizer shares one between its gradient and parameter rounds); default:
      this averager's own
    """

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: DHT,
        *,
        start: bool,
        prefix: str,
        target_group_size: int | None = None,
        min_group_size: int = 2,
        initial_group_bits: str = "",
        min_matchmaking_time: float = 5.0,
        request_timeout: float = 3.0,
        averaging_alpha: float = 1.0,
        part_size_bytes: int = DEFAULT_PART_SIZE_BYTES,
        allreduce_timeout: float | None = None,
        next_chunk_timeout: float | None = None,
        sender_timeout: float | None = None,
        reducer_timeout: float | None = None,
        compression: Any = None,
        state_compression: Any = None,
        tensor_infos: Sequence[CompressionInfo] | None = None,
        bandwidth: float | None = None,
        min_vector_size: int = 0,
        auxiliary: bool = False,
        allow_state_sharing: bool | None = None,
        declare_state_period: float = 30,
        client_mode: bool | None = None,
        daemon: bool = True,
        shutdown_timeout: float = 5,
        direct_data_path: bool | str | DirectConfig | None = True,
        direct_plaintext: bool = False,
        fingerprint: str = "",
        require_agreement: bool = False,
        reject_non_finite_state: bool = False,
        aggregator: Any = None,
        norm_bound: float | None = DEFAULT_NORM_BOUND,
        rotation: Coordinates | None = None,
    ):
        del min_vector_size, daemon  # hivemind internals with no meaning here
        self._group_bits = check_group_bits(initial_group_bits)  # see get_group_bits
        # rotation coordinates, set at start (they derive from the peer id); shared with the peer's other
        # averagers given the same object (see .matchmaking.rotation, "One rotation per peer")
        self._rotation = rotation if rotation is not None else Coordinates()
        tensors = list(averaged_tensors)
        _check_tensors(tensors)
        if client_mode is None:
            client_mode = bool(dht.client_mode)
        if client_mode and auxiliary:
            raise ConfigurationError("an auxiliary peer must accept incoming connections: drop client_mode")
        if allow_state_sharing is None:
            allow_state_sharing = not client_mode and not auxiliary
        if allow_state_sharing and client_mode:
            raise ConfigurationError("a client-mode peer cannot share its state (it accepts no connections)")
        if not (isinstance(averaging_alpha, int | float) and math.isfinite(averaging_alpha) and averaging_alpha > 0):
            raise ConfigurationError(f"averaging_alpha must be a positive number, got {averaging_alpha!r}")
        self.dht, self.prefix = dht, prefix
        self.client_mode, self.auxiliary = client_mode, auxiliary
        self.averaging_alpha, self.shutdown_timeout = float(averaging_alpha), shutdown_timeout
        # validated here (constructing a config checks the address); the address of ``True`` is chosen at start
        self._direct = DirectSettings.of(direct_data_path, plaintext=direct_plaintext)
        self.compression: Codec = as_codec(compression if compression is not None else NoCompression())
        self.state_compression: Codec = as_codec(
            state_compression if state_compression is not None else NoCompression()
        )
        self.tensor_infos = (
            tuple(tensor_infos)
            if tensor_infos is not None
            else tuple(CompressionInfo.from_tensor(t, key=i) for i, t in enumerate(tensors))
        )
        self.matchmaking_config = MatchmakingConfig(
            prefix=prefix,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            client_mode=client_mode,
            auxiliary=auxiliary,
            bandwidth=bandwidth,
            fingerprint=fingerprint,
        )
        self.allreduce_config = AllreduceConfig(
            compression=self.compression,
            part_size_bytes=part_size_bytes,
            allreduce_timeout=allreduce_timeout,
            next_chunk_timeout=next_chunk_timeout if next_chunk_timeout is not None else sender_timeout,
            aggregator=aggregator,
            norm_bound=norm_bound,
        )
        del reducer_timeout  # one per-chunk timeout covers both directions here
        self.state_sharing_config = StateSharingConfig(
            prefix=prefix,
            allow_state_sharing=allow_state_sharing,
            client_mode=client_mode,
            load_state_compression=self.state_compression,
            declare_state_period=declare_state_period,
            snapshot_reuse_time=0.0,  # like hivemind: get_current_state once per download, a copy as of it
            require_agreement=require_agreement,
            reject_non_finite=reject_non_finite_state,
        )
        self._allow_state_sharing = allow_state_sharing
        self._state_sharing_priority = 0
        self._donor: StateDonor | None = None
        self._loader: StateLoader | None = None
        self._averaged_tensors = tensors
        self._scratch = ScratchBuffers()  # each round's working tensors, reused from round to round
        self._lock = threading.RLock()  # held while tensors are read or written by either side
        self._runtime: PeerRuntime | None = None
        self._tasks: TaskOwner | None = None  # steps and downloads in flight, cancelled at shutdown
        self._matchmaker: Matchmaker | None = None
        self._service: AllreduceService | None = None
        self._server: RPCServer | None = None  # this averager's scope of the runtime's RPC server
        self._awaiting_trigger: dict[bytes, StepControl] = {}  # group id -> step waiting for its trigger
        self.last_round: RoundReport | None = None
        # this peer's measured throughput, declared as its bandwidth unless the user passed one
        self.throughput = ThroughputEstimator()
        # True: updates made to the tensors while a round runs are kept (tensor += average - start);
        # subclasses whose tensors nobody touches during a round set False to copy the average exactly
        self.keep_concurrent_updates = True
        self.last_updated: float = get_dht_time()
        if start:
            self.run_in_background()

    # ----- lifecycle

    @property
    def peer_id(self) -> Any:
        return self.dht.peer_id

    @property
    def mode(self) -> AveragingMode:
        """CLIENT for a client-mode peer, AUX for an auxiliary one, else NODE (as in hivemind)."""
        if self.client_mode:
            return AveragingMode.CLIENT
        return AveragingMode.AUX if self.auxiliary else AveragingMode.NODE

    @property
    def total_size(self) -> int:
        return sum(t.numel() for t in self._averaged_tensors)

    @property
    def allow_state_sharing(self) -> bool:
        """Whether newcomers may download this peer's state (settable, like hivemind's)."""
        return self._allow_state_sharing

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if value and self.client_mode:
            raise ConfigurationError("a client-mode peer cannot share its state (it accepts no connections)")
        self._allow_state_sharing = bool(value)
        if self._donor is not None:
            self._donor.allow_state_sharing = bool(value)

    @property
    def state_sharing_priority(self) -> int:
        """Newcomers download from the peers with the highest priority (e.g. the training epoch)."""
        return self._state_sharing_priority

    @state_sharing_priority.setter
    def state_sharing_priority(self, value: int) -> None:
        self._state_sharing_priority = int(value)
        if self._donor is not None:
            self._donor.set_version(int(value))

    @property
    def declared_bandwidth(self) -> float | None:
        """The bandwidth (Mbit/s) this peer declares to its next group: the ``bandwidth`` it was given,
        else its measured :attr:`throughput` (None before the first measured round: the group's mean)."""
        given = self.matchmaking_config.bandwidth
        return given if given is not None else self.throughput.mbit_per_s

    @property
    def runtime(self) -> PeerRuntime | None:
        """The peer runtime this averager runs on (None unless it runs)."""
        return self._runtime

    @property
    def rpc_client(self) -> RPCClient | None:
        """The client this averager's rounds call groupmates with (None unless it runs); its
        ``direct`` connector tells which groupmates the direct data path failed for."""
        return self._service.rpc_client if self._service is not None else None

    @property
    def donor(self) -> StateDonor | None:
        """What serves this peer's state to newcomers (its ``stats`` and ``serving``); None unless the
        averager runs, and always None in client mode (a client-mode peer serves nothing)."""
        return self._donor

    @property
    def scratch_buffers(self) -> ScratchBuffers:
        """The tensors this averager's rounds work in, kept from one round to the next (read-only)."""
        return self._scratch

    def is_alive(self) -> bool:
        runtime = self._runtime
        return runtime is not None and not runtime.closed and runtime.loop_thread.alive

    def run_in_background(self, await_ready: bool = True, timeout: float | None = None) -> None:
        """Joins the peer's runtime, registers the RPC handlers and joins the DHT-side services."""
        if self._runtime is not None:
            raise RuntimeError("the averager is already running")
        self._runtime = runtime = PeerRuntime.acquire(self.dht)
        self._tasks = TaskOwner(f"averager[{self.prefix}]")
        future = runtime.submit(self._start_services(runtime))
        if await_ready:
            try:
                future.result(timeout if timeout is not None else 60.0)
            except BaseException:
                self.shutdown()
                raise

    async def _start_services(self, runtime: PeerRuntime) -> None:
        p2p = await runtime.start_network()
        namespace = f"averager.{self.prefix}"
        self._server = runtime.server.scope(namespace)
        direct_server = None
        if not self.client_mode:  # a client-mode peer accepts nothing
            direct_server = await self._direct.server_config(self.dht, p2p)
        if direct_server is not None:
            await self._server.enable_direct(direct_server)
        client = RPCClient(p2p, namespace, prefer_direct=self._direct.enabled, direct_config=self._direct.client_config)
        self._service = AllreduceService(self._server, client, peer_id=p2p.peer_id)
        self._service.on_early_stream = self._on_early_stream
        await self._service.start()
        dht_calls = runtime.dht_calls
        # members confirm their group with its leader by one call (a plain libp2p client: tiny messages)
        confirmations = Confirmations(RPCClient(p2p, namespace), None if self.client_mode else self._server)
        await confirmations.start()
        self._matchmaker = Matchmaker(
            self.matchmaking_config,
            dht=self.dht,
            peer_id=p2p.peer_id,
            dht_calls=dht_calls,
            on_read=round_stats_of(runtime).record_board_read,
            confirmations=confirmations,
        )
        target = self.matchmaking_config.target_group_size
        if target is not None and target >= 2:  # rotating groups (see .matchmaking.rotation); bits take precedence
            self._rotation.start(p2p.peer_id.to_base58(), target)
        self._service.admission.is_listed = self._matchmaker.lists  # members' early streams get reserved slots
        with contextlib.suppress(MatchmakingError):  # the first search sets signing up then
            await self._matchmaker.prepare(timeout=max(SIGNING_SETUP_TIMEOUT, self.matchmaking_config.request_timeout))
        self._looking = asyncio.Lock()  # concurrent steps look for groups one after another
        self._loader = StateLoader(
            self.state_sharing_config,
            dht=self.dht,
            p2p=p2p,
            dht_calls=dht_calls,
            direct=self._direct.client_config if self._direct.enabled else None,
        )
        if not self.client_mode:  # a client-mode peer can never serve: it accepts no connections
            self._donor = StateDonor(
                self.state_sharing_config,
                dht=self.dht,
                p2p=p2p,
                server=runtime.server,
                dht_calls=dht_calls,
                get_state=self.get_current_state,
                version=self._state_sharing_priority,
                state_lock=self._lock,  # the donor copies what get_current_state returns under get_tensors()'s lock
                direct=self._server if direct_server is not None else None,  # one listener, one port
            )
            self._donor.allow_state_sharing = self._allow_state_sharing
            await self._donor.start()

    async def _stop_services(self, tasks: TaskOwner | None) -> None:
        """Stops what this averager started on the shared runtime (the runtime itself stops at its
        last release): its steps and downloads in flight, then its services and handlers."""
        stops: list[Callable[[], Awaitable[None]]] = []
        if tasks is not None:  # (not `tasks and ...`: an owner with no task is falsy)
            stops.append(lambda: tasks.aclose(timeout=self.shutdown_timeout))
        if self._donor is not None:
            stops.append(functools.partial(self._donor.shutdown, timeout=self.shutdown_timeout))
        if self._service is not None:
            stops.append(self._service.shutdown)
        if self._server is not None:
            stops.append(functools.partial(self._server.shutdown, timeout=self.shutdown_timeout))
        for stop in stops:
            try:
                await stop()
            except (HivemindExtError, OSError) as e:  # OSError: the daemon is gone already
                logger.debug(f"error while shutting the averager down: {e!r}")
        # the direct connections kept idle for the next calls (see p2p.direct_client)
        if self._service is not None:
            self._service.rpc_client.close()
        if self._loader is not None:
            self._loader.client.close()

    def shutdown(self) -> None:
        """Stops background work and releases the peer runtime; pending steps fail with an error.
        Idempotent."""
        runtime, self._runtime = self._runtime, None
        tasks, self._tasks = self._tasks, None
        if runtime is None:
            return
        try:
            if runtime.loop_thread.alive:
                with contextlib.suppress(HivemindExtError, TimeoutError):
                    runtime.run(self._stop_services(tasks), timeout=3 * self.shutdown_timeout + 1)
        finally:
            runtime.release()

    def __enter__(self) -> DecentralizedAverager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # ----- group keys

    def get_group_bits(self, wait: bool = True) -> str | concurrent.futures.Future[str]:
        """This peer's current group bits (without the prefix); a done future if ``wait`` is False.

        Peers only group with peers whose prefix and group bits are the same. After every group it
        joins, a peer with bits moves to the next key of hivemind's rotation (Moshpit averaging, see
        :mod:`.matchmaking.group_key`), unless :meth:`set_group_bits` sets them again.
        """
        return self._group_bits if wait else _done(self._group_bits)

    def set_group_bits(self, group_bits: str, wait: bool = True) -> concurrent.futures.Future[None] | None:
        """Use these group bits (a string of '0' and '1') from the next search for a group on; a
        search in progress keeps the key it started with. Returns a done future if ``wait`` is False."""
        self._group_bits = check_group_bits(group_bits)
        return None if wait else _done(None)

    def _move_group_bits(self, group: GroupInfo) -> None:
        """After a group assembled: the next key of the rotation (no-op without group bits)."""
        me = self._matchmaker.peer_id.to_base58() if self._matchmaker is not None else str(self.peer_id)
        members, target = [m.peer_id for m in group.members], self.matchmaking_config.target_group_size
        self._group_bits = next_group_bits_of(self._group_bits, group.group_id, members, me, target)
        rotation = self._rotation
        if rotation.digits and target is not None:
            rotation.digits = next_digits(rotation.digits, group.group_id, members.index(me), len(members), target)

    def _move_digits_alone(self) -> None:
        """After a search that found no group: rotating coordinates move as a group of one would
        (:func:`.matchmaking.rotation.digits_without_group`), so that a peer left over does not come
        last in the same shard again next round."""
        target = self.matchmaking_config.target_group_size
        rotation = self._rotation
        if rotation.digits and target is not None and self._matchmaker is not None:
            rotation.digits = digits_without_group(rotation.digits, self._matchmaker.peer_id.to_base58(), target)

    # ----- tensors and state

    @contextlib.contextmanager
    def get_tensors(self) -> Iterator[Sequence[torch.Tensor]]:
        """The averaged tensors, which the averager will not modify while this block runs."""
        with self._lock:
            yield self._averaged_tensors

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], Sequence[CompressionInfo]]:
        """What a newcomer downloads: (small metadata, tensors, infos). Subclasses override it.

        Called once per download (in a worker thread), as hivemind does. The tensors may be live, as
        here: right after the call the donor copies them while holding the lock of
        :meth:`get_tensors`, so a state changed in place under that lock is served as of one moment.
        """
        with self.get_tensors() as tensors:
            return {"prefix": self.prefix}, list(tensors), self.tensor_infos

    def expected_state_tensors(self) -> Sequence[TensorSpec] | None:
        """The shapes that a downloaded state's first tensors must have, checked against a donor's
        manifest before anything is pulled (None: no check). Subclasses that know their state override it."""
        return None

    def check_downloaded_state(self, metadata: Any, tensors: list[torch.Tensor]) -> None:
        """Refuses a downloaded state (raises StateLoadError, e.g. UntrustedStateError) before it is
        returned; the donors that served it are then skipped for a while and others are asked. Runs in
        a worker thread. Subclasses that know their state override it (default: accept anything)."""

    def load_state_from_peers(
        self, wait: bool = True, timeout: float | None = None
    ) -> tuple[Any, list[torch.Tensor]] | None:
        """Downloads the newest state (metadata, tensors) that other peers share, or None if nobody does.

        Like hivemind, this only returns the state: the caller decides how to apply it. If donors
        exist but every download failed, the failure is logged and None is returned.

        :param wait: block for the result; else return a ``concurrent.futures.Future``
        :param timeout: give up after this many seconds (default: 600)
        """
        if not self.is_alive() or self._loader is None or self._runtime is None:
            raise RuntimeError("the averager is not running: pass start=True or call run_in_background()")
        future = self._runtime.submit(self._owned(self._load_state(timeout)))
        return future.result() if wait else future

    async def _owned(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs ``coro`` in the current task, owned by this averager: its shutdown cancels the task
        (the loop it runs on is shared, and outlives the averager)."""
        tasks, task = self._tasks, asyncio.current_task()
        if tasks is None or task is None:
            coro.close()
            raise ClosedError("the averager is shut down")
        try:
            tasks.adopt(task, report_errors=False)
        except ClosedError:
            coro.close()
            raise
        return await coro

    async def _load_state(self, timeout: float | None) -> tuple[Any, list[torch.Tensor]] | None:
        assert self._loader is not None
        try:
            return await self._loader.load_state_from_peers(
                timeout=timeout, expected_tensors=self.expected_state_tensors(), validate=self.check_downloaded_state
            )
        except StateLoadError as e:
            logger.warning(f"could not download the state from peers: {e}")
            return None

    # ----- averaging

    def step(
        self,
        gather: Any = None,
        scheduled_time: float | None = None,
        weight: float | None = None,
        timeout: float | None = None,
        allow_retries: bool = True,
        require_trigger: bool = False,
        wait: bool = True,
        expected_group_size: int | None = None,
    ) -> dict[Any, Any] | StepControl:
        """Finds a group and averages with it once.

        :param gather: small msgpack-able metadata sent to every groupmate; the result maps each
          member's peer id to what it sent
        :param scheduled_time: DHT time at which to start the all-reduce even if the group is not full
        :param weight: this peer's weight in the average (default 1, auxiliary peers 0)
        :param timeout: give up if no group is found within this many seconds
        :param allow_retries: on a failed round, look for another group until ``timeout``
        :param require_trigger: wait for ``control.allow_allreduce()`` before the all-reduce (needs wait=False)
        :param expected_group_size: how many contributing (not auxiliary) peers to expect (without
          ``target_group_size``): the group forms as soon as that many are looking, instead of at
          ``scheduled_time``. With ``target_group_size``: the swarm's size, which chooses this peer's
          matchmaking shard (see :mod:`.matchmaking.rotation`)
        :param wait: block until done and return the gathered data; else return a StepControl
        :raises MatchmakingError, AllreduceError: (with wait=True) when the step fails
        """
        if not self.is_alive():
            raise RuntimeError("the averager is not running: pass start=True or call run_in_background()")
        if wait and require_trigger:
            raise ConfigurationError("a step that waits cannot also wait for a trigger: pass wait=False")
        if weight is None:
            weight = 0.0 if self.auxiliary else 1.0
        elif self.auxiliary and weight:
            logger.warning("auxiliary peers contribute no tensors: their weight is ignored")
            weight = 0.0
        now = get_dht_time()
        deadline = now + (timeout if timeout is not None else NO_DEADLINE)
        if scheduled_time is None:
            scheduled_time = min(now + self.matchmaking_config.min_matchmaking_time, deadline - 1e-3)
        control = StepControl(
            scheduled_time=scheduled_time,
            deadline=deadline,
            allow_retries=allow_retries,
            weight=weight,
            gather=gather,
            expected_group_size=expected_group_size,
        )
        if not require_trigger:
            control.allow_allreduce()
        assert self._runtime is not None
        task_future = self._runtime.submit(self._owned(self._run_step(control)))

        def settle_if_never_ran(future: Any) -> None:  # e.g. shut down between is_alive() and submit
            if future.cancelled() or future.exception() is not None:
                _settle(control, exception=AllreduceError("the averager stopped"))

        task_future.add_done_callback(settle_if_never_ran)
        control.add_done_callback(lambda c: task_future.cancel() if c.cancelled() else None)
        return control.result() if wait else control

    async def _run_step(self, control: StepControl) -> None:
        control.bind_to_running_loop()
        try:
            while True:
                try:
                    gathered = await self._attempt(control)
                except (MatchmakingError, AllreduceError, DeadlineExceededError) as e:
                    if not control.allow_retries or get_dht_time() >= control.deadline or control.done():
                        self._record_result(ok=False)
                        _settle(control, exception=e)
                        return
                    logger.info(f"averaging round failed ({e}); looking for another group")
                    continue
                self._record_result(ok=True)
                _settle(control, result=gathered)
                return
        except BaseException as e:
            if isinstance(e, Exception):
                self._record_result(ok=False)
            _settle(control, exception=e if isinstance(e, Exception) else AllreduceError("the averager stopped"))
            raise
        finally:
            control.stage = AveragingStage.FINISHED

    async def _attempt(self, control: StepControl) -> dict[Any, Any]:
        assert self._matchmaker is not None and self._service is not None
        control.stage = AveragingStage.LOOKING_FOR_GROUP
        async with self._looking:
            try:
                group = await self._matchmaker.look_for_group(
                    deadline=control.deadline,
                    scheduled_time=control.scheduled_time,
                    expected_group_size=control.expected_group_size,
                    group_bits=self._group_bits,
                    digits=() if self._group_bits else self._rotation.digits,
                    bandwidth=self.declared_bandwidth,
                )
            except MatchmakingError:
                self._move_digits_alone()
                raise
        self._move_group_bits(group)
        if not control.triggered:
            control.stage = AveragingStage.AWAITING_TRIGGER
            self._awaiting_trigger[group.group_id] = control
            try:
                await control.wait_for_trigger()
            finally:
                self._awaiting_trigger.pop(group.group_id, None)
        control.stage = AveragingStage.RUNNING_ALLREDUCE
        buffers: RoundBuffers = ([], [])
        if not self.auxiliary:
            with self._lock:
                buffers = self._scratch.lend(self._averaged_tensors)
                for buffer, tensor in zip(buffers[0], self._averaged_tensors, strict=True):
                    buffer.copy_(tensor.detach())
        start_values, outputs = buffers
        started, opened_after = get_dht_time(), loop_now()
        try:
            result: AllreduceResult = await self._service.run_round(
                group,
                start_values,
                weight=control.weight,
                gather=control.gather,
                config=self.allreduce_config,
                tensor_infos=self.tensor_infos,
                out=outputs if outputs else None,
            )
            # a group with at most one contributor (the others auxiliary) has nothing to average: its
            # round succeeds with the contributor's own values, as in hivemind
            contributors = sum(not member.auxiliary for member in group.members)
            if contributors > 1 and not any(len(part.contributors) > 1 for part in result.parts):
                raise AllreduceError(f"the round with {group.size} peers averaged nothing: {result.excluded}")
            if not self.auxiliary:
                with self._lock:  # the outputs are this round's scratch tensors: the delta goes in place
                    apply_average(
                        self._averaged_tensors,
                        result.tensors,
                        start_values,
                        alpha=self.averaging_alpha,
                        in_place=True,
                        keep_concurrent_updates=self.keep_concurrent_updates,
                    )
                self.last_updated = get_dht_time()
        finally:  # run_round returns (or raises) only once nothing writes into the outputs any more
            if start_values:
                self._scratch.give_back(buffers)  # one assignment: no lock (a user may hold it a while)
        self.last_round = RoundReport(
            group_size=group.size,
            contributors=tuple(tuple(str(p) for p in part) for part in result.contributors),
            excluded={str(peer): reason for peer, reason in result.excluded.items()},
            bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received,
            seconds=get_dht_time() - started,
            missing={str(peer): reason for peer, reason in result.missing.items()},
            part_sizes={str(part.owner): part.end - part.start for part in result.parts},
            receive_rate=result.receive_rate,
            predicted_seconds=result.predicted_seconds,
            timeout_seconds=result.timeout_seconds,
            chunk_bytes=result.chunk_bytes,
            **self._transports_since(opened_after),
        )
        self.throughput.update(result.receive_rate)
        control.report = self.last_round
        if not self.last_round.complete and not self.auxiliary:
            missing = "; ".join(f"{peer}: {reason}" for peer, reason in sorted(self.last_round.missing.items()))
            logger.warning(
                f"{self.prefix}: the round of {group.size} peers is NOT the mean over the whole group: "
                f"{len(self.last_round.missing)} peer(s) missing from some part ({missing})"
            )
        if self._runtime is not None:
            round_stats_of(self._runtime).record_allreduce(
                seconds=self.last_round.seconds, bytes_sent=result.bytes_sent, bytes_received=result.bytes_received
            )
        return result.gathered

    def _transports_since(self, moment: float) -> dict[str, dict[str, str]]:
        """Which path this peer's streams of the round took, per groupmate, and why direct ones failed."""
        client = self.rpc_client
        if client is None:
            return {}
        transports = client.transports_since(moment)
        failures = {}
        for peer, transport in transports.items():
            failure = client.direct.last_failure(peer) if client.direct is not None else None
            if transport == "libp2p" and failure is not None:
                failures[str(peer)] = f"{type(failure).__name__}: {failure}"
        return {
            "transports": {str(peer): transport for peer, transport in transports.items()},
            "direct_failures": failures,
        }

    def _record_result(self, ok: bool) -> None:
        """Counts one finished step in the peer's :func:`~hivemind_ext.averaging.round_stats.round_stats_of`."""
        if self._runtime is not None:
            round_stats_of(self._runtime).record_result(ok)

    def _on_early_stream(self, group_id: bytes) -> None:
        control = self._awaiting_trigger.get(group_id)
        if control is not None:
            control.mark_groupmate_started()


def _done(value: T) -> concurrent.futures.Future[T]:
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return future


def _settle(control: StepControl, *, result: Any = None, exception: BaseException | None = None) -> None:
    if control.done():
        return
    if exception is not None:
        control.set_exception(exception)
    else:
        control.set_result(result)


def _check_tensors(tensors: list[torch.Tensor]) -> None:
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ConfigurationError("averaged_tensors must be torch tensors")
    for t in tensors:
        if not t.dtype.is_floating_point:
            raise ConfigurationError(f"averaged tensors must be floating point, got {t.dtype}")
        if t.requires_grad and t.is_leaf:
            raise ConfigurationError("pass tensors detached from autograd (e.g. [p.detach() for p in params])")
