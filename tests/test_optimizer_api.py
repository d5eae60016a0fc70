"""hivemind_ext.Optimizer as a drop-in replacement for hivemind.Optimizer: the same keyword arguments,
a hivemind training script that runs with only the import changed, construction-time errors for
combinations that cannot work, torch.optim.Optimizer compatibility (param groups, schedulers,
GradScalers, state_dict) and what happens to gradients that overflow or hold NaN.

Mostly a single peer on one local DHT (a solo peer ends an epoch as soon as it alone reached
target_batch_size, without waiting for a group); one two-peer test checks that an overflowed epoch
contributes weight 0 to the group's average.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import os
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import hivemind
import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey
from swarm import addresses, local_swarm, new_peer, wait_for

import hivemind_ext
from hivemind_ext.compression import NoCompression
from hivemind_ext.errors import ConfigurationError, NonFiniteTensorError

FAST_TRACKER = {"min_refresh_period": 0.05, "max_refresh_period": 0.5, "default_refresh_period": 0.2}

# keyword arguments whose default differs from hivemind.Optimizer's, and why that is equivalent
KNOWN_DEFAULT_DIFFERENCES = {
    # hivemind: hivemind.NoCompression() (a shared instance as default); here None, which the averagers
    # resolve to hivemind_ext.compression.NoCompression() (checked in test_compression_defaults_mean_none)
    "grad_compression": "None -> NoCompression()",
    "state_averaging_compression": "None -> NoCompression()",
    "load_state_compression": "None -> NoCompression()",
}


@pytest.fixture(scope="module")
def dht() -> Iterator[hivemind.DHT]:
    dht = new_peer()
    yield dht
    dht.shutdown()


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(3, 2)


@contextmanager
def optimizer_for(dht: hivemind.DHT, model: torch.nn.Module, **kwargs: Any) -> Iterator[hivemind_ext.Optimizer]:
    options: dict[str, Any] = dict(
        dht=dht,
        run_id=f"api_{uuid.uuid4().hex[:10]}",
        target_batch_size=10_000,
        batch_size_per_step=4,
        params=model.parameters(),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        tracker_opts=dict(FAST_TRACKER),
    )
    options.update(kwargs)
    opt = hivemind_ext.Optimizer(**options)
    try:
        yield opt
    finally:
        opt.shutdown()


def batch(seed: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 3, generator=generator)
    return x, torch.randn(size, 2, generator=generator)


def loss_of(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = data
    return ((model(x) - y) ** 2).mean()


def reference_grads(model: torch.nn.Module, data: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
    """The unscaled gradients of ``data``'s loss at the model's current parameters (model left untouched)."""
    params = list(model.parameters())
    return [g.detach().clone() for g in torch.autograd.grad(loss_of(model, data), params)]


def accumulated_mean(opt: hivemind_ext.Optimizer) -> list[torch.Tensor]:
    accumulator = opt.grad_averager.accumulator
    out = [torch.empty_like(p, dtype=torch.float32) for p in accumulator.params]
    accumulator.mean_gradients(out)
    return out


def wait_for_thread_count(expected: int, timeout: float = 10.0) -> int:
    give_up = time.monotonic() + timeout
    while threading.active_count() > expected and time.monotonic() < give_up:
        time.sleep(0.05)
    return threading.active_count()


def child_processes() -> set[int]:
    """Pids of this process's children (daemons such as p2pd), read from /proc (empty elsewhere)."""
    me, found = str(os.getpid()), set()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            found.add(int(entry))
    return found


# ------------------------------------------------------------------ 1. the drop-in contract


def test_init_takes_every_hivemind_keyword_with_the_same_default() -> None:
    theirs = inspect.signature(hivemind.Optimizer.__init__).parameters
    ours = inspect.signature(hivemind_ext.Optimizer.__init__).parameters
    differing = set()
    for name, param in theirs.items():
        if name == "self":
            continue
        assert name in ours, f"hivemind.Optimizer's keyword {name!r} is missing"
        assert ours[name].kind is inspect.Parameter.KEYWORD_ONLY, name
        assert (ours[name].default is inspect.Parameter.empty) == (param.default is inspect.Parameter.empty), name
        if param.default is not inspect.Parameter.empty and ours[name].default != param.default:
            differing.add(name)
    assert differing == set(KNOWN_DEFAULT_DIFFERENCES), f"undocumented default differences: {differing}"
    for name in KNOWN_DEFAULT_DIFFERENCES:
        assert isinstance(theirs[name].default, hivemind.compression.NoCompression)
        assert ours[name].default is None
    # extra keywords of ours must be optional, so hivemind scripts never have to pass them
    for name in set(ours) - set(theirs):
        assert ours[name].default is not inspect.Parameter.empty, name


