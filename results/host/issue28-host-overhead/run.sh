#!/usr/bin/env bash
# Host time per call before (204e9a5) and after (this tree), interleaved: two rounds, each
# running before then after, at 4 KiB and 1 MiB.  BEFORE: a checkout of 204e9a5
# (git worktree add /tmp/before 204e9a5).  Run from the repository root.  ROUNDS names the
# rounds (default "1 2"); REGISTERED=1 times calls on registered buffers instead (the
# earlier repeat path, now the prepared calls found in the cache), files named "registered-";
# CPU=1 takes each rank's CPU time instead of the wall clock, files named "cpu-".
set -euo pipefail
BEFORE=${BEFORE:-/tmp/before}
OUT=${OUT:-results/host/issue28-host-overhead}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$(mktemp -d)}  # no tuning table from elsewhere
extra=() prefix=""
if [ "${REGISTERED:-0}" = 1 ]; then extra=(--registered); prefix="registered-"; fi
if [ "${CPU:-0}" = 1 ]; then extra+=(--cpu-time); prefix="cpu-$prefix"; fi
for round in ${ROUNDS:-1 2}; do
  for size in 4K 1M; do
    for side in before after; do
      tree=$([ $side = before ] && echo "$BEFORE" || pwd)
      PYTHONPATH=$tree mpiexec -n 2 python tools/host_overhead.py --no-stream-work \
        --size $size --iters 1000 --repeats 10 "${extra[@]}" \
        > "$OUT/$prefix$side-$size-round$round.txt"
    done
  done
done
