"""The problems the GPU benchmark times, and the peer implementations timed beside rl_triton.

Every problem is one estimator on an R x T rollout (batch-major, 2% dones, float32). Peers:

- per-step torch loop: ``backend="torch"`` (vectorised over rows, a Python loop over time);
- torch.compile, doubling scan: the same coefficients and epilogue as torch ops with the
  recurrence solved by a log-depth Hillis-Steele doubling scan, the whole call compiled;
- torch.compile, inductor associative_scan: the same with
  ``torch._higher_order_ops.associative_scan`` as the scan;
- TorchRL's functionals where TorchRL has the algorithm (GAE loop and vec, TD(lambda) loop and
  vec, V-trace), when torchrl is installed.

Each implementation is checked on the first rows against the float64 oracle (tests/oracle.py)
before it is timed; a wrong one is reported as wrong and not timed.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

import oracle
import rl_triton as rt
from rl_triton.core import scan as _scan

GAMMA, LMBDA, TRACE_LMBDA = 0.99, 0.95, 0.9


def doubling_scan(alpha, beta, carry, reverse):
    """y[t] = alpha[t] + beta[t] * y[t+1] (reverse) by log2(T) doubling steps of torch ops."""
    edge = -1 if reverse else 0
    a = alpha.clone()
    a[:, edge] = a[:, edge] + beta[:, edge] * carry
    b = beta
    if not reverse:
        a, b = a.flip(1), b.flip(1)
    k = 1
    while k < a.shape[1]:
        a = a + b * F.pad(a[:, k:], (0, k))
        b = b * F.pad(b[:, k:], (0, k))
        k *= 2
    return a if reverse else a.flip(1)


def _affine_combine(earlier, later):
    # scan order runs from the window edge inwards: y = a_later + b_later * y_earlier
    return later[0] + later[1] * earlier[0], earlier[1] * later[1]


def assoc_scan(alpha, beta, carry, reverse):
    """The same recurrence through torch's associative_scan (compiled by inductor)."""
    from torch._higher_order_ops.associative_scan import associative_scan

    edge = -1 if reverse else 0
    a = alpha.clone()
    a[:, edge] = a[:, edge] + beta[:, edge] * carry
    b = beta
    if reverse:
        a, b = a.flip(1), b.flip(1)
    mode = "pointwise" if a.is_cuda else "generic"  # inductor's pointwise mode is GPU-only
    y, _ = associative_scan(_affine_combine, (a, b), dim=1, combine_mode=mode)
    return y.flip(1) if reverse else y


@contextlib.contextmanager
def scan_swapped(fn):
    """Route rl_triton's composed (backend="torch") path through another scan function."""
    original = _scan._scan_op
    _scan._scan_op = lambda alpha, beta, carry, reverse, backend: fn(alpha, beta, carry, reverse)
    try:
        yield
    finally:
        _scan._scan_op = original


def _compiled_peer(call, scan_fn):
    compiled = torch.compile(lambda: call("torch"))

    def run():
        with scan_swapped(scan_fn):
            return compiled()

    return run


