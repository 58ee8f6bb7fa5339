"""Benchmarks against NCCL in the same run.

* ``python -m hoccl.bench`` — nccl-tests-style sweep: time, algbw, busbw, #wrong per
  size, for hoccl and NCCL (torch.distributed, nccl4py, and NCCL's zero-SM copy-engine
  mode), with the ratio hoccl / best NCCL; writes JSON and PNG plots.
* ``python -m hoccl.bench.overlap`` — a bf16 GEMM loop beside each library's
  collective loop: GEMM TFLOP/s alone and beside each, and the collective's bandwidth
  meanwhile.
* ``python -m hoccl.bench.tp`` — a tensor-parallel MLP layer (all_gather, matmuls,
  reduce_scatter) sequential and chunk-overlapped on hoccl and NCCL, and torch's async-TP
  (``mpirun -np 2`` only).
* ``python -m hoccl.bench.mixed`` — all_reduce, all_gather and point to point across hosts
  (``sendrecv``) on a job whose ranks are on different devices (GPU and CPU ranks as
  simulated hosts) beside gloo on the same tensors, and the phases pipelined, sequential
  and alone (``mpirun -np 4``).

The one-GPU lever study (hoccl's reduction kernel beside a bf16 GEMM, lever by lever) is
research, not a benchmark users run: it lives outside the package, in
``benchmarks/levers.py`` of the source tree.

Run under ``mpirun -np N`` (one GPU per rank; NCCL baselines need this), or with
``--local N`` in one process (hoccl only).
"""

__all__: list = []  # programs, not an API: run them with python -m
