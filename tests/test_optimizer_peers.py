"""hivemind_ext.Optimizer with real peers on 127.0.0.1: late joiners, busy donors, dead and stalled
peers, failed rounds, client-mode and auxiliary peers (and the ``hivemind-ext aux`` command).

Peers run in threads of this process (each with its own DHT and libp2p daemon), except in the
"killed peer" test, where they are separate processes so that one can be SIGKILLed.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch
from peer_trainers import (
    AVERAGING_TIMEOUT,
    BATCH_SIZE,
    MATCHMAKING_TIME,
    TARGET_BATCH_SIZE,
    Trainer,
    assert_same_params,
    make_model,
    make_optimizer,
    make_trainers,
    params_of,
    same_params,
    shutting_down,
    train_together,
)
from swarm import addresses, local_swarm, new_peer, wait_for

from hivemind_ext.averaging.control import AveragingStage
from hivemind_ext.averaging.state_sharing.config import StateSharingConfig
from hivemind_ext.errors import AllreduceError

# ---------------------------------------------------------------------------------------------
# 1. late joiner


@pytest.mark.timeout(120)
def test_late_joiner_downloads_the_state_spread_over_donors_and_trains_in_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # small chunks and little data in flight per donor, so that a 10 kB state is spread over both donors
    monkeypatch.setattr(
        "hivemind_ext.averaging.averager.StateSharingConfig",
        functools.partial(StateSharingConfig, chunk_bytes=512, inflight_bytes=1024),
    )
    caplog.set_level(logging.INFO, logger="hivemind_ext.averaging.state_sharing.download")
    with local_swarm(3) as dhts, shutting_down([]) as optimizers:
        trainers = make_trainers(dhts, optimizers, 2, "late")
        train_together(trainers, until_epoch=3)
        swarm_epoch = max(t.opt.local_epoch for t in trainers)
        assert_same_params(trainers[0].model, trainers[1].model)

        newcomer_model = make_model(seed=1)  # a different initialisation
        newcomer = make_optimizer(dhts[2], newcomer_model, "late")
        optimizers.append(newcomer)
        assert newcomer.local_epoch == 0
        wait_for(
            lambda: newcomer.tracker.global_progress.epoch == swarm_epoch, 10, message="the newcomer to see the swarm"
        )
        newcomer_trainer = Trainer(newcomer, newcomer_model, seed=2)
        newcomer_trainer.step_once(torch.Generator().manual_seed(2))
        # the first step() downloaded the state (and discarded its batch): the donors stood still meanwhile
        assert newcomer.local_epoch == swarm_epoch
        assert_same_params(newcomer_model, trainers[0].model)
        donor_state = trainers[0].opt.state_dict()
        for key, value in newcomer.state_dict()["state"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(value[name], donor_state["state"][key][name], rtol=0, atol=1e-6)

        donor_stats = [t.opt.state_averager.donor.stats for t in trainers]
        assert all(stats.chunks_served > 0 for stats in donor_stats), f"not spread over the donors: {donor_stats}"
        assert re.search(r"downloaded state version \d+ .* from 2 donors", caplog.text)

        everyone = [*trainers, newcomer_trainer]
        train_together(everyone, until_epoch=swarm_epoch + 4)
        # it then trains in line: identical parameters at an epoch after the join that all three reached
        # (a round that misses one peer is recovered by a download at its next step, so the very last
        # epoch may still be out of line)
        later = set.intersection(*(set(t.history) for t in everyone)) - set(range(swarm_epoch + 1))
        in_line = [e for e in later if all(same_params(t.history[e], everyone[0].history[e]) for t in everyone)]
        assert in_line, f"the newcomer never trained in line with the swarm (epochs {sorted(later)})"


@pytest.mark.timeout(60)
def test_a_peer_ahead_of_every_donor_keeps_its_state(caplog: pytest.LogCaptureFixture) -> None:
    """A resync (after a failed round) may find only donors that lag behind: going back would lose progress."""
    caplog.set_level(logging.DEBUG, logger="hivemind_ext.optim.optimizer")
    with local_swarm(2) as dhts, shutting_down([]) as optimizers:
        ahead_model, behind_model = make_model(seed=1), make_model(seed=2)
        ahead = make_optimizer(dhts[0], ahead_model, "ahead", load_state_timeout=5.0)
        behind = make_optimizer(dhts[1], behind_model, "ahead", load_state_timeout=5.0)
        optimizers += [ahead, behind]
        ahead.load_state_dict({**ahead.state_dict(), "local_epoch": 3})
        params = params_of(ahead_model)
        wait_for(
            lambda: ahead.load_state_from_peers() is None and "behind this peer's 3" in caplog.text,
            15,
            message="the lagging donor's state to be offered and refused",
        )
        assert ahead.local_epoch == 3 and same_params(params_of(ahead_model), params, atol=0)
        behind.load_state_from_peers()  # the other way round, the newer state is taken
        assert behind.local_epoch == 3
        assert_same_params(behind_model, ahead_model)


# ---------------------------------------------------------------------------------------------
# 2. busy donors


@contextlib.contextmanager
def held(lock: threading.RLock, seconds: float) -> Iterator[None]:
    """Holds ``lock`` in another thread for ``seconds`` (or until the block ends), as a long optimizer
    step or averaging round would."""
    taken, release = threading.Event(), threading.Event()

    def run() -> None:
        with lock:
            taken.set()
            release.wait(seconds)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    taken.wait(5)
    try:
        yield
    finally:
        release.set()
        thread.join(5)


@pytest.mark.timeout(120)
def test_busy_donors_never_make_a_newcomer_time_out() -> None:
    """hivemind issues 169 and 445: a donor busy averaging made newcomers wait until they timed out."""
    with local_swarm(4) as dhts, shutting_down([]) as optimizers:
        trainers = make_trainers(dhts, optimizers, 2, "busy")
        train_together(trainers, until_epoch=2)
        epoch = trainers[0].opt.local_epoch
        busy, free = trainers
        # the busy donor is in the middle of a state averaging round (that nobody else joins) and holds
        # its state lock for much longer than the newcomer is willing to wait
        wait_for(
            lambda: not any(t.opt.state_averager.round_in_progress for t in trainers),
            15,
            message="the last state round",
        )
        busy.opt.state_averager.begin_round(timeout=60.0)
        with held(busy.opt.state_lock, 60.0):
            newcomer_model = make_model(seed=7)
            newcomer = make_optimizer(dhts[2], newcomer_model, "busy", load_state_timeout=60.0)
            optimizers.append(newcomer)
            wait_for(
                lambda: newcomer.tracker.global_progress.epoch == epoch, 10, message="the newcomer to see the swarm"
            )
            started = time.monotonic()
            newcomer.load_state_from_peers()
            elapsed = time.monotonic() - started
            assert newcomer.local_epoch == epoch and elapsed < 10.0, (
                f"loaded epoch {newcomer.local_epoch} in {elapsed:.1f} s"
            )
            assert_same_params(newcomer_model, free.model)
            assert busy.opt.state_averager.round_in_progress

            # now every donor is busy for a while: the newcomer retries (or is served a snapshot taken
            # before) and loads soon after, long before its own load_state_timeout
            with held(free.opt.state_lock, 3.0):
                late_model = make_model(seed=8)
                late = make_optimizer(dhts[3], late_model, "busy", load_state_timeout=60.0)
                optimizers.append(late)
                wait_for(
                    lambda: late.tracker.global_progress.epoch == epoch,
                    10,
                    message="the second newcomer to see the swarm",
                )
                started = time.monotonic()
                late.load_state_from_peers()
                elapsed = time.monotonic() - started
            assert late.local_epoch == epoch and elapsed < 15.0, f"loaded epoch {late.local_epoch} in {elapsed:.1f} s"
            assert_same_params(late_model, free.model)
        busy.opt.state_averager.cancel_round()


# ---------------------------------------------------------------------------------------------
# 3. a peer killed mid-training (separate processes)


def process_peer(index: int, initial_peers: list[str], run_id: str, until_epoch: int, report: Any) -> None:
    """A training peer in its own process: reports ("epoch", index, epoch) as it goes, then
    ("done", index, epoch, max_step_seconds) or ("error", index, text), on ``report``: the write end of
    a pipe of its own (a process SIGKILLed while writing to a queue shared by several processes can
    leave its lock taken, and the others could never report again)."""
    try:
        os.setpgrp()  # a process group of its own: SIGKILLed with its DHT and libp2p daemon, as a dead machine
        faulthandler.register(signal.SIGUSR1, file=open(stack_file(run_id, index, os.getppid()), "w"), all_threads=True)
        log = logging.FileHandler(stack_file(run_id, index, os.getppid()) + ".log", mode="w")
        log.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
        logging.getLogger("hivemind_ext").addHandler(log)
        logging.getLogger("hivemind_ext").setLevel(logging.DEBUG)
        torch.set_num_threads(1)
        dht = new_peer(initial_peers)
        model = make_model(seed=0)
        opt = make_optimizer(dht, model, run_id, load_state_timeout=10.0)
        trainer = Trainer(opt, model, seed=index)
        deadline = time.monotonic() + 90
        while opt.local_epoch < until_epoch and time.monotonic() < deadline:
            trainer.train(opt.local_epoch + 1, deadline=deadline)
            report.send(("epoch", index, opt.local_epoch))
        report.send(("done", index, opt.local_epoch, max(trainer.step_seconds)))
        opt.shutdown()
        dht.shutdown()
    except BaseException as e:
        report.send(("error", index, repr(e)))
        raise


def stack_file(run_id: str, index: int, test_pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"hivemind_ext-test-{test_pid}-{run_id}-{index}.stacks")


def dump_stacks(run_id: str, indices: Sequence[int], processes: Sequence[Any]) -> str:
    """Asks the peers ``indices`` for their threads' stacks (faulthandler on SIGUSR1): what a hang looked like."""
    for index in indices:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[index].pid, signal.SIGUSR1)
    time.sleep(1.0)  # time to write the stacks; best effort: this builds a failure message and must not fail itself
    texts = []
    for index in indices:
        for suffix, tail in (("", 6000), (".log", 8000)):
            with contextlib.suppress(OSError), open(stack_file(run_id, index, os.getpid()) + suffix) as f:
                texts.append(f"--- peer {index}{suffix} ---\n{f.read()[-tail:]}")
    return "\n".join(texts)


