"""The cost model (hoccl.sched.cost) follows the formulas it cites and prints its table."""

import math

import pytest

from hoccl.sched.cost import (Machine, bus_bandwidth, hoccl_hierarchical, main, nccl_ring,
                              nccl_tree)

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


@pytest.mark.parametrize("collective", ["all_reduce", "all_gather", "reduce_scatter",
                                        "all_to_all"])
@pytest.mark.parametrize("hosts", [2, 8, 64])
def test_overlapping_the_phases_never_costs_more(collective, hosts):
    m = Machine(hosts=hosts)
    assert hoccl_hierarchical(collective, GIB, m, pipelined=True) <= \
        hoccl_hierarchical(collective, GIB, m)


def test_the_hierarchical_network_share_is_one_nic_per_rail():
    """all_reduce's rail phase moves 2(H-1)/H of S/G through each GPU's NIC."""
    m = Machine(hosts=16, nvlink_gbps=math.inf, reduce_gbps=math.inf, hoccl_call_us=0.0,
                net_latency_us=0.0, nccl_base_us=0.0)
    assert hoccl_hierarchical("all_reduce", GIB, m) == pytest.approx(
        GIB / 8 * 2 * 15 / 16 / 50e3)


def test_the_program_prints_a_table_per_collective(capsys):
    main(["--collective", "all_reduce,all_gather", "--size", "1G", "--hosts", "1,2,64"])
    out = capsys.readouterr().out
    assert "| hosts x gpus | nccl ring | hoccl hier | hoccl hier pipelined | nccl tree |" in out
    assert "| 64 x 8 |" in out and "all_gather, 1G" in out
