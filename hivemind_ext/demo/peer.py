"""One peer of the digits demo: a hivemind DHT, an ``Optimizer`` (``hivemind_ext.Optimizer`` or
``hivemind.Optimizer``, same keywords) and the usual loop ``loss.backward(); opt.step(); opt.zero_grad()``
until the swarm's global epoch (``opt.local_epoch``) reaches the goal, then the held-out accuracy."""

from __future__ import annotations

import logging
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from hivemind_ext.demo.data import DigitsData, accuracy, make_model

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)
OPTIMIZERS = ("hivemind_ext", "hivemind")
PROGRESS_PERIOD = 0.5  # seconds between a peer's progress reports
ALONE_TIMEOUT = 60.0  # seconds a joining peer trains without seeing another peer of its run before it gives up
DHT_START_TIMEOUT = 60.0  # seconds for the DHT to start (its daemon, then the bootstrap through the initial peers)


class PeerStartError(RuntimeError):
    """The peer could not join the network (a bad or unusable address, unreachable initial peers):
    a setup problem that one line explains, not a bug that needs a traceback."""


class SwarmGoneError(PeerStartError):
    """A joining peer saw no other peer of its run for ``alone_timeout`` seconds: the swarm it meant to join
    has ended, or its initial peers are gone. Training on alone would only look like joining."""


def peak_rss_mib() -> float | None:
    """This process's peak resident memory in MiB (the libp2p daemon, a child process, is not included);
    None where the platform has no ``resource`` module (Windows)."""
    try:
        import resource
    except ImportError:
        return None
    scale = 1 / 1024 if sys.platform != "darwin" else 1 / 2**20  # Linux reports KiB, macOS bytes
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def optimizer_class(name: str) -> type:
    """``hivemind_ext.Optimizer`` or ``hivemind.Optimizer``; both take the same keywords (ours is a drop-in)."""
    if name == "hivemind":
        import hivemind

        return hivemind.Optimizer
    if name == "hivemind_ext":
        from hivemind_ext.optim import Optimizer

        return Optimizer
    raise ValueError(f"unknown optimizer {name!r}: expected one of {OPTIMIZERS}")


# ----------------------------------------------------------------------------------------------- peer


@dataclass(frozen=True)
class PeerConfig:
    """What one peer does. Every field but ``index``, ``client_mode``, ``batch_size``, ``compute_time`` and
    ``seed`` must be the same on all peers of a run (``run_id``, the model, the optimizer settings)."""

    index: int
    data: DigitsData
    optimizer: str = "hivemind_ext"
    run_id: str = "digits"
    epochs: int = 20
    target_batch_size: int = 256
    batch_size: tuple[int, int] = (16, 16)  # each step draws its batch size uniformly from [low, high]
    compute_time: tuple[float, float] = (0.0, 0.0)  # seconds slept per step on top of the real work
    lr: float = 0.01
    matchmaking_time: float = 1.5
    averaging_timeout: float = 10.0
    client_mode: bool = False
    host_maddrs: tuple[str, ...] = LOOPBACK
    announce_maddrs: tuple[str, ...] = ()  # the addresses other peers should dial (a public IP, a forwarded port)
    model_seed: int = 0
    seed: int = 0  # this peer's batch order, batch sizes and compute times
    verbose: bool = False
    log_level: str = "ERROR"  # of the hivemind and hivemind_ext loggers in this peer
    # a joining peer gives up (SwarmGoneError) after this many seconds without another peer of the run online;
    # None: train on alone (the peers of a local swarm, where a lone first peer is a swarm of one)
    alone_timeout: float | None = None


@dataclass
class PeerStats:
    """Measured by one peer from its first step until the swarm reached the goal epoch."""

    steps: int = 0
    samples: int = 0
    train_seconds: float = 0.0
    step_seconds: float = 0.0  # time spent inside opt.step(): waiting for peers, averaging, updating
    # per epoch this peer ended: the samples its group averaged (hivemind_ext's opt.last_epoch_samples)
    averaged_samples: list[int] = field(default_factory=list)
    loss: float = math.nan  # exponential moving average of the training loss

    @property
    def blocked_fraction(self) -> float:
        return self.step_seconds / self.train_seconds if self.train_seconds > 0 else math.nan


Report = Callable[[str, dict[str, Any]], None]