def test_methods_and_properties_exist() -> None:
    step = inspect.signature(hivemind_ext.Optimizer.step).parameters
    assert list(step) == ["self", "closure", "batch_size", "grad_scaler"]
    assert all(step[name].default is None for name in ("closure", "batch_size", "grad_scaler"))
    theirs_zero_grad = inspect.signature(hivemind.Optimizer.zero_grad).parameters["set_to_none"].default
    assert inspect.signature(hivemind_ext.Optimizer.zero_grad).parameters["set_to_none"].default == theirs_zero_grad
    assert isinstance(inspect.getattr_static(hivemind_ext.Optimizer, "local_epoch"), property)
    assert isinstance(inspect.getattr_static(hivemind_ext.Optimizer, "param_groups"), property)
    for name in ("zero_grad", "load_state_from_peers", "state_dict", "load_state_dict", "shutdown"):
        assert callable(getattr(hivemind_ext.Optimizer, name)), name
    assert issubclass(hivemind_ext.Optimizer, torch.optim.Optimizer)
    assert issubclass(hivemind_ext.GradScaler, torch.amp.GradScaler)
    assert hivemind_ext.GradScaler is hivemind_ext.optim.GradScaler


@pytest.mark.timeout(60)
def test_compression_defaults_mean_none(dht: hivemind.DHT) -> None:
    with optimizer_for(dht, make_model()) as opt:
        assert isinstance(opt.grad_averager.compression, NoCompression)
        assert isinstance(opt.state_averager.compression, NoCompression)
        assert isinstance(opt.state_averager.state_compression, NoCompression)


# ------------------------------------------------------------------ 2. a hivemind script, import swapped

HIVEMIND_SCRIPT = """
import time
import torch
import hivemind
from hivemind.utils.crypto import RSAPrivateKey

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
opt = hivemind.Optimizer(
    dht=dht,
    run_id=RUN_ID,
    batch_size_per_step=4,
    target_batch_size=16,
    params=model.parameters(),
    optimizer=lambda params: torch.optim.Adam(params, lr=0.05),
    scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
    matchmaking_time=2.0,
    averaging_timeout=10.0,
    grad_compression=hivemind.compression.Float16Compression(),
    state_averaging_compression=hivemind.compression.Float16Compression(),
    tracker_opts={"private_key": RSAPrivateKey()},
    averager_opts={"request_timeout": 1.0},
    verbose=True,
)
initial = [p.detach().clone() for p in model.parameters()]
step_seconds = []
while opt.local_epoch < 3:
    x = torch.randn(4, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    started = time.perf_counter()
    opt.step()
    step_seconds.append(time.perf_counter() - started)
final_lr = opt.param_groups[0]["lr"]
opt.shutdown()
dht.shutdown()
"""


def swap_import(script: str) -> str:
    swapped = script.replace("import hivemind\n", "import hivemind\nimport hivemind_ext\n", 1)
    return swapped.replace("hivemind.Optimizer(", "hivemind_ext.Optimizer(")


