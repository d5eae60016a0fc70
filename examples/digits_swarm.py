"""The digits swarm moved into the package, as :mod:`hivemind_ext.demo` (``hivemind-ext train`` uses it):
this module keeps the old names importable for scripts that add ``examples/`` to ``sys.path``."""

from hivemind_ext.demo.data import DigitsData, accuracy, load_data, make_model
from hivemind_ext.demo.display import ProgressDisplay
from hivemind_ext.demo.local_swarm import PeerOutcome, SwarmRun, run_local_swarm
from hivemind_ext.demo.peer import (
    LOOPBACK,
    OPTIMIZERS,
    PeerConfig,
    PeerStats,
    global_progress,
    optimizer_class,
    peak_rss_mib,
    swarm_configs,
    train_peer,
)

__all__ = [
    "LOOPBACK",
    "OPTIMIZERS",
    "DigitsData",
    "PeerConfig",
    "PeerOutcome",
    "PeerStats",
    "ProgressDisplay",
    "SwarmRun",
    "accuracy",
    "global_progress",
    "load_data",
    "make_model",
    "optimizer_class",
    "peak_rss_mib",
    "run_local_swarm",
    "swarm_configs",
    "train_peer",
]