@pytest.mark.timeout(120)
def test_a_killed_peer_never_blocks_the_others() -> None:
    context = multiprocessing.get_context("spawn")
    bootstrap = new_peer()
    processes, readers = [], {}
    until_epoch, kill_at_epoch, victim = 4, 2, 2  # the round the victim dies in, and one more without it
    try:
        initial_peers = addresses(bootstrap)
        for index in range(3):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=process_peer, args=(index, initial_peers, "killed", until_epoch, writer))
            process.start()
            writer.close()  # the child holds it: the reader sees EOF when the child is gone
            processes.append(process)
            readers[reader] = index
        results: dict[int, tuple] = {}
        killed_at = None
        give_up = time.monotonic() + 100
        messages: list[tuple] = []
        while len(results) < 2:
            ready = multiprocessing.connection.wait(list(readers), timeout=max(give_up - time.monotonic(), 0.1))
            if not ready:
                stacks = dump_stacks("killed", [i for i in range(3) if i != victim], processes)
                last = messages[-6:]
                raise AssertionError(f"the survivors did not finish; last messages: {last}\n{stacks}")
            for reader in ready:
                try:
                    message = reader.recv()
                except EOFError:
                    index = readers.pop(reader)
                    assert index == victim or index in results, f"peer {index} exited early: {messages[-6:]}"
                    continue
                messages.append(message)
                kind, index = message[0], message[1]
                assert kind != "error", f"peer {index} failed: {message[2]}"
                if kind == "epoch" and index == victim and killed_at is None and message[2] >= kill_at_epoch:
                    os.killpg(processes[victim].pid, signal.SIGKILL)  # in the middle of its next epoch
                    killed_at = message[2]
                elif kind == "done":
                    assert index != victim or killed_at is None, "the victim finished before it could be killed"
                    results[index] = message
        assert killed_at is not None, "the victim never reached the epoch at which it was to be killed"
        for index, (_, _, epoch, max_step) in results.items():
            assert epoch >= until_epoch
            assert max_step < AVERAGING_TIMEOUT + MATCHMAKING_TIME + 3, f"peer {index}: a step took {max_step:.1f} s"
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # its DHT and daemon too
            if process.is_alive():
                process.kill()  # it had not made its own process group yet
            process.join(5)
        for reader in readers:
            reader.close()
        bootstrap.shutdown()