def global_progress(opt: Any) -> dict[str, Any]:
    """The swarm-wide progress that the optimizer's tracker last saw, as plain values."""
    progress = getattr(getattr(opt, "tracker", None), "global_progress", None)
    names = ("epoch", "samples_accumulated", "target_batch_size", "num_peers", "num_clients", "eta_next_epoch")
    names += ("samples_per_second",)  # the swarm's (hivemind_ext only: None with hivemind.Optimizer)
    return {name: getattr(progress, name, None) for name in names}


class Company:
    """Whether a joining peer still has a swarm: when it last saw another peer of its run online. Alone for
    ``alone_timeout`` s (None: never give up), :meth:`check` raises :class:`SwarmGoneError`."""

    def __init__(self, run_id: str, alone_timeout: float | None) -> None:
        self.run_id, self.alone_timeout = run_id, alone_timeout
        self.last_seen = time.monotonic()

    def check(self, num_peers: int | None) -> None:
        """``num_peers``: the peers of the run online as the tracker last saw them, this one included."""
        now = time.monotonic()
        if num_peers is not None and num_peers > 1:
            self.last_seen = now
        elif self.alone_timeout is not None and now - self.last_seen > self.alone_timeout:
            raise SwarmGoneError(
                f"no other peer of run {self.run_id!r} was online for {self.alone_timeout:g} s: the swarm has ended "
                "or its initial peers are gone; join a running swarm with the command its first peer prints "
                "(the same --run-id), or start one with `hivemind-ext train`"
            )


def start_dht(config: PeerConfig, initial_peers: Sequence[str]) -> Any:
    """This peer's DHT; a failure to start it (the daemon cannot listen on ``host_maddrs``, no initial
    peer answers) is a :class:`PeerStartError` that says which addresses were used."""
    import hivemind

    from hivemind_ext.p2p import dht_calls

    options: dict[str, Any] = {"announce_maddrs": list(config.announce_maddrs)} if config.announce_maddrs else {}
    dht = None
    try:
        dht = hivemind.DHT(
            initial_peers=list(initial_peers),
            host_maddrs=list(config.host_maddrs),
            client_mode=config.client_mode,
            start=False,
            **options,
        )
        dht_calls.start_dht(dht, timeout=DHT_START_TIMEOUT)  # DHT(start=True) waited for ever on a hung bootstrap
        return dht
    except Exception as e:
        if dht is not None:
            dht.shutdown()
        where = f"listening on {' '.join(config.host_maddrs)}"
        if initial_peers:
            where += f", joining {' '.join(initial_peers)}"
        message = " ".join(str(e).split())  # the daemon's message spans lines
        raise PeerStartError(f"could not start the DHT ({where}): {type(e).__name__}: {message}") from e


