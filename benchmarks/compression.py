"""Compression throughput and error: hivemind_ext's codecs next to hivemind's, in the same run.

For float32 tensors of normal values, each codec's compress + decompress throughput (GB/s of input),
relative error ||x - x'|| / ||x|| and compression ratio (input bytes over message bytes, header
included; hivemind's: over its serialized protobuf message). On CPU, hivemind's codec of the same
name is measured on the same tensor in the same loop as ours: after a warm-up call of each, batches
of calls of one and of the other alternate (so that load from elsewhere on the machine hits both
alike) until each has run for at least --min-seconds and --min-calls times; the figure is the fastest
call (--statistic min, the default: load from elsewhere only ever slows a call down) or the median
one. Where hivemind has no such codec (or it fails, as its 8-bit codecs do under numpy 2), the output says so
and its figures are null.

On CUDA (``--device cuda``), each codec's on-device encode + decode is measured next to a
device-to-device copy of the same tensor, and so is the full round trip with the compressed bytes
crossing to host memory and back.

    python benchmarks/compression.py                      # CPU, 1M / 16M / 64M values
    python benchmarks/compression.py --sizes 1M 16M --codecs MinMaxUInt8 Float16Compression
    python benchmarks/compression.py --sizes 16M --codecs Float16Compression Float16OrMinMax16
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, emit, higher_is_better, lower_is_better, median_seconds, start

import hivemind_ext.compression as ours


@dataclass(frozen=True)
class Case:
    name: str  # our class name
    make_ours: Callable[[], ours.Codec]
    hivemind_name: str | None  # hivemind's class to compare with, None where it has no counterpart


CASES = [
    Case("NoCompression", ours.NoCompression, "NoCompression"),
    Case("Float16Compression", ours.Float16Compression, "Float16Compression"),
    # the all-reduce's codec where the user's is Float16Compression: same bytes, chosen per tensor
    Case("Float16OrMinMax16", ours.Float16OrMinMax16, "Float16Compression"),
    Case("ScaledFloat16Compression", ours.ScaledFloat16Compression, "ScaledFloat16Compression"),
    Case("BFloat16Compression", ours.BFloat16Compression, None),
    Case("Uniform8BitQuantization", lambda: ours.Uniform8BitQuantization(), "Uniform8BitQuantization"),
    Case("Quantile8BitQuantization", lambda: ours.Quantile8BitQuantization(), "Quantile8BitQuantization"),
    Case("BlockwiseQuantization", lambda: ours.BlockwiseQuantization(), "BlockwiseQuantization"),
    # hivemind has no per-chunk min-max codec; its uniform 8-bit codec is the closest one
    Case("MinMaxUInt8", lambda: ours.MinMaxUInt8(), "Uniform8BitQuantization"),
    Case("MinMaxUInt4", lambda: ours.MinMaxUInt4(), None),
    # top-2% per chunk of 4096 with 2-bit values, for pseudo-gradients under error feedback: its one-shot
    # error is large by design (what it drops is sent in later rounds); hivemind has no sparse codec
    Case("SparseTopK", lambda: ours.SparseTopK(), None),
]
SIZES = {"1M": 2**20, "16M": 2**24, "64M": 2**26}


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm((x - y.to(x.dtype)).double()) / torch.linalg.vector_norm(x.double()))


def seconds_per_call(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved_seconds(
    fns: list[Callable[[], object]],
    min_seconds: float,
    min_calls: int,
    statistic: Callable[[list[float]], float] = min,
    batch_seconds: float = 0.05,
) -> list[float]:
    """Seconds per call of each of ``fns`` (each already called once, as a warm-up): ``statistic``
    (min or statistics.median) of the times of its calls.

    Batches of about ``batch_seconds`` of calls of each function alternate until every function has
    run at least ``min_calls`` times and for at least ``min_seconds`` in all: machine noise then falls
    on all of them alike. The garbage collector is paused meanwhile (torch tensors are freed by
    reference counting).
    """
    times: list[list[float]] = [[] for _ in fns]
    gc.collect()
    gc.disable()
    try:
        while any(len(t) < min_calls or sum(t) < min_seconds for t in times):
            for fn, t in zip(fns, times, strict=True):  # all of them, to the end: the same conditions
                estimate = statistics.median(t) if t else seconds_per_call(fn)
                for _ in range(max(1, min(math.ceil(batch_seconds / max(estimate, 1e-6)), 1000))):
                    t.append(seconds_per_call(fn))
    finally:
        gc.enable()
    return [statistic(t) for t in times]


def ours_round_trip(codec: ours.Codec, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """compress -> header bytes + payload view -> from_wire -> decompress."""

    def round_trip() -> torch.Tensor:
        message = codec.compress(x)
        received = ours.CompressedTensor.from_wire(message.header_bytes(), message.payload_view())
        return ours.decompress(received)

    return round_trip


def hivemind_ratio(name: str, x: torch.Tensor) -> float:
    import hivemind.compression as hm

    message = getattr(hm, name)().compress(x, hm.CompressionInfo.from_tensor(x))
    return x.numel() * x.element_size() / message.ByteSize()


def hivemind_round_trip(name: str, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """hivemind's compress (to its protobuf message) -> extract."""
    import hivemind.compression as hm

    codec = getattr(hm, name)()
    info = hm.CompressionInfo.from_tensor(x)
    return lambda: codec.extract(codec.compress(x, info))


