"""Argument checks shared by the LLM frameworks' drop-ins (verl, SkyRL)."""

from __future__ import annotations

import torch


def tensor_arg(x, name: str) -> torch.Tensor:
    """``x`` where it is a tensor; ``TypeError`` naming the argument ``name`` otherwise."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return x


def require_two_valid(response_mask: torch.Tensor) -> None:
    """``ValueError`` where ``response_mask`` has fewer than 2 nonzero tokens: the frameworks'
    unbiased whitening (verl's and SkyRL's ``masked_var``) divides by n - 1 and refuses n < 2.
    One host sync, as the frameworks' own check makes."""
    n = int(torch.count_nonzero(response_mask))
    if n < 2:
        raise ValueError(f"response_mask has {n} valid token(s); whitening over the valid tokens needs at least 2 "
                         "(an unbiased variance divides by n - 1)")
