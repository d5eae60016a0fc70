"""The one configuration of state sharing, used by donors and newcomers alike.

hivemind's knobs keep their names (``allow_state_sharing``, ``declare_state_period``,
``next_chunk_timeout``, ``load_state_compression``); the others are new and say what they bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hivemind_ext.compression import Codec, NoCompression, as_codec
from hivemind_ext.errors import ConfigurationError
from hivemind_ext.p2p import protocol_name

MAX_CHUNK_BYTES = 64 * 1024 * 1024  # one chunk is one frame; bigger chunks only add latency and memory
LOAD_STATE_HANDLER = "load_state"


@dataclass(frozen=True, kw_only=True)
class StateSharingConfig:
    """How a peer serves its state to late joiners and downloads the state when it joins late.

    Donor side:

    :param prefix: peers share state only with peers that use the same prefix (e.g. ``"run42"``).
    :param allow_state_sharing: serve downloads and advertise in the DHT (can be switched at runtime
        on :class:`~.state_donor.StateDonor`); hivemind's name.
    :param client_mode: this peer accepts no incoming connections, so it can neither serve nor
        advertise; ``None`` asks the DHT.
    :param load_state_compression: codec for the tensors sent to newcomers (hivemind codecs are
        converted); tensors whose dtype it cannot carry are sent uncompressed.
    :param chunk_bytes: raw tensor bytes per chunk. One chunk is the unit of integrity checks,
        of spreading over donors and of retries: smaller chunks spread and retry finer, larger ones
        cost less per-chunk overhead.
    :param max_concurrent_downloads: downloads served at once; more newcomers get an immediate
        "busy" answer and go to other donors instead of queueing behind the ones served.
    :param snapshot_timeout: how long a request waits for ``get_state`` (which may wait for the
        averager's lock) before the donor answers "busy" (or serves its previous snapshot of the
        same version), so a donor busy averaging never makes a newcomer wait (hivemind 169, 445).
    :param snapshot_reuse_time: a prepared snapshot of the current version is served again for this
        long instead of taking a new one, so a newcomer downloading from several donors, or several
        newcomers at once, cost one snapshot.
    :param declare_state_period: a donor's DHT record lives this long and is refreshed twice per period.
    :param dht_timeout: bound on each DHT read or write.

    Newcomer side:

    :param next_chunk_timeout: a donor that sends no chunk for this long is abandoned and its
        share is downloaded from another donor; hivemind's name.
    :param manifest_timeout: bound on connecting to a donor and receiving its manifest (which
        includes the donor's snapshot and encoding time).
    :param max_parallel_donors: donors of the newest version downloaded from at once.
    :param manifest_gather_time: after the first donor's manifest, how long the other donors asked
        at once get to answer before the first chunk is requested (or as long as the first one took,
        if that was longer), so that the download is spread over all of them from the start; the
        wait ends as soon as every donor asked has answered.
    :param inflight_bytes: raw bytes requested from one donor and not yet received; enough to keep
        its uplink busy across a round trip.
    :param busy_retry_delay: when every donor answered "busy", ask again after this pause (while
        the deadline allows) instead of failing.
    :param max_state_bytes: refuse a manifest that describes a larger state (before allocating it).
    :param require_agreement: trust no single donor while others exist: of the manifests gathered
      for a version, the largest group with the same content digest must hold at least 2 donors
      and more than half of those that answered, or the version is not downloaded (the older
      versions are tried next, then the search starts again after ``busy_retry_delay``, a few times).
      A swarm with one donor is still believed (and the state it serves checked by ``validate``).
      For runs whose peers hold bitwise identical states (synchronous training); off by default,
      as in hivemind.
    :param bad_donor_cooldown: a donor whose state failed validation, or that sent a corrupt
      manifest or chunk, is not asked again by this loader for this many seconds.
    :param reject_non_finite: a chunk whose floating-point values hold NaN or Inf is corrupt: its
      donor is dropped and banned, and the chunk is downloaded from another donor (for training
      states, which must be finite; off by default, as a generic averager may share anything).
    :param disagreement_retries: with ``require_agreement``, how many times the search starts again
      when no version had agreeing donors (honest donors may differ for a moment around an epoch's
      end, or be busy averaging). The last try takes the largest group of agreeing donors even
      without a majority (see :mod:`.download`), so that honest peers that diverged never lock
      newcomers out.
    """

    prefix: str
    allow_state_sharing: bool = True
    client_mode: bool | None = None
    load_state_compression: Codec = field(default_factory=NoCompression)
    chunk_bytes: int = 4 * 1024 * 1024
    max_concurrent_downloads: int = 4
    snapshot_timeout: float = 2.0
    snapshot_reuse_time: float = 5.0
    declare_state_period: float = 30.0
    dht_timeout: float = 5.0
    next_chunk_timeout: float = 10.0
    manifest_timeout: float = 15.0
    max_parallel_donors: int = 3
    manifest_gather_time: float = 0.5
    inflight_bytes: int = 16 * 1024 * 1024
    busy_retry_delay: float = 0.5
    max_state_bytes: int = 2**40
    require_agreement: bool = False
    reject_non_finite: bool = False
    bad_donor_cooldown: float = 300.0
    disagreement_retries: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str) or not self.prefix:
            raise ConfigurationError(f"prefix must be a non-empty string, got {self.prefix!r}")
        protocol_name(self.rpc_namespace, LOAD_STATE_HANDLER)  # the prefix must fit a libp2p protocol id
        for name in ("allow_state_sharing", "require_agreement", "reject_non_finite"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigurationError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.client_mode is not None and not isinstance(self.client_mode, bool):
            raise ConfigurationError(f"client_mode must be None or a bool, got {self.client_mode!r}")
        object.__setattr__(self, "load_state_compression", as_codec(self.load_state_compression))
        self._check_sizes()
        self._check_times()

    def _check_sizes(self) -> None:
        _require_int(self, "chunk_bytes", 1, MAX_CHUNK_BYTES)
        _require_int(self, "max_concurrent_downloads", 1, 1 << 16)
        _require_int(self, "max_parallel_donors", 1, 1 << 10)
        _require_int(self, "inflight_bytes", 1, 1 << 40)
        _require_int(self, "max_state_bytes", 0, 1 << 62)
        _require_int(self, "disagreement_retries", 0, 1 << 10)

    def _check_times(self) -> None:
        for name in (
            "snapshot_timeout",
            "snapshot_reuse_time",
            "declare_state_period",
            "dht_timeout",
            "next_chunk_timeout",
            "manifest_timeout",
            "manifest_gather_time",
            "busy_retry_delay",
            "bad_donor_cooldown",
        ):
            value = getattr(self, name)
            if not _is_number(value) or not 0 <= value < math.inf:
                raise ConfigurationError(f"{name} must be a finite non-negative number of seconds, got {value!r}")
        for name in ("snapshot_timeout", "declare_state_period", "dht_timeout", "next_chunk_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigurationError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.manifest_timeout <= self.snapshot_timeout:
            # a donor that cannot snapshot in time must be able to say "busy" before the newcomer gives up on it
            raise ConfigurationError(
                f"manifest_timeout ({self.manifest_timeout}) must exceed snapshot_timeout ({self.snapshot_timeout})"
            )

    @property
    def rpc_namespace(self) -> str:
        """The RPC namespace of the download handler: one per prefix, so runs never serve each other."""
        return f"{self.prefix}.state"


def _require_int(config: Any, name: str, low: int, high: int) -> None:
    value = getattr(config, name)
    if type(value) is not int or not low <= value <= high:
        raise ConfigurationError(f"{name} must be an int in [{low}, {high}], got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
