"""GPU timing of RLlib's V-trace and PPO GAE step against rl_triton's, for a CUDA machine without
Ray: the two RLlib functions are transcribed here from ray 2.60.0 (``vtrace_torch`` from
rllib/algorithms/impala/torch/vtrace_torch_v2.py, ``compute_value_targets`` from
rllib/utils/postprocessing/value_predictions.py); tests/test_rllib.py checks both transcriptions
against the installed RLlib on the CPU.

V-trace: time-major [T=50, B] float32 as the APPO / IMPALA torch Learners call it (discounts =
0.99 * (1 - terminated) * loss mask, terminals mid-row, clip thresholds 1.0): RLlib's loop over
T on the GPU against ``rl_triton.vtrace(..., gamma=discounts, time_dim=0, rho_bar=, c_bar=1,
rho_bar_pg=)``, the call rl_triton.integrations.rllib.vtrace_torch makes; full calls, synchronised.

GAE: RLlib's connector step on a GPU Learner (values to the host, the numpy loop, the
standardisation in numpy, both results back to the device) against rl_triton's connector step
on the device (one GAE scan, ``masked_whiten`` in place; no host round trip of the values), on
RLlib's flat batches of 4000, 32768 and 131072 steps.

The implementations take turns in --rounds rounds (benchmarks/common.py); cells are the
median time per call (lowest-highest round); speed-ups are taken within each round. The script
exits 1 where rl_triton disagrees with the transcription (float32 tolerance).

    python benchmarks/rllib_gpu.py                     # B = 256, 1024, 4096; 4000-131072 steps
    python benchmarks/rllib_gpu.py --batch 1024 --rounds 15
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import rl_triton as rt  # noqa: E402
from common import alternate, machine, pair_cells, parser, ratios, spread  # noqa: E402

GAMMA, LAMBDA = 0.99, 0.95
# RLlib's advantage standardisation as masked_whiten options (rl_triton.integrations.rllib)
RLLIB_WHITEN = {"unbiased": False, "eps": 1e-8, "eps_mode": "clamp"}


# -- ray 2.60.0, rllib/algorithms/impala/torch/vtrace_torch_v2.py, vtrace_torch (transcribed) ---
def rllib_vtrace(*, target_action_log_probs, behaviour_action_log_probs, discounts, rewards, values,
                 bootstrap_values, clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0):
    rhos = torch.exp(target_action_log_probs - behaviour_action_log_probs)
    clipped_rhos = rhos if clip_rho_threshold is None else torch.clamp(rhos, max=clip_rho_threshold)
    cs = torch.clamp(rhos, max=1.0)
    values_t_plus_1 = torch.cat([values[1:], torch.unsqueeze(bootstrap_values, 0)], axis=0)
    deltas = clipped_rhos * (rewards + discounts * values_t_plus_1 - values)
    vs_minus_v_xs = [torch.zeros_like(bootstrap_values, device=deltas.device)]
    for i in reversed(range(len(discounts))):
        vs_minus_v_xs.append(deltas[i] + discounts[i] * cs[i] * vs_minus_v_xs[-1])
    vs_minus_v_xs = torch.flip(torch.stack(vs_minus_v_xs[1:]), dims=[0])
    vs = torch.add(vs_minus_v_xs, values)
    vs_t_plus_1 = torch.cat([vs[1:], torch.unsqueeze(bootstrap_values, 0)], axis=0)
    clipped_pg_rhos = rhos if clip_pg_rho_threshold is None else torch.clamp(rhos, max=clip_pg_rho_threshold)
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_t_plus_1 - values)
    return torch.detach(vs), torch.detach(pg_advantages)


# -- ray 2.60.0, rllib/utils/postprocessing/value_predictions.py, compute_value_targets ---------
def rllib_value_targets(values, rewards, terminateds, truncateds, gamma, lambda_):
    non_terminal = 1.0 - terminateds
    propagate = non_terminal * (1.0 - truncateds)
    next_state_values = np.append(values[1:], 0.0)
    td_residuals = rewards + gamma * non_terminal * next_state_values - values
    advantages = np.zeros_like(rewards, dtype=np.float32)
    running_advantage = 0.0
    for t in reversed(range(td_residuals.shape[0])):
        running_advantage = td_residuals[t] + gamma * lambda_ * propagate[t] * running_advantage
        advantages[t] = running_advantage
    return (advantages + values).astype(np.float32)


def rl_triton_vtrace(k):
    """rl_triton.integrations.rllib.vtrace_torch's call."""
    return rt.vtrace(k["rewards"], k["values"], k["target_action_log_probs"], k["behaviour_action_log_probs"],
                     bootstrap_value=k["bootstrap_values"], gamma=k["discounts"], lmbda=1.0,
                     rho_bar=k["clip_rho_threshold"], c_bar=1.0, rho_bar_pg=k["clip_pg_rho_threshold"], time_dim=0)


