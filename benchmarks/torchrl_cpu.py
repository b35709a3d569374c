"""CPU timing of GAE: rl_triton's TorchRL drop-in vs TorchRL's loop and vectorised functionals.

TorchRL layout ``[B, T, 1]``, float32, ~2% dones (a tenth of them terminations), gamma=0.99,
lmbda=0.95. Each function is checked against TorchRL's loop first, then timed: median of
``--repeats`` calls after warm-up (wall clock, time.perf_counter).

    python benchmarks/torchrl_cpu.py                     # B=8,T=2048 and B=1024,T=128
    python benchmarks/torchrl_cpu.py --shapes 8x2048 --repeats 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchrl.objectives.value import functional as tfn  # noqa: E402

import rl_triton.integrations.torchrl as rtt  # noqa: E402


def _median_ms(fn, args, repeats, warmup=3):
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8x2048,1024x128")
    p.add_argument("--repeats", type=int, default=21)
    a = p.parse_args()
    torch.manual_seed(0)
    impls = [
        ("rl_triton generalized_advantage_estimate", rtt.generalized_advantage_estimate),
        ("TorchRL generalized_advantage_estimate (loop)", tfn.generalized_advantage_estimate),
        ("TorchRL vec_generalized_advantage_estimate", tfn.vec_generalized_advantage_estimate),
    ]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"RL_TRITON_CHECK_VALUES={os.environ.get('RL_TRITON_CHECK_VALUES', 'auto')}")
    print("| B x T | " + " | ".join(name for name, _ in impls) + " |")
    print("|---|" + "---:|" * len(impls))
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        v, nv, r = (torch.randn(B, T, 1) for _ in range(3))
        done = torch.rand(B, T, 1) < 0.02
        term = done & (torch.rand(B, T, 1) < 0.1)
        args = (0.99, 0.95, v, nv, r, done, term)
        ref = tfn.generalized_advantage_estimate(*args)[0]
        cells = []
        for _, fn in impls:
            err = (fn(*args)[0] - ref).abs().max().item()
            cells.append(f"{_median_ms(fn, args, a.repeats):.2f} ms (err {err:.1e})")
        print(f"| {B} x {T} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
