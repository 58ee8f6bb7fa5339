"""A program that loses a peer and then simply ends (2 ranks):
``python run_lost_peer_exit.py HOW [--backend B]``.

After a call both ranks finished, rank 1 dies mid-run (HOW: ``exit``, os._exit(3), or
``kill``, SIGKILL); rank 0's next call raises PeerDeadError, which it catches, prints
``rank 0: caught PeerDeadError ...`` and falls off the end of the script, leaving its
communicator open and MPI to mpi4py's finalize at exit.  MPI_Finalize would wait for the
dead rank for ever, so hoccl aborts the MPI job at exit: the launcher's exit status is
non-zero and the job ends within seconds.  Launch with the MPI's keep-going flag
(MPICH: -disable-auto-cleanup), so that it is hoccl, not the launcher, that ends rank 0.
"""

import argparse
import os
import signal

import numpy as np
from mpi4py import MPI

import hoccl
from hoccl.testing import array_module_for

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("how", choices=["exit", "kill"])
parser.add_argument("--backend", default=None)
args = parser.parse_args()
comm = hoccl.init(backend=args.backend)  # the default timeout: the death is seen at once
arrays = array_module_for(comm.backend, "float32")
total = arrays.asarray(np.ones(1024, np.float32), comm.device)
comm.all_reduce(total, total)
comm.synchronize()
MPI.COMM_WORLD.Barrier()
if comm.rank == 1:
    if args.how == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)
try:
    comm.all_reduce(total, total)
    comm.synchronize()
    print("rank 0: FAILED the call returned", flush=True)
except hoccl.PeerDeadError as error:
    print(f"rank 0: caught {type(error).__name__}: {error}", flush=True)
