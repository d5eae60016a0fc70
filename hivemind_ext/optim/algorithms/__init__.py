"""Pluggable training algorithms (Bagua-style): the Algorithm API and the built-in algorithms."""

from hivemind_ext.optim.algorithms.async_model_average import AsyncModelAverage, AsyncModelAverageImpl
from hivemind_ext.optim.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    AverageOp,
    Bucket,
    GradientAllReduce,
    Operation,
    PythonOp,
)
from hivemind_ext.optim.algorithms.diloco import DiLoCo, DiLoCoImpl
from hivemind_ext.optim.algorithms.powersgd import PowerSGD
from hivemind_ext.optim.algorithms.qadam import QAdam
from hivemind_ext.optim.algorithms.runner import AlgorithmRunner

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
    "Operation",
    "PowerSGD",
    "PythonOp",
    "QAdam",
]
