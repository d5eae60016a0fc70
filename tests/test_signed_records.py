"""Signed records everywhere (issue 12, item 5): an attacker that holds a valid key of its own tries to
overwrite, forge or impersonate other peers' donor records, matchmaking declarations and group
records, on a real swarm on 127.0.0.1. Each attack is tried in the form that works on unsigned
records (a plain subkey, or the victim's subkey with a later expiration) and in the form that signed
records still allow (a record under the attacker's own key that claims the victim's peer id)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator, Sequence

import hivemind
import pytest
import torch
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time
from hivemind.utils.crypto import RSAPrivateKey
from swarm import local_swarm, wait_for

from hivemind_ext.averaging.matchmaking.board import board_key, declaration_write, sealed_write
from hivemind_ext.averaging.matchmaking.group import Declaration, GroupInfo, MatchmakingConfig, Member, SealedGroup
from hivemind_ext.averaging.matchmaking.group import group_id_for as make_group_id
from hivemind_ext.averaging.matchmaking.matchmaker import Matchmaker
from hivemind_ext.averaging.state_sharing import LoadedState, StateDonor, StateLoader, StateSharingConfig
from hivemind_ext.averaging.state_sharing.records import donor_subkey, donors_key
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.signing import (
    CachingSignatureValidator,
    OwnedRecordsValidator,
    OwnerBook,
    default_signing_key,
    install_signing,
    owner_marker,
    signed_subkey,
    split_signed_subkey,
)

pytestmark = pytest.mark.slow

HONEST, ATTACKER, JOINER = (0, 1, 2), 3, 4
HOUR = 3600.0


@pytest.fixture(scope="module")
def swarm() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(5) as dhts:
        yield dhts


def attacker_key(dht: hivemind.DHT) -> bytes:
    """The attacker's DHT signs with its own valid key; returns that key's owner marker."""
    key = default_signing_key(dht)
    dht.add_validators([RSASignatureValidator(key)])
    return owner_marker(key)


def store(dht: hivemind.DHT, key: str, value: object, expiration: float, subkey: object) -> bool:
    """Whether a node took the record (hivemind raises on a plain subkey among signed (bytes) ones: refused)."""
    try:
        return bool(dht.store(key, value, expiration, subkey=subkey))
    except TypeError:
        return False


# ----- (a) donor records


def _donor_attack(dht: hivemind.DHT, prefix: str, victim: str, owner: bytes) -> list[bool]:
    """Everything an attacker can try to make the joiner skip ``victim``: "not accepting", for an hour."""
    refusal, until = {"version": 0, "accepts": False}, get_dht_time() + HOUR
    return [
        store(dht, donors_key(prefix), refusal, until, donor_subkey(victim, owner)),  # impersonation
        store(dht, donors_key(prefix), refusal, until, victim.encode()),
        store(dht, donors_key(prefix), refusal, until, victim),  # the plain subkey: what worked before signing
    ]


async def _until_loaded(loader: StateLoader, timeout: float = 30.0) -> LoadedState:
    """The state, once a donor is visible (load_state returns None while no donor is advertised)."""
    give_up = time.monotonic() + timeout
    while True:
        loaded = await loader.load_state(timeout=max(1.0, give_up - time.monotonic()))
        if loaded is not None:
            return loaded
        assert time.monotonic() < give_up, "no donor found"
        await asyncio.sleep(0.2)


@pytest.mark.timeout(120)
def test_a_donor_record_cannot_be_overwritten_and_the_joiner_catches_up(swarm: list[hivemind.DHT]) -> None:
    prefix = f"signed-{secrets.token_hex(4)}"
    config = StateSharingConfig(prefix=prefix, declare_state_period=2.0, dht_timeout=5.0)
    state = ({"epoch": 17}, [torch.arange(1000, dtype=torch.float32)])
    owner = attacker_key(swarm[ATTACKER])

    async def scenario() -> tuple[int, dict[str, int], list[bool]]:
        donor_p2p, joiner_p2p = await swarm[0].replicate_p2p(), await swarm[JOINER].replicate_p2p()
        donor = StateDonor(config, dht=swarm[0], p2p=donor_p2p, get_state=lambda: state, version=17)
        await donor.start()
        try:
            victim = donor_p2p.peer_id.to_base58()
            await _until_loaded(StateLoader(config, dht=swarm[JOINER], p2p=joiner_p2p))  # before the attack
            stored = await asyncio.to_thread(_donor_attack, swarm[ATTACKER], prefix, victim, owner)
            await asyncio.sleep(2 * config.declare_state_period)  # the donor refreshes; the forgeries outlive it
            joiner = StateLoader(config, dht=swarm[JOINER], p2p=joiner_p2p)  # a fresh joiner: no history
            loaded = await _until_loaded(joiner)
            return loaded.version, loaded.chunks_by_donor, stored
        finally:
            await donor.shutdown()

    version, chunks_by_donor, stored = asyncio.run(scenario())
    assert version == 17 and set(chunks_by_donor) == {swarm[0].peer_id.to_base58()}
    # Unsigned entries are refused by the nodes that protect the key (the donor's and the joiner's; the
    # others may hold them, and the reader skips them); under its own key the attacker may publish.
    assert stored[0]


# ----- matchmaking


def _matchmakers(swarm: Sequence[hivemind.DHT], prefix: str, **overrides: object) -> list[Matchmaker]:
    values: dict = dict(prefix=prefix, target_group_size=3, min_group_size=2, min_matchmaking_time=30.0)
    values.update(overrides)
    return [Matchmaker(MatchmakingConfig(**values), dht=swarm[i]) for i in HONEST]


async def _look(matchmakers: Sequence[Matchmaker], timeout: float) -> list[GroupInfo]:
    deadline = get_dht_time() + timeout
    return list(await asyncio.gather(*(m.look_for_group(deadline=deadline) for m in matchmakers)))


def _assert_one_honest_group(groups: Sequence[GroupInfo], swarm: Sequence[hivemind.DHT]) -> None:
    assert len({(g.group_id, g.members) for g in groups}) == 1, groups  # every member returned the same group
    assert {m.peer_id for m in groups[0].members} == {swarm[i].peer_id.to_base58() for i in HONEST}


def _read_raw(dht: hivemind.DHT, key: str) -> dict:
    found = dht.get(key, latest=True)
    return dict(found.value) if found is not None and isinstance(found.value, dict) else {}


@pytest.mark.timeout(120)
def test_b_a_declaration_claiming_another_peer_is_ignored(swarm: list[hivemind.DHT]) -> None:
    prefix = f"signed-{secrets.token_hex(4)}"
    owner = attacker_key(swarm[ATTACKER])
    matchmakers = _matchmakers(swarm, prefix)
    _assert_one_honest_group(asyncio.run(_look(matchmakers, 30)), swarm)  # the peers have met once

    victim = swarm[HONEST[1]].peer_id.to_base58()
    now = get_dht_time()
    fake = Member(victim, secrets.token_hex(8))
    impersonating = signed_subkey(f"d/{victim}/{fake.attempt}", victim, owner)
    # the most senior declaration, refreshed last: the one a reader would plan with for this peer id
    forged = declaration_write(Declaration(fake, prefix, now - HOUR, now - HOUR, now + HOUR, now + HOUR))
    stored = [
        store(swarm[ATTACKER], board_key(prefix), forged.value, now + HOUR, impersonating),
        store(swarm[ATTACKER], board_key(prefix), forged.value, now + HOUR, forged.subkey),
    ]
    assert stored[0]  # under its own key: valid, and ignored by readers that know the victim's key
    groups = asyncio.run(_look(matchmakers, 30))
    _assert_one_honest_group(groups, swarm)
    assert fake not in groups[0].members
    assert all(m.owners.rejected > 0 for m in matchmakers)  # the forgery was seen, and skipped


@pytest.mark.timeout(120)
def test_c_a_forged_or_overwritten_seal_does_not_break_the_honest_group(swarm: list[hivemind.DHT]) -> None:
    """Peers that wait for their scheduled time leave the attacker time to read their declarations and
    seal them first: as the group's real leader (its group id is predictable, its seal is overwritten
    with one that has already closed) and as a group of its own under the leader's name."""
    prefix = f"signed-{secrets.token_hex(4)}"
    owner = attacker_key(swarm[ATTACKER])
    matchmakers = _matchmakers(swarm, prefix, target_group_size=None, min_matchmaking_time=3.0)

    def attack() -> list[bool]:
        declared: dict[str, Member] = {}

        def everyone_declared() -> bool:
            for subkey, item in _read_raw(swarm[ATTACKER], board_key(prefix)).items():
                value = item.value
                if isinstance(value, dict) and value.get("state") == "looking":
                    peer_id, attempt = split_signed_subkey(subkey).tag.split("/")[1:]
                    declared[peer_id] = Member(peer_id, attempt, value["bandwidth"], False, False)
            return len(declared) == len(HONEST)

        wait_for(everyone_declared, timeout=20, message="the honest declarations")
        members = tuple(sorted(declared.values(), key=lambda m: m.key))
        leader, now = members[0].peer_id, get_dht_time()
        closed = sealed_write(SealedGroup(make_group_id(members), members, now - 1.0), now + HOUR)
        stored = []
        for subkey in (signed_subkey(closed.subkey, leader, owner), closed.subkey):
            stored.append(store(swarm[ATTACKER], board_key(prefix), closed.value, now + HOUR, subkey))
        return stored

    async def scenario() -> tuple[list[GroupInfo], list[bool]]:
        looking = asyncio.ensure_future(_look(matchmakers, 30))
        stored = await asyncio.to_thread(attack)
        return await looking, stored

    groups, stored = asyncio.run(scenario())
    assert stored[0]
    _assert_one_honest_group(groups, swarm)


