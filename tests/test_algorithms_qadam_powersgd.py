"""QAdam and PowerSGD: their math without a network, then real peers on loopback.

Unit tests drive the implementations through a stand-in for the runner (``run_pipeline``) that does
what AlgorithmRunner.communicate does, with averaging computed in-process across several simulated
peers. Network tests train 4 peers (threads, one DHT each) and compare with synchronous averaging.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import hivemind
import pytest
import torch
from optim_swarm import signing_key
from swarm import addresses, local_swarm, new_peer, wait_for

import hivemind_ext
from hivemind_ext.compression import ErrorFeedback, MinMaxUInt8, NoCompression, as_codec
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.algorithms import AverageOp, Bucket, PowerSGD, QAdam
from hivemind_ext.optim.algorithms.powersgd import LowRankCompressor, compression_rate, is_compressed
from hivemind_ext.optim.algorithms.qadam import QAdamImpl
from hivemind_ext.optim.training_state import TrainingState


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Any:
    """These tensors are tiny: on a loaded 2-core machine torch's intra-op threads made the unit tests
    ~70x slower (spinning workers). Restored for the other modules."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# a runner without a network: N simulated peers, averaging computed in-process


def fake_context(params: Sequence[torch.Tensor], torch_optimizer: torch.optim.Optimizer | None = None) -> Any:
    return SimpleNamespace(
        params=list(params), torch_optimizer=torch_optimizer, state_lock=threading.RLock(), local_epoch=0
    )


def build_buckets(impl: Any) -> list[Bucket]:
    groups = impl.tensors_to_buckets(impl.init_tensors())
    buckets = [Bucket(f"b{i}", group) for i, group in enumerate(groups)]
    for bucket in buckets:
        impl.init_operations(bucket)
    return buckets


def run_pipeline(peers: Sequence[tuple[Any, list[Bucket]]]) -> None:
    """AlgorithmRunner.communicate across ``peers`` (same structure): at each position the average
    operations form one weighted mean over the peers (each bucket through its codec), then the Python
    operations run."""
    depth = max(len(b.ops) for _, buckets in peers for b in buckets)
    for position in range(depth):
        averaged = [[b for b in buckets if position < len(b.ops) and isinstance(b.ops[position], AverageOp)]
                    for _, buckets in peers]  # fmt: skip
        if averaged[0]:
            weights = [float(b[0].ops[position].weight()) for b in averaged]
            for column in zip(*averaged, strict=True):
                for bucket in column:
                    bucket.pack()
                codec = as_codec(column[0].ops[position].codec or NoCompression())
                sent = [codec.decompress(codec.compress(b.flat)) for b in column]
                mean = sum(w * t for w, t in zip(weights, sent, strict=True)) / sum(weights)
                for bucket in column:
                    bucket.flat.copy_(mean)
                    bucket.unpack()
        for _, buckets in peers:
            for bucket in buckets:
                if position < len(bucket.ops) and not isinstance(bucket.ops[position], AverageOp):
                    bucket.ops[position].run([bucket], None)  # type: ignore[arg-type]


def global_step(peers: Sequence[tuple[Any, list[Bucket]]]) -> None:
    run_pipeline(peers)
    for impl, _ in peers:
        impl.optimizer_step()
        impl.on_optimizer_step()


