#!/usr/bin/env bash
# one GPU: the fuzzer's cuda hang bisected, grouped calls, shrink on cuda, the mixed job
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
M="mpirun -np 3 -x PYTHONPATH -x HOCCL_KERNEL_BYTES -x HOCCL_TIMEOUT"
f() { local lim=$1; shift; echo "=== $*"; timeout $lim "$@" > /tmp/f.log 2>&1; echo "rc=$?";
  grep -E "fuzz rank|OK|FAILED|error:|Error|passed" /tmp/f.log | cut -c1-260 | sort | uniq | head -6; }
F="python3 -m hoccl.testing.fuzz --backend cuda --calls 20 --seed 11 --timeout 12"
f 50 $M $F
f 50 $M $F --no-streams
f 50 $M $F --no-registered
f 50 $M $F --no-grouped-collectives
HOCCL_KERNEL_BYTES=0 f 50 $M $F
for mix in random broadcast; do f 60 $M python3 tests/mpi/run_groups.py --backend cuda --mix $mix --groups 24 --timeout 20; done
mkdir -p /tmp/st
for s in excluded closed; do f 60 $M python3 tests/mpi/run_shrink.py $s --victims 2 --stamps /tmp/st; done
f 60 mpirun -np 3 --mca orte_abort_on_non_zero_status 0 -x PYTHONPATH python3 tests/mpi/run_shrink.py dead --victims 1 --stamps /tmp/st
HOCCL_TIMEOUT=40 timeout 170 mpirun -np 4 -x PYTHONPATH -x HOCCL_TIMEOUT -x OMP_NUM_THREADS=4 python3 tests/mpi/run_mixed_job.py --json $OUT/mixed_job.json > $OUT/mixed.log 2>&1; echo "mixed rc=$?"; grep -E "OK|FAILED|passed|Error" $OUT/mixed.log | cut -c1-200 | head -20
