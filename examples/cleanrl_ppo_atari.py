"""PPO on an Atari game (ALE/Pong-v5, gymnasium vector envs, AtariPreprocessing and 4-frame
stacking) in the style of CleanRL's ppo_atari.py, its GAE either the inline reversed loop of
CleanRL's scripts or rl_triton's ``compute_gae``.

Install (from the repository root, after torch; see the README):

    pip install -e ".[examples]"

Run:

    python examples/cleanrl_ppo_atari.py                 # rl_triton's compute_gae
    python examples/cleanrl_ppo_atari.py --no-fast-gae   # the inline loop
    python examples/cleanrl_ppo_atari.py --compare       # both, the inline loop first

This file holds the environment, the agent and the arguments; the PPO loop with the two GAE
variants is CleanRL's, shared with cleanrl_ppo_continuous.py (rl_triton/_scripts.py,
cleanrl_train). Times the advantage phase (the GAE computation alone) and the update phase
(everything after the rollout: bootstrap value, GAE, and the PPO epochs), prints their medians,
and writes episodes.csv, timings.csv and returns.png (TensorBoard logs in tb/ too with
--tensorboard) into a folder under --out named after the run: compute_gae, inline_loop or
compare (both runs in each file). The default budget, 8 envs x 128 steps x 8 iterations, is
1,024 steps per env: about one game of Pong each (a game lasts 750 to 1,000 steps while the
policy is untrained). It finishes in a few minutes on 2 CPU cores (far too short to learn Pong:
it shows the plumbing and the timings). Runs on CUDA with --cuda (or automatically when a GPU is
present).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
from torch.distributions.categorical import Categorical

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl_triton._scripts import cleanrl_main  # noqa: E402


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
    compare: bool = False
    seed: int = 1
    torch_deterministic: bool = True
    cuda: bool | None = None
    tensorboard: bool = False
    out: str = "runs/cleanrl_ppo_atari"
    # filled in at run time
    batch_size: int = 0
    minibatch_size: int = 0
    num_iterations: int = 0


def make_env(env_id: str, gamma: float):
    def thunk():
        import ale_py
        import gymnasium as gym

        gym.register_envs(ale_py)
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


def make_agent(envs):
    if not hasattr(envs.single_action_space, "n"):
        raise ValueError(f"this agent takes discrete actions, not {envs.single_action_space}")
    return Agent(int(envs.single_action_space.n))


if __name__ == "__main__":
    cleanrl_main(__doc__, Args, make_env, make_agent, needs=("ale_py", "cv2"))
