"""Checks, on join and before each round, that this peer belongs to the run it joined.

:class:`RunGuard` reads what the :class:`~hivemind_ext.optim.progress.ProgressTracker` learned at its
last fetch (the swarm's run fingerprint, the foreign peers, how many peers there are): no network
call and no hashing, so it costs honest peers nothing per step. It

- raises :class:`~hivemind_ext.errors.RunMismatchError` once this peer's fingerprint differs from the
  swarm's, naming the first difference (the caller then leaves the swarm);
- logs once per foreign peer that the swarm ignores it;
- logs once, at WARNING, a hint when this peer has been alone for a while (a wrong run_id, or
  initial peers of another swarm, leave a peer at "epoch 0, 1 peers" with nothing else to say).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hivemind_ext.errors import RunMismatchError

logger = logging.getLogger(__name__)

ALONE_HINT_AFTER = 30.0  # seconds alone before the hint
MAX_WARNED_PEERS = 1024  # bounds the memory of whom we warned about


class RunGuard:
    """:param tracker: the peer's progress tracker (its ``fingerprint``, ``swarm_fingerprint``,
      ``foreign_peers`` and ``global_progress``)
    :param run_id: the run, for messages
    :param alone_hint: what to check when alone (where the run id and initial peers are set)
    :param alone_hint_after: seconds alone before the hint is logged
    """

    def __init__(
        self,
        tracker: Any,
        run_id: str,
        *,
        alone_hint: str = "check the run_id and the DHT's initial_peers",
        alone_hint_after: float = ALONE_HINT_AFTER,
    ) -> None:
        self.tracker, self.run_id = tracker, run_id
        self.alone_hint, self.alone_hint_after = alone_hint, alone_hint_after
        self._started = time.monotonic()
        self._seen_others = False
        self._hinted = False
        self._warned: set[str] = set()

    def mismatch(self) -> str | None:
        """The first difference between this peer's fingerprint and the swarm's, or None."""
        mine, swarm = self.tracker.fingerprint, self.tracker.swarm_fingerprint
        if mine is None or swarm is None or mine is swarm:
            return None
        return mine.difference(swarm, self.run_id)

    def check(self) -> None:
        """Raises :class:`RunMismatchError` if this peer does not match the swarm; logs the hints."""
        difference = self.mismatch()
        if difference is not None:
            raise RunMismatchError(
                f"this peer cannot join the run: {difference}. Start it with the same model and settings "
                f"as the other peers, or with another run_id"
            )
        foreign = self.tracker.foreign_peers
        if foreign:
            self._warn_about(foreign)
        self._hint_if_alone(bool(foreign))

    def _warn_about(self, foreign: list[Any]) -> None:
        swarm = self.tracker.swarm_fingerprint
        for record in foreign:
            if record.peer_id in self._warned or len(self._warned) >= MAX_WARNED_PEERS:
                continue
            self._warned.add(record.peer_id)
            why = record.fingerprint.difference(swarm, self.run_id) if swarm is not None else None
            logger.warning(
                "ignoring peer %s under run_id %r: its model or settings differ from the swarm's (%s)",
                record.peer_id,
                self.run_id,
                (why or "incompatible fingerprint").replace(" here,", " there,"),
            )

    def _hint_if_alone(self, saw_foreign: bool) -> None:
        if self._hinted or self._seen_others:
            return
        if saw_foreign or self.tracker.global_progress.num_peers > 1:
            self._seen_others = True
            return
        waited = time.monotonic() - self._started
        if waited >= self.alone_hint_after:
            self._hinted = True
            logger.warning("no other peer found under run_id %r after %.0f s: %s", self.run_id, waited, self.alone_hint)


__all__ = ["ALONE_HINT_AFTER", "RunGuard"]
