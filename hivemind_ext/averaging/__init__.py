"""Averaging: matchmaking on the DHT, fault-tolerant butterfly all-reduce, state sharing, and the
DecentralizedAverager that ties them together (see DESIGN.md).

Layout:

- :mod:`.averager`: :class:`DecentralizedAverager`, hivemind's averager API over the three subsystems;
- :mod:`.control`: :class:`StepControl`, the handle on one averaging step running in the background;
- :mod:`.matchmaking`: who averages with whom (the DHT board, the pure grouping rule, the matchmaker);
- :mod:`.allreduce`: the butterfly all-reduce of one group round (layout, sender, owner, wire), and
  how owners aggregate (the weighted mean, or robust ones: :class:`CenteredClip`, :class:`TrimmedMean`);
- :mod:`.state_sharing`: state download for late joiners (donors, manifests, verified chunked download).
- :mod:`.tensor_layout`: the tensor layout both of them use (tensor and chunk specs, the chunker, the
  wire encoding of a tensor list);
- :mod:`.delta`: "snapshot, average, apply ``average - snapshot``", for every caller that averages
  copies while the live tensors keep changing.
"""

from hivemind_ext.averaging.allreduce.aggregators import Aggregator, CenteredClip, TrimmedMean, WeightedMean
from hivemind_ext.averaging.allreduce.service import AllreduceConfig, AllreduceResult, AllreduceService
from hivemind_ext.averaging.averager import DecentralizedAverager, RoundReport
from hivemind_ext.averaging.control import AveragingMode, AveragingStage, StepControl
from hivemind_ext.averaging.matchmaking.group import GroupInfo, Member
from hivemind_ext.averaging.matchmaking.matchmaker import Matchmaker, MatchmakingConfig

__all__ = [
    "Aggregator",
    "AllreduceConfig",
    "AllreduceResult",
    "AllreduceService",
    "AveragingMode",
    "AveragingStage",
    "CenteredClip",
    "DecentralizedAverager",
    "GroupInfo",
    "Matchmaker",
    "MatchmakingConfig",
    "Member",
    "RoundReport",
    "StepControl",
    "TrimmedMean",
    "WeightedMean",
]
