"""The seam between hosts: every engine implements ``InterHostEngine``, refuses the worlds
it cannot serve, and a plan's calls reach its transfer methods with their arguments."""

import inspect

import pytest

import hoccl
from hoccl._hierarchy import ENGINES, INTER_HOST_ENGINES, InterHostEngine
from hoccl._hierarchy.hoccl_engine import HocclEngine
from hoccl.sched import Shape
from hoccl.sched.hierarchical import Call

TRANSFERS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "broadcast", "reduce",
             "gather", "scatter", "send", "recv", "barrier")


def test_every_engine_is_an_inter_host_engine_under_its_own_name():
    assert INTER_HOST_ENGINES == ("nccl", "mpi", "gloo", "ucx", "hoccl") == tuple(ENGINES)
    for name, engine in ENGINES.items():
        assert issubclass(engine, InterHostEngine) and engine.name == name
    assert sorted(InterHostEngine.__abstractmethods__) == sorted(
        TRANSFERS + ("connect", "abort", "close"))


def test_engines_refuse_the_worlds_they_cannot_serve():
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^init: inter_host='nccl' needs the "
                                                         r"cuda backend on every rank; this "
                                                         r"world also uses \['host'\]"):
        ENGINES["nccl"].check_world("init", ["cuda", "host"], ["a", "b"])
    with pytest.raises(hoccl.InvalidArgumentError, match=r"^init: inter_host='hoccl' needs one "
                                                         r"hoccl backend on every rank"):
        ENGINES["hoccl"].check_world("init", ["cuda", "host"], ["a", "a"])
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^init: inter_host='hoccl' connects simulated hosts on one "
                             r"machine; these ranks run on \['a', 'b'\]"):
        ENGINES["hoccl"].check_world("init", ["host"] * 4, ["a", "a", "b", "b"])
    ENGINES["hoccl"].check_world("init", ["host"] * 2, ["a", "a"])
    ENGINES["mpi"].check_world("init", ["cuda", "host"], ["a", "b"])
    ENGINES["gloo"].check_world("init", ["cuda", "host"], ["a", "b"])
    ENGINES["nccl"].check_world("init", ["cuda"] * 2, ["a", "b"])


