"""PPO on an Atari game (ALE/Pong-v5, gymnasium vector envs, AtariPreprocessing and 4-frame
stacking) in CleanRL's single-file style, its GAE either the inline reversed loop of CleanRL's
scripts or rl_triton's ``compute_gae``.

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/cleanrl_ppo_atari.py                 # rl_triton's compute_gae
    python examples/cleanrl_ppo_atari.py --no-fast-gae   # the inline loop

Times the advantage phase (the GAE computation alone) and the update phase (everything after
the rollout: bootstrap value, GAE, and the PPO epochs), prints their medians, and writes
episodes.csv, timings.csv and returns.png under --out (TensorBoard too with --tensorboard).
The default budget finishes in a few minutes on 2 CPU cores (far too short to learn Pong: it
shows the plumbing and the timings). Runs on CUDA with --cuda (or
automatically when a GPU is present).
"""

from __future__ import annotations

import csv
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import dataclass_args, progress, require  # noqa: E402
from rl_triton.integrations.cleanrl import compute_gae  # noqa: E402


@dataclass
class Args:
    env_id: str = "ALE/Pong-v5"
    total_timesteps: int = 8192
    num_envs: int = 8
    num_steps: int = 128
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 4
    update_epochs: int = 4
    norm_adv: bool = True
    clip_coef: float = 0.1
    clip_vloss: bool = True
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    fast_gae: bool = True
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool | None = None
    tensorboard: bool = False
    out: str = "runs/cleanrl_ppo_atari"
    # filled in at run time
    batch_size: int = 0
    minibatch_size: int = 0
    num_iterations: int = 0


def parse_args() -> Args:
    args = dataclass_args(__doc__, Args)
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    return args


def make_env(env_id: str, gamma: float):
    def thunk():
        # the v5 env already repeats each action 4 frames (sticky actions 0.25), so the
        # preprocessing must not skip again: frame_skip=1
        env = gym.make(env_id)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # raw game score, before reward clipping
        env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=1, screen_size=84,
                                              terminal_on_life_loss=False, grayscale_obs=True)
        env = gym.wrappers.TransformReward(env, lambda r: float(np.sign(r)))
        env = gym.wrappers.FrameStackObservation(env, 4)
        return env

    return thunk


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """The Nature-DQN torso (three convolutions, 512 units) shared by a categorical policy head
    and a value head."""

    def __init__(self, n_actions: int):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(64 * 7 * 7, 512)), nn.ReLU(),
        )
        self.actor = layer_init(nn.Linear(512, n_actions), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def get_value(self, x):
        return self.critic(self.network(x / 255.0))

    def get_action_and_value(self, x, action=None):
        hidden = self.network(x / 255.0)
        dist = Categorical(logits=self.actor(hidden))
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action), dist.entropy(), self.critic(hidden)


def episode_returns(infos):
    """Returns of the episodes that ended this step. With SAME_STEP autoreset (used here, as
    CleanRL's gymnasium 0.29 scripts expect) RecordEpisodeStatistics' dict sits in
    infos["final_info"]["episode"]; with NEXT_STEP (gymnasium 1.x's default) in infos["episode"]."""
    for src in (infos.get("final_info", {}), infos):
        if "episode" in src:
            mask = src.get("_episode", np.ones(len(src["episode"]["r"]), bool))
            return [float(r) for r, m in zip(src["episode"]["r"], mask) if m]
    return []


def write_outputs(args, episodes, timings, title):
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "episodes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "global_step", "episode_return"])
        w.writerows(episodes)
    with open(os.path.join(args.out, "timings.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "iteration", "advantage_ms", "update_ms"])
        w.writerows(timings)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if episodes:
        ax.plot([e[1] for e in episodes], [e[2] for e in episodes], ".", alpha=0.6, label=episodes[0][0])
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no episode finished within the budget", ha="center", transform=ax.transAxes)
    ax.set_xlabel("global step")
    ax.set_ylabel("episode return")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "returns.png"), dpi=120)
    plt.close(fig)


def median_ms(xs):
    """Median, leaving out the first iteration (process warm-up) when there are more."""
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


