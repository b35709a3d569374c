"""Sweep forced launch plans of the Triton engine for one estimator and print the fastest per shape.

    python benchmarks/sweep_plan.py [--algo gae] [--shapes 128x4096,64x8192]
    python benchmarks/sweep_plan.py --cells vtrace:1024x1024,episodic_cumsum:64x8192   # a short list each

With ``--cells`` each cell gets a short list of candidate plans instead of the full sweep
(``candidates``: whole rows in one pass at several warp counts, chunks of 256 to 1024 steps of
few warps, and for V-trace each with its epilogue reading vs[t+1] back from the output and by
the lane gather); every candidate is checked against the float64 oracle before it is timed.

Each plan compiles its own kernel, so a full sweep takes minutes: keep the shape list short.
Device time is the median CUDA-graph replay (benchmarks/run.py). The default plan is
``rl_triton.core.kernels.plan``; compare its line ("auto") with the best forced ones.
"""

import os
import sys

import torch

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..")]
from common import parser  # noqa: E402
from peers import Problem, max_error  # noqa: E402
from run import device_us  # noqa: E402

from rl_triton.core import kernels  # noqa: E402

SHAPES = "128x4096,64x8192,8x32768,1x131072,32768x8,4096x128"


def plans(R, T, sms, block_ts=(64, 128, 256, 512, 1024), warps=(1, 2, 4, 8), split=True, max_tile=4096):
    for block_t in block_ts:
        if block_t > max(T, 32):
            continue
        for num_warps in warps:
            for block_r in (1, 2, 4, 8, 16, 32, 64, 128):
                if block_r * block_t > max_tile or block_r * block_t < 32 * num_warps or block_r > 2 * R:
                    continue
                row_programs = -(-R // block_r)
                segs = {1, *(max(1, k * sms // row_programs) for k in (2, 4, 8))} if split else {1}
                for n_seg in sorted(segs):
                    if n_seg <= -(-T // block_t):
                        yield dict(block_t=block_t, block_r=block_r, num_warps=num_warps, n_seg=n_seg)


def candidates(algo, R, T):
    """A short list of forced plans for one cell (``--cells``)."""
    full = min(1 << (T - 1).bit_length(), 8192)
    out = []
    for num_warps in (4, 8, 16, 32):
        if 32 * num_warps <= full <= 256 * num_warps:  # 1 to 8 steps per thread
            out.append(dict(block_t=full, block_r=1, num_warps=num_warps, n_seg=1))
    for block_t, warps in ((256, (1, 2)), (512, (2, 4)), (1024, (4, 8))):
        if block_t < full:
            out += [dict(block_t=block_t, block_r=1, num_warps=w, n_seg=1) for w in warps]
    if full <= 128:
        out += [dict(block_t=full, block_r=max(1, 512 // full), num_warps=w, n_seg=1) for w in (2, 4)]
    if algo == "vtrace":  # the read-back everywhere, the gather on whole rows and in today's plan
        out = [dict(plan, prev_mem=True) for plan in out] + [
            dict(plan, prev_mem=False) for plan in out if plan["block_t"] == full] + [dict(prev_mem=False)]
    return out


def sweep_cells(cells, warm_only=False, shard="0/1"):
    """Time the candidate plans of each ``ALGO:RxT`` cell against the default plan; with
    ``warm_only`` call each once (compiling into Triton's cache) and time nothing; ``shard``
    K/N: the K-th of N interleaved parts of the candidates."""
    k, n = map(int, shard.split("/"))
    for item in cells.split(","):
        algo, shape = item.split(":")
        R, T = map(int, shape.split("x"))
        problem = Problem(algo, R, T)
        call, expected = problem.call, problem.expected(4)
        if warm_only:
            for forced in ([{}] + candidates(algo, R, T))[k::n]:
                with kernels.forced_plan(**forced):
                    try:
                        call()
                    except Exception:  # reported by the timed run
                        pass
            continue
        auto = device_us(call)
        results = []
        for forced in candidates(algo, R, T):
            with kernels.forced_plan(**forced):
                try:
                    err = max_error(call(), expected)
                    us = device_us(call, reps=5) if err <= 1e-4 else float("inf")
                except Exception as e:  # a plan that does not compile is reported, not fatal
                    print(f"  {algo} {shape} {forced}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
            results.append((us, forced, err))
        results.sort(key=lambda x: x[0])
        print(f"{algo} {shape}: auto {auto:.2f} us; floor {problem.nbytes / 4.3e6:.2f} us at 4.3 TB/s", flush=True)
        for us, forced, err in results:
            print(f"  {us:8.2f} us ({auto / us:.2f}x auto)  {forced}  err {err:.1e}", flush=True)
        del problem
        torch.cuda.empty_cache()


def main():
    p = parser(__doc__)
    p.add_argument("--algo", default="gae", help="an estimator of benchmarks/run.py (gae, vtrace, ...)")
    p.add_argument("--shapes", default=SHAPES, help="ROWSxT list")
    p.add_argument("--block-t", default="64,128,256,512,1024", help="BLOCK_T values to try")
    p.add_argument("--warps", default="1,2,4,8", help="num_warps values to try")
    p.add_argument("--max-tile", type=int, default=4096, help="largest BLOCK_R x BLOCK_T")
    p.add_argument("--no-split", action="store_true", help="one segment per row only")
    p.add_argument("--peers", action="store_true",
                   help="also time the torch.compile peers in the same process, and check the best plan "
                        "against the float64 oracle")
    p.add_argument("--cells", help="ALGO:RxT list: a short list of candidate plans per cell instead of the sweep")
    p.add_argument("--warm-only", action="store_true", help="--cells: compile every candidate, time nothing")
    p.add_argument("--shard", default="0/1", help="--cells --warm-only: K/N, the K-th of N parts of the candidates")
    args = p.parse_args()
    if args.cells:
        return sweep_cells(args.cells, args.warm_only, args.shard)
    ints = lambda text: tuple(int(x) for x in text.split(","))  # noqa: E731
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for shape in args.shapes.split(","):
        R, T = map(int, shape.split("x"))
        problem = Problem(args.algo, R, T)
        call = problem.call
        results = []
        for forced in plans(R, T, sms, ints(args.block_t), ints(args.warps), not args.no_split, args.max_tile):
            with kernels.forced_plan(**forced):
                results.append((device_us(call, reps=5), forced))
        results.sort(key=lambda x: x[0])
        best = " ".join(f"{t:.2f} {f}" for t, f in results[:3])
        print(f"{args.algo} {shape}: auto {device_us(call):.2f} us | best {best}", flush=True)
        if args.peers and results:
            with kernels.forced_plan(**results[0][1]):
                err = max_error(call(), problem.expected(8))
            torch._dynamo.reset()  # a fresh compile cache per shape, as benchmarks/run.py does
            peers = {name: fn for name, fn in problem.peers(loop_max_T=0).items() if "compile" in name}
            timed = " | ".join(f"{name} {device_us(fn):.2f} us" for name, fn in peers.items())
            print(f"  best plan: oracle error {err:.1e}; {timed}", flush=True)


if __name__ == "__main__":
    main()
