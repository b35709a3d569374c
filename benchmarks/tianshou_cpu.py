"""CPU timing of Tianshou's GAE step (tianshou 2.0.1): ``Algorithm.compute_episodic_return`` and
its numba ``_gae``, Tianshou's own against rl_triton's drop-ins
(``rl_triton.integrations.tianshou``), in one process.

The input is what an A2C/PPO update hands them: a real ``VectorReplayBuffer`` of ``--envs``
environments filled by ``add`` (episodes of about 200 steps, terminated or truncated, the last
episode of each environment unfinished), the whole buffer as the batch, float32 values from the
critic (``v_s``, ``v_s_``) and the buffer's float64 rewards; gamma=0.99, gae_lambda=0.95. Each
drop-in is first checked against Tianshou's function on that input (element for element:
both run in float64; the script exits 1 on a disagreement), then the implementations take turns
in --rounds rounds (benchmarks/common.py): each cell is the median time per call over the rounds
with the lowest-highest round, and the speed-ups are taken within each round. numba's and torch's thread
counts are the machine's unless --threads is given.

    python benchmarks/tianshou_cpu.py                       # 100k and 1M transitions
    python benchmarks/tianshou_cpu.py --steps 100000 --rounds 15 --threads 2
    python benchmarks/tianshou_cpu.py --device cuda     # values on the GPU: the CUDA path
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import alternate, machine, pair_cells, parser, set_threads  # noqa: E402

GAMMA, LAMBDA = 0.99, 0.95


def make_batch(steps: int, n_envs: int, seed: int = 0):
    """``(buffer, batch, indices, v_s_, v_s)``: a VectorReplayBuffer holding ``steps``
    transitions of ``n_envs`` environments, the whole buffer as the batch, float32 values."""
    from tianshou.data import Batch, VectorReplayBuffer

    rng = np.random.default_rng(seed)
    per_env = max(1, steps // n_envs)
    buf = VectorReplayBuffer(per_env * n_envs, n_envs)
    zeros = np.zeros((n_envs, 1), dtype=np.float32)
    for _ in range(per_env):
        terminated = rng.random(n_envs) < 1 / 300
        truncated = ~terminated & (rng.random(n_envs) < 1 / 600)
        buf.add(Batch(obs=zeros, act=np.zeros(n_envs, dtype=np.int64), rew=rng.standard_normal(n_envs),
                      terminated=terminated, truncated=truncated, obs_next=zeros, info=[{}] * n_envs))
    indices = buf.sample_indices(0)
    batch = buf[indices]
    v_s_ = rng.standard_normal(len(indices)).astype(np.float32)
    v_s = rng.standard_normal(len(indices)).astype(np.float32)
    return buf, batch, indices, v_s_, v_s


def _same(a, b, exact: bool) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(np.array_equal(a, b)) if exact else bool(np.allclose(a, b, rtol=1e-12, atol=1e-12))


def run(sizes, rounds: int = 9, n_envs: int = 64, device: str = "cpu") -> list[dict]:
    """One row per size: the median ms per call of each implementation, the median speed-ups and
    whether rl_triton agreed with Tianshou (a size that disagrees is not timed). With a CUDA
    ``device`` the values are tensors there, as a caller holding them on the GPU passes them:
    Tianshou copies them to the host, the drop-ins compute there (the agreement is then to 1e-12,
    float64 kernels of two backends)."""
    from tianshou.algorithm import algorithm_base

    import rl_triton.integrations.tianshou as rt_ts

    ts_gae = algorithm_base._gae
    ts_cer = algorithm_base.Algorithm.compute_episodic_return
    if ts_gae is rt_ts.gae_advantages:
        raise RuntimeError("Tianshou is patched: unpatch() before timing its own functions")
    rows = []
    for steps in sizes:
        buf, batch, indices, v_s_, v_s = make_batch(steps, n_envs)
        # _gae's inputs as compute_episodic_return forms them
        masked = v_s_ * algorithm_base.Algorithm.value_mask(buf, indices)
        end = np.logical_or(batch.terminated, batch.truncated)
        end[np.isin(indices, buf.unfinished_index())] = True
        rew = batch.rew
        agree = _same(ts_gae(v_s, masked, rew, end, GAMMA, LAMBDA),
                      rt_ts.gae_advantages(v_s, masked, rew, end, GAMMA, LAMBDA), True)
        values = (v_s_, v_s)  # compute_episodic_return's, on the device asked for
        if device != "cpu":
            import torch

            values = tuple(torch.from_numpy(x).to(device) for x in values)
        for a, b in zip(ts_cer(batch, buf, indices, *values, GAMMA, LAMBDA),
                        rt_ts.compute_episodic_return(batch, buf, indices, *values, GAMMA, LAMBDA)):
            agree = agree and _same(a, b, device == "cpu")
        row = {"steps": len(indices), "agree": agree}
        if agree:
            times = alternate({
                "ts gae": lambda: ts_gae(v_s, masked, rew, end, GAMMA, LAMBDA),
                "rt gae": lambda: rt_ts.gae_advantages(v_s, masked, rew, end, GAMMA, LAMBDA),
                "ts cer": lambda: ts_cer(batch, buf, indices, *values, GAMMA, LAMBDA),
                "rt cer": lambda: rt_ts.compute_episodic_return(batch, buf, indices, *values, GAMMA, LAMBDA),
            }, rounds=rounds)
            row.update(times=times, tianshou_ms=1e3 * float(np.median(times["ts cer"])),
                       rl_triton_ms=1e3 * float(np.median(times["rt cer"])))
        rows.append(row)
    return rows


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--steps", default="100000,1000000", help="transitions in the buffer (rounded to --envs)")
    p.add_argument("--envs", type=int, default=64, help="environments of the VectorReplayBuffer")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--threads", type=int, default=None, help="numba's and torch's threads (default: theirs)")
    p.add_argument("--device", default="cpu", help="where the values are (cuda: compute_episodic_return's CUDA path)")
    a = p.parse_args()
    import torch

    set_threads(a.threads)
    import numba

    print(f"{machine()}; numba threads {numba.get_num_threads()}; torch {torch.__version__}; "
          f"ms per call, median (lowest-highest) of {a.rounds} rounds")
    print("| transitions | Tianshou _gae | rl_triton _gae | speed-up | Tianshou compute_episodic_return "
          "| rl_triton compute_episodic_return | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for row in run([int(s) for s in a.steps.split(",")], a.rounds, a.envs, a.device):
        if not row["agree"]:
            print(f"disagreement at {row['steps']} transitions: rl_triton's result is not Tianshou's")
            failed = True
            continue
        t = row["times"]
        print(f"| {row['steps']} | {pair_cells(t, 'ts gae', 'rt gae')} | {pair_cells(t, 'ts cer', 'rt cer')} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
