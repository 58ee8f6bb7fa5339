"""The cross-memory transport's reads with several steps in flight
(``hoccl._hierarchy.cma``): a peer's offers and receipts each travel on one tag, so a
receipt answers the oldest offer not yet answered; pieces must therefore be read in the
order of the offers, even when a later step's offer is seen first."""

import numpy as np

from hoccl._hierarchy.cma import CmaTransport


class _Request:
    def __init__(self, done=False):
        self.done = done

    def Test(self):
        return self.done


class _Comm:
    """Records what a member posts; the test says which offers have come."""

    def __init__(self):
        self.offers, self.receipts = [], []

    def Irecv(self, buf, source, tag):
        request = _Request()
        self.offers.append((buf, request))
        return request

    def Isend(self, buf, dest, tag):
        self.receipts.append(dest)
        return _Request(True)


class _MPI:
    class Request:
        @staticmethod
        def Testall(requests):
            return all(request.Test() for request in requests)


def _transport():
    transport = CmaTransport.__new__(CmaTransport)
    transport.comm, transport.MPI, transport._steps = _Comm(), _MPI, []
    transport.size, transport.member, transport.label = 2, 0, "mpi, cross-memory"
    transport.order = []
    transport.read = lambda piece, peer, offer: transport.order.append(int(offer[0]))
    return transport


def test_a_later_steps_offer_seen_first_waits_for_the_earlier_read():
    transport = _transport()
    first = transport.recv(np.zeros(8, np.uint8), 1)
    second = transport.recv(np.zeros(8, np.uint8), 1)
    (offer1, request1), (offer2, request2) = transport.comm.offers
    offer1[:2] = [0x1000, 8]
    offer2[:2] = [0x2000, 8]
    request2.done = True  # the second offer looks done before the first
    assert not transport.test(second)
    assert transport.order == [] and transport.comm.receipts == []
    request1.done = True
    assert transport.test(first) and transport.test(second)
    assert transport.order == [0x1000, 0x2000]  # read in the order of the offers
    assert transport.comm.receipts == [1, 1]


def test_steps_from_different_peers_do_not_hold_each_other_back():
    transport = _transport()
    transport.size = 3
    first = transport.recv(np.zeros(8, np.uint8), 1)
    second = transport.recv(np.zeros(8, np.uint8), 2)
    (offer1, _), (offer2, request2) = transport.comm.offers
    offer2[:2] = [0x3000, 8]
    request2.done = True
    assert transport.test(second) and not transport.test(first)
    assert transport.order == [0x3000]
