"""Matchmaking: peers that average under one prefix find each other in hivemind's DHT and agree on
groups (confirmed by one direct call to the group's leader where it serves them).

Which file does what:

- :mod:`.group`: the configuration, the records peers publish and the grouping rule, as pure
  functions of what the DHT returned and the clock (tested without a network);
- :mod:`.group_key`, :mod:`.rotation`: which peers meet at all (hivemind's group bits; rotating
  groups and sharded boards for large swarms, Moshpit averaging);
- :mod:`.board`: the records of one prefix as they lie in the DHT, and their strict parsing;
- :mod:`.lifetimes`: how long each record lives (as long as its group is being formed);
- :mod:`.protocol`: one peer's side of the protocol as a pure state machine;
- :mod:`.pace`: the protocol's poll interval, stretched to the time this peer's DHT reads take;
- :mod:`.matchmaker`: :class:`Matchmaker`, the thin I/O around the state machine (DHT reads and
  writes with deadlines);
- :mod:`.dht_store`: what the matchmaker runs inside the DHT process: a poll's store and read, and
  stores nobody waits for sent to the nodes of the last read, without a search;
- :mod:`.confirmation`: members confirm a sealed group by one libp2p call to its leader, whose
  answer is the commit (the DHT board is kept for discovery);
- :mod:`.simulation`: many peers running the state machine over a simulated lagging DHT (tests,
  ``benchmarks/scale.py``).

Modules of this package import each other by full module path, never through this ``__init__``.
"""

from hivemind_ext.averaging.matchmaking.group import GroupInfo, MatchmakingConfig, Member
from hivemind_ext.averaging.matchmaking.matchmaker import Matchmaker

__all__ = ["GroupInfo", "Matchmaker", "MatchmakingConfig", "Member"]
