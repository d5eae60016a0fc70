"""The matchmaking's stores that nobody waits for (``_store_direct``), against a fake DHT node: where
they go, and when they fall back to the searching store. The real-DHT tests are in
test_matchmaking_dht.py."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

from hivemind.dht.routing import DHTID
from hivemind.utils import MSGPackSerializer, get_dht_time

from hivemind_ext.averaging.matchmaking import dht_store as ds
from hivemind_ext.averaging.matchmaking.board import Write

KEY = "board-key"


class FakeStorage:
    def __init__(self) -> None:
        self.stored: list[Any] = []

    def store(self, key_id: Any, value: Any, expiration: float, subkey: Any = None) -> bool:
        self.stored.append(subkey)
        return True


class FakeProtocol:
    def __init__(self, answer: Any) -> None:
        self.serializer, self.record_validator, self.storage = MSGPackSerializer, None, FakeStorage()
        self.answer, self.stores = answer, []

    async def call_store(self, peer: Any, keys: Any, values: Any, expiration_time: Any, subkeys: Any) -> Any:
        self.stores.append((peer, list(subkeys)))
        return self.answer if self.answer is None else [self.answer] * len(keys)


def fake_node(answer: Any = True, num_replicas: int = 3) -> tuple[Any, list[DHTID]]:
    """A node with 5 other nodes it knows (``nearest``, nearest to KEY first), num_replicas 3."""
    key_id = DHTID.generate(source=KEY)
    ids = sorted((DHTID.generate() for _ in range(6)), key=key_id.xor_distance)
    me, others = ids[1], [ids[0], *ids[2:]]  # this node is the second nearest
    node = SimpleNamespace(node_id=me, peer_id="me", num_replicas=num_replicas, protocol=FakeProtocol(answer))
    return node, others


def remember(node: Any, others: list[DHTID], age: float = 0.0) -> None:
    key_id = DHTID.generate(source=KEY)
    memory = {key_id: (time.monotonic() - age, [(node_id, f"peer-{i}") for i, node_id in enumerate(others)])}
    setattr(node, ds.NEAREST_ATTR, memory)


def run_direct(node: Any, monkeypatch: Any) -> tuple[Any, list[Any]]:
    searched: list[Any] = []

    async def searching(key, writes, read, all_replicas, _dht, _node):
        searched.append(writes)
        return True, None

    monkeypatch.setattr(ds, "store_then_read", searching)
    write = Write("probe", {"x": 1}, get_dht_time() + 30)
    return asyncio.run(ds.store_direct(KEY, (write,), None, node)), searched


def test_it_stores_on_the_nearest_nodes_itself_included_without_a_search(monkeypatch) -> None:
    node, others = fake_node()
    remember(node, others)
    (stored, _), searched = run_direct(node, monkeypatch)
    assert stored and not searched
    # num_replicas 3: the nearest other node, this node itself, the next other node
    assert [peer for peer, _ in node.protocol.stores] == ["peer-0", "peer-1"]
    assert node.protocol.storage.stored == ["probe"]


def test_without_a_fresh_read_it_searches(monkeypatch) -> None:
    node, others = fake_node()
    (_, _), searched = run_direct(node, monkeypatch)  # never read
    assert len(searched) == 1 and not node.protocol.stores
    remember(node, others, age=ds.NEAREST_TTL + 1)  # read too long ago
    (_, _), searched = run_direct(node, monkeypatch)
    assert len(searched) == 1 and not node.protocol.stores


def test_a_replica_that_does_not_answer_makes_it_search_and_forget_the_nodes(monkeypatch) -> None:
    node, others = fake_node(answer=None)
    remember(node, others)
    (_, _), searched = run_direct(node, monkeypatch)
    assert len(searched) == 1
    assert DHTID.generate(source=KEY) not in getattr(node, ds.NEAREST_ATTR)


def test_watching_a_node_remembers_where_its_gets_ended() -> None:
    calls: list[Any] = []
    node = SimpleNamespace(**{ds.HIVEMIND_HOOK: lambda *args, **kwargs: calls.append(args)})
    memory = ds.watch_searches(node)
    assert ds.watch_searches(node) is memory  # installed once
    key_id, near = DHTID.generate(source=KEY), DHTID.generate()
    getattr(node, ds.HIVEMIND_HOOK)(SimpleNamespace(key_id=key_id), [near], {near: "peer"}, _is_refresh=False)
    assert len(calls) == 1 and memory[key_id][1] == [(near, "peer")]
