"""Shared pieces of the Stable-Baselines3 examples: the --patch/--no-patch/--compare switch,
timing of SB3's and rl_triton's compute_returns_and_advantage side by side on each rollout and
of the whole update, an episode-return log with a progress bar, and the CSV/PNG outputs.

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

from rl_triton._scripts import parser, progress, require, returns_plot


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


def gae_ways():
    """SB3's compute_returns_and_advantage (its loop) and rl_triton's, by label. Withdraws the
    patch first, so that SB3's own method is the one on the class."""
    from stable_baselines3.common.buffers import RolloutBuffer

    import rl_triton.integrations.sb3 as rt_sb3

    rt_sb3.unpatch()
    return {"SB3 loop": RolloutBuffer.compute_returns_and_advantage, "rl_triton": rt_sb3.compute_returns_and_advantage}


def side_by_side(buffer, ways: dict, keep: str, timings) -> None:
    """Make ``buffer.compute_returns_and_advantage`` (this instance) run both GAEs of ``ways``
    (:func:`gae_ways`) on the same rollout, one after the other (which goes first alternates from
    one rollout to the next), and record each one's seconds in ``timings[label]``: both under the
    same load, so that their ratio is not the load's noise. ``keep`` labels the GAE the run trains
    with; it is called through the buffer's class (SB3's method, or rl_triton's under
    ``patch()``), and the buffer keeps its advantages and returns."""
    ways = dict(ways, **{keep: type(buffer).compute_returns_and_advantage})

    def compute_returns_and_advantage(last_values, dones):
        order = list(ways) if len(timings[keep]) % 2 == 0 else list(ways)[::-1]
        for label in order:
            start = time.perf_counter()
            ways[label](buffer, last_values, dones)
            timings[label].append(time.perf_counter() - start)
            if label == keep:
                kept = buffer.advantages.copy(), buffer.returns.copy()
        buffer.advantages[:], buffer.returns[:] = kept

    buffer.compute_returns_and_advantage = compute_returns_and_advantage


def run(make_model, ways: dict, timesteps: int, patch: bool, label: str):
    """Train one model with SB3's GAE or, patched, rl_triton's; each rollout also times the other
    of ``ways`` (:func:`side_by_side`). Returns the episode log and the per-call timings."""
    import rl_triton.integrations.sb3 as rt_sb3

    (rt_sb3.patch if patch else rt_sb3.unpatch)()
    model = make_model()
    torch.manual_seed(0)
    timings = defaultdict(list)
    side_by_side(model.rollout_buffer, ways, label, timings)
    model.train = _timed(model.train, timings, "update")
    callback = progress_callback(timesteps, label)
    start = time.perf_counter()
    model.learn(timesteps, callback=callback)
    timings["total"].append(time.perf_counter() - start)
    rt_sb3.unpatch()
    return {"label": label, "episodes": callback.episodes, "timings": timings}


def warm_up(ways: dict, n_steps: int, n_envs: int):
    """One call of each GAE of ``ways`` on a dummy buffer of the run's size (numba loads its
    cache)."""
    import gymnasium as gym
    from stable_baselines3.common.buffers import RolloutBuffer

    buf = RolloutBuffer(n_steps, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", n_envs=n_envs)
    buf.rewards[:] = np.random.default_rng(0).standard_normal(buf.rewards.shape)
    for fn in ways.values():
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
        loop, ours = t["SB3 loop"], t["rl_triton"]
        # each rollout's ratio is taken within its pair of calls; the first pair left out, as above
        ratios = [a / b for a, b in zip(loop, ours)]
        speedup = statistics.median(ratios[1:] or ratios)
        rows.append((r["label"], len(loop), _median_ms(loop), _median_ms(ours), speedup, _median_ms(t["update"]),
                     t["total"][0]))
    print(f"\n{title} (medians per call, first call left out)")
    print("compute_returns_and_advantage: both GAEs on each rollout's buffer, one after the other\n"
          "(the speed-up: the median of the pairs' ratios); the update (train) does the same work with either")
    print("| run trains with | rollouts | GAE, SB3 loop ms | GAE, rl_triton ms | GAE speed-up | update (train) ms | "
          "whole run s |")
    print("|---|---|---|---|---|---|---|")
    for label, n, loop_ms, ours_ms, speedup, upd_ms, total in rows:
        print(f"| {label} | {n} | {loop_ms:.3f} | {ours_ms:.3f} | {speedup:.1f}x | {upd_ms:.1f} | {total:.1f} |")
    with open(os.path.join(out, "timings.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "rollouts", "sb3_loop_ms_per_call", "rl_triton_ms_per_call", "gae_speedup",
                    "update_ms_per_call", "run_s"])
        w.writerows(rows)
    with open(os.path.join(out, "episodes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "timesteps", "episode_return"])
        for r in results:
            w.writerows((r["label"], s, ret) for s, ret in r["episodes"])
    returns_plot(os.path.join(out, "returns.png"), {r["label"]: r["episodes"] for r in results}, title, "timesteps")
    print(f"wrote {out}/timings.csv, episodes.csv and returns.png")


def main(doc, make_model, timesteps, n_envs, n_steps, out, title, needs=()):
    """Parse the command line of the script whose docstring is ``doc``, check that
    gymnasium, SB3, matplotlib and ``needs`` are installed, and train and report."""
    args = parse_args(doc, timesteps, n_envs, out)
    require("gymnasium", "stable_baselines3", "matplotlib", *needs)
    ways = gae_ways()
    warm_up(ways, n_steps, args.n_envs)
    variants = [False, True] if args.compare else [args.patch]
    results = [run(lambda: make_model(args), ways, args.timesteps, patch, "rl_triton" if patch else "SB3 loop")
               for patch in variants]
    report(results, args.out, title)
