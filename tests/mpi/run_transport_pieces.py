"""MpiTransport's exchanges between members that hand it different forms: a block-major
byte array (a staged member's slot) on some ranks, a list of one byte array per member
(a member in host memory, its own arrays) on the others.  Every rank checks what it
received against numpy, outputs poisoned first; prints "rank R: OK N/N".

  mpiexec -n 3 python tests/mpi/run_transport_pieces.py
"""

import numpy as np
from mpi4py import MPI

from hoccl._hierarchy.transports import MpiTransport

world = MPI.COMM_WORLD
rank, size = world.rank, world.size
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


for width in (0, 1, 13, 4096, 1 << 20):
    mine = data(rank, width, 1)
    recv = np.full(size * width, 0xA5, np.uint8)
    finish(transport.all_gather(mine, form(recv)))
    want = np.concatenate([data(m, width, 1) for m in range(size)])
    checks, passed = checks + 1, passed + int(np.array_equal(recv, want))

    send = data(rank, size * width, 2)
    recv = np.full(size * width, 0xA5, np.uint8)
    finish(transport.all_to_all(form(send), form(recv)))
    want = np.concatenate([data(m, size * width, 2)[rank * width:(rank + 1) * width]
                           for m in range(size)])
    checks, passed = checks + 1, passed + int(np.array_equal(recv, want))

transport.close()
print(f"rank {rank}: {'OK' if passed == checks else 'WRONG'} {passed}/{checks}", flush=True)
