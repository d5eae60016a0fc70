"""Checks on the project's own plumbing: the README's commands, CI, and package metadata."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    section = ROOT.joinpath("README.md").read_text().split("## Set-up")[1].split("\n## ")[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_readme_has_exactly_two_setup_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    main_job, tests = commands
    assert "pytest" in tests and "pytest" not in main_job
    for command in commands:
        assert "\n" not in command.strip(), "each set-up command must be one line"
        # torch is installed with the CPU pin only where it is missing
        assert command.startswith('python -c "import torch" 2>/dev/null || pip install torch==2.13.0;')


def test_ci_runs_the_readme_test_command_and_nothing_else() -> None:
    ci_lines = [
        line
        for line in ROOT.joinpath(".ci/run").read_text().splitlines()
        if line.strip() and not line.startswith("#") and not line.startswith(("set ", "cd "))
    ]
    assert ci_lines == [readme_commands()[1]]


def test_package_metadata_keeps_the_user_facing_torch_range() -> None:
    project = tomllib.loads(ROOT.joinpath("pyproject.toml").read_text())["project"]
    assert "torch>=2.1" in project["dependencies"]
    assert project["requires-python"] == ">=3.10"
    assert "pytest-timeout" in " ".join(project["optional-dependencies"]["test"])