@pytest.mark.timeout(60)
def test_hivemind_script_runs_with_only_the_import_swapped() -> None:
    script = swap_import(HIVEMIND_SCRIPT)
    changed = [
        line
        for line in difflib.unified_diff(HIVEMIND_SCRIPT.splitlines(), script.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    assert changed == [
        "+import hivemind_ext",
        "-opt = hivemind.Optimizer(",
        "+opt = hivemind_ext.Optimizer(",
    ]
    namespace: dict[str, Any] = {"RUN_ID": f"docs_{uuid.uuid4().hex[:10]}"}
    try:
        exec(compile(script, "<hivemind docs script>", "exec"), namespace)
    finally:
        for name in ("opt", "dht"):
            if name in namespace:
                namespace[name].shutdown()
    opt = namespace["opt"]
    assert isinstance(opt, hivemind_ext.Optimizer)
    assert opt.local_epoch == 3
    assert len(namespace["step_seconds"]) == 12, "a solo peer ends an epoch every target_batch_size samples"
    # a solo peer must not wait for a group that cannot form (averaging_timeout=10 s) at each epoch end
    assert max(namespace["step_seconds"]) < 4.0, namespace["step_seconds"]
    assert namespace["final_lr"] == pytest.approx(0.05 * 0.5**3), "the scheduler steps once per epoch"
    model = namespace["model"]
    assert any(not torch.equal(a, b) for a, b in zip(namespace["initial"], model.parameters(), strict=True))
    assert type(opt.grad_averager.compression).__name__ == "Float16Compression"
    assert type(opt.state_averager.compression).__name__ == "Float16Compression"
    assert type(opt.grad_averager.compression).__module__.startswith("hivemind_ext.")


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "mode",
    [dict(), dict(delay_optimizer_step=True), dict(delay_optimizer_step=True, delay_grad_averaging=True)],
    ids=["sync", "delay_step", "delay_grads"],
)
def test_solo_peer_advances_epochs_without_waiting_in_every_mode(dht: hivemind.DHT, mode: dict) -> None:
    model = make_model()
    initial = [p.detach().clone() for p in model.parameters()]
    with optimizer_for(dht, model, target_batch_size=8, averaging_timeout=10.0, **mode) as opt:
        step_seconds = []
        for i in range(8):
            loss_of(model, batch(i)).backward()
            started = time.perf_counter()
            opt.step()
            step_seconds.append(time.perf_counter() - started)
            opt.zero_grad()
        assert opt.local_epoch == 4
        assert max(step_seconds) < 4.0, step_seconds
    assert any(not torch.equal(a, b) for a, b in zip(initial, model.parameters(), strict=True))


@pytest.mark.timeout(60)
def test_solo_peer_steps_on_its_own_mean_gradient(dht: hivemind.DHT) -> None:
    model, reference = make_model(), make_model()
    with optimizer_for(dht, model, target_batch_size=8, averaging_timeout=10.0) as opt:
        data = [batch(1), batch(2)]
        expected_grads = [(a + b) / 2 for a, b in zip(*(reference_grads(reference, d) for d in data), strict=True)]
        started = time.perf_counter()
        for d in data:
            loss_of(model, d).backward()
            opt.step()
            opt.zero_grad()
        assert time.perf_counter() - started < 5.0, "the solo peer waited for a group"
        assert opt.local_epoch == 1
        assert opt.last_epoch_samples == 8
        for p, ref, g in zip(model.parameters(), reference.parameters(), expected_grads, strict=True):
            torch.testing.assert_close(p.detach(), ref.detach() - 0.1 * g)


# hivemind's tests/test_optimizer.py::test_optimizer modes: (use_local_updates, delay_state_averaging,
# delay_optimizer_step, delay_grad_averaging, reuse_grad_buffers)
HIVEMIND_TEST_MODES = [
    (False, False, False, False, False),
    (False, True, False, False, False),
    (False, True, True, True, False),
    (False, False, False, False, True),
    (False, True, True, True, True),
    (False, True, True, False, True),
    (True, False, False, False, False),
    (True, True, False, False, False),
]


def hivemind_test_optimizer(
    dht: hivemind.DHT, model: torch.nn.Module, mode: tuple[bool, ...], batch_size: int = 4
) -> hivemind_ext.Optimizer:
    """The Optimizer exactly as hivemind's tests/test_optimizer.py::_test_optimizer builds it."""
    use_local_updates, delay_state_averaging, delay_optimizer_step, delay_grad_averaging, reuse_grad_buffers = mode
    return hivemind_ext.Optimizer(
        run_id=f"hivemind_test_{uuid.uuid4().hex[:10]}",
        target_batch_size=32,
        batch_size_per_step=batch_size,
        params=model.parameters(),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, gamma=0.5, step_size=1),
        dht=new_peer(addresses(dht)),
        tracker_opts=dict(private_key=RSAPrivateKey(), max_refresh_period=1.0),
        averager_opts=dict(request_timeout=0.5),
        use_local_updates=use_local_updates,
        matchmaking_time=1.0,
        averaging_timeout=5.0,
        reuse_grad_buffers=reuse_grad_buffers,
        delay_state_averaging=delay_state_averaging,
        delay_grad_averaging=delay_grad_averaging,
        delay_optimizer_step=delay_optimizer_step,
        average_state_every=1,
        client_mode=False,
        verbose=False,
    )


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", HIVEMIND_TEST_MODES, ids=[str(i) for i in range(len(HIVEMIND_TEST_MODES))])
def test_hivemind_test_settings_are_accepted_with_their_meaning(dht: hivemind.DHT, mode: tuple[bool, ...]) -> None:
    opt = hivemind_test_optimizer(dht, make_model(), mode)
    try:
        assert opt.tracker.config.max_refresh_period == 1.0  # the user's value; the 3 s default follows it
        assert opt.tracker.config.default_refresh_period <= 1.0
        assert opt.state_averager.matchmaking_config.request_timeout == 0.5
        assert opt.state_averager.matchmaking_config.min_matchmaking_time == 1.0
        assert opt.use_local_updates == mode[0] and opt.reuse_grad_buffers == mode[4]
        assert (opt.grad_averager is None) == mode[0]
    finally:
        opt.shutdown()
        opt.dht.shutdown()


