"""Sample Factory's advantage steps (sample-factory 2.1.1) against rl_triton's drop-ins, on CPU or
CUDA tensors, in one process.

- GAE: Sample Factory's scripted ``gae_advantages`` against ``rl_triton.integrations
  .sample_factory.gae_advantages`` on ``[E, T]`` batches (dones at 2%), once with every step
  valid and once with 30% of the steps invalid (the drop-in's one launch serves both).
- V-trace: the real ``Learner._calculate_losses`` with ``with_vtrace`` run on a stand-in learner
  (``StandIn``: a network that returns given values and ratios, losses that return 0), so that
  what is timed is the method with its V-trace block, host round trip included, against
  ``vtrace_targets`` on the same tensors. The method does a little more than the block (the
  advantages' normalisation, the stand-in's calls), which the comparison counts on Sample
  Factory's side.

Each drop-in is first checked against Sample Factory's result (the script exits 1 on a
disagreement beyond float32 rounding); then the implementations take turns in --rounds rounds
(benchmarks/common.py on CPU; on CUDA each call is followed by a synchronisation, since the
block's copies synchronise). Cells: median time per call (lowest-highest round), speed-ups
within each round.

    python benchmarks/sample_factory_step.py                            # CPU
    python benchmarks/sample_factory_step.py --device cuda --trajectories 1024,4096
"""

from __future__ import annotations

import contextlib
import os
import sys
import types

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import alternate, machine, pair_cells, parser, set_threads  # noqa: E402

GAMMA, LAMBDA, RHO, C = 0.99, 0.95, 1.0, 1.0


class _Minibatch(dict):
    """A minibatch as the learner reads it: by attribute and by key."""

    def __getattr__(self, name):
        return self[name]


class StandIn:
    """What ``Learner._calculate_losses`` reads of its learner, for ``B`` samples of
    ``recurrence`` steps: a network whose values and action log-probs are given, losses of 0, and
    the advantages the block hands to the normalisation and the targets it hands to the value
    loss kept in ``caught``."""

    def __init__(self, ratio, values, rewards, dones, recurrence: int, gamma: float, rho: float, c: float):
        from sample_factory.algo.learning import learner

        B, device = ratio.shape[0], ratio.device
        self.learner, self.caught = learner, {}
        zero = torch.zeros((), device=device)
        dist = types.SimpleNamespace(log_prob=lambda actions: torch.log(ratio))
        self.actor_critic = types.SimpleNamespace(
            forward_head=lambda obs: torch.zeros(B, 2, device=device), forward_core=lambda h, s: (h, None),
            forward_tail=lambda core, values_only, sample_actions: {"values": values[:, None]},
            action_distribution=lambda: dist, action_space=None)
        self.cfg = types.SimpleNamespace(recurrence=recurrence, ppo_clip_ratio=0.1, ppo_clip_value=1.0,
                                         use_rnn=False, with_vtrace=True, vtrace_rho=rho, vtrace_c=c, gamma=gamma)
        self.timing = types.SimpleNamespace(add_time=lambda name: contextlib.nullcontext())
        self.device = device
        self.exploration_loss_func = lambda *a: zero
        self.kl_loss_func = lambda *a: (None, zero)
        self._policy_loss = lambda *a: zero
        self._value_loss = self._catch_targets
        # the minibatch as the learner keeps it: rewards and dones also on the host (float32)
        self.mb = _Minibatch(valids=torch.ones(B, dtype=torch.bool, device=device), normalized_obs=None,
                             rnn_states=torch.zeros(B, 1, device=device), actions=None,
                             log_prob_actions=torch.zeros(B, device=device), rewards_cpu=rewards.float().cpu(),
                             dones_cpu=dones.float().cpu(), values=values, action_logits=None)

    def _catch_targets(self, values, old_values, targets, *args):
        self.caught["targets"] = targets
        return torch.zeros((), device=targets.device)

    def run(self):
        """The method once: ``(targets, advantages)`` of its V-trace block."""
        real = self.learner.masked_select

        def masked_select(x, mask, n):
            self.caught["adv"] = x
            return real(x, mask, n)

        self.learner.masked_select = masked_select
        try:
            self.learner.Learner._calculate_losses(self, self.mb, 0)
        finally:
            self.learner.masked_select = real
        return self.caught["targets"], self.caught["adv"]


