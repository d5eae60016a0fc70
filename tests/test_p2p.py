"""hivemind_ext.p2p against real libp2p daemons on 127.0.0.1, plus unit tests of its pure parts.

Every asyncio test runs in its own event loop (``async_test``) with its own pair of daemons
(starting one takes a fraction of a second). Hostile peers are simulated by opening raw binary
streams through the daemon and writing bytes by hand, the way a malicious peer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import random
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import msgpack
import pytest
import torch
from hivemind.p2p import P2P, PeerID
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from swarm import USE_UVLOOP, new_peer

from hivemind_ext.compression import CompressedTensor, Float16Compression, decompress
from hivemind_ext.errors import (
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    MessageTooLargeError,
    PeerUnreachableError,
    ProtocolError,
    RemoteError,
)
from hivemind_ext.p2p import (
    HandlerConfig,
    Limits,
    Message,
    RPCClient,
    RPCContext,
    RPCServer,
    TaskOwner,
    pack_tensor,
    protocol_name,
    unpack_tensor,
)
from hivemind_ext.p2p import deadlines as deadlines_module
from hivemind_ext.p2p.deadlines import now, resolve_deadline, wait_until
from hivemind_ext.p2p.framing import (
    MAGIC,
    PREFIX,
    VERSION,
    Frame,
    FrameKind,
    decode_prefix,
    encode_frame_head,
    open_header,
    read_frame,
)
from hivemind_ext.p2p.idle import IdleStreamError, StalledWriteError

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NAMESPACE = "test"
P2P_PACKAGE_DIR = os.path.dirname(deadlines_module.__file__)


def async_test(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Runs an async test function in a fresh event loop (pytest-asyncio is not a dependency)."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        if USE_UVLOOP:
            import uvloop

            uvloop.run(test(*args, **kwargs))
        else:
            asyncio.run(test(*args, **kwargs))

    return run


# ----- helpers: daemons, a served namespace, task accounting, raw (hostile) streams


@dataclasses.dataclass
class Peers:
    server_p2p: P2P
    client_p2p: P2P
    server: RPCServer
    client: RPCClient
    calls: dict[str, int]  # how many times each test handler was entered

    @property
    def peer(self) -> PeerID:
        return self.server_p2p.peer_id

    async def honest_call_works(self) -> None:
        response = await self.client.call(self.peer, "echo", Message({"ok": 1}, b"still serving"), timeout=10)
        assert response.header["ok"] == 1 and bytes(response.payload) == b"still serving"


def p2p_layer_tasks() -> list[asyncio.Task[Any]]:
    """Tasks (other than the current one) running code of hivemind_ext.p2p anywhere in their await chain."""
    found = []
    for task in asyncio.all_tasks():
        if task is asyncio.current_task():
            continue
        awaitable: Any = task.get_coro()
        while awaitable is not None:
            code = getattr(awaitable, "cr_code", None) or getattr(awaitable, "ag_code", None)
            if code is not None and code.co_filename.startswith(P2P_PACKAGE_DIR):
                found.append(task)
                break
            awaitable = getattr(awaitable, "cr_await", None) or getattr(awaitable, "ag_await", None)
    return found


async def wait_for_no_p2p_tasks(timeout: float = 5.0) -> None:
    give_up = time.monotonic() + timeout
    while p2p_layer_tasks() and time.monotonic() < give_up:
        await asyncio.sleep(0.02)
    assert not p2p_layer_tasks(), f"tasks left behind: {p2p_layer_tasks()}"


@contextlib.asynccontextmanager
async def served(config: HandlerConfig | None = None, client_limits: Limits | None = None) -> AsyncIterator[Peers]:
    """Two daemons; on the first, an RPCServer with a few standard handlers; on the second, a client."""
    server_p2p = await P2P.create(host_maddrs=LOOPBACK)
    try:
        client_p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=await server_p2p.get_visible_maddrs())
        try:
            server = RPCServer(server_p2p, NAMESPACE, config=config)
            calls: dict[str, int] = {}
            peers = Peers(server_p2p, client_p2p, server, RPCClient(client_p2p, NAMESPACE, limits=client_limits), calls)

            async def echo(request: Message, context: RPCContext) -> Message:
                calls["echo"] = calls.get("echo", 0) + 1
                return Message(request.header, request.payload)

            async def echo_stream(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
                calls["echo_stream"] = calls.get("echo_stream", 0) + 1
                async for request in requests:
                    yield Message(request.header, request.payload)

            await server.add_unary("echo", echo)
            await server.add_stream("echo_stream", echo_stream)
            try:
                yield peers
            finally:
                await server.shutdown()
                await wait_for_no_p2p_tasks()
        finally:
            await client_p2p.shutdown()
    finally:
        await server_p2p.shutdown()


def frame_bytes(kind: FrameKind, header: Any, payload: bytes = b"") -> bytes:
    packed = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, VERSION, kind, len(packed), len(payload)) + packed + payload


def open_frame(timeout: float = 5.0) -> bytes:
    return frame_bytes(FrameKind.OPEN, open_header(timeout))


async def raw_exchange(peers: Peers, name: str, data: bytes, *, wait: float = 5.0) -> list[Frame] | None:
    """Writes ``data`` on a raw stream to handler ``name``; returns the frames the server answered
    until it closed the stream, or None if it closed without a word. Fails if it takes longer than ``wait``."""
    _, reader, writer = await peers.client_p2p.call_binary_stream_handler(peers.peer, protocol_name(NAMESPACE, name))
    frames: list[Frame] = []
    try:
        writer.write(data)
        give_up = now() + wait
        while True:
            try:
                frames.append(await read_frame(reader, limits=Limits(), deadline=give_up))
            except PeerUnreachableError:
                return frames or None
            if frames[-1].kind in (FrameKind.ERROR, FrameKind.END):
                return frames
    finally:
        writer.close()


# ----- unary calls


@pytest.mark.timeout(30)
@async_test
async def test_unary_round_trip_with_payload_and_rich_header() -> None:
    async with served() as peers:
        payload = os.urandom(3 * 1024 * 1024 + 17)  # not a multiple of any chunk size
        header = {"step": 7, "name": "grad", "ids": [1, 2, 3], "raw": b"\x00\xff", "nested": {"f": 0.5, "n": None}}
        response = await peers.client.call(peers.peer, "echo", Message(header, payload), timeout=10)
        assert bytes(response.payload) == payload
        assert response.header == header
        assert isinstance(response.payload, bytearray)  # receiver-owned, writable memory
        empty = await peers.client.call(peers.peer, "echo", Message({"empty": True}), timeout=10)
        assert empty.header == {"empty": True} and len(empty.payload) == 0


@pytest.mark.timeout(30)
@async_test
async def test_handler_sees_the_callers_peer_id_and_deadline() -> None:
    async with served() as peers:
        seen: list[RPCContext] = []

        async def whoami(request: Message, context: RPCContext) -> Message:
            seen.append(context)
            return Message({"peer": context.peer_id.to_bytes(), "left": context.time_left()})

        await peers.server.add_unary("whoami", whoami)
        response = await peers.client.call(peers.peer, "whoami", Message(), timeout=7)
        assert PeerID(response.header["peer"]) == peers.client_p2p.peer_id
        assert seen[0].peer_id == peers.client_p2p.peer_id and seen[0].handler == "whoami"
        assert 5 < response.header["left"] <= 7  # the caller's timeout, as seen by the server


@pytest.mark.timeout(30)
@async_test
async def test_compressed_tensor_travels_as_one_message() -> None:
    async with served() as peers:
        tensor = torch.randn(257, 33)
        message = pack_tensor(Float16Compression().compress(tensor), part=3)
        response = await peers.client.call(peers.peer, "echo", message, timeout=10)
        assert response.header["part"] == 3
        received = unpack_tensor(response, CompressedTensor)
        assert received.writable  # decoded tensors may alias the received buffer without a copy
        torch.testing.assert_close(decompress(received), tensor.half().float(), rtol=0, atol=0)
        with pytest.raises(ProtocolError):
            unpack_tensor(Message({"part": 3}, b""), CompressedTensor)


# ----- streaming calls


@pytest.mark.timeout(30)
@async_test
async def test_stream_interleaves_requests_and_responses() -> None:
    async with served() as peers:
        async with await peers.client.open_stream(peers.peer, "echo_stream", timeout=10) as stream:
            for i in range(10):  # each response arrives before the next request is sent
                await stream.send(Message({"i": i}, bytes([i]) * (i * 1000)))
                response = await stream.receive()
                assert response is not None and response.header == {"i": i}
                assert bytes(response.payload) == bytes([i]) * (i * 1000)
            await stream.end()
            assert await stream.receive() is None
            assert await stream.receive() is None


@pytest.mark.timeout(60)
@async_test
async def test_stream_moves_bulk_data_in_both_directions_at_once() -> None:
    # 32 MB each way, echoed frame by frame: more than the daemons and sockets buffer (a caller that
    # sends everything before reading stalls after ~20 MB), so this deadlocks unless both directions flow at once.
    async with served() as peers:
        chunks = [os.urandom(1024 * 1024) for _ in range(4)]
        requests = (Message({"i": i}, chunks[i % 4]) for i in range(32))
        received = 0
        async with peers.client.stream(peers.peer, "echo_stream", requests, timeout=40) as responses:
            async for response in responses:
                assert bytes(response.payload) == chunks[response.header["i"] % 4]
                assert response.header["i"] == received
                received += 1
        assert received == 32


@pytest.mark.timeout(30)
@async_test
async def test_stream_handler_may_answer_without_reading_every_request() -> None:
    async with served() as peers:

        async def first_only(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
            async for request in requests:
                yield Message({"first": request.header["i"]})
                return

        await peers.server.add_stream("first_only", first_only)
        requests = [Message({"i": i}, b"x" * 1000) for i in range(50)]
        async with peers.client.stream(peers.peer, "first_only", requests, timeout=10) as responses:
            assert [r.header async for r in responses] == [{"first": 0}]
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_failing_request_iterator_fails_the_call_with_its_own_error() -> None:
    async with served() as peers:

        def requests() -> Any:
            yield Message({"i": 0})
            raise ValueError("the caller's data source broke")

        with pytest.raises(ValueError, match="data source broke"):
            async with peers.client.stream(peers.peer, "echo_stream", requests(), timeout=10) as responses:
                async for _ in responses:
                    pass
        await peers.honest_call_works()


# ----- errors raised by handlers


@pytest.mark.timeout(30)
@async_test
async def test_handler_exceptions_arrive_as_remote_error_without_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async with served() as peers:
        secret = "local-variable-value-1234"

        async def broken(request: Message, context: RPCContext) -> Message:
            local_state = secret  # noqa: F841 - a local that must not leak to the caller
            raise KeyError("no such part")

        async def broken_midway(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
            async for request in requests:
                if request.header["i"] == 2:
                    raise RuntimeError("reducer crashed")
                yield request

        async def wrong_type(request: Message, context: RPCContext) -> Any:
            return {"not": "a Message"}

        await peers.server.add_unary("broken", broken)
        await peers.server.add_stream("broken_midway", broken_midway)
        await peers.server.add_unary("wrong_type", wrong_type)
        with caplog.at_level(logging.CRITICAL):  # the server logs handler failures; not the point here
            with pytest.raises(RemoteError, match="KeyError") as info:
                await peers.client.call(peers.peer, "broken", Message(), timeout=10)
            assert "no such part" in str(info.value)
            assert "Traceback" not in str(info.value) and secret not in str(info.value)

            received = []
            with pytest.raises(RemoteError, match="RuntimeError: reducer crashed"):
                requests = [Message({"i": i}) for i in range(5)]
                async with peers.client.stream(peers.peer, "broken_midway", requests, timeout=10) as responses:
                    async for response in responses:
                        received.append(response.header["i"])
            assert received == [0, 1]

            with pytest.raises(RemoteError, match="TypeError"):
                await peers.client.call(peers.peer, "wrong_type", Message(), timeout=10)
        await peers.honest_call_works()


# ----- deadlines


@pytest.mark.timeout(30)
@async_test
async def test_call_to_a_sleeping_handler_fails_at_its_deadline() -> None:
    async with served() as peers:
        handler_cancelled = asyncio.Event()

        async def sleepy(request: Message, context: RPCContext) -> Message:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                handler_cancelled.set()
                raise
            return Message()

        await peers.server.add_unary("sleepy", sleepy)
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError):
            await peers.client.call(peers.peer, "sleepy", Message(), timeout=0.5)
        assert 0.45 <= time.monotonic() - start < 1.5  # the deadline, not the handler's 60 s
        await asyncio.wait_for(handler_cancelled.wait(), 2)  # the server gave up too, not after 60 s
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_server_enforces_its_own_max_timeout() -> None:
    async with served(config=HandlerConfig(max_timeout=0.5)) as peers:

        async def sleepy(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
            await asyncio.sleep(60)
            yield Message()

        await peers.server.add_stream("sleepy", sleepy)
        start = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="deadline"):  # reported by the server's ERROR frame
            async with await peers.client.open_stream(peers.peer, "sleepy", timeout=20) as stream:
                await stream.receive()
        assert 0.45 <= time.monotonic() - start < 2.0


@pytest.mark.timeout(30)
@async_test
async def test_stream_operations_respect_their_own_timeouts() -> None:
    async with served() as peers:

        async def silent(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
            async for _ in requests:
                pass
            yield Message()

        await peers.server.add_stream("silent", silent)
        async with await peers.client.open_stream(peers.peer, "silent", timeout=20) as stream:
            start = time.monotonic()
            with pytest.raises(DeadlineExceededError):
                await stream.receive(timeout=0.3)
            assert 0.25 <= time.monotonic() - start < 1.5
            with pytest.raises(ClosedError):  # an interrupted operation closes the stream
                await stream.send(Message())
        await peers.honest_call_works()


@pytest.mark.timeout(60)
@async_test
async def test_idle_timeouts_cut_streams_that_stop_moving_long_before_their_deadline() -> None:
    """``idle_timeout`` bounds silence, not duration: a response that does not start, or a request
    that the server stops taking, fails after the idle window though the deadline is far away."""
    big = 64 * 1024 * 1024
    async with served(HandlerConfig(limits=Limits(max_payload_bytes=2 * big), max_timeout=60.0)) as peers:

        async def stuck(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
            await requests.receive()  # takes the first request, then neither reads nor answers
            await asyncio.sleep(3600)
            yield Message()

        await peers.server.add_stream("stuck", stuck)
        async with await peers.client.open_stream(peers.peer, "stuck", timeout=30) as stream:
            await stream.send(Message({"first": 1}))
            start = time.monotonic()
            with pytest.raises(IdleStreamError):
                await stream.receive(idle_timeout=0.5)
            assert 0.4 <= time.monotonic() - start < 3.0
        async with await peers.client.open_stream(peers.peer, "stuck", timeout=30) as stream:
            await stream.send(Message({"first": 1}))
            start = time.monotonic()
            with pytest.raises(StalledWriteError):  # more than every buffer on the way holds
                await stream.send(Message({}, bytearray(big)), idle_timeout=1.0)
            assert time.monotonic() - start < 20.0
        async with await peers.client.open_stream(peers.peer, "echo_stream", timeout=30) as stream:
            for index in range(3):  # a stream that keeps moving is never cut by the idle window
                await stream.send(Message({"i": index}, bytearray(4 * 1024 * 1024)), idle_timeout=1.0)
                response = await stream.receive(idle_timeout=1.0)
                assert response is not None and response.header == {"i": index}
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_connecting_to_an_unknown_peer_respects_the_deadline() -> None:
    async with served() as peers:
        gone = await P2P.create(host_maddrs=LOOPBACK)  # a valid peer id that no daemon can reach
        stranger = gone.peer_id
        await gone.shutdown()
        start = time.monotonic()
        with pytest.raises((DeadlineExceededError, PeerUnreachableError)):
            await peers.client.call(stranger, "echo", Message(), timeout=1.0)
        assert time.monotonic() - start < 2.5
        await peers.honest_call_works()


# ----- size limits


@pytest.mark.timeout(30)
@async_test
async def test_sender_refuses_oversized_messages_before_connecting() -> None:
    async with served(client_limits=Limits(max_header_bytes=1024, max_payload_bytes=64 * 1024)) as peers:
        with pytest.raises(MessageTooLargeError, match="payload"):
            await peers.client.call(peers.peer, "echo", Message({}, bytes(64 * 1024 + 1)), timeout=5)
        with pytest.raises(MessageTooLargeError, match="header"):
            await peers.client.call(peers.peer, "echo", Message({"big": "x" * 2000}), timeout=5)
        with pytest.raises(ProtocolError, match="msgpack"):
            await peers.client.call(peers.peer, "echo", Message({"obj": object()}), timeout=5)
        async with await peers.client.open_stream(peers.peer, "echo_stream", timeout=5) as stream:
            with pytest.raises(MessageTooLargeError):
                await stream.send(Message({}, bytes(64 * 1024 + 1)))
            await stream.send(Message({"after": 1}))  # a refused message leaves the stream usable
            assert (await stream.receive()).header == {"after": 1}
            await stream.end()
        assert peers.calls == {"echo_stream": 1}  # the unary handler never ran
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_receiver_refuses_oversized_messages_before_allocating() -> None:
    small = HandlerConfig(limits=Limits(max_payload_bytes=1024 * 1024))
    async with served(config=small, client_limits=Limits(max_payload_bytes=64 * 1024 * 1024)) as peers:
        for size in (1024 * 1024 + 1, 32 * 1024 * 1024):  # the large one is still being written when refused
            with pytest.raises(MessageTooLargeError):
                await peers.client.call(peers.peer, "echo", Message({}, bytes(size)), timeout=10)
        # a declared length no machine could allocate: answered with an error, not a MemoryError
        frames = await raw_exchange(peers, "echo", open_frame() + PREFIX.pack(MAGIC, VERSION, 2, 1, 2**62) + b"\x80")
        assert frames is not None and frames[-1].kind is FrameKind.ERROR and frames[-1].header["kind"] == "too_large"
        assert "echo" not in peers.calls
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_caller_refuses_oversized_or_garbage_responses() -> None:
    async with served() as peers:
        replies = {
            "huge": PREFIX.pack(MAGIC, VERSION, FrameKind.MESSAGE, 1, 2**62) + b"\x80",
            "garbage": b"HTTP/1.1 200 OK\r\n\r\n" + os.urandom(100),
            "bad_error": frame_bytes(FrameKind.ERROR, {"kind": 5, "message": ["?"]}),
        }

        def evil_handler(reply: bytes) -> Callable[..., Awaitable[None]]:
            async def handler(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                try:
                    writer.write(reply)
                    await writer.drain()
                    await asyncio.sleep(30)  # and never close: the caller must not wait for that
                finally:
                    writer.close()

            return handler

        for name, reply in replies.items():
            await peers.server_p2p.add_binary_stream_handler(protocol_name(NAMESPACE, name), evil_handler(reply))
        await peers.server_p2p.add_binary_stream_handler(protocol_name(NAMESPACE, "mute"), evil_handler(b""))
        start = time.monotonic()
        with pytest.raises(MessageTooLargeError):
            await peers.client.call(peers.peer, "huge", Message(), timeout=10)
        with pytest.raises(ProtocolError, match="magic"):
            await peers.client.call(peers.peer, "garbage", Message(), timeout=10)
        with pytest.raises(RemoteError):
            await peers.client.call(peers.peer, "bad_error", Message(), timeout=10)
        assert time.monotonic() - start < 3
        with pytest.raises(DeadlineExceededError):
            await peers.client.call(peers.peer, "mute", Message(), timeout=0.5)


# ----- hostile callers


def _declared(kind: int, header_nbytes: int, payload_nbytes: int) -> bytes:
    return PREFIX.pack(MAGIC, VERSION, kind, header_nbytes, payload_nbytes)


HOSTILE_INPUTS: dict[str, tuple[str, bytes, str | None]] = {
    # name: (handler, bytes written, expected error kind; None = any error frame or a closed stream)
    "http request": ("echo", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", "protocol"),
    "bad version": ("echo", struct.pack("<2sBBIQ", MAGIC, 99, 1, 1, 0) + b"\x80", "protocol"),
    "unknown frame kind": ("echo", _declared(77, 1, 0) + b"\x80", "protocol"),
    "empty header": ("echo", _declared(FrameKind.OPEN, 0, 0), "protocol"),
    "huge header length": ("echo", _declared(FrameKind.OPEN, 2**32 - 1, 0), "too_large"),
    "bad msgpack": ("echo", _declared(FrameKind.OPEN, 1, 0) + b"\xc1", "protocol"),
    "header not a map": ("echo", frame_bytes(FrameKind.OPEN, [1, 2, 3]), "protocol"),
    "msgpack ext type": ("echo", frame_bytes(FrameKind.OPEN, {"t": msgpack.ExtType(5, b"x")}), "protocol"),
    "no OPEN first": ("echo", frame_bytes(FrameKind.MESSAGE, {}), "protocol"),
    "timeout not a number": ("echo", frame_bytes(FrameKind.OPEN, {"timeout": "soon"}), "protocol"),
    "negative timeout": ("echo", frame_bytes(FrameKind.OPEN, {"timeout": -1.0}), "protocol"),
    "NaN timeout": ("echo", frame_bytes(FrameKind.OPEN, {"timeout": math.nan}), "protocol"),
    "END instead of a request": ("echo", open_frame() + frame_bytes(FrameKind.END, {}), "protocol"),
    "ERROR from the caller": ("echo", open_frame() + frame_bytes(FrameKind.ERROR, {"kind": "x"}), "protocol"),
    "second OPEN in a stream": ("echo_stream", open_frame() + open_frame(), "protocol"),
    "garbage mid-stream": (
        "echo_stream",
        open_frame() + frame_bytes(FrameKind.MESSAGE, {"i": 0}, b"ok") + b"\x00" * 40,
        "protocol",
    ),
    "truncated payload, then silence": (
        "echo",
        open_frame(timeout=0.5) + _declared(FrameKind.MESSAGE, 1, 1000) + b"\x80" + b"x" * 10,
        "deadline",
    ),
    "silence": ("echo", b"", "deadline"),  # HandlerConfig.open_timeout below
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(HOSTILE_INPUTS))
@async_test
async def test_malformed_input_gets_a_typed_error_and_the_server_carries_on(case: str) -> None:
    handler, data, expected_kind = HOSTILE_INPUTS[case]
    async with served(config=HandlerConfig(open_timeout=0.5)) as peers:
        start = time.monotonic()
        frames = await raw_exchange(peers, handler, data)
        assert time.monotonic() - start < 3.0  # the server never waits past its deadlines
        assert frames is not None, "the server closed the stream without saying why"
        error = frames[-1]
        assert error.kind is FrameKind.ERROR, frames
        assert error.header["kind"] == expected_kind, error.header
        assert isinstance(error.header["message"], str) and "Traceback" not in error.header["message"]
        assert "echo" not in peers.calls  # a malformed unary request never reaches the handler
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_callers_that_hang_up_mid_frame_do_not_hurt_the_server() -> None:
    async with served() as peers:
        truncated = [
            b"h",  # inside the prefix
            open_frame()[:20],  # inside the OPEN header
            open_frame() + _declared(FrameKind.MESSAGE, 1, 10**6) + b"\x80" + os.urandom(5000),  # inside a payload
            open_frame() + frame_bytes(FrameKind.MESSAGE, {"i": 0}, b"a"),  # a whole request, then gone
        ]
        for handler in ("echo", "echo_stream"):
            for data in truncated:
                _, _, writer = await peers.client_p2p.call_binary_stream_handler(
                    peers.peer, protocol_name(NAMESPACE, handler)
                )
                writer.write(data)
                await writer.drain()
                writer.close()
        await wait_for_no_p2p_tasks()  # every call ended, none hangs until a deadline
        await peers.honest_call_works()


@pytest.mark.timeout(60)
@async_test
async def test_random_bytes_never_break_the_server() -> None:
    rng = random.Random(1234)
    async with served(config=HandlerConfig(open_timeout=1.0)) as peers:
        for i in range(25):
            data = rng.randbytes(rng.randrange(1, 300))
            if i % 2:  # reach past the magic check into the rest of the parser
                data = MAGIC + bytes([VERSION]) + data
            frames = await raw_exchange(peers, rng.choice(["echo", "echo_stream"]), data, wait=3)
            assert frames is None or frames[-1].kind is FrameKind.ERROR
        await peers.honest_call_works()


# ----- cancellation and shutdown


@pytest.mark.timeout(30)
@async_test
async def test_cancelling_a_call_stops_the_handler_and_leaves_the_server_usable() -> None:
    async with served() as peers:
        entered, cancelled = asyncio.Event(), asyncio.Event()

        async def slow(request: Message, context: RPCContext) -> Message:
            entered.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise
            return Message()

        async def slow_stream(requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
            try:
                async for request in requests:
                    yield request
            finally:
                cancelled.set()

        await peers.server.add_unary("slow", slow)
        await peers.server.add_stream("slow_stream", slow_stream)
        call = asyncio.create_task(peers.client.call(peers.peer, "slow", Message(), timeout=60))
        await asyncio.wait_for(entered.wait(), 5)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(cancelled.wait(), 3)  # the hang-up reached the server's handler

        cancelled.clear()
        streaming = asyncio.Event()

        async def consume() -> None:
            async with await peers.client.open_stream(peers.peer, "slow_stream", timeout=60) as stream:
                await stream.send(Message({"i": 0}))
                await stream.receive()
                streaming.set()
                await stream.receive()  # never answered: cancelled here

        consumer = asyncio.create_task(consume())
        await asyncio.wait_for(streaming.wait(), 5)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer
        await asyncio.wait_for(cancelled.wait(), 3)
        await wait_for_no_p2p_tasks()
        await peers.honest_call_works()


@pytest.mark.timeout(30)
@async_test
async def test_shutdown_stops_calls_in_progress_and_leaves_no_tasks() -> None:
    async with served() as peers:
        entered = asyncio.Event()

        async def forever(request: Message, context: RPCContext) -> Message:
            entered.set()
            await asyncio.sleep(60)
            return Message()

        await peers.server.add_unary("forever", forever)
        calls = [asyncio.create_task(peers.client.call(peers.peer, "forever", Message(), timeout=30)) for _ in range(3)]
        stream = await peers.client.open_stream(peers.peer, "echo_stream", timeout=30)
        await stream.send(Message({"i": 0}))
        assert (await stream.receive()).header == {"i": 0}
        await asyncio.wait_for(entered.wait(), 5)
        give_up = time.monotonic() + 5
        while peers.server.active_calls < 4 and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        assert peers.server.active_calls == 4

        start = time.monotonic()
        await peers.server.shutdown()
        assert peers.server.active_calls == 0 and peers.server.handlers == ()
        for call in calls:
            with pytest.raises(PeerUnreachableError):  # "unavailable" from the server, or a closed stream
                await call
        with pytest.raises(PeerUnreachableError):
            await stream.receive()
        await stream.aclose()
        assert time.monotonic() - start < 3
        await wait_for_no_p2p_tasks()
        with pytest.raises(PeerUnreachableError):  # the daemon no longer routes the protocol
            await peers.client.call(peers.peer, "echo", Message(), timeout=5)
        with pytest.raises(ClosedError):
            await peers.server.add_unary("late", forever)
        await peers.server.shutdown()  # idempotent


@pytest.mark.timeout(30)
@async_test
async def test_calls_beyond_the_concurrency_limit_are_refused_at_once() -> None:
    async with served(config=HandlerConfig(max_concurrent_calls=2)) as peers:
        release = asyncio.Event()

        async def held(request: Message, context: RPCContext) -> Message:
            await release.wait()
            return Message({"done": True})

        await peers.server.add_unary("held", held)
        first = [asyncio.create_task(peers.client.call(peers.peer, "held", Message(), timeout=20)) for _ in range(2)]
        give_up = time.monotonic() + 5
        while peers.server.active_calls < 2 and time.monotonic() < give_up:
            await asyncio.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(PeerUnreachableError, match="unavailable"):
            await peers.client.call(peers.peer, "held", Message(), timeout=20)
        assert time.monotonic() - start < 2
        release.set()
        assert [(await call).header for call in first] == [{"done": True}] * 2
        await peers.honest_call_works()  # the limit is per handler, and counts only calls in progress


@pytest.mark.timeout(60)
@async_test
async def test_server_on_a_dht_replica_of_the_daemon() -> None:
    dht = new_peer()
    try:
        server_p2p = await dht.replicate_p2p()
        client_p2p = await P2P.create(host_maddrs=LOOPBACK, initial_peers=dht.get_visible_maddrs())
        try:
            async with RPCServer(server_p2p, NAMESPACE) as server:

                async def ping(request: Message, context: RPCContext) -> Message:
                    return Message({"pong": request.header["ping"]})

                await server.add_unary("ping", ping)
                client = RPCClient(client_p2p, NAMESPACE)
                response = await client.call(dht.peer_id, "ping", Message({"ping": 5}), timeout=10)
                assert response.header == {"pong": 5}
        finally:
            await client_p2p.shutdown()
            await server_p2p.shutdown()  # the replica's own connection; the DHT's daemon stays up
    finally:
        dht.shutdown()


@pytest.mark.timeout(30)
@async_test
async def test_registration_is_validated() -> None:
    async with served() as peers:
        with pytest.raises(ConfigurationError):
            await peers.server.add_unary("echo", lambda request, context: request)  # already registered
        with pytest.raises(ConfigurationError):
            await peers.server.add_unary("has space", lambda request, context: request)
        with pytest.raises(ConfigurationError):
            RPCServer(peers.server_p2p, "")
        with pytest.raises(ConfigurationError):
            HandlerConfig(max_timeout=math.inf)
        with pytest.raises(ConfigurationError):
            await peers.client.call(peers.peer, "echo", Message(), timeout=-1)
        await peers.server.remove("echo_stream")
        assert peers.server.handlers == ("echo",)
        with pytest.raises(ConfigurationError):
            await peers.server.remove("echo_stream")


# ----- pure parts: framing, deadlines, task ownership (no daemons)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200), with_magic=st.booleans())
def test_frame_reader_fails_only_with_typed_errors(data: bytes, with_magic: bool) -> None:
    if with_magic:
        data = MAGIC + bytes([VERSION]) + data
    limits = Limits(max_header_bytes=64, max_payload_bytes=64)

    async def read_all() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        while True:
            frame = await read_frame(reader, limits=limits, deadline=now() + 5)
            assert isinstance(frame.header, dict) and len(frame.payload) <= 64

    with pytest.raises((ProtocolError, PeerUnreachableError)):
        asyncio.run(read_all())


header_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(header=st.dictionaries(st.text(max_size=10), header_values, max_size=6), payload=st.binary(max_size=5000))
def test_frames_round_trip(header: dict[str, Any], payload: bytes) -> None:
    async def round_trip() -> Frame:
        reader = asyncio.StreamReader()
        head = encode_frame_head(FrameKind.MESSAGE, header, len(payload), Limits())
        reader.feed_data(head + payload)
        return await read_frame(reader, limits=Limits(), deadline=now() + 5)

    frame = asyncio.run(round_trip())
    assert frame.kind is FrameKind.MESSAGE and frame.header == header and bytes(frame.payload) == payload


def test_declared_sizes_are_checked_against_limits() -> None:
    limits = Limits(max_header_bytes=10, max_payload_bytes=100)
    assert decode_prefix(_declared(FrameKind.MESSAGE, 10, 100), limits) == (FrameKind.MESSAGE, 10, 100)
    with pytest.raises(MessageTooLargeError):
        decode_prefix(_declared(FrameKind.MESSAGE, 11, 0), limits)
    with pytest.raises(MessageTooLargeError):
        decode_prefix(_declared(FrameKind.MESSAGE, 1, 101), limits)
    with pytest.raises(MessageTooLargeError):
        encode_frame_head(FrameKind.MESSAGE, {}, 101, limits)
    with pytest.raises(ConfigurationError):
        Limits(max_payload_bytes=-1)
    with pytest.raises(ConfigurationError):
        Limits(max_header_bytes=0)
    with pytest.raises(ConfigurationError):
        HandlerConfig(answer_limits={"max_header_bytes": 10})  # type: ignore[arg-type]


@async_test
async def test_resolve_deadline_takes_the_earliest_bound() -> None:
    start = now()
    assert resolve_deadline(None, None, 5.0) == pytest.approx(start + 5.0, abs=0.1)
    assert resolve_deadline(1.0, start + 10, 5.0) == pytest.approx(start + 1.0, abs=0.1)
    assert resolve_deadline(10.0, start + 2, 5.0) == pytest.approx(start + 2, abs=0.1)
    for bad in (-1.0, math.nan, "1"):
        with pytest.raises(ConfigurationError):
            resolve_deadline(bad, None, 5.0)  # type: ignore[arg-type]


@pytest.mark.parametrize("native_timeout", [True, False], ids=["timeout_at", "wait_for (3.10 path)"])
@async_test
async def test_wait_until_raises_deadline_exceeded_but_propagates_cancellation(
    native_timeout: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if native_timeout and not hasattr(asyncio, "timeout_at"):
        pytest.skip("asyncio.timeout_at needs Python 3.11")
    monkeypatch.setattr(deadlines_module, "_HAS_TIMEOUT_AT", native_timeout)
    assert await wait_until(asyncio.sleep(0, result=3), now() + 1, "quick") == 3
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="slow"):
        await wait_until(asyncio.sleep(10), now() + 0.1, "slow")
    assert time.monotonic() - start < 0.5
    with pytest.raises(DeadlineExceededError, match="before the wait"):
        await wait_until(asyncio.sleep(10), now() - 1, "late")
    with pytest.raises(DeadlineExceededError, match="inner"):  # the nested, earlier deadline names itself
        await wait_until(wait_until(asyncio.sleep(10), now() + 0.05, "inner"), now() + 5, "outer")
    with pytest.raises(TimeoutError) as info:  # a TimeoutError raised by the work itself is not a deadline
        await wait_until(_raise(TimeoutError("os-level")), now() + 5, "work")
    assert not isinstance(info.value, DeadlineExceededError)

    waiter = asyncio.create_task(wait_until(asyncio.sleep(10), now() + 5, "cancelled"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def _raise(error: BaseException) -> None:
    raise error


@async_test
async def test_task_owner_cancels_and_awaits_everything_it_owns(caplog: pytest.LogCaptureFixture) -> None:
    finished: list[str] = []

    async def worker(name: str) -> None:
        try:
            await asyncio.sleep(60)
        finally:
            finished.append(name)

    async def failing() -> None:
        raise ValueError("boom")

    owner = TaskOwner("test")
    tasks = [owner.spawn(worker(f"w{i}")) for i in range(3)]
    with caplog.at_level(logging.ERROR, logger="hivemind_ext.p2p.tasks"):
        owner.spawn(failing(), name="failing")
        await asyncio.sleep(0.01)
    assert "failing" in caplog.text  # a failed background task is reported, not lost
    assert len(owner) == 3
    await owner.aclose()
    assert sorted(finished) == ["w0", "w1", "w2"] and all(task.cancelled() for task in tasks)
    assert len(owner) == 0
    with pytest.raises(ClosedError):
        owner.spawn(worker("late"))
    await owner.aclose()  # idempotent

    async def closes_its_own_owner(owner: TaskOwner) -> str:
        await owner.aclose()  # must not cancel (or wait for) itself
        return "done"

    async with TaskOwner("self") as owner:
        assert await owner.spawn(closes_its_own_owner(owner)) == "done"


@async_test
async def test_task_owner_close_is_bounded_even_if_a_task_ignores_cancellation() -> None:
    async def stubborn() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(60)  # swallows the first cancellation: a bug, but not ours to hang on

    owner = TaskOwner("stubborn")
    task = owner.spawn(stubborn(), name="stubborn-task")
    await asyncio.sleep(0.01)
    start = time.monotonic()
    with pytest.raises(DeadlineExceededError, match="stubborn-task"):
        await owner.aclose(timeout=0.2)
    assert time.monotonic() - start < 1.0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
