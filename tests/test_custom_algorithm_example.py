"""The user-defined algorithm example runs, communicates on its schedule and learns."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_algorithm.py"


@pytest.mark.timeout(180)
def test_custom_algorithm_example_trains_and_averages_every_period() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--peers", "2", "--steps", "60", "--period", "10"],
        capture_output=True,
        text=True,
        timeout=170,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = re.findall(r"peer (\d): held-out accuracy ([\d.]+), (\d+) averaging rounds \((\d+) failed\)", done.stdout)
    assert len(lines) == 2, done.stdout
    for _, acc, rounds, failed in lines:
        assert int(rounds) + int(failed) == 6  # 60 steps, one round every 10
        assert int(rounds) >= 5
        assert float(acc) > 0.8  # an untrained model scores about 0.1
