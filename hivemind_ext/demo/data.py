"""The digits data and model: scikit-learn's bundled ``load_digits`` (1797 images of 8x8 pixels,
10 classes), split into a train and a held-out test part with a fixed seed, and a two-layer MLP
(64 -> 128 -> 10) with the same initial weights on every peer."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

EXTRA_HINT = 'pip install "hivemind-ext[examples]"'


class MissingExtraError(ImportError):
    """An optional dependency of the demo is not installed; the message says how to install it."""


@dataclass(frozen=True)
class DigitsData:
    """Inputs scaled to [0, 1] as float32 rows of 64 pixels, labels as int64."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    def shard(self, index: int, count: int, seed: int) -> DigitsData:
        """The ``index``-th of ``count`` disjoint train shards (a seeded shuffle dealt round-robin); same test part."""
        order = np.random.default_rng(seed).permutation(len(self.train_y))[index::count]
        return replace(self, train_x=self.train_x[order], train_y=self.train_y[order])


def require_sklearn() -> None:
    """Raises :class:`MissingExtraError` (one line, with the install command) without scikit-learn."""
    try:
        import sklearn  # noqa: F401
    except ImportError as e:
        raise MissingExtraError(f"the digits demo needs scikit-learn: {EXTRA_HINT}") from e


def load_data(seed: int = 0, test_fraction: float = 0.2) -> DigitsData:
    """scikit-learn's bundled digits, split into train and held-out test parts (stratified, seeded)."""
    require_sklearn()
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    train_x, test_x, train_y, test_y = train_test_split(x, y, test_size=test_fraction, random_state=seed, stratify=y)
    return DigitsData(train_x, train_y, test_x, test_y)


def make_model(seed: int = 0) -> Any:
    """The MLP every peer trains; the seed fixes its initial weights, so all peers start from the same point."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def accuracy(model: Any, x: np.ndarray, y: np.ndarray) -> float:
    import torch

    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(dim=1)
    return float((predicted == torch.from_numpy(y)).float().mean())
