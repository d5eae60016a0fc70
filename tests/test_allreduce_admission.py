"""A flood of streams for groups that do not exist cannot starve honest rounds (issue 12, item 6).

Four honest peers run rounds where one of them starts late, so the others' streams arrive before
its round and must wait for it. An outsider (its own libp2p daemon, the library's own client)
keeps 72 streams open to that peer at all times, each a JOIN for a random group that does not
exist, reopened as soon as it is refused. Before admission control the outsider's streams filled
the 64 "round not started yet" slots: the honest members' early streams were refused and every
round excluded peers and ran until its timeouts. Now the board-listed members wait in their own
slots and the outsider is limited per peer id.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time

import pytest
from allreduce_swarm import NAMESPACE, check_round, config, group_of, make_tensors, run_round, swarm_fixtures
from hivemind.p2p import P2P

from hivemind_ext.averaging.allreduce.admission import AdmissionConfig, EarlyAdmission
from hivemind_ext.averaging.allreduce.wire import HANDLER_NAME, join_message
from hivemind_ext.errors import HivemindExtError
from hivemind_ext.p2p import RPCClient

swarm, no_leftover_tasks = swarm_fixtures(4)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
FLOOD_STREAMS = 72
LATE = 0.3  # the victim (peer 0) starts its round this long after the others
SHAPES = [(2000,), (37, 11)]


def test_outsiders_never_take_member_slots_and_are_rate_limited_per_peer() -> None:
    members = {"m1", "m2"}
    admission = EarlyAdmission(
        AdmissionConfig(max_member_waits=3, max_waits_per_peer=2, max_outsider_waits=2, outsider_burst=3),
        is_listed=lambda peer: peer in members,
    )
    outsider = [admission.admit("x", now=0.0) for _ in range(5)]
    assert sum(t is not None for t in outsider) == 2  # its per-peer share of the outsider pool
    assert admission.admit("y", now=0.0) is None  # the outsider pool is full; members are not
    tickets = [admission.admit("m1", 0.0), admission.admit("m1", 0.0), admission.admit("m2", 0.0)]
    assert all(tickets) and admission.admit("m1", 0.0) is None  # per-peer cap for members too
    assert admission.admit("m2", 0.0) is None and admission.waiting == (3, 2)  # member pool full
    for ticket in outsider:
        if ticket is not None:
            admission.leave(ticket)
    assert admission.admit("x", now=0.0) is not None  # a third token of the burst of 3
    assert admission.admit("x", now=0.0) is None  # the burst is spent: rate-limited though slots are free
    assert admission.admit("x", now=0.6) is not None  # 2 per second refill
    assert admission.refused >= 5


async def flood(attacker: P2P, victim, stop: asyncio.Event, opened: list[int]) -> None:
    client = RPCClient(attacker, NAMESPACE)

    async def one_loop() -> None:
        while not stop.is_set():
            join = join_message(os.urandom(16), b"\0" * 32, 1.0, b"", [])
            try:
                async with client.stream(victim, HANDLER_NAME, [join], timeout=10) as responses:
                    opened[0] += 1
                    await responses.receive()
            except HivemindExtError:
                await asyncio.sleep(0)  # refused or broken: reopen at once

    await asyncio.gather(*(one_loop() for _ in range(FLOOD_STREAMS)))


async def timed_rounds(peers, count: int, seed: int) -> list[float]:
    seconds = []
    for round_index in range(count):
        inputs = [make_tensors(SHAPES, seed=seed + 10 * round_index + i) for i in range(len(peers))]
        started = time.monotonic()
        outcomes = await run_round(
            peers, group_of([p.member() for p in peers]), inputs, config=config(), delays={0: LATE}
        )
        seconds.append(time.monotonic() - started)
        check_round(peers, inputs, [1.0] * len(peers), outcomes, honest=range(len(peers)))
        for index, outcome in enumerate(outcomes):
            result = outcome.result
            assert not result.excluded, f"round {round_index}: peer {index} excluded {result.excluded}"
            for part in result.parts:
                assert len(part.contributors) == len(peers), f"round {round_index}: peer {index} part {part}"
    return seconds


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_flood_of_streams_for_unknown_groups_does_not_exclude_members_or_slow_rounds(swarm) -> None:
    peers = swarm.peers
    honest = {peer.peer_id for peer in peers}
    for peer in peers:  # the matchmaking board lists the four members (as the averager wires it)
        peer.service.admission.is_listed = honest.__contains__

    async def scenario() -> tuple[list[float], list[float], int]:
        baseline = await timed_rounds(peers, 3, seed=0)
        attacker = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await peers[0].p2p.get_visible_maddrs())
        stop, opened = asyncio.Event(), [0]
        flooding = asyncio.create_task(flood(attacker, peers[0].peer_id, stop, opened))
        try:
            give_up = time.monotonic() + 30
            while opened[0] < FLOOD_STREAMS and time.monotonic() < give_up:  # the flood is on
                await asyncio.sleep(0.05)
            assert opened[0] >= FLOOD_STREAMS
            attacked = await timed_rounds(peers, 4, seed=100)
        finally:
            stop.set()
            await asyncio.wait_for(flooding, 30)
            await attacker.shutdown()
        return baseline, attacked, opened[0]

    baseline, attacked, opened = swarm.run(scenario(), timeout=170)
    normal = statistics.median(baseline)
    refused = peers[0].service.admission.refused
    print(
        f"rounds without flood {[round(s, 2) for s in baseline]} s, under a flood of {FLOOD_STREAMS} streams "
        f"({opened} opened, {refused} refused) {[round(s, 2) for s in attacked]} s"
    )
    assert max(attacked) <= 2 * normal + 0.5, f"rounds took {attacked} under the flood (normally {normal:.2f} s)"
