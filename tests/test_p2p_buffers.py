"""Reused receive buffers (framing.ReceiveBuffers) and the direct stream's bounded read-ahead."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from test_p2p import async_test

from hivemind_ext.errors import MessageTooLargeError, ProtocolError
from hivemind_ext.p2p import Limits, framing, now
from hivemind_ext.p2p.direct_transport import (
    DEFAULT_LIMIT,
    STAGING_BYTES,
    DirectStream,
    open_direct_connection,
    start_direct_server,
)
from hivemind_ext.p2p.framing import FrameKind, ReceiveBuffers, encode_frame_head, read_frame

KB, MB = 1024, 1024 * 1024


def test_a_buffer_is_handed_out_again_only_once_nothing_references_it() -> None:
    pool = ReceiveBuffers(max_bytes=16 * MB, min_bytes=64 * KB)
    first = pool.take(MB)
    assert len(first) == MB and pool.take(MB) is not first  # still referenced here
    first_id = id(first)
    view = memoryview(first)
    del first
    assert id(pool.take(MB)) != first_id  # a memoryview still holds it
    del view
    reused = pool.take(MB)
    assert id(reused) == first_id
    alias = torch.frombuffer(reused, dtype=torch.uint8)[10:]  # a tensor aliasing it keeps it too
    del reused
    assert id(pool.take(MB)) != first_id
    del alias
    assert id(pool.take(MB)) == first_id
    assert pool.held_bytes == 2 * MB  # the buffers dropped at once were handed out again


def test_small_large_and_excess_buffers_are_not_pooled_and_idle_ones_are_evicted() -> None:
    pool = ReceiveBuffers(max_bytes=8 * MB, min_bytes=64 * KB)
    assert len(pool.take(KB)) == KB and len(pool.take(3 * MB)) == 3 * MB  # too small; over max_bytes / 4
    assert pool.held_bytes == 0
    kept = [pool.take(2 * MB) for _ in range(5)]  # the fifth does not fit: allocated, not pooled
    assert pool.held_bytes == 8 * MB and all(len(b) == 2 * MB for b in kept)
    del kept[1:]
    other = pool.take(MB)  # idle 2 MiB buffers make room for a new size
    assert len(other) == MB and pool.held_bytes <= 8 * MB
    pool.clear()
    assert pool.held_bytes == 0 and len(kept[0]) == 2 * MB  # buffers in use stay valid


def _frame(payload: bytes) -> bytes:
    return encode_frame_head(FrameKind.MESSAGE, {"n": len(payload)}, len(payload), Limits()) + payload


@async_test
async def test_reused_payload_buffers_carry_exactly_the_new_frame_and_limits_still_hold() -> None:
    size = 256 * KB
    framing.RECEIVE_BUFFERS.clear()
    first_payload, second_payload = os.urandom(size), os.urandom(size)
    reader = asyncio.StreamReader(limit=2 * MB)
    reader.feed_data(_frame(first_payload) + _frame(second_payload))
    first = await read_frame(reader, limits=Limits(), deadline=now() + 5)
    assert bytes(first.payload) == first_payload
    first_id = id(first.payload)
    del first
    second = await read_frame(reader, limits=Limits(), deadline=now() + 5)
    assert id(second.payload) == first_id and bytes(second.payload) == second_payload
    held = second  # referenced: the next frame gets another buffer
    reader.feed_data(_frame(first_payload)[: -size // 2])  # cut short: a typed error, no partial frame
    reader.feed_eof()
    with pytest.raises(ProtocolError):
        await read_frame(reader, limits=Limits(), deadline=now() + 5)
    assert bytes(held.payload) == second_payload  # the failed read did not write into a buffer in use
    oversized = asyncio.StreamReader()
    oversized.feed_data(_frame(b"x" * 300 * KB))
    with pytest.raises(MessageTooLargeError):
        await read_frame(oversized, limits=Limits(max_payload_bytes=256 * KB), deadline=now() + 5)


@async_test
async def test_direct_stream_reads_ahead_a_bounded_amount_and_delivers_the_rest_in_place() -> None:
    received: asyncio.Queue[object] = asyncio.Queue()
    payload = os.urandom(4 * MB)

    async def on_connection(reader: DirectStream, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.sleep(0.3)  # nobody reads: the stream must stop reading ahead, not buffer 4 MiB
            buffered = reader.buffered
            head = await reader.readexactly(16)
            rest = bytearray(len(payload) - 16)
            await reader.readexactly_into(memoryview(rest))
            await received.put((buffered, head + rest))
        finally:
            writer.close()

    server = await start_direct_server(on_connection, "127.0.0.1", 0)
    try:
        _, writer = await open_direct_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        writer.write(payload)
        await writer.drain()
        buffered, data = await asyncio.wait_for(received.get(), 10)
        assert buffered <= DEFAULT_LIMIT + STAGING_BYTES
        assert data == payload
        writer.close()
    finally:
        server.close()
