"""The differentiable affine scan on ``[R, T]`` rows, and the public ``affine_scan``.

    reverse: y[t] = alpha[t] + beta[t] * y[t+1],  y[T]  = carry
    forward: y[t] = alpha[t] + beta[t] * y[t-1],  y[-1] = carry

The adjoint of a linear recurrence is the same recurrence run the other way, so the backward
pass is one more scan on the same backend (and is itself differentiable).
"""

from __future__ import annotations

from numbers import Real

import torch

from . import inputs, launch


def _shift(x, reverse, fill):
    """x[t+1] (reverse) or x[t-1] (forward) along time, ``fill`` [R] at the open end."""
    fill = fill.unsqueeze(1)
    return torch.cat([x[:, 1:], fill], 1) if reverse else torch.cat([fill, x[:, :-1]], 1)


class _AffineScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, alpha, beta, carry, reverse, backend):
        y = launch.scan_rows(alpha, beta, carry, reverse, backend)
        ctx.save_for_backward(beta, carry, y)
        ctx.reverse, ctx.backend = reverse, backend
        return y

    @staticmethod
    def backward(ctx, gy):
        beta, carry, y = ctx.saved_tensors
        reverse = ctx.reverse
        zero = torch.zeros_like(carry)
        # lam[t] = dL/dy[t] in total: the scan in the other direction with beta shifted by one
        lam = scan(gy, _shift(beta, not reverse, zero), zero, not reverse, ctx.backend)
        g_beta = lam * _shift(y, reverse, carry)
        edge = -1 if reverse else 0
        g_carry = lam[:, edge] * beta[:, edge]
        return lam, g_beta, g_carry, None, None


def scan(alpha, beta, carry, reverse: bool, backend: str):
    """Differentiable affine scan of ``[R, T]`` float tensors (``carry``: ``[R]``)."""
    if alpha.shape[1] == 0:  # the empty result, still part of the graph of every input
        return alpha + beta + carry[:, None][:, :0]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (alpha, beta, carry)):
        return _AffineScan.apply(alpha, beta, carry, reverse, backend)
    return launch.scan_rows(alpha, beta, carry, reverse, backend)


def affine_scan(alpha, beta, *, reverse=True, initial=None, time_dim=-1, backend=None, out=None):
    """Solve ``y[t] = alpha[t] + beta[t] * y[t+1]`` (``reverse=True``, ``y[T] = initial``) or
    ``y[t] = alpha[t] + beta[t] * y[t-1]`` (``reverse=False``, ``y[-1] = initial``) along ``time_dim``.

    ``alpha`` and ``beta`` broadcast to one shape (``beta`` may be a number); ``initial`` (default 0)
    has that shape without the time dim. Differentiable in every tensor argument.
    """
    inputs.check_tensor(alpha, "alpha")
    if isinstance(beta, Real) and not isinstance(beta, bool):
        beta = torch.tensor(float(beta), dtype=alpha.dtype, device=alpha.device)
    elif not isinstance(beta, torch.Tensor):
        raise TypeError(f"beta must be a number or a torch.Tensor, got {type(beta).__name__}")
    inputs.check_tensor(beta, "beta")
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    try:
        shape = torch.broadcast_shapes(alpha.shape, beta.shape)
    except RuntimeError:
        raise ValueError(f"alpha {tuple(alpha.shape)} and beta {tuple(beta.shape)} do not broadcast") from None
    ref = alpha if alpha.shape == shape else alpha.expand(shape)
    rows = inputs.Rows(ref, "alpha", time_dim, alpha.dtype)
    rows.value(beta, "beta")
    if initial is not None:
        rows.value(initial, "initial", shape=rows.row_shape)
    if out is not None:
        rows.check_out(out, "out")
        if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (alpha, beta, initial)):
            raise ValueError("out= does not support autograd; call without out= to get gradients")
    backend = launch.resolve_backend(backend, rows.device)
    cd = inputs.compute_dtype(alpha.dtype)
    a = rows.rows(alpha).to(cd)
    b = rows.rows(beta).to(cd)
    c = (rows.per_row(initial).to(cd) if initial is not None
         else torch.zeros(rows.R, dtype=cd, device=rows.device))
    return rows.deliver(scan(a, b, c, reverse, backend), out)
