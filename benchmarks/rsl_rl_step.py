"""rsl_rl's GAE step against rl_triton's, side by side: the loop of ``PPO.compute_returns``
(rsl-rl-lib 5.5.1, rsl_rl/algorithms/ppo.py, transcribed below so that the script needs no
rsl_rl) alone and followed by its normalisation ``(A - A.mean()) / (A.std() + 1e-8)``, against
``rt.gae(time_dim=0)`` and the call ``rl_triton.integrations.rsl_rl`` makes
(``rt.gae(..., whiten=dict(eps_mode="std"), out=(advantages, returns))``).

Time-major ``[T, N, 1]`` float32, uint8 dones (5%), gamma 0.99, lambda 0.95. Each cell is
checked against the loop first (the script exits 1 on a disagreement or an error), then the two
take turns in --rounds rounds (benchmarks/common.py); a cell is the median time per call over
the rounds with the lowest-highest round, and the speed-up is taken within each round. On CUDA
every call ends with a synchronisation (both sides pay it).

    python benchmarks/rsl_rl_step.py                          # this machine's device
    python benchmarks/rsl_rl_step.py --device cpu --shapes 16x4096,24x16384
    python benchmarks/rsl_rl_step.py --batch-major            # rt.gae on batch-major [N, T] alone
    python benchmarks/rsl_rl_step.py --batch-major --root ../main   # the same with another checkout

``--batch-major`` times ``rt.gae`` alone on batch-major shapes (dones, implied next values), to
compare two checkouts back to back (``--root``).
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import alternate, machine, parser, ratios, spread  # noqa: E402

CPU_SHAPES = "16x4096,24x4096,24x16384,32x16384"
CUDA_SHAPES = "24x4096,24x16384,64x4096"
BATCH_MAJOR_SHAPES = "8x2048,64x512,1024x128,4096x24"
GAMMA, LAM = 0.99, 0.95


def rsl_rl_loop(rewards, values, dones, last_values, returns, gamma=GAMMA, lam=LAM, normalize=True):
    """rsl-rl-lib 5.5.1, rsl_rl/algorithms/ppo.py, PPO.compute_returns after the bootstrap pass
    (transcribed): returns written in place, the advantages returned."""
    advantage = 0
    T = rewards.shape[0]
    for step in reversed(range(T)):
        next_values = last_values if step == T - 1 else values[step + 1]
        next_is_not_terminal = 1.0 - dones[step].float()
        delta = rewards[step] + next_is_not_terminal * gamma * next_values - values[step]
        advantage = delta + next_is_not_terminal * gamma * lam * advantage
        returns[step] = advantage + values[step]
    advantages = returns - values
    if normalize:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    return advantages


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--device", default=None, help="cpu or cuda (None: cuda where available)")
    p.add_argument("--shapes", default=None, help=f"T x N list (None: {CPU_SHAPES} on cpu, {CUDA_SHAPES} on cuda; "
                   f"with --batch-major N x T, {BATCH_MAJOR_SHAPES})")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--batch-major", action="store_true", help="rt.gae alone on batch-major shapes")
    p.add_argument("--root", default=None, help="a checkout whose rl_triton to import (None: this one)")
    a = p.parse_args()
    sys.path.insert(0, a.root or os.path.dirname(HERE))
    import torch

    import rl_triton as rt

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    shapes = a.shapes or (BATCH_MAJOR_SHAPES if a.batch_major else CUDA_SHAPES if cuda else CPU_SHAPES)
    print(f"{machine()}; torch {torch.__version__}; rl_triton from {os.path.dirname(rt.__file__)}; device {device}; "
          f"us per call, median (lowest-highest) of {a.rounds} rounds")

    def synced(fn):
        return (lambda: (fn(), torch.cuda.synchronize(device))) if cuda else fn

    g = torch.Generator().manual_seed(0)
    failed = False
    if a.batch_major:
        print("\n| shape [N, T] | rt.gae |\n|---|---:|")
        for shape in shapes.split(","):
            N, T = (int(x) for x in shape.split("x"))
            r, v = (torch.randn(N, T, generator=g).to(device) for _ in range(2))
            d = (torch.rand(N, T, generator=g) < 0.05).to(device)
            boot = torch.randn(N, generator=g).to(device)
            times = alternate({"rt": synced(lambda: rt.gae(r, v, bootstrap_value=boot, done=d))}, a.rounds)
            print(f"| {N} x {T} | {spread([1e6 * t for t in times['rt']], '{:.0f}')} |")
        return 0

    print("\n| shape [T, N, 1] | step | rsl_rl's loop | rl_triton | speed-up | max abs diff |\n"
          "|---|---|---:|---:|---:|---:|")
    for shape in shapes.split(","):
        T, N = (int(x) for x in shape.split("x"))
        r, v = (torch.randn(T, N, 1, generator=g).to(device) for _ in range(2))
        dones = (torch.rand(T, N, 1, generator=g) < 0.05).byte().to(device)
        last = torch.randn(N, 1, generator=g).to(device)
        ret_loop, ret_rt, adv_rt = (torch.empty_like(v) for _ in range(3))
        for step, whiten in (("GAE", False), ("GAE + normalisation", dict(eps_mode="std"))):
            def loop():
                return rsl_rl_loop(r, v, dones, last, ret_loop, normalize=bool(whiten))

            def fused():
                rt.gae(r, v, bootstrap_value=last, done=dones, gamma=GAMMA, lmbda=LAM, time_dim=0, whiten=whiten,
                       out=(adv_rt, ret_rt))
                return adv_rt

            try:
                want, got = loop(), fused()
                diff = max((want - got).abs().max().item(), (ret_loop - ret_rt).abs().max().item())
            except Exception as e:  # noqa: BLE001 - reported, then the exit status says so
                print(f"| {T} x {N} | {step} | error: {type(e).__name__}: {e} |")
                failed = True
                continue
            if not diff <= 1e-4:
                failed = True
            times = alternate({"loop": synced(loop), "rt": synced(fused)}, a.rounds)
            speed = ratios(times["loop"], times["rt"])
            print(f"| {T} x {N} | {step} | {spread([1e6 * t for t in times['loop']], '{:.0f}')} | "
                  f"{spread([1e6 * t for t in times['rt']], '{:.0f}')} | {spread(speed, '{:.1f}', 'x')} | "
                  f"{diff:.1e} |")
    if failed:
        print("FAILED: rl_triton erred or disagreed with rsl_rl's loop (max abs diff > 1e-4) in a cell")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
