"""Builders shared by the matchmaking tests: peers, declarations and boards without a network."""

from __future__ import annotations

from hivemind_ext.averaging.matchmaking.group import Board, Declaration, MatchmakingConfig, Member

_BASE58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"  # in ASCII order


def peer(index: int) -> str:
    """A valid base58 peer id whose string order is the order of ``index``."""
    digits = []
    for _ in range(6):
        index, digit = divmod(index, 58)
        digits.append(_BASE58[digit])
    return "12D3KooW" + "".join(reversed(digits))


def member(index: int, *, attempt: int = 0, client_mode: bool = False, auxiliary: bool = False) -> Member:
    return Member(peer(index), f"{index:08x}{attempt:08x}", 1.0, client_mode, auxiliary)


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
