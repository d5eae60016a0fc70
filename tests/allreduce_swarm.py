"""A swarm of real peers on 127.0.0.1 for the all-reduce tests, and reference results to check against.

Starting a daemon takes a fraction of a second, so a test module starts one :class:`Swarm` (its own
event loop, its daemons and services) and every test runs its coroutines on it; each round uses a
fresh random group id, so rounds never see each other. Tests that kill a daemon add a fresh peer.

:func:`check_round` is the core assertion: every part a peer reports as averaged holds exactly the
weighted mean, over the contributors it reports, of those contributors' inputs; every other part
holds the peer's own inputs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Coroutine, Sequence
from typing import Any

import pytest
import torch
from hivemind.p2p import P2P, PeerID
from swarm import new_test_loop

from hivemind_ext.averaging.allreduce.service import AllreduceConfig, AllreduceResult, AllreduceService, RoundHooks
from hivemind_ext.averaging.matchmaking.group import GroupInfo, Member
from hivemind_ext.p2p import DirectConfig, RPCClient, RPCServer

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NAMESPACE = "allreduce_test"
ALLREDUCE_MODULES = ("allreduce", "allreduce_run", "allreduce_owner", "allreduce_sender", "allreduce_round")


@dataclasses.dataclass
class Peer:
    p2p: P2P
    server: RPCServer
    service: AllreduceService

    @property
    def peer_id(self) -> PeerID:
        return self.p2p.peer_id

    @property
    def name(self) -> str:
        return self.p2p.peer_id.to_base58()

    def member(self, *, bandwidth: float | None = None, client_mode: bool = False, auxiliary: bool = False) -> Member:
        return Member(self.name, "attempt", bandwidth, client_mode, auxiliary)


class Swarm:
    """``size`` peers with running all-reduce services, on an event loop owned by this object."""

    def __init__(self, size: int, *, round_wait_timeout: float = 1.0, direct: DirectConfig | None = None) -> None:
        self.loop = new_test_loop()
        self.round_wait_timeout = round_wait_timeout
        self.direct = direct  # every peer serves and uses the direct data path with these settings
        self.peers: list[Peer] = []
        self.extra: list[Peer] = []
        self.run(self._start(size), timeout=60)

    async def _start(self, size: int) -> None:
        for _ in range(size):
            self.peers.append(await self.new_peer())

    async def new_peer(self, direct: DirectConfig | None = None) -> Peer:
        """A fresh peer (serving the direct path with ``direct``, default: the swarm's settings)."""
        direct = direct if direct is not None else self.direct
        initial = await self.peers[0].p2p.get_visible_maddrs() if self.peers else []
        p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=initial)
        server = RPCServer(p2p, NAMESPACE)
        if direct is not None:
            await server.enable_direct(direct)
        client = RPCClient(p2p, NAMESPACE, prefer_direct=direct is not None)
        service = AllreduceService(server, client, round_wait_timeout=self.round_wait_timeout)
        await service.start()
        peer = Peer(p2p, server, service)
        if self.peers:
            self.extra.append(peer)
        return peer

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60) -> Any:
        async def bounded() -> Any:
            try:
                return await asyncio.wait_for(coro, timeout)
            finally:
                await asyncio.sleep(0)  # let callbacks of finished streams run before the loop pauses

        return self.loop.run_until_complete(bounded())

    def leftover_tasks(self) -> list[asyncio.Task[Any]]:
        """Tasks still running code of the all-reduce modules (there must be none between rounds)."""
        return self.loop.run_until_complete(_leftovers())

    def close(self) -> None:
        async def stop() -> None:
            for peer in self.peers + self.extra:
                with contextlib.suppress(Exception):
                    await peer.service.shutdown()
                    await peer.server.shutdown()
                with contextlib.suppress(Exception):
                    await peer.p2p.shutdown()

        try:
            self.loop.run_until_complete(stop())
        finally:
            self.loop.close()


def swarm_fixtures(size: int = 4) -> tuple[Any, Any]:
    """A test module's fixtures, to assign at its top level: ``swarm`` (one :class:`Swarm` of ``size``
    peers for the whole module) and the autouse ``no_leftover_tasks`` (checked after every test)."""

    @pytest.fixture(scope="module")
    def swarm():
        swarm = Swarm(size)
        yield swarm
        swarm.close()

    @pytest.fixture(autouse=True)
    def no_leftover_tasks(swarm):
        yield
        assert not swarm.leftover_tasks(), "a round left tasks running"

    return swarm, no_leftover_tasks


async def _leftovers(grace: float = 3.0) -> list[asyncio.Task[Any]]:
    give_up = time.monotonic() + grace
    while True:
        found = [task for task in asyncio.all_tasks() if task is not asyncio.current_task() and _in_allreduce(task)]
        if not found or time.monotonic() > give_up:
            return found
        await asyncio.sleep(0.02)


