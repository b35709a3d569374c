"""skrl's and rl_games' GAE step against rl_triton's drop-ins, side by side in one process.

Time-major rollouts ``[T, N, K]`` as the IsaacLab configurations make them (float32, 1% of the
steps terminated and 0.5% truncated), gamma=0.99, lambda=0.95. Full calls, timed on the host
(with a device synchronisation after each call on CUDA):

- skrl: ``compute_gae`` (skrl's loop and its normalisation of the advantages) against
  ``rl_triton.integrations.skrl.compute_gae`` (one GAE call with the normalisation fused);
- rl_games, the step: ``A2CBase.discount_values``, the returns ``advantages + values`` and the
  normalisation rl_games' ``prepare_dataset`` applies to them (value heads summed, mean/std over
  the batch), with rl_games' method and with ``rl_triton.integrations.rl_games.discount_values``
  (rl_games normalises in another method, so that part is rl_games' code on both sides);
- rl_games, ``discount_values`` alone.

The frameworks' functions are the installed packages' where they import, else the transcriptions
in rl_triton/testing/sim_frameworks.py (skrl 2.1.1, rl-games 1.6.5); the header says which.
Every cell is checked first against the framework's function on float64 copies of the inputs:
the script exits with status 1 where rl_triton errs or disagrees (--atol). Cells: median time per
call over --rounds rounds (lowest-highest round); the speed-up is taken within each round.

    python benchmarks/skrl_rl_games.py                          # CPU (numba)
    python benchmarks/skrl_rl_games.py --device cuda            # the GPU, the IsaacLab shapes
    python benchmarks/skrl_rl_games.py --shapes 24x4096x4       # four value heads
    python benchmarks/skrl_rl_games.py --threads 1              # a CPU shared with other work
"""

from __future__ import annotations

import os
import sys
import types

import torch

sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rl_triton.integrations.rl_games as rt_rl_games  # noqa: E402
import rl_triton.integrations.skrl as rt_skrl  # noqa: E402
from rl_triton.testing import sim_frameworks  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import alternate, machine, parser, ratios, set_threads, spread  # noqa: E402

GAMMA, LAM = 0.99, 0.95


def frameworks():
    """(skrl's compute_gae, rl_games' discount_values, where each comes from)."""
    try:
        from skrl.agents.torch.ppo.ppo import compute_gae as skrl_gae
        skrl_from = "skrl " + __import__("skrl").__version__
    except ImportError:
        skrl_gae, skrl_from = sim_frameworks.skrl_compute_gae, "skrl 2.1.1 transcribed"
    try:
        from rl_games.common.a2c_common import A2CBase
        discount = A2CBase.__dict__["discount_values"]
        rl_games_from = "rl_games (installed)"
    except ImportError:
        discount, rl_games_from = sim_frameworks.rl_games_discount_values, "rl-games 1.6.5 transcribed"
    return skrl_gae, discount, f"{skrl_from}, {rl_games_from}"


def rollout(T, N, K, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(T, N, K, generator=g), torch.randn(T, N, K, generator=g)
    last_values = torch.randn(N, K, generator=g)
    terminated = torch.rand(T, N, 1, generator=g) < 0.01
    truncated = (torch.rand(T, N, 1, generator=g) < 0.005) & ~terminated
    skrl_kw = dict(rewards=rewards, terminated=terminated, truncated=truncated, values=values,
                   last_values=last_values, discount_factor=GAMMA, lambda_coefficient=LAM, time_limit_bootstrap=False)
    # rl_games: the done flag stored with each observation (the previous step's), and the live one
    done = (terminated | truncated)[..., 0].float()
    rl_games_args = (done[-1], last_values, torch.cat([torch.ones(1, N), done[:-1]]), values, rewards)
    on = lambda x: x.to(device)  # noqa: E731
    return {k: (on(v) if isinstance(v, torch.Tensor) else v) for k, v in skrl_kw.items()}, tuple(map(on, rl_games_args))


def _float64(x):
    return x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--device", default="cpu", help="cpu (numba) or cuda (Triton)")
    p.add_argument("--shapes", default="24x4096x1,24x16384x1,64x4096x1", help="T x N x K list (K: value heads)")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--atol", type=float, default=1e-4, help="largest difference from the float64 reference")
    p.add_argument("--threads", type=int, default=0,
                   help="torch's and numba's CPU threads (0: their defaults); 1 on a machine whose cores are busy")
    a = p.parse_args()
    set_threads(a.threads)
    skrl_gae, discount, source = frameworks()
    device = torch.device(a.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else machine()
    print(f"{where}; torch {torch.__version__}; {source}; us per call, median (lowest-highest) of "
          f"{a.rounds} rounds")
    print("| step | T x N x K | framework's loop | rl_triton | speed-up | largest difference from float64 |")
    print("|---|---|---:|---:|---:|---:|")
    failed = False
    for shape in a.shapes.split(","):
        T, N, K = map(int, shape.split("x"))
        skrl_kw, args = rollout(T, N, K, device)
        agent = types.SimpleNamespace(horizon_length=T, gamma=GAMMA, tau=LAM)

        def rl_games_step(method):
            def step():
                adv = method(agent, *args)
                returns = adv + args[3]
                return sim_frameworks.rl_games_normalized_advantages(returns.flatten(0, 1), args[3].flatten(0, 1))
            return step

        cells = [
            ("skrl compute_gae", lambda: skrl_gae(**skrl_kw), lambda: rt_skrl.compute_gae(**skrl_kw),
             lambda: skrl_gae(**{k: _float64(v) for k, v in skrl_kw.items()})),
            ("rl_games discount_values + normalisation", rl_games_step(discount),
             rl_games_step(rt_rl_games.discount_values), None),
            ("rl_games discount_values", lambda: discount(agent, *args), lambda: rt_rl_games.discount_values(agent, *args),
             lambda: discount(agent, *map(_float64, args))),
        ]
        for name, theirs, ours, reference in cells:
            try:
                got = ours()
            except Exception as error:  # a cell rl_triton cannot run fails the benchmark
                print(f"| {name} | {shape} | | error: {type(error).__name__}: {error} | | |", flush=True)
                failed = True
                continue
            if reference is None:  # the step: against the float64 step of rl_games' own method
                args64 = tuple(map(_float64, args))
                adv64 = discount(agent, *args64)
                ref = sim_frameworks.rl_games_normalized_advantages((adv64 + args64[3]).flatten(0, 1),
                                                                     args64[3].flatten(0, 1))
            else:
                ref = reference()
            got, ref = (got if isinstance(got, tuple) else (got,)), (ref if isinstance(ref, tuple) else (ref,))
            err = max((x.double() - y).abs().max().item() for x, y in zip(got, ref))
            bad = not err <= a.atol
            failed |= bad

            def timed(fn):
                return lambda: (fn(), sync())

            times = alternate({"theirs": timed(theirs), "ours": timed(ours)}, rounds=a.rounds)
            print(f"| {name} | {shape} | {spread([1e6 * t for t in times['theirs']], '{:.0f}')} | "
                  f"{spread([1e6 * t for t in times['ours']], '{:.0f}')} | "
                  f"{spread(ratios(times['theirs'], times['ours']), unit='x')} | "
                  f"{err:.1e}{' FAILS' if bad else ''} |", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
