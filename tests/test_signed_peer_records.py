"""Signed per-epoch state digests and neighbour registrations against a hostile writer.

Real DHTs on 127.0.0.1: an honest peer publishes through the library (:class:`DigestBoard`,
:class:`NeighbourRegistry`); a hostile peer with a DHT and an RSA key of its own writes raw
records next to it: unsigned entries under made-up peer ids, signed entries for several made-up
ids under its one key, a claim on the honest peer's id under its key, and a forged overwrite of
the honest peer's own record. A reader must count the honest record and at most one hostile vote.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import hivemind
import pytest
import torch
from hivemind.utils import ValueWithExpiration, get_dht_time
from swarm import local_swarm, wait_for

from hivemind_ext.optim.algorithms.neighbours import NEIGHBOUR_TAG, NeighbourRegistry
from hivemind_ext.optim.state_digests import (
    DigestBoard,
    digest_key,
    digest_subkey,
    majority_digest,
    parse_digests,
    state_digest,
)
from hivemind_ext.p2p.runtime import PeerRuntime
from hivemind_ext.p2p.signing import OwnerBook, default_signing_key, owner_marker, signed_subkey

HONEST_STATE = ({"epoch": 1}, [torch.ones(3)])
FAKE = hashlib.sha256(b"a state nobody holds").digest()
MADE_UP = ["QmSybA1", "QmSybB2", "QmSybC3"]  # base58 peer ids nobody runs


@pytest.fixture(scope="module")
def pair() -> Iterator[list[hivemind.DHT]]:
    with local_swarm(2) as dhts:
        yield dhts


# ----- parsing (pure)


def _entry(digest: Any, expiration: float) -> ValueWithExpiration:
    return ValueWithExpiration(digest, expiration)


def test_one_vote_per_key_and_only_for_the_peer_it_speaks_for() -> None:
    now, later = 100.0, 200.0
    a, b, x = b"[owner:a]", b"[owner:b]", b"[owner:x]"
    real, other = state_digest(*HONEST_STATE), FAKE
    book = OwnerBook(own=("QmHonestA", a))
    entries = {
        digest_subkey("QmHonestA", a): _entry(real, later),
        digest_subkey("QmHonestB", b): _entry(real, later),
        digest_subkey("QmHonestA", x): _entry(other, later),  # another key claims A's id
        **{digest_subkey(peer, x): _entry(other, later) for peer in MADE_UP},  # one key, three ids
        **{peer: _entry(other, later) for peer in ("QmU1", "QmU2", "QmU3")},  # unsigned (the old format)
        signed_subkey("donor", "QmHonestC", b"[owner:c]"): _entry(other, later),  # another record kind
        digest_subkey("QmShort", b"[owner:s]"): _entry(b"\x00" * 31, later),  # not a sha256
        digest_subkey("QmMap", b"[owner:m]"): _entry({"digest": real}, later),  # not bytes
        b"digest@QmBad[owner:" + b"k" * 5000 + b"]": _entry(real, later),  # an oversized key marker
        digest_subkey("QmExp", b"[owner:e]"): _entry(other, now - 1),  # expired
    }
    found = parse_digests(ValueWithExpiration(entries, later), book, now)
    assert found["QmHonestA"] == real and found["QmHonestB"] == real
    assert sum(digest == other for digest in found.values()) == 1  # key x: one vote, for a made-up id
    assert majority_digest(found) == real
    # A's claim by x, x's other ids, unsigned, donor, short, not bytes, oversized, expired
    assert book.rejected == 1 + 2 + 3 + 1 + 1 + 1 + 1 + 1


# ----- the DHT: a hostile writer next to an honest board


def _board(dht: hivemind.DHT, prefix: str, state: Any, diverged: list[int]) -> DigestBoard:
    return DigestBoard(dht, prefix, dht.peer_id.to_base58(), take_state=lambda: state, on_diverged=diverged.append)


@pytest.mark.timeout(90)
def test_a_hostile_writer_cannot_outvote_or_overwrite_an_honest_digest(pair: list[hivemind.DHT]) -> None:
    honest_dht, hostile_dht = pair
    prefix, diverged, hostile_diverged = "digests-hostile", [], []
    honest = _board(honest_dht, prefix, HONEST_STATE, diverged)
    hostile = _board(hostile_dht, prefix, ({"epoch": 1}, [torch.zeros(3)]), hostile_diverged)
    try:
        honest.after_epoch(1).result(30)
        hostile.after_epoch(1).result(30)  # its own signed vote, and a DHT that signs with its key
        key, expires = digest_key(prefix, 1), get_dht_time() + 300
        honest_id, hostile_owner = honest_dht.peer_id.to_base58(), owner_marker(default_signing_key(hostile_dht))
        for peer in MADE_UP:  # unsigned votes under made-up ids: enough for a majority if they counted
            hostile_dht.store(key, FAKE, expires, subkey=peer)
            hostile_dht.store(key, FAKE, expires, subkey=digest_subkey(peer, hostile_owner))  # one key, many ids
        hostile_dht.store(key, FAKE, expires, subkey=digest_subkey(honest_id, hostile_owner))  # claims A's id
        honest_subkey = digest_subkey(honest_id, owner_marker(default_signing_key(honest_dht)))
        assert not hostile_dht.store(key, FAKE, expires + 60, subkey=honest_subkey)  # forged: it cannot sign for A

        honest.after_epoch(2).result(30)  # compares epoch 1 with the others' digests
        seen = parse_digests(honest_dht.get(key, latest=True), honest.book, get_dht_time())
        assert seen[honest_id] == state_digest(*HONEST_STATE), "the honest record was overwritten"
        assert sum(digest != seen[honest_id] for digest in seen.values()) == 1, seen  # one hostile vote
        assert diverged == [] and honest.divergences == 0  # 1 against 1: no majority, no resync
        assert honest.book.rejected >= 4
    finally:
        honest.shutdown()
        hostile.shutdown()


@pytest.mark.timeout(90)
def test_neighbour_registrations_list_each_key_once_and_no_unsigned_entry(pair: list[hivemind.DHT]) -> None:
    hostile_dht = pair[1]
    key = "registry-hostile.decsgd_peers"
    with contextlib.ExitStack() as stack:
        runtimes = [PeerRuntime.acquire(dht) for dht in pair]
        stack.callback(lambda: [runtime.release() for runtime in runtimes])
        registries = [
            NeighbourRegistry(runtime, key, dht.peer_id.to_base58(), signing_key=default_signing_key(dht))
            for runtime, dht in zip(runtimes, pair, strict=True)
        ]
        for registry in registries:
            registry.register(force=True)
        honest_id, hostile_id = (dht.peer_id.to_base58() for dht in pair)
        hostile_owner, expires = owner_marker(default_signing_key(hostile_dht)), get_dht_time() + 30
        for peer in MADE_UP:
            hostile_dht.store(key, get_dht_time(), expires, subkey=peer)  # unsigned
            hostile_dht.store(key, get_dht_time(), expires, subkey=signed_subkey(NEIGHBOUR_TAG, peer, hostile_owner))
        wait_for(lambda: hostile_id in registries[0].live_peers(), 15, message="the honest peer to list the other")
        assert registries[0].live_peers() == [hostile_id]  # its made-up ids are not listed: one key, one entry
        assert registries[0].rejected >= 3
        assert registries[1].live_peers() == [honest_id]
