"""Where the host time of one GPU call goes: launch throughput (calls issued back to back, one
synchronize at the end, per call) of an empty Triton kernel, the engine launched directly with
prepared arguments, ``kernels.run`` on validated views, and the public ``rl_triton.gae``; then a
cProfile of the public call.

    python benchmarks/host_overhead.py [--shape 4096x128] [--profile 25]
"""

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rl_triton as rt  # noqa: E402
from rl_triton.core import kernels  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import _empty_kernel  # noqa: E402


def per_call_us(fn, n=2000, reps=7):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="4096x128")
    p.add_argument("--profile", type=int, default=25, help="cProfile rows to print (0: none)")
    args = p.parse_args()
    R, T = map(int, args.shape.split("x"))
    dev = "cuda"
    r, v = torch.randn(R, T, device=dev), torch.randn(R, T, device=dev)
    term = torch.rand(R, T, device=dev) < 0.02
    bv = torch.randn(R, device=dev)
    adv, ret = torch.empty_like(r), torch.empty_like(r)
    x = torch.empty(1, device=dev)
    call = lambda: rt.gae(r, v, bootstrap_value=bv, terminated=term)  # noqa: E731
    call_out = lambda: rt.gae(r, v, bootstrap_value=bv, terminated=term, out=(adv, ret))  # noqa: E731
    run = lambda: kernels.run("gae", r, v, None, bv, term, None, None, None, 0.99, 0.95, 0, 0, adv, ret)  # noqa: E731
    rows = [("empty Triton kernel (1 argument)", lambda: _empty_kernel[(1,)](x)),
            ("kernels.run on validated [R, T] views", run),
            ("rl_triton.gae(..., out=)", call_out),
            ("rl_triton.gae(...)", call)]
    print(f"launch throughput at {R}x{T} (us per call, calls back to back):")
    for name, fn in rows:
        print(f"  {name:40s} {per_call_us(fn):7.1f}")
    print(f"  compiled kernels launched directly: {len(kernels._compiled)}")
    for name, fn in rows[1:] if args.profile else ():
        print(f"\ncProfile of {name}:")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
