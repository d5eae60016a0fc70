"""What the local swarm's fork server imports before it forks the first peer (and only the fork
server imports this module): torch, hivemind and the peer code, so that each peer starts in a second
instead of importing them itself.

The fork server outlives the launcher by its own teardown: freeing torch's and hivemind's modules
takes seconds on a busy machine. It has nothing to clean up (its peers are gone, the launcher owns
its socket), so it exits at once. Peers forked from it never run this handler: multiprocessing ends a
child with ``os._exit``.
"""

from __future__ import annotations

import atexit
import os
import sys

import hivemind  # noqa: F401
import torch  # noqa: F401

import hivemind_ext.demo.local_swarm
import hivemind_ext.optim  # noqa: F401


def _exit_at_once() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


atexit.register(_exit_at_once)
