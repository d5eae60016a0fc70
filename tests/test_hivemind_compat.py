"""Drop-in means drop-in (issue 10): every scenario here drives hivemind's public API the way hivemind's
documentation, tests and examples do, and runs twice from one parametrized test: once with the classes
imported from ``hivemind`` and once with those from ``hivemind_ext``. A case that passes for one library
and fails for the other is a difference a user would hit by changing one import.

What a user swaps is in :class:`Library` (the Optimizer, GradScaler, DecentralizedAverager, codec
classes, the averager's AveragingMode); everything else is shared: hivemind's DHT, torch, and the
``AllreduceException`` that scripts catch (hivemind's class: a script keeps ``from
hivemind.averaging.partition import AllreduceException`` when it swaps the rest).

Peers are real DHTs with libp2p daemons on 127.0.0.1 (one module-wide swarm, a fresh prefix per test);
hivemind's averagers run in forked processes as they always do, ours in this one. The settings are
hivemind's own test settings (matchmaking_time=1.0, request_timeout=0.5, ...), with short timeouts.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import hivemind
import hivemind.compression
import pytest
import torch
import torch.nn.functional as F
from hivemind.averaging.allreduce import AveragingMode as HivemindAveragingMode
from hivemind.averaging.partition import AllreduceException
from hivemind.utils.crypto import RSAPrivateKey
from swarm import local_swarm, wait_for

import hivemind_ext
import hivemind_ext.averaging
import hivemind_ext.compression

pytestmark = pytest.mark.slow

CLIENT_DHT = 4  # the swarm's one client-mode DHT (hivemind.DHT(client_mode=True), as behind a firewall)
LIBRARIES = ("hivemind", "hivemind_ext")
_prefixes = itertools.count()


@dataclasses.dataclass(frozen=True)
class Library:
    """The public classes a user swaps when moving a script from hivemind to hivemind_ext."""

    name: str
    Optimizer: Any
    GradScaler: Any
    DecentralizedAverager: Any
    NoCompression: Any
    Float16Compression: Any
    Uniform8BitQuantization: Any
    AveragingMode: Any
    # what scripts catch; hivemind's class for both (ours are subclasses of it)
    AllreduceException: type[Exception] = AllreduceException


def load_library(name: str) -> Library:
    if name == "hivemind":
        return Library(
            name=name,
            Optimizer=hivemind.Optimizer,
            GradScaler=hivemind.GradScaler,
            DecentralizedAverager=hivemind.DecentralizedAverager,
            NoCompression=hivemind.compression.NoCompression,
            Float16Compression=hivemind.compression.Float16Compression,
            Uniform8BitQuantization=hivemind.compression.Uniform8BitQuantization,
            AveragingMode=HivemindAveragingMode,
        )
    return Library(
        name=name,
        Optimizer=hivemind_ext.Optimizer,
        GradScaler=hivemind_ext.GradScaler,
        DecentralizedAverager=hivemind_ext.averaging.DecentralizedAverager,
        NoCompression=hivemind_ext.compression.NoCompression,
        Float16Compression=hivemind_ext.compression.Float16Compression,
        Uniform8BitQuantization=hivemind_ext.compression.Uniform8BitQuantization,
        AveragingMode=hivemind_ext.averaging.AveragingMode,
    )


# hivemind's library first: its averagers fork, best before this process runs our runtimes' threads
@pytest.fixture(scope="module", params=LIBRARIES)
def lib(request: pytest.FixtureRequest) -> Library:
    return load_library(request.param)


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(5, client_indices=[CLIENT_DHT]) as dhts:
        yield dhts


_SIGNING_KEYS: dict[hivemind.DHT, RSAPrivateKey] = {}


def signing_key(dht: hivemind.DHT) -> RSAPrivateKey:
    """hivemind's tests pass ``tracker_opts=dict(private_key=RSAPrivateKey())`` because its default key is
    per process; peers in one process need one key per DHT, and a DHT keeps the first key it is given."""
    return _SIGNING_KEYS.setdefault(dht, RSAPrivateKey())


def fresh_prefix(lib: Library) -> str:
    return f"compat_{lib.name}_{next(_prefixes)}"


def shutdown_all(things: Sequence[Any]) -> None:
    for thing in things:
        thing.shutdown()


def run_threads(targets: Sequence[Callable[[], None]], timeout: float) -> None:
    """Runs each target in a thread; re-raises the first error a thread hit."""
    errors: list[BaseException] = []

    def guarded(target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as e:  # reported by the test thread below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(target,), daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    give_up = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(give_up - time.monotonic(), 0.0))
    assert not any(thread.is_alive() for thread in threads), f"a thread still runs after {timeout} s"
    if errors:
        raise errors[0]


# ---------------------------------------------------------------- the Optimizer, in each mode

# hivemind's test_optimizer.py parametrizes these; "client" is its _test_optimizer(num_clients=1)
OPTIMIZER_MODES: dict[str, dict[str, Any]] = {
    "synchronous": dict(),
    "synchronous_with_client": dict(),
    "local_updates": dict(use_local_updates=True),
    "delayed": dict(offload_optimizer=True, delay_optimizer_step=True, delay_grad_averaging=True),
}
TOTAL_EPOCHS = 2
TARGET_BATCH_SIZE = 32


def make_optimizer(lib: Library, dht: hivemind.DHT, run_id: str, model: torch.nn.Module, **kwargs: Any) -> Any:
    """hivemind's _test_optimizer settings (tests/test_optimizer.py), with Float16 gradients as its guide shows."""
    options: dict[str, Any] = dict(
        run_id=run_id,
        target_batch_size=TARGET_BATCH_SIZE,
        batch_size_per_step=4,
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        scheduler=partial(torch.optim.lr_scheduler.StepLR, gamma=0.5, step_size=1),
        dht=dht,
        tracker_opts=dict(private_key=signing_key(dht), max_refresh_period=1.0),
        averager_opts=dict(request_timeout=0.5),
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        grad_compression=lib.Float16Compression(),
        verbose=False,
    )
    options.update(kwargs)
    return lib.Optimizer(**options)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", list(OPTIMIZER_MODES))
