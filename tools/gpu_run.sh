#!/usr/bin/env bash
# The device machine's session: GPU tests (one process, and mpirun -np 2), then the
# benchmarks against NCCL.  Usage: bash tools/gpu_run.sh [tests|profile|bench|overlap|compare|torch|fsdp|hier|hierdiag|final|registered|onegpu|validate|dryrun|quickreg|figures-a|figures-b|figures-c|figures-d|figures-direct|figures-wide|direct|caller|placement|fused|levers|tp|groups|hostcost|world1|profile1|hostucx|core|ucxphases|mini|replay|shrink|ucx|ucxfix|ucxtorch|verify|all] [pytest args]
# groups: grouped calls (tests/mpi/run_groups.py) and the fuzzer's short run on the cuda
# backend, 3 ranks sharing the GPU under mpirun (correctness only: no speed there).
# hostcost: python -m hoccl.bench.host_cost, world 1 beside torch+NCCL, then 2 ranks.
# world1: the host cost (before, after beside NCCL, 2 ranks) and the cuda checks of a world
# of one (every collective against numpy, replays, graphs), run_checks with 2 and 3 ranks,
# the GPU tier.
# profile1: where one rank's repeated small call spends the host's time (tools/profile_call.py,
# world 1: the pieces and a cProfile), then the host-cost bench, world 1 only.
# hostucx: profile1, the cuda checks of the replayed paths (1, 2 ranks, graphs), ucxtorch.
# mini: core's checks first, the host cost of this tree only, in about 200 s.
# core: graphs under init_local, the host cost (world 1), replays, graphs, run_checks.
# shrink: dist.shrink_group on the cuda backend, three workers of a store launch.
# ucx: between simulated hosts over UCX (.wheels, tools/device_carry.sh --ucx): the mixed
# bench, two GPU ranks as two hosts, then the mixed job's checks (hoccl's, torch's, DDP);
# UCX_PART=bench,gpu-hosts,job,torch names the parts to run (UCX_STAGED= skips the staged
# two-GPU run).
# ucxphases: the mixed job over UCX: DDP/FSDP2 against gloo (PHASE_TRAINING= skips it),
# then the mixed bench with UCX's phases studied in each of PHASE_VARIANTS (phase chunk,
# stage bytes, GPU memory to UCX, HOCCL_UCX_PROGRESS, engines, libraries).
# ucxfix: which UCX transports move bytes between a GPU rank and a CPU rank over shared
# memory (tools/ucx_probe.py), then the mixed job and bench with the first that does.
# ucxtorch: two such probes, then torch's collectives and DDP/FSDP2 on the mixed job.
# verify: one GPU's correctness checks of the cuda paths: the host cost, grouped calls and
# the fuzzer (3 ranks), the GPU tier in one process, run_checks under mpirun with 2 and 3
# ranks, the mixed job across simulated hosts.
# torch: the torch.distributed backend's checks, DDP/FSDP2/HSDP training against NCCL (hoccl
# the default process group, then NCCL), the FSDP2 example on NCCL and on hoccl, and
# python -m hoccl.bench.train (one process per shape).
# levers: python benchmarks/levers.py on one GPU (LEVERS_ARGS, e.g. --quick, go to it).
# tp: python -m hoccl.bench.tp under mpirun -np 2, then its --quick run with a planted fault
# (every check must report exactly one wrong element per rank).
# compare: hoccl at 1 MiB and 1 GiB from this tree and from BASELINE (a checkout of an
# earlier commit, e.g. made with `git archive COMMIT | tar -x -C .baseline`), with NCCL,
# in one run.
# What the machine lacks travels in the call's carry: `bash tools/device_carry.sh` puts
# the wheels hoccl.bench needs (and, with --ucx, UCX's) in .wheels and, with --baseline
# REV, an earlier tree in .baseline.
# Logs and JSON go to $OUT (default ./gpu-out), and all of it into $OUT/gpu-run.tgz as
# well (the device tool brings back only a few files per call); a summary is printed last.
# The run keeps to GPU_RUN_BUDGET seconds (default 570, under the device tool's 600 s per
# command): steps that would run past it are cut short or skipped, and say so in the
# summary; set it higher where nothing stops the command (GPU_RUN_BUDGET=100000).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
what=${1:-all}; shift || true
DEPS=/tmp/hoccl-deps
if ls .wheels/*.whl >/dev/null 2>&1 && [ ! -d "$DEPS/nccl" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$DEPS" .wheels/*.whl > "$OUT/pip.log" 2>&1
fi
# wheels installed and packed here (tools/device_carry.sh --ucx: UCX's, without headers)
[ -f .wheels/site.tar.xz ] && mkdir -p "$DEPS" && tar xJf .wheels/site.tar.xz -C "$DEPS"
export PYTHONPATH=$PWD:$DEPS
# a step cut at its limit keeps what it printed (Python buffers output to a file)
export PYTHONUNBUFFERED=1
MPIRUN="mpirun -np 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
summary=()
# the whole run's budget in seconds (the device tool stops a command at 600 s, and only
# what the run packed at its end comes back whole): each step's limit is cut to what is
# left, a step with under 20 s left is skipped, so the packing always happens
BUDGET=${GPU_RUN_BUDGET:-570}
step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  local start=$SECONDS left=$((BUDGET - 15 - SECONDS))
  if [ "$left" -lt 20 ]; then
    summary+=("$(printf '%-14s skipped: %ss of the %ss budget left' "$name" "$((BUDGET - SECONDS))" "$BUDGET")")
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-14s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$OUT/$name.log")")")
}
export MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29517}  # torch's rendezvous
TRUN="$MPIRUN -x MASTER_ADDR -x MASTER_PORT"
gpu_tier() {  # gpu_tier PER_TEST_TIMEOUT "FAILURE SCENARIOS" [pytest args]
  local per_test=$1 scenarios=$2; shift 2
  step gpu-local 200 python3 -m pytest -q -x -p no:cacheprovider --timeout="$per_test" tests/gpu "$@"
  step gpu-mpirun 90 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step plant-fault 90 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --plant-fault flip --counts 17
  step hostile-mpirun 120 $MPIRUN python3 tests/mpi/run_hostile.py --backend cuda
  for scenario in $scenarios; do
    step "fail-$scenario" 60 $MPIRUN --mca orte_abort_on_non_zero_status 0 \
      python3 tests/mpi/run_failures.py $scenario --backend cuda
  done
}
train_shapes() {  # train_shapes SHAPE...: one mpirun per shape (a peer's freed buffers stay
  # mapped by hoccl's IPC cache for the life of the process: shapes run back to back in
  # one process run out of memory)
  for shape in "$@"; do
    step "train-$shape" 200 $TRUN python3 -m hoccl.bench.train --shapes $shape \
      ${TRAIN_LIBRARIES:+--libraries $TRAIN_LIBRARIES} --out "$OUT/train-$shape"
  done
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$OUT/gpus.txt" 2>&1
if [ "$what" = tests ] || [ "$what" = all ]; then
  gpu_tier 90 "mismatch dead absent killed early abort" "$@"
fi
if [ "$what" = profile ] || [ "$what" = tests ] || [ "$what" = all ]; then
  step profile 60 $MPIRUN python3 tools/profile_call.py --size 1M
  step profile-local 60 python3 tools/profile_call.py --size 1M --local
  step smoke 60 python3 tests/gpu/cuda_device_smoke.py
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  step bench 330 $MPIRUN python3 -m hoccl.bench --sizes ${BENCH_SIZES:-64K,1M,16M,256M,1G} --out "$OUT/bench"
fi
if [ "$what" = torch ]; then
  step torch-backend 150 $TRUN python3 tests/torch_programs/run_backend.py --device cuda
  step torch-training 150 $TRUN python3 tests/torch_programs/run_training.py --device cuda
  # NCCL the default process group, hoccl groups (and HSDP's shard dimension) beside it
  step torch-training-nccl-default 150 $TRUN python3 tests/torch_programs/run_training.py \
    --device cuda --default-backend reference
  for backend in nccl hoccl; do
    step "fsdp2-$backend" 120 $TRUN python3 examples/train_fsdp2.py --backend $backend --steps 50
  done
  train_shapes ${TRAIN_SHAPES:-compute comm large}
fi
if [ "$what" = fsdp ]; then
  # FSDP2 with hoccl's hooks on a small model first (a stuck run prints every thread's
  # stack), then the example on NCCL and on hoccl, then the training benchmark.
  step fsdp2-hooks-small 150 $TRUN python3 examples/train_fsdp2.py --backend nccl --hooks \
    --layers 2 --steps 5 --dump-stacks-after 100
  if ! grep -q "^step 4 " "$OUT/fsdp2-hooks-small.log"; then
    step fsdp2-hooks-eager 150 $TRUN -x CUDA_MODULE_LOADING=EAGER python3 examples/train_fsdp2.py \
      --backend nccl --hooks --layers 2 --steps 5 --dump-stacks-after 100
  fi
  for backend in nccl hoccl; do
    step "fsdp2-$backend" 150 $TRUN python3 examples/train_fsdp2.py --backend $backend --steps 50 \
      --dump-stacks-after 130
  done
  if grep -q "^step 49 " "$OUT/fsdp2-hoccl.log"; then
    train_shapes ${TRAIN_SHAPES:-compute comm large}
  fi
fi
if [ "$what" = final ]; then
  # one short session over what changed last: the GPU tier, the MPI checks (scaled sums),
  # split children, abort and dead peers, the hierarchy (averages by hoccl's kernel),
  # torch training against NCCL, the FSDP2 example and the comm-heavy training shape
  gpu_tier 120 "dead abort" "$@"
  step split-mpirun 90 $MPIRUN python3 tests/mpi/run_split.py --backend cuda
  step smoke 60 python3 tests/gpu/cuda_device_smoke.py
  step torch-training 150 $TRUN python3 tests/torch_programs/run_training.py --device cuda
  step fsdp2-hoccl 150 $TRUN python3 examples/train_fsdp2.py --backend hoccl --steps 50 \
    --dump-stacks-after 130
  train_shapes comm
fi
if [ "$what" = onegpu ] || [ "$what" = registered ]; then
  # calls captured into CUDA graphs: 1000 replays checked, eager calls between; a capture
  # on one rank only must raise everywhere
  step capture 240 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays ${REPLAYS:-1000}
fi
if [ "$what" = figures-a ]; then
  # 2 x H200, first of two device calls (each under 10 minutes) for the open issues'
  # figures: correctness of what one H200 checked (registered buffers, graphs, split),
  # then small messages eager and in graphs beside NCCL, and 1 GiB in place
  step registered-checks 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --registered \
    --counts 0,17,100003
  step capture 120 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays 300
  step split-mpirun 60 $MPIRUN python3 tests/mpi/run_split.py --backend cuda
  # issue 14's sizes, eager and in graphs, beside every NCCL mode: the in-place forms of
  # all_gather, reduce_scatter, all_reduce and broadcast, then all_to_all (out of place)
  step bench-1g 100 $MPIRUN python3 -m hoccl.bench --sizes 1G --collectives all_gather \
    --forms in --libraries hoccl,hoccl-reg,nccl4py,nccl-zero --out "$OUT/bench-1g"
  step bench-small 330 $MPIRUN python3 -m hoccl.bench --sizes 8K,64K,256K,1M,4M,16M \
    --forms in --collectives all_gather,all_reduce,reduce_scatter,broadcast \
    --libraries hoccl,hoccl-reg,hoccl-reg+one_shot_bytes=4M,hoccl-reg+pull_bytes=16M,nccl,nccl4py,nccl-zero \
    --graph --out "$OUT/bench-small"
  step bench-small-a2a 120 $MPIRUN python3 -m hoccl.bench --sizes 8K,64K,256K,1M,4M,16M \
    --forms out --collectives all_to_all --libraries hoccl,hoccl-reg,nccl,nccl4py,nccl-zero \
    --graph --out "$OUT/bench-small-a2a"
fi
if [ "$what" = figures-b ]; then
  # the second: reductions beside a GEMM, the tensor-parallel layer, torch training checks
  step overlap 240 $MPIRUN python3 -m hoccl.bench.overlap --cases reduce_scatter:out,all_reduce:in \
    --libraries hoccl,hoccl+fuse_sums=0,hoccl+max_sms=16,hoccl+chunk_bytes=128M,hoccl+max_sms=32+chunk_bytes=128M,hoccl+max_sms=32+chunk_bytes=256M,hoccl+max_sms=64+chunk_bytes=512M,hoccl+pull_bytes=2G+max_sms=32,hoccl+pull_bytes=2G+max_sms=16+chunk_bytes=1G,hoccl+pull_bytes=2G+max_sms=64+chunk_bytes=1G,nccl \
    --out "$OUT/overlap"
  # reductions alone at 1 GiB, every result checked: the SM caps up to 16 beside NCCL
  step bench-reduce-1g 120 $MPIRUN python3 -m hoccl.bench --sizes 1G \
    --collectives reduce_scatter,all_reduce --forms in \
    --libraries hoccl,hoccl+fuse_sums=0,hoccl+max_sms=16,hoccl+pull_bytes=2G+max_sms=16+chunk_bytes=1G,nccl,nccl4py \
    --out "$OUT/bench-reduce-1g"
  step tp 150 $TRUN python3 -m hoccl.bench.tp --out "$OUT/tp"
  step torch-training 120 $TRUN python3 tests/torch_programs/run_training.py --device cuda
fi
if [ "$what" = figures-c ]; then
  # the third: training beside NCCL on the most exposed shape, the hooks with registered
  # all-gather memory and without; then the reduce-scatter settings the one-GPU lever
  # study points to and pulled reduce-scatters on registered inputs (a run of its own: a
  # library is a whole sharded model with its optimizer, ~28 GB per GPU at this shape);
  # HSDP with NCCL as the default group (its replicate dimension)
  TRAIN_LIBRARIES=${TRAIN_LIBRARIES:-nccl,hoccl,hoccl-hooks,hoccl-hooks-plain} \
    train_shapes ${TRAIN_SHAPES:-comm}
  step train-comm-settings 200 $TRUN python3 -m hoccl.bench.train --shapes comm --libraries \
    nccl,hoccl-hooks+max_sms=32+chunk_bytes=128M,hoccl-hooks+pull_bytes=2G+max_sms=32,hoccl-hooks+pull_bytes=2G+max_sms=64+chunk_bytes=1G \
    --out "$OUT/train-comm-settings"
  step torch-training-nccl-default 150 $TRUN python3 tests/torch_programs/run_training.py \
    --device cuda --default-backend reference
fi
if [ "$what" = figures-mix ]; then
  # one call for what is left when the budget allows one: the reductions beside a GEMM
  # (the most promising variants), the comm-heavy training shape, the tensor-parallel layer
  step overlap 170 $MPIRUN python3 -m hoccl.bench.overlap --cases reduce_scatter:out,all_reduce:in \
    --libraries hoccl,hoccl+fuse_sums=0,hoccl+max_sms=32+chunk_bytes=256M,hoccl+pull_bytes=2G+max_sms=16+chunk_bytes=1G,hoccl+pull_bytes=2G+max_sms=64+chunk_bytes=1G,nccl \
    --out "$OUT/overlap"
  step train-comm 200 $TRUN python3 -m hoccl.bench.train --shapes comm --libraries \
    nccl,hoccl-hooks,hoccl-hooks+max_sms=32+chunk_bytes=128M,hoccl-hooks+pull_bytes=2G+max_sms=64+chunk_bytes=1G \
    --out "$OUT/train-comm"
  step tp 150 $TRUN python3 -m hoccl.bench.tp --out "$OUT/tp"
fi
if [ "$what" = figures-d ]; then
  # the fourth: the rest of the training sweep (compute-bound, and a larger model)
  TRAIN_LIBRARIES=${TRAIN_LIBRARIES:-nccl,hoccl,hoccl-hooks,hoccl-hooks+max_sms=32+chunk_bytes=128M} \
    train_shapes ${TRAIN_SHAPES:-compute large}
fi
if [ "$what" = dryrun ]; then
  # one GPU, two ranks: the hoccl parts of figures-b and figures-c (no NCCL, which refuses
  # two ranks on one GPU), each with its own correctness checks, so that the 2 x H200 runs
  # meet no broken script; the times say nothing here
  if [ -z "${DRY_TRAIN_ONLY:-}" ]; then
  step torch-training-pool 240 $TRUN python3 tests/torch_programs/run_training.py \
    --device cuda --reference hoccl
  step overlap 150 $MPIRUN python3 -m hoccl.bench.overlap --bytes 64M --gemm 4096 --gemms 10 \
    --cases reduce_scatter:out,all_reduce:in \
    --libraries hoccl,hoccl+max_sms=32+chunk_bytes=128M,hoccl+pull_bytes=2G+max_sms=32,hoccl+pull_bytes=2G+max_sms=64+chunk_bytes=1G \
    --out "$OUT/overlap"
  step tp 200 $TRUN python3 -m hoccl.bench.tp --quick --libraries hoccl,hoccl+max_sms=4 \
    --out "$OUT/tp"
  step bench-reduce-1g 150 $MPIRUN python3 -m hoccl.bench --sizes 1G \
    --collectives reduce_scatter,all_reduce --forms in \
    --libraries hoccl+max_sms=16,hoccl+pull_bytes=2G+max_sms=16+chunk_bytes=1G,hoccl+pull_bytes=2G+max_sms=64+chunk_bytes=1G \
    --out "$OUT/bench-reduce-1g"
  step tp-plant-fault 150 $TRUN python3 -m hoccl.bench.tp --quick --plant-fault --libraries hoccl \
    --out "$OUT/tp-plant-fault"
  fi
  if [ -n "${DRY_MORE:-}" ]; then
    # the hoccl parts of figures-direct and figures-wide: direct kernels eager and in
    # graphs (the bench checks every result), the wide training shape on the hooks with
    # the settings figures-wide compares (gloo the baseline: this checks that it runs and
    # fits, two sharded copies of the model on one GPU), the 7B tensor-parallel layer
    step direct-bench 150 $MPIRUN python3 -m hoccl.bench --sizes 64K,1M --forms in \
      --collectives all_gather,all_reduce,reduce_scatter,broadcast \
      --libraries hoccl-reg,hoccl-reg+kernel_bytes=16M,hoccl-reg+kernel_bytes=16M+kernel_sms=32 \
      --graph --out "$OUT/direct-bench"
    step train-wide 240 $TRUN python3 -m hoccl.bench.train --baseline gloo --shapes wide \
      --libraries hoccl-hooks+max_sms=32+chunk_bytes=128M,hoccl-hooks+pull_bytes=2G+max_sms=16+chunk_bytes=1G \
      --steps 2 --trials 1 --warmup 1 --profile-steps 1 --out "$OUT/train-wide"
    step tp-7b 150 $TRUN python3 -m hoccl.bench.tp --quick --hidden 4096 --ffn 11008 \
      --libraries hoccl,hoccl+max_sms=4 --out "$OUT/tp-7b"
  fi
  # the host's time per call (no NCCL to compare with here; the parts are driver calls)
  step profile-reg 60 $MPIRUN python3 tools/profile_call.py --size 1M --registered --iters 300
  step profile 60 $MPIRUN python3 tools/profile_call.py --size 1M --iters 300
  step train 200 $TRUN python3 -m hoccl.bench.train --baseline gloo --shapes ${DRY_SHAPE:-1024:2:8:256:1} \
    --libraries ${DRY_LIBRARIES:-hoccl,hoccl-hooks,hoccl-hooks-plain,hoccl-hooks+pull_bytes=2G+max_sms=32} \
    --steps 2 --trials 2 --warmup 1 --profile-steps 1 --host-profile ${HOST_PROFILE:-2} --out "$OUT/train"
fi
if [ "$what" = quickreg ]; then
  # the shortest comparison that says something: registered and unregistered hoccl, eager
  # and in a CUDA graph, beside NCCL, at 64 KiB and 1 MiB
  step bench-quick 200 $MPIRUN python3 -m hoccl.bench --sizes 64K,1M \
    --collectives all_gather,all_reduce,reduce_scatter --forms in \
    --libraries hoccl,hoccl-reg,nccl,nccl-zero --graph --out "$OUT/bench-quick"
fi
MPIRUN3="mpirun -np 3 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x TORCH_SYMM_MEM_DISABLE_MULTICAST -x NVSHMEM_DISABLE_NVLS"
if [ "$what" = groups ]; then
  for mix in random broadcast scatter sums; do
    step "groups-$mix" 120 $MPIRUN3 python3 tests/mpi/run_groups.py --backend cuda --mix $mix \
      --groups "${GROUPS_COUNT:-40}" --timeout 60
  done
  step fuzz-cuda-3 200 $MPIRUN3 python3 -m hoccl.testing.fuzz --backend cuda \
    --calls "${FUZZ_CALLS:-600}" --seed "${FUZZ_SEED:-11}" --timeout 60
fi
if [ "$what" = verify ]; then
  step host-cost-1 100 python3 -m hoccl.bench.host_cost --bursts 10 --out "$OUT/host_cost"
  for mix in random broadcast scatter; do
    step "groups-$mix" 60 $MPIRUN3 python3 tests/mpi/run_groups.py --backend cuda --mix $mix \
      --groups 24 --timeout 40
  done
  step fuzz-cuda-3 90 $MPIRUN3 python3 -m hoccl.testing.fuzz --backend cuda \
    --calls "${FUZZ_CALLS:-300}" --seed "${FUZZ_SEED:-11}" --timeout 40
  step gpu-mpirun 70 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step gpu-mpirun-3 70 $MPIRUN3 python3 tests/mpi/run_checks.py --backend cuda --counts 0,17,100003
  step mixed-job 70 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE python3 tests/mpi/run_mixed_job.py
  step gpu-local 150 python3 -m pytest -q -x -p no:cacheprovider --timeout=90 tests/gpu "$@"
fi
host_cost_steps() {  # host_cost_steps LIMIT [world1]: python -m hoccl.bench.host_cost, world 1
  # beside NCCL, then 2 ranks (not with world1); first BASELINE's hoccl variants (a
  # checkout of an earlier commit, e.g. `bash tools/device_carry.sh --baseline COMMIT`), in
  # the same run
  local limit=$1 variants=hoccl-registered,hoccl-plain,hoccl-direct
  local base=${BASELINE:-.baseline}
  if [ -d "$base/hoccl" ]; then  # run in it: python -m puts the working directory first
    base=$(cd "$base" && pwd)
    step host-cost-before "$limit" env -C "$base" PYTHONPATH="$base:$DEPS" \
      python3 -m hoccl.bench.host_cost --variants $variants --out "$OUT/host_cost_before"
  fi
  step host-cost-1 "$limit" python3 -m hoccl.bench.host_cost --out "$OUT/host_cost"
  # every memop list of two or more as one batch of kept parameters (HOCCL_SINGLE_MEMOPS=1;
  # default: up to eight as single calls), in the same run (HOST_COST_BATCHED=0 skips it)
  [ "${HOST_COST_BATCHED:-1}" = 1 ] && step host-cost-batched "$limit" \
    env HOCCL_SINGLE_MEMOPS=1 python3 -m hoccl.bench.host_cost --variants $variants \
    --out "$OUT/host_cost_batched"
  [ "${2:-}" = world1 ] && return
  step host-cost-2 "$limit" $MPIRUN python3 -m hoccl.bench.host_cost --variants $variants \
    --out "$OUT/host_cost_2"
}
if [ "$what" = replay ]; then
  # the replayed repeats on one GPU, in one call: the host cost before (BASELINE) and
  # after beside NCCL, then the cuda paths they touch checked against numpy (1, 2 and 3
  # ranks), captured graphs, and the GPU tier (REPLAY_HOST_COST=0: the checks only)
  [ "${REPLAY_HOST_COST:-1}" = 1 ] && host_cost_steps 100
  step replay-1 40 python3 tests/mpi/run_replay.py --backend cuda
  step replay-2 60 $MPIRUN python3 tests/mpi/run_replay.py --backend cuda
  [ "${REPLAY_QUICK:-0}" = 1 ] && BUDGET=$SECONDS  # the host cost and the replays only
  step replay-3 60 $MPIRUN3 python3 tests/mpi/run_replay.py --backend cuda
  step repeats-cuda 50 $MPIRUN python3 tests/mpi/run_repeats.py --backend cuda
  step capture 60 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays 200
  step gpu-mpirun 70 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step gpu-mpirun-3 70 $MPIRUN3 python3 tests/mpi/run_checks.py --backend cuda --counts 0,17,100003
  step gpu-local 150 python3 -m pytest -q -x -p no:cacheprovider --timeout=90 tests/gpu "$@"
  step profile-1 40 python3 tools/profile_call.py --registered --burst 50 --iters 1000 \
    --collective all_reduce
fi
if [ "$what" = hostcost ]; then
  host_cost_steps 150
  # the replayed repeats stay exact (registered, one-lane and lanes, direct) and their
  # mismatches still raise on every rank
  step repeats-cuda 90 $MPIRUN python3 tests/mpi/run_repeats.py --backend cuda
  step profile-1 90 python3 tools/profile_call.py --registered --burst 50 --iters 1000 \
    --collective all_reduce
fi
if [ "$what" = world1 ]; then
  # a world of one as one direct kernel: the host cost (BASELINE's, this tree's beside NCCL,
  # 2 ranks), the cuda checks of the paths it changes (every collective at world 1 against
  # numpy, replays, graphs, 2 and 3 ranks, the GPU tier), then where a call's time goes
  HOST_COST_BATCHED=0 host_cost_steps 60
  step checks-1 60 python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step replay-1 40 python3 tests/mpi/run_replay.py --backend cuda
  step capture-1 40 python3 tests/mpi/run_capture.py --backend cuda --replays 50
  step gpu-mpirun 60 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step gpu-mpirun-3 60 $MPIRUN3 python3 tests/mpi/run_checks.py --backend cuda --counts 0,17,100003
  # each test named as it ends, so a test cut at its limit is known (its stack is printed)
  step gpu-local 200 python3 -m pytest -v -x -p no:cacheprovider --timeout=90 --durations=10 \
    tests/gpu "$@"
  step profile-ag 40 python3 tools/profile_call.py --registered --burst 50 --iters 1000 \
    --collective all_gather
fi
if [ "$what" = profile1 ]; then
  # where one rank's repeated small call spends the host's time (world 1): the pieces of a
  # call and a cProfile (reduce_scatter: out of place, one copy), then the host-cost bench
  # (BASELINE's first where there is one, memops batched last), in one run
  step profile-rs 60 python3 tools/profile_call.py --registered --burst 50 --iters 1000 \
    --collective reduce_scatter
  host_cost_steps 70 world1
fi
if [ "$what" = mini ]; then
  # core's checks and this tree's host cost in about 200 s: graphs under init_local, the
  # replayed repeats (1 and 2 ranks), the host-cost bench (world 1, beside NCCL), graphs
  step local-capture 60 python3 -m pytest -q -p no:cacheprovider --timeout=50 \
    tests/gpu/test_gpu_local_capture.py
  step replay-1 30 python3 tests/mpi/run_replay.py --backend cuda
  step replay-2 40 $MPIRUN python3 tests/mpi/run_replay.py --backend cuda
  step host-cost-1 60 python3 -m hoccl.bench.host_cost --out "$OUT/host_cost"
  step capture 40 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays 30
fi
if [ "$what" = core ]; then
  # the least device time that checks this tree's cuda paths and times its host cost:
  # graphs captured under init_local, the host-cost bench (world 1: BASELINE's, this
  # tree's, memops batched), the replayed repeats (1 and 2 ranks), captured graphs (with a
  # grouped send/recv ring) and run_checks with 2 ranks
  step local-capture 90 python3 -m pytest -q -p no:cacheprovider --timeout=80 \
    tests/gpu/test_gpu_local_capture.py
  host_cost_steps 45 world1
  step replay-1 30 python3 tests/mpi/run_replay.py --backend cuda
  step replay-2 45 $MPIRUN python3 tests/mpi/run_replay.py --backend cuda
  step capture 45 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays 50
  step gpu-mpirun 60 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
fi
if [ "$what" = hostucx ]; then
  # one call for both: the host cost (profile1's steps), the cuda paths it touches checked
  # (1 and 2 ranks, captured graphs), then ucxtorch's probes and torch programs (as far as
  # the budget goes)
  step profile-rs 40 python3 tools/profile_call.py --registered --burst 50 --iters 1000 \
    --collective reduce_scatter
  host_cost_steps 50 world1
  step replay-1 30 python3 tests/mpi/run_replay.py --backend cuda
  step replay-2 45 $MPIRUN python3 tests/mpi/run_replay.py --backend cuda
  step gpu-mpirun 60 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step capture 40 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays 100
  what=ucxtorch
fi
if [ "$what" = shrink ]; then
  # dist.shrink_group on the cuda backend: three workers of a store launch (torchrun's
  # agent store) sharing the GPU, the victim last, first, killed mid-call, and twice over;
  # survivors check 20 all_reduces, DDP and FSDP2 on the shrunk group (SHRINK_RUNS each)
  step shrink-cuda 300 python3 tools/shrink_times.py --device cuda --runs ${SHRINK_RUNS:-2} \
    --json "$OUT/shrink_cuda.json"
fi
if [ "$what" = ucx ]; then
  # between simulated hosts over UCX (.wheels: ucxx-cu13 and its libraries), in parts
  # (UCX_PART, a comma list; default all of them):
  # bench: the mixed bench (two GPU ranks and two CPU ranks as two hosts) with the staged
  # engine over MPI beside UCX and gloo
  part() { case ",${UCX_PART:-bench,gpu-hosts,job,torch}," in *",$1,"*) return 0;; esac; return 1; }
  if part bench; then
    step mixed-bench-ucx 240 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 \
      python3 -m hoccl.bench.mixed --devices cuda,cuda,cpu,cpu --local-size 2 \
      --inter-host mpi,ucx --sizes ${UCX_SIZES:-1M,16M,64M,256M,1G} --phase-bytes 64M --iters 3 \
      --out "$OUT/mixed_ucx"
  fi
  if part gpu-hosts; then
    # two GPU ranks as two hosts: UCX between them beside a copy of the same bytes on the
    # device, the device memory handed to UCX (cuda_ipc), then staged through host memory
    step gpu-hosts-ucx 150 mpirun -np 2 -x PYTHONPATH -x NCCL_NVLS_ENABLE \
      -x HOCCL_UCX_DEVICE_MEMORY=1 python3 -m hoccl.bench.mixed --devices cuda --local-size 1 \
      --inter-host ucx --libraries hoccl,copy --sizes ${UCX_SIZES:-1M,16M,64M,256M,1G} \
      --phase-bytes 64M --iters 3 --out "$OUT/gpu_hosts_ucx"
    [ -n "${UCX_STAGED-1}" ] && step gpu-hosts-staged 150 mpirun -np 2 -x PYTHONPATH \
      -x NCCL_NVLS_ENABLE python3 -m hoccl.bench.mixed --devices cuda --local-size 1 \
      --inter-host ucx --libraries hoccl --sizes ${UCX_SIZES:-1M,16M,64M,256M,1G} \
      --phase-bytes 64M --iters 3 --out "$OUT/gpu_hosts_staged"
  fi
  # job: the same mixed job checked: every collective, point to point and the pipelines
  # (run_mixed_job); torch: torch's collectives (run_backend) and DDP/FSDP2 against gloo
  # on the CPU (run_training)
  if part job; then
    step mixed-ucx 200 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 \
      python3 tests/mpi/run_mixed_job.py --inter-host ucx --json "$OUT/mixed_ucx.json"
  fi
  if part torch; then
    step torch-backend-ucx 150 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x MASTER_ADDR \
      -x MASTER_PORT python3 tests/torch_programs/run_backend.py --devices cuda,cuda,cpu,cpu \
      --local-size 2 --inter-host ucx
    step torch-training-ucx 200 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x MASTER_ADDR \
      -x MASTER_PORT python3 tests/torch_programs/run_training.py --devices cuda,cuda,cpu,cpu \
      --local-size 2 --inter-host ucx
  fi
fi
if [ "$what" = ucxphases ]; then
  # the mixed job (two GPU ranks, two CPU ranks as two hosts) over UCX: torch's DDP and
  # FSDP2 against gloo, then the bench with UCX's phases studied, in each of
  # PHASE_VARIANTS: NAME:CHUNK:STAGE:DEVICE_MEMORY:PROGRESS:ENGINES:LIBRARIES (the chunk
  # of pipelined phases, the staged engine's chunk, UCX handed GPU memory (1), who
  # progresses UCX, the engines between hosts (the first studied), the libraries)
  [ -n "${PHASE_TRAINING-1}" ] && step torch-training-ucx 200 mpirun -np 4 -x PYTHONPATH \
    -x NCCL_NVLS_ENABLE -x MASTER_ADDR -x MASTER_PORT python3 tests/torch_programs/run_training.py \
    --devices cuda,cuda,cpu,cpu --local-size 2 --inter-host ucx
  for variant in ${PHASE_VARIANTS:-caller64:64M:16M:0:caller:ucx,mpi:hoccl,gloo thread64:64M:16M:0:thread:ucx:hoccl thread16:16M:16M:0:thread:ucx:hoccl polling16:16M:16M:0:polling:ucx:hoccl}; do
    IFS=: read -r name chunk stage memory progress engines libraries <<< "$variant"
    step "mixed-$name" 150 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 \
      -x HOCCL_UCX_DEVICE_MEMORY=$memory -x HOCCL_STAGE_BYTES=$stage -x HOCCL_UCX_PROGRESS=$progress \
      python3 -m hoccl.bench.mixed --devices cuda,cuda,cpu,cpu --local-size 2 \
      --inter-host "$engines" --libraries "$libraries" --sizes ${UCX_SIZES:-64M,256M} \
      --phase-bytes 64M --phase-chunk "$chunk" --iters 3 --out "$OUT/mixed_$name"
  done
fi
if [ "$what" = ucxfix ]; then
  # UCX between a GPU rank and a CPU rank of this machine: which transports move bytes
  # (tools/ucx_probe.py, endpoints without UCX's failure mode, rank 0 with a CUDA context
  # and pinned memory as a staged GPU member has), then the mixed bench and the mixed
  # job with the first set that works (HOCCL_UCX_TLS; none: HOCCL_UCX_PEER_FAILURE=all)
  export HOCCL_UCX_TLS= HOCCL_UCX_PEER_FAILURE=
  chosen=none
  for tls in '^cma' '^cma,cuda_ipc' '^cma,cuda_ipc,cuda_copy' 'posix,sysv,self,tcp'; do
    name=probe-$(printf '%s' "$tls" | tr -c 'a-z_' '-')
    step "$name" 25 mpirun -np 2 -x PYTHONPATH python3 tools/ucx_probe.py --error-handling 0 \
      --pinned 0 --cuda 0 --tls "$tls"
    if grep -q "67108864: ok.*67108864: ok" "$OUT/$name.log"; then chosen=$tls; break; fi
  done
  [ "$chosen" = none ] && step probe-plain 25 mpirun -np 2 -x PYTHONPATH python3 \
    tools/ucx_probe.py --error-handling 0
  case $chosen in
    none) export HOCCL_UCX_PEER_FAILURE=all ;;
    '^cma') ;;
    *) export HOCCL_UCX_TLS="^${chosen#^cma,}" ;;
  esac
  echo "chosen: $chosen HOCCL_UCX_TLS=$HOCCL_UCX_TLS HOCCL_UCX_PEER_FAILURE=$HOCCL_UCX_PEER_FAILURE" \
    > "$OUT/chosen.txt"
  [ "$chosen" = 'posix,sysv,self,tcp' ] && export HOCCL_UCX_TLS=$chosen
  UCXENV="-x HOCCL_UCX_TLS -x HOCCL_UCX_PEER_FAILURE"
  step mixed-ucx 200 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 $UCXENV \
    python3 tests/mpi/run_mixed_job.py --inter-host ucx --json "$OUT/mixed_ucx.json"
  step mixed-bench-ucx 240 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x OMP_NUM_THREADS=4 \
    $UCXENV python3 -m hoccl.bench.mixed --devices cuda,cuda,cpu,cpu --local-size 2 \
    --inter-host mpi,ucx --sizes ${UCX_SIZES:-1M,16M,64M,256M,1G} --phase-bytes 64M --iters 3 \
    --out "$OUT/mixed_ucx"
fi
if [ "$what" = ucxtorch ]; then
  # torch's collectives and DDP/FSDP2 on the mixed job over UCX (two GPU ranks, two CPU
  # ranks as two hosts), after two probes of shared memory between a GPU rank and a CPU
  # rank (tools/ucx_probe.py): with cuda_ipc out where only that one moves the bytes
  # (HOCCL_UCX_TLS=^cuda_ipc, peers watched), else hoccl's default
  export HOCCL_UCX_TLS=
  for tls in '^cma' '^cma,cuda_ipc'; do
    name=probe-$(printf '%s' "$tls" | tr -c 'a-z_' '-')
    step "$name" 25 mpirun -np 2 -x PYTHONPATH python3 tools/ucx_probe.py --error-handling 0 \
      --pinned 0 --cuda 0 --tls "$tls"
  done
  if ! grep -q "67108864: ok.*67108864: ok" "$OUT/probe--cma.log" \
      && grep -q "67108864: ok.*67108864: ok" "$OUT/probe--cma-cuda_ipc.log"; then
    export HOCCL_UCX_TLS=^cuda_ipc
  fi
  echo "HOCCL_UCX_TLS=$HOCCL_UCX_TLS" > "$OUT/chosen.txt"
  for program in run_backend run_training; do
    step "torch-$program-ucx" 150 mpirun -np 4 -x PYTHONPATH -x NCCL_NVLS_ENABLE -x MASTER_ADDR \
      -x MASTER_PORT -x HOCCL_UCX_TLS python3 tests/torch_programs/$program.py \
      --devices cuda,cuda,cpu,cpu --local-size 2 --inter-host ucx
  done
fi
if [ "$what" = onegpu ]; then
  # one GPU: two ranks under mpirun share it (IPC within one device), which runs every
  # protocol path of the cuda backend (exports, imports, memops, kernels) but no NVLink;
  # no NCCL (it refuses two ranks on one GPU), so no figures
  step registered-checks 150 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --registered \
    --counts 0,1,17,100003
  step registered-mpirun 120 $MPIRUN python3 tests/mpi/run_registered.py --backend cuda
  step gpu-mpirun 150 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step split-mpirun 120 $MPIRUN python3 tests/mpi/run_split.py --backend cuda
  step hostile-mpirun 120 $MPIRUN python3 tests/mpi/run_hostile.py --backend cuda
  if [ "${ONEGPU_LOCAL:-1}" = 1 ]; then
    step gpu-local-1 200 python3 -m pytest -q -p no:cacheprovider --timeout=90 tests/gpu "$@"
  fi
fi
if [ "$what" = validate ]; then
  # one GPU, two ranks (no NCCL, no figures): the cuda paths of registered buffers, graphs,
  # split, hostile inputs and the torch backend, each checked against numpy
  step capture 150 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays ${REPLAYS:-300}
  step registered-checks 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --registered \
    --counts 0,17,100003
  step gpu-mpirun 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,17,100003
  step registered-mpirun 90 $MPIRUN python3 tests/mpi/run_registered.py --backend cuda
  step split-mpirun 90 $MPIRUN python3 tests/mpi/run_split.py --backend cuda
  step hostile-mpirun 90 $MPIRUN python3 tests/mpi/run_hostile.py --backend cuda
  step example-graphs 90 $MPIRUN python3 examples/registered_and_graphs.py
  step torch-registered 120 $TRUN python3 tests/torch_programs/run_registered.py --device cuda
  # reductions that read the peers' inputs where they lie (Options.pull_bytes), plain and
  # on registered buffers, and captured into graphs
  step pull-checks 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --pull-bytes 1048576 \
    --counts 0,17,100003
  step pull-registered 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --registered \
    --pull-bytes 1048576 --counts 0,17,100003
  step pull-capture 150 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays 100 \
    --pull-bytes 1048576
  # the bench's pulled variant, eager and in a graph (on one GPU its times say nothing)
  step bench-pull 150 $MPIRUN python3 -m hoccl.bench --sizes 64K,1M --forms in \
    --collectives all_reduce,reduce_scatter --libraries hoccl,hoccl-reg+pull_bytes=16M --graph \
    --out "$OUT/bench-pull"
  step bench-broadcast 120 $MPIRUN python3 -m hoccl.bench --sizes 64K,1M --forms in,out \
    --collectives broadcast,all_to_all --libraries hoccl,hoccl-reg --graph --out "$OUT/bench-broadcast"
  # DDP, FSDP2 (hooks all-gathering into registered memory: every call counted) and HSDP
  # against a second hoccl group without registered memory or hooks (NCCL refuses two
  # ranks on one GPU)
  step torch-training-pool 200 $TRUN python3 tests/torch_programs/run_training.py \
    --device cuda --reference hoccl
  # the FSDP2 example (Llama-style, bf16) on hoccl, without and with use_for_fsdp's hooks
  # (all-gathers into registered memory): the same losses within 1e-3 relative, step by
  # step (this model's GPU kernels are not deterministic: two runs of the same path
  # differ by about 1e-5 relative)
  step fsdp2-hoccl 150 $TRUN python3 examples/train_fsdp2.py --backend hoccl --steps 20
  step fsdp2-hoccl-hooks 150 $TRUN python3 examples/train_fsdp2.py --backend hoccl --hooks \
    --steps 20
  summary+=("fsdp2 losses   $(python3 - "$OUT/fsdp2-hoccl.log" "$OUT/fsdp2-hoccl-hooks.log" <<'PY'
import re, sys
runs = [[float(x) for x in re.findall(r"^step \d+ loss (\S+)", open(f).read(), re.M)]
        for f in sys.argv[1:]]
worst = max((abs(a - b) / abs(b) for a, b in zip(*runs)), default=float("inf"))
same = len(runs[0]) == len(runs[1]) == 20 and worst <= 1e-3
print(f"{'agree' if same else 'DIFFER'}: {len(runs[0])} and {len(runs[1])} steps, "
      f"largest relative difference {worst:.1e}")
PY
)")
fi
if [ "$what" = figures-wide ]; then
  # 2 x H200: the training step where the GPUs' communication, not the host, bounds it
  # (few wide layers), and a 7B model's tensor-parallel layer (hidden 4096, ffn 11008),
  # each beside NCCL (and torch's async-TP) in the same run
  # (three libraries: each holds a sharded copy of the model and its optimizer, ~36 GB a GPU)
  TRAIN_LIBRARIES=${TRAIN_LIBRARIES:-nccl,hoccl-hooks+max_sms=32+chunk_bytes=128M,hoccl-hooks+pull_bytes=2G+max_sms=16+chunk_bytes=1G}
  train_shapes wide
  step tp-7b 240 $TRUN python3 -m hoccl.bench.tp --hidden 4096 --ffn 11008 \
    --libraries hoccl,hoccl+max_sms=4,nccl,async-tp --out "$OUT/tp-7b"
fi
if [ "$what" = figures-direct ]; then
  # 2 x H200: the direct kernels checked (one process on both GPUs, then mpirun), then
  # issue 14's sizes eager and in CUDA graphs beside every NCCL mode, judged at the end
  what=direct
  DIRECT_LIBRARIES=${DIRECT_LIBRARIES:-hoccl-reg,hoccl-reg+kernel_bytes=16M,hoccl-reg+kernel_bytes=16M+kernel_sms=32,nccl,nccl4py,nccl-zero}
  BENCH_SIZES=${BENCH_SIZES:-64K,256K,1M,4M}
  REPLAYS=${REPLAYS:-300}
  judge=1
fi
if [ "$what" = direct ]; then
  # the direct kernels (Options.kernel_bytes): exact checks plain and on registered
  # buffers, 1000 graph replays with eager calls between, an abort releasing a kernel
  # that waits for its peer, then small messages with and without them (with two ranks
  # on one GPU the ranks' kernels take turns on it: the times say nothing there)
  if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    step direct-local 200 python3 -m pytest -q -x -p no:cacheprovider --timeout=150 \
      tests/gpu/test_gpu_collectives.py -k direct
  fi
  step direct-checks 150 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda \
    --kernel-bytes 1048576 --counts 0,1,17,100003
  step direct-registered 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda \
    --registered --kernel-bytes 1048576 --counts 0,17,100003
  step direct-capture 150 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda \
    --replays ${REPLAYS:-1000} --kernel-bytes 1048576
  for scenario in abort absent mismatch; do
    step "direct-$scenario" 60 $MPIRUN --mca orte_abort_on_non_zero_status 0 \
      python3 tests/mpi/run_failures.py $scenario --backend cuda --kernel-bytes 1048576
  done
  # direct calls without messages; ranks whose calls differ told by their kernels
  for scenario in silent count blocks collective repeat replay; do
    step "direct-diverge-$scenario" 60 $MPIRUN --mca orte_abort_on_non_zero_status 0 \
      python3 tests/mpi/run_direct_divergence.py $scenario --backend cuda
  done
  # diverging registered calls abort: the memory the peers may still write is kept
  step registered-mpirun 120 $MPIRUN python3 tests/mpi/run_registered.py --backend cuda
  # the host's cost per call, timed in bursts (with two ranks on one GPU the device
  # cannot keep up): a direct kernel on the caller's stream, then the copy engines
  for collective in all_gather all_reduce; do
    step "direct-profile-$collective" 60 $MPIRUN python3 tools/profile_call.py --size 1M \
      --registered --kernel-bytes 16M --iters 1000 --burst 50 --collective $collective
  done
  step direct-profile-ce 60 $MPIRUN python3 tools/profile_call.py --size 1M --registered \
    --iters 1000 --burst 50
  [ "${DIRECT_BENCH:-1}" = 0 ] && what=none
fi
if [ "$what" = direct ]; then
  step direct-bench 250 $MPIRUN python3 -m hoccl.bench --sizes ${BENCH_SIZES:-8K,64K,256K,1M} \
    --forms in --collectives all_gather,all_reduce,reduce_scatter,broadcast \
    --libraries ${DIRECT_LIBRARIES:-hoccl-reg,hoccl-reg+kernel_bytes=16M} --graph \
    --out "$OUT/direct-bench"
  step direct-bench-a2a 120 $MPIRUN python3 -m hoccl.bench --sizes ${BENCH_SIZES:-8K,64K,256K,1M} \
    --collectives all_to_all --libraries ${DIRECT_LIBRARIES:-hoccl-reg,hoccl-reg+kernel_bytes=16M} \
    --graph --out "$OUT/direct-bench-a2a"
  if [ -n "${judge:-}" ]; then  # and 1 GiB in place against NCCL's zero-SM mode
    step bench-1g 100 $MPIRUN python3 -m hoccl.bench --sizes 1G --collectives all_gather \
      --forms in --libraries hoccl,hoccl-reg,nccl4py,nccl-zero --out "$OUT/bench-1g"
  fi
fi
if [ "$what" = caller ]; then
  # repeats of every eager collective on registered buffers (Engine.repeat), the FSDP2
  # hooks' marks and shadows: the exact checks plain and registered, the repeats checked
  # round after round, the training checks (against a second hoccl group: NCCL refuses
  # two ranks on one GPU; with two GPUs, against NCCL), graph replays with eager calls
  # between, then the host's cost per call (in bursts) and per FSDP2 hook, with
  # BASELINE (a checkout of an earlier commit) the same from it in the same run
  reference=$([ "$(nvidia-smi -L | wc -l)" -ge 2 ] && echo nccl || echo hoccl)
  step ce-checks 150 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --counts 0,1,17,100003
  step ce-registered 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --registered \
    --counts 0,17,100003
  step ce-repeats 120 $MPIRUN python3 tests/mpi/run_repeats.py --backend cuda
  step torch-training 150 $TRUN python3 tests/torch_programs/run_training.py --device cuda \
    --reference $reference
  step ce-capture 150 $MPIRUN python3 tests/mpi/run_capture.py --backend cuda --replays ${REPLAYS:-300}
  if [ -n "${CALLER_MORE:-}" ]; then
    # the torch backend's ops with direct kernels; the hierarchy's steps over MPI (now
    # nonblocking, with a timeout) on the CUDA backend, two simulated hosts of one GPU
    step torch-backend-direct 150 $TRUN python3 tests/torch_programs/run_backend.py --device cuda \
      --kernel-bytes 1048576
    step hier-mpi 120 $MPIRUN python3 tests/mpi/run_hierarchical.py --backend cuda \
      --inter-host mpi --local-size 1 --counts 0,1,17,100003
  fi
  for tree in $PWD ${BASELINE:+$PWD/$BASELINE}; do
    tag=$([ "$tree" = "$PWD" ] && echo new || echo base)
    for collective in all_gather all_reduce; do
      step "profile-$collective-$tag" 60 env PYTHONPATH=$tree:$DEPS $MPIRUN python3 \
        $tree/tools/profile_call.py --size 1M --registered --iters 1000 --burst 50 \
        --collective $collective
    done
    # the reduce-scatter pushed (the default) and pulled (pull_bytes)
    for hook in all_gather reduce_scatter reduce_scatter:pull_bytes=64M; do
      collective=${hook%%:*}; settings=${hook#"$collective"}; settings=${settings#:}
      step "hook-$collective${settings:+-pull}-$tag" 60 env PYTHONPATH=$tree:$DEPS $TRUN \
        python3 tools/hook_cost.py --collective $collective --size ${HOOK_SIZE:-1M} --iters 300 \
        --burst 20 ${settings:+--settings $settings}
    done
    if [ -n "${CALLER_TRAIN:-}" ]; then
      # an FSDP2 step through the hooks, the host's time per step and per call (gloo the
      # default group: NCCL refuses two ranks on one GPU; the step times say nothing here)
      # (-P: without it `python -m` puts the working directory, this tree, ahead of
      # PYTHONPATH, and the baseline's step would run this tree's hoccl)
      step "train-$tag" 240 env PYTHONPATH=$tree:$DEPS $TRUN python3 -P -m hoccl.bench.train \
        --baseline gloo --shapes $CALLER_TRAIN \
        --libraries hoccl-hooks,hoccl-hooks+pull_bytes=2G+chunk_bytes=1G --steps 3 --trials 3 \
        --warmup 2 --profile-steps 1 --host-profile 2 --out "$OUT/train-$tag"
    fi
  done
fi
if [ "$what" = fused ]; then
  # a pushed reduction's chunk sums as one launch waiting on the device (fuse_sums): exact
  # checks with many chunks, fused and not, plain and registered; an abort ending a launch
  # that waits; reductions checked at large sizes fused and not; the host's cost of a
  # d4096 layer's gradient reduce-scatter through FSDP2's hook, fused and not
  # (fuse_sums=on: left unset it is off where two ranks share a GPU, as on one H200)
  step fused-checks 150 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda \
    --chunk-bytes 4096 --counts 0,17,100003 --fuse-sums on
  step fused-checks-auto 150 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda \
    --chunk-bytes 4096 --counts 0,17,100003
  step fused-registered 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda \
    --registered --chunk-bytes 4096 --counts 0,17,100003 --fuse-sums on
  step fused-abort 60 $MPIRUN --mca orte_abort_on_non_zero_status 0 \
    python3 tests/mpi/run_failures.py abort --backend cuda --chunk-bytes 4096
  step fused-bench 200 $MPIRUN python3 -m hoccl.bench --sizes 16M,256M,1G \
    --collectives reduce_scatter,all_reduce --forms in,out \
    --libraries hoccl+fuse_sums=1,hoccl+fuse_sums=0,hoccl+chunk_bytes=4M+fuse_sums=1,hoccl+chunk_bytes=4M+fuse_sums=0 \
    --out "$OUT/fused-bench"
  for fuse in 1 0; do
    step "fused-hook-872M-$fuse" 90 $TRUN python3 tools/hook_cost.py \
      --collective reduce_scatter --size 872M --iters 30 --burst 5 --settings fuse_sums=$fuse
  done
  step fused-train 200 $TRUN python3 -m hoccl.bench.train --baseline gloo \
    --shapes 1024:2:8:256:1 --libraries hoccl-hooks+chunk_bytes=4M+fuse_sums=1,hoccl-hooks+chunk_bytes=4M \
    --steps 2 --trials 2 --warmup 1 --profile-steps 1 --out "$OUT/fused-train"
fi
if [ "$what" = placement ]; then
  # where FSDP2's reduce-scatter hook calls go (the caller's stream or the lanes), pushed
  # and pulled, small and as large as a d4096 layer's gradients; then an FSDP2 step's
  # driver calls by function, pulled (two ranks on one GPU: the host's side only)
  for size in 1M 872M; do
    iters=$([ "$size" = 1M ] && echo 300 || echo 30); burst=$([ "$size" = 1M ] && echo 20 || echo 5)
    for settings in "" "pull_bytes=2G,chunk_bytes=1G"; do
      step "hook-rs-$size${settings:+-pull}" 90 $TRUN python3 tools/hook_cost.py \
        --collective reduce_scatter --size $size --iters $iters --burst $burst \
        ${settings:+--settings $settings}
    done
  done
  step train-driver 240 $TRUN python3 tools/driver_profile.py -m hoccl.bench.train \
    --baseline gloo --shapes ${CALLER_TRAIN:-4096:8:32:512:1} \
    --libraries hoccl-hooks,hoccl-hooks+pull_bytes=2G+chunk_bytes=1G --steps 3 --trials 2 \
    --warmup 2 --profile-steps 1 --out "$OUT/train-driver"
fi
if [ "$what" = registered ]; then
  # registered buffers: every collective on registered memory against numpy, the
  # divergence checks, the GPU tier for the changed call path, split on GPUs (the stale
  # IPC mapping fix), then small sizes and 1 GiB in place beside NCCL
  step registered-checks 120 $MPIRUN python3 tests/mpi/run_checks.py --backend cuda --registered \
    --counts 0,1,17,100003
  step registered-mpirun 120 $MPIRUN python3 tests/mpi/run_registered.py --backend cuda
  gpu_tier 120 "mismatch dead abort" "$@"
  step split-mpirun 90 $MPIRUN python3 tests/mpi/run_split.py --backend cuda
  step profile-reg 60 $MPIRUN python3 tools/profile_call.py --size 1M --registered
  step bench-small 400 $MPIRUN python3 -m hoccl.bench --sizes ${BENCH_SIZES:-8K,64K,256K,1M,4M,16M} \
    --libraries hoccl,hoccl-reg,hoccl-reg+one_shot_bytes=4M,nccl,nccl4py,nccl-zero --graph \
    --out "$OUT/bench-small"
  step bench-1g 200 $MPIRUN python3 -m hoccl.bench --sizes 1G --collectives all_gather \
    --libraries hoccl,hoccl-reg,nccl4py,nccl-zero --out "$OUT/bench-1g"
fi
if [ "$what" = hier ] || [ "$what" = tests ] || [ "$what" = fsdp ] || [ "$what" = final ]; then
  # 2 simulated hosts of 1 GPU, NCCL between them forced onto sockets; then one host of 2
  step hier-2x1-nccl 150 $MPIRUN -x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1 \
    python3 tests/mpi/run_hierarchical.py --backend cuda --inter-host nccl --local-size 1 \
    --counts 0,1,17,100003
  step hier-1x2 120 $MPIRUN python3 tests/mpi/run_hierarchical.py --backend cuda --local-size 2 \
    --counts 0,1,17,100003
fi
if [ "$what" = hierdiag ]; then
  # bfloat16 avg across simulated hosts: launches made blocking, and over MPI instead of NCCL
  step hier-bf16-blocking 90 $MPIRUN -x CUDA_LAUNCH_BLOCKING=1 -x NCCL_P2P_DISABLE=1 \
    -x NCCL_SHM_DISABLE=1 python3 tests/mpi/run_hierarchical.py --backend cuda \
    --inter-host nccl --local-size 1 --dtypes bfloat16,float32 --ops avg --counts 17
  step hier-bf16-mpi 90 $MPIRUN python3 tests/mpi/run_hierarchical.py --backend cuda \
    --inter-host mpi --local-size 1 --dtypes bfloat16,float32 --ops avg --counts 17
fi
if [ "$what" = compare ]; then
  BASELINE=${BASELINE:-.baseline}
  for round in 1 2; do
    step "profile-baseline-$round" 60 bash -c "cd $BASELINE && PYTHONPATH=\$PWD:$DEPS $MPIRUN \
      python3 tools/profile_call.py --size 1M"
    step "profile-now-$round" 60 $MPIRUN python3 tools/profile_call.py --size 1M
    step "compare-baseline-$round" 150 bash -c "cd $BASELINE && PYTHONPATH=\$PWD:$DEPS $MPIRUN \
      python3 -m hoccl.bench --sizes 1M,1G --libraries hoccl --out $OUT/compare-baseline-$round"
    step "compare-now-$round" 150 $MPIRUN python3 -m hoccl.bench --sizes 1M,1G \
      --libraries ${COMPARE_LIBRARIES:-hoccl} --out "$OUT/compare-now-$round"
  done
fi
if [ "$what" = overlap ] || [ "$what" = all ]; then
  step overlap 200 $MPIRUN python3 -m hoccl.bench.overlap --out "$OUT/overlap"
fi
if [ "$what" = levers ] || [ "$what" = all ]; then
  step levers 420 python3 benchmarks/levers.py ${LEVERS_ARGS:-} --out "$OUT/levers"
fi
if [ "$what" = tp ] || [ "$what" = all ]; then
  step tp 300 $TRUN python3 -m hoccl.bench.tp ${TP_ARGS:-} --out "$OUT/tp"
  step tp-plant-fault 150 $TRUN python3 -m hoccl.bench.tp --quick --plant-fault \
    --out "$OUT/tp-plant-fault"
fi
case "$what${judge:+-judged}" in figures-*|*-judged)
  # the open issues' criteria, judged from this run's JSON (tools/criteria.py)
  python3 tools/criteria.py "$OUT" --json "$OUT/criteria.json" > "$OUT/criteria.md" 2>&1
  summary+=("criteria       $(grep -c '| met |' "$OUT/criteria.md") met, $(grep -c 'NOT met' "$OUT/criteria.md") not met (criteria.md)") ;;
esac
tar czf /tmp/gpu-run.tgz -C "$OUT" . && mv /tmp/gpu-run.tgz "$OUT/gpu-run.tgz"
cat "$OUT/gpus.txt"
printf '%s\n' "${summary[@]}"
[ -f "$OUT/criteria.md" ] && grep -E '\| (met|NOT met) \|' "$OUT/criteria.md" | cut -d'|' -f2-5 | cut -c1-220
grep -h "^rank [0-9]: " "$OUT"/fail-*.log "$OUT"/direct-*.log 2>/dev/null | grep -v " µs$" | cut -c1-160
