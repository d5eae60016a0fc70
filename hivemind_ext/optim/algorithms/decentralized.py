"""Low-precision decentralized SGD: peers exchange 8-bit compressed model differences with a few
fixed neighbours instead of averaging with the whole swarm.

Each peer keeps a replica of each neighbour's model. At every ``step()`` (the model as one bucket):

1. mix: ``x_half = mean(x, replicas of the neighbours)``;
2. local step: the wrapped optimizer steps ``x_half`` with the gradient computed at ``x``;
3. exchange: ``d = C(x_half - x)`` (MinMaxUInt8 by default), ``x = x + d``, and ``d`` is pushed to the
   peers that follow this one; a replica is updated with every difference received (in order).

Because the model itself moves by the compressed difference, a replica equals its neighbour's
model exactly (no drift from compression). Neighbours are chosen through the DHT (the peers that
follow on a ring of peer ids, :mod:`.neighbours`) and kept for the run. A neighbour that stays
silent and does not answer a ping is replaced; the new neighbour's model is downloaded in full
when subscribing (re-synchronizing the replica); a gap in a neighbour's sequence numbers does the
same. Pushes from peers that are not neighbours, of the wrong size, or with NaN are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import torch
from hivemind.p2p import PeerID

from hivemind_ext.compression import CompressedTensor, MinMaxUInt8, NoCompression, decompress
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import ClosedError, ConfigurationError, HivemindExtError, ProtocolError
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket, Operation
from hivemind_ext.optim.algorithms.neighbours import NeighbourRegistry, choose_neighbours
from hivemind_ext.p2p import HandlerConfig, Limits, Message, RPCClient, RPCContext, TaskOwner
from hivemind_ext.p2p.messages import TENSOR_KEY, pack_tensor, unpack_tensor
from hivemind_ext.p2p.runtime import PeerRuntime
from hivemind_ext.p2p.signing import default_signing_key

logger = logging.getLogger(__name__)

MAX_QUEUED_PUSHES = 64  # a subscriber that falls this far behind is dropped (it re-subscribes)
MAX_PUSH_FAILURES = 3
MAX_BATCHED_PUSHES = 32  # differences sent in one push when a subscriber's queue has several


class DecentralizedSGD(Algorithm):
    """:param num_neighbours: how many neighbours each peer mixes with
    :param codec: compression of the model differences (default MinMaxUInt8, Bagua's 8-bit min-max)
    :param neighbour_timeout: a neighbour silent this long is pinged, and replaced if it does not answer
    :param request_timeout: deadline of each call to a neighbour
    :param maintenance_period: how often (seconds) neighbours are checked from ``step()``
    """

    def __init__(
        self,
        num_neighbours: int = 2,
        codec: Any = None,
        *,
        neighbour_timeout: float = 10.0,
        request_timeout: float = 5.0,
        maintenance_period: float = 1.0,
    ) -> None:
        if isinstance(num_neighbours, bool) or not isinstance(num_neighbours, int) or num_neighbours < 1:
            raise ConfigurationError(f"num_neighbours must be a positive integer, got {num_neighbours!r}")
        for name, value in (
            ("neighbour_timeout", neighbour_timeout),
            ("request_timeout", request_timeout),
            ("maintenance_period", maintenance_period),
        ):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ConfigurationError(f"{name} must be a positive number of seconds, got {value!r}")
        self.num_neighbours = num_neighbours
        self.codec = as_codec(codec if codec is not None else MinMaxUInt8())
        self.neighbour_timeout, self.request_timeout = float(neighbour_timeout), float(request_timeout)
        self.maintenance_period = float(maintenance_period)

    def reify(self, context: AlgorithmContext) -> DecentralizedSGDImpl:
        return DecentralizedSGDImpl(context, self)


class NeighbourExchange(Operation):
    """Moves the bucket by the compressed difference from its pre-step value and pushes the difference
    to the subscribers (the exchange-with-neighbours operation)."""

    def __init__(self, impl: DecentralizedSGDImpl) -> None:
        self.impl = impl

    def run(self, buckets: Any, runner: Any) -> None:
        for bucket in buckets:
            self.impl.exchange(bucket)


class _Neighbour:
    """A neighbour's replica; while subscribing (replica None), early differences wait in ``early``."""

    def __init__(self) -> None:
        self.replica: torch.Tensor | None = None
        self.next_seq = 0
        self.early: list[tuple[int, torch.Tensor]] = []
        self.last_heard = time.monotonic()
        self.needs_resync = False

    def start(self, replica: torch.Tensor, seq: int) -> None:
        """The subscription's snapshot (after difference ``seq``), then the differences that came early."""
        self.replica, self.next_seq, self.needs_resync = replica, seq + 1, False
        for early_seq, delta in sorted(self.early, key=lambda item: item[0]):
            self.apply(early_seq, delta)
        self.early.clear()

    def apply(self, seq: int, delta: torch.Tensor) -> None:
        if self.replica is None:
            if len(self.early) < MAX_QUEUED_PUSHES:
                self.early.append((seq, delta))
            return
        if seq < self.next_seq:
            return  # a duplicate, or older than the snapshot
        if seq > self.next_seq:
            self.needs_resync = True  # a difference was lost: download the model again
            return
        self.replica.add_(delta.to(self.replica.device))
        self.next_seq += 1
        self.last_heard = time.monotonic()


class DecentralizedSGDImpl(AlgorithmImpl):
    def __init__(self, context: AlgorithmContext, algorithm: DecentralizedSGD) -> None:
        super().__init__(context)
        self.algorithm = algorithm
        self.numel = sum(p.numel() for p in context.params)
        self.seq = 0  # differences published so far
        self.steps = 0
        self.bytes_pushed = 0
        self.neighbours: dict[str, _Neighbour] = {}
        self.replaced = 0  # neighbours replaced after a failure (for tests)
        self._excluded: dict[str, float] = {}  # peer -> monotonic time until which it is not chosen again
        self._lock = threading.Lock()  # replicas, seq and subscribers (the loop thread's handlers take it)
        self._subscribers: dict[str, asyncio.Queue] = {}
        self._x_before: torch.Tensor | None = None
        # the model as neighbours know it: the last published model and its sequence number (a
        # subscriber's replica starts from it, and every later difference applies on top)
        self._published = torch.cat([p.detach().reshape(-1).float() for p in context.params])
        self._next_maintenance = 0.0
        # the peer's runtime (shared with its averagers and tracker): the loop, P2P replica, RPC server
        self._runtime = PeerRuntime.acquire(context.dht)
        self._closed = False
        self._tasks: TaskOwner | None = None
        try:
            self._runtime.run(self._start(), timeout=30)
        except BaseException:
            self.shutdown()
            raise
        self.peer_id = self._p2p.peer_id.to_base58()
        self.registry = NeighbourRegistry(
            self._runtime,
            context.prefix("decsgd_peers"),
            self.peer_id,
            signing_key=default_signing_key(context.dht),
            timeout=algorithm.request_timeout,
        )
        self.registry.register(force=True)

    @property
    def runtime(self) -> PeerRuntime:
        """The peer runtime this algorithm serves and calls on (shared with the peer's other components)."""
        return self._runtime

    @property
    def rpc_client(self) -> RPCClient:
        """The client this algorithm calls its neighbours' handlers with (subscribe, push, ping)."""
        return self._client

    # ----- the Algorithm API

    def tensors_to_buckets(self, tensors: Any) -> list:
        return [list(tensors)]  # one bucket: the mix and the local step apply to the whole model

    def init_tensors(self) -> list:
        return [(f"param{i}", p) for i, p in enumerate(self.context.params)]

    def init_operations(self, bucket: Bucket) -> None:
        bucket.append_python(self.mix)
        bucket.append_python(self.local_step)
        bucket.append_op(NeighbourExchange(self))

    def on_backward(self, batch_size: int) -> None:
        self.samples += batch_size
        if time.monotonic() >= self._next_maintenance:
            self._next_maintenance = time.monotonic() + self.algorithm.maintenance_period
            self.maintain_neighbours()

    def should_communicate(self) -> bool:
        return True

    def optimizer_step(self) -> None:
        pass  # the local step ran inside the bucket's operations

    def on_optimizer_step(self) -> None:
        self.steps += 1
        self.samples = 0

    # ----- the operations

    def mix(self, bucket: Bucket) -> None:
        bucket.pack()
        self._x_before = bucket.flat.clone()
        if not torch.equal(self._x_before, self._published):
            # the model changed outside the algorithm (e.g. a state download): publish that change
            # exactly, so that the neighbours' replicas stay equal to it
            self._publish(NoCompression().compress(self._x_before - self._published), self._x_before)
        with self._lock:
            replicas = [n.replica for n in self.neighbours.values() if n.replica is not None and not n.needs_resync]
            if replicas:
                torch.mean(torch.stack([bucket.flat, *replicas]), dim=0, out=bucket.flat)
        bucket.unpack()

    def local_step(self, bucket: Bucket) -> None:
        grads = [p.grad for p in self.context.params]
        self.context.state.apply_gradients(grads)
        bucket.pack()

    def exchange(self, bucket: Bucket) -> None:
        assert self._x_before is not None
        codec = self.algorithm.codec
        message = codec.compress(bucket.flat - self._x_before)
        delta = codec.decompress(message)
        torch.add(self._x_before, delta.to(bucket.flat.dtype), out=bucket.flat)
        bucket.unpack()
        self._publish(message, bucket.flat)

    def _publish(self, message: Any, model: torch.Tensor) -> None:
        """Sends one difference to the subscribers; ``model`` is this peer's model after it."""
        with self._lock:
            self.seq += 1
            seq = self.seq
            self._published.copy_(model)
            queues = list(self._subscribers.items())
        for peer, queue in queues:
            if queue.qsize() >= MAX_QUEUED_PUSHES:
                self._submit(self._drop_subscriber(peer, "it fell too far behind"))
            else:
                self._submit(_put(queue, (seq, message)))

    def _submit(self, coro: Any) -> None:
        if self._closed:
            coro.close()
            raise ClosedError("decentralized SGD is shut down")
        self._runtime.submit(coro)

    # ----- neighbours (training thread)

    def maintain_neighbours(self) -> None:
        """Registers, checks silent neighbours, replaces dead ones and re-synchronizes broken replicas."""
        self.registry.register()
        now = time.monotonic()
        for peer, neighbour in list(self.neighbours.items()):
            if neighbour.needs_resync:
                self._subscribe(peer)
            elif now - neighbour.last_heard > self.algorithm.neighbour_timeout and not self._ping(peer):
                logger.info(f"neighbour {peer} stopped answering: replacing it")
                with self._lock:
                    self.neighbours.pop(peer, None)
                self._excluded[peer] = now + 10 * self.algorithm.neighbour_timeout
                self.replaced += 1
        if len(self.neighbours) >= self.algorithm.num_neighbours:
            return
        self._excluded = {p: t for p, t in self._excluded.items() if t > now}
        wanted = choose_neighbours(
            self.peer_id,
            self.registry.live_peers(),
            self.algorithm.num_neighbours,
            current=list(self.neighbours),
            exclude=self._excluded,
        )
        for peer in wanted:
            if peer not in self.neighbours and not self._subscribe(peer):
                self._excluded[peer] = now + 3 * self.algorithm.neighbour_timeout

    def _subscribe(self, peer: str) -> bool:
        with self._lock:
            neighbour = self.neighbours.get(peer)
            if neighbour is None or neighbour.replica is not None:
                neighbour = self.neighbours[peer] = _Neighbour()  # pushes may arrive before the answer
        try:
            response = self._runtime.run(
                self._client.call(
                    PeerID.from_base58(peer),
                    "subscribe",
                    Message({"numel": self.numel}),
                    timeout=self.algorithm.request_timeout,
                ),
                timeout=self.algorithm.request_timeout + 1,
            )
            seq = response.header.get("seq")
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
                raise ProtocolError(f"invalid sequence number {seq!r}")
            replica = _decoded(response, self.numel).to(self.context.params[0].device)
        except (HivemindExtError, TimeoutError, ValueError) as e:
            logger.info(f"could not subscribe to {peer}: {e}")
            with self._lock:
                self.neighbours.pop(peer, None)
            return False
        with self._lock:
            neighbour.start(replica, seq)
        logger.debug(f"{self.peer_id}: replica of {peer} synchronized at difference {seq}")
        return True

    def _ping(self, peer: str) -> bool:
        try:
            response = self._runtime.run(
                self._client.call(
                    PeerID.from_base58(peer), "ping", Message({}), timeout=self.algorithm.request_timeout
                ),
                timeout=self.algorithm.request_timeout + 1,
            )
        except (HivemindExtError, TimeoutError):
            return False
        with self._lock:
            neighbour = self.neighbours.get(peer)
            if neighbour is not None:
                neighbour.last_heard = time.monotonic()
                if not response.header.get("subscribed") or response.header.get("seq", 0) >= neighbour.next_seq:
                    neighbour.needs_resync = True  # it dropped us, or we missed differences
        return True

    # ----- the service (loop thread)

    async def _start(self) -> None:
        self._p2p = await self._runtime.start_network()
        namespace = f"decsgd.{self.context.prefix('x')}"
        limits = Limits(max_payload_bytes=8 * self.numel + (1 << 20))
        config = HandlerConfig(limits=limits, max_timeout=60.0, max_concurrent_calls=64)
        self._server = self._runtime.server.scope(namespace, config=config)
        self._client = RPCClient(self._p2p, namespace, limits=limits, default_timeout=self.algorithm.request_timeout)
        self._tasks = TaskOwner(f"decentralized-sgd[{self.context.key}]")
        await self._server.add_unary("subscribe", self._handle_subscribe)
        await self._server.add_unary("push", self._handle_push)
        await self._server.add_unary("ping", self._handle_ping)

    async def _handle_ping(self, request: Message, ctx: RPCContext) -> Message:
        with self._lock:
            return Message({"subscribed": ctx.peer_id.to_base58() in self._subscribers, "seq": self.seq})

    async def _handle_subscribe(self, request: Message, ctx: RPCContext) -> Message:
        if request.header.get("numel") != self.numel:
            raise ProtocolError(f"this model has {self.numel} values, not {request.header.get('numel')!r}")
        peer = ctx.peer_id.to_base58()
        with self._lock:  # the snapshot and the sequence number must match
            flat = self._published.cpu().clone()
            seq = self.seq
            old = self._subscribers.pop(peer, None)
            queue: asyncio.Queue = asyncio.Queue()
            self._subscribers[peer] = queue
        if old is not None:
            old.put_nowait(None)  # stops the old sender
        assert self._tasks is not None
        self._tasks.spawn(self._send_to(peer, queue), name=f"push to {peer}")
        return pack_tensor(NoCompression().compress(flat), seq=seq)

    async def _handle_push(self, request: Message, ctx: RPCContext) -> Message:
        """One push carries one or more consecutive differences (a sender that fell behind batches them)."""
        peer = ctx.peer_id.to_base58()
        deltas = [(seq, _decoded(part, self.numel)) for seq, part in _split_push(request)]
        with self._lock:
            neighbour = self.neighbours.get(peer)
            if neighbour is None:
                raise ProtocolError("not subscribed to this peer")
            for seq, delta in deltas:
                neighbour.apply(seq, delta)
        return Message({"ok": True})

    async def _send_to(self, peer: str, queue: asyncio.Queue) -> None:
        failures = 0
        while True:
            batch = [await queue.get()]
            while not queue.empty() and len(batch) < MAX_BATCHED_PUSHES and batch[-1] is not None:
                batch.append(queue.get_nowait())
            if batch[-1] is None:
                return
            try:
                push = _join_push(batch)
                await self._client.call(PeerID.from_base58(peer), "push", push, timeout=self.algorithm.request_timeout)
                self.bytes_pushed += len(push.payload_view())
                failures = 0
            except HivemindExtError as e:
                failures += 1
                if failures >= MAX_PUSH_FAILURES:
                    await self._drop_subscriber(peer, f"{failures} pushes failed ({e})")
                    return

    async def _drop_subscriber(self, peer: str, reason: str) -> None:
        with self._lock:
            queue = self._subscribers.pop(peer, None)
        if queue is not None:
            logger.debug(f"dropping subscriber {peer}: {reason}")
            queue.put_nowait(None)

    async def _stop(self) -> None:
        """Stops what this algorithm started on the shared runtime: its pushes, then its handlers."""
        if self._tasks is not None:
            await self._tasks.aclose(timeout=5)
        server = getattr(self, "_server", None)  # None if _start failed before making it
        if server is not None:
            try:
                await server.shutdown(timeout=2)
            except HivemindExtError as e:
                logger.debug(f"error while stopping decentralized SGD: {e}")

    def shutdown(self) -> None:
        """Stops serving and releases the peer runtime; idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._runtime.run(self._stop(), timeout=10)
        except (HivemindExtError, TimeoutError) as e:
            logger.debug(f"decentralized SGD did not stop cleanly: {e!r}")
        finally:
            self._runtime.release()


def _join_push(batch: list[tuple[int, Any]]) -> Message:
    """Consecutive differences in one message: their headers and sizes in the header, payloads joined."""
    views = [message.payload_view() for _, message in batch]
    header = {
        "seqs": [seq for seq, _ in batch],
        "tensors": [message.header() for _, message in batch],
        "sizes": [len(view) for view in views],
    }
    return Message(header, b"".join(views))


def _split_push(request: Message) -> list[tuple[int, Message]]:
    header = request.header
    seqs, tensors, sizes = header.get("seqs"), header.get("tensors"), header.get("sizes")
    if not all(isinstance(x, list) for x in (seqs, tensors, sizes)) or not 0 < len(seqs) <= MAX_BATCHED_PUSHES:
        raise ProtocolError("a push needs lists of sequence numbers, tensor headers and sizes")
    if not len(seqs) == len(tensors) == len(sizes):
        raise ProtocolError("a push's lists differ in length")
    payload = request.payload_view()
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in (*seqs, *sizes)) or sum(sizes) != len(
        payload
    ):
        raise ProtocolError("a push's sequence numbers or sizes are invalid")
    parts, offset = [], 0
    for seq, tensor_header, size in zip(seqs, tensors, sizes, strict=True):
        parts.append((seq, Message({TENSOR_KEY: tensor_header}, payload[offset : offset + size])))
        offset += size
    return parts


def _decoded(message: Message, numel: int) -> torch.Tensor:
    tensor = unpack_tensor(message, CompressedTensor)
    if tuple(tensor.shape) != (numel,):
        raise ProtocolError(f"expected {numel} values, got shape {tuple(tensor.shape)}")
    values = decompress(tensor)
    if not values.dtype.is_floating_point or not torch.isfinite(values).all():
        raise ProtocolError("the values hold NaN or Inf")
    return values.float()


async def _put(queue: asyncio.Queue, item: Any) -> None:
    queue.put_nowait(item)
