"""Robust aggregation under attack: held-out loss with hostile peers, and what robustness costs.

8 peers train the same MLP on sklearn's digits with synchronous averaging: every step each peer
computes the gradient of its own batch of 32, folds it into its own momentum (0.9; worker momentum,
as Karimireddy et al. pair CenteredClip with: it shrinks the honest spread the clip radius follows),
the 8 momenta are averaged part by part, and every peer steps by the average (SGD, lr 0.1 on a
cosine schedule to 0). With plain averaging this is exactly SGD with momentum on the averaged
gradient. Hostile peers compute their honest momentum and send instead:

- ``scaled``: the momentum x 1000 (far past the default norm bound, 100x the median);
- ``random``: Gaussian noise with 10x its norm (within the bound);
- ``sign_flip``: minus 10x the momentum (within the bound);
- ``lying_donor``: honest momenta, but as state donors they serve the parameters x 57 (finite,
  with valid chunk digests); at the middle of the run one honest peer restarts and downloads the
  state. The download is real: one network round per library and attacker count, on 8 averagers
  (ours with ``require_agreement`` as the Optimizer sets it in synchronous training; hivemind's with
  the hostile donors declaring the highest priority), from the clean run's state at the middle;
  which state each library's joiner adopted (the honest one or x57) is then applied in the training
  runs at their middle, with a fresh momentum.

Each mode runs with 1 and with 2 of the 8 peers hostile (``MODE`` and ``MODE2`` in ``--cases``),
and cleanly. The score of a run is the mean held-out loss of the honest peers over its last 30
steps, averaged over ``--seeds`` seeds (each seed: other batches and initial parameters, the same
for every aggregator); the goal compares it with the clean run of plain averaging.

Training quality ("in-process"): 8 peers' steps run in this process, and each part of the
flattened momentum (the butterfly's layout: 8 equal parts) is reduced by the owner-side code
itself: our ``PartReducer`` (plain mean with the default norm bound, ``CenteredClip()``
adaptive, ``TrimmedMean(trim=0.25)``) and hivemind's ``TensorPartReducer`` (its plain weighted
mean, no bound) as the "hivemind" column. The network would only change who sends what when, so
this runs the whole matrix in a few minutes; ``--network-rounds`` cross-checks it.

Round time and the cross-check ("network"): the first ``--network-rounds`` steps of some cases run
on real averagers (8 hivemind DHTs with libp2p daemons on 127.0.0.1, ours and hivemind's
``DecentralizedAverager``); the median round time of the clean cases is the cost of robust
aggregation, and each network run's held-out loss is printed beside the in-process run's after the
same steps (they match unless a round failed on the network: a failed round makes its peers step
on their own momentum).

    python benchmarks/robust.py     # defaults: all cases, 3 seeds, 300 steps; 8 min of CPU time
    python benchmarks/robust.py --seeds 5 --network-rounds 300 --network-cases clean sign_flip random2   # more
    python benchmarks/robust.py --fixed-tau 0.05          # adds CenteredClip with that fixed radius

Options to run the full matrix over the network: ``--network-cases`` takes every case name
(``clean``, ``MODE``, ``MODE2`` except the lying donor, which is a network case anyway) and
``--network-rounds`` as many steps as ``--steps``; expect ~0.1-0.2 s per round on an idle machine,
1-2 s on a loaded one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hivemind
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    Digits,
    Result,
    describe_machine,
    digits_mlp,
    emit,
    full_group_averager,
    load_digits,
    lower_is_better,
)

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PEERS = 8
HIDDEN = 128
BATCH = 32
LR, MOMENTUM = 0.1, 0.9
TAIL = 30  # steps at the end whose held-out losses make a run's score
POISON = 57.0  # what a lying donor multiplies the parameters by
STEP_TIMEOUT = 30.0
MODES = ("scaled", "random", "sign_flip", "lying_donor")
AGGREGATORS = ("plain", "centered_clip", "trimmed_mean")


# ----- the problem


def make_model(seed: int) -> torch.nn.Module:
    return digits_mlp(HIDDEN, seed)  # every peer and every aggregator of one seed: the same initial parameters


def batch_of(data: Digits, peer: int, step: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peer ``peer``'s batch at ``step``: the same for every aggregator and attack of one seed."""
    generator = torch.Generator().manual_seed(1_000_003 * peer + step + 7919 * seed)
    indices = torch.randint(len(data.train_x), (BATCH,), generator=generator)
    return data.train_x[indices], data.train_y[indices]


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_params(model: torch.nn.Module, flat: torch.Tensor) -> None:
    torch.nn.utils.vector_to_parameters(flat, model.parameters())


