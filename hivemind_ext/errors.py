"""The library's exception hierarchy: one root, and subclasses that say what went wrong.

Every error that hivemind_ext raises on purpose derives from :class:`HivemindExtError`, so
``except hivemind_ext.HivemindExtError`` catches all of them. Where a standard exception has the
same meaning (a bad argument, a timeout), the subclass also derives from it, so code written
against the standard types keeps working.
"""

from __future__ import annotations

# hivemind's own failure types, so that code written against hivemind (``except AllreduceException``
# around ``averager.step()``) catches ours too. This is the one deliberate import from hivemind's
# averaging modules (DESIGN.md otherwise forbids them): only the two exception classes, and free,
# since ``import hivemind`` already imports hivemind.averaging.
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException


class HivemindExtError(Exception):
    """Root of all errors raised by hivemind_ext."""


class ConfigurationError(HivemindExtError, ValueError):
    """An argument or a combination of arguments is invalid; raised at construction time."""


class RunMismatchError(ConfigurationError):
    """This peer's model or settings differ from those of the run it joined (its tensors' shapes,
    ``target_batch_size``, codecs, algorithm): it cannot average with the swarm. The message names
    the first difference; the peer leaves the swarm."""


class CompressionError(HivemindExtError, ValueError):
    """A tensor cannot be compressed, or a compressed message is malformed and cannot be decoded."""


class NonFiniteTensorError(CompressionError):
    """A codec that cannot represent NaN or Inf was given a tensor that contains them."""


class ProtocolError(HivemindExtError):
    """A peer sent a message that violates the wire protocol (malformed, oversized, unexpected)."""


class AuthenticationError(ProtocolError):
    """A peer failed to prove the identity it claims: on the direct data path, a record not sealed
    with the session key that the libp2p identity received over the ticket call (a stolen token,
    a false server, an altered, replayed or reordered record), or a refused token (see
    ``hivemind_ext.p2p.direct_records``)."""


class MessageTooLargeError(ProtocolError):
    """A message or frame exceeds the configured maximum size."""


class DeadlineExceededError(HivemindExtError, TimeoutError):
    """A network wait ran past its deadline."""


class PeerUnreachableError(HivemindExtError, ConnectionError):
    """A peer could not be contacted, or disconnected before the exchange finished."""


class RemoteError(HivemindExtError):
    """A remote handler answered with an error; the message carries the remote side's description."""


class ClosedError(HivemindExtError, RuntimeError):
    """An object (a server, a stream, a task owner) was used after it was closed or shut down."""


class MatchmakingError(HivemindExtError, MatchmakingException, AllreduceException):
    """No averaging group could be formed before the deadline.

    Also a hivemind ``MatchmakingException`` and ``AllreduceException``: hivemind's
    ``DecentralizedAverager.step`` raises ``AllreduceException("... could not find a group")`` here."""


class AllreduceError(HivemindExtError, AllreduceException, MatchmakingException):
    """An all-reduce round failed as a whole (not merely some peers excluded).

    Also a hivemind ``AllreduceException`` and ``MatchmakingException``: hivemind's
    ``DecentralizedAverager.step`` wraps a failed all-reduce in ``MatchmakingException("Unable to run
    All-Reduce: ...")``, and its all-reduce itself raises ``AllreduceException``."""


class StateLoadError(HivemindExtError):
    """Downloading the state from peers failed or every transfer was corrupted."""


class UntrustedStateError(StateLoadError):
    """A downloaded state was refused: its values are out of range (non-finite tensors, an absurd
    learning rate, epoch or step count), or donors do not agree on it. The donors that served it are
    not asked again for a while."""


class DonorBusyError(PeerUnreachableError):
    """A state donor turned a download down for now (all its download slots are taken, or its state
    is locked by averaging); the newcomer should ask another donor instead of waiting."""


__all__ = [
    "AllreduceError",
    "AuthenticationError",
    "ClosedError",
    "CompressionError",
    "ConfigurationError",
    "DeadlineExceededError",
    "DonorBusyError",
    "HivemindExtError",
    "MatchmakingError",
    "MessageTooLargeError",
    "NonFiniteTensorError",
    "PeerUnreachableError",
    "ProtocolError",
    "RemoteError",
    "RunMismatchError",
    "StateLoadError",
    "UntrustedStateError",
]
