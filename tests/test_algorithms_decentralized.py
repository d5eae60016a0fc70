"""Low-precision decentralized SGD: neighbour choice, exact replicas, convergence, dead neighbours,
and pushes that must be refused."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.p2p import PeerID
from swarm import local_swarm, wait_for

import hivemind_ext
from hivemind_ext.compression import MinMaxUInt8, NoCompression
from hivemind_ext.errors import ConfigurationError, HivemindExtError
from hivemind_ext.optim.algorithms.decentralized import DecentralizedSGD, _join_push
from hivemind_ext.optim.algorithms.neighbours import choose_neighbours
from hivemind_ext.p2p import Message

TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
TRUE_W = torch.linspace(-1, 1, 8)


def test_neighbours_follow_me_on_the_ring() -> None:
    peers = ["a", "b", "c", "d", "e"]
    assert choose_neighbours("c", peers, 2) == ["d", "e"]
    assert choose_neighbours("e", peers, 2) == ["a", "b"]  # wraps around
    assert choose_neighbours("c", peers, 2, exclude=["d"]) == ["e", "a"]
    assert choose_neighbours("c", peers, 2, current=["a"]) == ["a", "d"]  # current ones are kept
    assert choose_neighbours("c", ["c"], 2) == []
    assert choose_neighbours("c", peers, 10) == ["d", "e", "a", "b"]
    assert choose_neighbours("z", peers, 1) == ["a"]  # a peer not listed yet still has a place


def test_invalid_hyperparameters_are_refused() -> None:
    with pytest.raises(ConfigurationError):
        DecentralizedSGD(num_neighbours=0)
    with pytest.raises(ConfigurationError):
        DecentralizedSGD(neighbour_timeout=-1)


def _make_swarm(dhts, algorithm, seeds, lr=0.05):
    models, opts = [], []
    for dht, seed in zip(dhts, seeds, strict=True):
        torch.manual_seed(seed)
        model = torch.nn.Linear(8, 1)
        models.append(model)
        opts.append(
            hivemind_ext.Optimizer(
                dht=dht,
                run_id="decsgd",
                target_batch_size=64,
                batch_size_per_step=4,
                optimizer=lambda p: torch.optim.SGD(p, lr=lr),
                params=model.parameters(),
                offload_optimizer=False,
                matchmaking_time=0.5,
                averaging_timeout=5,
                tracker_opts=TRACKER,
                algorithm=algorithm,
            )
        )
    return models, opts


def _train(model, opt, steps, seed, stop=None, losses=None):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        if stop is not None and stop.is_set():
            return
        x = torch.randn(4, 8, generator=generator)
        y = x @ TRUE_W[:, None]
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if losses is not None:
            losses.append(loss.item())
        time.sleep(0.01)


def _run(models, opts, steps):
    threads = [
        threading.Thread(target=_train, args=(m, o, steps, 100 + i))
        for i, (m, o) in enumerate(zip(models, opts, strict=True))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)


def _caught_up(neighbour, model) -> bool:
    """The neighbour's replica equals the model's parameters, within the tolerance the tests assert."""
    actual = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return bool(torch.allclose(neighbour.replica, actual, rtol=0, atol=1e-6))


def _eval_loss(model) -> float:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return float(((model(x) - x @ TRUE_W[:, None]) ** 2).mean())


@pytest.mark.timeout(120)
def test_replicas_equal_neighbours_models_and_peers_reach_consensus() -> None:
    with local_swarm(4) as dhts:
        models, opts = _make_swarm(
            dhts, DecentralizedSGD(num_neighbours=2, maintenance_period=0.1), seeds=range(4), lr=0.1
        )
        try:
            initial_spread = max(float((m.weight - models[0].weight).detach().abs().max()) for m in models)
            _run(models, opts, steps=100)
            model_of = {dht.peer_id.to_base58(): m for dht, m in zip(dhts, models, strict=True)}
            wait_for(
                lambda: all(
                    _caught_up(neighbour, model_of[peer])
                    for opt in opts
                    for peer, neighbour in list(opt.algorithm_impl.neighbours.items())
                ),
                30,
                message="the last pushes to arrive",
            )
            impls = {o.algorithm_impl.peer_id: (o.algorithm_impl, m) for o, m in zip(opts, models, strict=True)}
            for impl, _ in impls.values():
                assert len(impl.neighbours) == 2
                for peer, neighbour in impl.neighbours.items():
                    other_model = impls[peer][1]
                    actual = torch.cat([p.detach().reshape(-1) for p in other_model.parameters()])
                    # the model moves by exactly the decoded difference, so the replica is exact
                    torch.testing.assert_close(neighbour.replica, actual, rtol=0, atol=1e-6)
                assert impl.bytes_pushed > 0
            spread = max(float((m.weight - models[0].weight).detach().abs().max()) for m in models)
            assert spread < 0.05 * initial_spread, (initial_spread, spread)
            assert all(_eval_loss(m) < 0.01 for m in models), [_eval_loss(m) for m in models]
        finally:
            for opt in opts:
                opt.shutdown()


@pytest.mark.timeout(150)
def test_convergence_close_to_synchronous_averaging() -> None:
    """At equal samples (4 peers x 100 steps x 4 samples), the loss is within a stated tolerance of the
    standard synchronous Optimizer on the same data: at most 2x its loss plus 0.02."""
    results = {}
    for name, algorithm in (("sync", None), ("decentralized", DecentralizedSGD(codec=MinMaxUInt8()))):
        with local_swarm(4) as dhts:
            models, opts = _make_swarm(dhts, algorithm, seeds=[0] * 4, lr=0.15 if algorithm else 0.5)
            try:
                _run(models, opts, steps=100)
                results[name] = sum(_eval_loss(m) for m in models) / len(models)
            finally:
                for opt in opts:
                    opt.shutdown()
    assert results["decentralized"] <= 2 * results["sync"] + 0.02, results


@pytest.mark.timeout(120)
def test_dead_neighbour_is_replaced_and_the_others_finish() -> None:
    algorithm = DecentralizedSGD(num_neighbours=1, neighbour_timeout=0.5, request_timeout=1.0, maintenance_period=0.1)
    with local_swarm(4) as dhts:
        models, opts = _make_swarm(dhts, algorithm, seeds=range(4))
        stop_victim = threading.Event()
        try:
            _run(models, opts, steps=10)  # everyone has a neighbour now
            victim_id = opts[3].algorithm_impl.peer_id
            followers = [o for o in opts[:3] if victim_id in o.algorithm_impl.neighbours]
            assert followers, "with a ring of 4 and one neighbour each, somebody follows every peer"
            stop_victim.set()
            opts[3].shutdown()
            dhts[3].shutdown()
            threads = [
                threading.Thread(target=_train, args=(m, o, 60, 200 + i))
                for i, (m, o) in enumerate(zip(models[:3], opts[:3], strict=True))
            ]
            started = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join(90)
            assert not any(t.is_alive() for t in threads)
            assert time.monotonic() - started < 60
            for follower in followers:
                impl = follower.algorithm_impl
                assert impl.replaced >= 1
                assert victim_id not in impl.neighbours and len(impl.neighbours) == 1
                ((peer, neighbour),) = impl.neighbours.items()
                other = next(m for o, m in zip(opts, models, strict=True) if o.algorithm_impl.peer_id == peer)
                wait_for(lambda n=neighbour, m=other: _caught_up(n, m), 10, message="the last differences to arrive")
                actual = torch.cat([p.detach().reshape(-1) for p in other.parameters()])
                torch.testing.assert_close(neighbour.replica, actual, rtol=0, atol=1e-6)
        finally:
            for opt in opts[:3]:
                opt.shutdown()


@pytest.mark.timeout(90)
def test_bad_pushes_are_refused_and_change_nothing() -> None:
    with local_swarm(3) as dhts:
        models, opts = _make_swarm(dhts, DecentralizedSGD(num_neighbours=1, maintenance_period=0.1), seeds=range(3))
        try:
            _run(models, opts, steps=5)
            target = opts[0].algorithm_impl
            ((peer, neighbour),) = target.neighbours.items()
            sender_model = next(m for d, m in zip(dhts, models, strict=True) if d.peer_id.to_base58() == peer)
            wait_for(lambda: _caught_up(neighbour, sender_model), 10, message="the last legitimate differences")
            sender = next(o.algorithm_impl for o in opts if o.algorithm_impl.peer_id == peer)
            stranger = next(o.algorithm_impl for o in opts[1:] if o.algorithm_impl.peer_id != peer)
            before = neighbour.replica.clone()
            expected_seq = neighbour.next_seq
            numel = target.numel

            def push(impl, message):
                return impl.runtime.run(
                    impl.rpc_client.call(PeerID.from_base58(target.peer_id), "push", message, timeout=3), timeout=5
                )

            good = NoCompression().compress(torch.ones(numel))
            with pytest.raises(HivemindExtError):  # not a neighbour of the target
                push(stranger, _join_push([(expected_seq, good)]))
            with pytest.raises(HivemindExtError):  # wrong size
                push(sender, _join_push([(expected_seq, NoCompression().compress(torch.ones(numel + 1)))]))
            with pytest.raises(HivemindExtError):  # NaN
                bad = torch.ones(numel)
                bad[0] = float("nan")
                push(sender, _join_push([(expected_seq, NoCompression().compress(bad))]))
            with pytest.raises(HivemindExtError):  # no sequence numbers
                push(sender, Message({"tensor": good.header()}, good.payload_view()))
            with pytest.raises(HivemindExtError):  # sizes that do not add up to the payload
                message = _join_push([(expected_seq, good)])
                push(sender, Message({**message.header, "sizes": [1]}, message.payload))
            torch.testing.assert_close(neighbour.replica, before, rtol=0, atol=0)
            assert neighbour.next_seq == expected_seq
            _run(models, opts, steps=5)  # the target keeps working
            assert target.steps == 10
        finally:
            for opt in opts:
                opt.shutdown()