def measure(
    case: Case, x: torch.Tensor, min_seconds: float, min_calls: int, statistic: Callable[[list[float]], float]
) -> tuple[list[float | None], list[float | None], str]:
    """([our GB/s, relative error, ratio], [hivemind's], note); hivemind's figures are None where it has
    no counterpart or its codec fails (the note says which)."""
    nbytes = x.numel() * x.element_size()
    fns = [ours_round_trip(case.make_ours(), x)]
    errors = [relative_error(x, fns[0]())]
    ratios: list[float | None] = [nbytes / case.make_ours().compress(x).nbytes, None]
    note = "hivemind has no such codec"
    if case.hivemind_name is not None:
        note = f"vs hivemind {case.hivemind_name}" if case.hivemind_name != case.name else ""
        try:
            theirs = hivemind_round_trip(case.hivemind_name, x)
            errors.append(relative_error(x, theirs()))  # the warm-up call; may fail (numpy 2)
            fns.append(theirs)
            ratios[1] = hivemind_ratio(case.hivemind_name, x)
        except Exception as e:  # report any failure of the reference instead of dying
            first_line = (str(e).splitlines() or [""])[0][:120]
            note = f"hivemind {case.hivemind_name} failed: {type(e).__name__}: {first_line}"
            del fns[1:], errors[1:]
            ratios[1] = None
    seconds = interleaved_seconds(fns, min_seconds, min_calls, statistic)
    gbps = [nbytes / t / 1e9 for t in seconds]
    if len(fns) == 1:
        return [gbps[0], errors[0], ratios[0]], [None, None, None], note
    return [gbps[0], errors[0], ratios[0]], [gbps[1], errors[1], ratios[1]], note


def run_cpu(
    cases: list[Case], sizes: list[str], min_seconds: float, min_calls: int, statistic: Callable[[list[float]], float]
) -> list[Result]:
    results = []
    for size in sizes:
        numel = SIZES[size]
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for case in cases:
            (gbps, error, ratio), (hm_gbps, hm_error, hm_ratio), note = measure(
                case, x, min_seconds, min_calls, statistic
            )
            label = f"{case.name} {size}"
            speed = f"{gbps / hm_gbps:5.2f}x" if hm_gbps else "  n/a"
            hm_text = f"{hm_gbps:7.3f} GB/s err {hm_error:.2e} ratio {hm_ratio:6.1f}" if hm_gbps else f"{'-':>7}"
            print(
                f"{label:34s} ours {gbps:7.3f} GB/s err {error:.2e} ratio {ratio:6.1f} | hivemind {hm_text} | "
                f"{speed} {note}"
            )
            results.append(higher_is_better(label, "GB/s", round(gbps, 4), hm_gbps and round(hm_gbps, 4)))
            results.append(
                lower_is_better(
                    label,
                    "relative_error",
                    float(f"{error:.4g}"),
                    None if hm_error is None else float(f"{hm_error:.4g}"),
                )
            )
            results.append(
                higher_is_better(label, "compression_ratio", round(ratio, 2), hm_ratio and round(hm_ratio, 2))
            )
    return results


def run_cuda(cases: list[Case], sizes: list[str]) -> list[Result]:
    results = []
    sync = torch.cuda.synchronize
    for size in sizes:
        numel = SIZES[size]
        x = torch.randn(numel, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        nbytes = x.numel() * x.element_size()
        copy_gbps = nbytes / median_seconds(x.clone, 20, warmup=3, sync=sync) / 1e9
        print(f"device-to-device copy {size}: {copy_gbps:8.1f} GB/s")
        results.append(Result(f"device copy {size}", "GB/s", round(copy_gbps, 2), None, None))
        for case in cases:
            codec = case.make_ours()
            on_device = median_seconds(lambda c=codec, x=x: ours.decompress(c.encode(x), device="cuda"), 20, 3, sync)
            with_host = median_seconds(lambda c=codec, x=x: ours.decompress(c.compress(x), device="cuda"), 10, 2, sync)
            kernel_gbps, host_gbps = nbytes / on_device / 1e9, nbytes / with_host / 1e9
            print(
                f"{case.name:26s} {size}: on-device {kernel_gbps:8.1f} GB/s ({kernel_gbps / copy_gbps:6.1%} of copy)"
                f" | via host {host_gbps:7.2f} GB/s"
            )
            results.append(Result(f"{case.name} {size} cuda on-device", "GB/s", round(kernel_gbps, 2), None, None))
            results.append(
                Result(
                    f"{case.name} {size} cuda on-device / copy",
                    "fraction",
                    round(kernel_gbps / copy_gbps, 4),
                    None,
                    None,
                )
            )
            results.append(Result(f"{case.name} {size} cuda via host", "GB/s", round(host_gbps, 3), None, None))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--codecs", nargs="+", default=[c.name for c in CASES], choices=[c.name for c in CASES])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--min-seconds", type=float, default=0.5, help="CPU: least time of each side per case")
    parser.add_argument("--min-calls", type=int, default=5, help="CPU: least calls of each side per case")
    parser.add_argument("--statistic", default="min", choices=["min", "median"], help="CPU: of the calls' times")
    args = start(parser)
    cases = [c for c in CASES if c.name in args.codecs]
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device")
        results = run_cuda(cases, args.sizes)
    else:
        statistic = min if args.statistic == "min" else statistics.median
        results = run_cpu(cases, args.sizes, args.min_seconds, args.min_calls, statistic)
    emit("compression" if args.device == "cpu" else "compression_cuda", results)


if __name__ == "__main__":
    main()
