"""How a process group's ``complete`` chooses the calls to issue while its peers'
messages come (``hoccl._groups.matching``): in call order; a group of collectives whole,
once every call is matched; where a send or recv still waits for its peer, the matched
calls before it first, so that ranks that batch their sends and receives differently (a
pipeline schedule's) do not wait for each other in a cycle.  The behaviour under
mpiexec is ``tests/test_torch_pipeline.py``'s (every schedule on a flat communicator)."""

from types import SimpleNamespace

from hoccl._groups.matching import Early, Matching, is_pair

RANK = 0


def call(key, *participants):
    return SimpleNamespace(key=key, name="send" if is_pair(key) else "all_reduce",
                           prepared=None, plan=SimpleNamespace(participants=(RANK,) + participants))


def receive(matching, peer, key):
    matching.take(peer, key, ("signature",), {}, None)


def test_a_send_goes_out_once_matched_while_a_later_recv_still_waits():
    send, recv = call(("pair", 0, 1, 0), 1), call(("pair", 1, 0, 0), 1)
    matching = Matching([send, recv], RANK)
    assert matching.ready() == [] and matching.missing() == [1]
    receive(matching, 1, send.key)
    assert matching.ready() == [send]
    matching.issued += 1
    assert matching.waiting == [recv] and matching.ready() == []
    receive(matching, 1, recv.key)
    assert matching.ready() == [recv] and matching.missing() == []


def test_calls_go_out_in_call_order_even_where_a_later_one_is_matched_first():
    recv, send = call(("pair", 1, 0, 0), 1), call(("pair", 0, 2, 0), 2)
    matching = Matching([recv, send], RANK)
    receive(matching, 2, send.key)
    assert matching.ready() == []  # the engine's completion values follow call order
    receive(matching, 1, recv.key)
    assert matching.ready() == [recv, send]


def test_a_group_of_collectives_goes_out_whole():
    first, second = call(("coll", 0), 1, 2), call(("coll", 1), 1, 2)
    matching = Matching([first, second], RANK)
    for peer in (1, 2):
        receive(matching, peer, first.key)
    assert matching.ready() == []
    assert matching.missing(pairs=False) == [1, 2]
    receive(matching, 1, second.key)
    assert matching.ready() == [] and matching.missing(pairs=False) == [2]
    receive(matching, 2, second.key)
    assert matching.ready() == [first, second]


def test_a_collective_matched_before_a_waiting_send_goes_out_first():
    collective, send = call(("coll", 0), 1), call(("pair", 0, 1, 3), 1)
    matching = Matching([collective, send], RANK)
    receive(matching, 1, collective.key)
    assert matching.ready() == [collective]
    assert matching.missing(pairs=False) == []


def test_a_disagreement_names_the_call_and_the_peer():
    send = call(("pair", 0, 1, 0), 1)
    send.signature = (("count", 3),)
    matching = Matching([send], RANK)
    matching.take(1, send.key, (("count", 4),), {}, None)
    problem, diverged = matching.disagreement([send], RANK)
    assert "rank 0 called (count=3) but rank 1 called (count=4)" in problem
    assert diverged is None


def test_early_messages_wait_for_their_call_by_key():
    early = Early()
    early.keep(1, (("pair", 1, 0, 5), b"description", None))
    early.keep(2, (("pair", 0, 2, 1), b"other", None))
    assert early.from_peers([1]) == [("pair", 1, 0, 5)]
    assert early.take(("pair", 1, 0, 4)) is None
    assert early.take(("pair", 1, 0, 5)) == (1, (("pair", 1, 0, 5), b"description", None))
    assert early.from_peers([1, 2]) == [("pair", 0, 2, 1)]


def test_the_timeout_names_the_calls_missing_and_what_came_instead():
    send = call(("pair", 0, 1, 2), 1)
    matching = Matching([send], RANK)
    said = matching.unmatched(RANK, "node-a", 30, [1], [("pair", 1, 0, 2)])
    assert said.startswith("send: rank 0 (host node-a) waited 30 s for ranks [1] (host "
                           "node-a) to make the matching calls ['send/recv 2 from rank 0 to "
                           "rank 1']")
    assert "came instead: ['send/recv 2 from rank 1 to rank 0']" in said