# ---------------------------------------------------------------------------------------------
# 4. a stalled peer


@pytest.mark.timeout(120)
def test_a_peer_that_stops_stepping_in_a_scheduled_group_never_blocks_the_others() -> None:
    with local_swarm(3) as dhts, shutting_down([]) as optimizers:
        trainers = make_trainers(dhts, optimizers, 3, "stalled")
        train_together(trainers, until_epoch=2)
        staller = trainers[2]
        # the staller steps until it has a gradient round scheduled, then stops calling step()
        deadline = time.monotonic() + 30
        stop = threading.Event()
        others = threading.Thread(
            target=lambda: train_together(trainers[:2], until_epoch=5, seconds=60, stop=stop), daemon=True
        )
        others.start()
        generator = torch.Generator().manual_seed(5)
        while staller.opt.scheduled_round is None or staller.opt.scheduled_round.done():
            assert time.monotonic() < deadline, "the staller never scheduled a round"
            x = torch.randn(BATCH_SIZE, 16, generator=generator)
            ((staller.model(x) - 1) ** 2).mean().backward()
            staller.opt.step()
            staller.opt.zero_grad()
            time.sleep(0.02)
        held = staller.opt.scheduled_round
        wait_for(
            lambda: held.stage == AveragingStage.AWAITING_TRIGGER or held.done(), 10, message="the staller's group"
        )
        assert held.stage == AveragingStage.AWAITING_TRIGGER, "the staller was not holding a group"
        others.join(90)
        for trainer in trainers[:2]:
            assert trainer.error is None and trainer.opt.local_epoch >= 5  # the held round, then two without it
            longest = max(trainer.step_seconds)
            assert longest < AVERAGING_TIMEOUT + MATCHMAKING_TIME + 2, f"a step took {longest:.1f} s"


