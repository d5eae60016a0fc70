"""A one-process model of scale.py's digits case (issue 14), without the network: the same 16 peers,
MLP, batches, Adam and lockstep epochs as :mod:`scale_training`, their rounds computed here.

Per epoch: every peer's mean gradient over its ``steps_per_epoch`` batches; ``hops`` gradient rounds
in rotating groups (the rule of ``hivemind_ext.averaging.matchmaking.rotation`` applied to the whole
swarm at once, every group full: hashed coordinates, shards, the deal), each group averaging the
means weighted by the samples they cover; every peer's Adam step on its own result; then a parameter
round in the next rotating groups (the Optimizer's state round). "one group": one round of all 16.
Prints the held-out loss of each case (mean over the peers' models), its ratio to one group's, and
the spread of parameters (as scale_training measures it), per seed and on average.

    python benchmarks/scale_hops_sim.py --seeds 5
"""

from __future__ import annotations

import argparse
import hashlib
import statistics

import torch
from algorithms import BatchStream, evaluate
from common import load_digits
from scale_training import relative_spread, small_model

from hivemind_ext.averaging.matchmaking.rotation import initial_digits, next_digits, rotation_groups, shard_depth


def rotate(coordinates: dict[int, tuple[int, ...]], base: int, salt: str) -> list[list[int]]:
    """One round's groups for the whole swarm; moves every member's coordinates as its group deals."""
    groups = rotation_groups(coordinates, base=base, depth=shard_depth(len(coordinates), base))
    for members in groups:
        group_id = hashlib.sha256(f"{salt}/{members}".encode()).digest()
        for index, peer in enumerate(members):
            coordinates[peer] = next_digits(coordinates[peer], group_id, index, len(members), base)
    return groups


def run_case(
    *, peers: int, group: int | None, hops: int, epochs: int, batch: int, steps: int, seed: int, lr: float
) -> dict[str, float]:
    data = load_digits()
    models = [small_model() for _ in range(peers)]
    optimizers = [torch.optim.Adam(m.parameters(), lr=lr) for m in models]
    streams = [BatchStream(data, 100 * seed + i, batch) for i in range(peers)]
    coordinates = {i: initial_digits(f"seed{seed}-peer{i}", group) for i in range(peers)} if group else {}
    for epoch in range(epochs):
        grads = []
        for model, stream in zip(models, streams, strict=True):
            model.zero_grad()
            for _ in range(steps):
                x, y = stream.next_batch()
                (torch.nn.functional.cross_entropy(model(x), y) * len(x)).backward()
            grads.append([p.grad.detach().clone() / (batch * steps) for p in model.parameters()])
        weights = [float(batch * steps)] * peers
        rounds = (
            [[list(range(peers))]]
            if group is None
            else [rotate(coordinates, group, f"{epoch}/{h}") for h in range(hops)]
        )
        for groups in rounds:
            for members in groups:
                total = sum(weights[i] for i in members)
                mean = [sum(grads[i][k] * weights[i] for i in members) / total for k in range(len(grads[0]))]
                for i in members:
                    grads[i], weights[i] = [t.clone() for t in mean], total
        for model, opt, grad in zip(models, optimizers, grads, strict=True):
            for p, g in zip(model.parameters(), grad, strict=True):
                p.grad = g
            opt.step()
        state_groups = [list(range(peers))] if group is None else rotate(coordinates, group, f"{epoch}/state")
        with torch.no_grad():
            for members in state_groups:
                for tensors in zip(*(list(models[i].parameters()) for i in members), strict=True):
                    mean = torch.stack(tensors).mean(0)
                    for t in tensors:
                        t.copy_(mean)
    losses = [evaluate(m, data)[0] for m in models]
    params = [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]
    return dict(loss=statistics.mean(losses), spread=relative_spread(params))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers", type=int, default=16)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--hops", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    common = dict(peers=args.peers, epochs=args.epochs, batch=8, steps=2, lr=0.01)
    ratios: dict[int, list[float]] = {h: [] for h in args.hops}
    for seed in range(args.seeds):
        whole = run_case(group=None, hops=1, seed=seed, **common)
        line = f"seed {seed}: one group loss {whole['loss']:.4f}"
        for hops in args.hops:
            grouped = run_case(group=args.group, hops=hops, seed=seed, **common)
            ratios[hops].append(grouped["loss"] / whole["loss"])
            line += f"; groups of {args.group}, {hops} hop(s): loss {grouped['loss']:.4f} "
            line += f"(ratio {ratios[hops][-1]:.4f}, spread {grouped['spread']:.4f})"
        print(line, flush=True)
    for hops, values in ratios.items():
        print(f"{hops} hop(s): ratio mean {statistics.mean(values):.4f}, range {min(values):.4f}-{max(values):.4f}")


if __name__ == "__main__":
    main()
