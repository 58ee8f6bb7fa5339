#!/usr/bin/env bash
# One device call's checks on the cuda backend, ranks sharing the machine's GPUs under
# mpirun; logs under $OUT, a table last.  Usage: bash tools/gpu_checks.sh PART
#   prepared     the GPU tier on prepared calls (1, 2 and 3 ranks; registered, direct,
#                chunked, repeated, captured), divergence and failure scenarios, and
#                tools/profile_call.py before (.baseline) and after
#   mixed        a mixed job (2 ranks on the GPU, 2 on the CPU, two hosts, the staged
#                engine between): every collective, staging in small chunks, torch's
#                collectives and DDP on it, and python -m hoccl.bench.mixed beside gloo;
#                the staged steps and the benchmark again on MPI's own path
#                (HOCCL_CROSS_MEMORY=0), and tools/stage_probe.py's cross-memory reads
#   mixed-quick  the mixed job's checks, torch's collectives and DDP on it, the benchmark
#                beside gloo and the timeline of a 64 MiB all_reduce (the mixed part's
#                core, in about three minutes)
#   shared       the mixed job's core with the benchmark on plain and shared host memory
#                (hoccl.host_empty) beside gloo, the host backend's checks on shared memory
#                (run_checks --shared-memory, -np 4), timelines of a 64 MiB all_reduce on
#                each, the staged engine's steps on GPU ranks in 4 KiB stages, then the
#                GPU tier and run_checks on the cuda backend (-np 2, -np 3)
#   phases       the mixed job's all_reduce phases at 256 MiB: the benchmark's pipelined /
#                sequential / phase-alone study at phase chunks of 16M (gloo beside it)
#                and the default, tools/profile_phase.py's timeline of the whole call (pipelined,
#                sequential) and its profile of the rail phase (hoccl alone)
#   roof         tools/memory_probe.py (4 ranks copying at once: the machine's memory roof),
#                then the mixed job's phase study (hoccl alone) at stages of 16M, 8 host
#                threads, and phase chunks of 128M
#   tier         the GPU tier in one process and run_checks under mpirun -np 2 and -np 3,
#                then tools/profile_phase.py's timeline of the mixed job's all_reduce at
#                64 MiB (pipelined and sequential) and its rail phase alone
#   chunks       the mixed job's all_reduce at 64 MiB: tools/profile_phase.py's timeline
#                (pipelined) and its rail phase alone, then the benchmark (hoccl alone) at
#                64M and 256M in phase chunks of 32M and 16M
#   reliability  the failure scenarios (a peer dead, killed, closed, aborting), the
#                direct-kernel divergence scenarios, the lost-peer exit under Open MPI,
#                the torch backend's checks and training checks
#   tune         python -m hoccl.tune under mpirun -np 2 within its budget, run_checks
#                with the table it wrote, then python -m hoccl.bench with hoccl-auto
#                beside the hand-set variants on that table (each library's median of 3
#                rounds, timed in turn: one loop's time drifts by ±10 % on a shared GPU)
#   tune2        the same, shorter (at most 8 minutes; the tuner's budget 110 s, sizes 4K to
#                16M by 4x), the tuner's --beside-compute on the reductions (a bf16 torch
#                GEMM beside them), and tools/criteria.py's rows of issue 29: hoccl-auto
#                within 5 % of the fastest hand-set variant at each size
# Ranks sharing one GPU time-slice their contexts: this shows correctness, and the
# tuner and benchmark run end to end; the timings are that machine's only.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
export PYTHONPATH=$PWD MASTER_ADDR=127.0.0.1 MASTER_PORT=29511
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
MPIRUN="mpirun -np 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS -x MASTER_ADDR -x MASTER_PORT"
KEEP="--mca orte_abort_on_non_zero_status 0"
rows=()
run() {  # NAME LIMIT COMMAND...: the command's log, its status and its last line
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local status=$?
  rows+=("$(printf '%-26s exit %-3s %4ss  %s' "$name" "$status" "$((SECONDS - start))" \
    "$(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-110)")")
}
oks() {  # NAME: how many "rank R: OK" lines its log has
  grep -c 'rank [0-9]*: OK' "$OUT/$1.log"
}
# the mixed job: ranks 0-1 on the GPU (hoccl's cuda backend inside their simulated
# host), ranks 2-3 on the CPU (host backend), the staged engine between
MPI4="${MPIRUN/-np 2/-np 4}"
P="--devices cuda,cuda,cpu,cpu --intra-host cuda,cuda,host,host --local-size 2"
mixed_core() {  # its checks, torch's collectives and DDP on it, the benchmark beside gloo
  local memory=${1:-plain}
  run mixed-job 150 $MPI4 python3 tests/mpi/run_mixed_job.py
  rows[-1]="${rows[-1]}  [OK lines: $(oks mixed-job)]"
  run torch-mixed 100 env PYTHONPATH=$PWD/tests/torch_programs:$PWD $MPI4 \
    python3 tests/torch_programs/run_backend.py $P
  run ddp-mixed 100 env PYTHONPATH=$PWD/tests/torch_programs:$PWD $MPI4 \
    python3 tests/torch_programs/run_training.py $P --only DDP
  run bench-mixed 260 $MPI4 -x OMP_NUM_THREADS=4 python3 -m hoccl.bench.mixed $P \
    --sizes 1M,16M,64M,256M --phase-bytes 256M --iters 3 --host-memory "$memory" \
    --out "$OUT/bench-mixed"
}
case "${1:-}" in
prepared)
  # the cuda paths of prepared calls: the GPU tier, repeated, registered, captured and
  # direct-kernel calls, failures, and host time per call beside .baseline (a checkout
  # of an earlier commit: git archive COMMIT | tar -x -C .baseline) when there is one
  MPI3="${MPIRUN/-np 2/-np 3}"
  run gpu-local 120 python3 -m pytest -q -x -p no:cacheprovider --timeout=60 tests/gpu
  for ranks in 2 3; do
    launch=$MPIRUN; [ $ranks = 3 ] && launch=$MPI3
    for flags in "" "--registered" "--kernel-bytes 65536" "--chunk-bytes 64"; do
      run "checks-np$ranks${flags:+-${flags//[ -]/}}" 60 $launch python3 tests/mpi/run_checks.py \
        --backend cuda --counts 0,1,17,1003 $flags
    done
  done
  run repeats 40 $MPIRUN python3 tests/mpi/run_repeats.py --backend cuda
  run capture 70 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda
  for scenario in repeat replay silent; do
    run "diverge-$scenario" 40 $MPIRUN $KEEP python3 tests/mpi/run_direct_divergence.py \
      $scenario --backend cuda
  done
  for scenario in mismatch dead abort; do
    run "fail-$scenario" 40 $MPIRUN $KEEP python3 tests/mpi/run_failures.py $scenario --backend cuda
  done
  for round in 1 2; do
    if [ -d .baseline ]; then
      run "profile-before-$round" 40 env PYTHONPATH=$PWD/.baseline $MPIRUN \
        python3 .baseline/tools/profile_call.py --size 1M --iters 300
    fi
    run "profile-after-$round" 40 $MPIRUN python3 tools/profile_call.py --size 1M --iters 300
  done
  ;;