@pytest.mark.timeout(60)
def test_hivemind_benchmark_settings_are_accepted(dht: hivemind.DHT) -> None:
    model = make_model()
    opt = hivemind_ext.Optimizer(  # hivemind's benchmarks/benchmark_optimizer.py, a client-mode trainer
        run_id=f"benchmark_{uuid.uuid4().hex[:10]}",
        target_batch_size=256,
        batch_size_per_step=8,
        params=model.parameters(),
        optimizer=functools.partial(torch.optim.SGD, lr=0.1),
        scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, gamma=0.1, step_size=10),
        dht=new_peer(addresses(dht), client_mode=True),
        tracker_opts=dict(private_key=RSAPrivateKey(), max_refresh_period=5.0),
        matchmaking_time=5.0,
        averaging_timeout=15.0,
        reuse_grad_buffers=True,
        delay_grad_averaging=True,
        delay_optimizer_step=True,
        average_state_every=1,
        client_mode=True,
        verbose=True,
    )
    try:
        assert opt.tracker.config.max_refresh_period == 5.0 and opt.client_mode
    finally:
        opt.shutdown()
        opt.dht.shutdown()


@pytest.mark.timeout(90)
def test_hivemind_solo_training_run_measures_speed_and_finishes_its_scheduled_round(dht: hivemind.DHT) -> None:
    """hivemind's _test_optimizer with one peer: 3 epochs of 32 samples, 4 samples every 0.3 s."""
    torch.manual_seed(0)
    features = torch.randn(100, 5)
    targets = features @ torch.randn(5, 1)
    model = torch.nn.Linear(5, 1)
    opt = hivemind_test_optimizer(dht, model, (False, True, True, True, True))
    samples, batch_time = 0, 0.3
    try:
        opt.load_state_from_peers()
        prev_time = time.perf_counter()
        while opt.local_epoch < 3:
            time.sleep(max(0.0, prev_time + batch_time - time.perf_counter()))
            rows = torch.randint(0, len(features), (4,))
            torch.nn.functional.mse_loss(model(features[rows]), targets[rows]).backward()
            opt.step()
            samples += 4
            prev_time = time.perf_counter()
        time.sleep(1.0)
    finally:
        opt.shutdown()
        opt.dht.shutdown()
    assert opt.local_epoch == opt.tracker.global_epoch == 3
    assert 32 * 3 <= samples <= 32 * 3 * 1.2
    assert 4 / 0.3 * 0.8 <= opt.tracker.performance_ema.samples_per_second <= 4 / 0.3 * 1.2
    assert opt.scheduled_grads is None or opt.scheduled_grads.done()


# ------------------------------------------------------------------ 3. invalid combinations


