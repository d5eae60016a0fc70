"""State download for late joiners: donors serve snapshots of their state, newcomers download the
newest one, spread over several donors and checked chunk by chunk.

For the averager::

    config = StateSharingConfig(prefix="run42", load_state_compression=Float16Compression())
    runtime = PeerRuntime.acquire(dht)      # the peer's loop, P2P replica, RPC server and DHT calls
    p2p = await runtime.start_network()     # on runtime.loop_thread

    donor = StateDonor(config, dht=dht, p2p=p2p, get_state=current_state, state_lock=lock, version=epoch,
                       server=runtime.server, dht_calls=runtime.dht_calls)
    await donor.start()                     # serves and advertises (neither in client mode)
    donor.set_version(epoch)                # after each state update, from any thread
    donor.allow_state_sharing = False       # hivemind's switch, from any thread

    loader = StateLoader(config, dht=dht, p2p=p2p, dht_calls=runtime.dht_calls)
    loaded = await loader.load_state_from_peers(timeout=60)   # (metadata, tensors) or None

    await donor.shutdown()

Where the parts live:

- :mod:`.config`: :class:`StateSharingConfig`, every knob and what it bounds;
- :mod:`.records`: the donors' DHT records (key, format, strict parsing, ranking);
- :mod:`.manifest`: the wire protocol (requests, manifest, chunks, digests) and its validation;
- :mod:`.snapshot`: the donor's snapshots (taken and copied under the lock in a worker thread, encoded once);
- :mod:`.donor`: :class:`StateDonor` (handler, advertisement) and the :class:`DonorHooks` fault seam;
- :mod:`.download`: :class:`StateLoader` (donor choice, spreading, verification, retries).

Errors: ``load_state_from_peers`` returns None when no peer shares a state; it raises
:class:`~hivemind_ext.errors.StateLoadError` when donors exist but none delivered a complete, valid
state before the deadline (hivemind logs and returns None there; the averager may do the same by
catching it). Per-donor failures are logged and listed in the error; a busy donor raises
:class:`~hivemind_ext.errors.DonorBusyError` internally and the newcomer moves on.

Trust: records and manifests are validated strictly and every chunk is checked against the digest
its donor announced, which catches corrupted, truncated and mismatched transfers. That alone does
not make a donor honest (a consistent but wrong state passes). Three opt-in defences do, used by
the Optimizer: ``require_agreement`` (a state is downloaded only if at least 2 donors, and more
than half of those that answered, serve it bitwise identical: the manifest's content digest),
``reject_non_finite`` (a chunk holding NaN or Inf drops its donor) and a ``validate`` callback of
the caller (range checks); a donor caught serving a bad state or corrupt data is skipped for
``bad_donor_cooldown`` seconds, so the same bad state is never downloaded on every attempt.
"""

from hivemind_ext.averaging.state_sharing.config import StateSharingConfig
from hivemind_ext.averaging.state_sharing.donor import DonorHooks, DonorStats, StateDonor
from hivemind_ext.averaging.state_sharing.download import DonorMismatchError, LoadedState, StateLoader
from hivemind_ext.averaging.state_sharing.manifest import CorruptStateError
from hivemind_ext.averaging.state_sharing.snapshot import StateGetter

__all__ = [
    "CorruptStateError",
    "DonorHooks",
    "DonorMismatchError",
    "DonorStats",
    "LoadedState",
    "StateDonor",
    "StateGetter",
    "StateLoader",
    "StateSharingConfig",
]
