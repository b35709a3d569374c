"""Shared pieces of the Stable-Baselines3 examples: the --patch/--no-patch/--compare switch,
timing of compute_returns_and_advantage and of the whole update, an episode-return log with a
progress bar, and the CSV/PNG outputs.

The optional packages (gymnasium, Stable-Baselines3, the environments) are imported after the
command line is parsed, so ``--help`` works without them and a missing one ends in the
install line, not a traceback.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from collections import defaultdict

import numpy as np
import torch

from rl_triton._scripts import parser, progress, require


def parse_args(doc: str, timesteps: int, n_envs: int, out: str):
    p = parser(doc)
    p.add_argument("--patch", action=argparse.BooleanOptionalAction, default=True,
                   help="use rl_triton's fused GAE, or SB3's own loop with --no-patch")
    p.add_argument("--compare", action="store_true", help="run both, SB3's loop first, and compare")
    p.add_argument("--timesteps", type=int, default=timesteps, help="environment steps per run (all envs)")
    p.add_argument("--n-envs", type=int, default=n_envs, help="vectorised environments")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments and the model")
    p.add_argument("--out", default=out, help="folder for the CSV and PNG outputs")
    return p.parse_args()


def progress_callback(total: int, label: str):
    """An SB3 callback that collects episode returns from the Monitor infos and draws a
    progress bar over timesteps."""
    from stable_baselines3.common.callbacks import BaseCallback

    class Progress(BaseCallback):
        def __init__(self):
            super().__init__()
            self.episodes, self.bar = [], None

        def _on_training_start(self):
            self.bar = progress(total, label)

        def _on_step(self):
            for info in self.locals["infos"]:
                if "episode" in info:
                    self.episodes.append((self.num_timesteps, float(info["episode"]["r"])))
            if self.bar is not None:
                if self.episodes:
                    self.bar.set_postfix(last_return=f"{self.episodes[-1][1]:.1f}", refresh=False)
                self.bar.update(self.training_env.num_envs)
            return True

        def _on_training_end(self):
            if self.bar is not None:
                self.bar.close()

    return Progress()


def _timed(fn, timings, key):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            timings[key].append(time.perf_counter() - start)

    return wrapper


def run(make_model, timesteps: int, patch: bool, label: str):
    """Train one model; returns the episode log and the per-call timings."""
    import rl_triton.integrations.sb3 as rt_sb3

    (rt_sb3.patch if patch else rt_sb3.unpatch)()
    model = make_model()
    torch.manual_seed(0)
    timings = defaultdict(list)
    buffer = model.rollout_buffer
    buffer.compute_returns_and_advantage = _timed(buffer.compute_returns_and_advantage, timings, "gae")
    model.train = _timed(model.train, timings, "update")
    callback = progress_callback(timesteps, label)
    start = time.perf_counter()
    model.learn(timesteps, callback=callback)
    timings["total"].append(time.perf_counter() - start)
    rt_sb3.unpatch()
    return {"label": label, "episodes": callback.episodes, "timings": timings}


def warm_up(n_steps: int, n_envs: int):
    """One call of each GAE path on a dummy buffer of the run's size (numba loads its cache)."""
    import gymnasium as gym
    from stable_baselines3.common.buffers import RolloutBuffer

    import rl_triton.integrations.sb3 as rt_sb3

    buf = RolloutBuffer(n_steps, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", n_envs=n_envs)
    buf.rewards[:] = np.random.default_rng(0).standard_normal(buf.rewards.shape)
    for fn in (RolloutBuffer.compute_returns_and_advantage, rt_sb3.compute_returns_and_advantage):
        fn(buf, torch.zeros(n_envs), np.zeros(n_envs))


def _median_ms(times):
    """Median per call, leaving out the first call (warm-up of the process) when there are more."""
    return 1e3 * statistics.median(times[1:] if len(times) > 1 else times)


def report(results, out: str, title: str):
    """Print the timing table; write episodes.csv, timings.csv and returns.png under ``out``."""
    os.makedirs(out, exist_ok=True)
    rows = []
    for r in results:
        t = r["timings"]
        gae_ms, upd_ms = _median_ms(t["gae"]), _median_ms(t["update"])
        rows.append((r["label"], len(t["gae"]), gae_ms, upd_ms, gae_ms + upd_ms, t["total"][0]))
    print(f"\n{title} (medians per call, first call left out)")
    print("| GAE | rollouts | compute_returns_and_advantage ms/call | update (train) ms/call | "
          "GAE + update ms | whole run s |")
    print("|---|---|---|---|---|---|")
    for label, n, gae_ms, upd_ms, both, total in rows:
        print(f"| {label} | {n} | {gae_ms:.3f} | {upd_ms:.1f} | {both:.1f} | {total:.1f} |")
    if len(rows) == 2:
        print(f"compute_returns_and_advantage speed-up: {rows[0][2] / rows[1][2]:.1f}x; "
              f"GAE + update speed-up: {rows[0][4] / rows[1][4]:.3f}x")
    with open(os.path.join(out, "timings.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "rollouts", "gae_ms_per_call", "update_ms_per_call", "gae_plus_update_ms", "run_s"])
        w.writerows(rows)
    with open(os.path.join(out, "episodes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "timesteps", "episode_return"])
        for r in results:
            w.writerows((r["label"], s, ret) for s, ret in r["episodes"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        if r["episodes"]:
            by_step = defaultdict(list)
            for step, ret in r["episodes"]:
                by_step[step].append(ret)
            steps = sorted(by_step)
            line, = ax.plot(steps, [np.mean(by_step[s]) for s in steps], "-o", label=f"{r['label']} (mean)")
            ax.scatter(*zip(*r["episodes"]), s=8, alpha=0.4, color=line.get_color())
    ax.set_xlabel("timesteps")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    if any(r["episodes"] for r in results):
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no episode finished within the budget", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "returns.png"), dpi=120)
    print(f"wrote {out}/timings.csv, episodes.csv and returns.png")


def main(doc, make_model, timesteps, n_envs, n_steps, out, title, needs=()):
    """Parse the command line of the script whose docstring is ``doc``, check that
    gymnasium, SB3, matplotlib and ``needs`` are installed, and train and report."""
    args = parse_args(doc, timesteps, n_envs, out)
    require("gymnasium", "stable_baselines3", "matplotlib", *needs)
    warm_up(n_steps, args.n_envs)
    variants = [False, True] if args.compare else [args.patch]
    results = [run(lambda: make_model(args), args.timesteps, patch, "rl_triton" if patch else "SB3 loop")
               for patch in variants]
    report(results, args.out, title)
