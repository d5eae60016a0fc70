"""``hivemind-ext monitor`` and the metrics records peers publish for it.

Pure parts first (the record parser against hostile values, the swarm summary, the Prometheus
exposition of a state). Then one live run shared by the module: a 3-peer swarm on 127.0.0.1 (a
trainer, a client-mode trainer and an auxiliary peer, all with ``metrics_period``), a fourth peer
that writes garbage under the run's metrics key, and the ``hivemind-ext monitor`` command in a
subprocess. Its ``/metrics`` (parsed with prometheus_client's parser), its JSON and its dashboard
(rendered by headless Chromium) must show the peers' own numbers and nothing of the garbage.
"""

from __future__ import annotations

import dataclasses
import json
import math
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from prometheus_client.parser import text_string_to_metric_families
from swarm import addresses, local_swarm, wait_for, within

import hivemind_ext
from hivemind_ext.errors import ProtocolError
from hivemind_ext.monitoring.prometheus import registry_for
from hivemind_ext.monitoring.records import (
    PeerMetrics,
    metrics_key,
    metrics_value,
    parse_metrics_entries,
    parse_metrics_value,
)
from hivemind_ext.monitoring.swarm_state import SwarmState, summarize

ROOT = Path(__file__).resolve().parent.parent
PEER_ID = "12D3KooWEmSj6uGNt56rF171ETcjbVazUVKN4hXdDnwVAdgwmbiH"
OWNER = b"[owner:" + b"k" * 40 + b"]"
FAST_TRACKER = dict(min_refresh_period=0.05, max_refresh_period=0.5, default_refresh_period=0.2)


def record(**changes: Any) -> PeerMetrics:
    fields = dict(
        peer_id=PEER_ID,
        role="trainer",
        epoch=3,
        samples_per_second=12.5,
        loss=0.75,
        rounds_ok=4,
        rounds_failed=1,
        last_round_seconds=0.2,
        last_round_ok=True,
        bytes_sent=1000,
        bytes_received=900,
        time=1000.0,
    )
    fields.update(changes)
    return PeerMetrics(**fields)


def hostile_values() -> list[Any]:
    """Values a hostile peer could write: each is wrong in one way."""
    good = metrics_value(record())
    bad: list[Any] = [[1, 2, 3], "record", 7, {**good, **{f"extra{i}": i for i in range(40)}}]
    changes = [
        ("epoch", 2.5),
        ("epoch", True),
        ("epoch", -1),
        ("epoch", 2**63),
        ("epoch", "3"),
        ("samples_per_second", math.nan),
        ("samples_per_second", math.inf),
        ("samples_per_second", -1.0),
        ("samples_per_second", None),
        ("loss", math.nan),
        ("loss", "low"),
        ("last_round_seconds", -0.5),
        ("last_round_ok", 1),
        ("bytes_sent", 1.0),
        ("role", "admin"),
        ("role", ["trainer"]),
        ("peer_id", "x" * 100_000),
        ("peer_id", "not base58 0OIl"),
        ("peer_id", 5),
        ("time", math.nan),
    ]
    bad += [{**good, name: value} for name, value in changes]
    bad.append({key: value for key, value in good.items() if key != "rounds_ok"})
    bad.append({**good, ("tuple", "key"): 1})
    return bad


def test_a_record_survives_the_round_trip() -> None:
    for original in (record(), record(loss=None, last_round_seconds=None, last_round_ok=None, role="aux")):
        assert parse_metrics_value(metrics_value(original)) == original


@pytest.mark.parametrize("value", hostile_values())
def test_hostile_values_are_refused(value: Any) -> None:
    with pytest.raises(ProtocolError):
        parse_metrics_value(value)


def test_entries_keep_valid_owner_records_and_count_the_malformed_ones() -> None:
    now = get_dht_time()
    good = metrics_value(record())
    other = metrics_value(record(peer_id="12D3KooWQJifLmD3cFFGdETQNFvvAL3C3KUmdg6XZ97mGNL71Pw1", role="aux"))
    entries = [
        (OWNER, good, now + 10),
        (b"[owner:other]", other, now + 10),
        (b"not-an-owner", good, now + 10),  # unsigned: anyone could have written it
        ("[owner:str]", good, now + 10),
        (b"[owner:bad]", {**good, "epoch": math.nan}, now + 10),
        (b"[owner:gone]", None, now + 10),  # withdrawn: not malformed
        (b"[owner:old]", good, now - 1),  # expired: not malformed
    ]
    records, invalid = parse_metrics_entries(entries, now=now)
    assert sorted(r.role for r in records) == ["aux", "trainer"]
    assert invalid == 3