def set_grads(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad.clone()


# ---------------------------------------------------------------------------------------------
# PowerSGD math


def low_rank(rows: int, cols: int, rank: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, rank, generator=generator) @ torch.randn(rank, cols, generator=generator)


def test_rank_r_factors_reproduce_a_matrix_of_rank_at_most_r_and_truncate_a_full_rank_one() -> None:
    exact = low_rank(40, 30, 3, seed=1)
    compressor = LowRankCompressor("w", exact.shape, rank=4, error_feedback=False)
    compressor.begin(exact)
    compressor.after_p()
    approx = compressor.finish()
    assert torch.linalg.norm(approx - exact) / torch.linalg.norm(exact) < 1e-5

    full = torch.randn(40, 30, generator=torch.Generator().manual_seed(2))
    compressor = LowRankCompressor("w", full.shape, rank=4, error_feedback=False)
    compressor.begin(full)
    compressor.after_p()
    approx = compressor.finish()
    assert torch.linalg.matrix_rank(approx) == 4  # it really is rank 4: the factors are [40, 4] and [30, 4]
    # no better than the best rank-4 approximation (Eckart-Young), and not far from it
    singular = torch.linalg.svdvals(full)
    best = singular[4:].square().sum().sqrt()
    assert best <= torch.linalg.norm(approx - full) < 1.5 * best


def test_peers_share_q0_and_reconstruct_the_projection_of_the_mean_gradient() -> None:
    """Averaging is linear: with 3 peers the result is P P^T mean(M), exact when mean(M) has rank <= r."""
    grads = [low_rank(24, 16, 2, seed=10 + i) for i in range(3)]  # each rank 2: the mean has rank <= 6
    peers = [LowRankCompressor("layer.weight", g.shape, rank=6, error_feedback=False) for g in grads]
    assert all(torch.equal(peer.q, peers[0].q) for peer in peers)  # Q0 seeded by the name
    assert not torch.equal(LowRankCompressor("other", grads[0].shape, rank=6).q, peers[0].q)
    mean_p = sum(peer.begin(g) for peer, g in zip(peers, grads, strict=True)) / 3
    for peer in peers:
        peer.p.copy_(mean_p)
    mean_q = sum(peer.after_p() for peer in peers) / 3
    for peer in peers:
        peer.q.copy_(mean_q)
    results = [peer.finish() for peer in peers]
    expected = sum(grads) / 3
    for result in results:
        torch.testing.assert_close(result, results[0], rtol=0, atol=0)
        torch.testing.assert_close(result, expected, rtol=1e-4, atol=1e-4)


def apply_low_rank(
    grads: Sequence[torch.Tensor], rank: int, error_feedback: bool
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Sum of the updates a lone peer applies, its last error, and the error's norm after each step."""
    compressor = LowRankCompressor("w", grads[0].shape, rank=rank, error_feedback=error_feedback)
    applied = torch.zeros_like(grads[0])
    norms = []
    for grad in grads:
        compressor.begin(grad)
        compressor.after_p()
        applied += compressor.finish()
        norms.append(float(torch.linalg.norm(compressor.error)))
    return applied, compressor.error, norms


def test_error_feedback_makes_the_applied_updates_add_up_to_the_true_gradients() -> None:
    generator = torch.Generator().manual_seed(3)
    signal = torch.randn(20, 12, generator=generator)  # a full-rank mean gradient: rank 4 drops part of it
    grads = [signal + 0.3 * torch.randn(20, 12, generator=generator) for _ in range(120)]
    truth = sum(grads)
    with_feedback, error, norms = apply_low_rank(grads, 4, error_feedback=True)
    without_feedback, _, _ = apply_low_rank(grads, 4, error_feedback=False)
    # sum(applied) = sum(grads) - last error, exactly (up to float rounding)
    torch.testing.assert_close(with_feedback, truth - error, rtol=1e-4, atol=1e-2)
    # the error stays bounded (it saturates at a few gradients' worth: measured ~1.6x) instead of growing
    # with the steps, so the relative gap between what was applied and the true sum shrinks like 1 / steps
    largest = max(float(torch.linalg.norm(g)) for g in grads)
    assert max(norms) < 3 * largest, (max(norms), largest)
    assert max(norms[60:]) < 1.2 * max(norms[:60]), "the error keeps growing"
    gap_with = float(torch.linalg.norm(with_feedback - truth) / torch.linalg.norm(truth))
    gap_without = float(torch.linalg.norm(without_feedback - truth) / torch.linalg.norm(truth))
    assert gap_with < 0.025, gap_with  # measured 0.015 (0.03 after 60 steps, 0.006 after 300)
    assert gap_without > 5 * gap_with, (gap_without, gap_with)  # rank 4 alone keeps losing the same part


def test_min_compression_rate_routes_small_matrices_and_vectors_to_the_uncompressed_bucket() -> None:
    assert compression_rate((64, 32), 4) == pytest.approx(64 * 32 / (4 * 96))
    assert compression_rate((16, 3, 3, 3), 4) == pytest.approx(16 * 27 / (4 * 43))  # conv: [16, 27]
    assert not is_compressed((64,), 4, 0.0)  # biases never
    assert is_compressed((64, 32), 4, 2.0) and not is_compressed((64, 32), 4, 6.0)
    assert not is_compressed((4, 4), 4, 2.0)  # rank capped at 4: 16 / 32 = 0.5

    params = [torch.zeros(64, 32), torch.zeros(64), torch.zeros(8, 64), torch.zeros(16, 3, 3, 3)]
    impl = PowerSGD(rank=4, min_compression_rate=2.0).reify(fake_context(params))
    assert sorted(impl.compressors) == [0, 3]  # 8x64: 512 / (4 * 72) = 1.8 < 2
    assert impl.uncompressed == [1, 2]
    buckets = build_buckets(impl)
    kinds = {tuple(sorted(set(n.rstrip("0123456789") for n in b.names))): b for b in buckets}
    assert set(kinds) == {("p",), ("q",), ("grad",)}
    average_positions = {k: [i for i, op in enumerate(b.ops) if isinstance(op, AverageOp)] for k, b in kinds.items()}
    assert average_positions == {("p",): [1], ("q",): [3], ("grad",): [1]}
    assert kinds[("grad",)].names == ["grad1", "grad2"]

    everything = PowerSGD(rank=4, min_compression_rate=0.0).reify(fake_context(params))
    assert sorted(everything.compressors) == [0, 2, 3]


def test_powersgd_pipeline_over_simulated_peers_gives_every_peer_the_same_gradient() -> None:
    """The impl's operations, run as the runner runs them, with 3 peers and sample weights 1:2:1."""
    peers = []
    grads = []
    for index, samples in enumerate((1, 2, 1)):
        params = [torch.zeros(12, 10, requires_grad=True), torch.zeros(10, requires_grad=True)]
        impl = PowerSGD(rank=10, min_compression_rate=0.0).reify(fake_context(params))
        grad = [low_rank(12, 10, 2, seed=20 + index), torch.randn(10, generator=torch.Generator().manual_seed(index))]
        set_grads(params, grad)
        impl.on_backward(samples)
        grads.append((samples, grad))
        peers.append((impl, build_buckets(impl)))
    run_pipeline(peers)
    for param_index in range(2):
        expected = sum(s * grad[param_index] for s, grad in grads) / 4
        for impl, _ in peers:
            torch.testing.assert_close(impl.mean_grads[param_index], expected, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# QAdam math


def qadam_peer(params: Sequence[torch.Tensor], warmup_steps: int, **adam: Any) -> tuple[QAdamImpl, list[Bucket]]:
    torch_opt = torch.optim.AdamW(params, **adam)
    impl = QAdam(warmup_steps, codec=NoCompression()).reify(fake_context(params, torch_opt))
    return impl, build_buckets(impl)


def qadam_step(peer: tuple[QAdamImpl, list[Bucket]], grads: Sequence[torch.Tensor]) -> tuple[QAdamImpl, list[Bucket]]:
    impl, buckets = peer
    set_grads(impl.context.params, grads)
    impl.on_backward(1)
    if impl.need_reset():
        impl.reset()
        buckets = build_buckets(impl)
    global_step([(impl, buckets)])
    return impl, buckets


def test_qadam_warmup_is_adamw_and_then_momentum_moves_with_a_frozen_variance() -> None:
    adam = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    generator = torch.Generator().manual_seed(5)
    init = [torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)]
    steps = [[torch.randn(6, 4, generator=generator), torch.randn(4, generator=generator)] for _ in range(7)]
    warmup = 3

    params = [t.clone().requires_grad_() for t in init]
    peer = qadam_peer(params, warmup, **adam)
    reference = [t.clone().requires_grad_() for t in init]
    adamw = torch.optim.AdamW(reference, **adam)
    # hand-written reference state
    x = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in init]
    v = [torch.zeros_like(t) for t in init]
    beta1, beta2 = adam["betas"]
    for t, grads in enumerate(steps, start=1):
        names_before = [n for b in peer[1] for n in b.names]
        peer = qadam_step(peer, grads)
        names = [n for b in peer[1] for n in b.names]
        assert all(n.startswith("momentum" if t > warmup else "grad") for n in names), (t, names_before, names)
        for i, g in enumerate(grads):
            m[i] = beta1 * m[i] + (1 - beta1) * g
            if t <= warmup:
                v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t)
            v_hat = v[i] / (1 - beta2 ** min(t, warmup))
            if t > warmup:  # frozen v: floored at 1% of the mean v_hat
                v_hat = v_hat.clamp(min=0.01 * v_hat.mean().item())
            update = m_hat / (v_hat.sqrt() + adam["eps"])
            if t > warmup:  # max_update=1: no entry steps more than lr (before weight decay)
                update = update.clamp(-1.0, 1.0)
            x[i] = x[i] - adam["lr"] * (update + adam["weight_decay"] * x[i])
        if t <= warmup:  # warm-up = torch's AdamW, exactly
            set_grads(reference, grads)
            adamw.step()
            for mine, theirs in zip(params, reference, strict=True):
                torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-5, atol=1e-6)
        state = peer[0].context.torch_optimizer.state
        for i, param in enumerate(params):
            torch.testing.assert_close(param.detach(), x[i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state[param]["exp_avg"], m[i], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(state[param]["exp_avg_sq"], v[i], rtol=1e-5, atol=1e-7)
            assert int(state[param]["step"]) == t
    # after warm-up the parameters left torch's AdamW (which keeps updating v)
    assert not torch.allclose(params[0].detach(), reference[0].detach(), atol=1e-4)


def test_qadam_after_warmup_averages_the_peers_momenta_weighted_by_samples() -> None:
    generator = torch.Generator().manual_seed(6)
    init = torch.randn(5, 3, generator=generator)
    peers = [qadam_peer([init.clone().requires_grad_()], 1, lr=0.01) for _ in range(2)]
    shared = torch.randn(5, 3, generator=generator)
    for impl, _ in peers:  # warm-up step: the same gradient everywhere
        set_grads(impl.context.params, [shared])
        impl.on_backward(1)
    global_step(peers)
    momentum_before = peers[0][0].context.torch_optimizer.state[peers[0][0].opt_params[0]]["exp_avg"].clone()
    local = [torch.randn(5, 3, generator=generator) for _ in peers]
    rebuilt = []
    for (impl, _), grad, samples in zip(peers, local, (3, 1), strict=True):
        set_grads(impl.context.params, [grad])
        impl.on_backward(samples)
        assert impl.need_reset()
        impl.reset()
        rebuilt.append((impl, build_buckets(impl)))
    global_step(rebuilt)
    expected = 0.9 * momentum_before + 0.1 * (3 * local[0] + local[1]) / 4
    for impl, _ in rebuilt:
        torch.testing.assert_close(impl.context.torch_optimizer.state[impl.opt_params[0]]["exp_avg"], expected)


def test_a_late_joiner_gets_m_v_and_the_step_with_the_training_state_and_enters_the_same_stage() -> None:
    """m, v and the step live in the wrapped optimizer's state, which the Optimizer shares with newcomers
    (TrainingState.snapshot / load, as in load_state_from_peers)."""
    donor_state = TrainingState(optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), params=[torch.zeros(4, 3)])
    donor = QAdam(2).reify(fake_context(donor_state.main_params, donor_state.optimizer))
    peer = (donor, build_buckets(donor))
    for step in range(3):
        peer = qadam_step(peer, [torch.full((4, 3), float(step + 1))])
    assert donor.compressing  # 3 steps > 2 warm-up steps

    joiner_state = TrainingState(optimizer=lambda p: torch.optim.AdamW(p, lr=0.01), params=[torch.zeros(4, 3)])
    joiner = QAdam(2).reify(fake_context(joiner_state.main_params, joiner_state.optimizer))
    assert not joiner.compressing and not joiner.need_reset()
    joiner_state.load(*donor_state.snapshot())
    joiner.on_state_loaded()
    assert joiner.step_count == 3 and joiner.need_reset()
    joiner.reset()
    assert joiner.compressing
    mine, theirs = joiner_state.optimizer.state, donor_state.optimizer.state
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(mine[joiner.opt_params[0]][key], theirs[donor.opt_params[0]][key])


def test_qadam_refuses_optimizers_and_settings_it_does_not_implement() -> None:
    params = [torch.zeros(3, requires_grad=True)]
    with pytest.raises(ConfigurationError):
        QAdam(0)
    with pytest.raises(ConfigurationError):
        QAdam(1).reify(fake_context(params, torch.optim.SGD(params, lr=0.1)))
    with pytest.raises(ConfigurationError):
        QAdam(1).reify(fake_context(params, torch.optim.Adam(params, amsgrad=True)))
    impl = QAdam(1).reify(fake_context(params, torch.optim.Adam(params)))
    assert set(impl.context.torch_optimizer.state[params[0]]) == {"exp_avg", "exp_avg_sq", "step"}
    warmup_ops = build_buckets(impl)[0].ops
    assert isinstance(warmup_ops[1], AverageOp) and warmup_ops[1].codec is None  # float32
    impl.compressing = True
    assert isinstance(build_buckets(impl)[0].ops[1].codec, MinMaxUInt8)
    with_feedback = QAdam(1, error_feedback=True).reify(fake_context(params, torch.optim.AdamW(params)))
    with_feedback.compressing = True
    codec = build_buckets(with_feedback)[0].ops[1].codec
    assert isinstance(codec, ErrorFeedback) and isinstance(codec.codec, MinMaxUInt8)


# ---------------------------------------------------------------------------------------------
# real peers: convergence against synchronous averaging, bytes on the wire, a peer that dies

IN_FEATURES, HIDDEN, OUT_FEATURES = 32, 128, 8
BATCH_SIZE, TARGET_BATCH_SIZE = 16, 128
MATCHMAKING_TIME, AVERAGING_TIMEOUT = 0.3, 8.0
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)
EPOCHS = 10
# An algorithm's final held-out loss (mean over the peers) may exceed synchronous averaging's by
# RATIO x plus ABS. Measured (start 9.2): at 10 epochs sync 2.13, QAdam 1.97, PowerSGD rank 4 2.67
# (1.25x: its error feedback is still catching up); at 14 epochs sync 1.31, QAdam 1.25, PowerSGD 1.55.
LOSS_TOLERANCE = {"qadam": (1.3, 0.05), "powersgd": (1.5, 0.05)}


