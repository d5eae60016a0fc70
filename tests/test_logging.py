"""``Optimizer(verbose=True)`` shows its status lines on stderr with no logging set-up, as hivemind's
does; without ``verbose`` it says nothing at INFO; and a user's own logging configuration (made
before or after the Optimizer) sees every line exactly once. Logging is process-wide state, so each
case runs tests/logging_run.py in a fresh interpreter and reads its stderr."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "logging_run.py"
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LINE = re.compile(r"^\w{3} \d\d \d\d:\d\d:\d\d\.\d{3} INFO hivemind_ext\.")  # hivemind_ext.logs.FORMAT


def run(mode: str) -> dict[str, list[str]]:
    """stderr of ``logging_run.py mode``, split into its phases (the lines before each ``=== phase done``)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), mode], capture_output=True, text=True, timeout=150, env=env, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-4000:]
    phases: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in result.stderr.splitlines():
        if line.startswith("=== ") and line.endswith(" done"):
            phases[line[4:-5]] = lines
            lines = []
        else:
            lines.append(line)
    return phases


def ours(lines: list[str]) -> list[str]:
    """The library's lines (hivemind's own loggers print with hivemind's handler, not the root's)."""
    return [line for line in lines if "hivemind_ext." in line]


def transitions(lines: list[str]) -> list[str]:
    return [line for line in lines if "transitioning to epoch" in line]


@pytest.mark.slow
@pytest.mark.timeout(170)
def test_verbose_logs_on_stderr_without_setup_and_once_with_root_logging() -> None:
    phases = run("phases")
    assert set(phases) == {"quiet", "verbose", "root-after"}, phases

    # no verbose, no set-up: nothing at INFO (a warning may still reach Python's last-resort handler)
    assert not [line for line in phases["quiet"] if " INFO " in line or "transitioning" in line], phases["quiet"]

    # verbose: the default handler prints the epoch transitions and the rounds of both peers
    verbose = phases["verbose"]
    epochs = transitions(verbose)
    assert sorted(re.search(r"epoch (\d+)", line).group(1) for line in epochs) == ["1", "1", "2", "2"], verbose
    assert all(DEFAULT_LINE.match(line) and "hivemind_ext.optim.optimizer" in line for line in epochs), epochs
    rounds = [line for line in verbose if "hivemind_ext.optim.rounds" in line]
    assert rounds and all(re.search(r"averaged with 2 peers in [0-9.]+ s", line) for line in rounds), verbose
    assert any("hivemind_ext.optim.progress" in line and "samples from 2 peers" in line for line in verbose)

    # logging.basicConfig after the default handler was installed: each line once, from the root handler
    after = phases["root-after"]
    assert len(transitions(after)) == 2, after
    assert all(line.startswith("ROOT hivemind_ext.") for line in ours(after)), after


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_verbose_with_root_logging_configured_first_prints_each_line_once() -> None:
    lines = run("root-before")["root-before"]
    assert [re.search(r"epoch (\d+)", line).group(1) for line in transitions(lines)] == ["1", "2"], lines
    assert all(line.startswith("ROOT hivemind_ext.") for line in ours(lines)), lines
