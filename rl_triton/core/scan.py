"""The affine scan on ``[R, T]`` rows: backend choice, the per-backend scans, autograd.

    reverse: y[t] = alpha[t] + beta[t] * y[t+1],  y[T]  = carry
    forward: y[t] = alpha[t] + beta[t] * y[t-1],  y[-1] = carry

The adjoint of a linear recurrence is the same recurrence run the other way, so the backward
pass is one more scan on the same backend (and is itself differentiable).
"""

from __future__ import annotations

import torch

from . import cpu, inputs

BACKENDS = ("auto", "triton", "cpu", "torch")


def triton_usable(device: torch.device) -> bool:
    """Triton runs CUDA tensors, or CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    from . import kernels

    if not kernels.AVAILABLE:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and kernels.INTERPRET


_resolved: dict = {}


def resolve_backend(backend, device: torch.device) -> str:
    """Pick the backend for tensors on ``device``; ``None`` reads ``RL_TRITON_BACKEND``."""
    if backend is None:
        backend = inputs.env("RL_TRITON_BACKEND") or "auto"
    key = (backend, device.type)
    if key not in _resolved:
        _resolved[key] = _resolve(backend, device)
    return _resolved[key]


def _resolve(backend, device: torch.device) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    name = backend.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if name == "auto":
        if device.type == "cuda" and triton_usable(device):
            return "triton"
        if device.type == "cpu" and cpu.AVAILABLE:
            return "cpu"
        return "torch"
    if name == "cpu":
        if not cpu.AVAILABLE:
            raise ValueError("backend='cpu' needs numba: pip install 'rl-triton[cpu]'")
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' runs CPU tensors, got tensors on {device}")
    if name == "triton" and not triton_usable(device):
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}"
        )
    return name


def _scan_torch(alpha, beta, carry, reverse):
    y = torch.empty_like(alpha)
    acc = carry
    steps = range(alpha.shape[1] - 1, -1, -1) if reverse else range(alpha.shape[1])
    for t in steps:
        acc = torch.addcmul(alpha[:, t], beta[:, t], acc)
        y[:, t] = acc
    return y


def _scan_raw(alpha, beta, carry, reverse, backend):
    """y for float tensors alpha, beta [R, T] and carry [R], no autograd."""
    if backend == "cpu":
        y = torch.empty(alpha.shape, dtype=alpha.dtype)
        cpu.run("affine_scan", alpha.dtype, alpha, beta, carry, bool(reverse), y)
        return y
    if backend == "triton":
        from . import kernels

        return kernels.affine_scan(alpha, beta, carry, reverse)
    return _scan_torch(alpha, beta, carry, reverse)


def _shift(x, reverse, fill):
    """x[t+1] (reverse) or x[t-1] (forward) along time, ``fill`` [R] at the open end."""
    fill = fill.unsqueeze(1)
    return torch.cat([x[:, 1:], fill], 1) if reverse else torch.cat([fill, x[:, :-1]], 1)


def _scan_op(alpha, beta, carry, reverse, backend):
    if torch.compiler.is_compiling():
        from . import ops

        return ops.affine_scan_rows(alpha, beta, carry, reverse, backend)
    return _scan_raw(alpha, beta, carry, reverse, backend)


class _AffineScan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, alpha, beta, carry, reverse, backend):
        y = _scan_op(alpha, beta, carry, reverse, backend)
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
    if alpha.shape[1] == 0:
        return alpha.clone()
    if torch.is_grad_enabled() and any(t.requires_grad for t in (alpha, beta, carry)):
        return _AffineScan.apply(alpha, beta, carry, reverse, backend)
    return _scan_op(alpha, beta, carry, reverse, backend)


def affine_scan(alpha, beta, *, reverse=True, initial=None, time_dim=-1, backend=None, out=None):
    """Solve ``y[t] = alpha[t] + beta[t] * y[t+1]`` (``reverse=True``, ``y[T] = initial``) or
    ``y[t] = alpha[t] + beta[t] * y[t-1]`` (``reverse=False``, ``y[-1] = initial``) along ``time_dim``.

    ``alpha`` and ``beta`` broadcast to one shape; ``initial`` (default 0) has that shape without
    the time dim. Differentiable in every tensor argument.
    """
    inputs.check_tensor(alpha, "alpha")
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
    backend = resolve_backend(backend, rows.device)
    cd = inputs.compute_dtype(alpha.dtype)
    a = rows.rows(alpha).to(cd)
    b = rows.rows(beta).to(cd)
    c = (rows.per_row(initial).to(cd) if initial is not None
         else torch.zeros(rows.R, dtype=cd, device=rows.device))
    return rows.deliver(scan(a, b, c, reverse, backend), out)
