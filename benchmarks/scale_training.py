"""scale.py's training case (issue 14): 16 peers train a small MLP on sklearn's digits with synchronous
gradient averaging, once in rotating groups of 4 (``averager_opts=dict(target_group_size=4)``) and
once in one group of all 16, on the same swarm, the same initial parameters and the same batches.

Equal samples, by construction: the peers train in lockstep. In each epoch every peer processes
exactly ``steps_per_epoch`` batches: all but the last freely, the last only once the swarm's
progress records show that every peer has processed all but its last (or the swarm entered the
next epoch). ``target_batch_size`` is one sample more than those, so the first last batch ends the
epoch, and every peer's last batch then joins the round (a peer must call ``step()`` to average).
Without this, peers kept stepping while rounds formed, and an epoch held 9-14x
``target_batch_size`` samples, different in each case. A peer that resynchronizes (a failed round,
a state download that moves it to a later epoch) processes fewer batches; the samples are counted
per case, and ``equal_samples`` says whether both cases processed the same number.

Reported per case: the held-out loss and accuracy (mean over the peers' final models), the spread
of parameters across peers (the largest distance of a peer's parameters from the peers' mean,
relative to the mean's largest value), the samples, epochs reached, the group sizes of the
gradient rounds, seconds, and the CPU seconds of this process and of the peers' DHT processes and
daemons. The goal: groups of 4 within 2% of one group of 16 in held-out loss.

Peers are kept light for a small shared machine: threads of one process, each with its own
hivemind DHT and libp2p daemon (every peer must have its own peer id), a 64-32-10 MLP (2,410
parameters), batches of 8, peers idle while they wait for the swarm, and progress records read
every 0.2-1 s (:data:`TRACKER`; the other benchmarks read them every 0.05-0.5 s, which at 16
peers kept the DHT processes busy), and no state averaging beyond the Optimizer's default.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import statistics
import threading
import time
import traceback
from typing import Any

import torch
from algorithms import BatchStream, evaluate, local_swarm
from common import Digits, load_digits
from hivemind.utils.crypto import RSAPrivateKey

HIDDEN = 32
TRACKER = dict(min_refresh_period=0.2, max_refresh_period=1.0, default_refresh_period=0.5)
WAIT_POLL = 0.05  # how often a peer that waits for the swarm looks at its tracker's view (no network)


def small_model() -> torch.nn.Module:
    torch.manual_seed(0)  # every peer, both cases: the same initial parameters
    return torch.nn.Sequential(torch.nn.Linear(64, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 10))


def relative_spread(params: list[torch.Tensor]) -> float:
    """The largest distance of a peer's parameters from the peers' mean, relative to the mean's size."""
    mean = torch.stack(params).mean(0)
    return max(float((p - mean).abs().max()) for p in params) / float(mean.abs().max())


