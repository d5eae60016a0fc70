"""Train a real model with a local swarm of peers: hivemind_ext.Optimizer on scikit-learn's bundled digits.

What it does. By default this starts a swarm of 4 peer processes on this machine (127.0.0.1 only,
nothing leaves it), one of them in client mode (it accepts no incoming connections, like a peer
behind a firewall). The first peer's DHT is the bootstrap of the others. Every peer trains the same
small MLP on its own shard of the digits images (8x8 pixels, 10 classes) with a collaborative
``Optimizer``: each peer feeds batches of 16, the swarm accumulates 256 samples between global
updates (one "epoch"), then averages gradients and takes one Adam step together. After 20 epochs
every peer reports its accuracy on held-out images it never trained on, e.g.::

    epoch 20/20 | samples 0/256 | 1164 samples/s | peers online 4 (1 client mode) | loss 0.837 | held-out accuracy 0.908
    all 4 peers were up 30.6 s after the launch
    peer 0: held-out accuracy 0.914 | 320 steps, 5120 samples, 81% of the time in opt.step()
    ...
    peer 3 (client mode): held-out accuracy 0.914 | 60 steps, 960 samples, 100% of the time in opt.step()
    training took 13.1 s from the start to the last peer at the goal epoch; 44.6 s in all
    held-out accuracy: 0.9083 (mean of 4 peers, min 0.8944, max 0.9139)

(figures of hivemind.Optimizer on two busy CPU cores; most of the minute goes into starting the
peers). The exit code is 0 only if every peer reached the last epoch; peers that crash or hang are
reported and the run exits with 1.

How to run::

    python examples/train_digits.py                              # 4 peers (1 in client mode), 20 epochs
    python examples/train_digits.py --peers 8 --clients 3 --epochs 30
    python examples/train_digits.py --optimizer hivemind         # the same run with hivemind.Optimizer

Join a running swarm as one more peer (from another terminal, or another machine when the swarm
listens on a reachable address): the swarm prints the multiaddrs of its first peer, pass them here::

    python examples/train_digits.py --initial-peers /ip4/127.0.0.1/tcp/41234/p2p/12D3KooW... --run-id digits ...

(the swarm prints this command in full, with every setting that must match: ``--run-id``, ``--epochs``,
``--target-batch-size``, ...; add ``--client-mode`` behind NAT). ``hivemind-ext train`` and
``hivemind-ext join`` run the same code from the installed package; see the README's "Training across
machines".

A joining peer downloads the current model and optimizer state from the swarm, trains on a seeded
shuffle of the whole train split until the swarm reaches ``--epochs``, and prints its own
multiaddrs so that further peers can join through it.

Needs scikit-learn (``pip install -e ".[examples]"``). Ctrl-C stops every peer process within a second or two.
"""

from __future__ import annotations

from hivemind_ext.demo.commands import example_main, exit_now

if __name__ == "__main__":
    exit_now(example_main(description=__doc__))
