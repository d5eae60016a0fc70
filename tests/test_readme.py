"""Every ```python block of the README runs as written.

A block may use the names a reader brings (``INITIAL_PEERS``, ``PEERS``, ``model``, ``data``,
``compute_loss``: the README says they are the reader's); the test binds them to small real objects on
127.0.0.1. The averaging block needs two peers, as the README says: it runs on two peers at once.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import hivemind
import pytest
import torch
from swarm import addresses, new_peer

README = Path(__file__).resolve().parent.parent / "README.md"
# the names a block may use without defining them, and the blocks that need several peers at once
READER_NAMES = {"INITIAL_PEERS", "PEERS", "model", "data", "compute_loss"}
PEERS_NEEDED = {"DecentralizedAverager(": 2}


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", README.read_text(), flags=re.S)


def block_id(block: str) -> str:
    first = next(line for line in block.splitlines() if line.startswith(("from hivemind_ext", "import hivemind")))
    return f"{first[:40]}...{len(block)}"


def reader_names(initial_peers: list[str]) -> dict[str, Any]:
    model = torch.nn.Linear(8, 2)
    return {
        "INITIAL_PEERS": initial_peers,
        "PEERS": initial_peers,
        "model": model,
        "data": [(torch.randn(32, 8), torch.randint(0, 2, (32,))) for _ in range(3)],
        "compute_loss": lambda model, batch: torch.nn.functional.cross_entropy(model(batch[0]), batch[1]),
    }


def shut_down(namespace: dict[str, Any]) -> None:
    """Stops what a block started and left running (a block ends where a reader's script goes on)."""
    from hivemind_ext import Optimizer

    for value in namespace.values():
        if isinstance(value, Optimizer):
            value.shutdown()
    for value in namespace.values():
        if isinstance(value, hivemind.DHT):
            value.shutdown()


def run_block(block: str, initial_peers: list[str]) -> dict[str, Any]:
    namespace = reader_names(initial_peers)
    try:
        exec(compile(block, str(README), "exec"), namespace)
    finally:
        shut_down(namespace)
    return namespace


def test_the_readme_has_the_blocks_this_test_knows() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert any("CompressedTensor.from_bytes" in block for block in blocks)
    assert any("DecentralizedAverager(" in block for block in blocks)
    averaging = README.read_text().split("## Averaging\n")[1].split("```python")[0]
    assert "two or more peers" in averaging  # the block cannot run alone, and the README says so


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("block", python_blocks(), ids=block_id)
def test_python_block_runs_as_written(block: str) -> None:
    peers = max([count for marker, count in PEERS_NEEDED.items() if marker in block] or [1])
    bootstrap = new_peer()
    try:
        initial_peers = addresses(bootstrap)
        if peers == 1:
            run_block(block, initial_peers)
            return
        results: list[dict[str, Any]] = []
        errors: list[BaseException] = []

        def one_peer() -> None:
            try:
                results.append(run_block(block, initial_peers))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=one_peer) for _ in range(peers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=150)
        assert not any(thread.is_alive() for thread in threads), "a peer's block did not finish"
        assert not errors, errors
        # every peer averaged with the other: the gather data names both
        assert all(len(result["gathered"]) == peers for result in results), [r["gathered"] for r in results]
    finally:
        bootstrap.shutdown()


def test_the_compression_block_shows_two_valid_frames() -> None:
    """``header_bytes() + payload_view()`` (what the README once said) is not a frame for ``from_bytes``;
    the two parts rebuild the message with ``from_wire``."""
    from hivemind_ext.compression import CompressedTensor, MinMaxUInt8, decompress
    from hivemind_ext.errors import CompressionError

    (block,) = [block for block in python_blocks() if "CompressedTensor" in block]
    assert "header_bytes() + message.payload_view()" not in block and "from_wire(" in block
    message = MinMaxUInt8(chunk_size=64).compress(torch.randn(1000))
    parts = message.header_bytes() + bytes(message.payload_view())
    with pytest.raises(CompressionError):  # the first 4 bytes of the header are read as its length
        decompress(CompressedTensor.from_bytes(parts))
    namespace = run_block(block, [])
    assert torch.equal(namespace["restored"], decompress(CompressedTensor.from_bytes(namespace["frame"])))