def _inputs(n_traj: int, recurrence: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    B = n_traj * recurrence
    ratio = torch.exp(torch.randn(B, generator=g) * 0.5).clamp(0.05, 20.0)
    values, rewards = torch.randn(B, generator=g), torch.randn(B, generator=g)
    dones = (torch.rand(B, generator=g) < 0.02).float()
    return [x.to(device) for x in (ratio, values, rewards, dones)]


def _timed(impls: dict, rounds: int, device) -> dict:
    if device.type == "cuda":
        impls = {k: (lambda fn=fn: (fn(), torch.cuda.synchronize())) for k, fn in impls.items()}
    return alternate(impls, rounds=rounds)


def run(trajectories, recurrence: int = 32, rounds: int = 9, device="cpu") -> list[dict]:
    """One row per trajectory count: the times of each step and whether the drop-ins agreed."""
    from sample_factory.algo.utils import rl_utils

    import rl_triton.integrations.sample_factory as rt_sf

    device = torch.device(device)
    sf_gae = rl_utils.gae_advantages
    if sf_gae is rt_sf.gae_advantages:
        raise RuntimeError("Sample Factory is patched: unpatch() before timing its own functions")
    rows = []
    for n in trajectories:
        g = torch.Generator().manual_seed(n)
        rewards = torch.randn(n, recurrence, generator=g).to(device)
        dones = (torch.rand(n, recurrence, generator=g) < 0.02).float().to(device)
        values = torch.randn(n, recurrence + 1, generator=g).to(device)
        valids = torch.ones(n, recurrence + 1, dtype=torch.bool, device=device)
        mixed = (torch.rand(n, recurrence + 1, generator=g) >= 0.3).to(device)
        ratio, v, r, d = _inputs(n, recurrence, device)
        stand_in = StandIn(ratio, v, r, d, recurrence, GAMMA, RHO, C)

        def ours_vtrace():
            return rt_sf.vtrace_targets(ratio, v, r, d, recurrence, GAMMA, RHO, C)

        agree = all(torch.allclose(rt_sf.gae_advantages(rewards, dones, values, mask, GAMMA, LAMBDA),
                                   sf_gae(rewards, dones, values, mask, GAMMA, LAMBDA), rtol=1e-4, atol=1e-4)
                    for mask in (valids, mixed))
        for a, b in zip(ours_vtrace(), stand_in.run()):
            agree = agree and torch.allclose(a, b.to(device), rtol=1e-4, atol=1e-4)
        row = {"trajectories": n, "agree": bool(agree)}
        if agree:
            row["times"] = _timed({
                "sf gae": lambda: sf_gae(rewards, dones, values, valids, GAMMA, LAMBDA),
                "rt gae": lambda: rt_sf.gae_advantages(rewards, dones, values, valids, GAMMA, LAMBDA),
                "sf gae mixed": lambda: sf_gae(rewards, dones, values, mixed, GAMMA, LAMBDA),
                "rt gae mixed": lambda: rt_sf.gae_advantages(rewards, dones, values, mixed, GAMMA, LAMBDA),
                "sf vtrace": stand_in.run,
                "rt vtrace": ours_vtrace,
            }, rounds, device)
        rows.append(row)
    return rows


def main() -> int:
    p = parser(__doc__)
    p.add_argument("--trajectories", default="1024,4096", help="trajectories per batch / minibatch")
    p.add_argument("--recurrence", type=int, default=32, help="steps per trajectory (rollout = recurrence)")
    p.add_argument("--rounds", type=int, default=9, help="rounds of alternating timed batches")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="numba's and torch's threads (default: theirs)")
    a = p.parse_args()
    set_threads(a.threads)
    print(f"{machine()}; device {a.device}; recurrence {a.recurrence}; ms per call, median (lowest-highest) "
          f"of {a.rounds} rounds")
    print("| trajectories | SF gae_advantages | rl_triton | speed-up | SF, 30% invalid | rl_triton | speed-up "
          "| SF V-trace step (host round trip) | rl_triton vtrace_targets | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    failed = False
    for row in run([int(s) for s in a.trajectories.split(",")], a.recurrence, a.rounds, a.device):
        if not row["agree"]:
            print(f"disagreement at {row['trajectories']} trajectories")
            failed = True
            continue
        t = row["times"]
        print(f"| {row['trajectories']} | {pair_cells(t, 'sf gae', 'rt gae')} | "
              f"{pair_cells(t, 'sf gae mixed', 'rt gae mixed')} | {pair_cells(t, 'sf vtrace', 'rt vtrace')} |",
              flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
