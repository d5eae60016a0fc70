"""The DHT key prefixes of one run: every participant (trainer, auxiliary peer, ``hivemind-ext aux``)
derives them from the run id here, so that they meet under the same keys."""

from __future__ import annotations


def grad_prefix(run_id: str) -> str:
    """The gradient rounds' matchmaking prefix (trainers and auxiliary peers)."""
    return f"{run_id}_grad_averager"


def state_prefix(run_id: str) -> str:
    """State averaging rounds and state sharing."""
    return f"{run_id}_state_averager"


def progress_prefix(run_id: str) -> str:
    """The progress tracker's prefix: it stores under f"{run_id}_progress", as hivemind's does."""
    return run_id