def train_peer(
    config: PeerConfig,
    initial_peers: Sequence[str],
    report: Report,
    wait_for_start: Callable[[], bool] = lambda: True,
    keep_alive: Callable[[], bool] = lambda: False,
    stop_requested: Callable[[], bool] = lambda: False,
) -> PeerStats:
    """Runs one peer: joins the swarm, trains until ``opt.local_epoch`` reaches ``config.epochs``, evaluates.

    ``report(kind, payload)`` receives ``"dht_ready"`` (this peer's multiaddrs), ``"ready"`` (optimizer
    built), ``"progress"`` (every ``PROGRESS_PERIOD`` s) and ``"done"`` (accuracy and the measurements).
    ``wait_for_start()`` blocks until the swarm may start (False: give up). Once done, the peer stays
    online (serving its state to laggards) while ``keep_alive()`` is True, then shuts down. Training
    ends early, without "done", when ``stop_requested()`` (checked between steps) turns True.
    """
    import torch
    import torch.nn.functional as F

    from hivemind_ext.p2p import dht_calls

    torch.set_num_threads(1)
    for name in ("hivemind", "hivemind_ext"):
        logging.getLogger(name).setLevel(config.log_level.upper())
    rng = random.Random(config.seed)
    model = make_model(config.model_seed)
    data = config.data
    train_x, train_y = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    dht = opt = None
    try:
        dht = start_dht(config, initial_peers)
        report("dht_ready", {"maddrs": [str(addr) for addr in dht_calls.visible_maddrs(dht)]})
        low, high = config.batch_size
        opt = optimizer_class(config.optimizer)(
            dht=dht,
            run_id=config.run_id,
            target_batch_size=config.target_batch_size,
            batch_size_per_step=(low + high) // 2,
            optimizer=lambda params: torch.optim.Adam(params, lr=config.lr),
            params=model.parameters(),
            matchmaking_time=config.matchmaking_time,
            averaging_timeout=config.averaging_timeout,
            client_mode=config.client_mode,
            verbose=config.verbose,
        )
        report("ready", {})
        if not wait_for_start():
            return PeerStats()

        shuffle = torch.Generator().manual_seed(config.seed)
        stats, order, position = PeerStats(), torch.randperm(len(train_y), generator=shuffle), 0
        started = last_report = time.perf_counter()
        company = Company(config.run_id, config.alone_timeout)
        evaluated: tuple[int, float] | None = None  # (epoch, held-out accuracy) at the last progress report
        while opt.local_epoch < config.epochs:
            batch_size = rng.randint(low, high)
            if position + batch_size > len(order):  # next pass over this peer's shard
                order, position = torch.randperm(len(train_y), generator=shuffle), 0
            rows = order[position : position + batch_size]
            position += batch_size

            loss = F.cross_entropy(model(train_x[rows]), train_y[rows])
            loss.backward()
            if config.compute_time[1] > 0:  # stands in for a bigger model or a slower device
                time.sleep(rng.uniform(*config.compute_time))
            step_started, epoch_before = time.perf_counter(), opt.local_epoch
            opt.step(batch_size=batch_size)
            stats.step_seconds += time.perf_counter() - step_started
            averaged = getattr(opt, "last_epoch_samples", None)  # hivemind.Optimizer has no such figure
            if opt.local_epoch == epoch_before + 1 and averaged:
                stats.averaged_samples.append(int(averaged))
            opt.zero_grad()

            stats.steps += 1
            stats.samples += batch_size
            stats.loss = loss.item() if math.isnan(stats.loss) else 0.9 * stats.loss + 0.1 * loss.item()
            now = time.perf_counter()
            if now - last_report >= PROGRESS_PERIOD:
                last_report = now
                if evaluated is None or evaluated[0] != opt.local_epoch:  # once per epoch: a few ms
                    evaluated = (opt.local_epoch, accuracy(model, data.test_x, data.test_y))
                payload = {"epoch": opt.local_epoch, "loss": stats.loss, "swarm": global_progress(opt)}
                report("progress", {**payload, "accuracy": evaluated[1]})
                company.check(payload["swarm"]["num_peers"])
            if stop_requested():  # every step: Ctrl-C must not wait for the next report
                return stats
        stats.train_seconds = time.perf_counter() - started

        model.eval()
        report(
            "done",
            {
                "time": time.time(),
                "epoch": opt.local_epoch,
                "swarm": global_progress(opt),
                "accuracy": accuracy(model, data.test_x, data.test_y),
                "steps": stats.steps,
                "samples": stats.samples,
                "averaged_samples": stats.averaged_samples,
                "train_seconds": stats.train_seconds,
                "step_seconds": stats.step_seconds,
                "blocked_fraction": stats.blocked_fraction,
                "loss": stats.loss,
                "peak_rss_mib": peak_rss_mib(),
            },
        )
        while keep_alive():
            time.sleep(0.1)
        return stats
    finally:
        if opt is not None:
            opt.shutdown()
        if dht is not None:
            dht.shutdown()


def swarm_configs(base: PeerConfig, peers: int, clients: int) -> list[PeerConfig]:
    """One config per peer of a local swarm: its own train shard and seed; the last ``clients`` in client mode.

    The first peer listens on ``base.host_maddrs`` and announces ``base.announce_maddrs`` as given; the
    others listen on the same hosts with a port chosen by the system (one port serves one peer).
    """
    others = tuple(any_port(maddr) for maddr in base.host_maddrs)
    return [
        replace(
            base,
            index=i,
            data=base.data.shard(i, peers, base.seed),
            client_mode=i >= peers - clients,
            seed=base.seed * 1000 + i,
            host_maddrs=base.host_maddrs if i == 0 else others,
            announce_maddrs=base.announce_maddrs if i == 0 else (),
        )
        for i in range(peers)
    ]


def any_port(maddr: str) -> str:
    """``maddr`` with its tcp/udp port replaced by 0: /ip4/0.0.0.0/tcp/45555 -> /ip4/0.0.0.0/tcp/0."""
    parts = maddr.split("/")
    for i in range(len(parts) - 1):
        if parts[i] in ("tcp", "udp"):
            parts[i + 1] = "0"
    return "/".join(parts)
