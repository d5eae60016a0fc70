"""hivemind_ext: train one PyTorch model together with volunteers over the internet.

A drop-in replacement for ``hivemind.Optimizer`` built on hivemind's DHT and libp2p daemon, with
its own averaging, compression and training algorithms.
"""

from hivemind_ext import compression, errors
from hivemind_ext.errors import HivemindExtError
from hivemind_ext.optim import GradScaler, Optimizer

__version__ = "0.1.0"

__all__ = ["GradScaler", "HivemindExtError", "Optimizer", "__version__", "compression", "errors"]