def test_the_summary_adds_up_the_peers() -> None:
    peers = [
        record(peer_id="A1", epoch=3, samples_per_second=10.0, loss=1.0, bytes_sent=5, last_round_seconds=0.5),
        record(peer_id="B2", role="client", epoch=4, samples_per_second=2.5, loss=3.0, bytes_sent=7, rounds_failed=2),
        record(peer_id="C3", role="aux", epoch=2, samples_per_second=0.0, loss=None, last_round_seconds=None),
    ]
    summary = summarize(peers, now=100.0)
    assert summary.epoch == 4 and summary.samples_per_second == 12.5 and summary.loss == 2.0
    assert summary.peers == {"trainer": 1, "client": 1, "aux": 1}
    assert summary.rounds_ok == 12 and summary.rounds_failed == 2 + 1 + 1 and summary.bytes_sent == 5 + 7 + 1000
    assert summary.last_round_seconds == pytest.approx((0.5 + 0.2) / 2)
    empty = summarize([], now=1.0)
    assert empty.epoch is None and empty.loss is None and empty.peers == {"trainer": 0, "client": 0, "aux": 0}


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a Prometheus exposition, by name and labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_the_prometheus_exposition_holds_the_state() -> None:
    from prometheus_client import generate_latest

    state = SwarmState("run_x")
    state.update([record(), record(peer_id="B2", role="aux", epoch=5, loss=None)], invalid=2, now=get_dht_time())
    samples = scrape(generate_latest(registry_for(state)).decode())
    assert samples[("hivemind_ext_swarm_epoch", ())] == 5
    assert samples[("hivemind_ext_peers", (("role", "trainer"),))] == 1
    assert samples[("hivemind_ext_peers", (("role", "client"),))] == 0
    assert samples[("hivemind_ext_swarm_loss", ())] == 0.75
    assert samples[("hivemind_ext_monitor_invalid_records", ())] == 2
    assert samples[("hivemind_ext_peer_epoch", (("peer", "B2"), ("role", "aux")))] == 5
    assert (
        samples[("hivemind_ext_peer_rounds_total", (("peer", PEER_ID), ("result", "failed"), ("role", "trainer")))] == 1
    )
    assert samples[("hivemind_ext_monitor_info", (("run_id", "run_x"),))] == 1


# ---------------------------------------------------------------------------------------------
# a live run


@dataclasses.dataclass
class LiveRun:
    optimizers: list[hivemind_ext.Optimizer]
    monitor: subprocess.Popen
    url: str
    hostile_entries: int

    def own_records(self) -> dict[str, dict[str, Any]]:
        """What each peer last published, by peer id (the report time left out)."""
        own = {}
        for opt in self.optimizers:
            last = opt.metrics_publisher.last_record
            if last is not None:
                own[last.peer_id] = {k: v for k, v in dataclasses.asdict(last).items() if k != "time"}
        return own

    def scrape_metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(self.url + "metrics", timeout=10) as response:
            assert response.headers["Content-Type"].startswith("text/plain")
            return scrape(response.read().decode())

    def sees_the_garbage(self) -> bool:
        """The last poll read every hostile record (and ignored it); polls run every 0.5 s."""
        return self.state()["invalid_records"] == self.hostile_entries

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "api/state", timeout=10) as response:
            return json.load(response)

    def shown_records(self) -> dict[str, dict[str, Any]]:
        return {p["peer_id"]: {k: v for k, v in p.items() if k != "time"} for p in self.state()["peers"]}

    def settled(self) -> bool:
        """The monitor shows every peer's own latest record, and those records hold the peers' epochs."""
        own = self.own_records()
        epochs_published = all(
            opt.metrics_publisher.last_record.epoch == opt.local_epoch
            for opt in self.optimizers
            if opt.metrics_publisher.last_record
        )
        return len(own) == 3 and epochs_published and self.shown_records() == own

    def expected_summary(self) -> dict[str, Any]:
        own = list(self.own_records().values())
        losses = [r["loss"] for r in own if r["loss"] is not None]
        return {
            "epoch": max(opt.local_epoch for opt in self.optimizers),
            "samples_per_second": sum(r["samples_per_second"] for r in own),
            "loss": sum(losses) / len(losses),
            "peers": {role: sum(r["role"] == role for r in own) for role in ("trainer", "client", "aux")},
            "rounds_ok": sum(r["rounds_ok"] for r in own),
            "rounds_failed": sum(r["rounds_failed"] for r in own),
            "bytes_sent": sum(r["bytes_sent"] for r in own),
        }


