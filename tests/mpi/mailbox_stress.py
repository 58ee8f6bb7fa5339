"""The shared-memory mailboxes under load: ``mpiexec -n N python mailbox_stress.py SCENARIO``.

contention  every rank sends ``--messages`` messages of random sizes (up to the largest a
            slot holds) to every peer from one thread while its main thread receives from
            all peers.  Each message carries its sender, receiver, sequence number and a
            checksum; each is checked on arrival.  First every ring is filled and shown to
            refuse one more message (a send whose deadline has passed times out, losing
            nothing); then receivers pause now and then, so rings fill up again and
            senders wait.
dead        rank 1 is killed (SIGKILL) once the mailboxes are up; rank 0 fills its ring to
            rank 1 and sends once more: PeerDeadError naming rank 1, in < 5 s of a 300 s
            deadline.  Launch with the MPI's keep-going flag, rank 1 under a shell that
            outlives it (test_mailbox.py does).

Each rank prints ``rank R: OK <what happened>`` or ``rank R: FAILED ...``.  ``exercise``
also runs with threads standing in for processes (tests/test_mailbox.py).
"""

import argparse
import hashlib
import os
import pickle
import random
import signal
import struct
import sys
import threading
import time

from hoccl._errors import HocclTimeoutError, PeerDeadError
from hoccl._mailbox import MESSAGE_BYTES, SLOTS, Mailboxes, wait_until

_HEADER = struct.Struct("<IIQI")  # sender, receiver, sequence number, body length
_DIGEST = 16
# what pickling a bytes object of 256 bytes or more adds to it
_PICKLING = len(pickle.dumps(bytes(1024), protocol=pickle.HIGHEST_PROTOCOL)) - 1024
LARGEST_BODY = MESSAGE_BYTES - _PICKLING - _HEADER.size - _DIGEST


class CorruptMessage(AssertionError):
    """A message arrived damaged, out of order or at the wrong rank."""


def make_message(sender: int, receiver: int, seq: int, body: bytes) -> bytes:
    head = _HEADER.pack(sender, receiver, seq, len(body)) + body
    return head + hashlib.blake2b(head, digest_size=_DIGEST).digest()


def check_message(message: bytes, sender: int, receiver: int, seq: int) -> None:
    """Raise CorruptMessage unless ``message`` is intact and is ``seq`` from ``sender`` to
    ``receiver``."""
    head, digest = message[:-_DIGEST], message[-_DIGEST:]
    if hashlib.blake2b(head, digest_size=_DIGEST).digest() != digest:
        raise CorruptMessage(f"message {seq} from rank {sender} to rank {receiver}: checksum "
                             f"mismatch ({len(message)} bytes)")
    found = _HEADER.unpack_from(head)
    expected = (sender, receiver, seq, len(head) - _HEADER.size)
    if found != expected:
        raise CorruptMessage(f"expected (sender, receiver, seq, length) {expected}, got {found}")


def random_body(rng: random.Random) -> bytes:
    """Mostly small (like descriptors), often up to a full slot, sometimes exactly full."""
    pick = rng.random()
    size = (LARGEST_BODY if pick < 0.05 else rng.randint(0, LARGEST_BODY) if pick < 0.5
            else rng.randint(0, 512))
    return rng.randbytes(size)


