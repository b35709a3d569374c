"""Where the GPU starts to pay for SB3's GAE: the patched
``RolloutBuffer.compute_returns_and_advantage`` with ``device="cpu"`` against ``device="cuda"``
(host-to-device copies, kernel, copy back), side by side, over buffer sizes.

    python benchmarks/sb3_crossover.py [--sizes 128x8,2048x8,2048x64,...]

Prints a table (median us per call, SB3's own loop for reference) and the smallest buffer at
which the GPU path is faster: the value for ``rl_triton.integrations.sb3``'s
``gpu_min_elements`` (docs/sb3.md). Without CUDA it prints the CPU columns only.
"""

import argparse
import os
import sys

import gymnasium as gym
import numpy as np
import torch
from stable_baselines3.common.buffers import RolloutBuffer

import rl_triton.integrations.sb3 as rt_sb3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from run import median_us  # noqa: E402

SIZES = "128x8,512x8,2048x8,2048x64,2048x256,2048x1024,4096x2048,8192x4096"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=SIZES, help="n_steps x n_envs list")
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    print("| n_steps x n_envs | SB3 loop us | rl_triton cpu us | rl_triton cuda us |")
    print("|---|---|---|---|")
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

        def run(method):
            return lambda: method(buf, last_values, dones)

        sb3 = median_us(run(RolloutBuffer.compute_returns_and_advantage)) if T * N <= 1 << 22 else float("nan")
        rt_sb3.patch(device="cpu")
        ours_cpu = median_us(run(RolloutBuffer.compute_returns_and_advantage))
        ours_gpu = float("nan")
        if cuda:
            rt_sb3.patch(device="cuda")
            ours_gpu = median_us(run(RolloutBuffer.compute_returns_and_advantage))
            if crossover is None and ours_gpu < ours_cpu:
                crossover = T * N
        rt_sb3.unpatch()
        print(f"| {T}x{N} | {sb3:.0f} | {ours_cpu:.0f} | {ours_gpu:.0f} |", flush=True)
    if cuda:
        print(f"GPU faster from {crossover} buffer steps on" if crossover else "GPU never faster on these sizes")


if __name__ == "__main__":
    main()
