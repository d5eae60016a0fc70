"""The DHT key prefixes of one run: every participant (trainer, auxiliary peer, ``hivemind-ext aux``)
derives them from the run id here, so that they meet under the same keys."""

from __future__ import annotations

from typing import Any

from hivemind_ext.errors import ConfigurationError

# The longest protocol namespace built from a run id adds about 50 characters to it
# ("averager.<run_id>_asyncmodelaverage0_async_model_average"): this limit keeps every one of them
# within MAX_NAMESPACE_LENGTH, so a run id that passes check_run_id is never refused deeper down.
MAX_RUN_ID_LENGTH = 128


def check_run_id(run_id: Any) -> str:
    """``run_id`` if every peer of the run can use it as a name (DHT keys, protocol ids), else a
    :class:`ConfigurationError` that says what a run id may be."""
    if (
        not isinstance(run_id, str)
        or not 1 <= len(run_id) <= MAX_RUN_ID_LENGTH
        or not run_id.isprintable()
        or any(char.isspace() for char in run_id)
    ):
        raise ConfigurationError(
            f"run_id must be 1-{MAX_RUN_ID_LENGTH} printable characters without spaces, got {run_id!r:.160}"
        )
    return run_id


def grad_prefix(run_id: str) -> str:
    """The gradient rounds' matchmaking prefix (trainers and auxiliary peers)."""
    return f"{run_id}_grad_averager"


def state_prefix(run_id: str) -> str:
    """State averaging rounds and state sharing."""
    return f"{run_id}_state_averager"


def progress_prefix(run_id: str) -> str:
    """The progress tracker's prefix: it stores under f"{run_id}_progress", as hivemind's does."""
    return run_id
