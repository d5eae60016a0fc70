"""``hivemind-ext train`` / ``join`` / ``--version`` and the README's "Training across machines", run as a
user runs them: every command of that section parses as written, the local one trains with the join
command it prints, bad addresses end in one line, and Ctrl-C stops everything within seconds."""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fake_dht import StuckDHT
from swarm import addresses, new_peer

from hivemind_ext.cli import run
from hivemind_ext.demo.commands import example_main
from hivemind_ext.demo.options import MUST_MATCH

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_digits.py"
A_PEER_ID = "12D3KooWMqNxyHQUq31U9Mo8kgpJ5NFCcKFVScUZUzdUEWNhAjdk"  # a well-formed peer id nobody runs
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def cli() -> list[str]:
    """The console script where it is installed (as a user runs it), else the module."""
    return ["hivemind-ext"] if shutil.which("hivemind-ext") else [sys.executable, "-m", "hivemind_ext.cli"]


def as_run(command: str) -> list[str]:
    words = shlex.split(command)
    return [*cli(), *words[1:]] if words[0] == "hivemind-ext" else words


def section(title: str) -> str:
    return ROOT.joinpath("README.md").read_text().split(f"## {title}\n")[1].split("\n## ")[0]


def section_commands() -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", section("Training across machines"), flags=re.S)


class Running:
    """A command in its own session (so that its whole process tree can be found and signalled),
    with its output collected line by line."""

    def __init__(self, args: list[str]) -> None:
        self.process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV, start_new_session=True
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, pattern: str, timeout: float) -> re.Match[str]:
        give_up = time.monotonic() + timeout
        while time.monotonic() < give_up:
            for line in list(self.lines):
                if found := re.search(pattern, line):
                    return found
            if self.process.poll() is not None and not self.reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} within {timeout} s:\n{self.output[-4000:]}")

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.output[-4000:]}") from None
        self.reader.join(timeout=10)
        return code

    def session_processes(self) -> list[str]:
        """Live processes of this command's session: the command and everything it started."""
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                command = Path(f"/proc/{entry}/cmdline").read_text().replace("\0", " ")
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[3]) == self.process.pid and fields[0] != "Z":
                found.append(f"{entry}: {command[:120]}")
        return found

    def kill(self) -> None:
        if self.process.poll() is None or self.session_processes():
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=10)


