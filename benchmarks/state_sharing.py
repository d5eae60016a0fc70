"""State download time for a late joiner: hivemind_ext's StateLoader next to hivemind's
``DecentralizedAverager.load_state_from_peers``, in the same run.

Peers on 127.0.0.1, each with its own DHT and libp2p daemon: one or two donors hold a state of one
float32 tensor (default 16M values = 64 MiB) and a newcomer downloads it. hivemind's newcomer always
downloads from one donor; ours spreads the download over every donor of the newest version, so the
two-donor case shows that on its own line (on one machine the donors share its CPUs, so expect
little gain here: the spread pays off when each donor's uplink is the bottleneck). A download is
timed from the call until the tensors are in the newcomer's memory; the benchmark prints the
median over the repeats (after one warm-up that also takes the donor's first snapshot) and the
ratio to hivemind.

    python benchmarks/state_sharing.py
    python benchmarks/state_sharing.py --size 64M --repeats 5 --codecs none float16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import hivemind
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, emit, lower_is_better, start

SIZES = {"1M": 2**20, "4M": 2**22, "16M": 2**24, "64M": 2**26}
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TIMEOUT = 120.0


def start_dhts(count: int) -> list[hivemind.DHT]:
    first = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    peers = [str(maddr) for maddr in first.get_visible_maddrs()]
    return [first] + [hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=peers) for _ in range(count - 1)]


def time_hivemind(dhts: list[hivemind.DHT], tensor: torch.Tensor, codec: str, repeats: int) -> list[float]:
    """hivemind's newcomer downloading from its donor (``dhts`` = [donor, newcomer])."""
    import hivemind.compression as compression
    from hivemind.averaging import DecentralizedAverager

    state_compression = compression.NoCompression() if codec == "none" else compression.Float16Compression()
    prefix = f"bench_hivemind_{codec}"
    donor = DecentralizedAverager(
        [tensor], dhts[0], prefix=prefix, start=True, target_group_size=2, state_compression=state_compression
    )
    newcomer = DecentralizedAverager(
        [torch.zeros_like(tensor)], dhts[-1], prefix=prefix, start=True, target_group_size=2
    )
    try:
        time.sleep(2.0)  # the donor declares itself in the background
        times = []
        for attempt in range(repeats + 1):
            started = time.perf_counter()
            loaded = newcomer.load_state_from_peers(timeout=TIMEOUT)
            elapsed = time.perf_counter() - started
            if loaded is None or loaded[1][0].shape != tensor.shape:
                raise RuntimeError("hivemind's newcomer did not get the state")
            if attempt:  # the first one is a warm-up
                times.append(elapsed)
        return times
    finally:
        newcomer.shutdown()
        donor.shutdown()


async def time_ours(
    dhts: list[hivemind.DHT], p2ps: list[Any], tensor: torch.Tensor, codec: str, donors: int, repeats: int
) -> list[float]:
    from hivemind_ext.averaging.state_sharing import StateDonor, StateLoader, StateSharingConfig
    from hivemind_ext.compression import Float16Compression, NoCompression

    config = StateSharingConfig(
        prefix=f"bench_ours_{codec}_{donors}",
        load_state_compression=NoCompression() if codec == "none" else Float16Compression(),
    )
    serving = [
        StateDonor(config, dht=dhts[i], p2p=p2ps[i], get_state=lambda: ({"step": 1}, [tensor]), version=1)
        for i in range(donors)
    ]
    for donor in serving:
        await donor.start()
    try:
        await asyncio.sleep(1.0)
        loader = StateLoader(config, dht=dhts[-1], p2p=p2ps[-1])
        times = []
        for attempt in range(repeats + 1):
            loaded = await loader.load_state(timeout=TIMEOUT)
            if loaded is None or loaded.tensors[0].shape != tensor.shape or len(loaded.chunks_by_donor) > donors:
                raise RuntimeError("our newcomer did not get the state")
            if attempt:
                times.append(loaded.seconds)
        return times
    finally:
        for donor in serving:
            await donor.shutdown()


class BackgroundLoop:
    """Our peers' event loop, in a thread: hivemind's averagers must be created in the main thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT * 10)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def compare(args: argparse.Namespace, tensor: torch.Tensor) -> list[Result]:
    """Each implementation gets its own DHTs, and ours one daemon replica per DHT for the whole run:
    with hivemind 1.1.12, handlers registered on a daemon after a replica that had handlers was shut
    down cannot be reached."""
    megabytes = tensor.nbytes / 2**20
    theirs_dhts, ours_dhts = start_dhts(2), start_dhts(3)  # [donor, newcomer], [donor, donor, newcomer]
    background = BackgroundLoop()
    results: list[Result] = []
    p2ps: list[Any] = []
    try:
        p2ps += [background.run(dht.replicate_p2p()) for dht in ours_dhts]
        for codec in args.codecs:
            theirs = statistics.median(time_hivemind(theirs_dhts, tensor, codec, args.repeats))
            for donors in (1, 2):
                ours = statistics.median(
                    background.run(time_ours(ours_dhts, p2ps, tensor, codec, donors, args.repeats))
                )
                case = f"{megabytes:.0f} MiB, {codec}, {donors} donor{'s' if donors > 1 else ''}"
                print(
                    f"{case:>28}: ours {ours:.3f} s ({megabytes / ours:.0f} MiB/s) | "
                    f"hivemind {theirs:.3f} s ({megabytes / theirs:.0f} MiB/s, 1 donor) | speedup {theirs / ours:.2f}x",
                    flush=True,
                )
                results.append(lower_is_better(case, "seconds", round(ours, 4), round(theirs, 4)))
    finally:
        for p2p in p2ps:
            background.run(p2p.shutdown())
        background.stop()
        for dht in theirs_dhts + ours_dhts:
            dht.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="16M", help="float32 values in the state")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--codecs", nargs="+", choices=["none", "float16"], default=["none", "float16"])
    args = start(parser)
    tensor = torch.randn(SIZES[args.size])
    megabytes = tensor.nbytes / 2**20
    print(f"state: {megabytes:.0f} MiB of float32, {args.repeats} timed downloads after a warm-up")
    results = compare(args, tensor)
    emit("state_sharing", results)


if __name__ == "__main__":
    main()
