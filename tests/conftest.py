import os
import time

import pytest
import pytest_timeout
from hypothesis import settings as hypothesis_settings
from swarm import revive_dead_peers

# Property tests draw the same examples on every run: a suite that passed passes again on the same code.
# Drawing fresh ones on every run made CI fail on an example no one had seen (a protocol defect, found,
# but in the gate instead of in development). HX_HYPOTHESIS_EXPLORE=1 draws fresh examples: run that
# while changing a property or the code under it, with more examples than the suite's budget allows.
hypothesis_settings.register_profile("repeatable", derandomize=True, database=None)
hypothesis_settings.register_profile("explore", derandomize=False)
hypothesis_settings.load_profile("explore" if os.environ.get("HX_HYPOTHESIS_EXPLORE") else "repeatable")

# The whole suite takes 16-19 minutes on CI's 2 cores; CI gives up after 90. A run that has gone on for
# this long is broken (a hung environment makes every later multi-peer test wait for its timeout, three
# times with reruns) and stops here, with pytest's summary of what failed, instead of being cut off by
# CI with no summary at all. HX_SUITE_BUDGET_S overrides it (seconds).
SUITE_BUDGET_S = float(os.environ.get("HX_SUITE_BUDGET_S", 45 * 60))
_started = time.monotonic()


def pytest_sessionstart(session: pytest.Session) -> None:
    global _started
    _started = time.monotonic()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    stop_past_the_budget(item)
    if getattr(item, "execution_count", 1) > 1:
        rearm_the_timeout(item)


def rearm_the_timeout(item: pytest.Item) -> None:
    """pytest-timeout arms one timer for a test's whole protocol, reruns included, and cancels it when a
    try fails (its ``pytest_exception_interact``): without this, a rerun (pytest-rerunfailures) runs with
    no timeout at all, and one that hangs stalls the whole run (it did in a CI-like run: a DHT process of
    a module's swarm died, the first try failed, the rerun waited for ever on the dead DHT). Each rerun
    gets the test's timeout again, through pytest-timeout's own hook."""
    settings = pytest_timeout.get_env_settings(item.config)
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        settings = pytest_timeout.Settings(float(marker.args[0]), *settings[1:])
    if settings.timeout and not settings.func_only:
        item.config.hook.pytest_timeout_set_timer(item=item, settings=settings)


@pytest.fixture(autouse=True)
def _revive_module_swarms() -> None:
    """A DHT process of a module-scoped test swarm that died (seen under heavy load) is replaced before
    the next test, so that one death fails one test instead of every later test of the module."""
    revive_dead_peers()


def stop_past_the_budget(item: pytest.Item) -> None:
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
