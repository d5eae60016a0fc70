"""The digits demo: a small swarm that trains a digit classifier with a collaborative Optimizer.

It backs ``hivemind-ext train`` / ``hivemind-ext join`` and ``examples/train_digits.py``, and the
benchmarks reuse its peers so that they run exactly the same training:

- :mod:`.data`: scikit-learn's bundled digits (an optional extra: ``pip install hivemind-ext[examples]``),
  the MLP every peer trains and its held-out accuracy;
- :mod:`.peer`: one peer (a DHT, an ``Optimizer``, the training loop);
- :mod:`.local_swarm`: peer processes on this machine, started together and always cleaned up;
- :mod:`.display`: the progress line;
- :mod:`.options` and :mod:`.commands`: the command line of the example and of the CLI.
"""
