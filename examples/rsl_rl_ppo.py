"""PPO with rsl_rl's ``OnPolicyRunner`` on a gymnasium vector environment (CartPole-v1, a few
hundred copies) wrapped in rsl_rl's ``VecEnv`` interface, its GAE either rsl_rl's own loop or
rl_triton's fused call (``algorithm.class_name = "rl_triton.integrations.rsl_rl:PPO"``).

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/rsl_rl_ppo.py              # rl_triton's PPO subclass (--fast)
    python examples/rsl_rl_ppo.py --no-fast    # rsl_rl's PPO, its own loop
    python examples/rsl_rl_ppo.py --compare    # both, one after the other, same seed

The wrapper maps gymnasium's terminated and truncated onto rsl_rl's conventions as IsaacLab's
does: ``dones = terminated | truncated`` and ``extras["time_outs"] = truncated`` (rsl_rl folds
gamma * V(s_t) into the reward at a time-out). CartPole's two actions come from the sign of the
Gaussian policy's one output. Prints the median iteration time and the median time of
``compute_returns`` (the GAE and its normalisation), and writes iterations.csv and returns.png
(mean episode return and iteration time per iteration) under --out. The default budget
finishes in a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import csv
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import parser, progress, require, two_panels  # noqa: E402

ENV = "CartPole-v1"


def parse_args():
    p = parser(__doc__)
    p.add_argument("--iterations", type=int, default=60, help="learning iterations (rollout + update)")
    p.add_argument("--num-envs", type=int, default=256, help="environments stepped together")
    p.add_argument("--steps", type=int, default=24, help="steps per environment per iteration (IsaacLab's 24)")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments and torch")
    p.add_argument("--out", default="runs/rsl_rl_ppo", help="folder for the CSV and PNG outputs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fast", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="rl_triton's PPO subclass (--no-fast: rsl_rl's own PPO)")
    g.add_argument("--compare", action="store_true", help="rsl_rl's PPO, then rl_triton's")
    return p.parse_args()


def make_env(num_envs: int, seed: int):
    """CartPole-v1 x ``num_envs`` in rsl_rl's VecEnv interface."""
    import gymnasium as gym
    from rsl_rl.env import VecEnv
    from tensordict import TensorDict

    class GymVecEnv(VecEnv):
        def __init__(self):
            self.env = gym.vector.SyncVectorEnv([lambda: gym.make(ENV)] * num_envs,
                                                autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
            self.num_envs, self.num_actions, self.device, self.cfg = num_envs, 1, "cpu", {}
            self.max_episode_length = self.env.envs[0].spec.max_episode_steps
            self.episode_length_buf = torch.zeros(num_envs, dtype=torch.long)
            self.returns, self.finished = torch.zeros(num_envs), []
            obs, _ = self.env.reset(seed=seed)
            self.obs = torch.as_tensor(obs, dtype=torch.float32)

        def get_observations(self):
            return TensorDict({"policy": self.obs}, batch_size=[self.num_envs])

        def step(self, actions):
            obs, reward, terminated, truncated, _ = self.env.step((actions[:, 0] > 0).long().numpy())
            # SAME_STEP autoreset: obs is already the next episode's first where an episode ended
            self.obs = torch.as_tensor(obs, dtype=torch.float32)
            reward = torch.as_tensor(reward, dtype=torch.float32)
            terminated, truncated = torch.as_tensor(terminated), torch.as_tensor(truncated)
            dones = terminated | truncated
            self.returns += reward
            self.finished += self.returns[dones].tolist()
            self.returns[dones] = 0.0
            self.episode_length_buf += 1
            self.episode_length_buf[dones] = 0
            return self.get_observations(), reward, dones, {"time_outs": truncated}

    return GymVecEnv()


def train_cfg(fast: bool, steps: int) -> dict:
    return {
        "num_steps_per_env": steps, "save_interval": 10**9, "logger": "tensorboard",
        "obs_groups": {"actor": ["policy"], "critic": ["policy"]},
        "algorithm": {"class_name": "rl_triton.integrations.rsl_rl:PPO" if fast else "PPO",
                      "num_learning_epochs": 4, "num_mini_batches": 4, "learning_rate": 1e-3, "gamma": 0.99,
                      "lam": 0.95, "entropy_coef": 0.0},
        "actor": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "elu",
                  "distribution_cfg": {"class_name": "GaussianDistribution"}},
        "critic": {"class_name": "MLPModel", "hidden_dims": [64, 64], "activation": "elu"},
    }


def train(args, fast: bool, label: str):
    """One run: per iteration its time, the time of compute_returns, the mean finished return."""
    from rsl_rl.runners import OnPolicyRunner

    torch.manual_seed(args.seed)
    env = make_env(args.num_envs, args.seed)
    runner = OnPolicyRunner(env, train_cfg(fast, args.steps), log_dir=None, device="cpu")
    alg = runner.alg
    returns_times = []
    method = alg.compute_returns

    def timed(obs):
        t0 = time.perf_counter()
        method(obs)
        returns_times.append(time.perf_counter() - t0)

    alg.compute_returns = timed  # this instance only
    rows = []
    bar = progress(args.iterations, label, unit="it")
    for it in range(args.iterations):
        env.finished = []
        t0 = time.perf_counter()
        runner.learn(1)
        elapsed = time.perf_counter() - t0
        mean_return = statistics.fmean(env.finished) if env.finished else float("nan")
        rows.append((label, it, elapsed, 1e3 * returns_times[-1], mean_return))
        if bar is not None:
            bar.set_postfix(mean_return=f"{mean_return:.1f}", refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    cls = type(alg)
    print(f"{label}: algorithm {cls.__module__}.{cls.__name__}, {args.iterations} iterations of "
          f"{args.steps} x {args.num_envs}")
    return rows


def report(results: dict, out: str):
    os.makedirs(out, exist_ok=True)
    labels = list(results)
    # the first iteration compiles (numba) and warms up: left out of the medians
    med = {label: [statistics.median(r[i] for r in results[label][1:] or results[label]) for i in (2, 3)]
           for label in labels}
    print("\nrsl_rl PPO, " + ENV + ": medians")
    print("| | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    print("| iteration (s) | " + " | ".join(f"{med[label][0]:.3f}" for label in labels) + " |")
    print("| compute_returns (ms) | " + " | ".join(f"{med[label][1]:.3f}" for label in labels) + " |")
    with open(os.path.join(out, "iterations.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "iteration", "iteration_s", "compute_returns_ms", "mean_episode_return"])
        for label in labels:
            w.writerows(results[label])
    two_panels(os.path.join(out, "returns.png"),
               ((label, ([r[1] for r in results[label]], [r[4] for r in results[label]]),
                 ([r[1] for r in results[label]], [r[2] for r in results[label]])) for label in labels),
               dict(xlabel="iteration", ylabel="mean episode return", title=f"rsl_rl PPO, {ENV}"),
               dict(xlabel="iteration", ylabel="iteration time (s)", title="time per iteration"))
    print(f"wrote {out}/iterations.csv and returns.png")


def main():
    args = parse_args()
    require("rsl_rl", "gymnasium", "tensordict", "matplotlib")
    runs = [(False, "rsl_rl"), (True, "rl_triton")] if args.compare else [(args.fast, "rl_triton" if args.fast
                                                                            else "rsl_rl")]
    report({label: train(args, fast, label) for fast, label in runs}, args.out)


if __name__ == "__main__":
    main()
