"""Where the host time of one GPU call goes: launch throughput (calls issued back to back, one
synchronize at the end, per call) of an empty Triton kernel, the engine launched directly with
prepared arguments, ``kernels.run`` on validated views, the function a call plan generates for
the signature called directly (what an explicit reusable handle would cost: no signature key),
and the public ``rl_triton.gae``; the public call's first call of a signature (call plans
cleared) and its second beside it; then a cProfile of the public call. ``--cpu`` does the same for
the numba backend on CPU tensors, with a row for the Python above the backend alone (``cpu.run``
replaced by a no-op).

    python benchmarks/host_overhead.py [--shape 4096x128] [--profile 25] [--cpu]
"""

import cProfile
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # after PYTHONPATH: another checkout can be timed
import rl_triton as rt  # noqa: E402
from rl_triton.core import cpu, kernels, plans, spec  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import first_calls, parser, spread  # noqa: E402
from run import _empty_kernel  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def per_call_us(fn, n=2000, reps=7):
    for _ in range(20):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        _sync()
        times.append((time.perf_counter() - start) / n * 1e6)
    return statistics.median(times)


def _stubbed(fn):
    """``fn`` with the numba backend's launch replaced by a no-op: the Python above it alone."""
    def call():
        run, cpu.run = cpu.run, lambda *a: None
        try:
            fn()
        finally:
            cpu.run = run
    return call


def _generated(kwargs):
    """The function the call plan of ``rl_triton.gae(**kwargs)`` generated, called without the
    signature key."""
    plans.clear()
    for _ in range(3):
        rt.gae(**kwargs)
    (plan,) = [p for p in plans._plans.values() if p is not plans._NO_PLAN]
    assert plan.hit is not None, "no generated function for this signature"
    return lambda: plan.hit((), kwargs)


def main():
    p = parser(__doc__)
    p.add_argument("--shape", default="4096x128", help="ROWSxT of the GAE call")
    p.add_argument("--profile", type=int, default=25, help="cProfile rows to print (0: none)")
    p.add_argument("--cpu", action="store_true", help="the numba backend on CPU tensors")
    args = p.parse_args()
    R, T = map(int, args.shape.split("x"))
    dev = "cpu" if args.cpu else "cuda"
    r, v = torch.randn(R, T, device=dev), torch.randn(R, T, device=dev)
    term = torch.rand(R, T, device=dev) < 0.02
    bv = torch.randn(R, device=dev)
    adv, ret = torch.empty_like(r), torch.empty_like(r)
    x = torch.empty(1, device=dev)
    kwargs = dict(rewards=r, values=v, bootstrap_value=bv, terminated=term)
    call = lambda: rt.gae(**kwargs)  # noqa: E731
    call_out = lambda: rt.gae(**kwargs, out=(adv, ret))  # noqa: E731
    views = spec.GAE.bind(rewards=r, values=v, bootstrap_value=bv, terminated=term, gamma=0.99, lmbda=0.95)
    if args.cpu:
        rows = [("cpu.run on validated [R, T] views", lambda: cpu.run(spec.GAE, torch.float32, views, (adv, ret))),
                ("rl_triton.gae(..., out=), cpu.run a no-op", _stubbed(call_out)),
                ("generated function of the plan, no key", _generated(kwargs)),
                ("rl_triton.gae(..., out=)", call_out),
                ("rl_triton.gae(...)", call)]
    else:
        rows = [("empty Triton kernel (1 argument)", lambda: _empty_kernel[(1,)](x)),
                ("kernels.run on validated [R, T] views", lambda: kernels.run(spec.GAE, views, (adv, ret))),
                ("generated function of the plan, no key", _generated(kwargs)),
                ("rl_triton.gae(..., out=)", call_out),
                ("rl_triton.gae(...)", call)]
    print(f"launch throughput at {R}x{T} (us per call, calls back to back):")
    for name, fn in rows:
        print(f"  {name:44s} {per_call_us(fn):7.1f}")
    if not args.cpu:
        print(f"  compiled kernels launched directly: {len(kernels._compiled)}")
    print("one call (synchronized), median (lowest-highest) of 9, with the call plans cleared before the first:")
    for name, fn in rows[-2:]:
        times = first_calls(fn, 9, dev)
        print(f"  {name:44s} first call of its signature {spread(times['first'])}, second {spread(times['second'])}")
    for name, fn in rows[1:] if args.profile else ():
        print(f"\ncProfile of {name}:")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        _sync()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