class Recorder:
    """A communicator that records each call it is given."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append((name, args, kwargs))
        return record


@pytest.mark.parametrize("shape,expected", [
    (Shape("all_gather", 4, 8), ("all_gather", ("S", "R"))),
    (Shape("all_to_all", 4, 8), ("all_to_all", ("S", "R"))),
    (Shape("reduce_scatter", 4, 8, op="max"), ("reduce_scatter", ("S", "R", "max"))),
    (Shape("all_reduce", 4, 8, op="prod"), ("all_reduce", ("S", "R", "prod"))),
    (Shape("reduce", 4, 8, op="min", root=3), ("reduce", ("S", "R", 3, "min"))),
    (Shape("broadcast", 4, 8, root=2), ("broadcast", ("S", "R", 2))),
    (Shape("gather", 4, 8, root=1), ("gather", ("S", "R", 1))),
    (Shape("scatter", 4, 8, root=1), ("scatter", ("S", "R", 1))),
    (Shape("barrier", 4, 0), ("barrier", ())),
])
def test_a_plan_call_reaches_the_transfer_method_with_its_arguments(shape, expected):
    comm = Recorder()
    HocclEngine(comm, "hoccl (host)").issue(Call(shape, None, None), "S", "R", 7)
    assert comm.calls == [(*expected, {"stream": 7})]


def test_a_send_and_a_receive_go_to_their_peers():
    comm = Recorder()
    engine = HocclEngine(comm, "hoccl (host)")
    shape = Shape("sendrecv", 4, 8, root=1, peer=2)
    engine.issue(Call(shape, None, None), "S", None, None)
    engine.issue(Call(shape, None, None), None, "R", None)
    assert comm.calls == [("send", ("S", 2), {"stream": None}),
                          ("recv", ("R", 1), {"stream": None})]


def test_the_transfers_take_the_arguments_of_hoccls_api():
    for name in TRANSFERS:
        ours = list(inspect.signature(getattr(InterHostEngine, name)).parameters)[1:]
        api = list(inspect.signature(getattr(hoccl.Communicator, name)).parameters)[1:]
        api = [{"sendbuf": "send", "recvbuf": "recv", "scale": None}.get(p, p) for p in api]
        assert ours == [p for p in api if p is not None], name


def test_a_call_a_hosts_library_cannot_run_is_refused_naming_the_host_and_engine():
    """Every rank holds every host's report and the plan: the verdict is the same on all
    of them, reached before any data moves."""
    from hoccl._hierarchy.communicator import _PRIMITIVES
    from hoccl._hierarchy.hosts import HostReport, refusal
    from hoccl.sched.hierarchical import Topology, build_hierarchical
    topology = Topology(2, 2)
    hosts = [HostReport("a", "cpu", "host", "host", "hoccl (host)"),
             HostReport("b", "cuda", "torch", "cuda", "torch (gloo)",
                        lacks=(("all_to_all", "unsupported device type cuda"),))]

    def verdict(shape):
        plan = build_hierarchical(shape, topology)
        steps = [(topology.host_of(rank), step.shape.collective) for phase in plan.phases
                 if phase.level == "host" for rank, made in enumerate(phase.steps)
                 for step in made]
        return refusal(shape.collective, hosts, steps, _PRIMITIVES)
    assert verdict(Shape("all_reduce", 4, 9, "bfloat16", 2)) == (
        "all_reduce: host 1 (b) runs torch (gloo) inside, on cuda, which cannot run all_to_all "
        "(its reduce_scatter step): unsupported device type cuda; refused on every rank before "
        "any data moved")
    assert verdict(Shape("all_gather", 4, 9, "bfloat16", 2)) is None
    assert verdict(Shape("broadcast", 4, 9, "int8", 1, root=3)) is None
    assert "cannot run all_to_all (its all_to_all step)" in verdict(Shape("all_to_all", 4, 3))


def test_init_refuses_hosts_whose_ranks_differ_and_ranks_that_would_cut_calls_apart():
    from hoccl._hierarchy.hosts import HostReport, agree
    from hoccl.sched.hierarchical import Topology
    shared = (("phases", "auto"), ("phase_bytes", 1 << 26), ("stage_bytes", 1 << 22))
    cpu = HostReport("a", "cpu", "host", "host", "hoccl (host)", shared)
    gloo = HostReport("b", "cpu", "torch", "host", "torch (gloo)", shared)
    assert agree("init", [cpu, cpu, gloo, gloo], Topology(2, 2)) == [cpu, gloo]
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^init: the ranks of host 1 \(b\) must use one engine inside it; "
                             r"rank 2 has torch \(gloo\) on cpu, rank 3 hoccl \(host\) on cpu"):
        agree("init", [cpu, cpu, gloo, cpu], Topology(2, 2))
    other = HostReport("b", "cpu", "torch", "host", "torch (gloo)",
                       (("phases", "auto"), ("phase_bytes", 1 << 20), ("stage_bytes", 1 << 22)))
    with pytest.raises(hoccl.InvalidArgumentError,
                       match=r"^init: every rank must have the same \['phases', 'phase_bytes', "
                             r"'stage_bytes'\]; .* rank 3 .*\(differ: \['phase_bytes'\]\)"):
        agree("init", [cpu, cpu, gloo, other], Topology(2, 2))


def test_a_host_on_the_host_backend_pulls_its_reductions_unless_told():
    """``host_config``: the host backend inside a hierarchy pulls every reduction (a CPU
    has no copy engine to push with); a ``pull_bytes`` the user set stands, and the cuda
    backend keeps its table's or the defaults' choice."""
    from hoccl._hierarchy.hosts import HOST_PULL_BYTES, host_config
    plain = hoccl.Config()
    assert plain.pull_bytes == 0
    assert host_config(plain, "host").pull_bytes == HOST_PULL_BYTES
    assert host_config(plain, "cuda") is plain
    chosen = hoccl.Config(pull_bytes=4096)
    assert host_config(chosen, "host").pull_bytes == 4096
    off = plain.replace("test", pull_bytes=0)  # pulling turned off by name
    assert "pull_bytes" in off.given and host_config(off, "host").pull_bytes == 0
