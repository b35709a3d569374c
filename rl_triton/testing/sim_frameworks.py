"""The GPU-simulation frameworks' advantage loops, transcribed (their structure and arithmetic
kept, each naming its source file and version), for the benchmark machine, where the packages
are not installed (benchmarks/skrl_rl_games.py). tests/test_skrl.py and tests/test_rl_games.py
check each one against the package's own function. Plain torch; this module never imports
``rl_triton``."""

from __future__ import annotations

import torch


def skrl_compute_gae(*, rewards, terminated, truncated, values, last_values, discount_factor=0.99,
                     lambda_coefficient=0.95, time_limit_bootstrap=False):
    """skrl 2.1.1, skrl/agents/torch/ppo/ppo.py, compute_gae (the feed-forward agents' copy):
    ``(returns, normalised advantages)``."""
    advantage = 0
    advantages = torch.zeros_like(rewards)
    not_done = ((terminated | truncated) if time_limit_bootstrap else terminated).logical_not()
    memory_size = rewards.shape[0]
    for i in reversed(range(memory_size)):
        next_values = values[i + 1] if i < memory_size - 1 else last_values
        advantage = (
            rewards[i] - values[i] + discount_factor * not_done[i] * (next_values + lambda_coefficient * advantage)
        )
        advantages[i] = advantage
    returns = advantages + values
    advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    return returns, advantages


def rl_games_discount_values(self, fdones, last_extrinsic_values, mb_fdones, mb_extrinsic_values, mb_rewards):
    """rl-games 1.6.5, rl_games/common/a2c_common.py, A2CBase.discount_values (``self`` needs
    ``horizon_length``, ``gamma`` and ``tau``): the advantages."""
    lastgaelam = 0
    mb_advs = torch.zeros_like(mb_rewards)
    for t in reversed(range(self.horizon_length)):
        if t == self.horizon_length - 1:
            nextnonterminal = 1.0 - fdones
            nextvalues = last_extrinsic_values
        else:
            nextnonterminal = 1.0 - mb_fdones[t + 1]
            nextvalues = mb_extrinsic_values[t + 1]
        nextnonterminal = nextnonterminal.unsqueeze(1)
        delta = mb_rewards[t] + self.gamma * nextvalues * nextnonterminal - mb_extrinsic_values[t]
        mb_advs[t] = lastgaelam = delta + self.gamma * self.tau * nextnonterminal * lastgaelam
    return mb_advs


def rl_games_normalized_advantages(returns, values):
    """rl-games 1.6.5, rl_games/common/a2c_common.py, ContinuousA2CBase.prepare_dataset (without
    the running mean-std and the RNN masks): the advantages the train step uses, from the
    flattened ``[T * N, K]`` returns and values."""
    advantages = returns - values
    advantages = torch.sum(advantages, axis=1)
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)