def teacher() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return torch.randn(IN_FEATURES, 16, generator=generator) / 4, torch.randn(16, OUT_FEATURES, generator=generator)


def make_batch(generator: torch.Generator, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    first, second = teacher()
    x = torch.randn(size, IN_FEATURES, generator=generator)
    return x, torch.tanh(x @ first) @ second + 0.05 * torch.randn(size, OUT_FEATURES, generator=generator)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT_FEATURES)
    )


def held_out_loss(model: torch.nn.Module) -> float:
    x, y = make_batch(torch.Generator().manual_seed(99), 2048)
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(model(x), y))


@dataclass
class Peer:
    index: int
    model: torch.nn.Module
    opt: hivemind_ext.Optimizer
    dht: hivemind.DHT
    rounds: list[tuple[bool, int, int]] = field(default_factory=list)  # (QAdam compressing, bytes, group size)
    round_epochs: list[int] = field(default_factory=list)  # the epoch of each successful round
    failed_epochs: list[int] = field(default_factory=list)  # the epoch of each failed or missed round
    error: BaseException | None = None
    died: bool = False
    shutdown_error: BaseException | None = None


def make_peer(index: int, dht: hivemind.DHT, run_id: str, algorithm: Any) -> Peer:
    model = make_model()
    opt = hivemind_ext.Optimizer(
        dht=dht,
        run_id=run_id,
        target_batch_size=TARGET_BATCH_SIZE,
        batch_size_per_step=BATCH_SIZE,
        optimizer=lambda params: torch.optim.Adam(params, lr=0.01),
        params=model.parameters(),
        matchmaking_time=MATCHMAKING_TIME,
        averaging_timeout=AVERAGING_TIMEOUT,
        load_state_timeout=20.0,
        tracker_opts={**FAST_TRACKER, "private_key": signing_key(dht)},
        algorithm=algorithm,
    )
    return Peer(index, model, opt, dht)


