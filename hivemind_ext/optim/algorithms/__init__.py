"""Pluggable training algorithms (Bagua-style): the Algorithm API and the built-in algorithms.

base.py: the API (Algorithm, AlgorithmImpl and its hooks, AlgorithmContext, StepEngine, buckets);
runner.py: the engine that drives an implementation's hooks and bucket operations;
sync_gradients.py: the default, synchronous gradient averaging (GradientAllReduce);
local_updates.py: local steps with parameter averaging every epoch; state_rounds.py: the
parameter-averaging rounds those two share; diloco.py, qadam.py, powersgd.py, decentralized.py,
async_model_average.py: the other built-ins (neighbours.py: decentralized SGD's neighbour registry;
streaming.py: DiLoCo's overlapped rounds, ``DiLoCo(overlap=True)``; diloco_outer.py: the outer step
both DiLoCo modes share).
"""

from hivemind_ext.optim.algorithms.async_model_average import AsyncModelAverage, AsyncModelAverageImpl
from hivemind_ext.optim.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    AverageOp,
    Bucket,
    Operation,
    PythonOp,
    StepEngine,
)
from hivemind_ext.optim.algorithms.diloco import DiLoCo, DiLoCoImpl
from hivemind_ext.optim.algorithms.local_updates import LocalUpdatesImpl
from hivemind_ext.optim.algorithms.powersgd import PowerSGD
from hivemind_ext.optim.algorithms.qadam import QAdam
from hivemind_ext.optim.algorithms.runner import AlgorithmRunner
from hivemind_ext.optim.algorithms.streaming import OverlappedDiLoCoImpl
from hivemind_ext.optim.algorithms.sync_gradients import GradientAllReduce, SyncGradientsImpl

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AlgorithmRunner",
    "AsyncModelAverage",
    "AsyncModelAverageImpl",
    "AverageOp",
    "Bucket",
    "DiLoCo",
    "DiLoCoImpl",
    "GradientAllReduce",
    "LocalUpdatesImpl",
    "Operation",
    "OverlappedDiLoCoImpl",
    "PowerSGD",
    "PythonOp",
    "QAdam",
    "StepEngine",
    "SyncGradientsImpl",
]