def test_optimizer_reaches_its_epochs(lib: Library, swarm: list[hivemind.DHT], mode: str) -> None:
    """Two peers train a linear regression until the swarm's epoch is 2, as hivemind's _test_optimizer
    does; params stay finite, and in synchronous mode (every peer applies the same averaged gradient)
    both peers end with the same parameters."""
    run_id = fresh_prefix(lib)
    torch.manual_seed(0)
    features = torch.randn(100, 5)
    targets = features @ torch.randn(5, 1)
    dhts = [swarm[0], swarm[CLIENT_DHT] if mode == "synchronous_with_client" else swarm[1]]
    models = [torch.nn.Linear(5, 1) for _ in dhts]
    for model in models[1:]:
        model.load_state_dict(models[0].state_dict())
    opts: list[Any] = []
    samples = [0, 0]
    try:
        for dht, model in zip(dhts, models, strict=True):
            # as hivemind's _test_optimizer: a client-mode DHT, and client_mode=True said explicitly (hivemind's
            # Optimizer on a client-mode DHT with client_mode left at None fails in its first epoch)
            client = dict(client_mode=True) if dht.client_mode else {}
            opts.append(make_optimizer(lib, dht, run_id, model, **OPTIMIZER_MODES[mode], **client))

        def trainer(index: int, batch_time: float) -> Callable[[], None]:
            def train() -> None:
                opt, model = opts[index], models[index]
                opt.load_state_from_peers()
                generator = torch.Generator().manual_seed(index)
                give_up = time.monotonic() + 90
                while opt.local_epoch < TOTAL_EPOCHS and time.monotonic() < give_up:
                    batch = torch.randint(0, len(features), (4,), generator=generator)
                    F.mse_loss(model(features[batch]), targets[batch]).backward()
                    opt.step()
                    opt.zero_grad()
                    samples[index] += 4
                    if samples[index] == 4:  # a peer publishes its progress at its first step; until the
                        # peers see each other, each trains alone (in both libraries) and they diverge
                        wait_for(lambda: opt.tracker.global_progress.num_peers == 2, 20, message="the other peer")
                    time.sleep(batch_time)

            return train

        run_threads([trainer(0, 0.2), trainer(1, 0.25)], timeout=110)
        for opt in opts:
            assert opt.local_epoch == TOTAL_EPOCHS
            wait_for(lambda opt=opt: opt.tracker.global_epoch == TOTAL_EPOCHS, 10, message="the global epoch")
        for model in models:
            assert all(torch.isfinite(p).all() for p in model.parameters())
        if mode.startswith("synchronous"):
            for ours, theirs in zip(models[0].parameters(), models[1].parameters(), strict=True):
                # hivemind: a part's owner keeps its exact average, the others get it through float16
                torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-3)
    finally:
        shutdown_all(opts)
    for opt in opts:  # hivemind's test_optimizer: after shutdown, no round is left running
        assert opt.scheduled_grads is None or opt.scheduled_grads.done()


