"""A round's predicted duration, from the throughputs its members declared, and the whole-round
deadline that follows from it.

Why: ``allreduce_timeout`` (60 s by default) bounds a whole round, whatever its size and links. The
stall detector is elsewhere (``next_chunk_timeout`` is an idle window: a stream on which nothing
moves is cut, see :mod:`~hivemind_ext.p2p.idle`), so this deadline exists only to end a round that
keeps moving for too long; but a fixed one also ends rounds that are merely big for their links:
100 MB of float32 over 20 Mbit/s links needs about 80 s per round with four peers. So the deadline
follows the round's predicted duration: ``max(floor, multiple x predicted)``, where the floor is the
configured ``allreduce_timeout`` (a prediction never shortens a round) and the multiple is generous
(:data:`DEFAULT_MULTIPLE`), because the model below ignores latency, CPU and start skew.

**The prediction** is the model the part sizes are planned with (:mod:`.partition`): a member that
owns the fraction f_i of a vector of S bytes moves (1 + (N - 2) f_i) S bytes each way through its
link of bandwidth B_i, and the round takes the longest of these, max_i (1 + (N - 2) f_i) S / B_i.
S is the vector's uncompressed size (an upper bound for compressed rounds, so the deadline errs
long); B_i is what member i declared in matchmaking, by default its measured throughput
(:mod:`.throughput`: its receive rate in its recent rounds), and f_i is its part in this round's
layout. Members that declared nothing count as the mean of those that did; a round in which nobody
declared anything (every peer's first round) is not predicted, and keeps the floor.

**Hostile members.** A member's declared bandwidth enters only its own term and the split. Lying
high (to shrink the deadline) only shrinks its own term, and no split makes an honest member's term
smaller than moving its own vector once, S / B_honest; and the deadline is never below the floor.
Lying low lengthens the deadline (not below what an honest member predicts for itself), at most to
:data:`MAX_ROUND_SECONDS`, and costs the liar its part (a slow member owns little or nothing); a
stream that stops moving is still cut after the idle window.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hivemind_ext.averaging.allreduce.layout import RoundLayout, member_roles
from hivemind_ext.averaging.allreduce.partition import predicted_time
from hivemind_ext.averaging.allreduce.throughput import BITS_PER_MEGABIT
from hivemind_ext.averaging.matchmaking.group import Member

DEFAULT_MULTIPLE = 3.0  # the deadline is this many times the predicted duration (when above the floor)
MAX_ROUND_SECONDS = 3600.0  # a prediction never sets a deadline further out than this


def predict_round_seconds(layout: RoundLayout | None, members: Sequence[Member]) -> float | None:
    """The round's duration under the model of the module docstring, in seconds; None if nobody in
    the group declared a bandwidth or this peer has no layout yet (an auxiliary peer without tensors)."""
    if layout is None or not any(m.bandwidth is not None and not m.client_mode for m in members):
        return None
    total = layout.total
    if total == 0 or len(layout.parts) != len(members):
        return None
    fractions = [(part.end - part.start) / total for part in layout.parts]
    vector_bytes = sum(spec.nbytes for spec in layout.tensors)
    seconds = predicted_time(fractions, member_roles(members)) * vector_bytes * 8 / BITS_PER_MEGABIT
    return seconds if math.isfinite(seconds) else None


def round_timeout(
    predicted: float | None,
    floor: float,
    *,
    multiple: float = DEFAULT_MULTIPLE,
    ceiling: float = MAX_ROUND_SECONDS,
) -> float:
    """Seconds the whole round may take: ``floor`` (the configured ``allreduce_timeout``), or
    ``multiple`` times the prediction where that is longer, up to ``max(ceiling, floor)``."""
    if predicted is None or not math.isfinite(predicted) or predicted <= 0:
        return floor
    return max(floor, min(multiple * predicted, ceiling))
