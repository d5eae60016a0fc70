"""The drop-in Optimizer and its parts (see DESIGN.md).

Which file does what:

- :mod:`.optimizer`: :class:`Optimizer`, the torch facade with hivemind's keywords; it keeps the
  epoch and catch-up (state download when behind) and drives one algorithm engine per step;
- :mod:`.algorithms`: every training mode as an Algorithm (the default synchronous gradient
  averaging and local updates included) and the runner that drives custom ones;
- :mod:`.rounds`: the round driver: when a round is scheduled, whom to expect, when to give up,
  what a missed or failed round means (pure functions), and the one loop that waits on a round;
- :mod:`.config`: :class:`OptimizerConfig`, hivemind's keywords resolved and checked, and the one
  place the averagers' options are assembled; :mod:`.keys`: the run's DHT key prefixes;
- :mod:`.progress`: :class:`ProgressTracker`, the swarm's epoch and samples from signed DHT records;
- :mod:`.grad_accumulator`: the one gradient accumulator; :mod:`.grad_averager`: gradient rounds;
- :mod:`.state_averager`: parameter/optimizer-state rounds and state download; :mod:`.training_state`:
  the parameters, optimizer, scheduler and their host copies (offloading);
- :mod:`.functional`: functional optimizers for background steps; :mod:`.background`: the worker
  that runs delayed steps; :mod:`.param_groups`: the param-group views torch users read;
- :mod:`.grad_scaler`: the AMP GradScaler; :mod:`.auxiliary`: the auxiliary (no-data) peer role.
"""

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
