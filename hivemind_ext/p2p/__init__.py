"""Messaging over libp2p streams: msgpack-framed messages, unary and streaming RPC, deadlines, limits.

Built on hivemind's libp2p daemon (``hivemind.p2p.P2P``, or ``await dht.replicate_p2p()`` to share
a DHT's daemon) and its raw binary streams; no protobuf. See :mod:`hivemind_ext.p2p.framing` for
the wire format, :mod:`~hivemind_ext.p2p.server` (registration), :mod:`~hivemind_ext.p2p.serving`
(what a handler sees) and :mod:`~hivemind_ext.p2p.client` (calls). One
:class:`~hivemind_ext.p2p.runtime.PeerRuntime` per peer gives its components one event loop, one
P2P replica, one RPC server and one way to call the DHT with a deadline
(:mod:`~hivemind_ext.p2p.dht_calls`). The direct data path (TCP connections between peers, AES-GCM records
under session keys handed out over libp2p; plaintext as an explicit opt-in) is described in
:mod:`~hivemind_ext.p2p.direct_wire` and :mod:`~hivemind_ext.p2p.direct_records`.
"""

from hivemind_ext.p2p.client import ClientStream, RPCClient
from hivemind_ext.p2p.deadlines import now, remaining, resolve_deadline, wait_until
from hivemind_ext.p2p.dht_calls import DHTCalls
from hivemind_ext.p2p.direct_client import DirectClientConfig
from hivemind_ext.p2p.direct_server import DirectConfig
from hivemind_ext.p2p.framing import FrameKind, protocol_name
from hivemind_ext.p2p.messages import Limits, Message, pack_tensor, unpack_tensor
from hivemind_ext.p2p.runtime import PeerRuntime
from hivemind_ext.p2p.server import RPCServer
from hivemind_ext.p2p.serving import HandlerConfig, RequestStream, RPCContext, StreamHandler, UnaryHandler
from hivemind_ext.p2p.tasks import TaskOwner

__all__ = [
    "ClientStream",
    "DHTCalls",
    "DirectClientConfig",
    "DirectConfig",
    "FrameKind",
    "HandlerConfig",
    "Limits",
    "Message",
    "PeerRuntime",
    "RPCClient",
    "RPCContext",
    "RPCServer",
    "RequestStream",
    "StreamHandler",
    "TaskOwner",
    "UnaryHandler",
    "now",
    "pack_tensor",
    "protocol_name",
    "remaining",
    "resolve_deadline",
    "unpack_tensor",
    "wait_until",
]