def vtrace_inputs(T, B, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    terminated = torch.rand(T, B, generator=g) < 0.02
    loss_mask = torch.rand(T, B, generator=g) > 0.02
    k = dict(target_action_log_probs=0.5 * torch.randn(T, B, generator=g),
             behaviour_action_log_probs=0.5 * torch.randn(T, B, generator=g),
             discounts=(1.0 - terminated.float()) * GAMMA * loss_mask.float(), rewards=torch.randn(T, B, generator=g),
             values=torch.randn(T, B, generator=g), bootstrap_values=torch.randn(B, generator=g))
    k = {name: x.to(device) for name, x in k.items()}
    k.update(clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0)
    return k


def flat_batch(n, rng):
    """RLlib's flat GAE batch: episode chunks of 1-400 steps plus the extra timestep each."""
    term, trunc = [], []
    while len(term) < n:
        k = int(rng.integers(1, 401))
        end = rng.random() < 0.5
        term += [False] * (k - 1) + [end, False]
        trunc += [False] * (k - 1) + [not end, False]
    return (rng.normal(size=n).astype(np.float32), rng.normal(size=n).astype(np.float32), np.array(term[:n]),
            np.array(trunc[:n]))


def rllib_gae_step(values, rewards, term, trunc):
    """RLlib's connector step on a device Learner: everything through numpy on the host."""
    device = values.device
    v, r, te, tr = (x.cpu().numpy() for x in (values, rewards, term, trunc))
    targets = rllib_value_targets(v, r, te, tr, GAMMA, LAMBDA)
    adv = targets - v
    adv = (adv - adv.mean()) / max(1e-4, adv.std())
    return torch.from_numpy(adv).to(device), torch.from_numpy(targets).to(device)


def rl_triton_gae_step(values, rewards, term, trunc):
    """rl_triton.integrations.rllib's connector step: on the device."""
    nv = torch.cat([values[1:], values.new_zeros(1)])
    adv, targets = rt.gae(rewards, values, next_values=nv, terminated=term, truncated=trunc, gamma=GAMMA, lmbda=LAMBDA)
    rt.masked_whiten(adv, out=adv, **RLLIB_WHITEN)
    return adv, targets


def synced(fn, device):
    def call():
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return call


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--batch", default="256,1024,4096", help="V-trace batch sizes B (T = --horizon)")
    p.add_argument("--horizon", type=int, default=50, help="V-trace T (RLlib's rollout_fragment_length)")
    p.add_argument("--steps", default="4000,32768,131072", help="GAE batch lengths")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--device", default="cuda", help="the Learner's device")
    a = p.parse_args()
    device = torch.device(a.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{machine()}; {name}; torch {torch.__version__}; median (lowest-highest) of {a.rounds} rounds")
    failed = False

    print(f"\nV-trace [T={a.horizon}, B] float32, us per full call")
    print("| B | RLlib vtrace_torch | rl_triton | speed-up | max abs err |")
    print("|---:|---:|---:|---:|---:|")
    for B in map(int, a.batch.split(",")):
        k = vtrace_inputs(a.horizon, B, device)
        ref, ours = rllib_vtrace(**k), rl_triton_vtrace(k)
        err = max((x - y).abs().max().item() for x, y in zip(ref, ours))
        if not err <= 1e-4:
            print(f"| {B} | disagreement: max abs err {err:.1e} |")
            failed = True
            continue
        times = alternate({"rllib": synced(lambda: rllib_vtrace(**k), device),
                           "ours": synced(lambda: rl_triton_vtrace(k), device)}, rounds=a.rounds)
        us = {n: spread([1e6 * t for t in v], "{:.0f}") for n, v in times.items()}
        print(f"| {B} | {us['rllib']} | {us['ours']} | {spread(ratios(times['rllib'], times['ours']), unit='x')} "
              f"| {err:.0e} |", flush=True)

    print("\nPPO GAE step on the Learner's device (targets, advantages, standardisation), ms per call")
    print("| steps | RLlib (host numpy round trip) | rl_triton (on the device) | speed-up | max abs err |")
    print("|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for n in map(int, a.steps.split(",")):
        batch = [torch.from_numpy(x).to(device) for x in flat_batch(n, rng)]
        ref, ours = rllib_gae_step(*batch), rl_triton_gae_step(*batch)
        err = max((x - y).abs().max().item() for x, y in zip(ref, ours))
        if not err <= 1e-4:
            print(f"| {n} | disagreement: max abs err {err:.1e} |")
            failed = True
            continue
        times = alternate({"rllib": synced(lambda: rllib_gae_step(*batch), device),
                           "ours": synced(lambda: rl_triton_gae_step(*batch), device)}, rounds=a.rounds)
        print(f"| {n} | {pair_cells(times, 'rllib', 'ours')} | {err:.0e} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
