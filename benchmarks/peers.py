"""The problems the GPU benchmark times, and the peer implementations timed beside rl_triton.

Every problem is one estimator on an R x T rollout (batch-major, 2% dones, float32). Peers:

- per-step torch loop: ``backend="torch"`` (vectorised over rows, a Python loop over time);
- torch.compile, doubling scan: the same coefficients and epilogue as torch ops with the
  recurrence solved by a log-depth Hillis-Steele doubling scan, the whole call compiled;
- torch.compile, inductor associative_scan: the same with
  ``torch._higher_order_ops.associative_scan`` as the scan;
- TorchRL's functionals where TorchRL has the algorithm (GAE loop and vec, TD(lambda) loop and
  vec, V-trace), when torchrl is installed.

The problems come from rl_triton.testing's catalog (its "done" variants). Each
implementation is checked on the first rows against the float64 oracle before it is timed; a
wrong one is reported as wrong and not timed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

import rl_triton

_TESTING = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rl_triton", "testing")
if os.path.samefile(os.path.dirname(rl_triton.__file__), os.path.dirname(_TESTING)):
    import rl_triton.testing as testing
else:
    # rl_triton of another checkout (device_times.py --root, host_overhead.py with PYTHONPATH), which
    # may predate rl_triton.testing: this checkout's package under that name, so every version runs
    # the same problems (the catalog calls only rl_triton's public functions)
    _spec = importlib.util.spec_from_file_location("rl_triton.testing", os.path.join(_TESTING, "__init__.py"),
                                                   submodule_search_locations=[_TESTING])
    testing = sys.modules["rl_triton.testing"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(testing)

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
    from rl_triton.core import launch

    original = launch.scan_rows
    launch.scan_rows = lambda alpha, beta, carry, reverse, backend: fn(alpha, beta, carry, reverse)
    try:
        yield
    finally:
        launch.scan_rows = original


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
        lmbda = {"gae": LMBDA, "td_lambda_return": LMBDA, "eligibility_trace": TRACE_LMBDA}.get(algo)
        self.problem = testing.make(algo, (R, T), "done", dtype=dtype, device=device, seed=R * 7 + T, p_trunc=0.0,
                                    gamma=GAMMA, lmbda=lmbda)
        e = torch.tensor([], dtype=dtype).element_size()
        floats_in, floats_out = {"gae": (2, 2), "td_lambda_return": (2, 1), "discounted_return": (1, 1),
                                 "vtrace": (4, 2), "retrace": (5, 1)}.get(algo, (1, 1))
        self.nbytes = R * T * ((floats_in + floats_out) * e + 1)

    def call(self, backend=None):
        """rl_triton's call: a tuple of outputs."""
        return self.problem.call(backend)

    def expected(self, rows: int):
        """The float64 oracle's outputs for the first ``rows`` rows (hyperparameters in float32)."""
        return self.problem.head(rows).expected()

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
        args = self.problem.args
        r, v, d = col(args[0]), col(args[1]), col(self.problem.kwargs["done"])
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
                    out[name] = lambda fn=fn: (fn(GAMMA, LMBDA, v, r, d)[..., 0],)  # v: the next values here
        if self.algo == "vtrace" and loops:
            def vtrace():
                adv, vs = trl.vtrace_advantage_estimate(GAMMA, col(args[2]), col(args[3]), v, nv_implied, r, d)
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