class Problem:
    """One estimator on an R x T rollout: rl_triton's call, its bytes, its oracle, its peers."""

    def __init__(self, algo: str, R: int, T: int, device="cuda", dtype=torch.float32):
        self.algo, self.R, self.T = algo, R, T
        g = torch.Generator(device=device).manual_seed(R * 7 + T)

        def x(scale=1.0):
            return (torch.randn(R, T, device=device, generator=g) * scale).to(dtype)

        self.r, self.v, self.nv, self.lp, self.lm = x(), x(), x(), x(0.3), x(0.3)
        self.done = torch.rand(R, T, device=device, generator=g) < 0.02
        e = torch.tensor([], dtype=dtype).element_size()
        floats_in, floats_out = {"gae": (2, 2), "td_lambda_return": (2, 1), "discounted_return": (1, 1),
                                 "vtrace": (4, 2), "retrace": (5, 1)}.get(algo, (1, 1))
        self.nbytes = R * T * ((floats_in + floats_out) * e + 1)

    def call(self, backend=None):
        """rl_triton's call: a tuple of outputs."""
        r, v, nv, d, kw = self.r, self.v, self.nv, self.done, dict(backend=backend)
        if self.algo == "gae":
            return rt.gae(r, v, done=d, gamma=GAMMA, lmbda=LMBDA, **kw)
        if self.algo == "td_lambda_return":
            return (rt.td_lambda_return(r, nv, done=d, gamma=GAMMA, lmbda=LMBDA, **kw),)
        if self.algo == "discounted_return":
            return (rt.discounted_return(r, done=d, gamma=GAMMA, **kw),)
        if self.algo == "vtrace":
            return rt.vtrace(r, v, self.lp, self.lm, done=d, gamma=GAMMA, **kw)
        if self.algo == "retrace":
            return (rt.retrace(r, v, self.lp, self.lm, next_expected_q=nv, done=d, gamma=GAMMA, **kw),)
        if self.algo == "eligibility_trace":
            return (rt.eligibility_trace(r, done=d, gamma=GAMMA, lmbda=TRACE_LMBDA, **kw),)
        return (rt.episodic_cumsum(r, done=d, **kw),)

    def expected(self, rows: int):
        """The float64 oracle's outputs for the first ``rows`` rows (hyperparameters in float32)."""
        n = min(rows, self.R)
        f = {k: getattr(self, k)[:n].double().cpu().numpy() for k in ("r", "v", "nv", "lp", "lm")}
        d = self.done[:n].cpu().numpy()
        g, l = (np.full(d.shape, float(np.float32(x))) for x in (GAMMA, LMBDA))
        if self.algo == "gae":
            return oracle.gae(f["r"], f["v"], oracle.implied_next_values(f["v"]), d, d, g, l)
        if self.algo == "td_lambda_return":
            return (oracle.td_lambda_return(f["r"], f["nv"], d, d, g, l),)
        if self.algo == "discounted_return":
            return (oracle.discounted_return(f["r"], d, d, g),)
        if self.algo == "vtrace":
            return oracle.vtrace(f["r"], f["v"], oracle.implied_next_values(f["v"]), f["lp"], f["lm"], d, d, g,
                                 np.ones(d.shape), 1.0, 1.0, 1.0)
        if self.algo == "retrace":
            return (oracle.retrace(f["r"], f["v"], f["lp"], f["lm"], d, d, g, np.ones(d.shape), 1.0,
                                   next_expected_q=f["nv"]),)
        if self.algo == "eligibility_trace":
            return (oracle.eligibility_trace(f["r"], d, g, np.full(d.shape, float(np.float32(TRACE_LMBDA)))),)
        return (oracle.episodic_cumsum(f["r"], d),)

    def peers(self, compiled: bool = True, loop_max_T: int = 4096) -> dict:
        """name -> callable returning the outputs in rl_triton's order. Per-step Python loops are
        left out above ``loop_max_T`` steps (seconds per call); ``compiled=False`` leaves out the
        torch.compile peers (each shape costs a compilation)."""
        out = {}
        if self.T <= loop_max_T:
            out["per-step torch loop"] = lambda: self.call("torch")
        if compiled:
            out["torch.compile, doubling scan"] = _compiled_peer(self.call, doubling_scan)
            out["torch.compile, inductor associative_scan"] = _compiled_peer(self.call, assoc_scan)
        out.update(self._torchrl(loops=self.T <= loop_max_T))
        return out

    def _torchrl(self, loops: bool) -> dict:
        try:
            from torchrl.objectives.value import functional as trl
        except Exception:  # not installed, or built for another torch
            return {}
        col = lambda t: t[..., None]  # noqa: E731  TorchRL's [B, T, 1]
        r, v, d = col(self.r), col(self.v), col(self.done)
        nv_implied = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
        out = {}
        if self.algo == "gae":
            for name, fn in (("TorchRL GAE loop", trl.generalized_advantage_estimate),
                             ("TorchRL GAE vec", trl.vec_generalized_advantage_estimate)):
                if loops or "vec" in name:
                    out[name] = lambda fn=fn: tuple(x[..., 0] for x in fn(GAMMA, LMBDA, v, nv_implied, r, d))
        if self.algo == "td_lambda_return":
            for name, fn in (("TorchRL TD(lambda) loop", trl.td_lambda_return_estimate),
                             ("TorchRL TD(lambda) vec", trl.vec_td_lambda_return_estimate)):
                if loops or "vec" in name:
                    out[name] = lambda fn=fn: (fn(GAMMA, LMBDA, col(self.nv), r, d)[..., 0],)
        if self.algo == "vtrace" and loops:
            def vtrace():
                adv, vs = trl.vtrace_advantage_estimate(GAMMA, col(self.lp), col(self.lm), v, nv_implied, r, d)
                return vs[..., 0], adv[..., 0]

            out["TorchRL V-trace loop"] = vtrace
        return out


def max_error(outputs, expected) -> float:
    """Max of |y - ref| / (1 + |ref|) over the rows the oracle covers."""
    worst = 0.0
    for y, ref in zip(outputs, expected):
        y = y[: ref.shape[0]].double().cpu().numpy()
        worst = max(worst, float(np.max(np.abs(y - ref) / (1.0 + np.abs(ref)))) if ref.size else 0.0)
    return worst