def exercise(mailboxes: Mailboxes, barrier, messages: int, seed: int) -> str:
    """Every rank sends ``messages`` messages to every peer (the first ``SLOTS`` fill each
    ring, which then must refuse one more); returns what happened; raises on any fault."""
    rank = mailboxes.rank
    peers = [peer for peer in range(mailboxes.world_size) if peer != rank]
    rng = random.Random(seed * 1009 + rank)
    deadline = time.monotonic() + 120
    for peer in peers:
        for seq in range(SLOTS):
            mailboxes.send(peer, make_message(rank, peer, seq, random_body(rng)), deadline,
                           "stress")
    barrier()  # every ring is full, and no one receives until the next barrier
    for peer in peers:
        try:
            mailboxes.send(peer, make_message(rank, peer, SLOTS, b""), 0.0, "stress")
            raise CorruptMessage(f"rank {rank}'s ring to rank {peer} took message {SLOTS + 1}")
        except HocclTimeoutError as error:
            if f"to rank {peer} stayed full" not in str(error):
                raise
    barrier()
    full = [0]  # sends that found the ring full, then waited
    failure = []

    def send_the_rest():
        try:
            order = [peer for peer in peers for _ in range(SLOTS, messages)]
            rng_send = random.Random(seed * 2003 + rank)
            rng_send.shuffle(order)
            sent = dict.fromkeys(peers, SLOTS)
            for peer in order:
                message = make_message(rank, peer, sent[peer], random_body(rng_send))
                try:
                    mailboxes.send(peer, message, 0.0, "stress")  # past deadline: fails if full
                except HocclTimeoutError:
                    full[0] += 1
                    mailboxes.send(peer, message, deadline, "stress")
                sent[peer] += 1
        except BaseException as error:
            failure.append(error)

    # a daemon: should receiving fail, the process exits without waiting for it
    sender = threading.Thread(target=send_the_rest, name=f"stress-sender-{rank}", daemon=True)
    sender.start()
    received = dict.fromkeys(peers, 0)
    while True:
        waiting = [peer for peer in peers if received[peer] < messages]
        if not waiting or failure:
            break
        wait_until(lambda: any(mailboxes.ready(peer) for peer in waiting), deadline,
                   lambda: f"stress: rank {rank} waited for {waiting}: got {received}",
                   check=lambda: mailboxes.check_alive(waiting, "stress"))
        for peer in waiting:
            if mailboxes.ready(peer):
                check_message(mailboxes.receive(peer), peer, rank, received[peer])
                received[peer] += 1
        if rng.random() < 0.003:
            time.sleep(0.02)  # a slow receiver: the rings to it fill up
    sender.join()
    if failure:
        raise failure[0]
    barrier()
    leftover = [peer for peer in peers if mailboxes.ready(peer)]
    if leftover:
        raise CorruptMessage(f"rank {rank} has messages beyond the last from ranks {leftover}")
    return (f"received {sum(received.values())} intact messages from {len(peers)} peers in "
            f"order; its sends found a ring full {full[0]} times")


def dead_peer(mailboxes: Mailboxes, barrier) -> str:
    barrier()
    if mailboxes.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    deadline = started + 300
    for seq in range(SLOTS):
        mailboxes.send(1, seq, deadline, "stress")
    try:
        mailboxes.send(1, SLOTS, deadline, "stress")
    except PeerDeadError as error:
        waited = time.monotonic() - started
        text = str(error)
        if waited < 5 and text.startswith("stress: rank 0 waited for rank 1,"):
            return f"{type(error).__name__} after {waited:.2f} s: {text}"
        raise
    raise CorruptMessage("the send to a dead rank with a full ring returned")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("scenario", choices=["contention", "dead"])
    parser.add_argument("--messages", type=int, default=2000, help="per ordered pair of ranks")
    parser.add_argument("--seed", type=int, default=None)
    args = parser.parse_args()
    from mpi4py import MPI
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    seed = world.bcast(args.seed if args.seed is not None else random.randrange(1 << 30))
    ok = False
    try:
        mailboxes = Mailboxes(rank, world.Get_size(), world.allgather, world.Barrier)
        if args.scenario == "contention":
            what = exercise(mailboxes, world.Barrier, args.messages, seed)
        else:
            what = dead_peer(mailboxes, world.Barrier)
        mailboxes.close()
        ok = True
        print(f"rank {rank}: OK {what} (seed {seed})", flush=True)
        if args.scenario == "contention":
            world.Barrier()  # no rank exits (which may end the job) before every rank printed
    except Exception as error:  # report, then fail
        print(f"rank {rank}: FAILED {type(error).__name__}: {error} (seed {seed})", flush=True)
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # skip MPI_Finalize: a peer may be gone


if __name__ == "__main__":
    main()
