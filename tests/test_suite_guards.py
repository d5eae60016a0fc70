"""The guards tests/conftest.py puts around the whole run: an empty selection fails, a run past its time
budget stops with a summary instead of being cut off by CI, a rerun keeps its test's timeout, and property
tests draw the same examples on every run. Each
case runs pytest on a small test file beside copies of conftest.py and the helpers it imports."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

PASSES = """
def test_passes():
    pass
"""

HANGS_ON_ITS_RERUN = """
import pathlib
import time

import pytest


@pytest.mark.timeout(3)
def test_fails_then_hangs():
    tried = pathlib.Path(__file__).with_name("tried")
    if not tried.exists():
        tried.write_text("once")
        raise AssertionError("the first try fails")
    time.sleep(60)  # the rerun hangs
"""


DRAWS = """
import pathlib

from hypothesis import given, settings, strategies as st


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**60))
def test_draws(x):
    with pathlib.Path(__file__).with_name("drawn").open("a") as out:
        out.write(f"{x}\\n")
"""


def run_pytest(directory: Path, test_file: str, *args: str, **env: str) -> tuple[int, str]:
    for helper in ("conftest.py", "swarm.py"):
        (directory / helper).write_text((TESTS / helper).read_text())
    (directory / "test_example.py").write_text(test_file)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "timeout_method=signal", *args]
    run = subprocess.run(command, cwd=directory, env=env or None, capture_output=True, text=True, timeout=40)
    return run.returncode, run.stdout + run.stderr


def test_a_run_past_its_budget_stops_with_a_failure_and_names_where(tmp_path: Path) -> None:
    returncode, output = run_pytest(tmp_path, PASSES, **os.environ, HX_SUITE_BUDGET_S="0")
    assert returncode == 1, output
    assert "past its budget of 0 s" in output and "stopping before test_example.py::test_passes" in output, output
    assert "passed" not in output


def test_an_empty_selection_fails_instead_of_exit_code_5(tmp_path: Path) -> None:
    returncode, output = run_pytest(tmp_path, PASSES, "-k", "no_test_has_this_name")
    assert returncode == 1 and "1 deselected" in output, output


def test_a_rerun_that_hangs_is_cut_by_its_timeout(tmp_path: Path) -> None:
    """pytest-timeout cancels its timer when a try fails, so without conftest's re-arming a rerun has no
    timeout: this run then sleeps 60 s and the 40-s limit of run_pytest fails the test."""
    returncode, output = run_pytest(tmp_path, HANGS_ON_ITS_RERUN, "--reruns", "1")
    assert returncode == 1, output
    assert "Timeout (>3.0s)" in output and "1 failed" in output and "1 rerun" in output, output


def test_property_tests_draw_the_same_examples_on_every_run(tmp_path: Path) -> None:
    drawn = []
    for _ in range(2):
        returncode, output = run_pytest(tmp_path, DRAWS)
        assert returncode == 0, output
        drawn.append((tmp_path / "drawn").read_text())
        (tmp_path / "drawn").unlink()
    # without conftest's profile: two different lists (20 draws from 2**60 do not collide)
    assert drawn[0] == drawn[1] and len(set(drawn[0].split())) > 10
