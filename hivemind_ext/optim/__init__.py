"""The drop-in Optimizer and its parts: progress tracking, gradient and state averaging,
functional optimizers for background steps, and the AMP GradScaler (see DESIGN.md)."""

from hivemind_ext.optim.auxiliary import AuxiliaryPeer, run_auxiliary_peer
from hivemind_ext.optim.config import OptimizerConfig
from hivemind_ext.optim.functional import FunctionalOptimizer, functional_form, register_functional
from hivemind_ext.optim.grad_accumulator import GradientAccumulator
from hivemind_ext.optim.grad_averager import GradientAverager
from hivemind_ext.optim.grad_scaler import GradScaler
from hivemind_ext.optim.optimizer import Optimizer
from hivemind_ext.optim.progress import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind_ext.optim.state_averager import TrainingStateAverager
from hivemind_ext.optim.training_state import TrainingState

__all__ = [
    "AuxiliaryPeer",
    "FunctionalOptimizer",
    "GlobalTrainingProgress",
    "GradScaler",
    "GradientAccumulator",
    "GradientAverager",
    "LocalTrainingProgress",
    "Optimizer",
    "OptimizerConfig",
    "ProgressTracker",
    "TrainingState",
    "TrainingStateAverager",
    "functional_form",
    "register_functional",
    "run_auxiliary_peer",
]