def sgd_instance(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


INVALID = [
    ("delay_step_without_offload", dict(delay_optimizer_step=True, offload_optimizer=False), "offload_optimizer"),
    (
        "delay_grads_without_delay_step",
        dict(delay_grad_averaging=True, delay_optimizer_step=False),
        "delay_grad_averaging=True requires delay_optimizer_step",
    ),
    ("client_mode_auxiliary", dict(client_mode=True, auxiliary=True, batch_size_per_step=None), "auxiliary"),
    ("auxiliary_with_batch_size", dict(auxiliary=True, batch_size_per_step=4), "batch_size_per_step"),
    ("local_updates_reuse_buffers", dict(use_local_updates=True, reuse_grad_buffers=True), "reuse_grad_buffers"),
    (
        "local_updates_delay_grads",
        dict(use_local_updates=True, delay_grad_averaging=True, delay_optimizer_step=True, offload_optimizer=True),
        "delay_grad_averaging",
    ),
    (
        "local_updates_grad_averager_factory",
        dict(use_local_updates=True, grad_averager_factory=hivemind_ext.optim.GradientAverager),
        "grad_averager_factory",
    ),
    ("offload_prebuilt_optimizer", dict(offload_optimizer=True, params=None, optimizer=sgd_instance), "factory"),
    ("delay_prebuilt_optimizer", dict(delay_optimizer_step=True, params=None, optimizer=sgd_instance), "offload"),
    ("target_batch_size_zero", dict(target_batch_size=0), "target_batch_size"),
    ("target_batch_size_float", dict(target_batch_size=8.0), "target_batch_size"),
    ("batch_size_per_step_negative", dict(batch_size_per_step=-1), "batch_size_per_step"),
    ("negative_matchmaking_time", dict(matchmaking_time=-1.0), "matchmaking_time"),
    ("negative_averaging_timeout", dict(averaging_timeout=-5.0), "averaging_timeout"),
    ("zero_load_state_timeout", dict(load_state_timeout=0), "load_state_timeout"),
    ("infinite_allreduce_timeout", dict(allreduce_timeout=float("inf")), "allreduce_timeout"),
    ("empty_run_id", dict(run_id=""), "run_id"),
    ("run_id_not_str", dict(run_id=42), "run_id"),
    ("average_state_every_zero", dict(average_state_every=0), "average_state_every"),
    ("performance_ema_alpha_zero", dict(performance_ema_alpha=0.0), "performance_ema_alpha"),
    ("reuse_grad_buffers_not_bool", dict(reuse_grad_buffers="yes"), "reuse_grad_buffers"),
    ("unknown_averager_opt", dict(averager_opts={"no_such_option": 1}), "averager_opts"),
    ("unknown_tracker_opt", dict(tracker_opts={"no_such_option": 1}), "tracker_opts"),
    ("dht_not_a_dht", dict(dht="not a dht"), "dht"),
    ("grad_averaging_hops_zero", dict(grad_averaging_hops=0), "grad_averaging_hops must be"),
    ("grad_averaging_hops_word", dict(grad_averaging_hops="many"), "grad_averaging_hops must be"),
    ("grad_averaging_hops_local_updates", dict(grad_averaging_hops=2, use_local_updates=True), "use_local_updates"),
    (
        "grad_averaging_hops_custom_algorithm",
        dict(grad_averaging_hops="auto", algorithm=hivemind_ext.optim.algorithms.DiLoCo(inner_steps=4)),
        "custom algorithm",
    ),
    ("grad_averaging_hops_one_group", dict(grad_averaging_hops=2), "target_group_size"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("kwargs", "message"), [case[1:] for case in INVALID], ids=[case[0] for case in INVALID])
def test_invalid_configuration_raises_and_leaks_nothing(dht: hivemind.DHT, kwargs: dict, message: str) -> None:
    model = make_model()
    kwargs = dict(kwargs)
    if callable(kwargs.get("optimizer")) and kwargs.get("params", ...) is None:
        kwargs["optimizer"] = kwargs["optimizer"](model)  # a pre-built torch optimizer instance
    target_dht = kwargs.pop("dht", dht)
    threads_before, children_before = threading.active_count(), child_processes()
    with pytest.raises(ConfigurationError, match=message):
        with optimizer_for(target_dht, model, **kwargs):
            pass
    assert wait_for_thread_count(threads_before) == threads_before, [t.name for t in threading.enumerate()]
    assert child_processes() == children_before


@pytest.mark.timeout(60)
def test_valid_construction_and_shutdown_leak_nothing(dht: hivemind.DHT) -> None:
    threads_before, children_before = threading.active_count(), child_processes()
    with optimizer_for(dht, make_model(), delay_optimizer_step=True, delay_grad_averaging=True) as opt:
        assert threading.active_count() > threads_before
        assert opt.config.offload_optimizer  # hivemind's default with params=...: offload
    assert wait_for_thread_count(threads_before) == threads_before, [t.name for t in threading.enumerate()]
    assert child_processes() == children_before


# ------------------------------------------------------------------ 4. torch.optim.Optimizer compatibility


@pytest.mark.timeout(60)
def test_param_groups_show_the_models_params_and_write_through(dht: hivemind.DHT) -> None:
    model = make_model()
    with optimizer_for(dht, model, offload_optimizer=True) as opt:
        assert isinstance(opt, torch.optim.Optimizer)
        assert len(opt.param_groups) == 1
        group = opt.param_groups[0]
        assert all(a is b for a, b in zip(group["params"], model.parameters(), strict=True))
        inner_params = opt.opt.param_groups[0]["params"]
        assert all(a is not b for a, b in zip(inner_params, model.parameters(), strict=True)), "offloaded copies"
        group["lr"] = 0.5
        assert opt.opt.param_groups[0]["lr"] == 0.5
        opt.param_groups[0]["momentum"] = 0.25
        assert opt.opt.param_groups[0]["momentum"] == 0.25
        with pytest.raises(TypeError):
            group["params"] = []


@pytest.mark.timeout(60)
def test_torch_grad_scaler_unscales_the_models_grads(dht: hivemind.DHT) -> None:
    model = make_model()
    with optimizer_for(dht, model, offload_optimizer=True) as opt:
        grads = reference_grads(model, batch(1))
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(loss_of(model, batch(1))).backward()
        torch.testing.assert_close(next(model.parameters()).grad, grads[0] * 1024.0)
        scaler.unscale_(opt)
        for p, g in zip(model.parameters(), grads, strict=True):
            torch.testing.assert_close(p.grad, g)


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")
@pytest.mark.parametrize("offload", [True, False])
def test_lr_scheduler_built_on_the_optimizer_sets_the_stepped_lr(dht: hivemind.DHT, offload: bool) -> None:
    model, reference = make_model(), make_model()
    with optimizer_for(dht, model, target_batch_size=4, offload_optimizer=offload) as opt:
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
        scheduler.step()
        assert opt.opt.param_groups[0]["lr"] == pytest.approx(0.01)
        grads = reference_grads(reference, batch(1))
        loss_of(model, batch(1)).backward()
        opt.step()  # one batch is the whole target: the epoch ends and the optimizer steps
        assert opt.local_epoch == 1
        for p, ref, g in zip(model.parameters(), reference.parameters(), grads, strict=True):
            torch.testing.assert_close(p.detach(), ref.detach() - 0.01 * g)


def adam_opt_state(opt: hivemind_ext.Optimizer) -> dict:
    return {k: {n: v.clone() for n, v in s.items()} for k, s in opt.opt.state_dict()["state"].items()}


@pytest.mark.timeout(60)
def test_state_dict_round_trip(dht: hivemind.DHT) -> None:
    source_model, target_model = make_model(0), make_model(0)
    adam = dict(
        optimizer=lambda params: torch.optim.Adam(params, lr=0.1),
        scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        target_batch_size=4,
    )
    with optimizer_for(dht, source_model, **adam) as source, optimizer_for(dht, target_model, **adam) as target:
        for i in range(3):
            loss_of(source_model, batch(i)).backward()
            source.step()
            source.zero_grad()
        assert source.local_epoch == 3
        state_dict = source.state_dict()
        assert state_dict["local_epoch"] == 3
        assert {"state", "param_groups"} <= set(state_dict)
        views_before = target.param_groups

        target.load_state_dict(state_dict)
        assert target.local_epoch == 3
        assert target.scheduler.last_epoch == 3
        # the checkpoint's lr is that of epoch 3; loading must not apply the schedule once more
        assert target.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
        assert target.opt.param_groups[0]["lr"] == source.opt.param_groups[0]["lr"]
        expected = adam_opt_state(source)
        for key, values in adam_opt_state(target).items():
            for name, value in values.items():
                torch.testing.assert_close(value, expected[key][name])
        # the views follow the group dicts that load_state_dict put in place
        views = target.param_groups
        assert all(a is b for a, b in zip(views[0]["params"], target_model.parameters(), strict=True))
        views[0]["lr"] = 0.123
        assert target.opt.param_groups[0]["lr"] == 0.123
        assert views_before[0]["params"][0] is views[0]["params"][0]
        # and stepping continues from the loaded state (Adam's step counter 3 -> 4)
        loss_of(target_model, batch(7)).backward()
        target.step()
        assert target.local_epoch == 4
        assert all(s["step"].item() == 4.0 for s in target.opt.state.values())
        assert target.param_groups[0]["lr"] == pytest.approx(0.123 * 0.5)


# ------------------------------------------------------------------ 5. GradScaler


def scaled_step(
    opt: hivemind_ext.Optimizer,
    model: torch.nn.Module,
    scaler: torch.amp.GradScaler,
    data: tuple[torch.Tensor, torch.Tensor],
    *,
    overflow: bool = False,
    zero_grad: bool = True,
) -> None:
    scaler.scale(loss_of(model, data)).backward()
    if overflow:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    if zero_grad:
        opt.zero_grad()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scaler_class", [hivemind_ext.GradScaler, torch.amp.GradScaler], ids=["ours", "torch"])
def test_grad_scaler_skips_overflowing_batches_and_accumulates_unscaled(dht: hivemind.DHT, scaler_class) -> None:
    model, reference = make_model(), make_model()
    with optimizer_for(dht, model) as opt:
        scaler = scaler_class("cpu", init_scale=2.0**10)
        scaled_step(opt, model, scaler, batch(1))
        assert opt.grad_averager.local_samples_accumulated == 4
        assert scaler.get_scale() == 2.0**10
        before = accumulated_mean(opt)

        scaled_step(opt, model, scaler, batch(2), overflow=True)
        assert opt.grad_averager.local_samples_accumulated == 4, "the overflowing batch is not counted"
        for now, then in zip(accumulated_mean(opt), before, strict=True):
            assert torch.equal(now, then), "the overflowing batch changed the accumulators"
        assert scaler.get_scale() == 2.0**9, "update() lowers the scale after an overflow"

        scaled_step(opt, model, scaler, batch(3, size=4))
        assert opt.grad_averager.local_samples_accumulated == 8
        expected = [
            (a + b) / 2
            for a, b in zip(reference_grads(reference, batch(1)), reference_grads(reference, batch(3)), strict=True)
        ]
        for mean, exp in zip(accumulated_mean(opt), expected, strict=True):
            torch.testing.assert_close(mean, exp)
        assert all(torch.equal(p, r) for p, r in zip(model.parameters(), reference.parameters(), strict=True))


@pytest.mark.timeout(60)
def test_grad_scaler_with_reuse_grad_buffers_defers_to_the_epoch_boundary(dht: hivemind.DHT) -> None:
    model, reference = make_model(), make_model()
    options = dict(
        reuse_grad_buffers=True,
        target_batch_size=12,
        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
    )
    with optimizer_for(dht, model, **options) as opt:
        scaler = hivemind_ext.GradScaler("cpu", init_scale=2.0**8, growth_interval=1)
        data = [batch(1), batch(2), batch(3)]
        grads = [reference_grads(reference, d) for d in data]
        for i, d in enumerate(data):
            scaled_step(opt, model, scaler, d, zero_grad=False)
            if i < 2:
                assert opt.local_epoch == 0
                assert scaler.get_scale() == 2.0**8, "the scale must stay fixed within an epoch"
        assert opt.local_epoch == 1
        assert scaler.get_scale() == 2.0**9, "update() applies at the epoch boundary (growth_interval=1)"
        mean = [sum(gs) / 3 for gs in zip(*grads, strict=True)]  # reuse mode: .grad sum / micro-steps
        for p, ref, g in zip(model.parameters(), reference.parameters(), mean, strict=True):
            torch.testing.assert_close(p.detach(), ref.detach() - g)
        assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters()), "reset after the epoch"
        assert opt.last_epoch_samples == 12

        # an epoch whose summed gradients overflow: this peer contributes nothing, the scale is lowered
        params_before = [p.detach().clone() for p in model.parameters()]
        for i, d in enumerate(data):
            scaled_step(opt, model, scaler, d, overflow=(i == 1), zero_grad=False)
            if i < 2:
                assert scaler.get_scale() == 2.0**9
        assert opt.local_epoch == 2
        assert opt.last_epoch_samples == 0, "an overflowed epoch contributes weight 0"
        assert scaler.get_scale() == 2.0**8
        assert all(torch.equal(a, b) for a, b in zip(params_before, model.parameters(), strict=True))
        assert opt.grad_averager.local_samples_accumulated == 0
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.timeout(60)
def test_grad_scaler_unscale_for_clipping_is_bypassed_with_reuse_grad_buffers(dht: hivemind.DHT) -> None:
    """The usual AMP recipe (unscale_, clip, step, update) on every micro-step: with reuse_grad_buffers,
    .grad holds a running sum of scaled gradients, so unscale_ must wait for the epoch boundary."""
    model, reference = make_model(), make_model()
    options = dict(reuse_grad_buffers=True, target_batch_size=12, optimizer=lambda p: torch.optim.SGD(p, lr=1.0))
    with optimizer_for(dht, model, **options) as opt:
        scaler = hivemind_ext.GradScaler("cpu", init_scale=2.0**8)
        data = [batch(1), batch(2), batch(3)]
        grads = [reference_grads(reference, d) for d in data]
        for d in data:
            scaler.scale(loss_of(model, d)).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9)  # never clips: only the flow counts
            scaler.step(opt)
            scaler.update()
        assert opt.local_epoch == 1
        mean = [sum(gs) / 3 for gs in zip(*grads, strict=True)]
        for p, ref, g in zip(model.parameters(), reference.parameters(), mean, strict=True):
            torch.testing.assert_close(p.detach(), ref.detach() - g)


