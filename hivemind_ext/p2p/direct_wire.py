"""The direct data path's wire format: tickets (over libp2p) and the hello on each TCP connection.

Why: on a fast network the libp2p daemons (their encryption, copies through a unix socket) cost
more CPU than the peers themselves, so two peers that can reach each other directly move bulk data
(all-reduce streams, state downloads) over their own TCP connection instead, falling back to
libp2p where no direct connection can be made.

By default everything after the hello is AEAD records (AES-128-GCM with a key per token, see
:mod:`~hivemind_ext.p2p.direct_records`); plaintext is an explicit opt-in on both sides
(``DirectConfig(plaintext=True)`` on the server, ``DirectClientConfig(allow_plaintext=True)`` on
the caller) for loopback or trusted networks.

Authentication reuses libp2p's: a caller asks the server for tickets with a unary call over an
(authenticated, encrypted) libp2p stream. The server remembers which PeerID asked and answers with
its TCP address, random one-time tokens and, with each token, a fresh random session key. A
connection is accepted only with a valid, unexpired, unused token whose first record authenticates
under that token's key (plaintext: the token alone), and the call it carries is served as if that
PeerID had opened it over libp2p (handlers see the same ``ctx.peer_id``).

Ticket call (unary, handler :data:`TICKET_HANDLER`)::

    request  {"count": k}                               1 <= k <= MAX_TOKENS_PER_TICKET
    response {"host": str, "port": int, "ttl": seconds, "tokens": [32-byte bin, ...],
              "keys": [32-byte bin, ...]}               one key per token; no "keys": the server
                                                        speaks plaintext
              "reuse": seconds}                         optional: the server keeps a connection
                                                        open this long after a call for the next one
             or {"error": str} for a malformed request

TCP connection, caller first, in clear::

    offset  size  field
    0       4     magic b"hxd2"
    4       32    token (names the key; not a secret)

then, inside records (or in clear on a plaintext connection)::

    caller -> 2 bytes handler name length L (u16, little-endian), 1 <= L <= MAX_HANDLER_NAME_BYTES,
              then L bytes: the handler name (utf-8), in the server's namespace
    server -> 1 byte: ACCEPTED (0x01), or REJECTED (0x00) and close

An encrypted server answers nothing, and closes, until the caller's first record authenticates
(an unknown token or a record under another key gets no answer at all). After ACCEPTED the
connection carries one call, framed as over libp2p (:mod:`~hivemind_ext.p2p.framing`:
OPEN, MESSAGE..., END/ERROR).

Reuse (servers whose tickets say "reuse"): after a call that ended cleanly (a unary call answered
with a MESSAGE; a streaming call whose requests and responses both ended with END, the server's
END carrying ``{"reuse": True}``: it read the caller's END, which its handler need not), the caller may
send the next call on the same connection, in the same records (the record counters go on, so no
nonce repeats): the handler name as above, then at once the call's frames, without waiting; the
server answers ACCEPTED (or REJECTED and close) before the call's frames, for the same caller
identity and namespace as the token's. The server waits ``reuse`` seconds for the next name, then
closes; callers let their idle connections go sooner.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import struct
from collections.abc import Mapping
from typing import Any, Literal

from hivemind_ext.errors import HivemindExtError, PeerUnreachableError, ProtocolError
from hivemind_ext.p2p.deadlines import wait_until
from hivemind_ext.p2p.direct_records import ACCEPTED_KEY_BYTES
from hivemind_ext.p2p.direct_transport import DirectStream

# Which path a call took: "direct" is the encrypted direct path, "direct-plaintext" the opt-in one.
Transport = Literal["libp2p", "direct", "direct-plaintext"]
TICKET_HANDLER = "_direct_ticket"  # reserved name in every namespace that enables the direct path
HELLO_MAGIC = b"hxd2"
TOKEN_BYTES = 32
HELLO = struct.Struct(f"<4s{TOKEN_BYTES}s")
NAME_LENGTH = struct.Struct("<H")
MAX_HANDLER_NAME_BYTES = 200  # the same bound as protocol_name()
MAX_TOKENS_PER_TICKET = 16
ACCEPTED = b"\x01"
REJECTED = b"\x00"
# in the END frame of a direct streaming call: the server read the caller's END and waits for its next call
REUSE_END_KEY = "reuse"


def encode_hello(token: bytes) -> bytes:
    if len(token) != TOKEN_BYTES:
        raise ProtocolError(f"a direct token has {TOKEN_BYTES} bytes, got {len(token)}")
    return HELLO.pack(HELLO_MAGIC, token)


def encode_handler_name(handler: str) -> bytes:
    name = handler.encode()
    if not 1 <= len(name) <= MAX_HANDLER_NAME_BYTES:
        raise ProtocolError(f"handler name of {len(name)} bytes does not fit a hello")
    return NAME_LENGTH.pack(len(name)) + name


async def read_hello(reader: DirectStream, deadline: float) -> bytes:
    """The token from a new TCP connection, or ProtocolError / DeadlineExceededError (a fixed
    number of bytes: garbage costs at most that and ``deadline`` of waiting)."""
    magic, token = HELLO.unpack(await wait_until(_read(reader, HELLO.size), deadline, "reading a direct hello"))
    if magic != HELLO_MAGIC:
        raise ProtocolError(f"not a hivemind_ext direct hello (magic {magic!r})")
    return token


async def read_handler_name(reader: DirectStream, deadline: float) -> str:
    """The handler name that follows the hello (inside the first record of an encrypted connection:
    an AuthenticationError if that record is not sealed with the token's key)."""
    return await wait_until(_read_handler_name(reader), deadline, "reading a direct hello")


async def _read_handler_name(reader: DirectStream) -> str:
    (name_length,) = NAME_LENGTH.unpack(await _read(reader, NAME_LENGTH.size))
    if not 1 <= name_length <= MAX_HANDLER_NAME_BYTES:
        raise ProtocolError(f"direct hello declares a handler name of {name_length} bytes")
    try:
        return (await _read(reader, name_length)).decode()
    except UnicodeDecodeError:
        raise ProtocolError("direct hello's handler name is not utf-8") from None


async def _read(reader: DirectStream, nbytes: int) -> bytes:
    try:
        return await reader.readexactly(nbytes)
    except asyncio.IncompleteReadError:
        raise ProtocolError("connection closed inside a direct hello") from None
    except HivemindExtError:
        raise
    except (ConnectionError, OSError) as e:
        raise PeerUnreachableError(f"connection broke inside a direct hello: {type(e).__name__}") from e


@dataclasses.dataclass(frozen=True)
class Ticket:
    """What a ticket response says: where to connect, for how long, with which tokens, and each
    token's session key (None: the server speaks plaintext)."""

    host: str
    port: int
    ttl: float
    tokens: list[bytes]
    keys: list[bytes] | None
    reuse: float | None = None  # how long the server keeps a connection for the next call; None: one call only


def ticket_request(count: int) -> dict[str, Any]:
    return {"count": count}


def ticket_response(
    host: str, port: int, ttl: float, tokens: list[bytes], keys: list[bytes] | None, reuse: float | None = None
) -> dict[str, Any]:
    response: dict[str, Any] = {"host": host, "port": port, "ttl": float(ttl), "tokens": tokens}
    if keys is not None:
        response["keys"] = keys
    if reuse is not None:
        response["reuse"] = float(reuse)
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
    keys = header.get("keys")
    if keys is not None and (
        not isinstance(keys, list)
        or len(keys) != len(tokens)
        or not all(isinstance(key, bytes) and len(key) in ACCEPTED_KEY_BYTES for key in keys)
    ):
        raise ProtocolError("ticket must carry one key of 16 or 32 bytes per token")
    reuse = header.get("reuse")
    if reuse is not None and (type(reuse) not in (int, float) or not 0 < reuse <= 24 * 3600):
        raise ProtocolError(f"ticket reuse must be a positive number of seconds, got {reuse!r:.30}")
    return Ticket(host, port, float(ttl), tokens, keys, float(reuse) if reuse is not None else None)


def parse_ticket_request(header: Mapping[str, Any]) -> int:
    """The token count of a ticket request, or ProtocolError."""
    count = header.get("count")
    if type(count) is not int or not 1 <= count <= MAX_TOKENS_PER_TICKET:
        raise ProtocolError(f"ticket request needs a 'count' in 1..{MAX_TOKENS_PER_TICKET}, got {count!r:.30}")
    return count
