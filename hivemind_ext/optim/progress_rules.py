"""Which epoch the swarm is at and which sample claims count: rules that no single peer can bend.

Every progress record is signed by its writer, but a signature only proves who wrote a record, not
that it is true: any volunteer can publish epoch 10**9 or 10**12 samples under its own key. These
pure functions decide what a peer believes from the records of the other peers of its run (foreign
fingerprints already set apart) and its own progress, so that a minority of hostile records cannot
move the swarm's epoch or end an epoch early.

- **Epoch.** The swarm's epoch, seen from one peer, is the larger of its own epoch and the highest
  epoch that a strict majority of the *other* peers have reached (:func:`quorum_epoch`). A lone peer
  keeps its own epoch; a late joiner adopts the epoch the others agree on; a peer that missed a
  round sees the others move on once most of them did. A record more than one epoch above that is
  ignored (an honest peer is at most one epoch ahead, just after its round).
- **Samples.** A claim counts toward the swarm's epoch at most up to ``target_batch_size``, and,
  once at least two other trainers at that epoch can vouch for a reference, at most
  :data:`SAMPLE_FACTOR` times the upper median of their claims (the others' claims at this epoch,
  this peer's own included, the claimant's left out). A claim above :data:`ABSURD_TARGET_FACTOR`
  times the target is ignored. Speeds are capped the same way (they only schedule rounds).
- Auxiliary peers bring no samples: whatever their records claim counts as zero.

What that guarantees (h honest peers, f hostile ones, each with its own key): while f < h, no
hostile record moves any honest peer's epoch outside the honest peers' range (and so neither the LR
schedule nor the catch-up that follows the epoch). One hostile trainer counts as at most
:data:`SAMPLE_FACTOR` typical honest trainers toward the end of an epoch (with 3 honest trainers of
similar speed, an epoch still needs 3/5 of the target from them); an absurd claim counts nothing.
What it does not guarantee: keys are free, so f counts keys, not machines (a Sybil with many keys
is a majority); with two peers in all neither can tell which one lies (the other's record is
believed: the epoch it reports, samples up to the target); a record at the swarm's epoch or one
above counts as a live peer, so rounds expect it (and wait out their matchmaking window when it never
comes). The cost to honest swarms: a trainer more than :data:`SAMPLE_FACTOR` times ahead of the
others' median is counted at that bound, so such a mixed swarm ends its epochs a little after the
target (its gradients still carry every sample).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Protocol

SAMPLE_FACTOR = 2.0  # a trainer may be this many times ahead of a typical one (a faster machine)
ABSURD_TARGET_FACTOR = 4  # no honest peer reports this many times the target (it steps at the target)
EPOCH_AHEAD_REASON = "epoch far above the one the other peers agree on"
SAMPLES_REASON = "samples far above target_batch_size"


class ProgressRecord(Protocol):
    """What the rules read from a record (a :class:`~.progress.LocalTrainingProgress`)."""

    @property
    def peer_id(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def samples_accumulated(self) -> int: ...
    @property
    def samples_per_second(self) -> float: ...
    @property
    def auxiliary(self) -> bool: ...


@dataclasses.dataclass(frozen=True)
class Counted:
    """One peer's record with what of it counts: its samples toward the swarm's epoch (0 unless it
    is at that epoch) and its speed, both capped."""

    record: ProgressRecord
    samples: int
    speed: float
    is_local: bool = False
    limit: float = math.inf  # the most its samples may count for (its cap), also when extrapolated


@dataclasses.dataclass(frozen=True)
class Screening:
    """What :func:`screen_progress` decided."""

    epoch: int  # the swarm's epoch, as this peer sees it
    counted: tuple[Counted, ...]  # the peers that count (this one included), in the order given, local last
    ignored: tuple[tuple[str, str], ...]  # (peer id, why) of the records left out


def quorum_epoch(epochs: Sequence[int]) -> int | None:
    """The highest epoch that a strict majority of ``epochs`` have reached (None for no epochs).
    Fewer than half the values can neither raise it above the others' highest nor lower it below
    their lowest."""
    if not epochs:
        return None
    ordered = sorted(epochs, reverse=True)
    return ordered[len(ordered) // 2]  # the (n // 2 + 1)-th highest: that many values are >= it


def swarm_epoch(local_epoch: int, other_epochs: Sequence[int]) -> int:
    """The swarm's epoch for a peer at ``local_epoch``: its own, or what most others reached if further."""
    agreed = quorum_epoch(other_epochs)
    return local_epoch if agreed is None else max(local_epoch, agreed)


def upper_median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def vouched_cap(claims_of_others: Sequence[float], factor: float = SAMPLE_FACTOR) -> float:
    """The most one peer's claim may count, from the claims of the others (the claimant's own left
    out): ``factor`` times their upper median once at least two vouch, else no bound. With one hostile
    peer among them, the upper median of two or more is at most the highest honest claim."""
    if len(claims_of_others) < 2:
        return math.inf
    return factor * upper_median(claims_of_others)


def accepts_epoch(epoch: int, swarm: int) -> bool:
    """Whether an epoch from a peer (a record, a donor's state) is plausible next to the swarm's: an
    honest peer is at most one epoch ahead of what the others agree on."""
    return epoch <= swarm + 1


def screen_progress(records: Sequence[ProgressRecord], local: ProgressRecord, *, target_batch_size: int) -> Screening:
    """The swarm's epoch and what each peer's record counts for, from the other peers' ``records``
    and this peer's own ``local`` progress (which replaces a record with its peer id and is never
    capped: a peer trusts itself)."""
    others = [record for record in records if record.peer_id != local.peer_id]
    epoch = swarm_epoch(local.epoch, [record.epoch for record in others])

    ignored: list[tuple[str, str]] = []
    plausible = []
    for record in others:
        if not accepts_epoch(record.epoch, epoch):
            ignored.append((record.peer_id, EPOCH_AHEAD_REASON))
        elif record.samples_accumulated > ABSURD_TARGET_FACTOR * target_batch_size:
            ignored.append((record.peer_id, SAMPLES_REASON))
        else:
            plausible.append(record)

    peers = [*plausible, local]
    trainers = [index for index, peer in enumerate(peers) if not peer.auxiliary]
    at_epoch = [index for index in trainers if peers[index].epoch == epoch]
    speeds = {index: peers[index].samples_per_second for index in trainers}
    counted = []
    for index, peer in enumerate(peers):
        is_local = index == len(peers) - 1
        samples, speed, limit = 0, 0.0, math.inf
        if index in speeds:
            speed = peer.samples_per_second
            if not is_local:
                others_speeds = [value for other, value in speeds.items() if other != index and value > 0]
                speed = min(speed, vouched_cap(others_speeds))
        if index in at_epoch:
            samples = peer.samples_accumulated
            if not is_local:
                vouchers = [peers[other].samples_accumulated for other in at_epoch if other != index]
                limit = min(target_batch_size, vouched_cap(vouchers))
                samples = int(min(samples, limit))
        counted.append(Counted(peer, samples, speed, is_local, limit))
    return Screening(epoch=epoch, counted=tuple(counted), ignored=tuple(ignored))


__all__ = [
    "ABSURD_TARGET_FACTOR",
    "SAMPLE_FACTOR",
    "Counted",
    "ProgressRecord",
    "Screening",
    "accepts_epoch",
    "quorum_epoch",
    "screen_progress",
    "swarm_epoch",
    "upper_median",
    "vouched_cap",
]
