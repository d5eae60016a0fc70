"""Builders shared by the matchmaking tests: peers, declarations and boards without a network."""

from __future__ import annotations

from hivemind_ext.averaging.matchmaking.group import Board, Declaration, MatchmakingConfig, Member
from hivemind_ext.averaging.matchmaking.simulation import simulated_member
from hivemind_ext.averaging.matchmaking.simulation import simulated_peer_id as peer

__all__ = ["board_of", "config", "declaration", "member", "peer"]


def member(index: int, *, attempt: int = 0, client_mode: bool = False, auxiliary: bool = False) -> Member:
    return simulated_member(index, attempt=attempt, bandwidth=1.0, client_mode=client_mode, auxiliary=auxiliary)


def declaration(
    index: int,
    *,
    declared_at: float | None = None,
    ready_at: float = 100.0,
    deadline: float = 1000.0,
    expiration: float = 500.0,
    prefix: str = "run",
    attempt: int = 0,
    client_mode: bool = False,
    auxiliary: bool = False,
) -> Declaration:
    """Peer ``index``, by default declared at time ``index`` (so lower indices are more senior)."""
    return Declaration(
        member(index, attempt=attempt, client_mode=client_mode, auxiliary=auxiliary),
        prefix,
        declared_at=float(index) if declared_at is None else declared_at,
        ready_at=ready_at,
        deadline=deadline,
        expiration=expiration,
    )


def board_of(*declarations: Declaration, **records) -> Board:
    return Board(declarations={d.member.key: d for d in declarations}, **records)


def config(**overrides) -> MatchmakingConfig:
    values = dict(prefix="run", target_group_size=4, min_group_size=2, min_matchmaking_time=5.0, request_timeout=1.0)
    values.update(overrides)
    return MatchmakingConfig(**values)