def _in_allreduce(task: asyncio.Task[Any]) -> bool:
    awaitable: Any = task.get_coro()
    while awaitable is not None:
        code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "ag_code", None)
        if code is not None and any(code.co_filename.endswith(f"averaging/{m}.py") for m in ALLREDUCE_MODULES):
            return True
        awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    return False


def group_of(members: Sequence[Member]) -> GroupInfo:
    return GroupInfo(os.urandom(16), tuple(members))


def make_tensors(shapes: Sequence[tuple[int, ...]], seed: int, dtypes: Sequence[torch.dtype] | None = None):
    generator = torch.Generator().manual_seed(seed)
    dtypes = dtypes or [torch.float32] * len(shapes)
    return [torch.randn(shape, generator=generator).to(dtype) for shape, dtype in zip(shapes, dtypes, strict=True)]


@dataclasses.dataclass
class Outcome:
    """What one peer's run_round did: its result or the exception it raised, and how long it took."""

    result: AllreduceResult | None
    error: BaseException | None
    seconds: float


async def run_round(
    peers: Sequence[Peer],
    group: GroupInfo,
    inputs: Sequence[Sequence[torch.Tensor]],
    *,
    weights: Sequence[float] | None = None,
    config: AllreduceConfig | Sequence[AllreduceConfig],
    hooks: dict[int, RoundHooks] | None = None,
    delays: dict[int, float] | None = None,
    skip: Sequence[int] = (),
    tasks_out: dict[int, asyncio.Task[Any]] | None = None,
) -> list[Outcome | None]:
    """Runs one round on ``peers`` at once (peer i with ``inputs[i]``); peers in ``skip`` never start.

    ``config`` is every peer's, or a sequence of one per peer (e.g. each with its own ErrorFeedback codec,
    whose residuals must not be shared between peers)."""
    weights = weights or [1.0] * len(peers)
    configs = [config] * len(peers) if isinstance(config, AllreduceConfig) else list(config)
    tasks: dict[int, asyncio.Task[Outcome]] = {}

    async def one(index: int) -> Outcome:
        await asyncio.sleep((delays or {}).get(index, 0.0))
        start = time.monotonic()
        try:
            result = await peers[index].service.run_round(
                group,
                inputs[index],
                weight=weights[index],
                gather={"index": index, "name": peers[index].name},
                config=configs[index],
                hooks=(hooks or {}).get(index),
            )
        except BaseException as e:
            return Outcome(None, e, time.monotonic() - start)
        return Outcome(result, None, time.monotonic() - start)

    for index in range(len(peers)):
        if index not in skip:
            tasks[index] = asyncio.create_task(one(index))
    if tasks_out is not None:
        tasks_out.update(tasks)
    outcomes: list[Outcome | None] = [None] * len(peers)
    for index, task in tasks.items():
        try:
            outcomes[index] = await task
        except asyncio.CancelledError:  # the test crashed this peer by cancelling its task
            outcomes[index] = Outcome(None, asyncio.CancelledError(), float("nan"))
    return outcomes


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def check_round(
    peers: Sequence[Peer],
    inputs: Sequence[Sequence[torch.Tensor]],
    weights: Sequence[float],
    outcomes: Sequence[Outcome | None],
    *,
    honest: Sequence[int],
    atol: float = 1e-5,
    rtol: float = 1e-5,
) -> None:
    """Every honest peer returned; each part holds the weighted mean over its reported contributors
    (or the peer's own values), and peers that got a part averaged got identical values for it."""
    index_of = {peer.peer_id: i for i, peer in enumerate(peers)}
    agreed: dict[int, torch.Tensor] = {}
    for me in honest:
        outcome = outcomes[me]
        assert outcome is not None and outcome.error is None, f"peer {me} failed: {outcome and outcome.error!r}"
        result = outcome.result
        assert result is not None
        for tensor, given in zip(result.tensors, inputs[me], strict=True):
            assert tensor.shape == given.shape and tensor.dtype == given.dtype and tensor.device == given.device
        got, own = flat(result.tensors), flat(inputs[me])
        for part in result.parts:
            segment = got[part.start : part.end]
            if not part.averaged:
                assert torch.equal(segment, own[part.start : part.end]), f"peer {me}: unaveraged part changed"
                continue
            for start, end, present in part.segments:  # a sender that dropped out mid-part: several runs
                contributors = [index_of[p] for p in present]
                assert me in contributors, f"peer {me} got part {start}:{end} averaged without itself"
                total = sum(weights[c] for c in contributors)
                expected = sum(weights[c] * flat(inputs[c])[start:end] for c in contributors) / total
                torch.testing.assert_close(got[start:end], expected.to(segment.dtype), atol=atol, rtol=rtol)
            key = index_of[part.owner]
            if key in agreed and agreed[key].numel() == segment.numel():
                assert torch.equal(agreed[key], segment), "two peers got different averages of one part"
            agreed.setdefault(key, segment)


def config(**overrides: Any) -> AllreduceConfig:
    values: dict[str, Any] = dict(part_size_bytes=4096, next_chunk_timeout=2.0, allreduce_timeout=8.0)
    values.update(overrides)
    return AllreduceConfig(**values)
