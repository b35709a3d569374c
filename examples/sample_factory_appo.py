"""APPO with Sample Factory (2.1.1) on a gymnasium environment (CartPole-v1), its GAE either
Sample Factory's scripted loop or rl_triton's fused scan (``rl_triton.integrations.sample_factory
.patch()``).

Install (from the repository root, after torch; see the README). Sample Factory pins numpy < 2
and gymnasium < 1, so it goes in an environment of its own:

    pip install -e ".[cpu,sample-factory]" matplotlib tqdm

Run:

    python examples/sample_factory_appo.py              # rl_triton's GAE (--fast)
    python examples/sample_factory_appo.py --no-fast    # Sample Factory's own loop
    python examples/sample_factory_appo.py --compare    # both, one after the other, same seed

Sample Factory runs in its serial mode (``serial_mode=True, async_rl=False``: the rollout, the
batcher and the learner in this process, so that the patch made here is the learner's; in the
default multi-process mode call ``patch()`` where the learner process starts, e.g. in the
module that registers the environment). GAE, not V-trace (``with_vtrace=False``, APPO's
default): Sample Factory's V-trace is a block inside its learner that the patch does not
replace (docs/sample_factory.md). Prints the median time of the learner's GAE call and the
median time per training batch, and writes batches.csv and returns.png (mean episode return
and GAE time per training batch) under --out. The default budget finishes in about a minute on
2 CPU cores.
"""

from __future__ import annotations

import csv
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import parser, progress, require, two_panels  # noqa: E402



def quiet_sample_factory() -> None:
    """Errors only from Sample Factory's logger "rl" (it logs every step of its runner). Set after
    its import, which sets the level, and at this module's import: the process Sample Factory
    starts to read the environment's spaces imports this module again."""
    try:
        import sample_factory.utils.utils  # noqa: F401
    except ImportError:
        return
    logging.getLogger("rl").setLevel(logging.ERROR)


quiet_sample_factory()
# the wrapper below is read through by Sample Factory's attribute lookups, which gymnasium 0.29 flags
warnings.filterwarnings("ignore", message=".*to get variables from other wrappers is deprecated")

ENV = "CartPole-v1"
INSTALL = "pip install -e '.[cpu,sample-factory]' matplotlib tqdm"


def parse_args():
    p = parser(__doc__)
    p.add_argument("--env-steps", type=int, default=100_000, help="environment steps to train for")
    p.add_argument("--num-envs", type=int, default=16, help="environments of the one rollout worker")
    p.add_argument("--rollout", type=int, default=32, help="steps per trajectory (Sample Factory's rollout)")
    p.add_argument("--batch-size", type=int, default=1024, help="samples per training batch")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments and torch")
    p.add_argument("--out", default="runs/sample_factory_appo", help="folder for the CSV and PNG outputs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fast", action=__import__("argparse").BooleanOptionalAction, default=True,
                   help="rl_triton's GAE through patch() (--no-fast: Sample Factory's loop)")
    g.add_argument("--compare", action="store_true", help="Sample Factory's loop, then rl_triton's")
    return p.parse_args()


class EpisodeReturns:
    """The returns of the episodes finished since the last ``take()``, from every environment
    made in this process (serial mode)."""

    finished: list = []

    @classmethod
    def take(cls) -> list:
        done, cls.finished = cls.finished, []
        return done


def make_env(full_env_name, cfg=None, env_config=None, render_mode=None):
    import gymnasium as gym

    class Recorded(gym.Wrapper):
        def reset(self, **kwargs):
            self.ret = 0.0
            return self.env.reset(**kwargs)

        def step(self, action):
            obs, reward, terminated, truncated, info = self.env.step(action)
            self.ret += float(reward)
            if terminated or truncated:
                EpisodeReturns.finished.append(self.ret)
            return obs, reward, terminated, truncated, info

    return Recorded(gym.make(full_env_name, render_mode=render_mode))