def train(peer: Peer, until_epoch: int, die_at_epoch: int | None = None) -> None:
    generator = torch.Generator().manual_seed(100 + peer.index)
    runner = peer.opt.algorithm_runner
    try:
        while peer.opt.local_epoch < until_epoch:
            if die_at_epoch is not None and peer.opt.local_epoch >= die_at_epoch:
                peer.died = True
                peer.dht.shutdown()  # abruptly, in the middle of an epoch: its daemon goes first
                try:
                    peer.opt.shutdown()
                except OSError as e:  # closing averagers over a dead daemon can raise (FileNotFoundError)
                    peer.shutdown_error = e
                return
            x, y = make_batch(generator, BATCH_SIZE)
            torch.nn.functional.mse_loss(peer.model(x), y).backward()
            before = runner.bytes_sent if runner is not None else 0
            rounds = runner.rounds if runner is not None else 0
            failed = runner.failed_rounds if runner is not None else 0
            epoch = peer.opt.local_epoch
            peer.opt.step()
            peer.opt.zero_grad()
            if runner is not None and runner.rounds > rounds and runner.last_round is not None:
                compressing = bool(getattr(runner.impl, "compressing", False))
                peer.rounds.append((compressing, runner.bytes_sent - before, runner.last_round.group_size))
                peer.round_epochs.append(epoch)
            if runner is not None and runner.failed_rounds > failed:
                peer.failed_epochs.append(epoch)
            time.sleep(0.005)
    except BaseException as e:  # reported by the test
        peer.error = e