# hivemind's own tests pass these (test_optimizer.py and test_progress_tracker.py)
TRACKER_OPTS = {
    "max_refresh_period=1.0": dict(max_refresh_period=1.0),
    "min0.1-default0.2-max0.5": dict(min_refresh_period=0.1, default_refresh_period=0.2, max_refresh_period=0.5),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tracker_opts", list(TRACKER_OPTS))
def test_optimizer_accepts_hiveminds_tracker_opts(lib: Library, swarm: list[hivemind.DHT], tracker_opts: str) -> None:
    """A peer alone reaches its epoch from its own samples; the tracker reports its throughput."""
    model = torch.nn.Linear(5, 1)
    opt = lib.Optimizer(
        dht=swarm[2],
        run_id=fresh_prefix(lib),
        target_batch_size=8,
        batch_size_per_step=4,
        params=model.parameters(),
        optimizer=partial(torch.optim.SGD, lr=0.1),
        tracker_opts=dict(private_key=signing_key(swarm[2]), **TRACKER_OPTS[tracker_opts]),
        matchmaking_time=1.0,
        averaging_timeout=5.0,
    )
    try:
        for _ in range(20):
            model(torch.randn(4, 5)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.05)
            if opt.local_epoch >= 1:
                break
        assert opt.local_epoch >= 1
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert opt.tracker.performance_ema.samples_per_second > 0
    finally:
        opt.shutdown()


@pytest.mark.timeout(60)
def test_attributes_that_scripts_read(lib: Library, swarm: list[hivemind.DHT]) -> None:
    """DecentralizedAverager.mode, Optimizer.scheduled_grads, ProgressTracker.performance_ema."""
    prefix = fresh_prefix(lib)
    averagers = [
        lib.DecentralizedAverager([torch.zeros(3)], swarm[0], prefix=prefix, start=False),
        lib.DecentralizedAverager([torch.zeros(3)], swarm[1], prefix=prefix, auxiliary=True, start=False),
        lib.DecentralizedAverager([torch.zeros(3)], swarm[2], prefix=prefix, client_mode=True, start=False),
        lib.DecentralizedAverager([torch.zeros(3)], swarm[CLIENT_DHT], prefix=prefix, start=False),
    ]
    modes = [averager.mode for averager in averagers]
    assert modes == [lib.AveragingMode.NODE, lib.AveragingMode.AUX, lib.AveragingMode.CLIENT, lib.AveragingMode.CLIENT]
    # hivemind's test_allreduce_once compares with hivemind's enum; scripts keep that import
    assert modes == [HivemindAveragingMode.NODE, HivemindAveragingMode.AUX] + [HivemindAveragingMode.CLIENT] * 2
    assert modes[0] != HivemindAveragingMode.AUX

    model = torch.nn.Linear(5, 1)
    opt = make_optimizer(lib, swarm[2], fresh_prefix(lib), model)
    try:
        assert opt.scheduled_grads is None  # no round scheduled before the first step
        ema = opt.tracker.performance_ema
        assert isinstance(ema.samples_per_second, float) and ema.samples_per_second >= 0
        model(torch.randn(4, 5)).pow(2).mean().backward()
        opt.step()
        assert opt.scheduled_grads is None or hasattr(opt.scheduled_grads, "done")
    finally:
        opt.shutdown()


# ---------------------------------------------------------------- DecentralizedAverager

REFERENCE_TENSORS = [
    [torch.randn(123), torch.zeros(3)],
    [torch.rand(123), torch.ones(3)],
    [-torch.rand(123), torch.arange(3).to(torch.float32)],
    [torch.randn(123) ** 3, torch.arange(3).to(torch.float32) / 2],
]


def copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [tensor.clone() for tensor in tensors]


@pytest.mark.timeout(90)
def test_weighted_average_is_the_exact_weighted_mean(lib: Library, swarm: list[hivemind.DHT]) -> None:
    """hivemind's test_allreduce_weighted: 4 peers, 2 of them client_mode=True on ordinary DHTs."""
    prefix = fresh_prefix(lib)
    peer_tensors = [copies(tensors) for tensors in REFERENCE_TENSORS]
    client_modes = [True, False, True, False]
    weights = [float(w) for w in torch.rand(4) * 10 + 0.01]
    reference = [
        sum(tensors[i] * weight for tensors, weight in zip(REFERENCE_TENSORS, weights, strict=True)) / sum(weights)
        for i in range(2)
    ]
    averagers = []
    try:
        for tensors, dht, client_mode in zip(peer_tensors, swarm[:4], client_modes, strict=True):
            averagers.append(
                lib.DecentralizedAverager(
                    tensors,
                    dht=dht,
                    target_group_size=4,
                    min_matchmaking_time=15,
                    prefix=prefix,
                    client_mode=client_mode,
                    start=True,
                )
            )
        futures = [
            averager.step(weight=weight, wait=False) for averager, weight in zip(averagers, weights, strict=True)
        ]
        for future in futures:
            assert len(future.result(timeout=60)) == 4
        for averager in averagers:
            with averager.get_tensors() as averaged:
                for ref, ours in zip(reference, averaged, strict=True):
                    assert torch.allclose(ref, ours, atol=1e-6)
    finally:
        shutdown_all(averagers)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n_clients, n_aux", [(1, 1), (1, 3), (0, 4)])
def test_auxiliary_and_client_peers(lib: Library, swarm: list[hivemind.DHT], n_clients: int, n_aux: int) -> None:
    """hivemind's test_allreduce_once (and _edge_cases): every peer's result names every member, and
    non-auxiliary peers hold the mean of the non-auxiliary peers' tensors."""
    prefix = fresh_prefix(lib)
    modes = [lib.AveragingMode.CLIENT] * n_clients + [lib.AveragingMode.AUX] * n_aux
    modes += [lib.AveragingMode.NODE] * (4 - len(modes))
    random.Random(n_clients * 10 + n_aux).shuffle(modes)
    contributors = [t for t, m in zip(REFERENCE_TENSORS, modes, strict=True) if m != lib.AveragingMode.AUX]
    reference = [sum(tensors[i] for tensors in contributors) / max(1, len(contributors)) for i in range(2)]
    averagers = []
    try:
        for tensors, dht, mode in zip(REFERENCE_TENSORS, swarm[:4], modes, strict=True):
            averagers.append(
                lib.DecentralizedAverager(
                    copies(tensors),
                    dht=dht,
                    target_group_size=4,
                    min_matchmaking_time=6,  # hivemind: 15; only auxiliary peers wait all of it
                    prefix=prefix,
                    client_mode=mode == lib.AveragingMode.CLIENT,
                    auxiliary=mode == lib.AveragingMode.AUX,
                    start=True,
                )
            )
        futures = [averager.step(wait=False) for averager in averagers]
        for future in futures:
            result = future.result(timeout=30)  # hivemind: 2-10 s for its edge cases
            for averager in averagers:
                assert averager.peer_id in result
        for averager in averagers:
            if averager.mode != HivemindAveragingMode.AUX:
                with averager.get_tensors() as averaged:
                    for ref, ours in zip(reference, averaged, strict=True):
                        assert torch.allclose(ref, ours, atol=1e-6)
    finally:
        shutdown_all(averagers)


@pytest.mark.timeout(90)
def test_group_bits(lib: Library, swarm: list[hivemind.DHT]) -> None:
    """hivemind's test_getset_bits and test_allreduce_grid on a 2x2 grid: peers with different group bits
    never pair; rows then columns give every peer the exact mean."""
    prefix = fresh_prefix(lib)
    rows, columns = [0, 0, 1, 1], [0, 1, 0, 1]
    tensors = [torch.tensor([float(i**2), -3.0 * i]) for i in range(4)]
    expected = torch.stack(tensors).mean(dim=0)
    averagers = []
    try:
        for i, dht in enumerate(swarm[:4]):
            averagers.append(
                lib.DecentralizedAverager(
                    [tensors[i].clone()],
                    dht=dht,
                    target_group_size=2,
                    request_timeout=0.5,
                    prefix=prefix,
                    initial_group_bits=str(rows[i]),
                    start=True,
                )
            )
        assert [averager.get_group_bits() for averager in averagers] == ["0", "0", "1", "1"]
        ids = [averager.peer_id for averager in averagers]
        for layout in (rows, columns):
            for averager, line in zip(averagers, layout, strict=True):
                averager.set_group_bits(str(line))
                assert averager.get_group_bits() == str(line)
            futures = [averager.step(wait=False, timeout=30) for averager in averagers]
            for i, future in enumerate(futures):
                assert set(future.result(timeout=60)) == {ids[j] for j in range(4) if layout[j] == layout[i]}
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, expected, atol=1e-6, rtol=0)
        averagers[0].set_group_bits("00101011101010")
        assert averagers[0].get_group_bits() == "00101011101010"
    finally:
        shutdown_all(averagers)