def start_monitor(initial_peers: list[str], run_id: str) -> tuple[subprocess.Popen, queue.Queue]:
    command = [sys.executable, "-m", "hivemind_ext.cli", "monitor", "--initial-peers", *initial_peers]
    command += ["--run-id", run_id, "--port", "0", "--poll-interval", "0.5"]
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            lines.put(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return process, lines


def dashboard_url(lines: queue.Queue, timeout: float) -> str:
    give_up = time.monotonic() + timeout
    while time.monotonic() < give_up:
        try:
            line = lines.get(timeout=max(0.0, give_up - time.monotonic()))
        except queue.Empty:
            break
        if line.startswith("dashboard: "):
            return line.split(" ", 1)[1]
    raise AssertionError(f"the monitor printed no dashboard address within {timeout} s")


def write_garbage(dht: Any, run_id: str) -> int:
    """A hostile peer's records under the run's metrics key; returns how many."""
    key, expiration = metrics_key(run_id), get_dht_time() + 600
    forged = metrics_value(record(epoch=999, role="trainer"))
    signed_garbage = {**forged, "peer_id": "x" * 20_000, "samples_per_second": math.nan}
    validator = RSASignatureValidator(RSAPrivateKey())
    # its first: it signs records under its owner subkey
    within("adding the hostile peer's validator", dht.add_validators, [validator])
    entries = [
        (validator.local_public_key, signed_garbage),  # signed by its writer, but malformed
        (b"forged", forged),  # well-formed, but under no owner: nothing vouches for it
        (b"text", {"epoch": "many"}),
        (b"seven", [math.nan]),
    ]
    for subkey, value in entries:
        assert within("a hostile store", dht.store, key, value, expiration, subkey=subkey), subkey
    return len(entries)


@pytest.fixture(scope="module")
def live_run() -> Iterator[LiveRun]:
    run_id = "monitor_test"
    with local_swarm(4) as dhts:
        monitor, lines = start_monitor(addresses(dhts[0]), run_id)
        optimizers: list[hivemind_ext.Optimizer] = []
        try:
            models = [torch.nn.Linear(4, 1) for _ in range(3)]
            for index, model in enumerate(models):
                optimizers.append(
                    hivemind_ext.Optimizer(
                        dht=dhts[index],
                        run_id=run_id,
                        target_batch_size=32,
                        batch_size_per_step=None if index == 2 else 4,
                        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
                        params=model.parameters(),
                        matchmaking_time=1.0,
                        averaging_timeout=5.0,
                        average_state_every=1000,
                        client_mode=index == 1,
                        auxiliary=index == 2,
                        metrics_period=0.5,
                        tracker_opts=FAST_TRACKER,
                    )
                )
            train(optimizers, models, until_epoch=2)
            hostile_entries = write_garbage(dhts[3], run_id)
            run = LiveRun(optimizers, monitor, dashboard_url(lines, timeout=90), hostile_entries)
            wait_for(run.settled, 60, interval=0.5, message="the monitor to show the peers' own records")
            wait_for(run.sees_the_garbage, 30, interval=0.5, message="a poll that read the hostile records")
            yield run
        finally:
            if monitor.poll() is None:
                monitor.kill()
                monitor.wait(10)
            for opt in optimizers:
                opt.shutdown()


def train(optimizers: list[hivemind_ext.Optimizer], models: list[torch.nn.Module], until_epoch: int) -> None:
    """Every peer steps in its own thread until the trainers reach ``until_epoch``; the trainers report losses."""
    stop, errors = threading.Event(), []

    def run(index: int, opt: hivemind_ext.Optimizer, model: torch.nn.Module) -> None:
        generator = torch.Generator().manual_seed(index)
        try:
            while not stop.is_set():
                if opt.auxiliary:
                    opt.step()
                    continue
                x = torch.randn(4, 4, generator=generator)
                loss = torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True))
                loss.backward()
                opt.step()
                opt.zero_grad()
                opt.report_loss(loss.item())
                time.sleep(0.02)
        except BaseException as e:
            errors.append(e)
            raise

    threads = [
        threading.Thread(target=run, args=(i, o, m), daemon=True)
        for i, (o, m) in enumerate(zip(optimizers, models, strict=True))
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: errors or min(o.local_epoch for o in optimizers[:2]) >= until_epoch, 90, interval=0.1)
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_metrics_endpoint_shows_the_peers_own_numbers(live_run: LiveRun) -> None:
    samples = live_run.scrape_metrics()
    expected = live_run.expected_summary()
    assert expected["epoch"] >= 2
    assert samples[("hivemind_ext_swarm_epoch", ())] == expected["epoch"]
    for role in ("trainer", "client", "aux"):
        assert samples[("hivemind_ext_peers", (("role", role),))] == 1
    assert samples[("hivemind_ext_swarm_loss", ())] == pytest.approx(expected["loss"], rel=1e-12)
    assert samples[("hivemind_ext_swarm_samples_per_second", ())] == pytest.approx(expected["samples_per_second"])
    assert samples[("hivemind_ext_swarm_rounds_ok", ())] == expected["rounds_ok"] > 0
    assert samples[("hivemind_ext_swarm_bytes_sent", ())] == expected["bytes_sent"] > 0
    for opt in live_run.optimizers:
        own = opt.metrics_publisher.last_record
        labels = (("peer", own.peer_id), ("role", own.role))
        assert samples[("hivemind_ext_peer_epoch", labels)] == opt.local_epoch == own.epoch
        assert samples[("hivemind_ext_peer_samples_per_second", labels)] == own.samples_per_second
        assert samples[("hivemind_ext_peer_rounds_total", (*labels[:1], ("result", "ok"), labels[1]))] == own.rounds_ok
    assert samples[("hivemind_ext_monitor_invalid_records", ())] == live_run.hostile_entries
    assert samples[("hivemind_ext_monitor_polls_total", ())] > 0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hostile_records_are_ignored_by_the_monitor(live_run: LiveRun) -> None:
    state = live_run.state()
    assert {p["peer_id"] for p in state["peers"]} == set(live_run.own_records())
    assert state["latest"]["epoch"] == live_run.expected_summary()["epoch"] < 999
    assert state["invalid_records"] == live_run.hostile_entries
    assert state["invalid_records_total"] >= live_run.hostile_entries