# ---------------------------------------------------------------------------------------------
# 5. a failed round


@pytest.mark.timeout(120)
def test_a_failed_round_falls_back_to_local_gradients_then_the_peer_resyncs() -> None:
    # no state averaging: only the download after the failure can bring the failed peer back in line
    with local_swarm(3) as dhts, shutting_down([]) as optimizers:
        trainers = make_trainers(dhts, optimizers, 3, "failed", average_state_every=1000)
        train_together(trainers, until_epoch=2)
        failed = trainers[2]
        averager = failed.opt.grad_averager
        assert averager is not None
        original_step = averager.step
        injected: list[int] = []  # the epoch whose round failed

        def step_that_fails_once(*args: Any, control: Any = None, **kwargs: Any) -> Any:
            """The round runs (so the others are not disturbed), but for this peer it fails, once: the
            result raises, and the buffers hold the local mean gradients, as after a real failure."""
            if injected or control is None:
                return original_step(*args, control=control, **kwargs)
            injected.append(failed.opt.local_epoch)
            local = [torch.zeros_like(p, dtype=torch.float32) for p in averager.parameters]
            averager.accumulator.mean_gradients(local)
            result = original_step(*args, control=control, **kwargs)
            original_result = control.result

            def failing_result(timeout: float | None = None) -> Any:
                original_result(timeout)
                with averager.get_tensors() as buffers:
                    torch._foreach_copy_(list(buffers), local)
                raise AllreduceError("injected failure")

            control.result = failing_result
            return result

        original_load = failed.opt.load_state_from_peers
        loads: list[tuple[int, int, list[torch.Tensor]]] = []  # (epoch before, epoch after, params after)

        def recording_load(**kwargs: Any) -> None:
            epoch_before = failed.opt.local_epoch
            original_load(**kwargs)
            loads.append((epoch_before, failed.opt.local_epoch, params_of(failed.model)))

        averager.step = step_that_fails_once  # type: ignore[method-assign]
        failed.opt.load_state_from_peers = recording_load  # type: ignore[method-assign]
        train_together(trainers, until_epoch=6)

        assert injected, "the failure was never injected"
        failed_epoch = injected[0] + 1  # the epoch the failed round led to
        # the step went on with the local gradients: this peer's parameters left the others'
        assert any(
            not torch.equal(a, b)
            for a, b in zip(failed.history[failed_epoch], trainers[0].history[failed_epoch], strict=True)
        )
        # ... and its next step downloaded the state, which put it back in line
        assert loads and loads[0][0] == failed_epoch, f"downloads at epochs {[load[0] for load in loads]}"
        _, loaded_epoch, loaded = loads[0]
        assert any(same_params(loaded, t.history[loaded_epoch]) for t in trainers[:2]), "it loaded no donor's state"
        # Not asserted: that it then stays in line. When the download lands just before the others' next
        # round (which formed without it), it is left one epoch behind and joins the following round with
        # stale parameters; the step-time check requires only local_epoch >= global - 1 (see the report).


