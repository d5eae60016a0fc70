"""Pluggable training algorithms (Bagua-style): the Algorithm API and the built-in algorithms."""

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
from hivemind_ext.optim.algorithms.runner import AlgorithmRunner

__all__ = [
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AlgorithmRunner",
    "AverageOp",
    "Bucket",
    "GradientAllReduce",
    "Operation",
    "PythonOp",
]
