"""The cost model (hoccl.sched.cost) follows the formulas it cites and prints its table."""

import math

import pytest

from hoccl.sched.cost import (Machine, Phase, best_chunks, bus_bandwidth, hoccl_hierarchical,
                              host_shares, main, nccl_ring, nccl_tree, phases, pipeline_us)

GIB = 1 << 30


def test_the_ring_on_one_host_is_nccl_tests_formula_plus_latency():
    m = Machine(hosts=1, gpus_per_host=8, nvlink_gbps=400.0)
    steps = 2 * 7
    latency = m.nccl_base_us + steps * m.nvlink_latency_us
    assert nccl_ring("all_reduce", GIB, m) == pytest.approx(
        latency + GIB * 2 * 7 / 8 / 400e3)


def test_across_hosts_the_ring_is_limited_by_the_hosts_nics():
    m = Machine(hosts=4, gpus_per_host=8, nvlink_gbps=1000.0, nic_gbps=50.0,
                nvlink_latency_us=0.0, net_latency_us=0.0, nccl_base_us=0.0)
    time = nccl_ring("all_gather", GIB, m)
    assert bus_bandwidth("all_gather", GIB, time, 32) == pytest.approx(400.0)


def test_the_tree_has_logarithmic_network_latency():
    small = 1024
    deltas = [nccl_tree(small, Machine(hosts=h)) - nccl_tree(small, Machine(hosts=h // 2))
              for h in (4, 8, 16)]
    assert deltas == pytest.approx([2 * Machine(1).net_latency_us] * 3, rel=1e-3)


COLLECTIVES = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all"]
#: a machine whose every per-chunk cost is zero: only transfers count
FREE = dict(hoccl_call_us=0.0, copy_call_us=0.0, mpi_call_us=0.0, net_latency_us=0.0,
            nccl_base_us=0.0)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
@pytest.mark.parametrize("hosts", [2, 8, 64])
@pytest.mark.parametrize("staged", [False, True])
@pytest.mark.parametrize("nbytes", [1 << 20, 256 << 20, GIB])
def test_overlapping_the_phases_in_the_best_chunks_never_costs_more(collective, hosts, staged,
                                                                    nbytes):
    m = Machine(hosts=hosts)
    sequential = hoccl_hierarchical(collective, nbytes, m, staged=staged)
    assert hoccl_hierarchical(collective, nbytes, m, pipelined=True, staged=staged) <= sequential


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("staged", [False, True])
def test_one_chunk_is_the_phases_one_after_another(collective, staged):
    steps = phases(collective, GIB, Machine(hosts=4), staged)
    assert pipeline_us(steps, 1) == pytest.approx(
        sum(phase.host_us + phase.latency_us + phase.transfer_us for phase in steps))


@pytest.mark.parametrize("collective", COLLECTIVES)
@pytest.mark.parametrize("staged", [False, True])
def test_with_no_per_chunk_cost_the_pipeline_tends_to_its_busiest_level(collective, staged):
    steps = phases(collective, GIB, Machine(hosts=8, **FREE), staged)
    levels = {}
    for phase in steps:
        levels[phase.level] = levels.get(phase.level, 0.0) + phase.transfer_us
    times = [pipeline_us(steps, 1 << k) for k in range(0, 21, 4)]
    assert times == sorted(times, reverse=True)  # more chunks, less fill and drain
    assert times[-1] >= max(levels.values())
    assert times[-1] == pytest.approx(max(levels.values()), rel=1e-4)


def test_the_fill_and_drain_are_the_other_phases_chunk_times():
    """Two levels of T each: the first chunk crosses both (2T/k), then k-1 periods of T/k."""
    steps = [Phase("a", "one", 0.0, 0.0, 100.0), Phase("b", "two", 0.0, 0.0, 100.0)]
    for chunks in (1, 2, 5, 64):
        assert pipeline_us(steps, chunks) == pytest.approx(100.0 * (chunks + 1) / chunks)


def test_phases_of_one_level_take_turns_and_per_chunk_costs_add_up():
    """all_reduce's reduce_scatter and all_gather inside a host run on one level, so the
    period holds both; each chunk pays their host costs again."""
    m = Machine(hosts=2)
    steps = phases("all_reduce", GIB, m)
    assert [phase.level for phase in steps] == ["host", "rail", "host"]
    host = steps[0].transfer_us + steps[2].transfer_us
    assert pipeline_us(steps, 1 << 12) >= host + (1 << 12) * 2 * m.hoccl_call_us
    best = best_chunks(steps, GIB)
    assert pipeline_us(steps, best) <= min(pipeline_us(steps, k) for k in (1, 2, 8, 64, 256))


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
def test_all_gather_and_reduce_scatter_pipeline_one_share_per_host(collective):
    """One chunk per host: each pays one hoccl call and a broadcast's (reduce's) H - 1
    network steps.  It hides the rail behind the host phase on a few hosts; on many, the
    latencies of H rail calls outweigh it."""
    m = Machine(hosts=4)
    shares = host_shares(collective, GIB, m)
    host = [phase for phase in shares if phase.level == "host"]
    rail = [phase for phase in shares if phase.level == "rail"]
    assert [phase.host_us for phase in host] == [m.hoccl_call_us]
    assert rail[0].latency_us == pytest.approx(m.nccl_base_us + 3 * m.net_latency_us)
    pipelined = hoccl_hierarchical(collective, GIB, m, pipelined=True)
    assert pipelined == pytest.approx(pipeline_us(shares, 4))
    assert pipelined < hoccl_hierarchical(collective, GIB, m)
    many = Machine(hosts=64)  # a share of 16 MiB: the shares' latencies would outweigh it
    sequential = hoccl_hierarchical(collective, GIB, many)
    assert pipeline_us(host_shares(collective, GIB, many), 64) > sequential
    assert hoccl_hierarchical(collective, GIB, many, pipelined=True) == sequential


def test_the_runtimes_chunk_size_gives_the_chunk_count():
    m = Machine(hosts=4)
    steps = phases("all_reduce", GIB, m)
    assert hoccl_hierarchical("all_reduce", GIB, m, pipelined=True, chunk_bytes=64 << 20) == \
        pytest.approx(pipeline_us(steps, 16))


def test_the_staged_engine_adds_its_copies_as_levels_of_their_own():
    m = Machine(hosts=4, **FREE)
    plain, staged = phases("all_reduce", GIB, m), phases("all_reduce", GIB, m, staged=True)
    assert [phase.name for phase in staged] == [
        "host reduce_scatter", "device to host", "rail all_reduce", "host to device",
        "host all_gather"]
    assert {phase.level for phase in staged} == {"host", "stage in", "rail", "stage out"}
    per_gpu = GIB / 8
    assert staged[1].transfer_us == pytest.approx(per_gpu / (m.staging_gbps * 1e3))
    # the rail's sums run on the CPUs: the staged rail is the plain one plus them
    assert staged[2].transfer_us == pytest.approx(
        plain[1].transfer_us + per_gpu * 3 / 4 / (m.host_reduce_gbps * 1e3))


def test_between_two_hosts_the_staged_all_reduce_is_one_step_and_a_whole_fold():
    """As built (``StagedEngine.all_reduce``): the same bytes on the wire as the ring's two
    steps, one step's latency, and each host sums the whole message, not half of it."""
    m = Machine(hosts=2)
    plain, staged = phases("all_reduce", GIB, m), phases("all_reduce", GIB, m, staged=True)
    per_gpu = GIB / 8
    assert staged[2].latency_us == pytest.approx(plain[1].latency_us - m.net_latency_us)
    assert staged[2].transfer_us == pytest.approx(
        plain[1].transfer_us + per_gpu / (m.host_reduce_gbps * 1e3))


def test_the_hierarchical_network_share_is_one_nic_per_rail():
    """all_reduce's rail phase moves 2(H-1)/H of S/G through each GPU's NIC."""
    m = Machine(hosts=16, nvlink_gbps=math.inf, reduce_gbps=math.inf, hoccl_call_us=0.0,
                net_latency_us=0.0, nccl_base_us=0.0)
    assert hoccl_hierarchical("all_reduce", GIB, m) == pytest.approx(
        GIB / 8 * 2 * 15 / 16 / 50e3)


def test_the_program_prints_a_table_per_collective(capsys):
    main(["--collective", "all_reduce,all_gather", "--size", "1G", "--hosts", "1,2,64"])
    out = capsys.readouterr().out
    assert "a model, not a measurement" in out
    assert ("| hosts x gpus | nccl ring | hoccl hier | hoccl pipelined | pipelined 64M chunks | "
            "staged pipelined | nccl tree | chunks |") in out
    assert "| 64 x 8 |" in out and "all_gather, 1G" in out
    assert out.count("pipelined at or below the ring at hosts") == 2


def test_the_models_runtime_chunk_is_the_configs_default():
    """The "pipelined ... chunks" column is the runtime's default ``phase_bytes``."""
    from hoccl.config import Config
    from hoccl.sched.cost import PHASE_BYTES
    assert PHASE_BYTES == Config().phase_bytes


@pytest.mark.parametrize("collective", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("hosts,share_chunks,pipelined", [
    (2, 1, True), (2, 0.5, False), (4, 1, True), (4, 0.75, False), (8, 2, True),
    (64, 0.25, False)])
def test_the_runtime_pipelines_by_host_where_each_share_holds_a_chunk(collective, hosts,
                                                                      share_chunks, pipelined):
    """``plan_of`` (the runtime) and the model choose alike: one chunk per host where each
    host's share holds ``phase_bytes``, else the phases in turn; ``phases="pipelined"``
    pipelines whatever the size."""
    from hoccl._hierarchy.phases import plan_of
    from hoccl.sched import Shape
    from hoccl.sched.hierarchical import PipelinedPlan, Topology
    topology, phase_bytes, local = Topology(hosts, 2), 1 << 20, 2
    count = int(share_chunks * phase_bytes) // 4 // local  # elements per rank
    shape = Shape(collective, hosts * local, count, "float32", 4)
    plan = plan_of(shape, topology, "auto", phase_bytes, stream_ordered=False)
    assert isinstance(plan, PipelinedPlan) == pipelined
    forced = plan_of(shape, topology, "pipelined", phase_bytes, stream_ordered=False)
    assert isinstance(forced, PipelinedPlan)
    m = Machine(hosts=hosts)
    nbytes = float(count * 4 * hosts * local)
    modelled = hoccl_hierarchical(collective, nbytes, m, pipelined=True, chunk_bytes=phase_bytes)
    assert modelled == pytest.approx(pipeline_us(host_shares(collective, nbytes, m), hosts)
                                     if pipelined else pipeline_us(phases(collective, nbytes, m), 1))