mixed)
  mixed_core
  run staged-gpu-ranks 60 $MPIRUN -x HOCCL_STAGE_BYTES=4096 python3 tests/mpi/run_hierarchical.py \
    --backend cuda --inter-host mpi --local-size 1 --counts 0,1,17,100003
  # the same job with the staged engine on MPI's own path (no cross-memory reads)
  run staged-gpu-ranks-p2p 60 $MPIRUN -x HOCCL_STAGE_BYTES=4096 -x HOCCL_CROSS_MEMORY=0 \
    python3 tests/mpi/run_hierarchical.py --backend cuda --inter-host mpi --local-size 1 \
    --counts 0,1,17,100003
  run bench-mixed-p2p 120 $MPI4 -x OMP_NUM_THREADS=4 -x HOCCL_CROSS_MEMORY=0 \
    python3 -m hoccl.bench.mixed $P --sizes 64M,256M --phase-bytes 256M --iters 3 \
    --libraries hoccl --out "$OUT/bench-mixed-p2p"
  run probe 60 $MPIRUN python3 tools/stage_probe.py --devices cuda,cpu --sizes 4M,64M --cma
  ;;
mixed-quick)
  mixed_core
  run profile-64M-pipelined 60 $MPI4 python3 tools/profile_phase.py $P --size 64M \
    --phase pipelined
  ;;
