"""The DHT-process side of matchmaking's I/O: functions that run inside hivemind's DHT process
(through ``DHT.run_coroutine``) and return plain values across its pipe.

- :func:`store_then_read`: one poll, a store of the step's records and, if asked, a read of the
  board, both searching only the ``num_replicas`` nodes nearest to the board's key.
- :func:`store_direct`: a store nobody waits for, sent straight to the nodes where this node's last
  read of the board ended (:func:`watch_searches` remembers them), without a search.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from hivemind import DHT
from hivemind.dht import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import PeerID

from hivemind_ext.averaging.matchmaking.board import Write


async def store_then_read(
    key: str, writes: tuple[Write, ...], read: bool, all_replicas: bool, _dht: DHT, node: DHTNode
) -> tuple[bool, list[tuple[Any, Any, float]] | None]:
    """Runs inside the DHT process (see ``DHT.run_coroutine``): one store of all ``writes`` (one
    request per replica, which applies them in order: whoever sees the leader's marker also sees its
    group), then one ``get(latest=True)`` if ``read``. Returns plain values, as they cross a pipe.

    Both search only the ``num_replicas`` nearest nodes (see the module docstring); the store returns
    after the first replica took the writes unless ``all_replicas`` (the commit), and reports what
    that replica answered."""
    stored = True
    if writes:
        outcome = await node.store_many(
            [key] * len(writes),
            [write.value for write in writes],
            [write.expiration_time for write in writes],
            subkeys=[write.subkey for write in writes],
            await_all_replicas=all_replicas,
            await_all_tasks=all_replicas,
            beam_size=node.num_replicas,
        )
        stored = all(outcome.values())
    if not read:
        return stored, None
    watch_searches(node)
    found = await node.get(key, latest=True, beam_size=node.num_replicas)
    value = getattr(found, "value", None)  # None: nobody has written under the key yet
    entries = value.items() if isinstance(value, dict) else ()
    return stored, [(subkey, item.value, item.expiration_time) for subkey, item in entries]


NEAREST_TTL = 30.0  # seconds a read's nearest nodes stay good for the stores that skip the search
NEAREST_ATTR = "_hivemind_ext_nearest"  # where a watched node keeps what it remembers
# hivemind's DHTNode method (private to hivemind, 1.1.10-1.1.12) that every finished get hands its nearest nodes to
HIVEMIND_HOOK = "_cache_new_result"
_NEAREST_KEYS = 256  # keys remembered per DHT node (the oldest are forgotten)


def watch_searches(node: DHTNode) -> dict[Any, tuple[float, list[tuple[Any, PeerID]]]]:
    """Makes ``node`` remember, per key id, where its last search by ``get`` ended: the nodes nearest to
    the key (nearest first, with their peer ids) and when (loop clock). Installed once per node (in the
    DHT process), around hivemind's ``DHTNode._cache_new_result``, the one place a finished get's
    nearest nodes are handed to; a hivemind without it leaves nothing to remember, and every store
    then searches."""
    memory = getattr(node, NEAREST_ATTR, None)
    if memory is not None:
        return memory
    memory = {}
    setattr(node, NEAREST_ATTR, memory)
    original = getattr(node, HIVEMIND_HOOK, None)
    if original is None:
        return memory

    def remembering(*args: Any, **kwargs: Any) -> Any:
        try:  # hivemind 1.1.10-1.1.12 pass (search, nearest_nodes, node_to_peer_id, ...) by position
            search, nearest_nodes, node_to_peer_id = args[:3]
            nearest = [(node_id, node_to_peer_id[node_id]) for node_id in nearest_nodes if node_id in node_to_peer_id]
            memory.pop(search.key_id, None)
            memory[search.key_id] = (time.monotonic(), nearest)
            while len(memory) > _NEAREST_KEYS:
                memory.pop(next(iter(memory)))
        except Exception:  # never break hivemind's get
            pass
        return original(*args, **kwargs)  # whatever hivemind passes, unchanged

    setattr(node, HIVEMIND_HOOK, remembering)
    return memory


async def store_direct(key: str, writes: tuple[Write, ...], _dht: DHT, node: DHTNode) -> tuple[bool, None]:
    """Runs inside the DHT process: a store nobody waits for (:meth:`.Matchmaker._store_nowait`), sent
    straight to the ``num_replicas`` nodes nearest to the board's key, as this node's last read of the
    board found them (within ``NEAREST_TTL``), this node included where it is one of them: the very
    nodes a searching store would pick (``store_many`` takes the nearest of its search's result plus
    itself, and its search is the read's, with the same beam), so a later read, which asks those
    nodes, finds the records. It skips the search, whose every answer carries the whole board, which
    this process would validate record by record. Without a fresh read of the key, or if any replica
    does not answer, it stores through :func:`store_then_read` (a search) instead.

    Measured with benchmarks/scale.py's real 8 peers in one process (groups of 8, 4 KiB, 2 shared
    cores, 6 runs each, alternated): all-reduce 0.065-0.072 s (before: 0.083-0.218 s), Python CPU
    per peer and round 0.054-0.072 s (before: 0.053-0.079 s, median 0.067 against 0.055); the round
    trace's DHT requests served during the all-reduce went from 7-30 rpc_find to 0-7."""
    key_id = DHTID.generate(source=key)
    memory = getattr(node, NEAREST_ATTR, None) or {}
    known = memory.get(key_id)
    if not writes or known is None or time.monotonic() - known[0] > NEAREST_TTL:
        return await store_then_read(key, writes, False, False, _dht, node)
    candidates = [*known[1], (node.node_id, node.peer_id)]
    targets = sorted(dict(candidates).items(), key=lambda item: key_id.xor_distance(item[0]))[: node.num_replicas]
    protocol = node.protocol
    records = []
    for write in writes:
        record = DHTRecord(
            key_id.to_bytes(),
            protocol.serializer.dumps(write.subkey),
            protocol.serializer.dumps(write.value),
            write.expiration_time,
        )
        if protocol.record_validator is not None:
            record = dataclasses.replace(record, value=protocol.record_validator.sign_value(record))
        records.append(record)
    calls, local = [], True
    for node_id, peer_id in targets:
        if node_id == node.node_id:  # as store_many stores on itself
            for write, record in zip(writes, records, strict=True):
                if protocol.record_validator is None or protocol.record_validator.validate(record):
                    local = protocol.storage.store(key_id, record.value, record.expiration_time, subkey=write.subkey)
                else:
                    local = False
        else:
            calls.append(
                protocol.call_store(
                    peer_id,
                    keys=[key_id] * len(records),
                    values=[record.value for record in records],
                    expiration_time=[write.expiration_time for write in writes],
                    subkeys=[write.subkey for write in writes],
                )
            )
    answers = await asyncio.gather(*calls, return_exceptions=True)
    if any(answer is None or isinstance(answer, BaseException) for answer in answers):
        memory.pop(key_id, None)  # the nearest nodes changed: search again
        return await store_then_read(key, writes, False, False, _dht, node)
    return bool(local) and all(all(answer) for answer in answers), None