class ElementText(HTMLParser):
    """The text of every element with an id, and the attributes of every canvas."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, str] = {}
        self.canvases: dict[str, dict[str, str | None]] = {}
        self._open: list[str | None] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        if tag == "canvas":
            self.canvases[attributes.get("id") or ""] = attributes
            return
        self._open.append(attributes.get("id"))
        if attributes.get("id"):
            self.text[attributes["id"]] = ""

    def handle_endtag(self, tag: str) -> None:
        if tag != "canvas" and self._open:
            self._open.pop()

    def handle_data(self, data: str) -> None:
        for element in self._open:
            if element:
                self.text[element] += data


def chromium() -> str | None:
    return next((p for name in ("chromium", "chromium-browser", "google-chrome") if (p := shutil.which(name))), None)


def render(browser: str, url: str) -> ElementText:
    """The page's DOM after its scripts ran for 10 s of virtual time (headless Chromium)."""
    with tempfile.TemporaryDirectory() as profile:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
        flags += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
        flags += [f"--user-data-dir={profile}", "--virtual-time-budget=10000", "--dump-dom", url]
        result = subprocess.run([browser, *flags], capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stderr[-2000:]
    parser = ElementText()
    parser.feed(result.stdout)
    return parser


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_dashboard_shows_the_swarm_in_chromium(live_run: LiveRun) -> None:
    browser = chromium()
    if browser is None:
        pytest.skip("no chromium binary found (Debian: apt-get install -y chromium chromium-driver)")
    for attempt in range(3):  # a late round may change a peer's counters between the render and the check
        page = render(browser, live_run.url + "?poll_ms=500")
        expected = live_run.expected_summary()
        shown = {
            "epoch": int(page.text["value-epoch"]),
            "peers": {role: int(page.text[f"value-peers-{role}"]) for role in ("trainer", "client", "aux")},
            "rounds_ok": int(page.text["value-rounds-ok"]),
            "rounds_failed": int(page.text["value-rounds-failed"]),
        }
        wanted = {key: expected[key] for key in shown}
        if shown == wanted or attempt == 2:
            break
        wait_for(live_run.settled, 30, interval=0.5)
    assert shown == wanted
    assert page.text["run-id"] == "monitor_test"
    assert float(page.text["value-loss"]) == pytest.approx(expected["loss"], abs=1e-4)
    assert float(page.text["value-samples-per-second"]) == pytest.approx(expected["samples_per_second"], abs=0.1)
    assert page.text["value-invalid-records"] == str(live_run.hostile_entries)
    for chart in ("epoch", "speed", "loss", "peers", "failures", "bytes"):
        assert int(page.canvases[f"chart-{chart}"]["data-points"]) > 0, chart
    rows = page.text["peer-rows"]
    for own in live_run.own_records():
        assert own[-12:] in rows


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_monitor_stops_on_sigterm(live_run: LiveRun) -> None:
    started = time.monotonic()
    live_run.monitor.send_signal(signal.SIGTERM)
    assert live_run.monitor.wait(timeout=30) == 0
    assert time.monotonic() - started < 15
