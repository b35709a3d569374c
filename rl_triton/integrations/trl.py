"""TRL's PPO trainer: one call instead of the GAE loop and the whitening in ``PPOTrainer.train``.

TRL computes advantages inline in ``train()`` (``trl/experimental/ppo/ppo_trainer.py`` in TRL
1.0-1.12; 1.13 dropped the trainer), so there is nothing to patch: the loop over
``gen_length``, ``returns = advantages + values``, the whitening over ``~padding_mask`` and the
fill with 0 become::

    from rl_triton.integrations.trl import compute_advantages

    advantages, returns = compute_advantages(rewards, values, padding_mask, args.gamma, args.lam)

and, under ``args.whiten_rewards``, ``rewards = whiten_rewards(rewards, padding_mask_p1)``
(docs/trl.md has the diff).

Conventions mapped here: ``(batch, response_length)`` tensors, batch-major. TRL's GAE runs
over the whole padded response with V = 0 past its end; its inputs are already zero where it
zeroes them (``values`` past ``padding_mask_p1``, the KL rewards past ``padding_mask``, the
score at the first padding token), so the scan is ``rl_triton.gae`` with no mask and no
bootstrap. The advantages are then whitened as TRL's ``masked_whiten`` does (unbiased
variance, ``rsqrt(var + 1e-8)``: ``rl_triton.masked_whiten``'s defaults) over the response
tokens, and set to 0 on the padding. Everything runs under ``torch.no_grad()``, as TRL's block.
"""

from __future__ import annotations

import torch

from .. import gae, masked_whiten

__all__ = ["compute_advantages", "whiten_rewards"]


def _check_pair(a, b, a_name: str, b_name: str) -> None:
    for x, name in ((a, a_name), (b, b_name)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
        if x.ndim != 2:
            raise ValueError(f"{name} must be a (batch, response_length) tensor, got shape {tuple(x.shape)}")
    if b.shape != a.shape:
        raise ValueError(f"{b_name} must have {a_name}'s shape {tuple(a.shape)}, got {tuple(b.shape)}")


def _padding(mask, rewards, name: str) -> torch.Tensor:
    """``mask`` (True or nonzero = a padding token) as a bool tensor."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(mask).__name__}")
    if mask.shape != rewards.shape:
        raise ValueError(f"{name} must have the rewards' shape {tuple(rewards.shape)}, got {tuple(mask.shape)}")
    if mask.device != rewards.device:
        raise ValueError(f"{name} is on {mask.device} but rewards are on {rewards.device}")
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"{name} must be a bool (or integer) tensor, as TRL builds it, got {mask.dtype}")
    return mask if mask.dtype == torch.bool else mask != 0


@torch.no_grad()
def compute_advantages(rewards, values, padding_mask, gamma, lam, *, padding_mask_p1=None):
    """TRL's step "6. compute advantages and returns" as one fused scan and one whitening.

        A[t] = r[t] + gamma * V[t+1] - V[t] + gamma * lam * A[t+1],  V[T] = A[T] = 0
        returns    = A + values
        advantages = whiten(A) over ~padding_mask (mean, unbiased var, rsqrt(var + 1e-8)),
                     then 0 where padding_mask

    Returns ``(advantages, returns)``, new tensors in the promoted dtype of rewards and values
    (the dtype TRL's loop gives). The scan accumulates in float32 (float64 for float64), so bf16
    inputs are rounded once, not at every step as in the loop. No host synchronisation: a batch
    with no response token at all gives advantages that are all 0 (TRL's ``masked_var`` raises
    there), one with a single token NaN at that token (as TRL).

    Args:
        rewards: ``(batch, response_length)`` float tensor, as TRL holds it at that point (the KL
            rewards plus the score, 0 past each response).
        values: ``V[t]``, a float tensor of the rewards' shape (TRL's, already 0 past
            ``padding_mask_p1``).
        padding_mask: a bool (or integer) tensor of the rewards' shape and device, true on the
            padding tokens after each response's last token: the whitening leaves them out and
            their advantages are 0.
        gamma: the discount (``args.gamma``), a number or a tensor in [0, 1].
        lam: the GAE lambda (``args.lam``), a number or a tensor in [0, 1].
        padding_mask_p1: optional, as ``padding_mask`` but true from one token later: where given,
            rewards and values there are read as 0 first, for values that have not been filled
            yet (TRL has filled them, so in its trainer passing it changes nothing).
    """
    _check_pair(rewards, values, "rewards", "values")
    padding = _padding(padding_mask, rewards, "padding_mask")
    dtype = torch.promote_types(rewards.dtype, values.dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    if padding_mask_p1 is None:
        adv, returns = gae(rewards, values, gamma=gamma, lmbda=lam)
    else:
        past = _padding(padding_mask_p1, rewards, "padding_mask_p1")
        adv, returns = gae(rewards, values, mask=~past, mask_mode="pad", gamma=gamma, lmbda=lam)
    masked_whiten(adv, ~padding, out=adv)
    return adv.masked_fill_(padding, 0), returns


@torch.no_grad()
def whiten_rewards(rewards, padding_mask_p1):
    """TRL's step "5. whiten rewards" (``args.whiten_rewards``).

    The rewards scaled by the statistics of the tokens up to one past each response's end
    (``~padding_mask_p1``: mean and unbiased variance, ``rsqrt(var + 1e-8)``) with the mean kept
    (``shift_mean=False``), then 0 where ``padding_mask_p1``:
    ``y = (r - mean) * rsqrt(var + 1e-8) + mean``. Returns a new tensor of the rewards' dtype.

    Args:
        rewards: ``(batch, response_length)`` float tensor.
        padding_mask_p1: a bool (or integer) tensor of the rewards' shape and device, true from
            one token past each response's end: left out of the statistics and set to 0.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be a (batch, response_length) tensor, got shape {tuple(rewards.shape)}")
    past = _padding(padding_mask_p1, rewards, "padding_mask_p1")
    out = masked_whiten(rewards, ~past, shift_mean=False)
    return out.masked_fill_(past, 0)
