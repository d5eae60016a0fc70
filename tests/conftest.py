import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # An empty selection means the suite broke (a bad path, an import error hidden by a filter):
    # fail loudly instead of letting pytest's exit code 5 pass for "nothing to do".
    if exitstatus == pytest.ExitCode.NO_TESTS_COLLECTED:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