# ---------------------------------------------------------------------------------------------
# 6. client mode


@pytest.mark.timeout(120)
def test_client_mode_peers_contribute_without_serving() -> None:
    # peers 0, 1: normal; 2: a normal DHT with Optimizer(client_mode=True); 3: a client-mode DHT
    with local_swarm(4, client_indices=[3]) as dhts, shutting_down([]) as optimizers:
        trainers = []
        for index in range(4):
            model = make_model(seed=0)
            optimizers.append(make_optimizer(dhts[index], model, "clients", client_mode=True if index == 2 else None))
            trainers.append(Trainer(optimizers[-1], model, seed=index))
        assert not dhts[2].client_mode and dhts[3].client_mode
        for trainer in trainers[2:]:
            opt = trainer.opt
            assert opt.client_mode and opt.grad_averager is not None and opt.grad_averager.client_mode
            assert opt.state_averager.client_mode and not opt.state_averager.allow_state_sharing
            assert opt.state_averager.donor is None  # it registers no handler and advertises nothing
        assert all(not t.opt.client_mode and t.opt.state_averager.donor.serving for t in trainers[:2])
        # nobody downloads a gradient averager's state: it does not advertise one
        assert not any(t.opt.grad_averager.allow_state_sharing for t in trainers)

        group_sizes: list[tuple[int, int]] = []

        def record_rounds() -> None:
            while not done.is_set():
                report = trainers[0].opt.grad_averager.last_round
                if report is not None and (
                    not group_sizes or group_sizes[-1] != (report.group_size, len(report.contributors))
                ):
                    group_sizes.append((report.group_size, len(report.contributors)))
                time.sleep(0.01)

        done = threading.Event()
        recorder = threading.Thread(target=record_rounds, daemon=True)
        recorder.start()
        train_together(trainers, until_epoch=4)
        done.set()
        recorder.join(5)
        # groups of all four peers in which only the two servers own a part of the all-reduce
        assert (4, 2) in group_sizes, f"(group size, parts) seen: {group_sizes}"
        # identical parameters at an epoch all four reached together (the very last round may fail for one)
        common = set.intersection(*(set(t.history) for t in trainers)) - {0}
        in_line = [e for e in common if all(same_params(t.history[e], trainers[0].history[e]) for t in trainers)]
        assert in_line, f"the four peers never had the same parameters (epochs {sorted(common)})"


# ---------------------------------------------------------------------------------------------
# 7. auxiliary peers