@pytest.mark.timeout(60)
def test_zero_grad_is_refused_with_reuse_grad_buffers(dht: hivemind.DHT) -> None:
    with optimizer_for(dht, make_model(), reuse_grad_buffers=True) as opt:
        with pytest.raises(ConfigurationError):
            opt.zero_grad()


# ------------------------------------------------------------------ 6. NaN gradients without a scaler


@pytest.mark.timeout(60)
def test_nan_gradients_raise_and_keep_the_accumulated_samples(dht: hivemind.DHT) -> None:
    model, reference = make_model(), make_model()
    with optimizer_for(dht, model) as opt:
        loss_of(model, batch(1)).backward()
        opt.step()
        opt.zero_grad()
        expected = reference_grads(reference, batch(1))

        loss_of(model, batch(2)).backward()
        with torch.no_grad():
            list(model.parameters())[1].grad[0] = float("nan")
        with pytest.raises(NonFiniteTensorError):
            opt.step()
        opt.zero_grad()
        assert opt.grad_averager.local_samples_accumulated == 4
        for mean, exp in zip(accumulated_mean(opt), expected, strict=True):
            torch.testing.assert_close(mean, exp)

        loss_of(model, batch(3)).backward()  # training goes on after the bad batch
        opt.step()
        assert opt.grad_averager.local_samples_accumulated == 8
        expected = [(a + b) / 2 for a, b in zip(expected, reference_grads(reference, batch(3)), strict=True)]
        for mean, exp in zip(accumulated_mean(opt), expected, strict=True):
            torch.testing.assert_close(mean, exp)


