"""PPO on a MuJoCo task (HalfCheetah-v5, gymnasium vector envs) in the style of CleanRL's
ppo_continuous_action.py, its GAE either the inline reversed loop of CleanRL's scripts or
rl_triton's ``compute_gae``.

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/cleanrl_ppo_continuous.py                 # rl_triton's compute_gae
    python examples/cleanrl_ppo_continuous.py --no-fast-gae   # the inline loop
    python examples/cleanrl_ppo_continuous.py --compare       # both, the inline loop first

Here: the environment, the agent and the arguments. The PPO loop (CleanRL's), its timings and
its outputs are those of cleanrl_ppo_atari.py (cleanrl_train and cleanrl_main in
rl_triton/_scripts.py): the medians of the advantage phase (the GAE alone) and of the update
phase (bootstrap value, GAE and the PPO epochs); episodes.csv, timings.csv and returns.png in
the folder compute_gae, inline_loop or compare under --out. The default budget finishes in
about a minute on 2 CPU cores; --cuda runs on CUDA (the default when a GPU is present).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.distributions.normal import Normal

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import cleanrl_main, quiet_mujoco  # noqa: E402


@dataclass
class Args:
    env_id: str = "HalfCheetah-v5"
    total_timesteps: int = 65_536
    num_envs: int = 4
    num_steps: int = 512
    learning_rate: float = 3e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    num_minibatches: int = 32
    update_epochs: int = 10
    norm_adv: bool = True
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    target_kl: float | None = None
    fast_gae: bool = True
    compare: bool = False
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool | None = None
    tensorboard: bool = False
    out: str = "runs/cleanrl_ppo_continuous"
    # filled in at run time
    batch_size: int = 0
    minibatch_size: int = 0
    num_iterations: int = 0


def make_env(env_id: str, gamma: float):
    def thunk():
        import gymnasium as gym

        env = gym.make(env_id)
        env = gym.wrappers.FlattenObservation(env)
        env = gym.wrappers.RecordEpisodeStatistics(env)  # raw returns, before reward normalisation
        env = gym.wrappers.ClipAction(env)
        env = gym.wrappers.NormalizeObservation(env)
        env = gym.wrappers.TransformObservation(env, lambda o: np.clip(o, -10, 10), env.observation_space)
        env = gym.wrappers.NormalizeReward(env, gamma=gamma)
        env = gym.wrappers.TransformReward(env, lambda r: float(np.clip(r, -10, 10)))
        return env

    return thunk


def layer_init(layer, std=np.sqrt(2), bias_const=0.0):
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """Separate tanh MLPs (64, 64) for the value and the Gaussian mean; a learned log-std."""

    def __init__(self, obs_dim: int, act_dim: int):
        super().__init__()
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_dim, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, 64)), nn.Tanh(),
            layer_init(nn.Linear(64, act_dim), std=0.01),
        )
        self.actor_logstd = nn.Parameter(torch.zeros(1, act_dim))

    def get_value(self, x):
        return self.critic(x)

    def get_action_and_value(self, x, action=None):
        mean = self.actor_mean(x)
        dist = Normal(mean, self.actor_logstd.expand_as(mean).exp())
        if action is None:
            action = dist.sample()
        return action, dist.log_prob(action).sum(1), dist.entropy().sum(1), self.critic(x)


def make_agent(envs):
    if envs.single_action_space.shape is None or len(envs.single_action_space.shape) != 1:
        raise ValueError(f"this agent takes a vector of continuous actions, not {envs.single_action_space}")
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    return Agent(obs_dim, envs.single_action_space.shape[0])


if __name__ == "__main__":
    quiet_mujoco()
    cleanrl_main(__doc__, Args, make_env, make_agent, needs=("mujoco",))