def run_swarm(peers: Sequence[Peer], until_epoch: int, die: dict[int, int] | None = None, timeout: float = 90) -> None:
    die = die or {}
    # every tracker sees the whole swarm first: a peer that started before seeing all the others expected
    # fewer, formed the first round without the last one, and that one then stayed an epoch behind for
    # several epochs (miss, download, late again), which a run of 6 epochs cannot tell from a death
    wait_for(
        lambda: all(p.opt.tracker.global_progress.num_trainers == len(peers) for p in peers),
        10,
        message="every peer to see the swarm",
    )
    threads = [threading.Thread(target=train, args=(p, until_epoch, die.get(p.index)), daemon=True) for p in peers]
    for thread in threads:
        thread.start()
    give_up = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(give_up - time.monotonic(), 0.1))
    for peer in peers:
        assert peer.error is None, f"peer {peer.index} failed: {peer.error!r}"
    stuck = [p.index for p, t in zip(peers, threads, strict=True) if t.is_alive()]
    assert not stuck, f"peers {stuck} did not reach epoch {until_epoch} in {timeout} s"


@pytest.fixture(scope="module")
def swarm() -> Any:
    with local_swarm(4) as dhts:
        yield dhts


def train_and_evaluate(dhts: Sequence[hivemind.DHT], run_id: str, algorithm: Any) -> tuple[float, list[Peer]]:
    peers = [make_peer(i, dht, run_id, algorithm) for i, dht in enumerate(dhts)]
    try:
        run_swarm(peers, EPOCHS)
        return statistics.mean(held_out_loss(peer.model) for peer in peers), peers
    finally:
        for peer in peers:
            peer.opt.shutdown()


