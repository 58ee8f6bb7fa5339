#!/usr/bin/env bash
# What a device call carries that the GPU machine lacks (it cannot download): wheels for
# its Python 3.12 in .wheels (tools/gpu_run.sh installs them), and optionally an earlier
# tree in .baseline for before-and-after runs in one call. Both paths are git-ignored:
# name them in the device call's carry. The carry limit is 64 MiB with the tracked tree:
# UCX's wheels (52 MB) do not fit beside it, so --ucx installs them here for that machine,
# drops their headers, static libraries and tools, and packs the rest (16 MB,
# .wheels/site.tar.xz, which tools/gpu_run.sh unpacks onto its path).
#   bash tools/device_carry.sh                 # humanfriendly and tqdm (hoccl.bench needs them)
#   bash tools/device_carry.sh --ucx           # and ucxx-cu13 with its libraries, packed
#   bash tools/device_carry.sh --baseline REV  # and REV's hoccl package in .baseline (with
#                                              # this tree's hoccl/bench/host_cost.py if it lacks one)
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=(humanfriendly tqdm)
ucx=()
baseline=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ucx) ucx=(ucxx-cu13==0.52.0 libucxx-cu13==0.52.0 libucx-cu13==1.21.0
                librmm-cu13==26.10.0 rapids-logger==0.3.0) ;;
    --baseline) baseline=$2; shift ;;
    *) echo "device_carry.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p .wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d .wheels "${wheels[@]}"
if [ ${#ucx[@]} -gt 0 ]; then
  site=$(mktemp -d)
  python3 -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --target "$site" "${ucx[@]}"
  rm -rf "$site"/lib*/include "$site"/libucx/bin
  find "$site" \( -name '*.a' -o -name __pycache__ \) -prune -exec rm -rf {} +
  tar cJf .wheels/site.tar.xz -C "$site" . && rm -rf "$site"
fi
if [ -n "$baseline" ]; then
  rm -rf .baseline && mkdir .baseline && git archive "$baseline" hoccl | tar -x -C .baseline
  # a tree older than the host-cost benchmark is measured by this tree's benchmark module
  [ -f .baseline/hoccl/bench/host_cost.py ] || cp hoccl/bench/host_cost.py .baseline/hoccl/bench/
fi
du -sh .wheels ${baseline:+.baseline}
