"""CPU timing of GAE: rl_triton's TorchRL drop-in vs TorchRL's loop and vectorised functionals.

TorchRL layout ``[B, T, 1]``, float32, ~2% dones (a tenth of them terminations), gamma=0.99,
lmbda=0.95. Each function is checked against TorchRL's loop first, then timed: the three take
turns in --rounds rounds (benchmarks/common.py), and each cell is the median time per call
over the rounds with the lowest-highest round; the last column is rl_triton's speed-up over
TorchRL's loop, taken within each round.

    python benchmarks/torchrl_cpu.py                     # B=8,T=2048 and B=1024,T=128
    python benchmarks/torchrl_cpu.py --shapes 8x2048 --rounds 15
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torchrl.objectives.value import functional as tfn  # noqa: E402

import rl_triton.integrations.torchrl as rtt  # noqa: E402
from common import alternate, machine, parser, ratios, spread  # noqa: E402


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--shapes", default="8x2048,1024x128", help="B x T list")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    a = p.parse_args()
    torch.manual_seed(0)
    impls = [
        ("rl_triton generalized_advantage_estimate", rtt.generalized_advantage_estimate),
        ("TorchRL generalized_advantage_estimate (loop)", tfn.generalized_advantage_estimate),
        ("TorchRL vec_generalized_advantage_estimate", tfn.vec_generalized_advantage_estimate),
    ]
    print(f"{machine()}; torch {torch.__version__}; "
          f"RL_TRITON_CHECK_VALUES={os.environ.get('RL_TRITON_CHECK_VALUES', 'auto')}; ms per call, median "
          f"(lowest-highest) of {a.rounds} rounds")
    print("| B x T | " + " | ".join(name for name, _ in impls) + " | speed-up over TorchRL's loop |")
    print("|---|" + "---:|" * (len(impls) + 1))
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        v, nv, r = (torch.randn(B, T, 1) for _ in range(3))
        done = torch.rand(B, T, 1) < 0.02
        term = done & (torch.rand(B, T, 1) < 0.1)
        args = (0.99, 0.95, v, nv, r, done, term)
        ref = tfn.generalized_advantage_estimate(*args)[0]
        errors = [(fn(*args)[0] - ref).abs().max().item() for _, fn in impls]
        times = alternate({name: (lambda fn=fn: fn(*args)) for name, fn in impls}, rounds=a.rounds)
        cells = [f"{spread([1e3 * t for t in times[name]], '{:.2f}')} (err {err:.1e})"
                 for (name, _), err in zip(impls, errors)]
        speed = spread(ratios(times[impls[1][0]], times[impls[0][0]]), unit="x")
        print(f"| {B} x {T} | " + " | ".join(cells) + f" | {speed} |", flush=True)


if __name__ == "__main__":
    main()
