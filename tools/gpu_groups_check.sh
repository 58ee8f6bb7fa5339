#!/usr/bin/env bash
# One GPU, three ranks sharing it under mpirun: grouped calls, the fuzzer, shrink and the
# mixed job on the cuda backend, in one device call of under ten minutes.
#   bash tools/gpu_groups_check.sh bisect    # the fuzzer's seed-11 group, each option off
#                                            # in turn, then the groups' mixes, shrink and
#                                            # the mixed job
#   bash tools/gpu_groups_check.sh confirm   # the fuzzer at 300 calls (seeds 11, 5, 23 on
#                                            # 3 ranks, seed 5 on 4) and the groups' mixes
# Logs go to $OUT (default ./gpu-out), all of them into $OUT/logs.tgz; a summary is printed
# last.  Independent steps run side by side (correctness only: ranks share one GPU).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export MASTER_ADDR=127.0.0.1
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT/logs"
what=${1:-bisect}
DEPS=/tmp/hoccl-deps
if ls .wheels/*.whl >/dev/null 2>&1 && [ ! -d "$DEPS/humanfriendly" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$DEPS" .wheels/*.whl > "$OUT/logs/pip.log" 2>&1
fi
export PYTHONPATH=$PWD:$DEPS
MPI3="mpirun -np 3 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
BUDGET=${GPU_RUN_BUDGET:-545}
summary=()
step() {  # step NAME TIMEOUT COMMAND...: one step, its log $OUT/logs/NAME.log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS left=$((BUDGET - 20 - SECONDS))
  if [ "$left" -lt 15 ]; then echo "skipped (budget)" > "$OUT/logs/$name.log"; return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout -k 5 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  echo "rc=$? ${limit}s-limit $((SECONDS - start))s" >> "$OUT/logs/$name.log"
}
fuzz() {  # fuzz NAME TIMEOUT [ENV=VALUE...] -- FUZZ ARGS
  local name=$1 limit=$2; shift 2
  local envs=()
  while [ "$1" != "--" ]; do envs+=(-x "$1"); export "${1%%=*}=${1#*=}"; shift; done
  shift
  step "$name" "$limit" $MPI3 "${envs[@]}" python3 -m hoccl.testing.fuzz --backend cuda "$@"
  for pair in "${envs[@]}"; do [ "$pair" != -x ] && unset "${pair%%=*}"; done
}
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/logs/gpu.txt" 2>&1
SHORT="--calls 20 --seed 11 --timeout 20 --dump-stacks-after 16"
if [ "$what" = bisect ]; then
  # cold: the kernels compiled and loaded by the calls themselves, as in the run that hung
  fuzz fuzz-cold 45 -- $SHORT
  step warm 90 python3 -c "from hoccl.backends.cuda import open_device; \
d = open_device(0, max_sms=4, copy_sms=4); d._kernels(); print('kernels compiled')"
  fuzz fuzz-base 45 -- $SHORT &
  fuzz fuzz-eager 45 CUDA_MODULE_LOADING=EAGER -- $SHORT &
  fuzz fuzz-kernel0 45 HOCCL_KERNEL_BYTES=0 -- $SHORT &
  wait
  for option in streams registered grouped-collectives rings; do
    fuzz "fuzz-no-$option" 45 -- $SHORT "--no-$option" &
  done
  wait
else
  step warm 90 python3 -c "from hoccl.backends.cuda import open_device; \
d = open_device(0, max_sms=4, copy_sms=4); d._kernels(); print('kernels compiled')"
  for seed in 11 5 23; do
    fuzz "fuzz-300-seed$seed" 150 -- --calls 300 --seed $seed --timeout 40 &
  done
  step fuzz4-300-seed5 150 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE python3 -m hoccl.testing.fuzz \
    --backend cuda --calls 300 --seed 5 --timeout 40 &
  for mix in random broadcast scatter sums; do
    step "groups-$mix" 120 $MPI3 python3 tests/mpi/run_groups.py --backend cuda --mix $mix \
      --groups 24 --timeout 40 &
  done
  wait
  tar -czf "$OUT/logs.tgz" -C "$OUT" logs
  for log in "$OUT"/logs/*.log; do
    printf '== %s: %s\n' "$(basename "$log" .log)" "$(tail -n 1 "$log")"
    grep -E "hoccl fuzz rank|^rank [0-9]+:|error:" "$log" | cut -c1-300 | head -n 8
  done
  exit 0
fi
for mix in random broadcast scatter; do
  step "groups-$mix" 120 $MPI3 python3 tests/mpi/run_groups.py --backend cuda --mix $mix \
    --groups 24 --timeout 40 &
done
stamps=$(mktemp -d)
step shrink-dead 90 $MPI3 --mca orte_abort_on_non_zero_status 0 python3 tests/mpi/run_shrink.py \
  dead --victims 1 --stamps "$stamps" --backend cuda &
wait
stamps=$(mktemp -d)
step shrink-closed 90 $MPI3 --mca orte_abort_on_non_zero_status 0 python3 tests/mpi/run_shrink.py \
  closed --victims 0 --stamps "$stamps" --backend cuda
export MASTER_PORT=29531
step mixed-job 400 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
  -x NVSHMEM_DISABLE_NVLS -x MASTER_ADDR -x MASTER_PORT python3 tests/mpi/run_mixed_job.py \
  --counts 0,1,17,65537 --dtypes float32,bfloat16,int64,int8 --ops sum,max,avg \
  --json "$OUT/mixed_job.json"
tar -czf "$OUT/logs.tgz" -C "$OUT" logs
for log in "$OUT"/logs/*.log; do
  name=$(basename "$log" .log)
  printf '== %s: %s\n' "$name" "$(tail -n 1 "$log")"
  grep -E "hoccl fuzz rank|^rank [0-9]+:|OK |FAILED|Error|error:" "$log" | cut -c1-400 | head -n 8
done