# ----- (d) the validators


@pytest.mark.timeout(60)
def test_d_unsigned_and_foreign_signed_entries_are_refused(swarm: list[hivemind.DHT]) -> None:
    prefix = f"signed-{secrets.token_hex(4)}"
    keys = (board_key(prefix), donors_key(prefix))

    async def protect(dht: hivemind.DHT) -> bytes:
        return await install_signing(DHTCalls(dht), default_signing_key(dht), protected_keys=keys, timeout=10)

    owners = [asyncio.run(protect(dht)) for dht in swarm]
    victim, attacker = swarm[0].peer_id.to_base58(), swarm[ATTACKER]
    until = get_dht_time() + 60
    for key in keys:
        assert not store(attacker, key, {"x": 1}, until, "d/plain")  # no owner: signed by nobody
        assert not store(attacker, key, {"x": 1}, until, signed_subkey("d/x", victim, owners[0]))  # not its key
        assert store(swarm[0], key, {"x": 1}, until, signed_subkey("d/x", victim, owners[0]))  # the owner's own
    validator = OwnedRecordsValidator(keys)
    for subkey, valid in ((b"d/plain", False), ("d/plain", False), (signed_subkey("d/x", victim, owners[0]), True)):
        record = DHTRecord(
            DHTID.generate(source=keys[0]).to_bytes(), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(1), 0.0
        )
        assert validator.validate(record) is valid


