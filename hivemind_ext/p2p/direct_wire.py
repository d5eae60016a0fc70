"""The direct data path's wire format: tickets (over libp2p) and the hello on each TCP connection.

Why: on a fast network the libp2p daemons (their encryption, copies through a unix socket) cost
more CPU than the peers themselves, so two peers that can reach each other directly move bulk data
(all-reduce streams, state downloads) over their own TCP connection instead, falling back to
libp2p where no direct connection can be made.

By default the connection is TLS 1.3 with both certificates pinned through libp2p (see
:mod:`~hivemind_ext.p2p.direct_tls`); plaintext is an explicit opt-in on both sides
(``DirectConfig(plaintext=True)`` on the server, ``DirectClientConfig(allow_plaintext=True)`` on
the caller) for loopback or trusted networks.

Authentication reuses libp2p's: a caller asks the server for tickets with a unary call over an
(authenticated, encrypted) libp2p stream, sending its TLS certificate. The server remembers which
PeerID asked with which certificate and answers with its TCP address, its own certificate and
random one-time tokens. A connection is accepted only over TLS with the caller's certificate and
a valid, unexpired, unused token issued for that certificate (plaintext: the token alone), and the
call it carries is served as if that PeerID had opened it over libp2p (handlers see the same
``ctx.peer_id``).

Ticket call (unary, handler :data:`TICKET_HANDLER`)::

    request  {"count": k, "cert": DER bytes}            1 <= k <= MAX_TOKENS_PER_TICKET; "cert" may
                                                        be left out only for a plaintext server
    response {"host": str, "port": int, "ttl": seconds, "tokens": [32-byte bin, ...],
              "cert": DER bytes}                        no "cert": the server speaks plaintext
             or {"error": str} for a malformed request

TCP connection: the TLS handshake (the caller's SNI names its certificate, see
:func:`~hivemind_ext.p2p.direct_tls.sni_name`; none for plaintext), then, caller first::

    offset  size  field
    0       4     magic b"hxd1"
    4       32    token
    36      2     handler name length L (u16, little-endian), 1 <= L <= MAX_HANDLER_NAME_BYTES
    38      L     handler name (utf-8), in the server's namespace

    server -> 1 byte: ACCEPTED (0x01), or REJECTED (0x00) and close

After ACCEPTED the connection carries exactly one call, framed as over libp2p
(:mod:`~hivemind_ext.p2p.framing`: OPEN, MESSAGE..., END/ERROR).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import struct
from collections.abc import Mapping
from typing import Any, Literal

from hivemind_ext.errors import PeerUnreachableError, ProtocolError
from hivemind_ext.p2p.deadlines import wait_until
from hivemind_ext.p2p.direct_tls import check_certificate
from hivemind_ext.p2p.direct_transport import DirectStream

# Which path a call took: "direct" is the encrypted direct path, "direct-plaintext" the opt-in one.
Transport = Literal["libp2p", "direct", "direct-plaintext"]
TICKET_HANDLER = "_direct_ticket"  # reserved name in every namespace that enables the direct path
HELLO_MAGIC = b"hxd1"
TOKEN_BYTES = 32
HELLO_HEAD = struct.Struct(f"<4s{TOKEN_BYTES}sH")
MAX_HANDLER_NAME_BYTES = 200  # the same bound as protocol_name()
MAX_TOKENS_PER_TICKET = 16
ACCEPTED = b"\x01"
REJECTED = b"\x00"


def encode_hello(token: bytes, handler: str) -> bytes:
    name = handler.encode()
    if len(token) != TOKEN_BYTES:
        raise ProtocolError(f"a direct token has {TOKEN_BYTES} bytes, got {len(token)}")
    if not 1 <= len(name) <= MAX_HANDLER_NAME_BYTES:
        raise ProtocolError(f"handler name of {len(name)} bytes does not fit a hello")
    return HELLO_HEAD.pack(HELLO_MAGIC, token, len(name)) + name


async def read_hello(reader: DirectStream, deadline: float) -> tuple[bytes, str]:
    """(token, handler name) from a new TCP connection, or ProtocolError / DeadlineExceededError.

    Both lengths are fixed or bounded before anything is read, so garbage costs at most a few
    hundred bytes and ``deadline`` of waiting.
    """
    return await wait_until(_read_hello(reader), deadline, "reading a direct hello")


async def _read_hello(reader: DirectStream) -> tuple[bytes, str]:
    try:
        magic, token, name_length = HELLO_HEAD.unpack(await reader.readexactly(HELLO_HEAD.size))
        if magic != HELLO_MAGIC:
            raise ProtocolError(f"not a hivemind_ext direct hello (magic {magic!r})")
        if not 1 <= name_length <= MAX_HANDLER_NAME_BYTES:
            raise ProtocolError(f"direct hello declares a handler name of {name_length} bytes")
        raw_name = await reader.readexactly(name_length)
    except asyncio.IncompleteReadError:
        raise ProtocolError("connection closed inside a direct hello") from None
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"connection broke inside a direct hello: {type(e).__name__}") from e
    try:
        return token, raw_name.decode()
    except UnicodeDecodeError:
        raise ProtocolError("direct hello's handler name is not utf-8") from None


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a ticket response says: where to connect, for how long, with which tokens, and the
    server's certificate to pin (None: the server speaks plaintext)."""

    host: str
    port: int
    ttl: float
    tokens: list[bytes]
    cert: bytes | None


