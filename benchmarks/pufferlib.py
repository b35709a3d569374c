"""PufferLib's advantage on the GPU: rl_triton's drop-in and kernel against PufferLib 3.0.0's CUDA
kernel, side by side in one process.

    python benchmarks/pufferlib.py --peers-dir PEERS [--shapes 8x64,32768x8] [--rounds 7] [--md FILE]

``PEERS`` holds ``pufferlib_ext/`` (PufferLib 3.0.0's ``pufferlib.cpp`` and ``pufferlib.cu``,
built with torch.utils.cpp_extension and nvcc on first use, about a minute; MIT-licensed, kept
outside this repository). Per shape (segments x horizon, float32, PufferLib's layout), with
PufferLib's default hyperparameters (gamma 0.99, lambda 0.95, both clips 1) and dones at 5% of
the steps:

- ``puffer op``: ``torch.ops.pufferlib.compute_puff_advantage`` on preallocated buffers;
- ``drop-in``: ``rl_triton.integrations.pufferlib.compute_puff_advantage`` (PufferLib's
  signature, its checks, writing into the same kind of buffer);
- ``rt kernel``: ``rl_triton.arrival_gae(..., out=advantages, write_last=False)``, the call the
  drop-in makes, without the drop-in's checks.

Kernel time: torch.profiler's CUDA kernel durations of 50 calls, summed per call (PufferLib's
op launches on the legacy default stream, so a CUDA graph cannot capture it). Full call: CUDA
events around one call after a synchronize (what a training loop sees), the implementations
taking turns in ``--rounds`` rounds, ratios taken within a round; the table gives the median
and the lowest-highest round. Before timing, every cell is checked: the drop-in against
PufferLib's op (float32 tolerance, the unwritten last column equal) and against the float64
oracle on the first rows; a disagreement or an error ends the run with status 1 after the
table. ``--ratio random`` draws importance ratios far from 1 (the default, ``one``, is
PufferLib's first call of an epoch).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..")]
import rl_triton as rt  # noqa: E402
import rl_triton.integrations.pufferlib as rt_puffer  # noqa: E402
from common import parser, spread  # noqa: E402
from peers import load_external_peers  # noqa: E402
from run import _full_call_round as full_call_round  # noqa: E402
from rl_triton.testing import oracle  # noqa: E402

# this file has PufferLib's package name: with its neighbours imported, its folder leaves sys.path,
# so that ``import pufferlib`` (the peers' build tries it) finds PufferLib or nothing, not this file
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]

GRID = ["8x64", "32768x8", "4096x32", "16384x64", "4096x128", "1024x1024", "128x4096", "8x32768"]
GAMMA, LAMBDA, RHO_CLIP, C_CLIP = 0.99, 0.95, 1.0, 1.0
CHECK_ROWS = 8  # rows checked against the float64 oracle


def _inputs(R, T, ratio_mode, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    values = torch.randn(R, T, device="cuda", generator=g)
    rewards = torch.randn(R, T, device="cuda", generator=g).clamp(-1, 1)
    dones = (torch.rand(R, T, device="cuda", generator=g) < 0.05).float()
    ratio = torch.ones(R, T, device="cuda") if ratio_mode == "one" else \
        torch.exp(0.5 * torch.randn(R, T, device="cuda", generator=g))
    return values, rewards, dones, ratio


def _check(op, inputs) -> list:
    """What is wrong with the drop-in's result on these inputs (empty: nothing)."""
    values, rewards, dones, ratio = inputs
    theirs = torch.full_like(values, -3.0)
    op(values, rewards, dones, ratio, theirs, GAMMA, LAMBDA, RHO_CLIP, C_CLIP)
    ours = rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, torch.full_like(values, -3.0), GAMMA,
                                            LAMBDA, RHO_CLIP, C_CLIP)
    torch.cuda.synchronize()
    problems = []
    if not torch.equal(ours[:, -1], theirs[:, -1]):
        problems.append("the last column was written")
    scale = max(1.0, float(theirs.abs().max()))
    err = float((ours - theirs).abs().max())
    if not err <= 1e-5 * scale:  # NaN fails too
        problems.append(f"max |drop-in - PufferLib| = {err:.3g} (scale {scale:.3g})")
    rows = [x[:CHECK_ROWS].double().cpu().numpy() for x in inputs]
    f32 = float(np.float32(GAMMA)), float(np.float32(LAMBDA))
    want = oracle.arrival_gae(rows[1], rows[0], rows[3], rows[2], np.full(rows[0].shape, f32[0]),
                              np.full(rows[0].shape, f32[1]), RHO_CLIP, C_CLIP)
    got = ours[:CHECK_ROWS, :-1].double().cpu().numpy()
    err = float(np.abs(got - want[:, :-1]).max()) if got.size else 0.0
    if not err <= 1e-5 * max(1.0, float(np.abs(want).max())):
        problems.append(f"max |drop-in - oracle| = {err:.3g}")
    return problems


