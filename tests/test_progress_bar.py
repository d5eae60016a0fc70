"""The Optimizer's progress bar (``progress=``): what it shows is the tracker's view of the swarm and
the round driver's last outcome, rendered at most a few times a second, and closed on shutdown."""

from __future__ import annotations

import io
import re
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from optim_swarm import FAST_TRACKER, signing_key
from swarm import local_swarm, wait_for

from hivemind_ext import Optimizer
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.optim.progress import GlobalTrainingProgress
from hivemind_ext.optim.progress_bar import ProgressBar, make_progress_bar, progress_status
from hivemind_ext.optim.rounds import RoundOutcome

LINE = re.compile(
    r"epoch (?P<epoch>\d+): +\d+%\|[^|]*\| (?P<samples>\d+)/(?P<target>\d+) samples "
    r"\[(?P<speed>[0-9.]+) samples/s \| peers (?P<peers>\d+): (?P<trainers>\d+) trainers?, "
    r"(?P<clients>\d+) client, (?P<aux>\d+) aux \| (?P<round>[^\]]*)\]"
)


def progress(**fields: object) -> GlobalTrainingProgress:
    values = dict(
        epoch=3,
        samples_accumulated=100,
        target_batch_size=256,
        num_peers=4,
        num_clients=1,
        eta_next_epoch=0.0,
        next_fetch_time=0.0,
        samples_per_second=412.34,
    )
    values.update(fields)
    return GlobalTrainingProgress(**values)  # type: ignore[arg-type]


def frames(text: str) -> list[re.Match[str]]:
    """Every render of the bar in what tqdm wrote (each starts with a carriage return)."""
    return [m for part in re.split(r"[\r\n]", text) if (m := LINE.fullmatch(part.strip()))]


def test_status_counts_peers_by_role_and_describes_the_last_round() -> None:
    last = RoundOutcome(group_size=4, seconds=0.314, excluded={"QmPeer": "stalled"}, auxiliary=1)
    status = progress_status(progress(num_auxiliary=1), 2, last)
    assert (status.epoch, status.samples, status.target, status.peers) == (2, 100, 256, 4)
    assert (status.trainers, status.clients, status.auxiliary) == (2, 1, 1)
    assert status.postfix == "412.3 samples/s | peers 4: 2 trainers, 1 client, 1 aux | avg 4 peers -1 0.31s"
    failed = progress_status(progress(num_peers=1, num_clients=0), 0, RoundOutcome(0, 5.0, error="no group"))
    assert failed.postfix.endswith("| peers 1: 1 trainer, 0 client, 0 aux | round failed: no group")
    assert progress_status(progress(), 0, None).last_round == "no round yet"
    excluded = RoundOutcome(2, 0.5, excluded={"12D3KooWxyz": "timeout"})
    assert excluded.describe() == "averaged with 2 peers in 0.50 s (1 excluded: 3KooWxyz: timeout)"


def test_renders_are_throttled_and_the_epoch_change_and_close_always_render() -> None:
    shown = progress()
    tracker = SimpleNamespace(target_batch_size=256, global_progress=shown)
    rounds = SimpleNamespace(last_outcome=None)
    out = io.StringIO()
    bar = ProgressBar(tracker=tracker, rounds=rounds, file=out, min_interval=60.0)
    for _ in range(200):
        bar.update(3)
    assert len(frames(out.getvalue())) == 1  # the first render only: the others came within min_interval
    tracker.global_progress = progress(epoch=4, samples_accumulated=7)
    bar.update(4)  # a new epoch renders at once
    tracker.global_progress = progress(epoch=4, samples_accumulated=9)
    bar.close(4)
    bar.close(4)  # idempotent
    bar.update(4)  # after close: nothing
    rendered = frames(out.getvalue())
    shown_after = [(int(m["epoch"]), int(m["samples"])) for m in rendered][1:]
    # tqdm's close() draws the final line once more: the same figures
    assert shown_after[:2] == [(4, 7), (4, 9)] and set(shown_after[2:]) <= {(4, 9)}, shown_after
    assert out.getvalue().endswith("\n")


def test_progress_keyword() -> None:
    tracker = SimpleNamespace(target_batch_size=8, global_progress=progress())
    rounds = SimpleNamespace(last_outcome=None)
    assert make_progress_bar(False, verbose=True, tracker=tracker, rounds=rounds) is None
    # pytest captures stderr: not a terminal, so verbose alone draws no bar
    assert make_progress_bar(None, verbose=True, tracker=tracker, rounds=rounds) is None
    out = io.StringIO()
    bar = make_progress_bar(out, verbose=False, tracker=tracker, rounds=rounds)
    assert isinstance(bar, ProgressBar)
    bar.close()
    with pytest.raises(ConfigurationError):
        make_progress_bar(5, verbose=False, tracker=tracker, rounds=rounds)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bar_of_a_real_two_peer_run_matches_the_tracker() -> None:
    """A trainer and a client-mode peer train 3 epochs; the trainer's bar, drawn into a StringIO,
    ends on the figures its tracker holds and shows the rounds it averaged."""
    out = io.StringIO()
    with local_swarm(2, client_indices=[1]) as dhts:
        models = [torch.nn.Linear(8, 1) for _ in dhts]
        opts = [
            Optimizer(
                dht=dht,
                run_id="progress_bar",
                target_batch_size=32,
                batch_size_per_step=4,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                params=model.parameters(),
                matchmaking_time=1.0,
                averaging_timeout=20.0,
                tracker_opts={**FAST_TRACKER, "private_key": signing_key(dht)},
                progress=out if index == 0 else None,
            )
            for index, (dht, model) in enumerate(zip(dhts, models, strict=True))
        ]
        try:
            assert opts[1].progress_bar is None  # off by default
            errors: list[BaseException] = []

            def train(opt: Optimizer, model: torch.nn.Module) -> None:
                try:
                    give_up = time.monotonic() + 90
                    while opt.local_epoch < 3 and time.monotonic() < give_up:
                        x = torch.randn(4, 8)
                        torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
                        opt.step()
                        opt.zero_grad()
                        time.sleep(0.02)
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=train, args=pair) for pair in zip(opts, models, strict=True)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(100)
            assert not errors and all(opt.local_epoch >= 3 for opt in opts), errors
            trainer = opts[0]
            wait_for(lambda: trainer.tracker.fetch_now().num_peers == 2, 30, message="both peers in the tracker")
            expected = trainer.tracker.global_progress
            last_round = trainer.rounds.last_outcome
            epoch = trainer.local_epoch
        finally:
            for opt in opts:
                opt.shutdown()
    rendered = frames(out.getvalue())
    assert len(rendered) >= 3, out.getvalue()
    epochs = [int(m["epoch"]) for m in rendered]
    assert epochs == sorted(epochs) and epochs[0] == 0, epochs
    final = rendered[-1]
    assert int(final["epoch"]) == epoch
    assert (int(final["samples"]), int(final["target"])) == (expected.samples_accumulated, 32)
    assert float(final["speed"]) == pytest.approx(expected.samples_per_second, abs=0.051)
    assert (int(final["peers"]), int(final["clients"]), int(final["trainers"])) == (2, 1, 1)
    assert last_round is not None and last_round.ok and last_round.group_size == 2
    assert final["round"] == last_round.describe(short=True)
    assert any(m["round"].startswith("avg 2 peers") for m in rendered[:-1]), out.getvalue()
    assert out.getvalue().endswith("\n")
