"""The guards tests/conftest.py puts around the whole run: an empty selection fails, and a run past its
time budget stops with a summary instead of being cut off by CI."""

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def run_pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--reruns", "0", *args]
    return subprocess.run(
        command, cwd=TESTS.parent, env={**os.environ, **env}, capture_output=True, text=True, timeout=90
    )


def test_a_run_past_its_budget_stops_with_a_failure_and_names_where() -> None:
    selection = ["tests/test_helpers.py", "-k", "wait_for"]
    within_budget = run_pytest(*selection)
    assert within_budget.returncode == 0, within_budget.stdout + within_budget.stderr
    assert "2 passed" in within_budget.stdout

    past_budget = run_pytest(*selection, HX_SUITE_BUDGET_S="0")
    output = past_budget.stdout + past_budget.stderr
    assert past_budget.returncode == 1, output
    assert "past its budget of 0 s" in output and "test_wait_for_returns_the_first_truthy_value" in output
    assert "passed" not in past_budget.stdout


def test_an_empty_selection_fails_instead_of_exit_code_5() -> None:
    empty = run_pytest("tests/test_helpers.py", "-k", "no_test_has_this_name")
    assert empty.returncode == 1, empty.stdout + empty.stderr
