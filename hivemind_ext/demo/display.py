"""The progress line of the digits demo."""

from __future__ import annotations

import math
import time
from typing import Any


class ProgressDisplay:
    """Shows the swarm's progress: one updating line on a terminal, a line per epoch (or every ``period`` s)
    otherwise, so that logs stay readable. The line ends on the final epoch: :meth:`done` shows each
    peer's last epoch and accuracy."""

    def __init__(self, epochs: int, stream: Any, period: float = 10.0) -> None:
        self.epochs, self.stream, self.period = epochs, stream, period
        self.tty = stream.isatty()
        self.losses: dict[int, float] = {}
        self.accuracy: float | None = None  # the held-out accuracy last measured (by any peer: they share the model)
        self.swarm: dict[str, Any] = {}
        self.epoch = -1
        self.last_line = ""
        self.last_print = 0.0
        self.totals: list[tuple[float, int]] = []  # (time, samples the swarm processed since the start)
        self.rates: dict[int, float] = {}  # samples/s of each peer that finished, over its whole run

    def update(self, index: int, epoch: int, loss: float, swarm: dict[str, Any], accuracy: float | None = None) -> None:
        self.losses[index] = loss
        if accuracy is not None:
            self.accuracy = accuracy
        if swarm.get("epoch") is not None and (not self.swarm or swarm["epoch"] >= self.swarm.get("epoch", -1)):
            self.swarm = swarm
            self._count_samples(swarm)
        self._show(epoch)

    def done(self, index: int, payload: dict[str, Any]) -> None:
        """Peer ``index`` reached the goal (``payload``: its "done" report)."""
        epoch, self.accuracy, swarm = payload["epoch"], payload["accuracy"], payload.get("swarm") or {}
        if payload.get("train_seconds"):
            self.rates[index] = payload["samples"] / payload["train_seconds"]
        if swarm.get("epoch") is not None and swarm["epoch"] >= self.swarm.get("epoch", -1):
            self.swarm = swarm
        self._show(epoch, force=self.tty)  # a log gets the line of the final epoch once, from the first peer done

    def _show(self, epoch: int, force: bool = False) -> None:
        new_epoch = epoch > self.epoch
        self.epoch = max(self.epoch, epoch)
        line = self.line()
        now = time.monotonic()
        if self.tty:
            if line != self.last_line and (force or now - self.last_print >= 0.2):
                self.stream.write("\r" + line.ljust(len(self.last_line)))
                self.stream.flush()
                self.last_line, self.last_print = line, now
        elif (new_epoch or force or now - self.last_print >= self.period) and line != self.last_line:
            print(line, file=self.stream, flush=True)
            self.last_line, self.last_print = line, now

    def _count_samples(self, swarm: dict[str, Any]) -> None:
        """Keeps the swarm's total samples over the last 10 s, for samples/s where the tracker has no figure."""
        target, samples = swarm.get("target_batch_size"), swarm.get("samples_accumulated")
        if target is None or samples is None:
            return
        now = time.monotonic()
        self.totals.append((now, swarm["epoch"] * target + min(samples, target)))
        while len(self.totals) > 2 and now - self.totals[0][0] > 10.0:
            self.totals.pop(0)

    def samples_per_second(self) -> float | None:
        speed = self.swarm.get("samples_per_second")
        if speed is not None:
            return float(speed)
        if len(self.totals) < 2 or self.totals[-1][0] - self.totals[0][0] < 1.0:
            return sum(self.rates.values()) if self.rates else None  # a run too short to measure live
        (start, first), (end, last) = self.totals[0], self.totals[-1]
        return max(0.0, (last - first) / (end - start))

    def line(self) -> str:
        swarm = self.swarm
        finite = [value for value in self.losses.values() if not math.isnan(value)]
        loss = f"{sum(finite) / len(finite):.3f}" if finite else "-"
        epoch = max(swarm.get("epoch") or 0, self.epoch) if swarm.get("epoch") is not None or self.epoch >= 0 else None
        samples, target = swarm.get("samples_accumulated"), swarm.get("target_batch_size")
        peers, clients = swarm.get("num_peers"), swarm.get("num_clients")
        speed = self.samples_per_second()
        accuracy = f" | held-out accuracy {self.accuracy:.3f}" if self.accuracy is not None else ""
        eta = swarm.get("eta_next_epoch")
        in_seconds = eta - time.time() if eta is not None else math.inf  # hivemind says "unknown" with ~1e22
        eta_text = (
            f" | next epoch in {max(0.0, in_seconds):.1f} s" if in_seconds < 3600 and self.epoch < self.epochs else ""
        )
        return (
            f"epoch {'-' if epoch is None else epoch}/{self.epochs} | samples {samples if samples is not None else '-'}"
            f"/{target or '-'} | {'-' if speed is None else f'{speed:.0f}'} samples/s"
            f" | peers online {peers if peers is not None else '-'} ({clients or 0} client mode)"
            f" | loss {loss}{accuracy}{eta_text}"
        )

    def close(self) -> None:
        if self.tty and self.last_line:
            self.stream.write("\n")
            self.stream.flush()
            self.last_line = ""
