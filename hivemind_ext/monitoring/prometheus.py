"""The monitor's Prometheus metrics: a ``prometheus_client`` collector that turns the latest
:class:`~hivemind_ext.monitoring.swarm_state.SwarmState` into metric families at every scrape.

Swarm-wide gauges (``hivemind_ext_swarm_*``, ``hivemind_ext_peers{role}``) and one series per peer
(``hivemind_ext_peer_*{peer, role}``: the peer's own counters are monotonic, so they are counters);
the monitor's own counters under ``hivemind_ext_monitor_*``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from hivemind_ext.monitoring.records import ROLES
from hivemind_ext.monitoring.swarm_state import SwarmState

PREFIX = "hivemind_ext"


class SwarmCollector:
    """Collects from ``state`` at each scrape (register it on a ``CollectorRegistry``)."""

    def __init__(self, state: SwarmState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state
        yield InfoMetricFamily(f"{PREFIX}_monitor", "The run this monitor watches", value={"run_id": state.run_id})
        counters = state.counters()
        yield CounterMetricFamily(f"{PREFIX}_monitor_polls", "DHT polls that succeeded", value=counters["polls"])
        yield CounterMetricFamily(
            f"{PREFIX}_monitor_failed_polls", "DHT polls that failed", value=counters["failed_polls"]
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_monitor_invalid_records",
            "Malformed metrics records ignored in the last poll",
            value=counters["invalid_records"],
        )
        yield from self._swarm()
        yield from self._peers()

    def _swarm(self) -> Iterator[Metric]:
        latest = self.state.latest
        if latest is None:
            return
        peers = GaugeMetricFamily(f"{PREFIX}_peers", "Peers reporting metrics, by role", labels=["role"])
        for role in ROLES:
            peers.add_metric([role], latest.peers.get(role, 0))
        yield peers
        gauges = {
            "epoch": ("The highest epoch a peer reports", latest.epoch),
            "samples_per_second": ("The peers' training speeds, added up", latest.samples_per_second),
            "loss": ("The mean of the losses the peers report", latest.loss),
            "last_round_seconds": ("The mean of the peers' last all-reduce durations", latest.last_round_seconds),
            "rounds_ok": ("Successful averaging steps of the reporting peers", latest.rounds_ok),
            "rounds_failed": ("Failed averaging steps of the reporting peers", latest.rounds_failed),
            "bytes_sent": ("All-reduce bytes sent by the reporting peers", latest.bytes_sent),
            "bytes_received": ("All-reduce bytes received by the reporting peers", latest.bytes_received),
        }
        for name, (documentation, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(f"{PREFIX}_swarm_{name}", documentation, value=value)

    def _peers(self) -> Iterator[Metric]:
        records = self.state.records
        labels = ["peer", "role"]
        epoch = GaugeMetricFamily(f"{PREFIX}_peer_epoch", "A peer's epoch", labels=labels)
        speed = GaugeMetricFamily(f"{PREFIX}_peer_samples_per_second", "A peer's training speed", labels=labels)
        loss = GaugeMetricFamily(f"{PREFIX}_peer_loss", "A peer's mean reported loss", labels=labels)
        duration = GaugeMetricFamily(
            f"{PREFIX}_peer_last_round_seconds", "A peer's last all-reduce duration", labels=labels
        )
        rounds = CounterMetricFamily(f"{PREFIX}_peer_rounds", "A peer's averaging steps", labels=[*labels, "result"])
        sent = CounterMetricFamily(f"{PREFIX}_peer_sent_bytes", "A peer's all-reduce bytes sent", labels=labels)
        received = CounterMetricFamily(
            f"{PREFIX}_peer_received_bytes", "A peer's all-reduce bytes received", labels=labels
        )
        for record in records:
            values = [record.peer_id, record.role]
            epoch.add_metric(values, record.epoch)
            speed.add_metric(values, record.samples_per_second)
            if record.loss is not None:
                loss.add_metric(values, record.loss)
            if record.last_round_seconds is not None:
                duration.add_metric(values, record.last_round_seconds)
            rounds.add_metric([*values, "ok"], record.rounds_ok)
            rounds.add_metric([*values, "failed"], record.rounds_failed)
            sent.add_metric(values, record.bytes_sent)
            received.add_metric(values, record.bytes_received)
        yield from (epoch, speed, loss, duration, rounds, sent, received)


def registry_for(state: SwarmState) -> CollectorRegistry:
    """A registry holding only the collector of ``state`` (no process metrics of the monitor)."""
    registry = CollectorRegistry()
    registry.register(SwarmCollector(state))
    return registry


__all__ = ["SwarmCollector", "registry_for"]
