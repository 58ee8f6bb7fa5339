"""The staged engine's MPI transports (``MpiTransport``; ``CmaTransport``, whose
receivers read the senders' memory) on every step, between members that hand different
forms: a block-major byte array (a staged member's slot) on some ranks, a list of one
byte array per member (a member in host memory, its own arrays) on the others.  Every
rank checks what it received against numpy, outputs poisoned first; prints
"rank R: OK N/N".

  mpiexec -n 3 python tests/mpi/run_transport_pieces.py [--transport cma]
"""

import argparse

import numpy as np
from mpi4py import MPI

from hoccl._hierarchy.cma import CmaTransport, same_machine
from hoccl._hierarchy.transports import MpiTransport

parser = argparse.ArgumentParser()
parser.add_argument("--transport", choices=("mpi", "cma"), default="mpi")
args = parser.parse_args()
world = MPI.COMM_WORLD
rank, size = world.rank, world.size
if args.transport == "cma":
    assert same_machine(world), "cross-memory reads between these ranks do not work"
    transport = CmaTransport(world.Dup())
else:
    transport = MpiTransport(world.Dup())
lists = rank % 2 == 0  # even ranks hand lists
checks = passed = 0


def data(member, nbytes, salt):
    return ((np.arange(nbytes) * 7 + 31 * member + salt) % 251).astype(np.uint8)


def form(array):
    width = array.nbytes // size
    return [array[i * width:(i + 1) * width] for i in range(size)] if lists else array


def finish(request):
    while not transport.test(request):
        pass


def check(got, want):
    global checks, passed
    checks, passed = checks + 1, passed + int(np.array_equal(got, want))


def poisoned(nbytes):
    return np.full(nbytes, 0xA5, np.uint8)


for width in (0, 1, 13, 4096, 1 << 20, 9 << 20):
    mine = data(rank, width, 1)
    recv = poisoned(size * width)
    finish(transport.all_gather(mine, form(recv)))
    check(recv, np.concatenate([data(m, width, 1) for m in range(size)]))

    send = data(rank, size * width, 2)
    recv = poisoned(size * width)
    finish(transport.all_to_all(form(send), form(recv)))
    check(recv, np.concatenate([data(m, size * width, 2)[rank * width:(rank + 1) * width]
                                for m in range(size)]))
    for root in range(size):
        buf = data(root, width, 3) if rank == root else poisoned(width)
        finish(transport.broadcast(buf, root))
        check(buf, data(root, width, 3))

        recv = poisoned(size * width) if rank == root else None
        finish(transport.gather(data(rank, width, 4), recv, root))
        if rank == root:
            check(recv, np.concatenate([data(m, width, 4) for m in range(size)]))

        recv = poisoned(width)
        finish(transport.scatter(data(root, size * width, 5) if rank == root else None, recv,
                                 root))
        check(recv, data(root, size * width, 5)[rank * width:(rank + 1) * width])
    # a ring of sends: each member to the next, from the one before
    after, before = (rank + 1) % size, (rank - 1) % size
    recv = poisoned(width)
    sent = transport.send(data(rank, width, 6), after)
    got = transport.recv(recv, before)
    finish(sent), finish(got)
    check(recv, data(before, width, 6))
    finish(transport.barrier())

transport.close()
print(f"rank {rank}: {'OK' if passed == checks else 'WRONG'} {passed}/{checks} "
      f"({transport.label})", flush=True)
