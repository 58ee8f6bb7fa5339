"""cProfile of repeated world-1 calls on the cuda backend (host cost breakdown)."""
import cProfile, pstats, sys, time, io
import torch, hoccl
comm = hoccl.init(backend="cuda")
n = 1 << 19
out = sys.argv[1] if len(sys.argv) > 1 else "."
for variant in ("registered", "plain", "direct"):
    if variant == "plain":
        send = torch.zeros(n, dtype=torch.bfloat16, device="cuda"); recv = torch.zeros_like(send)
    else:
        send = hoccl.empty(n, "bfloat16", comm, framework="torch"); recv = hoccl.empty(n, "bfloat16", comm, framework="torch")
    comm.set_options(kernel_bytes=(2 * n if variant == "direct" else 0))
    for _ in range(20): comm.all_reduce(send, recv)
    comm.synchronize(); torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(500): comm.all_reduce(send, recv)
    us = (time.perf_counter() - t) / 500 * 1e6
    comm.synchronize(); torch.cuda.synchronize()
    pr = cProfile.Profile(); pr.enable()
    for _ in range(500): comm.all_reduce(send, recv)
    pr.disable(); comm.synchronize(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    s2 = io.StringIO(); pstats.Stats(pr, stream=s2).sort_stats("cumtime").print_stats(40)
    with open(f"{out}/prof_{variant}.txt", "w") as f:
        f.write(f"{variant}: {us:.1f} us/call unprofiled\n" + s.getvalue() + s2.getvalue())
    print(variant, f"{us:.1f} us/call")
comm.close()