def sf_config(args, train_dir: str, experiment: str):
    from sample_factory.cfg.arguments import parse_full_cfg, parse_sf_args

    argv = [f"--env={ENV}", f"--experiment={experiment}", f"--train_dir={train_dir}", "--algo=APPO",
            "--serial_mode=True", "--async_rl=False", "--num_workers=1", f"--num_envs_per_worker={args.num_envs}",
            "--worker_num_splits=1", f"--rollout={args.rollout}", "--recurrence=1", "--use_rnn=False",
            "--with_vtrace=False", f"--batch_size={args.batch_size}", "--num_batches_per_epoch=1", "--num_epochs=1",
            f"--train_for_env_steps={args.env_steps}", f"--seed={args.seed}", "--device=cpu",
            "--reward_scale=0.1", "--save_every_sec=100000", "--save_best_every_sec=100000",
            "--keep_checkpoints=1", "--experiment_summaries_interval=100000", "--with_wandb=False",
            "--decorrelate_envs_on_one_worker=False"]
    sf_parser, _ = parse_sf_args(argv=argv)
    return parse_full_cfg(sf_parser, argv)


def train(args, fast: bool, label: str, train_dir: str):
    """One run: per training batch its env steps, the GAE call's time, the batch's time and the
    mean return of the episodes finished since the batch before."""
    import torch
    from sample_factory.algo.learning import learner
    from sample_factory.envs.env_utils import register_env
    from sample_factory.train import run_rl

    import rl_triton.integrations.sample_factory as rt_sf

    torch.manual_seed(args.seed)
    register_env(ENV, make_env)
    cfg = sf_config(args, train_dir, label)
    rows = []
    bar = progress(args.env_steps, label, unit="step")
    last = [time.perf_counter()]

    def timed(gae):
        def call(rewards, dones, values, valids, gamma, gae_lambda):
            t0 = time.perf_counter()
            adv = gae(rewards, dones, values, valids, gamma, gae_lambda)
            gae_ms = 1e3 * (time.perf_counter() - t0)
            now = time.perf_counter()
            finished = EpisodeReturns.take()
            steps = (len(rows) + 1) * args.batch_size
            rows.append((label, len(rows), steps, gae_ms, now - last[0],
                         statistics.fmean(finished) if finished else float("nan")))
            last[0] = now
            if bar is not None:
                bar.set_postfix(mean_return=f"{rows[-1][5]:.1f}", refresh=False)
                bar.update(min(args.batch_size, args.env_steps - bar.n))
            return adv

        return call

    EpisodeReturns.take()
    with rt_sf.patched() if fast else _unpatched():
        looked_up = learner.gae_advantages  # the learner's name: rl_triton's while patched
        learner.gae_advantages = timed(looked_up)
        try:
            status = run_rl(cfg)
        finally:
            learner.gae_advantages = looked_up
    if bar is not None:
        bar.close()
    print(f"{label}: GAE {looked_up.__module__}.{looked_up.__name__}, {len(rows)} training batches of "
          f"{args.batch_size}, status {status}")
    return rows


class _unpatched:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def report(results: dict, out: str):
    os.makedirs(out, exist_ok=True)
    labels = list(results)
    # the first batch compiles (TorchScript, numba) and warms up: left out of the medians
    med = {label: [statistics.median(r[i] for r in results[label][1:] or results[label]) for i in (3, 4)]
           for label in labels}
    print(f"\nSample Factory APPO, {ENV}: medians")
    print("| | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(labels))
    print("| GAE call (ms) | " + " | ".join(f"{med[label][0]:.3f}" for label in labels) + " |")
    print("| training batch (s) | " + " | ".join(f"{med[label][1]:.3f}" for label in labels) + " |")
    with open(os.path.join(out, "batches.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "batch", "env_steps", "gae_ms", "batch_s", "mean_episode_return"])
        for label in labels:
            w.writerows(results[label])
    two_panels(os.path.join(out, "returns.png"),
               ((label, ([r[2] for r in results[label]], [r[5] for r in results[label]]),
                 ([r[2] for r in results[label]], [r[3] for r in results[label]])) for label in labels),
               dict(xlabel="environment steps", ylabel="mean episode return", title=f"Sample Factory APPO, {ENV}"),
               dict(xlabel="environment steps", ylabel="GAE call (ms)", title="the learner's GAE call",
                    yscale="log"))
    print(f"wrote {out}/batches.csv and returns.png")


def main():
    args = parse_args()
    require("sample_factory", "gymnasium", "matplotlib", install=INSTALL)
    runs = [(False, "sample_factory"), (True, "rl_triton")] if args.compare else [
        (args.fast, "rl_triton" if args.fast else "sample_factory")]
    with tempfile.TemporaryDirectory() as train_dir:
        results = {label: train(args, fast, label, train_dir) for fast, label in runs}
    report(results, args.out)


if __name__ == "__main__":
    main()
