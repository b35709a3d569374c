"""A CleanRL-style PPO update at GPU-simulator scale, without an environment: CleanRL's inline GAE
loop against rl_triton's ``compute_gae``, side by side in one process.

    python benchmarks/cleanrl_synthetic.py                          # CPU defaults (under a minute)
    python benchmarks/cleanrl_synthetic.py --device cuda --md out.md
    python benchmarks/cleanrl_synthetic.py --shapes 4096x32,256x2048 --epochs 10

Each rollout is random: observations (obs dim 60), actions (dim 8), rewards, and episode starts
with probability 1/--episode-len; values and log-probs come from the agent. For each
(num_envs, num_steps) shape and each GAE variant it times

* the advantage phase: the GAE computation alone (loop, or one compute_gae call);
* the update phase: everything after the rollout, as in CleanRL's scripts: the bootstrap value,
  the advantage phase, flattening, and --epochs epochs of --minibatches minibatches of
  forward / clipped PPO loss / backward / grad clipping / Adam on a Gaussian MLP agent.

On a CPU the defaults are 2 epochs and 7 timed repeats (5 and 10 on a GPU), printed in the
table's header. Timing uses CUDA events on a GPU and time.perf_counter on a CPU, after --warmup
untimed updates per variant; within each repeat both variants run, their order swapping from one
repeat to the next, and the speed-ups are taken within a repeat. Prints (and with --md writes) a
markdown table: each cell is the median over the repeats and, in parentheses, the lowest and
highest repeat.
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn as nn
from torch.distributions.normal import Normal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from common import machine, parser, ratios, spread  # noqa: E402
from rl_triton.testing.frameworks import cleanrl_gae as inline_gae  # noqa: E402
from rl_triton.integrations.cleanrl import compute_gae  # noqa: E402

OBS_DIM, ACT_DIM = 60, 8
SHAPES = "4096x32,1024x128,8192x16,256x2048"


class Agent(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()

        def mlp(out, std):
            last = nn.Linear(hidden, out)
            nn.init.orthogonal_(last.weight, std)
            nn.init.zeros_(last.bias)
            return nn.Sequential(nn.Linear(OBS_DIM, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(), last)

        self.critic = mlp(1, 1.0)
        self.actor_mean = mlp(ACT_DIM, 0.01)
        self.actor_logstd = nn.Parameter(torch.zeros(1, ACT_DIM))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        mean = self.actor_mean(x)
        dist = Normal(mean, self.actor_logstd.expand_as(mean).exp())
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action).sum(1), dist.entropy().sum(1), self.critic(x)


class Clock:
    """Marks on a CUDA stream (events) or on the host clock; read() syncs once."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def read(self):
        """Milliseconds between consecutive marks."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def make_rollout(num_envs, num_steps, agent, device, episode_len, gen):
    obs = torch.randn(num_steps, num_envs, OBS_DIM, generator=gen).to(device)
    with torch.no_grad():
        actions, logprobs, _, values = agent.get_action_and_value(obs.reshape(-1, OBS_DIM))
    dones = (torch.rand(num_steps, num_envs, generator=gen) < 1.0 / episode_len).float().to(device)
    return {
        "obs": obs, "actions": actions.reshape(num_steps, num_envs, ACT_DIM),
        "logprobs": logprobs.reshape(num_steps, num_envs), "values": values.reshape(num_steps, num_envs),
        "rewards": torch.randn(num_steps, num_envs, generator=gen).to(device), "dones": dones,
        "next_obs": torch.randn(num_envs, OBS_DIM, generator=gen).to(device),
        "next_done": (torch.rand(num_envs, generator=gen) < 1.0 / episode_len).float().to(device),
    }


def ppo_update(agent, optimizer, ro, fast, args, clock):
    """One update phase; returns the advantages. Marks: start, GAE start, GAE end, end."""
    clock.mark()
    with torch.no_grad():
        next_value = agent.get_value(ro["next_obs"]).reshape(1, -1)
        clock.mark()
        gae = compute_gae if fast else inline_gae
        advantages, returns = gae(ro["rewards"], ro["values"], ro["dones"], next_value, ro["next_done"],
                                  args.gamma, args.gae_lambda)
        clock.mark()
    b_obs, b_actions = ro["obs"].reshape(-1, OBS_DIM), ro["actions"].reshape(-1, ACT_DIM)
    b_logprobs, b_values = ro["logprobs"].reshape(-1), ro["values"].reshape(-1)
    b_advantages, b_returns = advantages.reshape(-1), returns.reshape(-1)
    batch = b_obs.shape[0]
    mb = batch // args.minibatches
    for _ in range(args.epochs):
        perm = torch.randperm(batch, device=b_obs.device)
        for start in range(0, batch, mb):
            idx = perm[start:start + mb]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[idx], b_actions[idx])
            logratio = newlogprob - b_logprobs[idx]
            ratio = logratio.exp()
            adv = b_advantages[idx]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            pg_loss = torch.max(-adv * ratio, -adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
            newvalue = newvalue.view(-1)
            v_clipped = b_values[idx] + torch.clamp(newvalue - b_values[idx], -args.clip_coef, args.clip_coef)
            v_loss = 0.5 * torch.max((newvalue - b_returns[idx]) ** 2, (v_clipped - b_returns[idx]) ** 2).mean()
            loss = pg_loss - 0.0 * entropy.mean() + 0.5 * v_loss
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            optimizer.step()
    clock.mark()
    return advantages


def bench_shape(num_envs, num_steps, args, device):
    gen = torch.Generator().manual_seed(num_envs * 7919 + num_steps)
    torch.manual_seed(0)
    agent = Agent(args.hidden).to(device)
    optimizer = torch.optim.Adam(agent.parameters(), lr=3e-4, eps=1e-5)
    ro = make_rollout(num_envs, num_steps, agent, device, args.episode_len, gen)
    # the two variants agree (float32 rounding) on this rollout
    with torch.no_grad():
        nv = agent.get_value(ro["next_obs"]).reshape(1, -1)
        a_loop, _ = inline_gae(ro["rewards"], ro["values"], ro["dones"], nv, ro["next_done"], args.gamma,
                               args.gae_lambda)
        a_fast, _ = compute_gae(ro["rewards"], ro["values"], ro["dones"], nv, ro["next_done"], args.gamma,
                                args.gae_lambda)
    max_diff = (a_loop - a_fast).abs().max().item()
    times = {False: ([], []), True: ([], [])}
    for r in range(args.warmup + args.repeats):
        for fast in ((False, True) if r % 2 == 0 else (True, False)):
            clock = Clock(device)
            ppo_update(agent, optimizer, ro, fast, args, clock)
            _, adv_ms, _ = d = clock.read()
            if r >= args.warmup:
                times[fast][0].append(adv_ms)
                times[fast][1].append(sum(d))
    return times, max_diff


def main():
    p = parser(__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the agent, the rollout and the GAE run")
    p.add_argument("--shapes", default=SHAPES, help="comma-separated NUM_ENVSxNUM_STEPS")
    p.add_argument("--epochs", type=int, default=None, help="PPO epochs per update (None: 5 on a GPU, 2 on a CPU)")
    p.add_argument("--minibatches", type=int, default=4, help="minibatches per epoch")
    p.add_argument("--hidden", type=int, default=64, help="width of the two tanh layers (CleanRL: 64)")
    p.add_argument("--repeats", type=int, default=None, help="timed updates per variant (None: 10 GPU, 7 CPU)")
    p.add_argument("--warmup", type=int, default=1, help="untimed updates per variant first")
    p.add_argument("--episode-len", type=float, default=200.0, help="mean episode length of the random dones")
    p.add_argument("--gamma", type=float, default=0.99, help="discount")
    p.add_argument("--gae-lambda", type=float, default=0.95, help="GAE lambda")
    p.add_argument("--clip-coef", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--md", default=None, help="also write the markdown table to this file")
    args = p.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args.epochs = args.epochs or (5 if on_gpu else 2)
    args.repeats = args.repeats or (10 if on_gpu else 7)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]

    # compile / load numba or Triton before anything is timed
    z = torch.zeros(4, 2, device=device)
    compute_gae(z, z, z, z[0], z[0], args.gamma, args.gae_lambda)

    dev_name = torch.cuda.get_device_name(device) if on_gpu else f"CPU ({machine()})"
    header = (f"CleanRL-style PPO update on random data, {dev_name}; torch {torch.__version__}; "
              f"MLP {OBS_DIM}->{args.hidden}->{args.hidden} (obs {OBS_DIM}, action {ACT_DIM}), {args.epochs} epochs x "
              f"{args.minibatches} minibatches, {args.repeats} updates per variant after {args.warmup} warm-up, "
              f"median (lowest-highest); "
              f"update phase = bootstrap value + GAE + epochs; timing: "
              f"{'CUDA events' if on_gpu else 'time.perf_counter'}")
    lines = [header, "",
             "| num_envs x num_steps | advantage ms, inline loop | advantage ms, compute_gae | advantage speed-up | "
             "update ms, inline loop | update ms, compute_gae | update speed-up | loop's GAE share of update | "
             "max abs diff |",
             "|---|---|---|---|---|---|---|---|---|"]
    print(header + "\n")
    print("\n".join(lines[2:]), flush=True)
    for n, t in shapes:
        times, diff = bench_shape(n, t, args, device)
        (la, lu), (fa, fu) = times[False], times[True]
        row = (f"| {n} x {t} | {spread(la, '{:.2f}')} | {spread(fa, '{:.3f}')} | {spread(ratios(la, fa), unit='x')} | "
               f"{spread(lu)} | {spread(fu)} | {spread(ratios(lu, fu), '{:.3f}', 'x')} | "
               f"{spread([100 * a / u for a, u in zip(la, lu)], unit='%')} | {diff:.1e} |")
        lines.append(row)
        print(row, flush=True)
    if args.md:
        os.makedirs(os.path.dirname(os.path.abspath(args.md)), exist_ok=True)
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
        print(f"wrote {args.md}")


if __name__ == "__main__":
    main()
