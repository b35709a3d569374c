"""The differentiable affine scan on ``[R, T]`` rows, and the public ``affine_scan``.

    reverse: y[t] = alpha[t] + beta[t] * y[t+1],  y[T]  = carry
    forward: y[t] = alpha[t] + beta[t] * y[t-1],  y[-1] = carry

The adjoint of a linear recurrence is the same recurrence run the other way, so the backward
pass is one more scan on the same backend (and is itself differentiable).
"""

from __future__ import annotations

from numbers import Real

import torch

from . import inputs, launch, routes, sharded, spec
from .call import Call
from .docstrings import documented


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


def call_scan(c: Call, alpha, beta, carry, reverse: bool):
    """A call's composed-path scan from ``carry`` (the chunk's, in a sharded call), reporting
    the edge map where the chunk asks for one."""
    y = scan(alpha, beta, c.carry(carry), reverse, c.backend)
    c.edge_map(y, beta, reverse)
    return y


@routes.public(sharded.AFFINE_SCAN)
@documented(
    alpha=("``alpha[t]``: a float16, bfloat16, float32 or float64 tensor with time at ``time_dim``. ``alpha`` and "
           "``beta`` broadcast to one shape, which the output has, with ``alpha``'s dtype and device."),
    beta=("``beta[t]``: a tensor of ``alpha``'s dtype and device, or a Python number, applied in float32 "
          "(float64 for float64 ``alpha``) as a number ``gamma`` is. Where ``beta[t]`` is 0 the neighbouring "
          "``y`` is not read (semantics section 11)."),
    reverse="a bool: True runs backward in time from ``y[T] = initial``, False forward from ``y[-1] = initial``.",
    initial=("``y[T]`` (reverse) or ``y[-1]`` (forward) per row: the broadcast shape without the time dim "
             "(broadcastable), ``alpha``'s dtype. None: 0."),
)
def affine_scan(alpha, beta, *, reverse=True, initial=None, time_dim=-1, backend=None, out=None, cu_seqlens=None,
                max_seqlen=None, group=None, _chunk=None):
    """Solve ``y[t] = alpha[t] + beta[t] * y[t+1]`` (``reverse=True``, ``y[T] = initial``) or
    ``y[t] = alpha[t] + beta[t] * y[t-1]`` (``reverse=False``, ``y[-1] = initial``) along ``time_dim``.

    Differentiable in every tensor argument. Returns ``y``.
    """
    inputs.check_tensor(alpha, "alpha")
    number = isinstance(beta, Real) and not isinstance(beta, bool)
    if number:  # applied in the compute dtype, as the estimators apply a number gamma
        beta = float(beta)
        beta_t = torch.tensor(beta, dtype=inputs.compute_dtype(alpha.dtype), device=alpha.device)
    elif isinstance(beta, torch.Tensor):
        beta_t = inputs.check_tensor(beta, "beta")
    else:
        raise TypeError(f"beta must be a number or a torch.Tensor, got {type(beta).__name__}")
    if not isinstance(reverse, bool):
        raise TypeError(f"reverse must be a bool, got {type(reverse).__name__}")
    try:
        shape = torch.broadcast_shapes(alpha.shape, beta_t.shape)
    except RuntimeError:
        raise ValueError(f"alpha {tuple(alpha.shape)} and beta {tuple(beta_t.shape)} do not broadcast") from None
    c = Call(alpha if alpha.shape == shape else alpha.expand(shape), "alpha", time_dim, chunk=_chunk)
    if not number:
        c.value(beta_t, "beta")
    c.per_row(initial, "initial")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:  # the kernels read alpha and beta in any float dtype; a number beta is a constant
        return c.bind(spec.AFFINE_SCAN, alpha=c.view(alpha), beta=beta if number else c.view(beta),
                      carry=c.row_view(initial), reverse=reverse)
    return c.results([call_scan(c, c.float_rows(alpha), c.float_rows(beta_t), c.float_row(initial), reverse)])
