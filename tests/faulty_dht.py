"""A faulty-DHT wrapper: the seam through which tests inject DHT failures into any component.

Every component that takes ``dht=`` (averagers, the progress tracker, the matchmaker, state
sharing, decentralized SGD) reaches the DHT only through its peer runtime's
:class:`~hivemind_ext.p2p.dht_calls.DHTCalls`, which accepts any DHT-like object. Passing a
``FaultyDHT`` instead of the real DHT breaks the calls named in its fault sets and forwards
everything else to the real DHT:

- ``hang``: the call is accepted and never answered (a hung DHT process);
- ``fail``: the call is answered with an exception (a failure inside the DHT process);
- ``refuse``: handing the call over fails (a DHT whose process is gone).

The sets are plain public attributes, so a test may change them while the component runs.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterable
from typing import Any

import hivemind

DHT_CALLS = frozenset({"get", "store", "run_coroutine"})


class FaultyDHT:
    """Wraps ``real``; the methods named in ``hang``, ``fail`` and ``refuse`` misbehave (see the module)."""

    def __init__(
        self, real: hivemind.DHT, *, hang: Iterable[str] = (), fail: Iterable[str] = (), refuse: Iterable[str] = ()
    ) -> None:
        self.real = real
        self.hang, self.fail, self.refuse = set(hang), set(fail), set(refuse)
        unknown = (self.hang | self.fail | self.refuse) - DHT_CALLS
        if unknown:
            raise ValueError(f"FaultyDHT can break only {sorted(DHT_CALLS)}, not {sorted(unknown)}")
        self.calls: list[str] = []  # the names of the calls made through the wrapper, in order

    @property
    def peer_id(self) -> Any:
        return self.real.peer_id

    @property
    def client_mode(self) -> bool:
        return self.real.client_mode

    def is_alive(self) -> bool:
        return self.real.is_alive()

    def add_validators(self, validators: Any) -> None:
        self.real.add_validators(validators)

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("get", args, kwargs)

    def store(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("store", args, kwargs)

    def run_coroutine(self, *args: Any, **kwargs: Any) -> Any:
        return self._call("run_coroutine", args, kwargs)

    def _call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.calls.append(name)
        if name in self.refuse:
            raise BrokenPipeError(f"FaultyDHT refuses {name}")
        if name in self.hang:
            return concurrent.futures.Future()  # never resolved
        if name in self.fail:
            future: concurrent.futures.Future[Any] = concurrent.futures.Future()
            future.set_exception(RuntimeError(f"FaultyDHT fails {name}"))
            return future
        return getattr(self.real, name)(*args, **kwargs)
