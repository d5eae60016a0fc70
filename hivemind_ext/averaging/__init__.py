"""Averaging: matchmaking on the DHT, fault-tolerant butterfly all-reduce, state sharing, and the
DecentralizedAverager that ties them together (see DESIGN.md)."""

from hivemind_ext.averaging.allreduce import AllreduceConfig, AllreduceResult, AllreduceService
from hivemind_ext.averaging.averager import DecentralizedAverager, RoundReport
from hivemind_ext.averaging.control import AveragingStage, StepControl
from hivemind_ext.averaging.group import GroupInfo, Member
from hivemind_ext.averaging.matchmaking import Matchmaker, MatchmakingConfig

__all__ = [
    "AllreduceConfig",
    "AllreduceResult",
    "AllreduceService",
    "AveragingStage",
    "DecentralizedAverager",
    "GroupInfo",
    "Matchmaker",
    "MatchmakingConfig",
    "Member",
    "RoundReport",
    "StepControl",
]