_results: dict[str, tuple[float, list[Peer]]] = {}
_keep_alive: list[Any] = []


def result_of(name: str, dhts: Sequence[hivemind.DHT]) -> tuple[float, list[Peer]]:
    """Each configuration trains once per module (the bytes test reuses QAdam's run)."""
    if name not in _results:
        algorithm = {"sync": None, "qadam": QAdam(warmup_steps=5), "powersgd": PowerSGD(rank=4)}[name]
        _results[name] = train_and_evaluate(dhts, f"conv_{name}", algorithm)
    return _results[name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["qadam", "powersgd"])
def test_four_peers_reach_the_loss_of_synchronous_averaging(swarm: list[hivemind.DHT], name: str) -> None:
    sync_loss, _ = result_of("sync", swarm)
    loss, peers = result_of(name, swarm)
    initial = held_out_loss(make_model())
    assert sync_loss < 0.5 * initial, f"the baseline did not learn: {sync_loss} vs {initial} at the start"
    ratio, slack = LOSS_TOLERANCE[name]
    assert loss <= ratio * sync_loss + slack, (name, loss, sync_loss)
    assert loss < 0.5 * initial, (name, loss, initial)
    assert all(peer.opt.local_epoch >= EPOCHS for peer in peers)
    runner = peers[0].opt.algorithm_runner
    assert runner is not None and runner.rounds >= EPOCHS * (2 if name == "powersgd" else 1) // 2


