"""The run fingerprint as pure functions: what it covers, its stability, the swarm's choice, its wire
form in progress records and matchmaking declarations, the state manifest check and the guard's hints."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from hivemind_ext.averaging.matchmaking.board import declaration_write, parse_board
from hivemind_ext.averaging.matchmaking.group import Declaration, Member
from hivemind_ext.averaging.state_sharing.download import check_expected_tensors
from hivemind_ext.averaging.tensor_layout import TensorSpec
from hivemind_ext.compression import Float16Compression, NoCompression
from hivemind_ext.errors import ConfigurationError, ProtocolError, RunMismatchError
from hivemind_ext.optim.algorithms.diloco import DiLoCo
from hivemind_ext.optim.algorithms.sync_gradients import GradientAllReduce
from hivemind_ext.optim.fingerprint import (
    RunFingerprint,
    auxiliary_fingerprint,
    swarm_fingerprint,
    trainer_fingerprint,
)
from hivemind_ext.optim.progress import LocalTrainingProgress, parse_progress_value, progress_value
from hivemind_ext.optim.run_guard import RunGuard
from hivemind_ext.optim.training_state import TrainingState

PEER = "QmPeerA"


def _state(out_features: int = 2, *, dtype: torch.dtype = torch.float32, optimizer: Any = None, **kwargs: Any):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, out_features).to(dtype)
    return TrainingState(
        optimizer=optimizer or (lambda params: torch.optim.SGD(params, lr=0.1)),
        params=model.parameters(),
        scheduler=None,
        offload=False,
        **kwargs,
    )


BASE: dict[str, Any] = dict(
    target_batch_size=512,
    grad_compression=None,
    state_averaging_compression=None,
    algorithm=GradientAllReduce(),
    use_local_updates=False,
    average_state_every=1,
)


def _fingerprint(state: TrainingState | None = None, **changes: Any) -> RunFingerprint:
    return trainer_fingerprint(state if state is not None else _state(), **{**BASE, **changes})


@pytest.mark.parametrize(
    ("what", "make", "named"),
    [
        ("shape", lambda: _fingerprint(_state(3)), "tensor 0 'parameter 0': shape (3, 8) here, (2, 8)"),
        ("dtype", lambda: _fingerprint(_state(dtype=torch.float64)), "float64 (2, 8) here, float32 (2, 8)"),
        ("tensor count", lambda: _fingerprint(_state(extra_tensors=[torch.zeros(3)])), "3 tensors here, 2"),
        ("target_batch_size", lambda: _fingerprint(target_batch_size=4096), "target_batch_size 4096 here, 512"),
        ("optimizer", lambda: _fingerprint(_state(optimizer=lambda p: torch.optim.Adam(p))), "optimizer"),
        ("grad codec", lambda: _fingerprint(grad_compression=Float16Compression()), "grad_compression"),
        (
            "state codec",
            lambda: _fingerprint(state_averaging_compression=Float16Compression()),
            "state_averaging_compression",
        ),
        ("algorithm", lambda: _fingerprint(algorithm=DiLoCo(inner_steps=10)), "algorithm DiLoCo("),
        ("hyperparameter", lambda: _fingerprint(algorithm=DiLoCo(inner_steps=20)), "inner_steps=20"),
        ("local updates", lambda: _fingerprint(use_local_updates=True), "use_local_updates True here"),
        ("state period", lambda: _fingerprint(average_state_every=4), "average_state_every 4 here, 1"),
        (
            "statistics",
            lambda: _fingerprint(_state(optimizer=lambda p: torch.optim.Adam(p), average_opt_statistics=["exp_avg"])),
            "average_opt_statistics ['exp_avg'] here, [] in the swarm",
        ),
        ("codec of an algorithm", lambda: _fingerprint(algorithm=DiLoCo(inner_steps=10, codec=None)), "codec="),
        ("gradient hops", lambda: _fingerprint(grad_averaging_hops=2), "grad_averaging_hops 2 here, 1 in the swarm"),
        ("automatic hops", lambda: _fingerprint(grad_averaging_hops="auto"), "grad_averaging_hops 'auto' here"),
    ],
)
def test_every_listed_field_changes_the_fingerprint_and_the_difference_names_it(what, make, named):
    base = _fingerprint()
    changed = make()
    assert changed.digest != base.digest, what
    assert not changed.compatible(base)
    difference = changed.difference(base, "run-x")
    assert difference is not None and difference.endswith("in the swarm (run 'run-x')")
    assert named in difference


def test_the_two_algorithms_with_other_hyperparameters_differ_and_equal_ones_do_not():
    assert (
        _fingerprint(algorithm=DiLoCo(inner_steps=10)).digest != _fingerprint(algorithm=DiLoCo(inner_steps=20)).digest
    )
    assert (
        _fingerprint(algorithm=DiLoCo(inner_steps=10)).digest == _fingerprint(algorithm=DiLoCo(inner_steps=10)).digest
    )


def test_the_intruder_of_the_issue_is_told_the_tensor_and_both_shapes():
    intruder, swarm = _fingerprint(_state(3)), _fingerprint(_state(2))
    assert intruder.difference(swarm, "x") == (
        "tensor 0 'parameter 0': shape (3, 8) here, (2, 8) in the swarm (run 'x')"
    )
    assert swarm.difference(swarm, "x") is None


def test_equal_settings_give_equal_digests_whatever_the_field_order_or_codec_spelling():
    a = RunFingerprint.of({"b": 1, "a": "x", TARGET: 3})
    b = RunFingerprint.of({TARGET: 3, "a": "x", "b": 1})
    assert a == b and a.digest == b.digest
    assert _fingerprint(grad_compression=None).digest == _fingerprint(grad_compression=NoCompression()).digest
    assert _fingerprint().digest == _fingerprint().digest


TARGET = "target_batch_size"

_SUBPROCESS = textwrap.dedent(
    """
    import torch
    from hivemind_ext.compression import Float16Compression
    from hivemind_ext.optim.algorithms.diloco import DiLoCo
    from hivemind_ext.optim.fingerprint import trainer_fingerprint
    from hivemind_ext.optim.training_state import TrainingState
    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    state = TrainingState(optimizer=lambda p: torch.optim.Adam(p), params=model.parameters(), scheduler=None,
                          offload=False, average_opt_statistics=["exp_avg_sq", "exp_avg"])
    print(trainer_fingerprint(state, target_batch_size=64, grad_compression=Float16Compression(),
                              state_averaging_compression=None, algorithm=DiLoCo(inner_steps=5),
                              use_local_updates=False, average_state_every=2).digest)
    """
)


@pytest.mark.timeout(300)
def test_the_digest_is_the_same_in_other_processes_with_other_hash_seeds():
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, env=env, timeout=90, check=True
        )
        digests.add(done.stdout.strip().splitlines()[-1])
    assert len(digests) == 1 and len(next(iter(digests))) == 32


def test_an_auxiliary_fingerprint_compares_only_the_target_batch_size():
    trainer = _fingerprint()
    assert auxiliary_fingerprint(512).compatible(trainer) and trainer.compatible(auxiliary_fingerprint(512))
    assert (
        auxiliary_fingerprint(4096).difference(trainer, "r")
        == "target_batch_size 4096 here, 512 in the swarm (run 'r')"
    )


def test_the_swarm_is_the_peers_furthest_along_then_the_majority_and_never_an_auxiliary_peer():
    a, b = _fingerprint(_state(2)), _fingerprint(_state(3))
    aux = auxiliary_fingerprint(1)
    assert swarm_fingerprint([(a, 0)]) == a  # a lone first peer defines the run
    assert swarm_fingerprint([(a, 5), (b, 0), (b, 0)]) == a  # the run being trained wins over newcomers
    assert swarm_fingerprint([(a, 3), (a, 3), (b, 3)]) == a  # then the majority
    assert swarm_fingerprint([(aux, 9), (b, 0)]) == b
    assert swarm_fingerprint([(aux, 9), (None, 3)]) is None
    tie = swarm_fingerprint([(a, 1), (b, 1)])
    assert tie == swarm_fingerprint([(b, 1), (a, 1)])  # every peer makes the same choice


def test_progress_records_carry_the_fingerprint_and_older_records_still_parse():
    fingerprint = _fingerprint()
    record = LocalTrainingProgress(PEER, 3, 10, 1.5, 100.0, False, fingerprint)
    value = progress_value(record)
    assert len(value) == 7
    assert parse_progress_value(value) == record
    assert parse_progress_value(value[:6]).fingerprint is None
    assert parse_progress_value([*value[:6], None]).fingerprint is None  # an auxiliary peer's record may have none
    for broken in ({"fields": [["a"]], "complete": True}, {"fields": [["a", 1]], "complete": True}, [1, 2], "x"):
        with pytest.raises(ProtocolError):
            parse_progress_value([*value[:6], broken])
    for not_a_mark in (False, 1, "True", None):  # an eighth item is only the auxiliary peers' True
        with pytest.raises(ProtocolError):
            parse_progress_value([*value, not_a_mark])
    assert parse_progress_value([*value, True]).auxiliary
    with pytest.raises(ProtocolError):
        RunFingerprint.from_wire({"fields": [["a", "1"], ["a", "2"]], "complete": True})
    with pytest.raises(ProtocolError):
        RunFingerprint.from_wire({"fields": [["a", "x" * 5000]], "complete": True})


def _declaration(peer: str, fingerprint: str) -> tuple[str, dict, float]:
    member = Member(peer, "0123456789abcdef", None, False, False)
    write = declaration_write(
        Declaration(member, "run_grads", 1.0, 2.0, 50.0, expiration=60.0, fingerprint=fingerprint)
    )
    return write.subkey, write.value, write.expiration_time


def test_matchmaking_ignores_declarations_of_another_fingerprint():
    entries = [_declaration("QmSame", "aa"), _declaration("QmDiffer", "bb"), _declaration("QmAux", "")]
    seen = {key[0] for key in parse_board("run_grads", entries, now=10.0, fingerprint="aa").declarations}
    assert seen == {"QmSame", "QmAux"}
    everyone = {key[0] for key in parse_board("run_grads", entries, now=10.0).declarations}
    assert everyone == {"QmSame", "QmDiffer", "QmAux"}  # a peer that checks nothing (an auxiliary peer)
    too_long = [_declaration("QmSame", "aa")]
    too_long[0][1]["fingerprint"] = "f" * 500
    assert not parse_board("run_grads", too_long, now=10.0, fingerprint="aa").declarations


def test_the_state_manifest_is_checked_before_anything_is_pulled():
    mine = [TensorSpec((3, 8), torch.float32), TensorSpec((3,), torch.float32)]
    theirs = [TensorSpec((2, 8), torch.float32), TensorSpec((2,), torch.float32), TensorSpec((2, 8), torch.float32)]
    with pytest.raises(RunMismatchError, match=r"tensor 0: shape \(3, 8\) here, \(2, 8\)"):
        check_expected_tensors(theirs, mine)
    with pytest.raises(RunMismatchError, match="1 tensors"):
        check_expected_tensors(theirs[:1], mine)
    check_expected_tensors([*mine, theirs[2]], mine)  # optimizer state after the parameters: not checked
    assert issubclass(RunMismatchError, ConfigurationError)


@dataclass
class _Progress:
    num_peers: int = 1


@dataclass
class _Tracker:
    """What RunGuard reads from a ProgressTracker."""

    fingerprint: RunFingerprint | None
    swarm_fingerprint: RunFingerprint | None
    foreign_peers: list = field(default_factory=list)
    global_progress: _Progress = field(default_factory=_Progress)


def test_the_guard_raises_on_a_mismatch_and_warns_once_per_foreign_peer(caplog):
    mine, other = _fingerprint(), _fingerprint(target_batch_size=64)
    with pytest.raises(RunMismatchError, match="target_batch_size 512 here, 64 in the swarm"):
        RunGuard(_Tracker(mine, other), "r").check()
    foreign = LocalTrainingProgress("QmIntruder", 0, 0, 0.0, 1.0, False, other)
    guard = RunGuard(_Tracker(mine, mine, [foreign], _Progress(2)), "r")
    with caplog.at_level(logging.WARNING, logger="hivemind_ext.optim.run_guard"):
        for _ in range(5):
            guard.check()
    warnings = [r.getMessage() for r in caplog.records if "QmIntruder" in r.getMessage()]
    assert len(warnings) == 1 and "target_batch_size 64 there, 512 in the swarm" in warnings[0]


def test_a_peer_alone_gets_one_hint_about_its_run_id(caplog):
    tracker = _Tracker(_fingerprint(), _fingerprint())
    guard = RunGuard(tracker, "my-run", alone_hint="check --run-id and --initial-peers", alone_hint_after=0.0)
    with caplog.at_level(logging.WARNING, logger="hivemind_ext.optim.run_guard"):
        for _ in range(10):
            guard.check()
    hints = [r.getMessage() for r in caplog.records if "no other peer" in r.getMessage()]
    assert len(hints) == 1
    assert "no other peer found under run_id 'my-run'" in hints[0] and "--initial-peers" in hints[0]
    caplog.clear()
    company = RunGuard(_Tracker(None, None, global_progress=_Progress(2)), "r", alone_hint_after=0.0)
    with caplog.at_level(logging.WARNING, logger="hivemind_ext.optim.run_guard"):
        company.check()
    assert not caplog.records
