"""Call matching: a ``Group`` per communicator matches each call with its peers' calls
before the engine issues it (``base``: what every group offers; ``local``: the ranks of
one process; ``process``: one rank per process).  Rendezvous, how the ranks find each
other, is ``hoccl.bootstrap``'s."""

from .base import _ABORTED, Group, _describe
from .local import LocalGroup
from .process import ProcessGroup

__all__ = ["Group", "LocalGroup", "ProcessGroup", "_ABORTED", "_describe"]
