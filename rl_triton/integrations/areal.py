"""AReaL: one call instead of the GAE loop in ``PPOActor._compute_advantages`` (written against
areal 1.0.4, ``areal/trainer/ppo/actor.py``).

AReaL computes GAE inline in that method, between the KL-shaped rewards and the advantage
normalisation, on the actor workers' devices, so there is no function to patch: the loop from
``advantages_reversed = [...]`` to ``torch.stack(...)`` becomes::

    from rl_triton.integrations.areal import compute_gae

    advantages, data["returns"] = compute_gae(rewards, values, loss_mask, seq_no_eos_mask,
                                              self.discount, self.gae_lambda)

(docs/areal.md has the diff). Everything else in the method stays AReaL's.

Conventions mapped here: ``[bs, max_seqlen]`` tensors holding prompt and response, ``loss_mask``
the rolled float mask AReaL builds (1 where the next token is a generated one); the last column
gets advantage 0 and its value (times "the sequence has no EOS") bootstraps the step before it;
masked tokens carry the next value and the running advantage across (rl_triton's
``mask_mode="skip"``). The mask is read as a flag (0/1), where AReaL multiplies by it: for 0/1
masks and finite inputs the results agree.
"""

from __future__ import annotations

import torch

from .. import gae
from ..core.docstrings import documented
from ._llm import tensor_arg

__all__ = ["compute_gae"]


@documented(
    rewards="``[bs, max_seqlen]`` float tensor of token rewards (AReaL's KL-shaped rewards with the score added).",
    values="``[bs, max_seqlen]`` float tensor of values (zeros where AReaL has no critic).",
    loss_mask="``[bs, max_seqlen]`` 0/1 mask, AReaL's rolled ``loss_mask``: bool, integer or float.",
    seq_no_eos_mask=("``[bs]`` bool (or 0/1) tensor: the sequence fills the window without an EOS, so the last "
                     "column's value bootstraps the step before it."),
    discount="the discount: a number or a tensor in [0, 1].",
    gae_lambda="the GAE lambda: a number or a tensor in [0, 1].",
)
def compute_gae(rewards, values, loss_mask, seq_no_eos_mask, discount, gae_lambda):
    """AReaL's GAE: ``(advantages, returns)``, ``[bs, max_seqlen]``.

    ``rl_triton.gae(rewards, values, mask=loss_mask with its last column cleared,
    mask_mode="skip", bootstrap_value=values[:, -1] * seq_no_eos_mask, gamma=discount,
    lmbda=gae_lambda)``: the masked last column gets advantage 0 and carries the bootstrap to the
    step before it. Per row, backwards over t < max_seqlen - 1, with nv the
    bootstrap and A = 0 at first, delta = r[t] + discount*nv - V[t], A' = delta +
    discount*gae_lambda*A; where loss_mask[t] is set nv = V[t] and A = A', elsewhere both carry
    over; advantages[t] = A, returns = advantages + values.

    Computed in the promoted dtype of rewards, values, the mask and float32 (AReaL's last column
    is a float32 zero). Outputs never require grad.
    """
    with torch.no_grad():
        r = tensor_arg(rewards, "rewards")
        v = tensor_arg(values, "values")
        m = tensor_arg(loss_mask, "loss_mask")
        no_eos = tensor_arg(seq_no_eos_mask, "seq_no_eos_mask")
        if r.ndim != 2 or v.shape != r.shape or m.shape != r.shape:
            raise ValueError(f"rewards, values and loss_mask must be [bs, max_seqlen] of one shape, got "
                             f"{tuple(r.shape)}, {tuple(v.shape)} and {tuple(m.shape)}")
        if no_eos.shape != r.shape[:1]:
            raise ValueError(f"seq_no_eos_mask must be [bs] = {tuple(r.shape[:1])}, got {tuple(no_eos.shape)}")
        if r.shape[1] == 0:
            raise ValueError("rewards must have at least one column (AReaL's loop reads values[:, -1])")
        dtype = torch.promote_types(torch.promote_types(r.dtype, v.dtype), m.dtype)
        dtype = torch.promote_types(dtype, torch.float32)
        r, v = r.to(dtype), v.to(dtype)
        bootstrap = torch.where(no_eos != 0, v[:, -1], torch.zeros((), dtype=dtype, device=v.device))
        steps = m != 0
        steps[:, -1] = False  # the last column is no step: advantage 0, its value the bootstrap
        return gae(r, v, mask=steps, mask_mode="skip", bootstrap_value=bootstrap, gamma=discount, lmbda=gae_lambda)