@pytest.mark.timeout(60)
def test_failed_step_is_caught_as_allreduce_exception(lib: Library, swarm: list[hivemind.DHT]) -> None:
    """hivemind's test_too_few_peers: peers whose group bits differ find no group; the step fails with
    AllreduceException, which a script catches as hivemind documents."""
    prefix = fresh_prefix(lib)
    averagers = []
    try:
        for i, dht in enumerate(swarm[:2]):
            averagers.append(
                lib.DecentralizedAverager(
                    [torch.randn(3)],
                    dht=dht,
                    target_group_size=2,
                    min_matchmaking_time=1,
                    request_timeout=0.5,
                    prefix=prefix,
                    initial_group_bits=bin(i)[2:].rjust(3, "0"),
                    start=True,
                )
            )
        futures = [averager.step(wait=False, timeout=2) for averager in averagers]
        for future in futures:
            caught = None
            try:
                future.result(timeout=30)
            except AllreduceException as e:
                caught = e
            assert isinstance(caught, lib.AllreduceException)
        caught = None
        try:
            averagers[0].step(timeout=1)
        except AllreduceException as e:
            caught = e
        assert caught is not None
    finally:
        shutdown_all(averagers)


def live_state_averager(lib: Library) -> type:
    """hivemind's documented pattern: a subclass whose get_current_state returns the live tensors (those
    training changes in place), counting its calls as hivemind's test_load_state_from_peers does."""

    class LiveStateAverager(lib.DecentralizedAverager):  # type: ignore[name-defined,misc]
        calls = 0
        metadata: dict[str, Any] = {"x": 123}

        def get_current_state(self) -> tuple[Any, Any]:
            type(self).calls += 1
            with self.get_tensors() as tensors:
                return dict(type(self).metadata), tensors

    return LiveStateAverager


