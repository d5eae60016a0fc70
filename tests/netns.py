"""Shaped and NAT'd links for tests and benchmarks: Linux network namespaces on one bridge.

A :class:`Topology` builds, as root::

    <prefix>-br           a namespace holding the bridge "br0" (the "internet")
    <prefix>-p<i>         one namespace per public peer: veth "eth0" with 10.<net>.0.<i+1>/16
    <prefix>-r<j>         a NAT router per client peer: "wan" on the bridge (10.<net>.1.<j+1>),
                          "lan" 192.168.<j>.1, MASQUERADE out of "wan", nothing forwarded in
    <prefix>-c<j>         the client peer behind router j: "eth0" 192.168.<j>.2, default route via it

Each peer's link is limited in both directions with ``tc tbf`` (``netem`` does not exist here): its
upload on its own "eth0", its download on the bridge-side end of its veth. A client peer's limit
sits on the router's "wan" link, which it alone uses.

Everything is removed by :meth:`Topology.close` (deleting a namespace removes its veths and qdiscs),
which the context manager and an ``atexit`` hook call, also when setup fails half-way; namespaces
left by a killed run with the same prefix are removed before a new topology is built.

``HX_NETNS_TAG`` (a letter or two) is appended to every prefix, so that several runs on one machine
(engineers' test runs side by side) never share, or delete, each other's namespaces and veths.

Commands run inside a namespace with :meth:`Topology.popen` / :meth:`Topology.run`
(``ip netns exec``). Only the addresses above are used: nothing leaves the machine.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class NetnsUnavailable(RuntimeError):
    """This machine cannot build the topology (not root, no ``ip``/``tc``, namespaces not allowed)."""


@dataclass(frozen=True)
class Link:
    """One peer's access link: ``rate_mbit`` both ways (None: unshaped); ``behind_nat`` puts the peer
    behind its own NAT router (it can dial out, nobody can dial in)."""

    rate_mbit: float | None = None
    behind_nat: bool = False


@dataclass
class Peer:
    """Where one peer lives: its namespace and the IP address it can listen on."""

    index: int
    namespace: str
    address: str
    link: Link


@dataclass
class Topology:
    """``Topology(links, prefix="hx")``: a context manager that builds the namespaces (see the module
    docstring) on enter and removes them on exit. ``peers[i]`` tells where ``links[i]`` lives."""

    links: Sequence[Link]
    prefix: str = "hx"
    net: int = 77
    peers: list[Peer] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = tagged(self.prefix)

    def __enter__(self) -> Topology:
        check_available()
        remove_namespaces(self.prefix)
        atexit.register(self.close)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    def close(self) -> None:
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)
        self._namespaces.clear()
        atexit.unregister(self.close)

    # commands inside a namespace

    def command(self, peer: Peer | int, argv: Sequence[str]) -> list[str]:
        namespace = self._peer(peer).namespace
        return ["ip", "netns", "exec", namespace, *argv]

    def popen(self, peer: Peer | int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        return subprocess.Popen(self.command(peer, argv), **kwargs)

    def run(self, peer: Peer | int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.command(peer, argv), **kwargs)

    def python(self, peer: Peer | int, code: str, *args: str, **kwargs: Any) -> subprocess.Popen:
        """Starts ``python -c code args...`` in the peer's namespace with this process's environment."""
        kwargs.setdefault("env", dict(os.environ))
        return self.popen(peer, [sys.executable, "-c", code, *args], **kwargs)

    def set_rate(self, peer: Peer | int, rate_mbit: float | None) -> None:
        """Changes (or removes, with None) the shaping of one peer's link in both directions."""
        peer = self._peer(peer)
        for namespace, device in self._shaped_ends(peer):
            _shape(namespace, device, rate_mbit)

    def link_bytes(self) -> list[tuple[int, int]]:
        """Bytes each peer's shaped link has carried so far, ``(up, down)`` per peer in order: the byte
        counters of its two ``tc tbf`` qdiscs, i.e. what the shaper charged the link (Ethernet, IP and
        TCP headers of every segment, acknowledgements, the DHT's traffic), not only the payload. A
        client peer's link is its router's, which carries nothing else. An unshaped direction reads 0."""
        ends = [end for peer in self.peers for end in self._shaped_ends(peer)]
        readings = [_start_qdisc_read(*end) for end in ends]  # all at once: a reading is one moment
        counts = [_qdisc_bytes(reading) for reading in readings]
        return list(zip(counts[0::2], counts[1::2], strict=True))

    # building

    def _peer(self, peer: Peer | int) -> Peer:
        return self.peers[peer] if isinstance(peer, int) else peer

    def _build(self) -> None:
        bridge = self._add_namespace(f"{self.prefix}-br")
        _ip(bridge, "link", "add", "br0", "type", "bridge")
        _ip(bridge, "link", "set", "br0", "up")
        nat_index = 0
        for index, link in enumerate(self.links):
            if link.behind_nat:
                self.peers.append(self._add_client(index, nat_index, link, bridge))
                nat_index += 1
            else:
                self.peers.append(self._add_public(index, link, bridge))

    def _add_public(self, index: int, link: Link, bridge: str) -> Peer:
        namespace = self._add_namespace(f"{self.prefix}-p{index}")
        address = f"10.{self.net}.0.{index + 1}"
        self._attach(namespace, f"{self.prefix}b{index}", "eth0", f"{address}/16", bridge)
        peer = Peer(index, namespace, address, link)
        self.set_rate(peer, link.rate_mbit)
        return peer

    def _add_client(self, index: int, nat_index: int, link: Link, bridge: str) -> Peer:
        router = self._add_namespace(f"{self.prefix}-r{nat_index}")
        self._attach(router, f"{self.prefix}w{nat_index}", "wan", f"10.{self.net}.1.{nat_index + 1}/16", bridge)
        namespace = self._add_namespace(f"{self.prefix}-c{nat_index}")
        lan = f"192.168.{nat_index}"
        _veth(f"{self.prefix}l{nat_index}", router, "lan", namespace, "eth0")
        _ip(router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        _ip(router, "link", "set", "lan", "up")
        _ip(namespace, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _ip(namespace, "link", "set", "eth0", "up")
        _ip(namespace, "route", "add", "default", "via", f"{lan}.1")
        _in(router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        nat = shutil.which("iptables")
        if nat is None:
            raise NetnsUnavailable("a NAT'd peer needs iptables (apt-get install -y iptables)")
        _in(router, nat, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
        # Only replies to connections the client opened come back in; nothing new is forwarded to it.
        _in(router, nat, "-A", "FORWARD", "-i", "wan", "-m", "state", "--state", "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _in(router, nat, "-A", "FORWARD", "-i", "wan", "-j", "DROP")
        peer = Peer(index, namespace, f"{lan}.2", link)
        self.set_rate(peer, link.rate_mbit)
        return peer

    def _shaped_ends(self, peer: Peer) -> list[tuple[str, str]]:
        bridge = f"{self.prefix}-br"
        if peer.link.behind_nat:
            nat_index = int(peer.namespace.rsplit("-c", 1)[1])
            return [(f"{self.prefix}-r{nat_index}", "wan"), (bridge, f"{self.prefix}w{nat_index}")]
        return [(peer.namespace, "eth0"), (bridge, f"{self.prefix}b{peer.index}")]

    def _add_namespace(self, name: str) -> str:
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _ip(name, "link", "set", "lo", "up")
        return name

    def _attach(self, namespace: str, outer: str, inner: str, cidr: str, bridge: str) -> None:
        """A veth from ``namespace`` (named ``inner``, with ``cidr``) to the bridge (named ``outer``)."""
        _veth(outer, bridge, outer, namespace, inner)
        _ip(bridge, "link", "set", outer, "master", "br0")
        _ip(bridge, "link", "set", outer, "up")
        _ip(namespace, "addr", "add", cidr, "dev", inner)
        _ip(namespace, "link", "set", inner, "up")


def check_available() -> None:
    """Raises :class:`NetnsUnavailable` with the reason when namespaces cannot be built here."""
    if sys.platform != "linux":
        raise NetnsUnavailable("network namespaces need Linux")
    if os.geteuid() != 0:
        raise NetnsUnavailable("network namespaces need root")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"the '{tool}' command (iproute2) is not installed")
    probe = f"hxprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
    if made.returncode != 0:
        raise NetnsUnavailable(f"'ip netns add' failed: {made.stderr.strip()}")
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)


def unavailable_reason(nat: bool = False) -> str | None:
    """None when topologies (with NAT'd peers if ``nat``) can be built here, else why not (for
    ``pytest.skip``)."""
    try:
        check_available()
    except NetnsUnavailable as error:
        return str(error)
    if nat and shutil.which("iptables") is None:
        return "a NAT router needs iptables (apt-get install -y iptables)"
    return None


def tagged(prefix: str) -> str:
    """``prefix`` with this run's ``HX_NETNS_TAG`` appended."""
    tag = os.environ.get("HX_NETNS_TAG", "")
    if not tag.isalnum() and tag:
        raise ValueError(f"HX_NETNS_TAG must be letters and digits, got {tag!r}")
    return prefix + tag


def remove_namespaces(prefix: str) -> None:
    """Deletes every namespace named ``<prefix>-*`` (left over by a killed run)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    for line in listed.splitlines():
        name = line.split()[0] if line.strip() else ""
        if name.startswith(f"{prefix}-"):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def namespaces_with_prefix(prefix: str) -> list[str]:
    prefix = tagged(prefix)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip().startswith(f"{prefix}-")]


def _shape(namespace: str, device: str, rate_mbit: float | None) -> None:
    subprocess.run(["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", device, "root"], capture_output=True)
    if rate_mbit is None:
        return
    # burst: at least one 10 ms tick of data (and 32 KB); queue: 50 ms at the rate (a home router's buffer)
    rate_bytes = rate_mbit * 1e6 / 8
    burst = max(32 * 1024, int(rate_bytes / 100))
    _in(namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
        "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms")  # fmt: skip


def _start_qdisc_read(namespace: str, device: str) -> subprocess.Popen:
    return subprocess.Popen(
        ["ip", "netns", "exec", namespace, "tc", "-s", "-j", "qdisc", "show", "dev", device],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _qdisc_bytes(reading: subprocess.Popen) -> int:
    """What the ``tbf`` qdisc read by ``reading`` (:func:`_start_qdisc_read`) has sent so far, in bytes
    (GSO segments counted with their headers, as the shaper charges them); 0 where it is not shaped."""
    try:
        listed, error = reading.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        reading.kill()
        reading.communicate()
        raise
    if reading.returncode != 0:
        raise subprocess.CalledProcessError(reading.returncode, reading.args, listed, error)
    return sum(int(qdisc.get("bytes", 0)) for qdisc in json.loads(listed) if qdisc.get("kind") == "tbf")


def _veth(name: str, namespace_a: str, name_a: str, namespace_b: str, name_b: str) -> None:
    """A veth pair created under the unique root-namespace names ``name``/``name``+"x", moved into
    the two namespaces and renamed there (interface names are per namespace, 15 characters at most)."""
    _run("ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}x")
    _run("ip", "link", "set", name, "netns", namespace_a)
    _run("ip", "link", "set", f"{name}x", "netns", namespace_b)
    if name_a != name:
        _ip(namespace_a, "link", "set", name, "name", name_a)
    _ip(namespace_b, "link", "set", f"{name}x", "name", name_b)


def _ip(namespace: str, *args: str) -> None:
    _run("ip", "-n", namespace, *args)


def _in(namespace: str, *argv: str) -> None:
    _run("ip", "netns", "exec", namespace, *argv)


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)!r} failed: {done.stderr.strip()}")
