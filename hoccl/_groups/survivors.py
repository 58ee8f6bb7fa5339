"""``MailboxBootstrap``: a rendezvous over some ranks of a process group, through the
group's shared-memory mailboxes; what ``Communicator.shrink`` builds the survivors'
communicator on, and what that communicator keeps as its own bootstrap.

A job that lost a rank can no longer use its launcher's collectives (an MPI
communicator or a torch store barrier that counts the lost rank waits for it), but the
survivors' mailboxes still connect every pair of them.  An exchange sends each
survivor's value to every other survivor and takes theirs; messages that were in
flight in the mailboxes before it (the descriptions of calls the parent never finished)
are skipped.  Every wait is bounded by the timeout and ends early with PeerDeadError or
PeerClosedError when a survivor's process exits or closes its communicator.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence

from .._errors import MismatchError
from .._mailbox import Mailboxes, wait_until

__all__ = ["MailboxBootstrap"]


class MailboxBootstrap:
    """A ``Bootstrap`` of ``members`` (ranks of the process group whose ``mailboxes`` it
    uses, in the new rank order; this rank is one of them).  ``tag`` names the exchange
    sequence (every member passes the same one; a later sequence over the same
    mailboxes passes a newer tag: messages of older ones are skipped)."""

    def __init__(self, mailboxes: Mailboxes, members: Sequence[int], tag: tuple,
                 timeout: float, call: str = "shrink",
                 peer_lost: Callable[[str], None] = lambda gone: None):
        self._mailboxes = mailboxes
        self._members = list(members)
        self.rank = self._members.index(mailboxes.rank)
        self.world_size = len(self._members)
        self._tag = tag
        self._timeout = timeout
        self._call = call
        self._seq = 0
        #: this sequence's messages taken early (``_drain``), by peer
        self._early: Dict[int, List[tuple]] = {}
        self.peer_lost = peer_lost

    def allgather(self, value: Any) -> List[Any]:
        """Every member's ``value`` (picklable), in member order."""
        key = ("bootstrap", self._tag, self._seq)
        self._seq += 1
        deadline = time.monotonic() + self._timeout
        mailboxes, me = self._mailboxes, self._mailboxes.rank
        for peer in self._members:
            if peer != me:
                self._drain(peer)  # room in both directions, however much was left unread
                mailboxes.send(peer, (key, value, None), deadline, self._call)
        values = []
        for index, peer in enumerate(self._members):
            values.append(value if peer == me else self._take(peer, key, deadline, index))
        return values

    def _drain(self, peer: int) -> None:
        """Take every message ``peer`` has sent so far: this sequence's are kept for
        ``_take``, any other goes (a call the parent never ran, an earlier attempt's
        exchange: nobody will read it now)."""
        mailboxes = self._mailboxes
        while mailboxes.ready(peer):
            message = mailboxes.receive(peer)
            if message[0][:2] == ("bootstrap", self._tag):
                self._early.setdefault(peer, []).append(message)

    def _take(self, peer: int, key: tuple, deadline: float, index: int) -> Any:
        """``peer``'s message of exchange ``key``, skipping what it sent before."""
        mailboxes = self._mailboxes
        while True:
            early = self._early.get(peer)
            if early:
                got_key, got, _ = early.pop(0)
            else:
                wait_until(lambda: mailboxes.ready(peer), deadline,
                           lambda: f"{self._call}: rank {self.rank} waited {self._timeout:g} s "
                                   f"for rank {index} (rank {peer} of the communicator it was "
                                   f"made from) to take part; it never did",
                           check=lambda: mailboxes.check_alive([peer], self._call))
                got_key, got, _ = mailboxes.receive(peer)
            if got_key == key:
                return got
            if got_key[:2] == ("bootstrap", self._tag):
                raise MismatchError(f"{self._call}: rank {self.rank}'s exchange {key[2]} met "
                                    f"exchange {got_key[2]} of rank {index}: the ranks' "
                                    f"sequences differ")

    def barrier(self) -> None:
        self.allgather(None)

    def close(self) -> None:
        """Nothing to release: the mailboxes belong to their group."""
