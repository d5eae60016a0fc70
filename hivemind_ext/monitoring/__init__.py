"""Watching a run: peers publish signed metrics records to the DHT, ``hivemind-ext monitor`` reads them.

- :mod:`.records`: the record's schema, and its strict parser (the DHT is open to anyone);
- :mod:`.publisher`: a peer's publisher (``Optimizer(..., metrics_period=...)``, ``Optimizer.report_loss``);
- :mod:`.swarm_state`: what the monitor knows (the latest records, a short history of swarm summaries);
- :mod:`.poller`: reads the records from the DHT into the state;
- :mod:`.prometheus`: the ``/metrics`` collector; :mod:`.server`: the dashboard, its JSON and ``/metrics``;
- :mod:`.cli`: the ``hivemind-ext monitor`` command.

This package's ``__init__`` imports nothing, so the Optimizer can import the publisher alone.
"""
