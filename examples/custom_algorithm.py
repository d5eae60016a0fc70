"""Write your own training algorithm: periodic model averaging (local SGD) in ~40 lines.

hivemind_ext lets you decide what peers communicate, when, and how the model is updated, through
the Algorithm API (``hivemind_ext.optim.algorithms``). An :class:`Algorithm` holds the
hyperparameters; ``reify(context)`` returns an :class:`AlgorithmImpl` bound to one optimizer, whose
hooks ``Optimizer.step()`` calls in this order::

    on_backward(batch_size)      -> here: a local optimizer step on this peer's gradients
    should_communicate()         -> here: every `period` local steps
    (bucket operations)          -> here: average the parameters with the swarm, in float16
    optimizer_step()             -> here: nothing (the averaged parameters are the update)
    on_optimizer_step()          -> here: reset the sample counter

This script starts a small swarm of peers as threads of one process (each peer with its own
hivemind DHT on 127.0.0.1), trains a digit classifier (scikit-learn's bundled digits) with the
algorithm below, and prints each peer's held-out accuracy and how often it communicated::

    python examples/custom_algorithm.py --peers 3 --steps 150 --period 10
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import hivemind
import torch

import hivemind_ext
from hivemind_ext.compression import Float16Compression
from hivemind_ext.demo.data import accuracy, load_data, make_model  # the digits demo's data and model
from hivemind_ext.optim.algorithms import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket


class PeriodicAveraging(Algorithm):
    """Local SGD: every peer steps on its own gradients; every ``period`` steps, peers average their
    parameters (weighted by the samples each processed since the last average)."""

    def __init__(self, period: int = 10, codec: object = None) -> None:
        self.period = period
        self.codec = codec if codec is not None else Float16Compression()

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        return PeriodicAveragingImpl(context, self)


class PeriodicAveragingImpl(AlgorithmImpl):
    def __init__(self, context: AlgorithmContext, algorithm: PeriodicAveraging) -> None:
        super().__init__(context)
        self.algorithm = algorithm
        self.local_steps = 0

    def init_tensors(self) -> list:
        # what is communicated: the parameters themselves (the default would be the gradients)
        return [(f"param{i}", p) for i, p in enumerate(self.context.params)]

    def init_operations(self, bucket: Bucket) -> None:
        # how: one weighted average per bucket, compressed to float16 on the wire
        bucket.append_average(self.algorithm.codec, weight=lambda: float(max(self.samples, 1)))

    def on_backward(self, batch_size: int) -> None:
        # a local step with this peer's gradients (the optimizer's lock keeps state downloads out)
        with self.context.state_lock:
            self.context.state.apply_gradients([p.grad for p in self.context.params])
        self.samples += batch_size
        self.local_steps += 1

    def should_communicate(self) -> bool:
        # when: every `period` local steps
        return self.local_steps % self.algorithm.period == 0

    def optimizer_step(self) -> None:
        pass  # the averaged parameters were written back into the model: nothing else to do

    def on_optimizer_step(self) -> None:
        self.samples = 0


def train(index: int, dht: hivemind.DHT, args: argparse.Namespace, results: dict) -> None:
    data = load_data().shard(index, args.peers, seed=0)
    model = make_model(seed=0)
    opt = hivemind_ext.Optimizer(
        dht=dht,
        run_id="custom_algorithm_example",
        target_batch_size=args.batch_size * args.peers * args.period,
        batch_size_per_step=args.batch_size,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        params=model.parameters(),
        offload_optimizer=False,
        matchmaking_time=0.5,
        averaging_timeout=15.0,
        algorithm=args.algorithm,
    )
    generator = torch.Generator().manual_seed(index)
    x_all, y_all = torch.from_numpy(data.train_x), torch.from_numpy(data.train_y)
    try:
        for _ in range(args.steps):
            batch = torch.randint(len(y_all), (args.batch_size,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x_all[batch]), y_all[batch])
            loss.backward()
            opt.step()
            opt.zero_grad()
        runner = opt.algorithm_runner
        results[index] = (accuracy(model, data.test_x, data.test_y), runner.rounds, runner.failed_rounds)
    finally:
        opt.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=3, help="peers in the local swarm (threads)")
    parser.add_argument("--steps", type=int, default=150, help="local steps per peer")
    parser.add_argument("--period", type=int, default=10, help="average the parameters every this many steps")
    parser.add_argument("--batch-size", type=int, default=16, help="samples per local step")
    args = parser.parse_args(argv)
    args.algorithm = PeriodicAveraging(period=args.period)  # one Algorithm object serves every peer's model
    torch.set_num_threads(1)
    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    initial_peers = [str(a) for a in dhts[0].get_visible_maddrs()]
    dhts += [
        hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers)
        for _ in range(args.peers - 1)
    ]
    results: dict[int, tuple[float, int, int]] = {}
    started = time.monotonic()
    try:
        threads = [threading.Thread(target=train, args=(i, dht, args, results)) for i, dht in enumerate(dhts)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        for dht in dhts:
            dht.shutdown()
    for index in sorted(results):
        acc, rounds, failed = results[index]
        print(f"peer {index}: held-out accuracy {acc:.3f}, {rounds} averaging rounds ({failed} failed)")
    print(f"done in {time.monotonic() - started:.1f} s")
    return 0 if len(results) == args.peers else 1


if __name__ == "__main__":
    sys.exit(main())
