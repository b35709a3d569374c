"""Where the GPU starts to pay for SB3's GAE: the patched
``RolloutBuffer.compute_returns_and_advantage`` with ``device="cpu"`` against ``device="cuda"``
(host-to-device copies, kernel, copy back), side by side, over buffer sizes.

    python benchmarks/sb3_crossover.py [--sizes 128x8,2048x8,2048x64,...] [--rounds 9]

Prints a table (us per call, SB3's own loop for reference up to 4M steps, and the speed-up of the
CPU path over it) and the smallest buffer
at which the GPU path is faster: the value for ``rl_triton.integrations.sb3``'s
``gpu_min_elements`` (docs/sb3.md). The implementations take turns in --rounds rounds
(benchmarks/common.py); each cell is the median over the rounds and the lowest-highest
round. Without CUDA it prints the SB3 and CPU columns only.
"""

import os
import sys

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3.common.buffers import RolloutBuffer

import rl_triton.integrations.sb3 as rt_sb3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, parser, ratios, spread  # noqa: E402


SIZES = "128x8,512x8,2048x8,2048x64,2048x256,2048x1024,4096x2048,8192x4096"


def main():
    p = parser(__doc__)
    p.add_argument("--sizes", default=SIZES, help="n_steps x n_envs list")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    columns = ["SB3 loop", "rl_triton cpu"] + (["rl_triton cuda"] if cuda else [])
    print("| n_steps x n_envs | " + " | ".join(f"{c} us" for c in columns) + " | SB3 loop / rl_triton cpu |")
    print("|---|" + "---|" * (len(columns) + 1))
    crossover = None
    for size in args.sizes.split(","):
        T, N = map(int, size.split("x"))
        rng = np.random.default_rng(T + N)
        buf = RolloutBuffer(T, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", gae_lambda=0.95,
                            gamma=0.99, n_envs=N)
        buf.rewards[:] = rng.standard_normal((T, N))
        buf.values[:] = rng.standard_normal((T, N))
        buf.episode_starts[:] = rng.random((T, N)) < 0.02
        last_values, dones = torch.randn(N), np.zeros(N)

        def patched(device):
            def call():
                buf.gae_device = device  # the per-buffer setting of FastRolloutBuffer
                rt_sb3.compute_returns_and_advantage(buf, last_values, dones)
            return call

        impls = {"rl_triton cpu": patched("cpu")}
        if cuda:
            impls["rl_triton cuda"] = patched("cuda")
        if T * N <= 1 << 22:
            impls["SB3 loop"] = lambda: RolloutBuffer.compute_returns_and_advantage(buf, last_values, dones)
        times = alternate(impls, rounds=args.rounds)
        cells = [spread([1e6 * t for t in times[c]], "{:.0f}") if c in times else "-" for c in columns]
        speed_up = ratios(times["SB3 loop"], times["rl_triton cpu"]) if "SB3 loop" in times else None
        cells.append(spread(speed_up, unit="x") if speed_up else "-")
        print(f"| {T}x{N} | " + " | ".join(cells) + " |", flush=True)
        if cuda and crossover is None and np.median(times["rl_triton cuda"]) < np.median(times["rl_triton cpu"]):
            crossover = T * N
    if cuda:
        print(f"GPU faster from {crossover} buffer steps on" if crossover else "GPU never faster on these sizes")


if __name__ == "__main__":
    main()
