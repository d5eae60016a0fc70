"""Fault-tolerant butterfly all-reduce: one group round, every member reducing its part.

Which file does what:

- :mod:`.service`: :class:`AllreduceService`, the entry point (one per averager: one RPC handler,
  ``run_round``), and the round's overview (roles, pipelining, faults);
- :mod:`.api`: what a round takes and returns (:class:`AllreduceConfig`, :class:`RoundHooks` for
  fault injection, :class:`PartOutcome`, :class:`AllreduceResult`);
- :mod:`.partition`: who reduces what (part sizes that minimize the round's predicted time given the
  members' bandwidths, chunk bounds, member roles);
- :mod:`.throughput`: this peer's bandwidth, measured from its rounds (what it declares by default);
- :mod:`.layout`: where every value of a round goes (parts, chunks and their size, the layout fingerprint);
- :mod:`.paths`: which streams take the direct data path (not those over thin links);
- :mod:`.wire`: the messages on one (sender, owner) stream, built and strictly parsed;
- :mod:`.round_state`: what one member keeps for one round, shared by its two sides;
- :mod:`.run`: one member's run of one round (a sender task per owner, plus its own part);
- :mod:`.sender`: the sender's side (its slice of one part to the owner, the average back);
- :mod:`.owner`: the owner's side (reduce the part it owns, send the average back);
- :mod:`.reducer`: the weighted mean (or a robust aggregate) of one part, chunk by chunk, each
  chunk over the senders still in the part when it was complete;
- :mod:`.aggregators`: CenteredClip, TrimmedMean and the norm bound (pure functions).

Modules of this package import each other by full module path, never through this ``__init__``.
"""

from hivemind_ext.averaging.allreduce.api import AllreduceConfig, AllreduceResult, PartOutcome, RoundHooks
from hivemind_ext.averaging.allreduce.service import AllreduceService

__all__ = ["AllreduceConfig", "AllreduceResult", "AllreduceService", "PartOutcome", "RoundHooks"]
