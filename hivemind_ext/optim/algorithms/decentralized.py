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
from hivemind.p2p import P2P, PeerID

from hivemind_ext.compression import CompressedTensor, MinMaxUInt8, NoCompression, decompress
from hivemind_ext.compression.resolve import as_codec
from hivemind_ext.errors import ConfigurationError, HivemindExtError, ProtocolError
from hivemind_ext.optim.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket, Operation
from hivemind_ext.optim.algorithms.neighbours import NeighbourRegistry, choose_neighbours
from hivemind_ext.p2p import HandlerConfig, Limits, Message, RPCClient, RPCContext, RPCServer, TaskOwner
from hivemind_ext.p2p.messages import pack_tensor, unpack_tensor
from hivemind_ext.runtime import LoopThread

logger = logging.getLogger(__name__)

MAX_QUEUED_PUSHES = 64  # a subscriber that falls this far behind is dropped (it re-subscribes)
MAX_PUSH_FAILURES = 3


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
    def __init__(self, replica: torch.Tensor, next_seq: int) -> None:
        self.replica, self.next_seq = replica, next_seq
        self.last_heard = time.monotonic()
        self.needs_resync = False


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
        self._next_maintenance = 0.0
        self._loop = LoopThread(f"decentralized-sgd[{context.key}]")
        self._tasks: TaskOwner | None = None
        try:
            self._loop.run(self._start(), timeout=30)
        except BaseException:
            self._loop.stop(timeout=5)
            raise
        self.peer_id = self._p2p.peer_id.to_base58()
        self.registry = NeighbourRegistry(
            context.dht, context.prefix("decsgd_peers"), self.peer_id, timeout=algorithm.request_timeout
        )
        self.registry.register(force=True)

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
        with self._lock:
            replicas = [n.replica for n in self.neighbours.values() if not n.needs_resync]
            if replicas:
                torch.mean(torch.stack([bucket.flat, *replicas]), dim=0, out=bucket.flat)
        bucket.unpack()

    def local_step(self, bucket: Bucket) -> None:
        grads = [p.grad for p in self.context.params]
        self.context.optimizer.state_manager.apply_gradients(grads)
        bucket.pack()

    def exchange(self, bucket: Bucket) -> None:
        assert self._x_before is not None
        codec = self.algorithm.codec
        message = codec.compress(bucket.flat - self._x_before)
        delta = codec.decompress(message)
        torch.add(self._x_before, delta.to(bucket.flat.dtype), out=bucket.flat)
        bucket.unpack()
        with self._lock:
            self.seq += 1
            seq = self.seq
            queues = list(self._subscribers.items())
        for peer, queue in queues:
            if queue.qsize() >= MAX_QUEUED_PUSHES:
                self._loop.submit(self._drop_subscriber(peer, "it fell too far behind"))
            else:
                self._loop.submit(_put(queue, (seq, message)))

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
        try:
            response = self._loop.run(
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
            self.neighbours[peer] = _Neighbour(replica, seq + 1)
        logger.debug(f"{self.peer_id}: replica of {peer} synchronized at difference {seq}")
        return True

    def _ping(self, peer: str) -> bool:
        try:
            self._loop.run(
                self._client.call(
                    PeerID.from_base58(peer), "ping", Message({}), timeout=self.algorithm.request_timeout
                ),
                timeout=self.algorithm.request_timeout + 1,
            )
        except (HivemindExtError, TimeoutError):
            return False
        if peer in self.neighbours:
            self.neighbours[peer].last_heard = time.monotonic()
        return True

    # ----- the service (loop thread)

    async def _start(self) -> None:
        dht = self.context.dht
        maddr = await dht.run_coroutine(_daemon_listen_maddr, return_future=True)
        self._p2p = await P2P.replicate(maddr)
        namespace = f"decsgd.{self.context.prefix('x')}"
        limits = Limits(max_payload_bytes=8 * self.numel + (1 << 20))
        config = HandlerConfig(limits=limits, max_timeout=60.0, max_concurrent_calls=64)
        self._server = RPCServer(self._p2p, namespace, config=config)
        self._client = RPCClient(self._p2p, namespace, limits=limits, default_timeout=self.algorithm.request_timeout)
        self._tasks = TaskOwner(f"decentralized-sgd[{self.context.key}]")
        await self._server.add_unary("subscribe", self._handle_subscribe)
        await self._server.add_unary("push", self._handle_push)
        await self._server.add_unary("ping", self._handle_ping)

    async def _handle_ping(self, request: Message, ctx: RPCContext) -> Message:
        return Message({"ok": True})

    async def _handle_subscribe(self, request: Message, ctx: RPCContext) -> Message:
        if request.header.get("numel") != self.numel:
            raise ProtocolError(f"this model has {self.numel} values, not {request.header.get('numel')!r}")
        peer = ctx.peer_id.to_base58()
        params = self.context.params
        with self._lock:  # the snapshot and the sequence number must match
            with self.context.optimizer.state_lock:
                flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])
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
        peer = ctx.peer_id.to_base58()
        seq = request.header.get("seq")
        if isinstance(seq, bool) or not isinstance(seq, int):
            raise ProtocolError("a push needs an integer sequence number")
        delta = _decoded(request, self.numel)
        with self._lock:
            neighbour = self.neighbours.get(peer)
            if neighbour is None:
                raise ProtocolError("not subscribed to this peer")
            if seq < neighbour.next_seq:
                return Message({"ok": True, "duplicate": True})
            if seq > neighbour.next_seq:
                neighbour.needs_resync = True  # a difference was lost: download the model again
                return Message({"ok": False, "resync": True})
            neighbour.replica.add_(delta.to(neighbour.replica.device))
            neighbour.next_seq += 1
            neighbour.last_heard = time.monotonic()
        return Message({"ok": True})

    async def _send_to(self, peer: str, queue: asyncio.Queue) -> None:
        failures = 0
        while True:
            item = await queue.get()
            if item is None:
                return
            seq, message = item
            try:
                await self._client.call(
                    PeerID.from_base58(peer),
                    "push",
                    pack_tensor(message, seq=seq),
                    timeout=self.algorithm.request_timeout,
                )
                self.bytes_pushed += len(message.payload_view())
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
        if self._tasks is not None:
            await self._tasks.aclose(timeout=5)
        for stop in (self._server.shutdown(timeout=2), self._p2p.shutdown()):
            try:
                await stop
            except HivemindExtError as e:
                logger.debug(f"error while stopping decentralized SGD: {e}")

    def shutdown(self) -> None:
        if not self._loop.alive:
            return
        try:
            self._loop.run(self._stop(), timeout=10)
        except (HivemindExtError, TimeoutError) as e:
            logger.debug(f"decentralized SGD did not stop cleanly: {e!r}")
        finally:
            self._loop.stop(timeout=5)


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


async def _daemon_listen_maddr(_dht: Any, node: Any) -> Any:
    return node.p2p.daemon_listen_maddr