if __name__ == "__main__":
    args = parse_args()
    require("gymnasium", "ale_py", "cv2", "matplotlib")
    import ale_py
    import gymnasium as gym

    gym.register_envs(ale_py)
    gae_label = "compute_gae" if args.fast_gae else "inline loop"
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    use_cuda = torch.cuda.is_available() if args.cuda is None else args.cuda
    device = torch.device("cuda" if use_cuda else "cpu")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    writer = None
    if args.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(os.path.join(args.out, "tb"))
        writer.add_text("hyperparameters", "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, args.gamma) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "discrete actions only"
    obs_shape = envs.single_observation_space.shape
    agent = Agent(int(envs.single_action_space.n)).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, device=device)
    actions = torch.zeros((args.num_steps, args.num_envs), device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)

    # one call of compute_gae before timing anything (numba / Triton compile or load their cache)
    compute_gae(rewards, values, dones, values[0], dones[0], args.gamma, args.gae_lambda)

    global_step = 0
    episodes, timings = [], []
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.tensor(next_obs, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)
    bar = progress(args.num_iterations * args.batch_size, gae_label)
    start_time = time.perf_counter()

    for iteration in range(1, args.num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / args.num_iterations) * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            # as CleanRL: a time-limit truncation counts as a termination (no bootstrap)
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward, dtype=torch.float32, device=device)
            next_obs = torch.tensor(next_obs, dtype=torch.float32, device=device)
            next_done = torch.tensor(next_done, dtype=torch.float32, device=device)
            for ret in episode_returns(infos):
                episodes.append((gae_label, global_step, ret))
                if writer:
                    writer.add_scalar("charts/episodic_return", ret, global_step)
        if bar:
            if episodes:
                bar.set_postfix(last_return=f"{episodes[-1][2]:.1f}", refresh=False)
            bar.update(args.batch_size)

        sync()
        t_update = time.perf_counter()
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            sync()
            t_adv = time.perf_counter()
            if args.fast_gae:
                advantages, returns = compute_gae(rewards, values, dones, next_value, next_done,
                                                  args.gamma, args.gae_lambda)
            else:
                advantages = torch.zeros_like(rewards).to(device)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                returns = advantages + values
            sync()
            adv_ms = 1e3 * (time.perf_counter() - t_adv)

        b_obs = obs.reshape((-1,) + obs_shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape(-1)
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        b_inds = np.arange(args.batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.batch_size, args.minibatch_size):
                mb_inds = b_inds[start:start + args.minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions.long()[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())
                mb_adv = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds],
                                                                -args.clip_coef, args.clip_coef)
                    v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb_inds]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        sync()
        update_ms = 1e3 * (time.perf_counter() - t_update)
        timings.append((gae_label, iteration, adv_ms, update_ms))
        if writer:
            writer.add_scalar("timing/advantage_ms", adv_ms, global_step)
            writer.add_scalar("timing/update_ms", update_ms, global_step)
            writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
            writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
            writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)

    if bar:
        bar.close()
    envs.close()
    if writer:
        writer.close()
    total_s = time.perf_counter() - start_time
    adv = median_ms([t[2] for t in timings])
    upd = median_ms([t[3] for t in timings])
    title = f"CleanRL-style PPO, {args.env_id}, {args.num_envs} envs x {args.num_steps} steps"
    print(f"\n{title} ({device}; medians per iteration, first iteration left out)")
    print("| GAE | iterations | advantage phase ms | update phase ms (incl. GAE) | GAE share of update | run s |")
    print("|---|---|---|---|---|---|")
    print(f"| {gae_label} | {len(timings)} | {adv:.3f} | {upd:.1f} | {100 * adv / upd:.2f}% | {total_s:.1f} |")
    print(f"episodes finished: {len(episodes)}" +
          (f", mean return of the last 10: {np.mean([e[2] for e in episodes[-10:]]):.1f}" if episodes else ""))
    write_outputs(args, episodes, timings, title)
    print(f"wrote {args.out}/episodes.csv, timings.csv and returns.png")
