"""Which address a peer's direct data path listens on and which one it offers to callers.

Why: a peer's libp2p addresses are set with hivemind's ``host_maddrs`` (where the daemon listens,
``0.0.0.0`` by default) and ``announce_maddrs`` (what it tells others, e.g. a public address behind
port forwarding). The direct path follows them, so users configure one set of addresses:

- it listens on the IP of ``host_maddrs`` (every interface if that is a wildcard or there are several);
- it offers the first IP of ``announce_maddrs`` if there is one; else the IP it listens on, if
  that is one address; else the best address the daemon sees itself at (a public one before a
  private one, loopback last); never a wildcard such as ``0.0.0.0``.

:func:`choose_direct_address` is a pure function of those three lists (tested directly);
:func:`direct_config_for` reads them from a DHT and its daemon.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
from collections.abc import Iterable
from typing import Any

from hivemind_ext.p2p.deadlines import now, wait_until
from hivemind_ext.p2p.direct_server import DirectConfig

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
WILDCARD = "0.0.0.0"


def ips_of(maddrs: Iterable[Any]) -> list[IPAddress]:
    """The literal IP addresses in multiaddrs (``/ip4/1.2.3.4/tcp/5``); names and relays are skipped."""
    found = []
    for maddr in maddrs:
        parts = str(maddr).split("/")
        for protocol, value in itertools.pairwise(parts):
            if protocol in ("ip4", "ip6"):
                try:
                    found.append(ipaddress.ip_address(value))
                except ValueError:
                    pass
                break
    return found


def _preference(address: IPAddress) -> int:
    if address.is_loopback:
        return 2
    return 1 if address.is_private or address.is_link_local else 0


def choose_direct_address(
    host_maddrs: Iterable[Any], announce_maddrs: Iterable[Any], visible_maddrs: Iterable[Any]
) -> tuple[str, str] | None:
    """(listen IP, advertised IP) for the direct path, or None if there is no address to offer."""
    hosts = ips_of(host_maddrs)
    if len(hosts) == 1 and not hosts[0].is_unspecified:
        listen = str(hosts[0])
    elif hosts and all(host.version == 6 for host in hosts):
        listen = "::"
    else:
        listen = WILDCARD
    for announced in ips_of(announce_maddrs):
        if not announced.is_unspecified:
            return listen, str(announced)
    if listen not in (WILDCARD, "::"):
        return listen, listen
    seen = [ip for ip in ips_of(visible_maddrs) if not ip.is_unspecified and ip.version == (6 if listen == "::" else 4)]
    if not seen:
        return None
    return listen, str(min(seen, key=_preference))  # min() is stable: the daemon's order breaks ties


def dht_maddrs(dht: Any) -> tuple[list[Any], list[Any]]:
    """(host_maddrs, announce_maddrs) a hivemind DHT was created with (hivemind's default host: 0.0.0.0)."""
    kwargs = getattr(dht, "kwargs", None) or {}
    return list(kwargs.get("host_maddrs") or [f"/ip4/{WILDCARD}/tcp/0"]), list(kwargs.get("announce_maddrs") or [])


async def direct_config_for(
    dht: Any, p2p: Any, base: DirectConfig | None = None, *, timeout: float = 10.0
) -> DirectConfig | None:
    """The direct path's settings for a peer: ``base``'s, at the address chosen from ``dht``'s
    multiaddrs and what ``p2p``'s daemon sees (None: no address to offer, so no direct path)."""
    host_maddrs, announce_maddrs = dht_maddrs(dht)
    visible: list[Any] = []
    if not announce_maddrs:
        try:
            visible = await wait_until(p2p.get_visible_maddrs(latest=True), now() + timeout, "the daemon's addresses")
        except ValueError:  # the daemon knows no address of its own yet
            visible = []
    chosen = choose_direct_address(host_maddrs, announce_maddrs, visible)
    if chosen is None:
        return None
    listen, advertised = chosen
    if base is None:
        return DirectConfig(host=listen, advertise_host=advertised)
    return dataclasses.replace(base, host=listen, advertise_host=advertised)
