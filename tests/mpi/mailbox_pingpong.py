"""Per-message cost of the shared-memory mailboxes: ``mpiexec -n 2 python mailbox_pingpong.py``.

Two measures, each the median of several rounds, in µs per message:

* ``self``  — rank 0 sends to its own ring and takes the message straight back: the CPU
  cost of one message (a pickle, a copy in, a copy out, an unpickle) with no waiting;
* ``pingpong`` — rank 0 sends to rank 1, which sends it back: half a round trip, the
  latency one rank sees when it waits for another's descriptors.

Prints a table; ``--json PATH`` also writes it as JSON.
"""

import argparse
import json
import statistics
import time

from mpi4py import MPI

from hoccl._mailbox import Mailboxes, wait_until

DESCRIPTOR = (("coll", 17), ({"send": (4242, 0x7F00_0000_0000, 1 << 20, 0),
                              "recv": (4242, 0x7F00_0010_0000, 1 << 20, 0)}, None))
MESSAGES = {"descriptor": DESCRIPTOR, "1 KiB": bytes(1 << 10), "8 KiB": bytes(8 << 10)}


def to_self(mailboxes, rank, message, count):
    deadline = time.monotonic() + 60
    start = time.perf_counter()
    for _ in range(count):
        mailboxes.send(rank, message, deadline, "pingpong")
        mailboxes.ready(rank)
        mailboxes.receive(rank)
    return (time.perf_counter() - start) / count


def ping_pong(mailboxes, rank, message, count):
    peer = 1 - rank
    deadline = time.monotonic() + 60

    def answer():
        wait_until(lambda: mailboxes.ready(peer), deadline,
                   lambda: f"pingpong: rank {rank} had no answer from rank {peer}")
        return mailboxes.receive(peer)

    start = time.perf_counter()
    for _ in range(count):
        if rank == 0:
            mailboxes.send(peer, message, deadline, "pingpong")
            answer()
        else:
            mailboxes.send(peer, answer(), deadline, "pingpong")
    return (time.perf_counter() - start) / (2 * count)


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--count", type=int, default=20000, help="messages per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    assert world.Get_size() == 2, "run with mpiexec -n 2"
    mailboxes = Mailboxes(rank, 2, world.allgather, world.Barrier)
    rows = []
    for name, message in MESSAGES.items():
        own = [to_self(mailboxes, rank, message, args.count) for _ in range(args.rounds)]
        world.Barrier()
        both = []
        for _ in range(args.rounds):
            world.Barrier()
            both.append(ping_pong(mailboxes, rank, message, args.count))
        rows.append({"message": name, "self_us": 1e6 * statistics.median(own),
                     "pingpong_us": 1e6 * statistics.median(both)})
    mailboxes.close()
    if rank == 0:
        print(f"{'message':>12} {'self µs':>9} {'pingpong µs':>12}")
        for row in rows:
            print(f"{row['message']:>12} {row['self_us']:9.2f} {row['pingpong_us']:12.2f}")
        if args.json:
            with open(args.json, "w") as handle:
                json.dump(rows, handle, indent=1)


if __name__ == "__main__":
    main()