phases)
  # gloo beside the first (the same run), hoccl alone beside the second
  run phases-16M 120 $MPI4 -x OMP_NUM_THREADS=4 python3 -m hoccl.bench.mixed $P \
    --sizes 16M,64M,256M --phase-bytes 256M --iters 3 --phase-chunk 16M --out "$OUT/phases-16M"
  run phases-default 90 $MPI4 -x OMP_NUM_THREADS=4 python3 -m hoccl.bench.mixed $P \
    --sizes 64M --phase-bytes 256M --iters 3 --libraries hoccl --out "$OUT/phases-default"
  for phase in pipelined sequential "rail all_reduce"; do
    run "profile-${phase// /-}" 60 $MPI4 python3 tools/profile_phase.py $P --size 256M \
      --phase "$phase"
  done
  ;;
roof)
  run memory 90 $MPI4 python3 tools/memory_probe.py --bytes 256M --threads 1,2,4
  for setting in HOCCL_STAGE_BYTES=16777216 HOCCL_HOST_THREADS=8 chunk=128M; do
    extra=(); [ "${setting%%=*}" = chunk ] && extra=(--phase-chunk "${setting#*=}")
    run "roof-${setting}" 90 env "$setting" $MPI4 -x OMP_NUM_THREADS=4 -x "${setting%%=*}" \
      python3 -m hoccl.bench.mixed $P --sizes 64M --phase-bytes 256M --iters 3 \
      --libraries hoccl "${extra[@]}" --out "$OUT/roof-${setting}"
  done
  ;;
shared)
  MPI3="${MPIRUN/-np 2/-np 3}"
  mixed_core both
  run checks-host-shared 90 $MPI4 python3 tests/mpi/run_checks.py --backend host \
    --shared-memory --counts 0,1,17,1000,70000
  for memory in plain shared; do
    run "profile-64M-$memory" 60 $MPI4 python3 tools/profile_phase.py $P --size 64M \
      --phase pipelined --host-memory "$memory"
  done
  run staged-gpu-ranks 60 $MPIRUN -x HOCCL_STAGE_BYTES=4096 python3 tests/mpi/run_hierarchical.py \
    --backend cuda --inter-host mpi --local-size 1 --counts 0,1,17,100003
  run gpu-local 150 python3 -m pytest -q -x -p no:cacheprovider --timeout=60 tests/gpu
  run checks-np2 60 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,1003
  run checks-np3 60 $MPI3 python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,1003
  ;;
tier)
  MPI3="${MPIRUN/-np 2/-np 3}"
  run gpu-local 150 python3 -m pytest -q -x -p no:cacheprovider --timeout=60 tests/gpu
  run checks-np2 60 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,1003
  run checks-np3 60 $MPI3 python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,1003
  for phase in pipelined sequential "rail all_reduce"; do
    run "profile-64M-${phase// /-}" 60 $MPI4 python3 tools/profile_phase.py $P --size 64M \
      --phase "$phase"
  done
  ;;
