"""A TCP proxy on 127.0.0.1 that can record and alter what passes: the seam for on-path attackers.

A test points a peer's advertised direct-path port (``DirectConfig(advertise_port=proxy.port)``)
at the proxy and the proxy at the peer's real port, so callers' connections pass through it.
``flip_at=N`` flips one byte at offset N of the caller-to-server bytes of each connection that gets
that far (an attacker altering ciphertext in flight); ``captured`` keeps every caller-to-server
byte (what an eavesdropper sees).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator


class TcpProxy:
    def __init__(self, *, flip_at: int | None = None, record: bool = False) -> None:
        self.flip_at, self.record = flip_at, record
        self.target_port: int | None = None  # set once the server behind it listens
        self.captured = bytearray()
        self.flipped = 0  # connections altered so far
        self.connections = 0  # accepted so far
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        try:
            if self.target_port is None:
                return
            upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
            try:
                await asyncio.gather(
                    self._pump(reader, upstream_writer, True), self._pump(upstream_reader, writer, False)
                )
            finally:
                upstream_writer.close()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            self._tasks.discard(task)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        offset = 0
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                if upstream and self.record:
                    self.captured += data
                if upstream and self.flip_at is not None and offset <= self.flip_at < offset + len(data):
                    changed = bytearray(data)
                    changed[self.flip_at - offset] ^= 0xFF
                    data, self.flipped = bytes(changed), self.flipped + 1
                offset += len(data)
                writer.write(data)
                await writer.drain()
            writer.write_eof()


@contextlib.contextmanager
def proxy_in_thread(target_port: int) -> Iterator[TcpProxy]:
    """A TcpProxy to ``target_port`` on an event loop of its own (for tests whose peers run their own loops)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="tcp-proxy", daemon=True)
    thread.start()
    try:
        proxy = asyncio.run_coroutine_threadsafe(TcpProxy().start(), loop).result(5)
        proxy.target_port = target_port
        try:
            yield proxy
        finally:
            asyncio.run_coroutine_threadsafe(proxy.close(), loop).result(5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
