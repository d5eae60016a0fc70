"""A hostile outsider, run as its own process: keeps N streams open to a peer's all-reduce handler,
each a JOIN for a random group that does not exist, reopened as soon as it ends.

    python flood_client.py PEER_ID NAMESPACE STREAMS MULTIADDR...

Prints ``ready`` once every stream has been opened at least once, then floods until its stdin is
closed, and prints ``opened <count>`` before exiting. Its own process, so that the attacker's CPU is
not charged to the victim's event loop.
"""

from __future__ import annotations

import asyncio
import os
import sys

from hivemind.p2p import P2P, PeerID

from hivemind_ext.averaging.allreduce.wire import HANDLER_NAME, join_message
from hivemind_ext.errors import HivemindExtError
from hivemind_ext.p2p import RPCClient


async def flood(peer: PeerID, namespace: str, streams: int, maddrs: list[str]) -> None:
    attacker = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=maddrs)
    client = RPCClient(attacker, namespace)
    stop = asyncio.Event()
    opened = 0

    async def one_loop() -> None:
        nonlocal opened
        while not stop.is_set():
            join = join_message(os.urandom(16), b"\0" * 32, 1.0, b"", [])
            try:
                async with client.stream(peer, HANDLER_NAME, [join], timeout=10) as responses:
                    opened += 1
                    await responses.receive()
            except HivemindExtError:
                await asyncio.sleep(0)  # refused or broken: reopen at once

    loops = [asyncio.create_task(one_loop()) for _ in range(streams)]
    while opened < streams:
        await asyncio.sleep(0.02)
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the test closes stdin
    stop.set()
    await asyncio.wait_for(asyncio.gather(*loops), 30)
    print(f"opened {opened}", flush=True)
    await attacker.shutdown()


if __name__ == "__main__":
    asyncio.run(flood(PeerID.from_base58(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]))