def held_out_loss(model: torch.nn.Module, data: Digits) -> float:
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(data.test_x), data.test_y).item()


def flat_gradient(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def corrupt(mode: str, momentum: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if mode == "scaled":
        return momentum * 1000.0
    if mode == "sign_flip":
        return momentum * -10.0
    if mode == "random":
        noise = torch.randn(momentum.shape, generator=generator)
        return noise * (10.0 * float(momentum.norm()) / float(noise.norm()))
    if mode == "lying_donor":
        return momentum  # honest in averaging: it lies as a donor
    raise ValueError(mode)


def learning_rate(step: int, steps: int) -> float:
    return LR * 0.5 * (1 + math.cos(math.pi * step / steps))


# ----- owner-side reduction in this process (each library's own reducer, no network)


def part_bounds_of(size: int) -> list[tuple[int, int]]:
    """The butterfly's parts for 8 members of equal bandwidth (what the averagers use)."""
    from hivemind_ext.averaging.allreduce.partition import MemberRole, part_bounds, part_sizes

    return part_bounds(part_sizes(size, [MemberRole(1.0)] * PEERS))


def make_aggregator(name: str, fixed_tau: float | None) -> Any:
    from hivemind_ext.averaging import CenteredClip, TrimmedMean

    return {
        "plain": None,
        "centered_clip": CenteredClip(),
        "centered_clip_fixed": CenteredClip(tau=fixed_tau) if fixed_tau else None,
        "trimmed_mean": TrimmedMean(trim=0.25),
    }[name]


class OursInProcess:
    """Our owners' ``PartReducer`` on each part, fed chunk by chunk as the network would."""

    CHUNK = 4096  # about one chunk per part: the same values as smaller chunks, fewer calls

    def __init__(self, aggregator: Any, bounds: Sequence[tuple[int, int]]) -> None:
        self.aggregator, self.bounds = aggregator, bounds
        self.rounds_excluding = 0

    def average(self, rows: torch.Tensor) -> torch.Tensor:
        from hivemind_ext.averaging.allreduce.reducer import PartReducer
        from hivemind_ext.compression import NoCompression
        from hivemind_ext.errors import AllreduceError, ProtocolError

        codec, result, excluded = NoCompression(), torch.empty(rows.shape[1]), False
        for start, end in self.bounds:
            reducer = PartReducer(
                end - start, self.CHUNK, dict.fromkeys(range(len(rows)), float(BATCH)), aggregator=self.aggregator
            )
            for index, offset in enumerate(range(start, end, self.CHUNK)):
                for sender in reducer.active_senders():
                    with contextlib.suppress(ProtocolError):  # NaN/Inf: the sender is excluded, as on the wire
                        reducer.accept(
                            sender, index, codec.compress(rows[sender, offset : min(offset + self.CHUNK, end)])
                        )
            try:
                reduced = reducer.finalize()
            except AllreduceError:  # nobody sent finite values (a diverged swarm): the round fails
                result[start:end] = math.nan
                continue
            excluded |= bool(reduced.rejected)
            result[start:end] = reduced.values
        self.rounds_excluding += excluded
        return result


class HivemindInProcess:
    """hivemind's owner-side ``TensorPartReducer`` on each part (its weighted mean, no bound)."""

    def __init__(self, bounds: Sequence[tuple[int, int]]) -> None:
        self.bounds = bounds
        self.rounds_excluding = 0

    def average(self, rows: torch.Tensor) -> torch.Tensor:
        return asyncio.run(self._average(rows))

    async def _average(self, rows: torch.Tensor) -> torch.Tensor:
        from hivemind.averaging.partition import TensorPartReducer

        result = torch.empty(rows.shape[1])
        for start, end in self.bounds:
            reducer = TensorPartReducer([torch.Size([end - start])], len(rows))
            parts = [reducer.accumulate_part(i, 0, row[start:end].clone(), float(BATCH)) for i, row in enumerate(rows)]
            result[start:end] = (await asyncio.gather(*parts))[0]
        return result


# ----- one training run


@dataclasses.dataclass(frozen=True)
class Case:
    name: str  # "clean", "sign_flip 1/8", ...
    mode: str | None = None
    attackers: int = 0


@dataclasses.dataclass
class Run:
    losses: list[float]  # held-out loss of the honest peers (mean) at each of the last TAIL steps
    rounds_excluding: int = 0  # rounds in which the norm bound left someone out

    @property
    def score(self) -> float:
        return statistics.mean(self.losses) if all(math.isfinite(v) for v in self.losses) else math.inf


def train(
    case: Case,
    average: Callable[[torch.Tensor], torch.Tensor],
    data: Digits,
    *,
    steps: int,
    seed: int,
    schedule: int | None = None,
    joiner_adopts: str = "honest",
) -> tuple[Run, torch.Tensor]:
    """``steps`` synchronous steps (of a cosine schedule ``schedule`` steps long); honest peers share
    one set of parameters, except a joiner that adopted a poisoned state (lying donor). Returns the
    run and the swarm's final parameters."""
    schedule = schedule or steps
    hostile = set(range(PEERS - case.attackers, PEERS))
    swarm, joiner = make_model(seed), None  # joiner: peer 0's own model once it adopted a poisoned state
    size = flat_params(swarm).numel()
    momenta = torch.zeros(PEERS, size)
    generator, losses = torch.Generator().manual_seed(7 + seed), []
    for step in range(steps):
        if case.mode == "lying_donor" and step == schedule // 2:
            momenta[0].zero_()  # peer 0 restarts and downloads the state
            if joiner_adopts == "poisoned":
                joiner = make_model(seed)
                set_params(joiner, flat_params(swarm) * POISON)
        for peer in range(PEERS):
            model = joiner if peer == 0 and joiner is not None else swarm
            momenta[peer].mul_(MOMENTUM).add_(flat_gradient(model, *batch_of(data, peer, step, seed)))
        rows = momenta.clone()
        for peer in hostile:
            rows[peer] = corrupt(case.mode, momenta[peer], generator)
        update = average(rows) * learning_rate(step, schedule)
        for model in (swarm, joiner) if joiner is not None else (swarm,):
            set_params(model, flat_params(model) - update)
        if step >= steps - TAIL:
            honest = PEERS - len(hostile)
            loss = held_out_loss(swarm, data)
            if joiner is not None:
                loss = (loss * (honest - 1) + held_out_loss(joiner, data)) / honest
            losses.append(loss)
        if not math.isfinite(float(update.sum())):  # diverged: every later step is NaN too
            losses += [math.inf] * (min(TAIL, steps) - len(losses))
            break
    return Run(losses), flat_params(swarm)


# ----- the lying donor's download, for real


def download_outcome(impl: str, dhts: Sequence[Any], state: torch.Tensor, attackers: int, index: int) -> str:
    """Which state a joiner (on ``dhts[0]``) adopts when the last ``attackers`` of the other peers
    serve ``state`` x POISON and the rest serve ``state``: "honest", "poisoned" or "none"."""
    prefix = f"robust_donor_{index}_{impl}_{attackers}"
    donors = []
    try:
        for i, dht in enumerate(dhts[1:], start=1):
            lying = i >= len(dhts) - attackers
            tensors = [state * POISON if lying else state.clone()]
            # a lying donor claims a newer version (priority) than the honest ones: one epoch ahead, as
            # the Optimizer still accepts; hivemind asks the highest priority first
            donors.append(_state_averager(impl, tensors, dht, prefix, priority=2 if lying else 1))
        joiner = _state_averager(impl, [torch.zeros_like(state)], dhts[0], prefix, priority=0)
        donors.append(joiner)
        time.sleep(3.0)  # donor records reach the DHT
        loaded = joiner.load_state_from_peers(timeout=60)
    finally:
        for averager in donors:
            averager.shutdown()
    if loaded is None:
        return "none"
    adopted = loaded[1][0]
    if torch.allclose(adopted, state):
        return "honest"
    return "poisoned" if torch.allclose(adopted, state * POISON) else "none"


def _state_averager(impl: str, tensors: list[torch.Tensor], dht: Any, prefix: str, priority: int) -> Any:
    common = dict(prefix=prefix, target_group_size=PEERS, start=True)
    if impl == "hivemind":
        from hivemind.averaging import DecentralizedAverager as HivemindAverager

        averager = HivemindAverager(tensors, dht, **common)
    else:
        from hivemind_ext.averaging import DecentralizedAverager

        averager = DecentralizedAverager(tensors, dht, require_agreement=True, **common)
    averager.state_sharing_priority = priority
    return averager


# ----- the same steps over the network


def network_run(
    case: Case, impl: str, aggregator: Any, dhts: Sequence[Any], data: Digits, rounds: int, schedule: int, index: int
) -> tuple[float, float, int]:
    """The first ``rounds`` steps of ``case`` (seed 0) on 8 real averagers; returns the median round
    time (s), the honest peers' mean held-out loss after them, and how many peer-rounds failed."""
    hostile = set(range(PEERS - case.attackers, PEERS))
    models = [make_model(0) for _ in range(PEERS)]
    size = flat_params(models[0]).numel()
    momenta = torch.zeros(PEERS, size)
    buffers = [torch.zeros(size) for _ in range(PEERS)]
    prefix = f"robust_net_{index}_{impl}"
    averagers = [_averager(impl, [buffers[i]], dhts[i], prefix, aggregator) for i in range(PEERS)]
    generator, round_times, failures = torch.Generator().manual_seed(7), [], 0
    try:
        for step in range(rounds):
            for peer in range(PEERS):
                model = models[0] if peer in hostile else models[peer]  # hostile: an honest peer's parameters
                momenta[peer].mul_(MOMENTUM).add_(flat_gradient(model, *batch_of(data, peer, step, 0)))
                row = corrupt(case.mode, momenta[peer], generator) if peer in hostile else momenta[peer]
                with averagers[peer].get_tensors() as tensors:
                    tensors[0].copy_(row)
            started = time.perf_counter()
            controls = [a.step(wait=False, timeout=STEP_TIMEOUT, weight=float(BATCH)) for a in averagers]
            finished = [peer in hostile or _finished(control) for peer, control in enumerate(controls)]
            round_times.append(time.perf_counter() - started)
            for peer in hostile:  # one left out of every part retries until its timeout: stop it
                controls[peer].cancel()
            for peer in set(range(PEERS)) - hostile:
                failures += not finished[peer]
                with averagers[peer].get_tensors() as tensors:
                    update = tensors[0] if finished[peer] else momenta[peer]
                    set_params(models[peer], flat_params(models[peer]) - update * learning_rate(step, schedule))
    finally:
        for averager in averagers:
            averager.shutdown()
    losses = [held_out_loss(models[p], data) for p in range(PEERS) if p not in hostile]
    loss = statistics.mean(losses) if all(math.isfinite(v) for v in losses) else math.inf
    return statistics.median(round_times[1:] or round_times), loss, failures


def _averager(impl: str, tensors: list[torch.Tensor], dht: Any, prefix: str, aggregator: Any) -> Any:
    extra = {} if impl == "hivemind" else dict(aggregator=aggregator)
    return full_group_averager(impl, tensors, dht, prefix, PEERS, **extra)


def _finished(control: Any) -> bool:
    try:
        control.result(timeout=STEP_TIMEOUT + 30)
        return True
    except Exception as e:
        logging.info(f"step failed: {type(e).__name__}: {e}")
        return False


def start_swarm(peers: int) -> list[Any]:
    dhts = [hivemind.DHT(start=True, host_maddrs=LOOPBACK)]
    initial_peers = [str(a) for a in dhts[0].get_visible_maddrs()]
    for _ in range(peers - 1):  # one at a time: bootstrapping 7 at once fails on a loaded 2-core box
        dhts.append(hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=initial_peers))
    return dhts


# ----- the run


def cases_for(selected: Sequence[str]) -> list[Case]:
    cases = [Case("clean")] if "clean" in selected else []
    for attackers, suffix in ((1, ""), (2, "2")):
        cases += [Case(f"{mode} {attackers}/{PEERS}", mode, attackers) for mode in MODES if mode + suffix in selected]
    return cases


def _finite(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def main(argv: Sequence[str] | None = None) -> None:
    everything = ["clean", *MODES, *(f"{mode}2" for mode in MODES)]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run (a cosine schedule to 0)")
    parser.add_argument("--seeds", type=int, default=3, help="runs per case and aggregator, averaged")
    parser.add_argument("--cases", nargs="+", default=everything, help="clean, MODE (1 hostile), MODE2 (2 hostile)")
    parser.add_argument("--fixed-tau", type=float, default=None, help="also run CenteredClip(tau=this)")
    parser.add_argument("--network-rounds", type=int, default=30, help="steps of each network run (0: none)")
    parser.add_argument("--network-cases", nargs="+", default=["clean", "sign_flip"], help="cases run on the network")
    parser.add_argument("--no-hivemind", action="store_true", help="skip hivemind (its reducer and averagers)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)  # 8 peers' small steps: threads only add contention on a shared box
    print(f"machine: {describe_machine()}", flush=True)
    data = load_digits()
    aggregators = [*AGGREGATORS, *(["centered_clip_fixed"] if args.fixed_tau else [])]
    impls = [("ours", a) for a in aggregators] + ([] if args.no_hivemind else [("hivemind", "plain")])
    bounds = part_bounds_of(flat_params(make_model(0)).numel())
    cases = cases_for(args.cases)
    print(
        f"{PEERS} peers, {args.steps} steps of batch {BATCH} per peer, worker momentum {MOMENTUM}, lr {LR} cosine; "
        f"score: honest held-out loss over the last {TAIL} steps, mean of {args.seeds} seeds",
        flush=True,
    )
    needs_network = args.network_rounds > 0 or any(c.mode == "lying_donor" for c in cases)
    dhts = start_swarm(PEERS) if needs_network else []
    scores: dict[tuple[str, str, str], float] = {}
    network: dict[tuple[str, str, str], tuple[float, float, int]] = {}
    try:
        adopted = {}
        for index, case in enumerate(c for c in cases if c.mode == "lying_donor"):
            _, middle = train(
                Case("clean"),
                OursInProcess(None, bounds).average,
                data,
                steps=args.steps // 2,
                seed=0,
                schedule=args.steps,
            )
            for impl in ("ours", *([] if args.no_hivemind else ["hivemind"])):
                adopted[(impl, case.attackers)] = download_outcome(impl, dhts, middle, case.attackers, index)
                print(
                    f"{case.name:>16} {impl:>8}: the joiner adopted the {adopted[(impl, case.attackers)]} state",
                    flush=True,
                )
        for case in cases:
            for impl, name in impls:
                started, runs = time.perf_counter(), []
                for seed in range(args.seeds):
                    reducer = (
                        HivemindInProcess(bounds)
                        if impl == "hivemind"
                        else OursInProcess(make_aggregator(name, args.fixed_tau), bounds)
                    )
                    joiner = adopted.get((impl, case.attackers), "honest") if case.mode == "lying_donor" else "honest"
                    run, _ = train(case, reducer.average, data, steps=args.steps, seed=seed, joiner_adopts=joiner)
                    run.rounds_excluding = reducer.rounds_excluding
                    runs.append(run)
                scores[(case.name, impl, name)] = statistics.mean(r.score for r in runs)
                print(
                    f"{case.name:>16} {impl:>8} {name:>19}: held-out loss {scores[(case.name, impl, name)]:.4f} "
                    f"(seeds: {' '.join(f'{r.score:.4f}' for r in runs)}), rounds excluding someone "
                    f"{sum(r.rounds_excluding for r in runs)}, {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
        network_cases = [c for c in cases_for(args.network_cases) if c.mode != "lying_donor"]
        for index, case in enumerate(network_cases if args.network_rounds > 0 else []):
            names = AGGREGATORS if case.mode is None else ("centered_clip",)
            for impl, name in [("ours", n) for n in names] + ([] if args.no_hivemind else [("hivemind", "plain")]):
                started = time.perf_counter()
                outcome = network_run(
                    case,
                    impl,
                    make_aggregator(name, args.fixed_tau),
                    dhts,
                    data,
                    args.network_rounds,
                    args.steps,
                    index,
                )
                network[(case.name, impl, name)] = outcome
                reducer = (
                    HivemindInProcess(bounds)
                    if impl == "hivemind"
                    else OursInProcess(make_aggregator(name, args.fixed_tau), bounds)
                )
                _, params = train(case, reducer.average, data, steps=args.network_rounds, seed=0, schedule=args.steps)
                model = make_model(0)
                set_params(model, params)
                print(
                    f"{case.name:>16} {impl:>8} {name:>19}: network, {args.network_rounds} rounds: round "
                    f"{outcome[0] * 1000:.0f} ms, held-out loss {outcome[1]:.4f} (in-process "
                    f"{held_out_loss(model, data):.4f}), failed peer-rounds {outcome[2]}, "
                    f"{time.perf_counter() - started:.0f} s",
                    flush=True,
                )
    finally:
        for dht in dhts:
            dht.shutdown()
    emit("robust", summarize(scores, network))


def summarize(
    scores: dict[tuple[str, str, str], float], network: dict[tuple[str, str, str], tuple[float, float, int]]
) -> list[Result]:
    results: list[Result] = []
    names = list(dict.fromkeys(name for name, _, _ in scores))
    clean = scores.get(("clean", "ours", "plain"))
    for name in names:
        theirs = scores.get((name, "hivemind", "plain"))
        for aggregator in (*AGGREGATORS, "centered_clip_fixed"):
            ours = scores.get((name, "ours", aggregator))
            if ours is not None:
                hivemind_loss = _finite(theirs) if theirs is not None else None
                results.append(lower_is_better(f"{name}, {aggregator}", "held-out loss", _finite(ours), hivemind_loss))
        clip = scores.get((name, "ours", "centered_clip"))
        if clean and clip is not None:  # the goals: <= 1.02 with 1 of 8 hostile, <= 1.01 clean
            results.append(
                Result(f"{name}, centered_clip vs clean plain", "loss ratio", _finite(clip / clean), None, None)
            )
    hivemind_clean = network.get(("clean", "hivemind", "plain"))
    for aggregator in AGGREGATORS:
        outcome = network.get(("clean", "ours", aggregator))
        if outcome is not None:
            theirs = round(hivemind_clean[0], 4) if hivemind_clean else None
            results.append(lower_is_better(f"clean, {aggregator}", "round seconds", round(outcome[0], 4), theirs))
    plain, clip = network.get(("clean", "ours", "plain")), network.get(("clean", "ours", "centered_clip"))
    if plain and clip:  # the goal: <= 1.10
        results.append(
            Result("clean, centered_clip vs plain", "round time ratio", round(clip[0] / plain[0], 4), None, None)
        )
    return results


if __name__ == "__main__":
    main()
