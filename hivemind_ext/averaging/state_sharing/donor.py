"""The donor: serves its state to late joiners and advertises that it does.

Usage (inside the averager's event loop)::

    donor = StateDonor(config, dht=dht, p2p=await dht.replicate_p2p(), get_state=averager_snapshot)
    await donor.start()
    donor.set_version(epoch)          # from any thread, after the new state is in place
    donor.allow_state_sharing = False # from any thread
    ...
    await donor.shutdown()

The download handler runs on the donor's own :class:`~hivemind_ext.p2p.RPCServer` (namespace
``<prefix>.state``; a scope of the peer runtime's server when one is passed), independently of
any averaging work: it never waits for an all-reduce, only (at most ``snapshot_timeout``) for
``get_state``, and it answers "busy" at once when ``max_concurrent_downloads`` downloads are in
progress. See :mod:`.manifest` for the wire format and :mod:`.snapshot` for snapshots.

Client-mode peers accept no incoming connections: their donor neither registers the handler nor
advertises, and :attr:`StateDonor.serving` is False.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from hivemind import DHT
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.crypto import RSAPrivateKey

from hivemind_ext.averaging.state_sharing.config import LOAD_STATE_HANDLER, StateSharingConfig
from hivemind_ext.averaging.state_sharing.manifest import (
    MAX_CHUNK_PAYLOAD_BYTES,
    MAX_MANIFEST_BYTES,
    chunk_response,
    manifest_response,
    parse_chunks_request,
    parse_manifest_request,
    refusal_response,
)
from hivemind_ext.averaging.state_sharing.records import MAX_VERSION, donor_subkey, donor_value, donors_key
from hivemind_ext.averaging.state_sharing.snapshot import PreparedState, SnapshotCache, StateGetter
from hivemind_ext.errors import (
    ClosedError,
    ConfigurationError,
    DeadlineExceededError,
    DonorBusyError,
    HivemindExtError,
    ProtocolError,
)
from hivemind_ext.p2p import (
    DirectConfig,
    HandlerConfig,
    Limits,
    Message,
    RPCContext,
    RPCServer,
    TaskOwner,
    now,
    wait_until,
)
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.signing import default_signing_key, install_signing

logger = logging.getLogger(__name__)

DEFAULT_CONTROL_TIMEOUT = 10.0
MAX_DOWNLOAD_SECONDS = 3600.0  # a handler is stopped after this even if the newcomer asked for longer
BUSY_ANSWER_SLACK = 16  # calls beyond max_concurrent_downloads still get an in-band "busy" answer
RETRACT_TIMEOUT = 2.0  # at shutdown, how long to try withdrawing the DHT record


class DonorHooks:
    """Fault-injection seam: the donor passes every manifest and chunk through these before sending.

    The defaults send everything unchanged. Tests subclass this to corrupt a chunk (return a
    modified payload), truncate the transfer (return ``None``: the donor ends the stream there),
    stall (sleep) or fail (raise).
    """

    async def on_manifest(self, peer_id: PeerID, payload: bytes) -> bytes:
        return payload

    async def on_chunk(
        self, peer_id: PeerID, index: int, header: dict, payload: memoryview
    ) -> tuple[dict, memoryview] | None:
        return header, payload


@dataclass
class DonorStats:
    """What a donor has served (read by tests and logs)."""

    downloads: int = 0  # manifests sent
    busy_answers: int = 0
    chunks_served: int = 0
    bytes_served: int = 0


class StateDonor:
    """Serves this peer's state to newcomers and advertises it in the DHT.

    :param config: the state sharing configuration (prefix, codec, limits, timeouts).
    :param dht: a running hivemind DHT, for the advertisement.
    :param p2p: the libp2p daemon to serve on (``await dht.replicate_p2p()``).
    :param server: serve on a scope of this (the peer runtime's) RPC server instead of a server of
      the donor's own on ``p2p``.
    :param dht_calls: the peer runtime's DHT helper (default: one of the donor's own around ``dht``).
    :param get_state: returns the state to serve, live tensors allowed (see :data:`.snapshot.StateGetter`).
    :param version: the state's version (e.g. the epoch); newcomers download the newest one.
    :param hooks: fault injection for tests.
    :param state_lock: held while the tensors ``get_state`` returned are copied (the lock under which
      training changes them, e.g. the averager's); each download serves such a copy.
    :param signing_key: the RSA key the DHT signs this peer's records with (default: this DHT's,
      see :func:`~hivemind_ext.p2p.signing.default_signing_key`); the record goes under its owner subkey.
    :param direct: also serve downloads over the direct data path: with a listener of the donor's own
      with these settings (a DirectConfig, see ``RPCServer.enable_direct``), or through the listener
      (one port) of another server of this peer (an RPCServer, e.g. the averager's scope, see
      ``RPCServer.share_direct``); None: over libp2p only.
    """

    def __init__(
        self,
        config: StateSharingConfig,
        *,
        dht: DHT,
        p2p: P2P,
        get_state: StateGetter,
        version: int = 0,
        hooks: DonorHooks | None = None,
        server: RPCServer | None = None,
        dht_calls: DHTCalls | None = None,
        state_lock: AbstractContextManager[Any] | None = None,
        signing_key: RSAPrivateKey | None = None,
        direct: DirectConfig | RPCServer | None = None,
    ) -> None:
        if not callable(get_state):
            raise ConfigurationError(f"get_state must be callable, got {type(get_state).__name__}")
        self.config, self.dht, self.p2p = config, dht, p2p
        self.hooks = hooks if hooks is not None else DonorHooks()
        self.stats = DonorStats()
        self._version = _checked_version(version)
        self._allow = config.allow_state_sharing
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-snapshot")
        self._snapshots = SnapshotCache(
            get_state,
            codec=config.load_state_compression,
            chunk_bytes=config.chunk_bytes,
            reuse_time=config.snapshot_reuse_time,
            executor=self._executor,
            state_lock=state_lock,
        )
        self._dht_calls = dht_calls if dht_calls is not None else DHTCalls(dht)
        self._signing_key = signing_key if signing_key is not None else default_signing_key(dht)
        self._owner = b""  # the owner marker of the signing key, once the DHT signs with it (start())
        if server is not None:
            self._server = server.scope(config.rpc_namespace, config=self._handler_config())
        else:
            self._server = RPCServer(p2p, config.rpc_namespace, config=self._handler_config())
        self._direct = direct
        self._tasks = TaskOwner(f"StateDonor({config.prefix})")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._active_downloads = 0
        self.serving = False

    def _handler_config(self) -> HandlerConfig:
        limits = Limits(max_payload_bytes=max(MAX_MANIFEST_BYTES, MAX_CHUNK_PAYLOAD_BYTES))
        return HandlerConfig(
            limits=limits,
            max_timeout=MAX_DOWNLOAD_SECONDS,
            max_concurrent_calls=self.config.max_concurrent_downloads + BUSY_ANSWER_SLACK,
        )

    # ----- lifecycle

    async def start(self, *, timeout: float = DEFAULT_CONTROL_TIMEOUT) -> None:
        """Registers the download handler and starts advertising (neither in client mode)."""
        if self._loop is not None:
            raise ClosedError("StateDonor.start() was called already")
        self._loop, self._changed = asyncio.get_running_loop(), asyncio.Event()
        client_mode = self.config.client_mode
        if client_mode is None:  # the property is a blocking round trip to the DHT process
            client_mode = await wait_until(asyncio.to_thread(lambda: self.dht.client_mode), now() + timeout, "DHT mode")
        if client_mode:
            logger.debug("state donor of %s is in client mode: not serving, not advertising", self.config.prefix)
            return
        self._owner = await install_signing(
            self._dht_calls, self._signing_key, protected_keys=(donors_key(self.config.prefix),), timeout=timeout
        )
        if isinstance(self._direct, RPCServer):
            await self._server.share_direct(self._direct, timeout=timeout)
        elif self._direct is not None:
            await self._server.enable_direct(self._direct, timeout=timeout)
        await self._server.add_stream(LOAD_STATE_HANDLER, self._serve_download, timeout=timeout)
        self.serving = True
        self._tasks.spawn(self._advertise_forever(self._changed), name=f"advertise state of {self.config.prefix}")

    async def shutdown(self, *, timeout: float = DEFAULT_CONTROL_TIMEOUT) -> None:
        """Stops advertising (withdrawing the record, best effort), stops serving; idempotent."""
        deadline = now() + timeout
        was_advertising = self.serving and not self._tasks.closing
        await self._tasks.aclose(timeout=timeout)
        if was_advertising:  # newcomers skip us at once instead of trying until the record expires
            await self._store_record(accepts=False, timeout=min(RETRACT_TIMEOUT, max(deadline - now(), 0.01)))
        self.serving = False
        try:
            await self._server.shutdown(timeout=max(deadline - now(), 0.01))
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self) -> StateDonor:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.shutdown()

    # ----- runtime settings (any thread)

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        """Sets the version of the state ``get_state`` returns from now on, and re-advertises.

        Call it after the new state is in place: a snapshot is labelled with the version read just
        before ``get_state`` runs, so a label may lag its state, never run ahead of it.
        """
        self._version = _checked_version(version)
        self._wake_advertiser()

    @property
    def allow_state_sharing(self) -> bool:
        return self._allow

    @allow_state_sharing.setter
    def allow_state_sharing(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigurationError(f"allow_state_sharing must be a bool, got {value!r}")
        self._allow = value
        self._wake_advertiser()

    def _wake_advertiser(self) -> None:
        if self._loop is None or self._changed is None or self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop stopped meanwhile
            self._loop.call_soon_threadsafe(self._changed.set)

    @property
    def active_downloads(self) -> int:
        return self._active_downloads

    @property
    def snapshots_taken(self) -> int:
        """Snapshots prepared so far (downloads beyond this number reused one)."""
        return self._snapshots.snapshots_taken

    # ----- advertising

    async def _advertise_forever(self, changed: asyncio.Event) -> None:
        """Keeps this donor's record alive: stores it every half period, and at once when the version
        or the sharing switch changes. A donor that stops sharing stores ``accepts: False`` once, so
        newcomers skip it before its old record expires."""
        advertised_accepting = False
        while True:
            changed.clear()
            if self._allow or advertised_accepting:
                accepting = self._allow
                if await self._store_record(accepts=accepting, timeout=self.config.dht_timeout):
                    advertised_accepting = accepting
            with contextlib.suppress(DeadlineExceededError):
                await wait_until(changed.wait(), now() + self.config.declare_state_period / 2, "next advertisement")

    async def _store_record(self, *, accepts: bool, timeout: float) -> bool:
        expiration = get_dht_time() + self.config.declare_state_period
        try:
            return await self._dht_calls.store(
                donors_key(self.config.prefix),
                donor_value(self._version, accepts),
                expiration,
                subkey=donor_subkey(self.p2p.peer_id.to_base58(), self._owner),
                timeout=timeout,
            )
        except HivemindExtError as e:  # timed out, failed, or the DHT is stopped
            logger.warning("could not advertise the state of %s: %s: %s", self.config.prefix, type(e).__name__, e)
            return False

    # ----- serving

    async def _serve_download(self, requests: AsyncIterator[Message], context: RPCContext) -> AsyncIterator[Message]:
        """One download: the manifest, then the chunks the newcomer asks for, until it ends the stream."""
        try:
            parse_manifest_request((await anext(requests)).header)
        except StopAsyncIteration:
            return
        except ProtocolError as e:
            yield Message(refusal_response("rejected", str(e)))
            return
        if not self._allow:
            yield Message(refusal_response("refused", "this peer does not share its state"))
            return
        if self._active_downloads >= self.config.max_concurrent_downloads:
            self.stats.busy_answers += 1
            yield Message(
                refusal_response("busy", f"all {self.config.max_concurrent_downloads} download slots are taken")
            )
            return
        self._active_downloads += 1
        try:
            try:
                prepared = await self._snapshots.get(
                    self._version, snapshot_timeout=self.config.snapshot_timeout, deadline=context.deadline
                )
            except DonorBusyError as e:
                self.stats.busy_answers += 1
                yield Message(refusal_response("busy", str(e)))
                return
            except Exception as e:  # get_state or the encoding failed (logged by the snapshot cache)
                yield Message(refusal_response("failed", f"{type(e).__name__}: {e}"))
                return
            self.stats.downloads += 1
            payload = await self.hooks.on_manifest(context.peer_id, prepared.manifest_bytes)
            yield Message(manifest_response(prepared.manifest_digest), payload)
            async for message in self._serve_chunks(requests, context, prepared):
                yield message
        finally:
            self._active_downloads -= 1

    async def _serve_chunks(
        self, requests: AsyncIterator[Message], context: RPCContext, prepared: PreparedState
    ) -> AsyncIterator[Message]:
        """Chunks in the order asked for; each chunk at most once per download (a newcomer that asks
        again is broken or hostile, and must not make us send the state twice)."""
        sent = bytearray(len(prepared.chunks))
        async for request in requests:
            try:
                indices = parse_chunks_request(request.header, prepared.manifest.snapshot, len(prepared.chunks))
                if any(sent[index] for index in indices) or len(set(indices)) != len(indices):
                    raise ProtocolError("a chunk was asked for twice")
            except ProtocolError as e:
                logger.debug("state download by %s rejected: %s", context.peer_id, e)
                yield Message(refusal_response("rejected", str(e)))
                return
            for index in indices:
                sent[index] = 1
                chunk = prepared.chunks[index]
                outgoing = await self.hooks.on_chunk(
                    context.peer_id, index, chunk_response(index, chunk.tensor_header), chunk.payload_view()
                )
                if outgoing is None:
                    return
                self.stats.chunks_served += 1
                self.stats.bytes_served += outgoing[1].nbytes
                yield Message(*outgoing)


def _checked_version(version: int) -> int:
    if type(version) is not int or not 0 <= version <= MAX_VERSION:
        raise ConfigurationError(f"version must be an int in [0, 2**63), got {version!r}")
    return version
