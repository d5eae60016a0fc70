"""Command-line options of the digits demo, shared by ``hivemind-ext train`` / ``join`` and
``examples/train_digits.py``, and the "join with" command that the first peer prints.

Every setting in :data:`MUST_MATCH` has to be the same on every peer of a run; the join command
carries all of them, so that it works as printed.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Sequence
from typing import Any

from hivemind_ext.demo.peer import ALONE_TIMEOUT, LOOPBACK, OPTIMIZERS

ALL_INTERFACES = ("/ip4/0.0.0.0/tcp/0",)
# (option, attribute) of the settings every peer of one run must share
MUST_MATCH = (
    ("--run-id", "run_id"),
    ("--epochs", "epochs"),
    ("--target-batch-size", "target_batch_size"),
    ("--optimizer", "optimizer"),
    ("--lr", "lr"),
    ("--matchmaking-time", "matchmaking_time"),
    ("--averaging-timeout", "averaging_timeout"),
    ("--seed", "seed"),
)


class OneLineErrorParser(argparse.ArgumentParser):
    """Reports a bad argument in one line (``prog: error: ...``), without the long usage text."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def multiaddr(text: str) -> str:
    from hivemind.utils.multiaddr import Multiaddr

    try:
        Multiaddr(text)
    except Exception as e:
        raise argparse.ArgumentTypeError(f"not a valid multiaddr: {' '.join(str(e).split())}") from e
    return text


def peer_multiaddr(text: str) -> str:
    """A multiaddr that names its peer (``.../p2p/12D3KooW...``), as a running peer prints it."""
    multiaddr(text)
    if "/p2p/" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} must end with /p2p/<peer id>, as the first peer prints it")
    return text


def is_loopback(maddr: str) -> bool:
    return maddr.startswith(("/ip4/127.", "/ip6/::1/"))


def add_swarm_options(parser: argparse.ArgumentParser) -> None:
    swarm = parser.add_argument_group("the local swarm")
    swarm.add_argument("--peers", type=int, default=4, help="peer processes to start (default: %(default)s)")
    swarm.add_argument(
        "--clients",
        type=int,
        default=None,
        help="how many of them run in client mode, the last ones (default: 1, or 0 with --peers 1)",
    )
    swarm.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="give up on peers not done this many seconds after the start (default: 300)",
    )


def add_network_options(parser: argparse.ArgumentParser, *, joining: bool, initial_peers_required: bool) -> None:
    network = parser.add_argument_group("network")
    if joining:
        network.add_argument(
            "--initial-peers",
            nargs="+",
            type=peer_multiaddr,
            required=initial_peers_required,
            metavar="MULTIADDR",
            help="multiaddrs of peers already in the swarm (the first peer prints them); run as one peer that joins",
        )
        network.add_argument("--client-mode", action="store_true", help="accept no incoming connections (behind NAT)")
        network.add_argument(
            "--alone-timeout",
            type=float,
            default=ALONE_TIMEOUT,
            metavar="SECONDS",
            help="when joining: give up, with an error, after this long without another peer of the run online "
            "(the swarm has ended or the initial peers are gone) (default: %(default)g)",
        )
    network.add_argument(
        "--host-maddrs",
        nargs="+",
        type=multiaddr,
        default=None,
        metavar="MULTIADDR",
        help="where the (first) peer listens, e.g. /ip4/0.0.0.0/tcp/45555 to be reachable from other machines "
        "(default: /ip4/127.0.0.1/tcp/0; when joining peers on other machines, /ip4/0.0.0.0/tcp/0)",
    )
    network.add_argument(
        "--announce-maddrs",
        nargs="+",
        type=multiaddr,
        default=None,
        metavar="MULTIADDR",
        help="addresses other peers should dial, e.g. a public IP with a forwarded port: /ip4/203.0.113.7/tcp/45555",
    )


def add_training_options(parser: argparse.ArgumentParser) -> None:
    training = parser.add_argument_group("training (run id to seed: the same on every peer of a run)")
    training.add_argument("--run-id", default="digits", help="name of the run, shared by its peers (default: digits)")
    training.add_argument("--epochs", type=int, default=20, help="global epochs to train (default: %(default)s)")
    training.add_argument(
        "--target-batch-size",
        type=int,
        default=256,
        help="samples the swarm accumulates per epoch, i.e. per global optimizer step (default: %(default)s)",
    )
    training.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="hivemind_ext",
        help="hivemind_ext.Optimizer or hivemind.Optimizer, the same keywords (default: %(default)s)",
    )
    training.add_argument("--lr", type=float, default=0.01, help="Adam learning rate (default: %(default)s)")
    training.add_argument(
        "--matchmaking-time", type=float, default=1.5, help="seconds to gather a group (default: %(default)s)"
    )
    training.add_argument(
        "--averaging-timeout",
        type=float,
        default=10.0,
        help="seconds before an averaging round is given up (default: 10)",
    )
    training.add_argument("--seed", type=int, default=0, help="data split, shards and batch order (default: 0)")
    peer = parser.add_argument_group("this peer (may differ between peers)")
    peer.add_argument("--batch-size", type=int, default=16, help="samples per local step (default: 16)")
    peer.add_argument(
        "--compute-time",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long per local step on top of the real work, to act like a bigger model (default: 0)",
    )
    peer.add_argument("--verbose", action="store_true", help="let the optimizer log its internal events")
    peer.add_argument(
        "--log-level",
        default="error",
        choices=["debug", "info", "warning", "error"],
        help="of hivemind's and hivemind_ext's loggers in every peer (default: error; --verbose needs info)",
    )


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Cross-field checks and the defaults that depend on other options."""
    joining = getattr(args, "initial_peers", None) is not None
    if not joining and hasattr(args, "peers"):
        if args.clients is None:
            args.clients = 1 if args.peers > 1 else 0
        if args.peers < 1 or not 0 <= args.clients < args.peers:
            parser.error("need --peers >= 1 and 0 <= --clients < --peers (the first peer is the bootstrap)")
    if args.epochs < 1 or args.batch_size < 1 or args.target_batch_size < 1 or args.compute_time < 0:
        parser.error("--epochs, --batch-size and --target-batch-size must be positive, --compute-time not negative")
    if getattr(args, "alone_timeout", 1.0) <= 0:
        parser.error("--alone-timeout must be positive")
    if args.host_maddrs is None:
        remote = joining and not all(is_loopback(maddr) for maddr in args.initial_peers)
        args.host_maddrs = list(ALL_INTERFACES if remote else LOOPBACK)
    return args


def join_command(prefix: Sequence[str], maddrs: Sequence[str], args: argparse.Namespace) -> str:
    """The command that joins this run: the reachable ``maddrs`` of its first peer and every setting that must
    match. Loopback addresses are left out when the peer has others (they name the joiner's own machine)."""
    reachable = [maddr for maddr in maddrs if not is_loopback(maddr)] or list(maddrs)
    words = [*prefix, "--initial-peers", *reachable]
    for option, name in MUST_MATCH:
        words += [option, str(getattr(args, name))]
    return shlex.join(words)


def python_command() -> list[str]:
    """How to start this Python from a shell: ``python`` when that name on PATH is this interpreter's."""
    name = os.path.basename(sys.executable)
    return [name] if shutil.which(name) else [sys.executable]
