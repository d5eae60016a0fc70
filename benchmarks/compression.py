"""Compression throughput and error: hivemind_ext's codecs next to hivemind's, in the same run.

For float32 tensors of normal values, each codec's compress + decompress throughput (GB/s of input)
and relative error ||x - x'|| / ||x||. On CPU, hivemind's codec of the same name is measured on the
same tensor right after ours; where hivemind has no such codec (or it fails, as its 8-bit codecs do
under numpy 2), the output says so and its figures are null.

On CUDA (``--device cuda``), each codec's on-device encode + decode is measured next to a
device-to-device copy of the same tensor, and so is the full round trip with the compressed bytes
crossing to host memory and back.

    python benchmarks/compression.py                      # CPU, 1M / 16M / 64M values
    python benchmarks/compression.py --sizes 1M 16M --codecs MinMaxUInt8 Float16Compression
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, describe_machine, emit, higher_is_better, lower_is_better, median_seconds

import hivemind_ext.compression as ours


@dataclass(frozen=True)
class Case:
    name: str  # our class name
    make_ours: Callable[[], ours.Codec]
    hivemind_name: str | None  # hivemind's class to compare with, None where it has no counterpart


CASES = [
    Case("NoCompression", ours.NoCompression, "NoCompression"),
    Case("Float16Compression", ours.Float16Compression, "Float16Compression"),
    Case("ScaledFloat16Compression", ours.ScaledFloat16Compression, "ScaledFloat16Compression"),
    Case("BFloat16Compression", ours.BFloat16Compression, None),
    Case("Uniform8BitQuantization", lambda: ours.Uniform8BitQuantization(), "Uniform8BitQuantization"),
    Case("Quantile8BitQuantization", lambda: ours.Quantile8BitQuantization(), "Quantile8BitQuantization"),
    Case("BlockwiseQuantization", lambda: ours.BlockwiseQuantization(), "BlockwiseQuantization"),
    # hivemind has no per-chunk min-max codec; its uniform 8-bit codec is the closest one
    Case("MinMaxUInt8", lambda: ours.MinMaxUInt8(), "Uniform8BitQuantization"),
    Case("MinMaxUInt4", lambda: ours.MinMaxUInt4(), None),
]
SIZES = {"1M": 2**20, "16M": 2**24, "64M": 2**26}


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm((x - y.to(x.dtype)).double()) / torch.linalg.vector_norm(x.double()))


def repeats_for(numel: int) -> int:
    return 5 if numel <= 2**20 else 3 if numel <= 2**24 else 2


def measure_ours(codec: ours.Codec, x: torch.Tensor, repeats: int) -> tuple[float, float]:
    """(GB/s, relative error) of compress -> header bytes + payload view -> from_wire -> decompress."""

    def round_trip() -> torch.Tensor:
        message = codec.compress(x)
        received = ours.CompressedTensor.from_wire(message.header_bytes(), message.payload_view())
        return ours.decompress(received)

    seconds = median_seconds(round_trip, repeats)
    return x.numel() * x.element_size() / seconds / 1e9, relative_error(x, round_trip())


def measure_hivemind(name: str, x: torch.Tensor, repeats: int) -> tuple[float | None, float | None, str]:
    """(GB/s, relative error, note) of hivemind's compress -> extract; figures are None if it fails."""
    import hivemind.compression as hm

    codec = getattr(hm, name)()
    info = hm.CompressionInfo.from_tensor(x)

    def round_trip() -> torch.Tensor:
        return codec.extract(codec.compress(x, info))

    try:
        seconds = median_seconds(round_trip, repeats)
        error = relative_error(x, round_trip())
    except Exception as e:  # report any failure of the reference instead of dying
        return None, None, f"hivemind {name} failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    return x.numel() * x.element_size() / seconds / 1e9, error, ""


def run_cpu(cases: list[Case], sizes: list[str]) -> list[Result]:
    results = []
    for size in sizes:
        numel = SIZES[size]
        x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
        for case in cases:
            repeats = repeats_for(numel)
            gbps, error = measure_ours(case.make_ours(), x, repeats)
            hm_gbps, hm_error, note = None, None, "hivemind has no such codec"
            if case.hivemind_name is not None:
                hm_gbps, hm_error, note = measure_hivemind(case.hivemind_name, x, repeats)
                if case.hivemind_name != case.name and not note:
                    note = f"vs hivemind {case.hivemind_name}"
            label = f"{case.name} {size}"
            ratio = f"{gbps / hm_gbps:5.2f}x" if hm_gbps else "  n/a"
            hm_text = f"{hm_gbps:7.3f} GB/s err {hm_error:.2e}" if hm_gbps else f"{'-':>7}"
            print(f"{label:34s} ours {gbps:7.3f} GB/s err {error:.2e} | hivemind {hm_text} | {ratio} {note}")
            results.append(higher_is_better(label, "GB/s", round(gbps, 4), hm_gbps and round(hm_gbps, 4)))
            results.append(
                lower_is_better(
                    label,
                    "relative_error",
                    float(f"{error:.4g}"),
                    None if hm_error is None else float(f"{hm_error:.4g}"),
                )
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
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    cases = [c for c in CASES if c.name in args.codecs]
    print(f"machine: {describe_machine()}", flush=True)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device")
        results = run_cuda(cases, args.sizes)
    else:
        results = run_cpu(cases, args.sizes)
    emit("compression" if args.device == "cpu" else "compression_cuda", results)


if __name__ == "__main__":
    main()
