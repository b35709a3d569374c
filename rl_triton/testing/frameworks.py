"""The LLM frameworks' (and CleanRL's and PufferLib's) own advantage loops, transcribed (their
structure and arithmetic kept, each naming its source file and version), for the tests and the token-level benchmark to
compare against. Plain torch; this module never imports ``rl_triton``."""

from __future__ import annotations

from collections import defaultdict

import torch


def cleanrl_gae(rewards, values, dones, next_value, next_done, gamma, gae_lambda):
    """CleanRL's cleanrl/ppo.py (the same loop in ppo_atari.py and ppo_continuous_action.py), the
    reversed loop written out in its PPO scripts, with ``args.num_steps`` the rollout's length:
    ``(advantages, returns)`` of time-major ``(num_steps, num_envs)`` tensors, ``dones[t]`` = 1
    where obs t starts an episode, ``next_value``/``next_done`` those after the rollout."""
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    lastgaelam = 0
    for t in reversed(range(num_steps)):
        if t == num_steps - 1:
            nextnonterminal = 1.0 - next_done
            nextvalues = next_value
        else:
            nextnonterminal = 1.0 - dones[t + 1]
            nextvalues = values[t + 1]
        delta = rewards[t] + gamma * nextvalues * nextnonterminal - values[t]
        advantages[t] = lastgaelam = delta + gamma * gae_lambda * nextnonterminal * lastgaelam
    return advantages, advantages + values


def verl_gae(token_level_rewards, values, response_mask, gamma, lam):
    """verl 0.5, verl/trainer/ppo/core_algos.py, compute_gae_advantage_return: the loop, returning
    (advantages before whitening, returns)."""
    nextvalues = 0
    lastgaelam = 0
    advantages_reversed = []
    gen_len = token_level_rewards.shape[-1]
    for t in reversed(range(gen_len)):
        delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages, advantages + values


def verl_masked_whiten(values, mask, shift_mean=True):
    """verl 0.5, verl/utils/torch_functional.py: masked_mean, masked_var (unbiased) and
    masked_whiten, without masked_var's checks of the mask sum."""
    mean = (values * mask).sum() / mask.sum()
    centered = values - mean
    variance = (centered**2 * mask).sum() / mask.sum()
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    whitened = (values - mean) * torch.rsqrt(variance + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """verl's whole GAE step: the loop, then the advantages whitened over the response mask."""
    advantages, returns = verl_gae(token_level_rewards, values, response_mask, gamma, lam)
    return verl_masked_whiten(advantages, response_mask), returns


def openrlhf_gae(values, rewards, action_mask, gamma, lambd):
    """OpenRLHF 0.11.2, openrlhf/trainer/ppo_utils/experience_maker.py,
    RemoteExperienceMaker.get_advantages_and_returns."""
    lastgaelam = 0
    advantages_reversed = []
    response_length = rewards.size(1)
    if action_mask is not None:
        values = action_mask * values
        rewards = action_mask * rewards
    for t in reversed(range(response_length)):
        nextvalues = values[:, t + 1] if t < response_length - 1 else 0.0
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam = delta + gamma * lambd * lastgaelam
        advantages_reversed.append(lastgaelam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    return advantages.detach(), advantages + values


def verl_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    """verl 0.5, verl/trainer/ppo/core_algos.py, compute_grpo_outcome_advantage (returns the
    advantages)."""
    scores = token_level_rewards.sum(dim=-1)
    id2score = defaultdict(list)
    id2mean, id2std = {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        return scores.unsqueeze(-1) * response_mask


def pufferlib_advantage(values, rewards, dones, importance, advantages, gamma, lam, rho_clip, c_clip):
    """pufferlib 3.0.0, pufferlib/extensions/pufferlib.cpp, puff_advantage_row (the CPU twin of
    its CUDA kernel): the loop over t = horizon-2 .. 0, here vectorised over rows, in the
    tensors' dtype with the scalars rounded to it (the op's parameters are C floats). fminf keeps
    the number where the other operand is NaN (torch.fmin). ``advantages[:, -1]`` is not
    written. Returns ``advantages``, written in place."""
    dt = values.dtype
    gamma, lam, rho_clip, c_clip = (torch.tensor(x, dtype=dt) for x in (gamma, lam, rho_clip, c_clip))
    lastpufferlam = torch.zeros(values.shape[0], dtype=dt, device=values.device)
    for t in range(values.shape[1] - 2, -1, -1):
        t_next = t + 1
        nextnonterminal = 1.0 - dones[:, t_next]
        rho_t = torch.fmin(importance[:, t], rho_clip)
        c_t = torch.fmin(importance[:, t], c_clip)
        delta = rho_t * (rewards[:, t_next] + gamma * values[:, t_next] * nextnonterminal - values[:, t])
        lastpufferlam = delta + gamma * lam * c_t * lastpufferlam * nextnonterminal
        advantages[:, t] = lastpufferlam
    return advantages


SKYRL_PPO_UTILS = "skyrl.backends.skyrl_train.utils.ppo_utils"


def skyrl_ppo_utils():
    """SkyRL's real ``ppo_utils`` module (SkyRL installed: the ``skyrl`` extra), imported.

    On Python < 3.12 SkyRL 0.3.0's ``skyrl.backends`` package does not import: its
    ``skyrl.tinker.types`` builds pydantic models of ``typing.TypedDict``, which pydantic takes
    from Python 3.12 on. ppo_utils imports nothing of that package's ``__init__``, so there the
    package is entered without running it (an empty package module over the same directory)."""
    import importlib
    import os
    import sys
    import types

    try:
        return importlib.import_module(SKYRL_PPO_UTILS)
    except Exception as e:
        if sys.version_info >= (3, 12) or "TypedDict" not in str(e):
            raise
    import skyrl

    for name in [n for n in sys.modules if n == "skyrl.backends" or n.startswith("skyrl.backends.")]:
        del sys.modules[name]
    backends = types.ModuleType("skyrl.backends")
    backends.__path__ = [os.path.join(os.path.dirname(skyrl.__file__), "backends")]
    sys.modules["skyrl.backends"] = backends
    return importlib.import_module(SKYRL_PPO_UTILS)
