"""Sweep forced launch plans of the Triton engine for one estimator and print the fastest per shape.

    python benchmarks/sweep_plan.py [--algo gae] [--shapes 128x4096,64x8192]

Each plan compiles its own kernel, so a full sweep takes minutes: keep the shape list short.
Device time is the median CUDA-graph replay (benchmarks/run.py). The default plan is
``rl_triton.core.kernels.plan``; compare its line ("auto") with the best forced ones.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
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
    args = p.parse_args()
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