def train_case(
    dhts: list[Any],
    keys: list[RSAPrivateKey],
    data: Digits,
    *,
    group: int | None,
    epochs: int,
    batch: int,
    steps_per_epoch: int,
    lr: float,
    timeout: float,
    hops: int | str = 1,
) -> dict[str, Any]:
    """Every peer trains ``epochs`` epochs of ``steps_per_epoch`` batches in lockstep (see the module
    docstring); ``group``: target_group_size (None: one group); ``hops``: ``grad_averaging_hops``."""
    import hivemind_ext

    if steps_per_epoch < 2:
        raise ValueError("lockstep needs at least 2 batches per epoch (the last one waits for the swarm)")
    peers = len(dhts)
    models = [small_model() for _ in dhts]
    averager_opts = dict(target_group_size=group) if group is not None else {}
    run_id = f"scale_digits_{group or peers}_{secrets.token_hex(3)}"
    all_but_last = peers * batch * (steps_per_epoch - 1)  # the swarm's samples before the last batches
    optimizers = [
        hivemind_ext.Optimizer(
            dht=dht,
            run_id=run_id,
            target_batch_size=all_but_last + 1,
            batch_size_per_step=batch,
            optimizer=lambda p: torch.optim.Adam(p, lr=lr),
            params=model.parameters(),
            matchmaking_time=3.0,
            averaging_timeout=30.0,
            shutdown_timeout=2.0,
            tracker_opts={**TRACKER, "private_key": key},
            averager_opts=averager_opts,
            grad_averaging_hops=hops,
        )
        for dht, model, key in zip(dhts, models, keys, strict=True)
    ]
    state_rounds: collections.Counter[str] = collections.Counter()  # parameter rounds: applied or not
    for opt in optimizers:
        opt.state_averager.apply_round = counted_rounds(opt, state_rounds)
    samples = [0] * peers
    discarded = [0] * peers  # batches whose step() resynchronized the peer instead of counting them
    group_sizes: list[int] = []  # members of each gradient round a peer took part in (as it ended its epoch)
    hop_sizes: list[int] = []  # members of each further hop's group (0: the hop was skipped)
    errors: list[str] = []
    stop = threading.Event()

    def swarm_is_at_last_batch(opt: Any, epoch: int) -> bool:
        progress = opt.tracker.global_progress
        return progress.epoch > epoch or progress.samples_accumulated >= all_but_last

    def train(index: int) -> None:
        opt, model = optimizers[index], models[index]
        stream = BatchStream(data, index, batch)
        epoch, done = opt.local_epoch, 0  # batches this peer processed in its current epoch
        try:
            while opt.local_epoch < epochs and not stop.is_set():
                if opt.local_epoch != epoch:
                    group_sizes.append(len(opt.last_round_samples))
                    hop_sizes.extend(opt.engine.hops.last_hops)
                    epoch, done = opt.local_epoch, 0
                if done >= steps_per_epoch - 1 and not swarm_is_at_last_batch(opt, epoch):
                    time.sleep(WAIT_POLL)
                    continue
                if done >= steps_per_epoch:  # the last batch's step() ends the epoch whatever its round did
                    errors.append(f"peer {index}: still in epoch {epoch} after its last batch")
                    return
                x, y = stream.next_batch()
                torch.nn.functional.cross_entropy(model(x), y).backward()
                before = (opt.local_epoch, opt.tracker.local_progress.samples_accumulated)
                opt.step()
                opt.zero_grad()
                if step_counted(opt, before, len(x), last=done == steps_per_epoch - 1):
                    samples[index] += len(x)
                    done += 1
                else:  # the step downloaded the swarm's state instead (a resync): its batch does not count
                    discarded[index] += 1
                time.sleep(0.02)
        except Exception:
            errors.append(f"peer {index}: {traceback.format_exc()}")
            stop.set()

    cpu_before = process_tree_cpu()
    try:
        threads = [threading.Thread(target=train, args=(i,), daemon=True) for i in range(peers)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(max(1.0, started + timeout - time.monotonic()))
        seconds = time.monotonic() - started
        stop.set()
        for thread in threads:
            thread.join(30)
        cpu = {kind: used - cpu_before.get(kind, 0.0) for kind, used in process_tree_cpu().items()}
        finished = [opt.local_epoch for opt in optimizers]
        scores = [evaluate(model, data) for model in models]
        params = [torch.cat([p.detach().flatten() for p in model.parameters()]) for model in models]
        initial = torch.cat([p.detach().flatten() for p in small_model().parameters()])
    finally:
        for opt in optimizers:
            with contextlib.suppress(Exception):
                opt.shutdown()
    return dict(
        loss=statistics.mean(s[0] for s in scores),
        accuracy=statistics.mean(s[1] for s in scores),
        spread=relative_spread(params),
        moved=relative_spread([params[0], initial]),
        samples=sum(samples),
        discarded=sum(discarded),
        target_samples=peers * batch * steps_per_epoch * epochs,
        epochs=(min(finished), max(finished)),
        group_size=statistics.mean(group_sizes) if group_sizes else 0.0,
        hop_sizes=collections.Counter(hop_sizes),
        state_rounds=(state_rounds["applied"], state_rounds["applied"] + state_rounds["not applied"]),
        repeated_rounds=state_rounds["repeated"],
        seconds=seconds,
        cpu=cpu,
        error=errors[0].strip().splitlines()[-1][:200] if errors else None,
    )


def step_counted(opt: Any, before: tuple[int, int], batch: int, *, last: bool) -> bool:
    """Whether the ``step()`` just made counted its batch toward the swarm's progress. A step that
    catches up with the swarm (a resync after a failed or missed round) downloads the state and
    reports 0 samples instead: counting that batch anyway left the swarm one batch short of
    ``all_but_last`` for good, and every peer waited for it until the case's timeout (2 of 12 epochs
    in 215 s). ``before``: the peer's (local epoch, local samples) before the step; ``last``: the
    epoch's last batch, whose counted step ends the epoch."""
    epoch, accumulated = before
    if opt.local_epoch != epoch:
        return last and opt.local_epoch == epoch + 1
    return opt.tracker.local_progress.samples_accumulated >= accumulated + batch


def counted_rounds(opt: Any, outcomes: collections.Counter[str]) -> Any:
    """``apply_round`` of a peer's state averager, counting the parameter rounds it applied and the ones
    that failed or were discarded (mixed epochs): what keeps groups' parameters together; and the
    applied ones whose members were exactly those of the peer's last gradient round ("repeated":
    they mix nothing across groups)."""
    apply_round = opt.state_averager.apply_round

    def counting(*args: Any, **kwargs: Any) -> Any:
        applied = apply_round(*args, **kwargs)
        if applied is not None:
            outcomes["applied" if applied else "not applied"] += 1
            report = opt.state_averager.last_round
            if applied and report is not None and set(report.part_sizes) == set(opt.last_round_samples):
                outcomes["repeated"] += 1
        return applied

    return counting


def process_tree_cpu() -> dict[str, float]:
    """CPU seconds (user + system) used so far by this process and by its descendants, by kind:
    "trainer" (this process), "dht" (hivemind.DHT processes), "p2pd" (libp2p daemons), "other"."""
    used: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, tuple[str, float]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:
            continue  # exited meanwhile
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        parent, user, system = int(rest[1]), int(rest[11]), int(rest[12])
        children.setdefault(parent, []).append(int(entry))
        stats[int(entry)] = (name, (user + system) / tick)
    me = os.getpid()
    todo = [me]
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        if pid not in stats:
            continue
        name, seconds = stats[pid]
        kind = "trainer" if pid == me else "p2pd" if name == "p2pd" else "dht" if name.startswith("python") else "other"
        used[kind] = used.get(kind, 0.0) + seconds
    return used


def compare_groups(
    peers: int = 16,
    group: int = 4,
    epochs: int = 12,
    batch: int = 8,
    steps_per_epoch: int = 2,
    timeout: float = 200.0,
    hops: int | str = 1,
) -> dict[str, dict[str, Any]]:
    """Both cases on one swarm of ``peers`` DHTs: ``{"groups": ..., "one group": ...}``; ``hops``: the
    groups' ``grad_averaging_hops`` (one group of the whole swarm averages in one round)."""
    data = load_digits()
    keys = [RSAPrivateKey() for _ in range(peers)]
    outcomes = {}
    # 16 daemons start at once and ping each other on a small machine: longer start-up and RPC timeouts
    with local_swarm(peers, startup_timeout=120, wait_timeout=10) as dhts:
        for name, size in ((f"groups of {group}", group), ("one group", None)):
            outcome = train_case(
                dhts,
                keys,
                data,
                group=size,
                epochs=epochs,
                batch=batch,
                steps_per_epoch=steps_per_epoch,
                lr=0.01,
                timeout=timeout,
                hops=hops if size is not None else 1,
            )
            outcomes[name] = outcome
            error = f", ERROR {outcome['error']}" if outcome["error"] else ""
            cpu = ", ".join(f"{kind} {seconds:.0f}" for kind, seconds in sorted(outcome["cpu"].items()))
            print(
                f"digits, {peers} peers, {name}: held-out loss {outcome['loss']:.4f}, "
                f"accuracy {outcome['accuracy']:.3f}, spread {outcome['spread']:.4f} (moved {outcome['moved']:.3f}), "
                f"{outcome['samples']} of {outcome['target_samples']} samples ({outcome['discarded']} batches "
                f"discarded by resyncs), epochs {outcome['epochs']}, "
                f"gradient rounds of {outcome['group_size']:.1f} peers on average, further hops' groups "
                f"{dict(sorted(outcome['hop_sizes'].items()))} (size: count; 0: skipped), parameter rounds applied "
                f"{outcome['state_rounds'][0]} of {outcome['state_rounds'][1]} ({outcome['repeated_rounds']} with the "
                f"members of the gradient round), {outcome['seconds']:.0f} s "
                f"(CPU s: {cpu}), load {os.getloadavg()[0]:.1f}{error}",
                flush=True,
            )
    return outcomes