@contextmanager
def running(args: list[str]) -> Iterator[Running]:
    command = Running(args)
    try:
        yield command
    finally:
        command.kill()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def parse_in_process(main: Callable[[list[str]], int], args: list[str], capsys: pytest.CaptureFixture[str]):
    """``main(args)`` for arguments that end in argparse's exit (a bad value, ``--help``): the exit code and
    output the command gives, without the seconds a new interpreter spends importing torch and hivemind
    (the console script itself runs in the tests that start peers)."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    output = capsys.readouterr()
    return subprocess.CompletedProcess(args, exited.value.code, output.out, output.err)


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    output = (result.stdout + result.stderr).strip()
    assert result.returncode != 0, output
    assert "Traceback" not in output, output
    assert len(output.splitlines()) == 1, output
    return output


# ------------------------------------------------------------------------------------------- --version


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"hivemind-ext {importlib.metadata.version('hivemind-ext')}"


# ---------------------------------------------------------------------------------- bad addresses


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "args",
    [
        ["train", "--host-maddrs", "/ip4/127.0.0.1/tcp/abc"],
        ["train", "--announce-maddrs", "203.0.113.7:45555"],
        ["join", "--initial-peers", "/ip4/127.0.0.1/tcp/45555"],  # no /p2p/<peer id>
        ["join", "--initial-peers", "/ip4/127.0.0.1/tcp/45555/p2p/Qm..."],
    ],
    ids=["port", "not-a-multiaddr", "no-peer-id", "bad-peer-id"],
)
def test_a_bad_multiaddr_ends_in_one_line(args: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    result = parse_in_process(run, args, capsys)
    assert result.returncode == 2
    assert f"argument {args[1]}" in one_line_error(result)


@pytest.mark.timeout(30)
def test_the_example_rejects_a_bad_multiaddr_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--initial-peers", "/ip4/127.0.0.1/tcp/abc/p2p/" + A_PEER_ID]
    result = parse_in_process(example_main, args, capsys)  # what examples/train_digits.py runs
    assert "not a valid multiaddr" in one_line_error(result)


@pytest.mark.timeout(120)
def test_a_dht_that_cannot_start_ends_in_one_line() -> None:
    """No peer at the initial address: hivemind's daemon fails, and the command says so in one line."""
    args = [*cli(), "join", "--initial-peers", f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{A_PEER_ID}"]
    result = subprocess.run(args, capture_output=True, text=True, env=ENV, timeout=100)
    assert result.returncode == 1
    assert "could not start the DHT" in one_line_error(result)


@pytest.mark.timeout(90)
def test_a_join_whose_swarm_is_gone_gives_up_in_one_line() -> None:
    """The join command's initial peer leaves and no other peer of the run is online: the joiner stops with
    one actionable line after ``--alone-timeout`` (it used to train alone for ever, as if it had joined)."""
    alone_timeout = 3.0
    initial = new_peer()  # a DHT peer with no trainer: the joiner bootstraps from it and is alone in the run
    try:
        args = ["join", "--initial-peers", *addresses(initial), "--epochs", "100000", "--alone-timeout", "3"]
        with running([*cli(), *args]) as joiner:
            joiner.wait_for_line(r"^joined run 'digits'", timeout=60)
            initial.shutdown()  # the initial peer is gone too
            # the deadline, then the peer's own shutdown (seconds on a loaded machine); before: never
            assert joiner.wait(timeout=alone_timeout + 30) == 1, joiner.output
            errors = [line for line in joiner.lines if line.startswith("error:")]
            assert len(errors) == 1 and "no other peer of run 'digits' was online for 3 s" in errors[0], joiner.output
            assert "Traceback" not in joiner.output, joiner.output
    finally:
        initial.shutdown()


# ------------------------------------------------------------------------------ aux: a hung DHT


class MuteDHT(StuckDHT):
    """Starts, then its process never answers a question (``get_visible_maddrs``, ``peer_id``...)."""

    def wait_until_ready(self, timeout: float | None = None) -> None:
        return

    def run_coroutine(self, coro, return_future: bool = False):
        if not return_future:
            time.sleep(5.0)
            raise AssertionError("asked the DHT without a deadline")
        return concurrent.futures.Future()

    def get_visible_maddrs(self, latest: bool = False):
        return self.run_coroutine(None)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("dht_class", "what"), [(StuckDHT, "did not start"), (MuteDHT, "visible multiaddrs")])
def test_aux_gives_up_on_a_hung_dht_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], dht_class: type, what: str
) -> None:
    """``hivemind.DHT(start=True)`` and ``get_visible_maddrs()`` wait for ever on a DHT that hangs; the command
    gives up after its deadlines with one line naming the wait, and shuts the DHT down."""
    import hivemind

    import hivemind_ext.cli

    monkeypatch.setattr(hivemind, "DHT", dht_class)
    monkeypatch.setattr(hivemind_ext.cli, "DHT_START_TIMEOUT", 0.2, raising=False)
    monkeypatch.setattr(hivemind_ext.cli, "DHT_CALL_TIMEOUT", 0.2, raising=False)
    StuckDHT.made.clear()
    args = [
        "aux",
        "--initial-peers",
        f"/ip4/127.0.0.1/tcp/1/p2p/{A_PEER_ID}",
        "--run-id",
        "r",
        "--target-batch-size",
        "8",
    ]
    started = time.monotonic()
    assert run(args) == 1
    assert time.monotonic() - started < 3.0
    output = capsys.readouterr().out
    assert "hivemind-ext aux failed: DeadlineExceededError: " in output and what in output, output
    assert [dht.shut_down for dht in StuckDHT.made] == [True]


@pytest.mark.timeout(30)
def test_the_monitor_and_the_demo_peer_give_up_on_a_dht_that_never_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import hivemind

    import hivemind_ext.demo.peer
    import hivemind_ext.monitoring.cli
    from hivemind_ext.demo.data import DigitsData

    monkeypatch.setattr(hivemind, "DHT", StuckDHT)
    monkeypatch.setattr(hivemind_ext.monitoring.cli, "DHT_START_TIMEOUT", 0.2, raising=False)
    monkeypatch.setattr(hivemind_ext.demo.peer, "DHT_START_TIMEOUT", 0.2, raising=False)
    StuckDHT.made.clear()
    started = time.monotonic()
    assert run(["monitor", "--run-id", "r", "--initial-peers", f"/ip4/127.0.0.1/tcp/1/p2p/{A_PEER_ID}"]) == 1
    assert time.monotonic() - started < 3.0
    assert "hivemind-ext monitor failed: DeadlineExceededError: the DHT did not start" in capsys.readouterr().out
    config = hivemind_ext.demo.peer.PeerConfig(index=0, data=DigitsData.__new__(DigitsData))
    started = time.monotonic()
    with pytest.raises(hivemind_ext.demo.peer.PeerStartError, match=r"could not start the DHT.*did not start within"):
        hivemind_ext.demo.peer.start_dht(config, [])
    assert time.monotonic() - started < 3.0
    assert [dht.shut_down for dht in StuckDHT.made] == [True, True]


