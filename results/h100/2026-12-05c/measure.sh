#!/usr/bin/env bash
# host cost before (the checkout's root: main) and after (.gpu-host/tree), then the cuda checks
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
ROOT=$PWD; H=$ROOT/.gpu-host
python3 -m pip install -q --no-index --no-deps --target /tmp/site $H/.wheels/*.whl
MPI="mpirun -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
run() { local name=$1 lim=$2; shift 2; local t=$SECONDS; timeout $lim "$@" > $OUT/$name.log 2>&1; echo "$name rc=$? $((SECONDS-t))s $(tail -n1 $OUT/$name.log)" >> $OUT/summary.txt; }
V=hoccl-registered,hoccl-plain,hoccl-direct
cd $H/tree; export PYTHONPATH=$H/tree:/tmp/site
run after-1 150 python3 -m hoccl.bench.host_cost --bursts 10 --out $OUT/after1
run after-2 80 $MPI -np 2 python3 -m hoccl.bench.host_cost --bursts 10 --variants $V --out $OUT/after2
cd $ROOT; export PYTHONPATH=$ROOT:/tmp/site
run before-1 100 python3 -m hoccl.bench.host_cost --bursts 10 --variants $V --out $OUT/before1
run before-2 80 $MPI -np 2 python3 -m hoccl.bench.host_cost --bursts 10 --variants $V --out $OUT/before2
cd $H/tree; export PYTHONPATH=$H/tree:/tmp/site
run checks-2 60 $MPI -np 2 python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
run checks-3 60 $MPI -np 3 python3 tests/mpi/run_checks.py --backend cuda --counts 0,17,100003
run repeats 40 $MPI -np 2 python3 tests/mpi/run_repeats.py --backend cuda
run capture 50 $MPI -np 2 python3 tests/mpi/run_capture.py --backend cuda --replays 200
run gpu-local 130 python3 -m pytest -q -x -p no:cacheprovider --timeout=60 tests/gpu
cd $OUT; tar czf logs.tgz *.log; cat summary.txt
for f in after1 after2 before1 before2; do cat $f/host_cost.md | grep "^|" ; done