chunks)
  for phase in pipelined "rail all_reduce"; do
    run "profile-64M-${phase// /-}" 60 $MPI4 python3 tools/profile_phase.py $P --size 64M \
      --phase "$phase"
  done
  for chunk in 32M 16M; do
    run "chunks-$chunk" 90 $MPI4 -x OMP_NUM_THREADS=4 python3 -m hoccl.bench.mixed $P \
      --sizes 64M,256M --phase-bytes 256M --iters 3 --libraries hoccl --phase-chunk "$chunk" \
      --out "$OUT/chunks-$chunk"
  done
  ;;
reliability)
  for scenario in mismatch dead absent killed early closed abort; do
    run "fail-$scenario" 60 $MPIRUN $KEEP python3 tests/mpi/run_failures.py $scenario --backend cuda
    rows[-1]="${rows[-1]}  [OK lines: $(oks fail-$scenario)]"
  done
  run fail-closed-direct 60 $MPIRUN $KEEP python3 tests/mpi/run_failures.py closed --backend cuda \
    --kernel-bytes 1048576
  for scenario in collective count; do  # (late is the host backend's)
    run "diverge-$scenario" 60 $MPIRUN $KEEP python3 tests/mpi/run_direct_divergence.py $scenario \
      --backend cuda
    rows[-1]="${rows[-1]}  [OK lines: $(oks diverge-$scenario)]"
  done
  for how in exit kill; do
    run "lost-peer-exit-$how" 60 $MPIRUN $KEEP python3 tests/mpi/run_lost_peer_exit.py $how \
      --backend cuda
  done
  run torch-backend 200 $MPIRUN python3 tests/torch_programs/run_backend.py --device cuda
  # NCCL refuses two ranks on one GPU: hoccl's own plain path is the training reference
  run torch-training 200 $MPIRUN python3 tests/torch_programs/run_training.py --device cuda \
    --reference hoccl
  ;;
tune|tune2)
  table="$OUT/tune-h200-2ranks-shared.json"
  budget=200 limit=260 sizes=4K,64K,1M,16M
  if [ "$1" = tune2 ]; then budget=110 limit=150 sizes=4K,16K,64K,256K,1M,4M,16M; fi
  run tune "$limit" $MPIRUN python3 -m hoccl.tune --backend cuda --max-bytes 16M \
    --budget "$budget" --output "$table"
  if [ "$1" = tune2 ]; then  # its own table: the bench below runs on the plain one
    run tune-beside 60 $MPIRUN python3 -m hoccl.tune --backend cuda --beside-compute \
      --collectives reduce_scatter,all_reduce --max-bytes 1M --budget 40 \
      --output "$OUT/tune-beside.json"
  fi
  export HOCCL_TUNING_FILE="$table"
  MPIRUN="$MPIRUN -x HOCCL_TUNING_FILE"
  run checks-tuned 45 env HOCCL_DEBUG=INFO $MPIRUN -x HOCCL_DEBUG python3 tests/mpi/run_checks.py \
    --backend cuda --counts 0,1,17,1003
  rows+=("  table rows used by the checks: $(grep -c 'from table row' "$OUT/checks-tuned.log") log lines")
  run bench-auto 200 $MPIRUN python3 -m hoccl.bench --sizes "$sizes" --forms in --rounds 3 \
    --libraries hoccl-auto,hoccl,hoccl+kernel_bytes=16M,hoccl+pull_bytes=16M,hoccl+one_shot_bytes=16M \
    --out "$OUT/bench"
  python3 tools/criteria.py "$OUT/bench" > "$OUT/auto-vs-best.md" 2>&1
  grep -E '^\| 29 |^issue 29' "$OUT/auto-vs-best.md" | tee -a "$OUT/auto-vs-best.txt"
  rows+=("  $(grep '^issue 29' "$OUT/auto-vs-best.md")")
  ;;
*)
  echo "usage: bash tools/gpu_checks.sh prepared|mixed|mixed-quick|shared|phases|roof|tier|chunks|reliability|tune|tune2" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -1
printf '%s\n' "${rows[@]}" | tee "$OUT/summary.txt"
tar -czf "$OUT/logs.tgz" -C "$OUT" --exclude logs.tgz . 2>/dev/null