class ConstantGradient(torch.nn.Module):
    """A model whose gradient is the same constant on every peer: the loss is ``sum(weight * c)``, so the
    averaged gradient is ``c`` whatever each peer's weight, unless someone adds zeros with a weight > 0."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(64))
        self.register_buffer("c", torch.arange(1.0, 65.0) / 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * self.c).sum() + 0 * x.sum()


def train_constant(trainer: Trainer, *, stop: threading.Event, deadline: float, pause: float) -> None:
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            trainer.model(torch.zeros(1)).backward()
            started = time.perf_counter()
            trainer.opt.step()
            trainer.step_seconds.append(time.perf_counter() - started)
            trainer.opt.zero_grad()
            time.sleep(pause)
    except BaseException as e:
        trainer.error = e
        raise


@pytest.mark.timeout(120)
def test_auxiliary_peers_help_average_and_contribute_nothing() -> None:
    with local_swarm(3) as dhts, shutting_down([]) as optimizers:
        trainers = []
        for index in range(2):
            model = ConstantGradient()
            opt = make_optimizer(
                dhts[index], model, "aux", optimizer=lambda p: torch.optim.SGD(p, lr=1.0), average_state_every=1000
            )
            optimizers.append(opt)
            trainers.append(Trainer(opt, model, seed=index))
        aux = make_optimizer(dhts[2], torch.nn.Linear(1, 1), "aux", auxiliary=True, batch_size_per_step=None)
        optimizers.append(aux)
        assert aux.auxiliary and aux.grad_averager is None

        def observe_groups(stop: threading.Event, seen: list[int]) -> None:
            while not stop.is_set():
                report = trainers[0].opt.grad_averager.last_round
                if report is not None:
                    seen.append(report.group_size)
                time.sleep(0.01)

        def run_phase(
            helper: Callable[[threading.Event], Any],
            until_epoch: int,
            pause: float,
            until: Callable[[], bool] | None = None,
        ) -> list[int]:
            stop, seen = threading.Event(), []
            deadline = time.monotonic() + 60
            threads = [threading.Thread(target=helper, args=(stop,), daemon=True)]
            threads += [
                threading.Thread(
                    target=train_constant, args=(t,), kwargs=dict(stop=stop, deadline=deadline, pause=pause)
                )
                for t in trainers
            ]
            threads.append(threading.Thread(target=observe_groups, args=(stop, seen), daemon=True))
            for thread in threads:
                thread.start()
            wait_for(
                lambda: min(t.opt.local_epoch for t in trainers) >= until_epoch and (until is None or until(seen)),
                60,
                message=f"epoch {until_epoch}",
            )
            stop.set()
            for thread in threads:
                thread.join(30)
            for trainer in trainers:
                assert trainer.error is None, repr(trainer.error)
            return seen

        aux_errors: list[BaseException] = []

        def aux_loop(stop: threading.Event) -> None:
            try:
                while not stop.is_set():
                    aux.step()
            except BaseException as e:
                aux_errors.append(e)
                raise

        seen = run_phase(aux_loop, until_epoch=3, pause=0.1, until=lambda seen: 3 in seen)
        assert not aux_errors, f"the auxiliary peer's step() failed: {aux_errors[0]!r}"
        assert 3 in seen, f"the auxiliary peer never joined a round: group sizes {set(seen)}"
        assert aux.local_epoch >= 2
        check_weighted_mean(trainers)

        # the same with the command-line auxiliary peer, in its own process
        aux.shutdown()
        initial_peers = addresses(dhts[0])
        command = [
            sys.executable, "-m", "hivemind_ext.cli", "aux", "--initial-peers", *initial_peers,
            "--run-id", "aux", "--target-batch-size", str(TARGET_BATCH_SIZE),
            "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--matchmaking-time", str(MATCHMAKING_TIME),
            "--averaging-timeout", str(AVERAGING_TIMEOUT), "--max-rounds", "2",
        ]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            # the trainers keep training until the command has helped with two rounds and exited
            seen = run_phase(
                lambda stop: process.wait(60), until_epoch=0, pause=0.05, until=lambda seen: process.poll() is not None
            )
            output = process.communicate(timeout=10)[0]
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        assert process.returncode == 0, output
        assert "/ip4/127.0.0.1/tcp/" in output and "helped with 2 averaging rounds" in output, output
        assert 3 in seen, f"the command never joined a round: group sizes {set(seen)}"
        check_weighted_mean(trainers)


def check_weighted_mean(trainers: Sequence[Trainer]) -> None:
    """Every epoch moved the weights by exactly -c: the mean of the trainers' (equal) gradients, with the
    auxiliary peer's zero tensors given no weight."""
    for trainer in trainers:
        model = trainer.model
        expected = -model.c * trainer.opt.local_epoch
        torch.testing.assert_close(model.weight.detach(), expected, rtol=1e-6, atol=1e-6)