# ------------------------------------------------------------------- README: training across machines


def test_the_section_documents_every_setting_that_must_match() -> None:
    text = section("Training across machines")
    for option, _ in MUST_MATCH:
        assert f"`{option}`" in text, option
    (readme_join,) = [command for command in section_commands() if command.startswith("hivemind-ext join")]
    assert [option for option, _ in MUST_MATCH] == [
        word for word in shlex.split(readme_join) if word in dict(MUST_MATCH)
    ]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("command", section_commands())
def test_every_command_of_the_section_parses_as_written(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The commands for other machines cannot run here (they name a public address): each must still
    parse, every value checked, up to ``--help``."""
    assert command.startswith("hivemind-ext ")
    result = parse_in_process(run, [*shlex.split(command)[1:], "--help"], capsys)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "usage: hivemind-ext" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_local_commands_of_the_section_train_together() -> None:
    """The section's one-machine run: `train` on a fixed port, then the `join with:` line it prints, as
    printed; the first peer listens on the port asked for, and both peers reach the last epoch."""
    (command,) = [command for command in section_commands() if "/ip4/127.0.0.1/" in command]
    port = free_port()  # the README's 45555, unless something here uses it
    command = command.replace("/tcp/45555", f"/tcp/{port}")
    with running(as_run(command)) as first:
        listening = first.wait_for_line(r"^peer 0 listens on (.*)$", timeout=180)
        assert listening.group(1).startswith(f"/ip4/127.0.0.1/tcp/{port}/p2p/"), first.output
        join = first.wait_for_line(r"^join with: (hivemind-ext join .*)$", timeout=10).group(1)
        words = shlex.split(join)
        for option, _ in MUST_MATCH:
            assert option in words, join
        assert words[words.index("--epochs") + 1] == "40" and words[words.index("--initial-peers") + 1] in listening[1]
        with running(as_run(join)) as second:
            assert second.wait(timeout=300) == 0, second.output
            assert re.search(r"^held-out accuracy: 0\.\d+", second.output, flags=re.M), second.output
            assert re.search(r"^this peer: held-out accuracy .* \| [1-9]\d* steps", second.output, flags=re.M)
        assert first.wait(timeout=120) == 0, first.output
        assert "peers online 2" in first.output, first.output  # they trained together


# ------------------------------------------------------------------------------------------- Ctrl-C


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("command", "sigint"), [("hivemind-ext train", "default"), ("examples/train_digits.py", "ignored")]
)
def test_ctrl_c_stops_a_training_swarm_within_seconds_and_leaves_no_process(command: str, sigint: str) -> None:
    """``sigint="ignored"`` starts the command as a shell script's background job is started (and as some
    CI runners start the test suite): with SIGINT ignored, which a process inherits across exec."""
    start = as_run(command) if command.startswith("hivemind-ext") else [sys.executable, str(ROOT / command)]
    if sigint == "ignored":
        start = ["sh", "-c", 'trap "" INT; exec "$@"', "sh", *start]
    with running([*start, "--peers", "2", "--epochs", "1000"]) as swarm:
        swarm.wait_for_line(r"^epoch [1-9]\d*/1000", timeout=240)
        assert any("p2pd" in process for process in swarm.session_processes())
        os.killpg(swarm.process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the foreground group
        sent = time.monotonic()
        assert swarm.wait(timeout=30) == 130, swarm.output
        took = time.monotonic() - sent
        assert took < 4.0, f"Ctrl-C took {took:.1f} s"  # 0.2-0.9 s measured here; 3.3-9.2 s before
        give_up = time.monotonic() + 20  # the fork server and multiprocessing's tracker exit on their own
        while (left := swarm.session_processes()) and time.monotonic() < give_up:
            time.sleep(0.2)
        assert not left, left
        assert "interrupted; all peers stopped" in swarm.output
        assert "Traceback" not in swarm.output, swarm.output