def test_owner_book_pins_the_first_lone_key_and_refuses_the_others() -> None:
    book = OwnerBook(own=("me", b"[owner:mine]"), pin_seconds=100.0)
    assert book.resolve([("me", b"[owner:forger]"), ("x", b"[owner:x]")], 0.0) == {
        "me": b"[owner:mine]",  # nobody speaks for this peer but its own key
        "x": b"[owner:x]",
    }
    assert book.resolve([("x", b"[owner:x]"), ("x", b"[owner:forger]")], 1.0) == {"x": b"[owner:x]"}
    assert book.resolve([("x", b"[owner:forger]")], 2.0) == {"x": b"[owner:x]"}  # the pin holds: forger refused
    assert book.resolve([("y", b"[owner:y]"), ("y", b"[owner:forger]")], 3.0) == {"y": None}  # disputed
    assert book.disputed == 1
    assert book.resolve([("x", b"[owner:new]")], 2.0 + 100.0 + 1e-3) == {"x": b"[owner:new]"}  # an old pin lapses


def test_a_key_signs_only_under_its_own_owner_subkey() -> None:
    key = RSAPrivateKey()
    validator = RSASignatureValidator(key)
    own = DHTRecord(b"k", MSGPackSerializer.dumps(signed_subkey("t", "p", owner_marker(key))), b"\x01", 1.0)
    other = DHTRecord(
        b"k", MSGPackSerializer.dumps(signed_subkey("t", "p", owner_marker(RSAPrivateKey()))), b"\x01", 1.0
    )
    assert RSASignatureValidator().validate(DHTRecord(own.key, own.subkey, validator.sign_value(own), 1.0))
    assert validator.sign_value(other) == other.value  # unsigned: every node refuses it
    assert not RSASignatureValidator().validate(other)


def test_the_caching_validator_answers_a_known_record_without_copying_it(monkeypatch) -> None:
    """A DHT node validates every record of a board on every read; a record it verified before is
    answered from the cache by a digest of its fields, which used to be taken through
    dataclasses.astuple (a deep copy of every field: half the cost of a cache hit). Any changed
    field is still a new record, verified afresh."""
    import copy

    key = RSAPrivateKey()
    signer = CachingSignatureValidator(key)
    unsigned = DHTRecord(b"k", MSGPackSerializer.dumps(signed_subkey("t", "p", owner_marker(key))), b"\x01", 5.0)
    record = DHTRecord(unsigned.key, unsigned.subkey, signer.sign_value(unsigned), 5.0)
    validator = CachingSignatureValidator()
    assert validator.validate(record)
    copies = []
    original = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda *args, **kwargs: copies.append(1) or original(*args, **kwargs))
    assert validator.validate(record)
    assert copies == []
    tampered = record.value.replace(b"\x01", b"\x02", 1)
    for changed in (
        DHTRecord(b"j", record.subkey, record.value, 5.0),
        DHTRecord(record.key, record.subkey, tampered, 5.0),
        DHTRecord(record.key, record.subkey, record.value, 6.0),
    ):
        assert not validator.validate(changed)
    assert validator.validate(record)
