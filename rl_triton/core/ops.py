"""torch custom ops around the backend launches, so ``torch.compile(fullgraph=True)`` traces
the estimators without graph breaks (the kernels are opaque to the compiler, described to it
by fake implementations). Eager calls launch directly and skip the op dispatch.
"""

from __future__ import annotations

import math

import torch

from .signatures import kinds


def encode(args) -> tuple[list, list]:
    """Kernel arguments as an op schema can carry them: a tensor list and a number list
    (NaN marks an absent input)."""
    tensors, numbers = [], []
    for x in args:
        is_tensor = isinstance(x, torch.Tensor)
        tensors.append(x if is_tensor else None)
        numbers.append(0.0 if is_tensor else math.nan if x is None else float(x))
    return tensors, numbers


def decode(name: str, tensors, numbers) -> list:
    args = []
    for kind, x, n in zip(kinds(name), tensors, numbers):
        if x is not None:
            args.append(x)
        elif math.isnan(n):
            args.append(None)
        else:
            args.append(int(n) if kind == "i" else bool(n) if kind == "b" else n)
    return args


@torch.library.custom_op("rl_triton::fused", mutates_args=())
def fused(name: str, backend: str, compute: torch.dtype, tensors: list[torch.Tensor | None],
          numbers: list[float], like: torch.Tensor, time_dim: int, n_out: int) -> list[torch.Tensor]:
    """Run fused kernel ``name``; outputs are allocated like ``like`` (time at ``time_dim``)."""
    from . import cpu, kernels

    outs = [torch.empty_like(like) for _ in range(n_out)]
    R, T = tensors[0].shape[:2]
    dtype = compute if backend == "cpu" else like.dtype
    views = []
    for o in outs:
        moved = o.movedim(time_dim, -1)
        try:
            views.append((moved, moved.view(R, T) if o.dtype == dtype else None))
        except RuntimeError:
            views.append((moved, None))
    buffers = [v if v is not None else torch.empty(R, T, dtype=dtype, device=like.device) for _, v in views]
    args = decode(name, tensors, numbers)
    if backend == "cpu":
        cpu.run(name, compute, *args, *buffers)
    else:
        kernels.run(name, *args, *buffers)
    for (moved, v), b in zip(views, buffers):
        if v is None:
            moved.copy_(b.reshape(moved.shape))
    return outs


@fused.register_fake
def _(name, backend, compute, tensors, numbers, like, time_dim, n_out):
    return [torch.empty_like(like) for _ in range(n_out)]


@torch.library.custom_op("rl_triton::affine_scan_rows", mutates_args=())
def affine_scan_rows(alpha: torch.Tensor, beta: torch.Tensor, carry: torch.Tensor, reverse: bool,
                     backend: str) -> torch.Tensor:
    """The affine scan of ``[R, T]`` rows (the differentiable path's forward and backward)."""
    from .scan import _scan_raw

    return _scan_raw(alpha, beta, carry, reverse, backend)


@affine_scan_rows.register_fake
def _(alpha, beta, carry, reverse, backend):
    return torch.empty(alpha.shape, dtype=alpha.dtype, device=alpha.device)
