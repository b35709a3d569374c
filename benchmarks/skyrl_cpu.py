"""CPU timing of SkyRL's advantage estimators (skyrl 0.3.0,
``skyrl.backends.skyrl_train.utils.ppo_utils``): SkyRL's own functions against rl_triton's
drop-ins (``rl_triton.integrations.skyrl``), in one process.

The input is a batch of responses as SkyRL's trainer hands it over: ``[responses, tokens]``
float32 token-level rewards (the outcome score on the last response token, small per-token
terms elsewhere) and values, a 0/1 float32 response mask that pads each response on the right
at a random length, and one prompt id per group of 8 responses; gamma=1.0, lambd=0.95 (GAE),
gamma=1.0 (REINFORCE++). Each drop-in is first checked against SkyRL's function on that input
(float32, 1e-5; the script exits 1 on a disagreement), then the two take turns in --rounds
rounds (benchmarks/common.py): each cell is the median time per call over the rounds with the
lowest-highest round, and the speed-ups are taken within each round. numba's and torch's thread
counts are the machine's unless --threads is given. Needs SkyRL (``pip install -e
".[cpu,skyrl]"``).

    python benchmarks/skyrl_cpu.py --threads 2                   # 64 x 2048 and 16 x 16384 tokens
    python benchmarks/skyrl_cpu.py --shapes 8x512 --rounds 3 --estimators gae
    python benchmarks/skyrl_cpu.py --device cuda                 # the tensors on the GPU (Triton)
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import alternate, machine, pair_cells, parser, set_threads, synced  # noqa: E402

GAMMA, LAMBDA, GROUP = 1.0, 0.95, 8
# SkyRL's registry name -> the keyword arguments its function takes beyond rewards and mask
ESTIMATORS = {"gae": ("values", "gamma", "lambd"), "grpo": ("index",), "rloo": ("index",),
              "reinforce++": ("gamma",)}


def make_batch(responses: int, tokens: int, seed: int = 0, device: str = "cpu") -> dict:
    """All keyword arguments any estimator takes, for ``responses`` x ``tokens``, the tensors on
    ``device``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(tokens // 4, tokens + 1, (responses,), generator=g)
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).float()
    rewards = 0.01 * torch.randn(responses, tokens, generator=g) * mask
    rewards[torch.arange(responses), lengths - 1] += (torch.rand(responses, generator=g) < 0.5).float()
    values = torch.randn(responses, tokens, generator=g) * mask
    index = np.array([f"prompt-{i // GROUP}" for i in range(responses)], dtype=object)
    return dict(token_level_rewards=rewards.to(device), response_mask=mask.to(device), values=values.to(device),
                index=index, gamma=GAMMA, lambd=LAMBDA)


def call(fn, name: str, batch: dict):
    """``fn`` on ``batch``'s arguments for estimator ``name`` (SkyRL's functions write into the
    rewards' row sums, never into the rewards; a fresh reference is enough)."""
    kwargs = {k: batch[k] for k in ("token_level_rewards", "response_mask", *ESTIMATORS[name])}
    return fn(**kwargs)


def run(shapes, estimators, rounds: int = 9, device: str = "cpu") -> list[dict]:
    """One row per (shape, estimator): whether the drop-in agreed with SkyRL and, where it did,
    the seconds per call of both in each round."""
    import torch

    import rl_triton.integrations.skyrl as rt_skyrl
    from rl_triton.testing.frameworks import skyrl_ppo_utils

    ppo_utils = skyrl_ppo_utils()
    if rt_skyrl.is_patched():
        raise RuntimeError("SkyRL is patched: unpatch() before timing its own functions")
    rows = []
    for responses, tokens in shapes:
        batch = make_batch(responses, tokens, device=device)
        for name in estimators:
            theirs = getattr(ppo_utils, rt_skyrl.ESTIMATORS[name])
            ours = getattr(rt_skyrl, rt_skyrl.ESTIMATORS[name])
            agree = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5)
                        for a, b in zip(call(theirs, name, batch), call(ours, name, batch)))
            row = {"shape": f"{responses} x {tokens}", "estimator": name, "agree": agree}
            if agree:
                row["times"] = alternate({"skyrl": synced(lambda: call(theirs, name, batch), device),
                                          "rl_triton": synced(lambda: call(ours, name, batch), device)},
                                         rounds=rounds)
            rows.append(row)
    return rows


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--shapes", default="64x2048,16x16384", help="responses x tokens, comma-separated")
    p.add_argument("--estimators", default=",".join(ESTIMATORS), help="SkyRL registry names, comma-separated")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--threads", type=int, default=None, help="numba's and torch's threads (default: theirs)")
    p.add_argument("--device", default="cpu", help="where the tensors are (cuda: both sides on the GPU)")
    a = p.parse_args()
    import torch

    set_threads(a.threads)
    import numba

    shapes = [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")]
    estimators = a.estimators.split(",")
    unknown = sorted(set(estimators) - set(ESTIMATORS))
    if unknown:
        p.error(f"--estimators: unknown {unknown}; known: {sorted(ESTIMATORS)}")
    print(f"{machine()}; numba threads {numba.get_num_threads()}; torch {torch.__version__}; "
          f"ms per call, median (lowest-highest) of {a.rounds} rounds")
    print("| shape | estimator | SkyRL | rl_triton | speed-up |")
    print("|---|---|---:|---:|---:|")
    failed = False
    for row in run(shapes, estimators, a.rounds, a.device):
        if not row["agree"]:
            print(f"disagreement at {row['shape']}, {row['estimator']}: rl_triton's result is not SkyRL's")
            failed = True
            continue
        print(f"| {row['shape']} | {row['estimator']} | {pair_cells(row['times'], 'skyrl', 'rl_triton')} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