def ticket_request(count: int, cert: bytes | None) -> dict[str, Any]:
    return {"count": count} if cert is None else {"count": count, "cert": cert}


def ticket_response(host: str, port: int, ttl: float, tokens: list[bytes], cert: bytes | None) -> dict[str, Any]:
    response: dict[str, Any] = {"host": host, "port": port, "ttl": float(ttl), "tokens": tokens}
    if cert is not None:
        response["cert"] = cert
    return response


def parse_ticket_response(header: Mapping[str, Any]) -> Ticket:
    """The ticket in a ticket response; anything malformed is a ProtocolError."""
    if "error" in header:
        raise ProtocolError(f"the server refused the ticket request: {header['error']!r:.200}")
    host, port, ttl, tokens = (header.get(key) for key in ("host", "port", "ttl", "tokens"))
    if not isinstance(host, str):
        raise ProtocolError(f"ticket host must be a string, got {type(host).__name__}")
    try:
        ipaddress.ip_address(host)  # a literal address: a ticket must not make us resolve names
    except ValueError:
        raise ProtocolError(f"ticket host must be an IP address, got {host!r:.60}") from None
    if type(port) is not int or not 1 <= port <= 65535:
        raise ProtocolError(f"ticket port must be in 1..65535, got {port!r:.30}")
    if type(ttl) not in (int, float) or not 0 < ttl <= 24 * 3600:
        raise ProtocolError(f"ticket ttl must be a positive number of seconds, got {ttl!r:.30}")
    if (
        not isinstance(tokens, list)
        or not 1 <= len(tokens) <= MAX_TOKENS_PER_TICKET
        or not all(isinstance(token, bytes) and len(token) == TOKEN_BYTES for token in tokens)
    ):
        raise ProtocolError(f"ticket must carry 1..{MAX_TOKENS_PER_TICKET} tokens of {TOKEN_BYTES} bytes")
    cert = check_certificate(header["cert"]) if "cert" in header else None
    return Ticket(host, port, float(ttl), tokens, cert)


def parse_ticket_request(header: Mapping[str, Any]) -> tuple[int, bytes | None]:
    """(token count, the caller's certificate or None) from a ticket request, or ProtocolError."""
    count = header.get("count")
    if type(count) is not int or not 1 <= count <= MAX_TOKENS_PER_TICKET:
        raise ProtocolError(f"ticket request needs a 'count' in 1..{MAX_TOKENS_PER_TICKET}, got {count!r:.30}")
    cert = check_certificate(header["cert"]) if "cert" in header else None
    return count, cert
