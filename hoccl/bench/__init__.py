"""Benchmarks against NCCL in the same run.

* ``python -m hoccl.bench`` — nccl-tests-style sweep: time, algbw, busbw, #wrong per
  size, for hoccl and NCCL (torch.distributed, nccl4py, and NCCL's zero-SM copy-engine
  mode), with the ratio hoccl / best NCCL; writes JSON and PNG plots.
* ``python -m hoccl.bench.overlap`` — a bf16 GEMM loop beside each library's
  collective loop: GEMM TFLOP/s alone and beside each, and the collective's bandwidth
  meanwhile.

Run under ``mpirun -np N`` (one GPU per rank; NCCL baselines need this), or with
``--local N`` in one process (hoccl only).
"""

__all__: list = []  # programs, not an API: run them with python -m
