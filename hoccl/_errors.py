"""Errors raised by hoccl.

Every message starts with the name of the call that failed and says what was
expected and what was given (or seen), so that a log line alone is enough to act on.
"""

__all__ = ["HocclError", "InvalidArgumentError", "PlanError", "HocclTimeoutError",
           "AbortedError", "DriverError", "MismatchError", "DivergedError", "PeerDeadError",
           "PeerClosedError"]


class HocclError(RuntimeError):
    """Base class of every error hoccl raises on purpose."""


class InvalidArgumentError(HocclError, ValueError):
    """A public call was given an argument it cannot use; nothing was enqueued."""


class PlanError(HocclError):
    """A plan failed verification: it could deadlock, race or leave output unwritten."""


class HocclTimeoutError(HocclError, TimeoutError):
    """A host-side wait ran past the communicator's timeout."""


class AbortedError(HocclError):
    """The communicator was aborted; its pending work was released, not completed."""


class DriverError(HocclError):
    """A CUDA driver call returned an error status."""


class MismatchError(HocclError):
    """Ranks called different collectives, or the same collective with different arguments."""


class DivergedError(MismatchError):
    """A call on registered buffers ran before its peers' descriptions were checked, and
    a peer's call differed: the ranks' calls diverged, so the communicator was aborted.
    Nothing was written outside the registered windows; the outputs are undefined."""


class PeerDeadError(AbortedError):
    """A rank waited for a peer that has left the communicator for good: its process has
    exited (or, ``PeerClosedError``, it closed the communicator).  The communicator is
    aborted; later calls raise the same error."""


class PeerClosedError(PeerDeadError):
    """A rank waited for a call that a peer will never make: the peer closed the
    communicator (its process may still run).  A ``PeerDeadError``, so that code which
    handles a lost peer handles both."""


def fatal(error: BaseException) -> bool:
    """Whether handing calls over failed for good (the communicator is aborted): a plain
    mismatch released the calls and the communicator stays usable; a divergence (an
    earlier registered call ran differently) or anything else leaves nothing to match
    up."""
    return isinstance(error, DivergedError) or not isinstance(error, MismatchError)
