"""DecentralizedAverager end to end: real DHTs and libp2p daemons on 127.0.0.1, hivemind's API."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import hivemind
import hivemind.compression
import pytest
import torch
from swarm import local_swarm, wait_for
from tcp_proxy import proxy_in_thread

from hivemind_ext.averaging import AveragingStage, DecentralizedAverager
from hivemind_ext.compression import Float16Compression
from hivemind_ext.errors import ConfigurationError, MatchmakingError
from hivemind_ext.p2p import DirectConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(90)]

CLIENT = 4  # the swarm's client-mode DHT
_prefixes = itertools.count()


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(5, client_indices=[CLIENT]) as dhts:
        yield dhts


def fresh_prefix() -> str:
    return f"averager-test-{next(_prefixes)}"


def make_tensors(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(1000, generator=generator),
        torch.randn(3, 17, generator=generator),
        torch.randn(1, generator=generator).squeeze(),
    ]


def averagers(dhts: Sequence[hivemind.DHT], prefix: str, **kwargs: Any) -> list[DecentralizedAverager]:
    options = dict(target_group_size=len(dhts), min_matchmaking_time=30.0, request_timeout=1.0, start=True)
    options.update(kwargs)
    return [DecentralizedAverager(make_tensors(seed), dht, prefix=prefix, **options) for seed, dht in enumerate(dhts)]


def step_all(group: Sequence[DecentralizedAverager], **kwargs_by_peer: Sequence[Any]) -> list[Any]:
    """Calls step() on every averager at once (as separate peers would) and returns the results in order."""
    with concurrent.futures.ThreadPoolExecutor(len(group)) as pool:
        futures = [
            pool.submit(averager.step, timeout=30, **{k: v[i] for k, v in kwargs_by_peer.items()})
            for i, averager in enumerate(group)
        ]
        return [future.result(timeout=60) for future in futures]


def shutdown_all(group: Sequence[DecentralizedAverager]) -> None:
    for averager in group:
        averager.shutdown()


def test_four_peers_reach_the_weighted_mean_and_gather(swarm: list[hivemind.DHT]) -> None:
    group = averagers(swarm[:4], fresh_prefix())
    try:
        weights = [1.0, 2.0, 3.0, 4.0]
        originals = [make_tensors(seed) for seed in range(4)]
        started = time.monotonic()
        results = step_all(group, weight=weights, gather=[{"peer": i} for i in range(4)])
        elapsed = time.monotonic() - started
        assert elapsed < 10, f"a full group must form at once, not after min_matchmaking_time ({elapsed:.1f} s)"
        for index, expected in enumerate(zip(*originals, strict=True)):
            mean = sum(w * t for w, t in zip(weights, expected, strict=True)) / sum(weights)
            for averager in group:
                with averager.get_tensors() as tensors:
                    torch.testing.assert_close(tensors[index], mean, rtol=1e-5, atol=1e-6)
        for averager, gathered in zip(group, results, strict=True):
            assert sorted(value["peer"] for value in gathered.values()) == [0, 1, 2, 3]
            assert averager.last_round is not None and averager.last_round.group_size == 4
            assert averager.last_round.excluded == {}
    finally:
        shutdown_all(group)


def test_a_round_that_leaves_a_peer_out_says_so_in_its_report_and_at_warning(
    swarm: list[hivemind.DHT], caplog: pytest.LogCaptureFixture
) -> None:
    """A member whose values are NaN is excluded by every owner: the round still succeeds for the
    others (with the mean over the two of them), but their report and a WARNING say that it is not
    the mean over the whole group, naming the peer left out and why."""
    group = averagers(swarm[:3], fresh_prefix())
    poisoned = swarm[2].peer_id.to_base58()
    with group[2].get_tensors() as tensors:
        for tensor in tensors:
            tensor.fill_(float("nan"))
    try:
        pool = concurrent.futures.ThreadPoolExecutor(3)
        with caplog.at_level(logging.WARNING, logger="hivemind_ext"):
            # the poisoned peer averages nothing and retries until its timeout: only the others are awaited
            futures = [pool.submit(averager.step, timeout=30) for averager in group]
            assert futures[0].exception(timeout=60) is None and futures[1].exception(timeout=60) is None
        pool.shutdown(wait=False)
        for averager in group[:2]:
            report = averager.last_round
            assert not report.complete and list(report.missing) == [poisoned]
            assert "NaN" in report.missing[poisoned]
            with averager.get_tensors() as tensors:
                for tensor, *inputs in zip(tensors, make_tensors(0), make_tensors(1), strict=True):
                    torch.testing.assert_close(tensor, sum(inputs) / 2, rtol=1e-5, atol=1e-6)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        partial = [m for m in warnings if "NOT the mean over the whole group" in m]
        assert len(partial) >= 2 and all(poisoned in m and "NaN" in m for m in partial), warnings
    finally:
        shutdown_all(group)


def test_direct_path_is_on_by_default_and_each_pair_reports_its_transport(swarm: list[hivemind.DHT]) -> None:
    """Peers 0 and 1 use the defaults (encrypted direct path); peer 2 offers an address nobody can
    reach; peer 3 opts into plaintext, which default peers refuse; peer 4 is in client mode (it
    dials out, nobody dials it). Every pair that can use the encrypted direct path does, the others
    fall back to libp2p, and the mean is exact."""
    with socket.socket() as probe:  # a port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    unreachable = DirectConfig(host="127.0.0.1", advertise_port=closed_port)
    per_peer: list[dict[str, Any]] = [{}, {}, dict(direct_data_path=unreachable), dict(direct_plaintext=True), {}]
    prefix = fresh_prefix()
    options = dict(target_group_size=5, min_matchmaking_time=30.0, request_timeout=1.0, start=True)
    group = [
        DecentralizedAverager(make_tensors(i), swarm[i], prefix=prefix, **options, **per_peer[i]) for i in range(5)
    ]
    try:
        originals = [make_tensors(seed) for seed in range(5)]
        step_all(group)
        for index, expected in enumerate(zip(*originals, strict=True)):
            for averager in group:
                with averager.get_tensors() as tensors:
                    torch.testing.assert_close(tensors[index], sum(expected) / 5, rtol=1e-5, atol=1e-6)
        assert all(averager.last_round.excluded == {} for averager in group)
        names = [str(averager.peer_id) for averager in group]
        direct = {(0, 1), (1, 0), (2, 0), (2, 1), (3, 0), (3, 1), (4, 0), (4, 1)}  # (caller, owner)
        for caller, averager in enumerate(group):
            report = averager.last_round
            expected = {
                names[owner]: "direct" if (caller, owner) in direct else "libp2p"
                for owner in range(4)
                if owner != caller
            }
            assert report.transports == expected, f"peer {caller}"
            assert set(report.direct_failures) == {p for p, t in expected.items() if t == "libp2p"}
        assert "PeerUnreachableError" in group[0].last_round.direct_failures[names[2]]
        assert "plaintext" in group[0].last_round.direct_failures[names[3]]
        with pytest.raises(ConfigurationError):
            DecentralizedAverager(make_tensors(0), swarm[0], prefix="x", direct_data_path="localhost", start=False)
    finally:
        shutdown_all(group)


def test_all_reduce_and_state_downloads_share_one_fixed_direct_port(swarm: list[hivemind.DHT]) -> None:
    # Peer 0 fixes its direct port and advertises a proxy in front of it: every direct connection to
    # it, the round's and the download's, must pass through that one port.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    prefix = fresh_prefix()
    options = dict(target_group_size=2, min_matchmaking_time=30.0, request_timeout=1.0, start=True)
    with proxy_in_thread(port) as proxy:
        fixed = DirectConfig(host="127.0.0.1", port=port, advertise_port=proxy.port)
        group = [
            DecentralizedAverager(make_tensors(0), swarm[0], prefix=prefix, direct_data_path=fixed, **options),
            DecentralizedAverager(make_tensors(1), swarm[1], prefix=prefix, **options),
        ]
        try:
            with socket.socket() as taken, pytest.raises(OSError):
                taken.bind(("127.0.0.1", port))  # the fixed port is the listener's
            step_all(group)
            assert group[1].last_round.transports == {str(group[0].peer_id): "direct"}
            after_round = proxy.connections
            assert after_round >= 1
            group[1].allow_state_sharing = False
            with group[0].get_tensors() as tensors:
                averaged = [tensor.clone() for tensor in tensors]
            loaded = wait_for(lambda: group[1].load_state_from_peers(timeout=10), 20, interval=0.5, message="a donor")
            assert all(torch.equal(got, want) for got, want in zip(loaded[1], averaged, strict=True))
            assert proxy.connections > after_round  # the download came through the same port
        finally:
            shutdown_all(group)


def test_rounds_reuse_their_scratch_tensors_and_overlapping_rounds_never_share_them(
    swarm: list[hivemind.DHT],
) -> None:
    group = averagers(swarm[:2], fresh_prefix())
    try:
        originals = [make_tensors(seed) for seed in range(2)]
        step_all(group)
        scratch = [averager.scratch_buffers.kept for averager in group]  # kept for the next round
        assert all(buffers is not None for buffers in scratch)
        with group[0].get_tensors() as tensors:
            for tensor in tensors:  # new local values between rounds: the next round averages them
                tensor.mul_(3)
        step_all(group)
        for index, (mine, other) in enumerate(zip(*originals, strict=True)):
            mean = (mine + other) / 2
            expected = (3 * mean + mean) / 2
            for averager in group:
                with averager.get_tensors() as tensors:
                    torch.testing.assert_close(tensors[index], expected, rtol=1e-5, atol=1e-6)
        for averager, buffers in zip(group, scratch, strict=True):
            assert averager.scratch_buffers.kept is buffers  # the second round used the same tensors
            with averager.get_tensors() as tensors:
                assert all(t.data_ptr() not in {b.data_ptr() for b in (*buffers[0], *buffers[1])} for t in tensors)
        pool = group[0].scratch_buffers
        with group[0].get_tensors() as tensors:
            lent = pool.lend(tensors)  # a round holds them: an overlapping round gets its own
            overlapping = pool.lend(tensors)
            pointers = {t.data_ptr() for t in (*lent[0], *lent[1])}
            assert not pointers & {t.data_ptr() for t in (*overlapping[0], *overlapping[1])}
            pool.give_back(lent)
            assert pool.lend(tensors) is lent
    finally:
        shutdown_all(group)


def test_averaging_alpha_moves_part_of_the_way(swarm: list[hivemind.DHT]) -> None:
    group = averagers(swarm[:2], fresh_prefix(), averaging_alpha=0.25)
    try:
        originals = [make_tensors(seed) for seed in range(2)]
        step_all(group)
        for averager, own in zip(group, originals, strict=True):
            with averager.get_tensors() as tensors:
                for tensor, mine, other in zip(tensors, own, originals[1 - group.index(averager)], strict=True):
                    torch.testing.assert_close(tensor, mine + 0.25 * ((mine + other) / 2 - mine))
    finally:
        shutdown_all(group)


def test_client_mode_and_auxiliary_peers(swarm: list[hivemind.DHT]) -> None:
    prefix = fresh_prefix()
    trainers = [
        DecentralizedAverager(make_tensors(0), swarm[0], prefix=prefix, target_group_size=4, start=True),
        DecentralizedAverager(make_tensors(1), swarm[1], prefix=prefix, target_group_size=4, start=True),
        DecentralizedAverager(make_tensors(4), swarm[CLIENT], prefix=prefix, target_group_size=4, start=True),
    ]
    helper = DecentralizedAverager(
        make_tensors(2), swarm[2], prefix=prefix, target_group_size=4, auxiliary=True, start=True
    )
    group = [*trainers, helper]
    try:
        assert trainers[2].client_mode and not trainers[2].allow_state_sharing  # taken from the DHT
        step_all(group)
        expected = [sum(ts) / 3 for ts in zip(make_tensors(0), make_tensors(1), make_tensors(4), strict=True)]
        for averager in trainers:
            assert averager.last_round.complete and averager.last_round.missing == {}  # the helper is no member
            with averager.get_tensors() as tensors:
                for tensor, mean in zip(tensors, expected, strict=True):
                    torch.testing.assert_close(tensor, mean, rtol=1e-5, atol=1e-6)
        with helper.get_tensors() as tensors:  # an auxiliary peer contributes and receives nothing
            for tensor, own in zip(tensors, make_tensors(2), strict=True):
                torch.testing.assert_close(tensor, own)
    finally:
        shutdown_all(group)


def test_trigger_holds_the_allreduce_and_cancel_stops_a_step(swarm: list[hivemind.DHT]) -> None:
    group = averagers(swarm[:2], fresh_prefix(), compression=Float16Compression())
    try:
        controls = [a.step(wait=False, require_trigger=True, timeout=30) for a in group]
        wait_for(
            lambda: all(c.stage == AveragingStage.AWAITING_TRIGGER for c in controls), 15, message="both at the trigger"
        )
        with group[0].get_tensors() as tensors:
            before = tensors[0].clone()
        time.sleep(0.3)  # a window in which nothing may finish
        assert not any(c.done() for c in controls)
        with group[0].get_tensors() as tensors:
            torch.testing.assert_close(tensors[0], before)  # nothing averaged before the trigger
        for control in controls:
            control.allow_allreduce()
        assert all(len(c.result(timeout=30)) == 2 for c in controls)

        lonely = group[0].step(wait=False, timeout=30)  # nobody else is looking: it would wait 30 s
        wait_for(lambda: lonely.stage == AveragingStage.LOOKING_FOR_GROUP, 10, message="the lonely step to look")
        assert lonely.cancel() and lonely.cancelled()
        assert len(step_all(group)[0]) == 2  # the averager still works after a cancelled step
    finally:
        shutdown_all(group)


def test_a_lonely_peer_fails_at_its_timeout(swarm: list[hivemind.DHT]) -> None:
    (averager,) = averagers(swarm[:1], fresh_prefix(), target_group_size=2, min_matchmaking_time=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(MatchmakingError):
            averager.step(timeout=2.0)
        assert 1.5 < time.monotonic() - started < 5.0
    finally:
        averager.shutdown()


def test_newcomer_downloads_the_state_with_the_highest_priority(swarm: list[hivemind.DHT]) -> None:
    prefix = fresh_prefix()
    old, new, newcomer = averagers(swarm[:3], prefix)
    try:
        old.state_sharing_priority, new.state_sharing_priority = 1, 5
        newcomer.allow_state_sharing = False

        def newest_state() -> tuple | None:
            loaded = newcomer.load_state_from_peers(timeout=10)
            with new.get_tensors() as tensors:
                return loaded if loaded is not None and torch.equal(loaded[1][0], tensors[0]) else None

        # donors may not have advertised their new priority yet
        loaded = wait_for(newest_state, 20, interval=0.5, message="the newest donor's state")
        metadata, tensors = loaded
        assert metadata == {"prefix": prefix}
        for got, want in zip(tensors, make_tensors(1), strict=True):
            assert torch.equal(got, want)
    finally:
        shutdown_all([old, new, newcomer])


def test_restart_on_the_same_dht(swarm: list[hivemind.DHT]) -> None:
    prefix = fresh_prefix()
    shutdown_all(averagers(swarm[:2], prefix))
    group = averagers(swarm[:2], prefix)  # handlers are registered again on the same daemons
    try:
        assert all(len(gathered) == 2 for gathered in step_all(group))
    finally:
        shutdown_all(group)


def test_arguments_are_checked_and_hivemind_codecs_accepted(swarm: list[hivemind.DHT]) -> None:
    with pytest.raises(ConfigurationError):
        DecentralizedAverager(make_tensors(0), swarm[0], prefix="x", client_mode=True, auxiliary=True, start=False)
    with pytest.raises(ConfigurationError):
        DecentralizedAverager([torch.zeros(3, dtype=torch.int64)], swarm[0], prefix="x", start=False)
    with pytest.raises(ConfigurationError):
        DecentralizedAverager(make_tensors(0), swarm[0], prefix="x", averaging_alpha=0.0, start=False)
    averager = DecentralizedAverager(
        make_tensors(0), swarm[0], prefix="x", compression=hivemind.compression.Float16Compression(), start=False
    )
    assert isinstance(averager.compression, Float16Compression)
    with pytest.raises(RuntimeError):
        averager.step()  # not started
    with DecentralizedAverager(make_tensors(0), swarm[0], prefix=fresh_prefix(), start=True) as running:
        with pytest.raises(ConfigurationError):
            running.step(wait=True, require_trigger=True)
        with pytest.raises(ConfigurationError):
            running.step(weight=-1.0)
    assert not running.is_alive()
