"""A rank that aborts and then closes (or exits) leaves two traces for the peer still
waiting for it: its abort (with the reason it announced) and its close.  The peer must
report the cause, the abort (``DivergedError`` when the calls diverged, as the aborting
rank raised itself), whichever trace its wait happens to look at first."""

import threading
from types import SimpleNamespace

import pytest

from hoccl import AbortedError, DivergedError, PeerClosedError
from hoccl._health import Health
from hoccl._mailbox import Notice


class _Group:
    """Rank 1's view of a 3-rank group in which rank 0 closed; ``aborts`` maps a peer to
    the notice of its abort, if it announced one."""
    exported = False
    world_size = 3

    def __init__(self, aborts):
        self.aborts = aborts

    def closed_peer(self, calls):
        return "rank 0, which closed the communicator without making this all_reduce"

    def dead_peer(self):
        return None

    def peer_abort(self, peer):
        return self.aborts.get(peer)


def _waiting_rank(aborts):
    """Rank 1's monitor, waiting for one call; its abort only marks the engine aborted
    (what the device and the peers are told is tested elsewhere)."""
    engine = SimpleNamespace(aborted=False, closed=False, lock=threading.Lock(), rank=1,
                             abort_reason="", unfinished=lambda: ["all_reduce"],
                             device=SimpleNamespace(failure=lambda: None),
                             pad=SimpleNamespace(aborted_by=lambda: None))
    engine.raise_later = lambda error: setattr(engine, "abort_error", error)
    health = Health(engine, timeout=5.0, group=_Group(aborts))

    def abort(reason, kind="aborted"):
        engine.aborted, engine.abort_reason = True, reason
        engine.abort_error = AbortedError
    health.abort = abort
    return health


@pytest.mark.parametrize("notice, expected", [
    (Notice("diverged", "all_reduce: rank 0's count 0, rank 1's 10"), DivergedError),
    (Notice("aborted", "rank 0 gave up"), AbortedError),
    (None, PeerClosedError),
])
def test_a_peer_that_aborted_then_closed_is_reported_by_its_abort(notice, expected):
    health = _waiting_rank({0: notice} if notice is not None else {})
    with pytest.raises(expected) as raised:
        health._check_peers("synchronize", grace=0.0)
    assert type(raised.value) is expected
    if notice is not None:
        assert notice.reason in str(raised.value) and "rank 0" in str(raised.value)
