import os
import time

import pytest

# The whole suite takes 16-19 minutes on CI's 2 cores; CI gives up after 90. A run that has gone on for
# this long is broken (a hung environment makes every later multi-peer test wait for its timeout, three
# times with reruns) and stops here, with pytest's summary of what failed, instead of being cut off by
# CI with no summary at all. HX_SUITE_BUDGET_S overrides it (seconds).
SUITE_BUDGET_S = float(os.environ.get("HX_SUITE_BUDGET_S", 45 * 60))
_started = time.monotonic()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started
    _started = time.monotonic()


def pytest_runtest_setup(item: pytest.Item) -> None:
    elapsed = time.monotonic() - _started
    if elapsed > SUITE_BUDGET_S:
        pytest.exit(
            f"the test run has taken {elapsed:.0f} s, past its budget of {SUITE_BUDGET_S:.0f} s "
            f"(HX_SUITE_BUDGET_S); stopping before {item.nodeid}: see the failures above",
            returncode=pytest.ExitCode.TESTS_FAILED,
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # An empty selection means the suite broke (a bad path, an import error hidden by a filter):
    # fail loudly instead of letting pytest's exit code 5 pass for "nothing to do".
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
