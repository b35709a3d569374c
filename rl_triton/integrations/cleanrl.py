"""CleanRL-style scripts: one call instead of the inline GAE loop.

CleanRL's PPO scripts end each rollout with about twelve lines (a reversed loop over steps with
``nextnonterminal``/``nextvalues``); replace them with::

    from rl_triton.integrations.cleanrl import compute_gae

    with torch.no_grad():
        next_value = agent.get_value(next_obs).reshape(1, -1)
        advantages, returns = compute_gae(rewards, values, dones, next_value, next_done,
                                          args.gamma, args.gae_lambda)

Conventions (docs/cleanrl.md): time-major ``(num_steps, num_envs)`` tensors on any device;
``dones[t]`` marks obs t as the first of an episode (CleanRL stores the ``next_done`` of the
previous step) and ``next_done`` closes the window; every done is a termination, as in
CleanRL's loop. These are rl_triton's observation-aligned flags, read in place: no shifted
copies. ``compute_gae_truncated`` is the variant for scripts that keep terminations,
truncations and the values of the final observations separately.
"""

from __future__ import annotations

import torch

from .. import gae

__all__ = ["compute_gae", "compute_gae_truncated"]


def _row(x: torch.Tensor, num_envs: int, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.numel() != num_envs:
        raise ValueError(f"{name} must hold one value per env ({num_envs}), got shape {tuple(x.shape)}")
    return x.reshape(num_envs)


def compute_gae(rewards, values, dones, next_value, next_done, gamma: float, gae_lambda: float):
    """CleanRL's GAE loop as one fused scan.

    ``rewards``, ``values``, ``dones``: ``(num_steps, num_envs)``; ``next_value``: ``(1, N)`` or
    ``(N,)``, V of the observation after the rollout; ``next_done``: ``(N,)``.
    delta[t] = r[t] + gamma * V(t+1) * (1 - done[t+1]) - V(t), A[t] = delta[t] +
    gamma * gae_lambda * (1 - done[t+1]) * A[t+1], with done[T] = next_done, V(T) = next_value.
    ``gamma``, ``gae_lambda``: CleanRL's ``args.gamma`` and ``args.gae_lambda``, in [0, 1].
    Returns ``(advantages, returns = advantages + values)``. Arguments that are not torch
    tensors (numpy arrays, say) raise TypeError.
    """
    for name, x in (("rewards", rewards), ("values", values), ("dones", dones)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be a (num_steps, num_envs) tensor, got shape {tuple(rewards.shape)}")
    n = rewards.shape[1]
    bootstrap = _row(next_value, n, "next_value")
    if bootstrap.dtype != rewards.dtype:
        bootstrap = bootstrap.to(rewards.dtype)
    return gae(rewards, values, episode_starts=dones, last_done=_row(next_done, n, "next_done"),
               bootstrap_value=bootstrap, gamma=gamma, lmbda=gae_lambda, time_dim=0)


def compute_gae_truncated(rewards, values, next_values, terminations, truncations, gamma: float,
                          gae_lambda: float):
    """GAE with time-limit truncations bootstrapped correctly (gymnasium >= 1.0 vector envs).

    Step-aligned, as ``envs.step`` returns them: ``terminations[t]``/``truncations[t]`` end the
    episode after step t; ``next_values[t]`` = V(s_{t+1}) of the true successor (the final
    observation's value where step t was truncated, ``values[t+1]`` inside an episode, the
    next observation's value at the last step). A truncation cuts the trace but bootstraps
    from ``next_values``; a termination does not bootstrap. All ``(num_steps, num_envs)``.
    Returns ``(advantages, returns = advantages + values)``.
    """
    return gae(rewards, values, next_values=next_values, terminated=terminations, truncated=truncations,
               gamma=gamma, lmbda=gae_lambda, time_dim=0)
