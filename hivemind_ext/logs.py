"""Where the library's log records go when the user has not said: ``verbose=True`` must be seen.

Every module logs to ``logging.getLogger(__name__)``, so the loggers form one tree under the package
logger ``hivemind_ext`` (one subtree per subsystem: ``hivemind_ext.optim``, ``hivemind_ext.averaging.
matchmaking``, ... see the README's "Logging" section). A library should not configure logging, but
``Optimizer(verbose=True)`` promises status lines on the console, as hivemind's does (hivemind installs
its own handler on its ``hivemind`` logger at import). :func:`use_default_handler` keeps that promise
with the least intrusion:

- it adds one stderr handler to the package logger, only if neither that logger nor the root logger
  has a handler (a user who configured logging keeps full control), and lowers the package logger to
  INFO only if no level was set on it;
- records still propagate to the root logger, and the handler stays silent for as long as the root
  logger has handlers of its own: a user who calls ``logging.basicConfig()`` after building the
  Optimizer sees each record once, from their own handler.

The handler writes through ``tqdm.write`` so that its lines do not break a progress bar being drawn on
the same stream (:mod:`hivemind_ext.optim.progress_bar`).
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import TextIO

import tqdm

PACKAGE_LOGGER = "hivemind_ext"
FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%b %d %H:%M:%S"

_install_lock = threading.Lock()


class DefaultHandler(logging.StreamHandler):
    """The package's fallback console handler: writes to stderr unless the root logger has handlers."""

    def __init__(self, stream: TextIO | None = None) -> None:
        super().__init__(stream)
        self.follows_stderr = stream is None  # sys.stderr when the record is written (it may be replaced)
        self.setFormatter(logging.Formatter(FORMAT, datefmt=DATE_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # the record propagates to the user's own handlers: printing it here too would double it
        try:
            tqdm.tqdm.write(self.format(record), file=sys.stderr if self.follows_stderr else self.stream)
        except Exception:
            self.handleError(record)


def default_handler() -> DefaultHandler | None:
    """The handler that :func:`use_default_handler` installed, if any."""
    for handler in logging.getLogger(PACKAGE_LOGGER).handlers:
        if isinstance(handler, DefaultHandler):
            return handler
    return None


def use_default_handler(stream: TextIO | None = None) -> bool:
    """Makes the package's INFO records visible on ``stream`` (stderr) unless logging is configured
    already (see the module docstring). Idempotent; returns whether the default handler is in place."""
    with _install_lock:
        package = logging.getLogger(PACKAGE_LOGGER)
        if default_handler() is not None:
            return True
        if package.handlers or logging.getLogger().handlers:
            return False
        package.addHandler(DefaultHandler(stream))
        if package.level == logging.NOTSET:
            package.setLevel(logging.INFO)
        return True


__all__ = ["PACKAGE_LOGGER", "DefaultHandler", "default_handler", "use_default_handler"]
