#!/usr/bin/env bash
# Correct programs of many small calls on the cuda backend, with 3 and 4 ranks sharing
# the machine's GPUs under mpirun (tests/mpi/run_small_calls.py: the mixed small-call
# sequence and the zero-size one, direct kernels on and off), the direct-kernel
# divergence scenarios, then the GPU tier in one process.  Logs under $OUT; a table last.
# Usage: bash tools/gpu_small_calls.sh [RUNS]   (RUNS per case, default 5)
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONPATH=$PWD
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
RUNS=${1:-5}
rows=()
mpi() { mpirun -np "$1" -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST \
        -x NVSHMEM_DISABLE_NVLS "${@:2}"; }
case_runs() {  # NAME RANKS CALLS ARGS...: RUNS runs of run_small_calls.py
  local name=$1 ranks=$2 calls=$3; shift 3
  local ok=0 bad=0 start=$SECONDS
  for run in $(seq "$RUNS"); do
    log="$OUT/$name-n$ranks-$run.log"
    timeout 300 bash -c "$(declare -f mpi); mpi $ranks python3 tests/mpi/run_small_calls.py $* \
      --backend cuda --calls $calls" > "$log" 2>&1
    if [ "$(grep -o "OK $calls" "$log" | wc -l)" = "$ranks" ]; then ok=$((ok + 1)); else bad=$((bad + 1)); fi
  done
  rows+=("$(printf '%-28s ranks=%s calls=%-5s runs ok %s, failed %s (%ss)' "$name" "$ranks" "$calls" "$ok" "$bad" "$((SECONDS - start))")")
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
for ranks in 3 4; do
  case_runs mixed-direct "$ranks" 1000 mixed --kernel-bytes 4096
  case_runs zero-direct "$ranks" 300 zero --kernel-bytes 4096
  case_runs zero-off "$ranks" 100 zero --kernel-bytes 0
done
case_runs mixed-broadcast-first 3 20 mixed --kernel-bytes 4096 --start 3
for scenario in silent count blocks collective repeat replay; do
  log="$OUT/divergence-$scenario.log"
  timeout 120 bash -c "$(declare -f mpi); mpi 2 python3 tests/mpi/run_direct_divergence.py $scenario --backend cuda" > "$log" 2>&1
  rows+=("$(printf '%-28s %s of 2 ranks OK, %s FAILED lines' "divergence-$scenario" \
    "$(grep -c 'rank [01]: OK' "$log")" "$(grep -c 'FAILED' "$log")")")
done
timeout 120 bash -c "$(declare -f mpi); mpi 2 python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003" > "$OUT/checks-np2.log" 2>&1
rows+=("checks-np2                   $(grep -h ' passed, ' "$OUT/checks-np2.log" | tail -1)")
timeout 240 python3 -m pytest -q -p no:cacheprovider --timeout=90 tests/gpu > "$OUT/gpu-tier.log" 2>&1
rows+=("gpu-tier (one process)       $(tail -1 "$OUT/gpu-tier.log")")
cat "$OUT/gpu.txt"
printf '%s\n' "${rows[@]}" | tee "$OUT/summary.txt"
