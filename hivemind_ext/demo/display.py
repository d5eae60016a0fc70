"""The progress line of the digits demo."""

from __future__ import annotations

import math
import time
from typing import Any


class ProgressDisplay:
    """Shows the swarm's progress: one updating line on a terminal, a line per epoch (or every ``period`` s)
    otherwise, so that logs stay readable."""

    def __init__(self, epochs: int, stream: Any, period: float = 10.0) -> None:
        self.epochs, self.stream, self.period = epochs, stream, period
        self.tty = stream.isatty()
        self.losses: dict[int, float] = {}
        self.swarm: dict[str, Any] = {}
        self.epoch = -1
        self.last_line = ""
        self.last_print = 0.0

    def update(self, index: int, epoch: int, loss: float, swarm: dict[str, Any]) -> None:
        self.losses[index] = loss
        if swarm.get("epoch") is not None and (not self.swarm or swarm["epoch"] >= self.swarm.get("epoch", -1)):
            self.swarm = swarm
        line = self.line()
        now = time.monotonic()
        new_epoch = epoch > self.epoch
        self.epoch = max(self.epoch, epoch)
        if self.tty:
            if line != self.last_line and now - self.last_print >= 0.2:
                self.stream.write("\r" + line.ljust(len(self.last_line)))
                self.stream.flush()
                self.last_line, self.last_print = line, now
        elif new_epoch or now - self.last_print >= self.period:
            print(line, file=self.stream, flush=True)
            self.last_print = now

    def line(self) -> str:
        swarm = self.swarm
        finite = [value for value in self.losses.values() if not math.isnan(value)]
        loss = f"{sum(finite) / len(finite):.3f}" if finite else "-"
        epoch = swarm.get("epoch")
        samples, target = swarm.get("samples_accumulated"), swarm.get("target_batch_size")
        peers, clients = swarm.get("num_peers"), swarm.get("num_clients")
        eta = swarm.get("eta_next_epoch")
        in_seconds = eta - time.time() if eta is not None else math.inf  # hivemind says "unknown" with ~1e22
        eta_text = f" | next epoch in {max(0.0, in_seconds):.1f} s" if in_seconds < 3600 else ""
        return (
            f"epoch {'-' if epoch is None else epoch}/{self.epochs} | samples {samples if samples is not None else '-'}"
            f"/{target or '-'} | peers online {peers if peers is not None else '-'} ({clients or 0} client mode)"
            f" | loss {loss}{eta_text}"
        )

    def close(self) -> None:
        if self.tty and self.last_line:
            self.stream.write("\n")
            self.stream.flush()
