"""A flood of streams for groups that do not exist cannot starve honest rounds (issue 12, item 6).

Four honest peers run rounds where one of them starts late, so the others' streams arrive before
its round and must wait for it. An outsider (its own process and libp2p daemon, the library's own client:
tests/flood_client.py)
keeps 72 streams open to that peer at all times, each a JOIN for a random group that does not
exist, reopened as soon as it is refused. Before admission control the outsider's streams filled
the 64 "round not started yet" slots: the honest members' early streams were refused and every
round excluded peers and ran until its timeouts. Now the board-listed members wait in their own
slots and the outsider is limited per peer id.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import time
from pathlib import Path

import pytest
from allreduce_swarm import NAMESPACE, check_round, config, group_of, make_tensors, run_round, swarm_fixtures

from hivemind_ext.averaging.allreduce.admission import AdmissionConfig, EarlyAdmission
from hivemind_ext.averaging.matchmaking.group import Board, Commit, Declaration, Member, SealedGroup
from hivemind_ext.averaging.matchmaking.listed import ListedPeers

swarm, no_leftover_tasks = swarm_fixtures(4)

FLOOD_CLIENT = Path(__file__).with_name("flood_client.py")
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


def test_the_board_lists_declared_sealed_and_committed_peers_for_a_while() -> None:
    declared = Member("declared", "a1", None, False, False)
    sealed = Member("sealed", "a2", None, False, False)
    board = Board(
        declarations={declared.key: Declaration(declared, "run.0", declared_at=0.0, ready_at=1.0, deadline=5.0)},
        sealed={"g": SealedGroup("g", (sealed,), commit_by=3.0)},
        commits={"g": Commit("g", (("committed", "a3"),))},
    )
    listed = ListedPeers(ttl=60.0, max_peers=3)
    listed.update(board, now=100.0)
    assert all(listed.lists(name, 150.0) for name in ("declared", "sealed", "committed"))
    assert not listed.lists("stranger", 150.0) and not listed.lists("declared", 161.0)  # forgotten after ttl
    other = Member("newcomer", "a4", None, False, False)
    listed.update(Board(declarations={other.key: Declaration(other, "run.1", 0.0, 1.0, 5.0)}), now=200.0)
    assert len(listed) == 3 and listed.lists("newcomer", 200.0)  # the least recently seen went first


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

    async def scenario() -> tuple[list[float], list[float], str]:
        baseline = await timed_rounds(peers, 3, seed=0)
        maddrs = [str(m) for m in await peers[0].p2p.get_visible_maddrs()]
        attacker = await asyncio.create_subprocess_exec(
            sys.executable,
            str(FLOOD_CLIENT),
            peers[0].name,
            NAMESPACE,
            str(FLOOD_STREAMS),
            *maddrs,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        try:
            assert await asyncio.wait_for(attacker.stdout.readline(), 60) == b"ready\n"  # the flood is on
            attacked = await timed_rounds(peers, 6, seed=100)
            attacker.stdin.close()
            opened = (await asyncio.wait_for(attacker.stdout.readline(), 60)).decode().strip()
        finally:
            if attacker.returncode is None:
                attacker.kill()
            await attacker.wait()
        return baseline, attacked, opened

    baseline, attacked, opened = swarm.run(scenario(), timeout=170)
    normal = statistics.median(baseline)
    refused = peers[0].service.admission.refused
    print(
        f"rounds without flood {[round(s, 2) for s in baseline]} s, under a flood of {FLOOD_STREAMS} streams "
        f"({opened}, {refused} refused) {[round(s, 2) for s in attacked]} s"
    )
    assert max(attacked) <= 2 * normal + 0.5, f"rounds took {attacked} under the flood (normally {normal:.2f} s)"