@pytest.mark.timeout(120)
def test_state_download_from_a_subclass_with_live_tensors(lib: Library, swarm: list[hivemind.DHT]) -> None:
    """hivemind's test_load_state_from_peers with live tensors: each download calls get_current_state once
    and returns the state as it is then; allow_state_sharing=False hides the donor; downloads keep
    working while training writes the tensors in place."""
    prefix = fresh_prefix(lib)
    donor_class = live_state_averager(lib)
    live = [torch.zeros(100_000), torch.zeros(3)]
    donor = donor_class(live, dht=swarm[0], start=True, prefix=prefix, target_group_size=2)
    # the same class on both sides, as in hivemind's test: hivemind names its RPC protocols by class
    joiner = donor_class(
        [torch.zeros(100_000), torch.zeros(3)], dht=swarm[1], start=True, prefix=prefix, target_group_size=2
    )
    stop = threading.Event()
    try:
        first = wait_for(lambda: joiner.load_state_from_peers(timeout=5), 30, interval=0.2, message="a donor")
        metadata, tensors = first
        assert metadata == {"x": 123} and all(torch.equal(t, torch.zeros_like(t)) for t in tensors)

        with donor.get_tensors() as tensors:
            tensors[1][2] = 9
        donor_class.metadata = {"x": 123, "y": 123}
        calls = donor_class.calls
        metadata, tensors = joiner.load_state_from_peers(timeout=30)
        assert donor_class.calls == calls + 1
        assert metadata == {"x": 123, "y": 123} and tensors[1].tolist() == [0.0, 0.0, 9.0]

        donor.allow_state_sharing = False
        time.sleep(0.5)
        assert joiner.load_state_from_peers(timeout=5) is None
        donor.allow_state_sharing = True
        wait_for(lambda: joiner.load_state_from_peers(timeout=5), 30, interval=0.2, message="the donor back")

        def train() -> None:  # writes every value of the big tensor at once, under the averager's lock
            for value in itertools.count(1):
                if stop.is_set():
                    return
                with donor.get_tensors() as tensors:
                    tensors[0].fill_(float(value))
                time.sleep(0.002)

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        for attempt in range(3):
            calls = donor_class.calls
            loaded = joiner.load_state_from_peers(timeout=30)
            if loaded is None and lib.name == "hivemind":
                # hivemind's own download of changing tensors failed here once in a CI run (it returned
                # None): hivemind gets one more try, so that its flake does not fail our suite; ours gets none
                calls = donor_class.calls
                loaded = joiner.load_state_from_peers(timeout=30)
            assert loaded is not None, f"download {attempt} of changing live tensors failed"
            assert donor_class.calls == calls + 1
            big = loaded[1][0]
            assert big.shape == (100_000,) and torch.equal(big, big.round()) and big.min() >= 1
    finally:
        stop.set()
        shutdown_all([joiner, donor])


