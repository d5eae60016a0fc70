"""Who may wait for a round that has not started here yet (issue 12: admission an outsider cannot starve).

A member's stream can arrive a little before this peer starts the round (its groupmate started
first); the service then lets it wait for ``round_wait_timeout``. Waiting costs a slot, and a flood
of streams for groups that do not exist must not take the slots of real members. So:

- requesters that the matchmaking board lists (``is_listed``: peers whose declarations or group
  records this peer has read recently) wait in the *member* slots;
- everyone else waits in a small, separate pool of *outsider* slots, and never in a member slot;
- every requester may hold at most ``max_waits_per_peer`` (members) or ``max_outsider_waits_per_peer``
  waits at once, and an outsider may start at most ``outsider_rate`` waits per second (a token
  bucket of ``outsider_burst``), so one peer id cannot fill even its own pool.

A member that the board does not list yet (this peer has not read its declaration) is served as an
outsider: it still gets a slot unless outsiders are flooding, and then its round excludes it, as
before. :class:`EarlyAdmission` is pure bookkeeping on a clock the caller passes; it is tested
without a network.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Hashable

from hivemind_ext.errors import ConfigurationError

MAX_RATE_BUCKETS = 4096  # outsiders whose token buckets are remembered; the oldest are forgotten


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    max_member_waits: int = 256
    max_waits_per_peer: int = 8
    max_outsider_waits: int = 16
    max_outsider_waits_per_peer: int = 2
    outsider_rate: float = 2.0
    outsider_burst: float = 4.0

    def __post_init__(self) -> None:
        for name in ("max_member_waits", "max_waits_per_peer", "max_outsider_waits", "max_outsider_waits_per_peer"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ConfigurationError(f"{name} must be a non-negative int, got {value!r}")
        for name in ("outsider_rate", "outsider_burst"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ConfigurationError(f"{name} must be a finite non-negative number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Ticket:
    """One admitted wait; hand it back to :meth:`EarlyAdmission.leave`."""

    peer: Hashable
    member: bool


class EarlyAdmission:
    """Counts the waits for not-yet-started rounds and decides who may start one (see the module)."""

    def __init__(self, config: AdmissionConfig, is_listed: Callable[[Hashable], bool] | None = None) -> None:
        self.config = config
        # None: no board to ask (a service used without matchmaking): every requester is a member
        self.is_listed = is_listed
        self._member_waits = 0
        self._outsider_waits = 0
        self._per_peer: collections.Counter[Hashable] = collections.Counter()
        self._buckets: collections.OrderedDict[Hashable, tuple[float, float]] = collections.OrderedDict()
        self.refused = 0  # requests refused so far (for monitoring and tests)

    @property
    def waiting(self) -> tuple[int, int]:
        """(member waits, outsider waits) right now."""
        return self._member_waits, self._outsider_waits

    def admit(self, peer: Hashable, now: float) -> Ticket | None:
        """A ticket if ``peer`` may wait for a round that has not started; None (counted) if not."""
        member = self.is_listed is None or bool(self.is_listed(peer))
        config = self.config
        if member:
            allowed = self._member_waits < config.max_member_waits and self._per_peer[peer] < config.max_waits_per_peer
        else:
            allowed = (
                self._outsider_waits < config.max_outsider_waits
                and self._per_peer[peer] < config.max_outsider_waits_per_peer
                and self._take_token(peer, now)
            )
        if not allowed:
            self.refused += 1
            return None
        self._per_peer[peer] += 1
        if member:
            self._member_waits += 1
        else:
            self._outsider_waits += 1
        return Ticket(peer, member)

    def leave(self, ticket: Ticket) -> None:
        """The wait of ``ticket`` is over (its round started, or it gave up)."""
        self._per_peer[ticket.peer] -= 1
        if self._per_peer[ticket.peer] <= 0:
            del self._per_peer[ticket.peer]
        if ticket.member:
            self._member_waits -= 1
        else:
            self._outsider_waits -= 1

    def _take_token(self, peer: Hashable, now: float) -> bool:
        config = self.config
        tokens, last = self._buckets.pop(peer, (config.outsider_burst, now))
        tokens = min(config.outsider_burst, tokens + max(0.0, now - last) * config.outsider_rate)
        taken = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if taken else tokens, now)
        while len(self._buckets) > MAX_RATE_BUCKETS:
            self._buckets.popitem(last=False)
        return taken
