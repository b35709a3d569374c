"""PPO and APPO on CartPole-v1 with Ray RLlib (new API stack, torch, CPU), their GAE and
V-trace either RLlib's own or rl_triton's (rl_triton.integrations.rllib, through the Learner
classes that config.learners(learner_class=...) takes).

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"
    pip install -e ".[rllib]" torch==2.13.0     # ray[rllib]==2.60.*

Run:

    python examples/rllib_ppo_appo.py                     # rl_triton's GAE and V-trace
    python examples/rllib_ppo_appo.py --no-fast           # RLlib's
    python examples/rllib_ppo_appo.py --compare           # both, the same seed, side by side
    python examples/rllib_ppo_appo.py --num-learners 1    # the Learner in its own Ray actor
    python examples/rllib_ppo_appo.py --algo ppo --train-batch-size 32000 --compare

Each training iteration's time spent in the GAE connector (PPO: the value-function forward pass,
the targets, the advantages and their standardisation) or in V-trace (APPO: every minibatch's
call), measured inside the Learner process, is printed with the iteration's wall time and its
share of it. Writes iterations.csv (per iteration: episode return mean, env steps, seconds in
the iteration and in GAE / V-trace) and returns.png under --out.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import parser, progress, require, two_panels  # noqa: E402

ENV = "CartPole-v1"
RLLIB_INSTALL = "pip install -e '.[rllib]' torch==2.13.0"


def parse_args():
    p = parser(__doc__)
    p.add_argument("--algo", choices=["ppo", "appo", "both"], default="both", help="which algorithm(s) to train")
    p.add_argument("--iterations", type=int, default=10, help="training iterations per run")
    p.add_argument("--train-batch-size", type=int, default=4000, help="env steps per training batch")
    p.add_argument("--num-learners", type=int, default=0, help="0: the Learner in this process; 1: in a Ray actor")
    p.add_argument("--seed", type=int, default=0, help="seed of the environments and networks (every run)")
    p.add_argument("--out", default="runs/rllib_ppo_appo", help="folder for the CSV and PNG outputs")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                   help="rl_triton's GAE connector and V-trace (--no-fast: RLlib's)")
    g.add_argument("--compare", action="store_true", help="RLlib's, then rl_triton's")
    return p.parse_args()


# -- timing inside the Learner process ---------------------------------------------------------
_times: list = []  # seconds of each GAE / V-trace call since the last read, in this process


def _timed_connector(cls):
    """A subclass of the GAE connector class ``cls`` (RLlib's or rl_triton's) that records the
    time of each call (same class name, so the pipeline finds it by name)."""

    class Timed(cls):
        def __call__(self, **kwargs):
            t0 = time.perf_counter()
            try:
                return super().__call__(**kwargs)
            finally:
                _times.append(time.perf_counter() - t0)

    Timed.__name__ = Timed.__qualname__ = cls.__name__
    return Timed


def _timed_vtrace(fn):
    def vtrace_torch(**kwargs):
        t0 = time.perf_counter()
        try:
            return fn(**kwargs)
        finally:
            _times.append(time.perf_counter() - t0)

    vtrace_torch.untimed = fn
    return vtrace_torch


def learner_class(algo: str, fast: bool):
    """The Learner class of one run: rl_triton's (fast) or RLlib's, with the timers."""
    import rl_triton.integrations.rllib as rt_rllib

    if algo == "ppo":
        from ray.rllib.algorithms.ppo.torch.ppo_torch_learner import PPOTorchLearner
        from ray.rllib.connectors.learner import GeneralAdvantageEstimation

        base = rt_rllib.PPOTorchLearner if fast else PPOTorchLearner

        class Timed(base):
            def build(self):
                super().build()  # rl_triton's class has put its connector in by now
                pieces = self._learner_connector.connectors
                for i, piece in enumerate(pieces):
                    if isinstance(piece, GeneralAdvantageEstimation):
                        pieces[i] = _timed_connector(type(piece))(
                            piece.input_observation_space, piece.input_action_space,
                            gamma=piece.gamma, lambda_=piece.lambda_)
    else:
        from ray.rllib.algorithms.appo.torch.appo_torch_learner import APPOTorchLearner

        base = rt_rllib.APPOTorchLearner if fast else APPOTorchLearner

        class Timed(base):
            def build(self):
                super().build()
                # the globals the loss finds vtrace_torch in: RLlib's module, or rl_triton's copy
                names = base.compute_loss_for_module.__globals__
                if not hasattr(names["vtrace_torch"], "untimed"):
                    names["vtrace_torch"] = _timed_vtrace(names["vtrace_torch"])

    def read_times(self):
        """(seconds in GAE / V-trace since the last read, the class's fused-path call counts)."""
        total = sum(_times)
        _times.clear()
        return total, rt_rllib.call_counts()

    Timed.read_times = read_times
    Timed.__name__ = Timed.__qualname__ = f"Timed{base.__name__}"
    return Timed


def _untime_vtrace():
    """The local Learner's timer off RLlib's and rl_triton's V-trace globals again."""
    import rl_triton.integrations.rllib as rt_rllib
    from ray.rllib.algorithms.appo.torch import appo_torch_learner

    for names in (vars(appo_torch_learner), rt_rllib.APPOTorchLearner.compute_loss_for_module.__globals__):
        names["vtrace_torch"] = getattr(names["vtrace_torch"], "untimed", names["vtrace_torch"])


def make_config(algo: str, args, fast: bool):
    if algo == "ppo":
        from ray.rllib.algorithms.ppo import PPOConfig

        config = PPOConfig().training(train_batch_size=args.train_batch_size, minibatch_size=128, num_epochs=5,
                                      lr=3e-4)
    else:
        from ray.rllib.algorithms.appo import APPOConfig

        config = APPOConfig().training(train_batch_size_per_learner=args.train_batch_size, lr=5e-4)
        config = config.reporting(min_time_s_per_iteration=0, min_sample_timesteps_per_iteration=args.train_batch_size)
    return (config.environment(ENV).env_runners(num_env_runners=0)
            .learners(num_learners=args.num_learners, learner_class=learner_class(algo, fast))
            .debugging(seed=args.seed))


def train(algo: str, args, fast: bool, label: str):
    """One run; per iteration: (env steps, episode return mean, iteration s, GAE / V-trace s)."""
    config = make_config(algo, args, fast)
    built = config.build_algo()
    rows = []
    counts = {}
    bar = progress(args.iterations, f"{algo.upper()} {label}", unit="iteration")
    try:
        for _ in range(args.iterations):
            result = built.train()
            reads = [r.get() for r in built.learner_group.foreach_learner(lambda learner: learner.read_times())]
            runners = result["env_runners"]
            rows.append((runners.get("num_env_steps_sampled_lifetime", 0),
                         runners.get("episode_return_mean", float("nan")), result["time_this_iter_s"],
                         sum(r[0] for r in reads)))
            counts = reads[0][1]
            if bar is not None:
                bar.set_postfix(return_mean=f"{rows[-1][1]:.1f}", refresh=False)
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
        built.stop()
        _untime_vtrace()
    fused = counts["connector"] if algo == "ppo" else counts["vtrace_torch"]
    print(f"{algo.upper()} {label}: {len(rows)} iterations, rl_triton fused calls in the Learner: {fused}")
    return rows


def report(results, out: str):
    os.makedirs(out, exist_ok=True)
    print("\nmedian per training iteration (after the first, which compiles)")
    print("| run | iteration s | in GAE / V-trace s | share | last return mean |")
    print("|---|---:|---:|---:|---:|")
    for (algo, label), rows in results.items():
        steady = rows[1:] or rows
        it, part = statistics.median(r[2] for r in steady), statistics.median(r[3] for r in steady)
        print(f"| {algo.upper()} {label} | {it:.3f} | {part:.4f} | {100 * part / it:.1f}% | {rows[-1][1]:.1f} |")
    with open(os.path.join(out, "iterations.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["algo", "run", "iteration", "env_steps", "episode_return_mean", "iteration_s", "gae_or_vtrace_s"])
        for (algo, label), rows in results.items():
            w.writerows([algo, label, i + 1, *row] for i, row in enumerate(rows))
    two_panels(os.path.join(out, "returns.png"),
               ((f"{algo.upper()} {label}", ([r[0] for r in rows], [r[1] for r in rows]),
                 (range(1, len(rows) + 1), [1e3 * r[3] for r in rows])) for (algo, label), rows in results.items()),
               dict(xlabel="env steps", ylabel="episode return mean", title=f"RLlib on {ENV}"),
               dict(xlabel="iteration", ylabel="ms in GAE (PPO) / V-trace (APPO)", yscale="log", title="per iteration"))
    print(f"wrote {out}/iterations.csv and returns.png")


def main():
    args = parse_args()
    require("matplotlib", "gymnasium")
    require("ray", install=RLLIB_INSTALL)
    import logging
    import warnings

    import ray

    # RLlib's notices (new API stack, deprecations, GPU monitoring) left out of the progress log
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    ray.init(include_dashboard=False, log_to_driver=False, num_cpus=max(2, args.num_learners + 1),
             logging_level=logging.ERROR)
    logging.getLogger("ray").setLevel(logging.ERROR)
    try:
        algos = ["ppo", "appo"] if args.algo == "both" else [args.algo]
        variants = [(False, "RLlib"), (True, "rl_triton")] if args.compare else [
            (args.fast, "rl_triton" if args.fast else "RLlib")]
        results = {(algo, label): train(algo, args, fast, label) for algo in algos for fast, label in variants}
    finally:
        ray.shutdown()
    report(results, args.out)


if __name__ == "__main__":
    main()