# ---------------------------------------------------------------- codecs in a round


@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec, atol", [("Float16Compression", 1e-2), ("Uniform8BitQuantization", 0.1)])
def test_compressed_average_of_a_pair(lib: Library, swarm: list[hivemind.DHT], codec: str, atol: float) -> None:
    if lib.name == "hivemind" and codec == "Uniform8BitQuantization":
        from hivemind.compression import CompressionInfo

        probe, codec = torch.randn(100), lib.Uniform8BitQuantization()
        try:
            codec.extract(codec.compress(probe, CompressionInfo.from_tensor(probe)))
        except TypeError as e:  # numpy 2: float() of a 1-element array inside hivemind's codec
            pytest.skip(f"hivemind 1.1.12's Uniform8BitQuantization fails under numpy 2 (hivemind's bug): {e}")
    prefix = fresh_prefix(lib)
    generator = torch.Generator().manual_seed(7)
    tensors = [torch.randn(10_000, generator=generator) for _ in range(2)]
    expected = (tensors[0] + tensors[1]) / 2
    averagers = []
    try:
        for tensor, dht in zip(tensors, swarm[:2], strict=True):
            averagers.append(
                lib.DecentralizedAverager(
                    [tensor.clone()],
                    dht=dht,
                    prefix=prefix,
                    target_group_size=2,
                    request_timeout=0.5,
                    compression=getattr(lib, codec)(),
                    start=True,
                )
            )
        futures = [averager.step(wait=False, timeout=30) for averager in averagers]
        for future in futures:
            assert len(future.result(timeout=45)) == 2
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, expected, atol=atol, rtol=0)
    finally:
        shutdown_all(averagers)
