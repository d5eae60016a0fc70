"""PyTorch Lightning with hivemind_ext: a Trainer per peer, one model trained together.

Each peer is an ordinary ``lightning.Trainer`` fitting a small MLP on its shard of scikit-learn's
digits; ``HivemindExtStrategy`` makes its optimizer a ``hivemind_ext.Optimizer``, so the peers
average their gradients every ``--target-batch-size`` samples (one swarm epoch) and take the same
step. By default this starts a local swarm of ``--peers`` processes on 127.0.0.1 and prints each
peer's held-out accuracy once the swarm reached ``--epochs``::

    python examples/lightning_digits.py                        # 2 peers, 10 swarm epochs
    python examples/lightning_digits.py --peers 3 --epochs 20

Join a running swarm as one more peer with the multiaddrs that the first peer prints::

    python examples/lightning_digits.py --initial-peers /ip4/127.0.0.1/tcp/41234/p2p/12D3KooW...

Needs lightning and scikit-learn (``pip install -e ".[lightning,examples]"``).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys
import time
import warnings

import hivemind
import lightning.pytorch as pl
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Subset, TensorDataset

from hivemind_ext.integrations.lightning import HivemindExtStrategy, StopAtSwarmEpoch


class DigitsClassifier(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)  # hivemind_ext.Optimizer wraps this one


class WaitForPeers(pl.Callback):
    """Starts training once the swarm has ``num_peers`` peers (else the first one trains alone for a while)."""

    def __init__(self, num_peers: int, timeout: float) -> None:
        self.num_peers, self.timeout = num_peers, timeout

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        tracker = trainer.strategy.optimizer.tracker
        give_up = time.monotonic() + self.timeout
        while tracker.global_progress.num_peers < self.num_peers and time.monotonic() < give_up:
            time.sleep(0.1)


def digits_split() -> tuple[TensorDataset, TensorDataset]:
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x / 16.0, y, test_size=0.2, random_state=0, stratify=y)
    return tuple(  # type: ignore[return-value]
        TensorDataset(torch.tensor(x, dtype=torch.float32), torch.tensor(y))
        for x, y in ((x_train, y_train), (x_test, y_test))
    )


def train_peer(args: argparse.Namespace, dht: hivemind.DHT, shard: int) -> str:
    """Fits one Trainer until the swarm reaches ``args.epochs``; returns the line that reports it."""
    torch.manual_seed(args.seed)  # every peer starts from the same parameters
    model = DigitsClassifier(lr=args.lr)
    train, test = digits_split()
    indices = list(range(shard % args.peers, len(train), args.peers))
    data = DataLoader(Subset(train, indices), batch_size=args.batch_size, shuffle=True)
    strategy = HivemindExtStrategy(
        dht=dht,
        run_id=args.run_id,
        target_batch_size=args.target_batch_size,
        matchmaking_time=3.0,
        averaging_timeout=30.0,
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_epochs=10_000,  # the Trainer's epochs are local passes over the shard: stop on the swarm's
        callbacks=[WaitForPeers(args.peers, timeout=60.0), StopAtSwarmEpoch(args.epochs)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, data)
    x, y = test.tensors
    with torch.no_grad():
        accuracy = float((model(x).argmax(dim=1) == y).float().mean())
    return (
        f"peer {shard}: held-out accuracy {accuracy:.4f} at swarm epoch {strategy.optimizer.local_epoch} "
        f"({trainer.global_step} local steps, {trainer.current_epoch} passes over its shard)"
    )


def run_local_swarm(args: argparse.Namespace, dht: hivemind.DHT) -> int:
    """This process is peer 0; peers 1.. are child processes that join through its DHT."""
    maddrs = [str(addr) for addr in dht.get_visible_maddrs()]
    print(f"join with: python {sys.argv[0]} --initial-peers {maddrs[0]} --epochs {args.epochs}", flush=True)
    common = ["--run-id", args.run_id, "--epochs", str(args.epochs), "--peers", str(args.peers)]
    children = [
        subprocess.Popen(
            [sys.executable, __file__, "--initial-peers", *maddrs, "--shard", str(i), *common],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(1, args.peers)
    ]
    lines = [train_peer(args, dht, shard=0)]
    for child in children:
        try:
            stdout, _ = child.communicate(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            child.kill()
            stdout, _ = child.communicate()
        lines += [line for line in stdout.splitlines() if line.startswith("peer ")]
    print("\n".join(lines))
    accuracies = [float(line.split("accuracy ")[1].split()[0]) for line in lines]
    print(f"held-out accuracy: {statistics.mean(accuracies):.4f} (mean of {len(accuracies)} peers)")
    failed = [child.args for child in children if child.returncode != 0]
    return 1 if failed or len(accuracies) != args.peers else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=2, help="peers in the swarm (default: %(default)s)")
    parser.add_argument("--epochs", type=int, default=10, help="swarm epochs to train (default: %(default)s)")
    parser.add_argument("--target-batch-size", type=int, default=256, help="samples per swarm epoch (default: 256)")
    parser.add_argument("--batch-size", type=int, default=16, help="each peer's batch (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=0.01, help="Adam's learning rate (default: %(default)s)")
    parser.add_argument("--run-id", default="lightning_digits", help="the swarm's name (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialization (the same on every peer)")
    parser.add_argument("--initial-peers", nargs="*", default=[], help="multiaddrs of a peer to join through")
    parser.add_argument("--host-maddrs", nargs="*", default=["/ip4/127.0.0.1/tcp/0"], help="where to listen")
    parser.add_argument("--shard", type=int, default=None, help="which 1/peers of the data to train on")
    parser.add_argument("--timeout", type=float, default=300.0, help="give up on child peers after this long")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)  # a tiny model: more threads only contend on a small machine
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # lightning's own use of a torch API
    dht = hivemind.DHT(initial_peers=args.initial_peers, host_maddrs=args.host_maddrs, start=True)
    try:
        if args.initial_peers:  # one more peer of a running swarm
            print(train_peer(args, dht, shard=args.shard if args.shard is not None else 0), flush=True)
            return 0
        return run_local_swarm(args, dht)
    finally:
        dht.shutdown()


if __name__ == "__main__":
    sys.exit(main())
