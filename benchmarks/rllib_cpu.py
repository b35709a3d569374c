"""CPU timing of RLlib's PPO GAE step: RLlib's ``compute_value_targets`` against rl_triton's drop-in
(numpy in, numpy out, as the GAE connector calls it) and against the device-resident path of
rl_triton's connector (targets, advantages and RLlib's standardisation on the tensors).

The input is RLlib's flat batch (ray 2.60, the rllib extra): episode chunks of 1-400 steps,
each followed by the extra timestep ``AddOneTsToEpisodesAndTruncate`` appends, the last real
step terminated or truncated; float32 values and rewards, bool flags; gamma=0.99,
lambda_=0.95. Each implementation is checked against RLlib's first (the script exits 1 on a
disagreement), then they take turns in --rounds rounds (benchmarks/common.py); each cell is the
median time per call over the rounds with the lowest-highest round, and the speed-ups are taken
within each round.

Columns: RLlib's ``compute_value_targets``; rl_triton's (the same contract); RLlib's whole numpy
step (its targets, advantages = targets - values, (A - mean) / max(1e-4, std), as in
general_advantage_estimation.py); rl_triton's connector step on torch tensors (one GAE scan, the
standardisation in place, no numpy).

    python benchmarks/rllib_cpu.py                       # 4000, 32768 and 131072 steps
    python benchmarks/rllib_cpu.py --steps 4000 --rounds 15
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from ray.rllib.utils.postprocessing.value_predictions import compute_value_targets as rllib_targets  # noqa: E402

import rl_triton.integrations.rllib as rt_rllib  # noqa: E402
from common import alternate, machine, parser, ratios, spread  # noqa: E402
from rllib_gpu import GAMMA, LAMBDA, flat_batch  # noqa: E402


def rllib_step(values, rewards, term, trunc):
    targets = rllib_targets(values, rewards, term, trunc, GAMMA, LAMBDA)
    adv = targets - values
    return (adv - adv.mean()) / max(1e-4, adv.std()), targets


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--steps", default="4000,32768,131072", help="batch lengths")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--threads", type=int, default=None,
                   help="torch's intra-op threads (default: torch's own; a Ray actor runs with OMP_NUM_THREADS "
                        "set from its CPUs)")
    a = p.parse_args()
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    print(f"{machine()}; torch {torch.__version__}; torch threads {torch.get_num_threads()}; "
          f"ms per call, median (lowest-highest) of {a.rounds} rounds")
    print("| steps | RLlib compute_value_targets | rl_triton compute_value_targets | speed-up | RLlib numpy step "
          "| rl_triton connector step | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for n in map(int, a.steps.split(",")):
        values, rewards, term, trunc = flat_batch(n, rng)
        tensors = [torch.from_numpy(x) for x in (values, rewards, term, trunc)]
        ref_targets = rllib_targets(values, rewards, term, trunc, GAMMA, LAMBDA)
        ref_adv, _ = rllib_step(values, rewards, term, trunc)
        ours = rt_rllib.compute_value_targets(values, rewards, term, trunc, GAMMA, LAMBDA)
        adv, targets = rt_rllib._targets_and_advantages(*tensors, GAMMA, LAMBDA)
        ulps = int(np.max(np.abs(ours.view(np.int32).astype(np.int64) - ref_targets.view(np.int32))))
        err = max(float(np.max(np.abs(adv.numpy() - ref_adv))), float(np.max(np.abs(targets.numpy() - ref_targets))))
        if ulps > 1 or err > 1e-4:
            print(f"disagreement at {n} steps: compute_value_targets {ulps} ulp, connector step {err:.1e}")
            failed = True
            continue
        times = alternate({
            "rllib": lambda: rllib_targets(values, rewards, term, trunc, GAMMA, LAMBDA),
            "ours": lambda: rt_rllib.compute_value_targets(values, rewards, term, trunc, GAMMA, LAMBDA),
            "rllib step": lambda: rllib_step(values, rewards, term, trunc),
            "ours step": lambda: rt_rllib._targets_and_advantages(*tensors, GAMMA, LAMBDA),
        }, rounds=a.rounds)
        ms = {k: spread([1e3 * t for t in v], "{:.3f}") for k, v in times.items()}
        print(f"| {n} | {ms['rllib']} | {ms['ours']} (max {ulps} ulp) | "
              f"{spread(ratios(times['rllib'], times['ours']), unit='x')} | {ms['rllib step']} | "
              f"{ms['ours step']} (err {err:.0e}) | "
              f"{spread(ratios(times['rllib step'], times['ours step']), unit='x')} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
