"""How an Optimizer decides whether to trust a state: the wiring of :mod:`.state_checks` (range
checks of a downloaded state), donor agreement (``StateSharingConfig.require_agreement``) and
:mod:`.state_digests` (per-epoch digests compared across peers).

Agreement and digests need peers whose states are bitwise identical: synchronous gradient
averaging (the default algorithm without ``use_local_updates``, and without ``delay_optimizer_step``
for the digests, whose background step lands at a different moment on each peer), in one group of
the whole swarm (not in groups of ``target_group_size``, see ``averaging.matchmaking.rotation``).
Peers must then start from the same parameters (a seeded initialization, or the state downloaded at the first
step), as hivemind assumes too. Other modes get the range checks only; ``averager_opts=
{"require_agreement": ...}`` overrides the choice.
"""

from __future__ import annotations

from typing import Any

from hivemind_ext.optim.algorithms import GradientAllReduce
from hivemind_ext.optim.state_checks import StateBounds
from hivemind_ext.optim.state_digests import DigestBoard

Optimizer = Any  # hivemind_ext.Optimizer (not imported: it imports this module)


def synchronous_states(optimizer: Optimizer) -> bool:
    """Whether this optimizer's peers should hold bitwise identical states after each epoch."""
    config = optimizer.config
    algorithm = optimizer.algorithm
    default_algorithm = algorithm is None or type(algorithm) is GradientAllReduce
    # in groups smaller than the swarm (target_group_size), each group steps on its own average:
    # peers stay close (rotating groups mix them), not bitwise identical
    return default_algorithm and not config.use_local_updates and not config.auxiliary and not in_groups(optimizer)


def in_groups(optimizer: Optimizer) -> bool:
    """Whether the optimizer's peers average in groups of ``target_group_size`` (rotating groups,
    see ``averaging.matchmaking.rotation``) rather than in one group of the whole swarm."""
    return optimizer.averager_opts.get("target_group_size") is not None


def state_trust_options(optimizer: Optimizer, bounds: StateBounds | None, common: dict[str, Any]) -> dict[str, Any]:
    """The TrainingStateAverager keywords for trusting downloads and for rounds that mix epochs
    (``in_groups``), merged with ``common`` (the user's ``averager_opts`` win)."""
    tracker = optimizer.tracker
    return {
        "require_agreement": synchronous_states(optimizer),
        **common,
        "state_bounds": bounds,
        "swarm_epoch": lambda: int(tracker.global_progress.epoch),
        "in_groups": in_groups(optimizer),
    }


def make_digest_board(optimizer: Optimizer) -> DigestBoard | None:
    """The optimizer's digest board, or None where peers' states are not expected to be identical."""
    if not synchronous_states(optimizer) or optimizer.config.delay_optimizer_step:
        return None
    averager = optimizer.state_averager
    state, lock = optimizer.state_manager, optimizer.state_lock

    def take_state() -> tuple[Any, list[Any]]:
        with lock:
            return state.snapshot()

    return DigestBoard(
        optimizer.dht,
        averager.prefix,
        optimizer.dht.peer_id.to_base58(),
        take_state=take_state,
        on_diverged=lambda epoch: optimizer.rounds.request_resync(),
    )