@pytest.mark.timeout(120)
def test_qadam_sends_about_a_quarter_of_the_bytes_after_warmup(swarm: list[hivemind.DHT]) -> None:
    """A peer sends 2 (n - 1) / n of its tensors in a group of n (its parts to n - 1 owners, then its averaged
    part back to them), so each round's bytes are divided by that before warm-up and 8-bit rounds are
    compared: a warm-up in groups of 2 against 8-bit rounds in groups of 4 read 1.5x the codec's ratio
    (0.35+ under load). Comparing only rounds of one size instead found too few of them when the groups
    varied under load (CI-like run at load 8-12: 3 compressed rounds of the best size). Measured: groups of
    4, 8766 / 32322 bytes = 0.27; groups of 3, 7482 / 28442 = 0.26."""
    _, peers = result_of("qadam", swarm)
    rounds = [(compressing, nbytes, size) for peer in peers for compressing, nbytes, size in peer.rounds if nbytes]
    per_tensor = {True: [], False: []}
    for compressing, nbytes, size in rounds:
        if size >= 2:
            per_tensor[compressing].append(nbytes / (2 * (size - 1) / size))
    assert len(per_tensor[False]) >= 4 and len(per_tensor[True]) >= 4, rounds
    ratio = statistics.median(per_tensor[True]) / statistics.median(per_tensor[False])
    assert 0.2 <= ratio <= 0.3, (ratio, rounds)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["qadam", "powersgd"])
def test_a_peer_that_dies_mid_run_does_not_stop_the_others(swarm: list[hivemind.DHT], name: str) -> None:
    algorithm = QAdam(warmup_steps=2) if name == "qadam" else PowerSGD(rank=4)
    _keep_alive.append(algorithm)  # model keys count Algorithm objects by id: a reused id would split the run
    victim_dht = new_peer(addresses(swarm[0]))
    run_id = f"dies_{name}"
    peers = [make_peer(i, dht, run_id, algorithm) for i, dht in enumerate(swarm[:3])]
    peers.append(make_peer(3, victim_dht, run_id, algorithm))
    try:
        die_at = 3
        run_swarm(peers, until_epoch=6, die={3: die_at})
        assert peers[3].died
        survivors = peers[:3]
        assert all(peer.opt.local_epoch >= 6 for peer in survivors)
        # the swarm kept averaging after the death: every survivor that was in line when the victim died
        # (no round failed before) averaged again, and so did at least two survivors in all. A survivor
        # that was already behind (late for an early round: it then misses round after round, each
        # download landing it just after the swarm's next round formed, see the runner's missed-round
        # check) may still be catching up by epoch 6 whether or not a peer dies.
        after = {peer.index: [epoch for epoch in peer.round_epochs if epoch > die_at] for peer in survivors}
        history = {peer.index: (peer.round_epochs, peer.failed_epochs) for peer in survivors}
        in_line = [peer.index for peer in survivors if not [e for e in peer.failed_epochs if e < die_at]]
        assert all(after[index] for index in in_line), (in_line, history)
        assert sum(bool(epochs) for epochs in after.values()) >= 2, history
    finally:
        for peer in peers:
            peer.opt.shutdown()
        victim_dht.shutdown()