# ------------------------------------------------------------------ two peers: an overflowed epoch weighs 0


@pytest.mark.timeout(60)
def test_overflowed_epoch_contributes_weight_zero_to_the_group() -> None:
    """Peer 0's scaled gradient sum overflows; the group's average must then be peer 1's gradient alone,
    and both peers step on it (reuse_grad_buffers: every micro-step of the epoch sees the same parameters)."""
    from hivemind.utils.crypto import RSAPrivateKey

    run_id = f"overflow_{uuid.uuid4().hex[:10]}"
    reference = make_model()
    with local_swarm(2) as dhts:
        models = [make_model(), make_model()]
        opts = []
        try:
            for dht, model in zip(dhts, models, strict=True):
                opts.append(
                    hivemind_ext.Optimizer(
                        dht=dht,
                        run_id=run_id,
                        target_batch_size=16,
                        batch_size_per_step=4,
                        reuse_grad_buffers=True,
                        params=model.parameters(),
                        optimizer=lambda params: torch.optim.SGD(params, lr=1.0),
                        matchmaking_time=2.0,
                        averaging_timeout=20.0,
                        # peers in one process need their own signing keys (hivemind's default is per process)
                        tracker_opts={**FAST_TRACKER, "private_key": RSAPrivateKey()},
                    )
                )
            wait_for(
                lambda: all(opt.tracker.fetch_now().num_peers >= 2 for opt in opts),
                20,
                interval=0.1,
                message="the peers to see each other's progress",
            )
            steps_taken = [0, 0]
            errors: list[BaseException] = []

            def train(index: int) -> None:
                try:
                    scaler = hivemind_ext.GradScaler("cpu", init_scale=2.0**8)
                    give_up = time.monotonic() + 40
                    while opts[index].local_epoch < 1 and time.monotonic() < give_up:
                        data = batch(100 * index + steps_taken[index])
                        overflow = index == 0 and steps_taken[index] == 0
                        scaled_step(opts[index], models[index], scaler, data, overflow=overflow, zero_grad=False)
                        steps_taken[index] += 1
                        time.sleep(0.05)
                except BaseException as e:  # reported by the main thread
                    errors.append(e)

            threads = [threading.Thread(target=train, args=(i,)) for i in range(2)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(50)
            assert not errors, errors
            assert [opt.local_epoch for opt in opts] == [1, 1]
            grads = [reference_grads(reference, batch(100 + i)) for i in range(steps_taken[1])]
            peer1_mean = [sum(gs) / steps_taken[1] for gs in zip(*grads, strict=True)]
            for model in models:
                for p, ref, g in zip(model.parameters(), reference.parameters(), peer1_mean, strict=True):
                    torch.testing.assert_close(p.detach(), ref.detach() - g, rtol=1e-5, atol=1e-6)
            own_id = str(dhts[0].peer_id)
            assert opts[0].last_round_samples.get(own_id) == 0, opts[0].last_round_samples
            assert opts[0].last_epoch_samples == 4 * steps_taken[1]
        finally:
            for opt in opts:
                opt.shutdown()