def kernel_us(fn, calls=50) -> float:
    """Summed CUDA kernel durations (torch.profiler) per call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    total = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    if total <= 0:
        raise RuntimeError("torch.profiler recorded no CUDA kernel")
    return total / calls


def full_calls(impls: dict, rounds: int, calls: int = 25) -> dict:
    """Per implementation, the median full call of ``calls`` calls in each round; the
    implementations take turns, the order rotating from round to round."""
    names = list(impls)
    for fn in impls.values():
        for _ in range(3):
            fn()
    out = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            out[name].append(full_call_round(impls[name], calls))
    return out


def main():
    p = parser(__doc__)
    p.add_argument("--peers-dir", metavar="DIR", required=True, help="a folder holding pufferlib_ext/")
    p.add_argument("--shapes", default=",".join(GRID), help="segments x horizon list")
    p.add_argument("--rounds", type=int, default=7, help="rounds of alternating full calls")
    p.add_argument("--ratio", choices=("one", "random"), default="one", help="importance ratios: 1, or far from 1")
    p.add_argument("--md", help="also write the table to this markdown file")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/pufferlib.py needs a CUDA device")
    op = load_external_peers(args.peers_dir, pufferlib=True).puff_advantage
    if op is None:
        raise SystemExit("PufferLib's CUDA op is not available (see the line above)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rl_triton {rt.__version__}, "
          f"ratio {args.ratio}", flush=True)
    head = ("| shape | kernel us: puffer op | rt kernel | puffer / rt | full call us: puffer op | drop-in | "
            "rt kernel | drop-in / puffer | rt kernel / puffer |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    failed = []
    for shape in args.shapes.split(","):
        R, T = (int(n) for n in shape.split("x"))
        inputs = _inputs(R, T, args.ratio)
        values, rewards, dones, ratio = inputs
        try:
            problems = _check(op, inputs)
        except Exception as e:  # an error of rl_triton's is a failed cell
            problems = [f"{type(e).__name__}: {e}"]
        if problems:
            failed.append(f"{shape}: {'; '.join(problems)}")
            print(f"{shape}: WRONG: {'; '.join(problems)}", flush=True)
            continue
        theirs, ours, direct = (torch.zeros_like(values) for _ in range(3))
        impls = {
            "puffer op": lambda: op(values, rewards, dones, ratio, theirs, GAMMA, LAMBDA, RHO_CLIP, C_CLIP),
            "drop-in": lambda: rt_puffer.compute_puff_advantage(values, rewards, dones, ratio, ours, GAMMA, LAMBDA,
                                                                RHO_CLIP, C_CLIP),
            "rt kernel": lambda: rt.arrival_gae(rewards, values, ratio=ratio, done=dones, gamma=GAMMA, lmbda=LAMBDA,
                                                rho_bar=RHO_CLIP, c_bar=C_CLIP, write_last=False, out=direct),
        }
        k_puffer, k_rt = kernel_us(impls["puffer op"]), kernel_us(impls["rt kernel"])
        full = full_calls(impls, args.rounds)
        drop = [a / b for a, b in zip(full["drop-in"], full["puffer op"])]
        kern = [a / b for a, b in zip(full["rt kernel"], full["puffer op"])]
        line = (f"| {shape} | {k_puffer:.1f} | {k_rt:.1f} | {k_puffer / k_rt:.2f}x | {spread(full['puffer op'])} | "
                f"{spread(full['drop-in'])} | {spread(full['rt kernel'])} | {spread(drop, '{:.2f}', 'x')} | "
                f"{spread(kern, '{:.2f}', 'x')} |")
        lines.append(line)
        print(line, flush=True)
    table = "\n".join(lines)
    print("\n" + table)
    if args.md:
        with open(args.md, "w") as f:
            f.write(table + "\n")
    if failed:
        print("\nFAILED cells:\n" + "\n".join(failed))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
