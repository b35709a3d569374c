"""CPU timing of the token scans of LLM RL frameworks that do not install beside torch 2.13 here,
against rl_triton's drop-ins, in one process: NeMo-RL's ``GeneralizedAdvantageEstimator._compute_gae``
(carry-forward masking, run on the driver's CPU; ``rl_triton.integrations.nemo_rl.compute_gae``),
with a fixed lambda and with VAPO's length-adaptive per-sample lambda, and slime's ``chunked_gae``
(a chunked-matmul scan; ``rl_triton.integrations.slime.chunked_gae``) on the zero-padded rows
slime builds (rewards and values times the mask), and AReaL's loop inline in
``PPOActor._compute_advantages`` (``rl_triton.integrations.areal.compute_gae``). The framework
side is the transcriptions in ``rl_triton.testing.frameworks`` (NVIDIA-NeMo/RL at commit
``7ea279ab``, THUDM/slime at ``624b824a``, the areal 1.0.4 wheel).

The input: ``[responses, tokens]`` float32 token-level rewards and values, a 0/1 float32 mask
with a prompt prefix, a tool-output hole and right padding per response; gamma=1.0,
lambda=0.95 (or 1 - 1/(0.05 * length)). Each drop-in is first checked against the framework's
code (float32, 1e-4; the script exits 1 on a disagreement), then the two take turns in --rounds rounds
(benchmarks/common.py): each cell is the median time per call over the rounds with the
lowest-highest round, and the speed-ups are taken within each round. numba's and torch's thread
counts are the machine's unless --threads is given.

    python benchmarks/llm_loops_cpu.py --threads 2               # 64 x 2048 and 16 x 16384 tokens
    python benchmarks/llm_loops_cpu.py --shapes 8x512 --rounds 3
    python benchmarks/llm_loops_cpu.py --device cuda             # the tensors on the GPU (Triton)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import alternate, machine, pair_cells, parser, set_threads, synced  # noqa: E402


def make_batch(responses: int, tokens: int, seed: int = 0, device: str = "cpu"):
    """``(rewards, values, mask)``: float32 on ``device``, a prompt prefix, one hole and right
    padding per row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(tokens)[None, :]
    start = torch.randint(0, tokens // 8 + 1, (responses, 1), generator=g)
    end = torch.randint(tokens // 2, tokens + 1, (responses, 1), generator=g)
    hole = start + (end - start) // 3
    mask = ((pos >= start) & (pos < end) & ((pos < hole) | (pos >= hole + tokens // 64))).float()
    rewards = 0.01 * torch.randn(responses, tokens, generator=g) * mask
    values = torch.randn(responses, tokens, generator=g)
    return rewards.to(device), values.to(device), mask.to(device)


def cases(rewards, values, mask):
    """name -> (the framework's loop, the drop-in), each a call with no arguments."""
    import rl_triton.integrations.nemo_rl as rt_nemo
    from rl_triton.integrations.areal import compute_gae as areal_compute_gae
    import rl_triton.integrations.slime as rt_slime
    from rl_triton.testing.frameworks import areal_gae, nemo_rl_compute_gae, slime_chunked_gae

    padded = (rewards * mask, values * mask)  # slime's rows: zeros past the response
    no_eos = mask[:, -1] != 0  # AReaL: the response runs to the window's end
    adaptive = (1.0 - 1.0 / (0.05 * mask.sum(dim=1)).clamp(min=1.0)).clamp(0.0, 1.0)
    return {
        "NeMo-RL GAE": (lambda: nemo_rl_compute_gae(rewards, values, mask, 1.0, 0.95),
                        lambda: rt_nemo.compute_gae(rewards, values, mask, 1.0, 0.95)),
        "NeMo-RL GAE, per-sample lambda": (lambda: nemo_rl_compute_gae(rewards, values, mask, 1.0, adaptive),
                                           lambda: rt_nemo.compute_gae(rewards, values, mask, 1.0, adaptive)),
        "slime chunked_gae": (lambda: slime_chunked_gae(*padded, 1.0, 0.95),
                              lambda: rt_slime.chunked_gae(*padded, 1.0, 0.95)),
        "AReaL GAE": (lambda: areal_gae(rewards, values, mask, no_eos, 1.0, 0.95),
                      lambda: areal_compute_gae(rewards, values, mask, no_eos, 1.0, 0.95)),
    }


def run(shapes, rounds: int = 9, device: str = "cpu") -> list[dict]:
    """One row per (shape, case): whether the drop-in agreed with the loop and, where it did, the
    seconds per call of both in each round."""
    import torch

    rows = []
    for responses, tokens in shapes:
        for name, (theirs, ours) in cases(*make_batch(responses, tokens, device=device)).items():
            agree = all(torch.allclose(a, b, rtol=1e-5, atol=1e-4) for a, b in zip(theirs(), ours()))
            row = {"shape": f"{responses} x {tokens}", "case": name, "agree": agree}
            if agree:
                row["times"] = alternate({"loop": synced(theirs, device), "rl_triton": synced(ours, device)},
                                         rounds=rounds)
            rows.append(row)
    return rows


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--shapes", default="64x2048,16x16384", help="responses x tokens, comma-separated")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--threads", type=int, default=None, help="numba's and torch's threads (default: theirs)")
    p.add_argument("--device", default="cpu", help="where the tensors are (cuda: both sides on the GPU)")
    a = p.parse_args()
    import torch

    set_threads(a.threads)
    import numba

    shapes = [tuple(int(n) for n in s.split("x")) for s in a.shapes.split(",")]
    print(f"{machine()}; numba threads {numba.get_num_threads()}; torch {torch.__version__}; "
          f"ms per call, median (lowest-highest) of {a.rounds} rounds")
    print("| shape | loop | framework's loop | rl_triton | speed-up |")
    print("|---|---|---:|---:|---:|")
    failed = False
    for row in run(shapes, a.rounds, a.device):
        if not row["agree"]:
            print(f"disagreement at {row['shape']}, {row['case']}: rl_triton's result is not the loop's")
            failed = True
            continue
        print(f"| {row['shape']} | {row['case']} | {pair_cells(row['times'], 'loop', 'rl_triton')} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
