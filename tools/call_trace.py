"""Print the path of one eager call through hoccl, function by function, with modules.

Run: ``python tools/call_trace.py [--collective all_gather] [--ranks 2] [--count 1024]
[--all]``

Every rank lives in this process (``init_local``, host backend).  Each rank makes the
call once (its shape is prepared then), then again on the same buffers: the last rank's
second call, which matches every rank's and issues their work, is traced.  Each line is
one Python call inside hoccl, indented by its depth below the public method, with its
module; comprehensions are left out, and below the device's methods only their first
level is shown unless ``--all``.  The summary counts the frames from the public method
to the device's first copy and lists the layers each ``Engine.issue`` passed through, in
order (``tests/test_call_path.py`` checks both)."""

import argparse
import sys

import numpy as np

import hoccl
from hoccl._engine import Engine

SKIPPED = ("<listcomp>", "<genexpr>", "<dictcomp>", "<setcomp>", "<lambda>")
#: the layers below the matching, by module prefix
LAYERS = (("hoccl._engine", "engine"), ("hoccl._windows", "engine"), ("hoccl.p2p", "executor"),
          ("hoccl.streams", "stream manager / device"), ("hoccl.backends", "stream manager / device"))


def _layer(module: str) -> str:
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective", default="all_gather",
                        choices=("all_gather", "reduce_scatter", "all_reduce"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--count", type=int, default=1024, help="float32 elements per block")
    parser.add_argument("--all", action="store_true", help="show the device's inner calls too")
    args = parser.parse_args()
    comms = hoccl.init_local(args.ranks, backend="host")
    n, count = args.ranks, args.count
    full = [np.ones(n * count, np.float32) for _ in range(n)]

    def call(rank):
        comm, buffer = comms[rank], full[rank]
        own = buffer[rank * count:(rank + 1) * count]
        if args.collective == "all_gather":
            comm.all_gather(own, buffer)
        elif args.collective == "reduce_scatter":
            comm.reduce_scatter(buffer, own)
        else:
            comm.all_reduce(buffer, buffer)
    for rank in range(n):  # the first call of the shape: prepared now
        call(rank)
    for rank in range(n - 1):
        call(rank)
    lines, issue_modules, first_copy = [], [], []
    depth, in_issue, in_device, top = [0], [0], [0], [0]
    public = getattr(hoccl.Communicator, args.collective).__code__

    def profile(frame, event, arg):
        module = frame.f_globals.get("__name__", "")
        if event == "call":
            depth[0] += 1
            if frame.f_code is public:
                top[0] = depth[0] - 1  # the public method's frame is the first
            if frame.f_code is Engine.issue.__code__:
                in_issue[0] += 1
                issue_modules.append([])
            if not module.startswith("hoccl") or frame.f_code.co_name in SKIPPED:
                return
            if in_issue[0] and (not issue_modules[-1] or issue_modules[-1][-1] != _layer(module)):
                issue_modules[-1].append(_layer(module))
            if module.startswith("hoccl.backends"):
                if frame.f_code.co_name in ("copy", "copy_batch") and not first_copy:
                    first_copy.append(depth[0] - top[0])
                in_device[0] += 1
                if in_device[0] > 1 and not args.all:
                    return
            owner = frame.f_locals.get("self")
            name = (f"{type(owner).__name__}.{frame.f_code.co_name}" if owner is not None
                    else frame.f_code.co_name)
            lines.append(f"{'  ' * (depth[0] - top[0] - 1)}{name}  [{module}]")
        elif event == "return":
            if frame.f_code is Engine.issue.__code__:
                in_issue[0] -= 1
            if module.startswith("hoccl.backends") and frame.f_code.co_name not in SKIPPED:
                in_device[0] -= 1
            depth[0] -= 1
    sys.setprofile(profile)
    try:
        call(n - 1)
    finally:
        sys.setprofile(None)
    for comm in comms:
        comm.synchronize()
    print(f"rank {n - 1}'s repeated {args.collective} of {n} x {count} float32 "
          f"(init_local, host backend), the call that issues every rank's work:")
    print("\n".join(lines))
    print(f"\nframes from {args.collective} to the device's first copy: "
          f"{first_copy[0] if first_copy else 'none'}")
    for index, layers in enumerate(issue_modules):
        print(f"Engine.issue {index + 1} of {len(issue_modules)} passes: " + " -> ".join(layers))
    for comm in comms:
        comm.close()


if __name__ == "__main__":
    main()
