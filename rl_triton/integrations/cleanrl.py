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

    delta[t] = r[t] + gamma * V(t+1) * (1 - done[t+1]) - V(t), A[t] = delta[t] +
    gamma * gae_lambda * (1 - done[t+1]) * A[t+1], with done[T] = next_done, V(T) = next_value.
    Returns ``(advantages, returns = advantages + values)``. Arguments that are not torch tensors
    (numpy arrays, say) raise TypeError.

    Args:
        rewards: ``(num_steps, num_envs)`` float tensor of rewards, on any device; the outputs
            have its shape, dtype and device.
        values: ``V(t)``, ``(num_steps, num_envs)``, the rewards' dtype and device.
        dones: ``(num_steps, num_envs)`` flags (any dtype, true where nonzero): ``dones[t]`` marks
            observation t as the first of an episode (CleanRL's ``next_done`` of the step before).
        next_value: V of the observation after the rollout, one per env (``(1, num_envs)`` or
            ``(num_envs,)``); cast to the rewards' dtype.
        next_done: ``(num_envs,)`` flags: whether each env's last step ended its episode.
        gamma: the discount in [0, 1].
        gae_lambda: the GAE lambda in [0, 1].
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

    Step-aligned, as ``envs.step`` returns them. A truncation cuts the trace but bootstraps from
    ``next_values``; a termination does not bootstrap. Returns ``(advantages, returns =
    advantages + values)``.

    Args:
        rewards: ``(num_steps, num_envs)`` float tensor of rewards, on any device; the outputs
            have its shape, dtype and device.
        values: ``V(s_t)``, ``(num_steps, num_envs)``, the rewards' dtype and device.
        next_values: ``V(s_{t+1})`` of each step's true successor, ``(num_steps, num_envs)``: the
            final observation's value where step t was truncated, ``values[t+1]`` inside an
            episode, the next observation's value at the last step.
        terminations: ``(num_steps, num_envs)`` flags (any dtype, true where nonzero):
            ``s_{t+1}`` is terminal.
        truncations: ``(num_steps, num_envs)`` flags: the episode was cut after step t.
        gamma: the discount in [0, 1].
        gae_lambda: the GAE lambda in [0, 1].
    """
    return gae(rewards, values, next_values=next_values, terminated=terminations, truncated=truncations,
               gamma=gamma, lmbda=gae_lambda, time_dim=0)
