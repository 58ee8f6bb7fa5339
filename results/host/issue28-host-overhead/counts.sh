#!/usr/bin/env bash
# Python calls inside hoccl per call, before (204e9a5) and after (this tree): a figure the
# machine's load does not move (tools/host_overhead.py --count-calls).  Run from the
# repository root; BEFORE: a checkout of 204e9a5.
set -euo pipefail
BEFORE=${BEFORE:-/tmp/before}
OUT=${OUT:-results/host/issue28-host-overhead}
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$(mktemp -d)}
for registered in "" --registered; do
  for size in 4K 1M; do
    for side in before after; do
      tree=$([ $side = before ] && echo "$BEFORE" || pwd)
      PYTHONPATH=$tree mpiexec -n 2 python tools/host_overhead.py --no-stream-work \
        --size $size --iters 1000 --repeats 1 --count-calls $registered \
        > "$OUT/calls-${registered:+registered-}$side-$size.txt"
    done
  done
done
grep -H "Python calls" "$OUT"/calls-*.txt
