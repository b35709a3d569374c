"""The problems the GPU benchmark times, and the peer implementations timed beside rl_triton.

Every problem is one estimator on an R x T rollout (batch-major, 2% dones, float32). Peers:

- per-step torch loop: ``backend="torch"`` (vectorised over rows, a Python loop over time);
- torch.compile, doubling scan: the same coefficients and epilogue as torch ops with the
  recurrence solved by a log-depth Hillis-Steele doubling scan, the whole call compiled;
- torch.compile, inductor associative_scan: the same with
  ``torch._higher_order_ops.associative_scan`` as the scan;
- TorchRL's functionals where TorchRL has the algorithm (GAE loop and vec, TD(lambda) loop and
  vec, V-trace), when torchrl is installed;
- given a peers folder (:func:`load_external_peers`): the seed library rl-triton 0.1.3 (Triton,
  imported as ``rl_triton_seed``) for every algorithm, and PufferLib 3.0.0's CUDA advantage
  kernel for GAE. Both take float32 flags, made once with the rest of their inputs; where their
  conventions differ from the problem's, the inputs are chosen so that they compute the
  problem exactly, and the name says how (``Problem._seed``, ``Problem._pufferlib``).

The problems come from rl_triton.testing's catalog (its "done" variants). Each
implementation is checked on the first rows against the float64 oracle before it is timed; a
wrong one is reported as wrong and not timed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
from typing import Any, Optional

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
SEED, PUFFERLIB = "rl-triton 0.1.3 seed", "PufferLib 3.0.0 CUDA"


@dataclasses.dataclass
class ExternalPeers:
    """The peers loaded from a peers folder: the seed library's module and PufferLib's advantage
    op, each None when absent."""

    seed: Any = None
    puff_advantage: Any = None


def load_external_peers(folder: Optional[str], pufferlib: bool = True) -> ExternalPeers:
    """Import the seed library (``rl_triton_seed/``) and, with ``pufferlib``, build PufferLib's
    advantage kernel (``pufferlib_ext/``, compiled by torch.utils.cpp_extension on first use, about
    a minute) from ``folder``, which goes on sys.path. Prints one line for each peer that is
    absent: no folder given, or its import or build failed."""
    out = ExternalPeers()
    if not folder:
        print(f"{SEED} and {PUFFERLIB} peers: absent (no peers folder given)", flush=True)
        return out
    folder = os.path.abspath(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)

    def absent(name, e):
        first_line = (str(e).strip().splitlines() or [""])[0]
        print(f"{name} peer: absent ({type(e).__name__}: {first_line})", flush=True)

    try:
        import rl_triton_seed

        out.seed = rl_triton_seed
    except Exception as e:
        absent(SEED, e)
    if not pufferlib:
        return out
    try:
        from pufferlib_ext.build import load_puff_advantage

        out.puff_advantage, _ = load_puff_advantage()
    except Exception as e:
        absent(PUFFERLIB, e)
    return out


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
        """``algo``: a function name, or ``retrace:TRACE`` for Retrace's other traces (the catalog's
        variant of that name); the problem has done flags (the trace variants: the catalog's)."""
        self.algo, self.R, self.T = algo, R, T
        fn, _, trace = algo.partition(":")
        lmbda = {"gae": LMBDA, "td_lambda_return": LMBDA, "eligibility_trace": TRACE_LMBDA}.get(fn)
        self.problem = testing.make(fn, (R, T), trace or "done", dtype=dtype, device=device, seed=R * 7 + T,
                                    p_trunc=0.0, gamma=GAMMA, lmbda=lmbda)
        # the per-step inputs: float tensors, and flags (bytes per step)
        steps = [x for x in (*self.problem.args, *self.problem.kwargs.values())
                 if isinstance(x, torch.Tensor) and x.numel() == R * T]
        self.floats_in = sum(x.is_floating_point() for x in steps)
        self.flag_bytes = sum(x.element_size() for x in steps if not x.is_floating_point())
        self.element_size = torch.tensor([], dtype=dtype).element_size()
        self.nbytes = self.nbytes_with({"gae": 2, "vtrace": 2}.get(fn, 1))

    def nbytes_with(self, n_outputs: int) -> int:
        """The fewest bytes of this problem for an implementation that writes ``n_outputs``
        outputs: every per-step input read once (flags at their size), every output written once."""
        return self.R * self.T * ((self.floats_in + n_outputs) * self.element_size + self.flag_bytes)

    def call(self, backend=None):
        """rl_triton's call: a tuple of outputs."""
        return self.problem.call(backend)

    def expected(self, rows: int):
        """The float64 oracle's outputs for the first ``rows`` rows (hyperparameters in float32)."""
        return self.problem.head(rows).expected()

    def peers(self, compiled: bool = True, loop_max_T: int = 4096,
              external: Optional[ExternalPeers] = None) -> dict:
        """name -> callable returning the outputs in rl_triton's order (a peer that returns
        fewer outputs, e.g. advantages only, is checked on those). Per-step Python loops are
        left out above ``loop_max_T`` steps (seconds per call); ``compiled=False`` leaves out the
        torch.compile peers (each shape costs a compilation); ``external`` adds the seed
        library's and PufferLib's implementations that it holds."""
        out = {}
        if self.T <= loop_max_T:
            out["per-step torch loop"] = lambda: self.call("torch")
        if compiled:
            out["torch.compile, doubling scan"] = _compiled_peer(self.call, doubling_scan)
            out["torch.compile, inductor associative_scan"] = _compiled_peer(self.call, assoc_scan)
        out.update(self._torchrl(loops=self.T <= loop_max_T))
        if external is not None and external.seed is not None:
            out.update(self._seed(external.seed))
        if external is not None and external.puff_advantage is not None:
            out.update(self._pufferlib(external.puff_advantage))
        return out

    def _seed(self, seed) -> dict:
        """The seed library's function for this algorithm, called as its users call it: batch-major
        float32 tensors, float flags (``done`` is a termination, which the seed calls
        ``terminateds``), no truncations, backward scans bootstrapped from 0 at the window end (the
        problem has no bootstrap value), except where the name says otherwise."""
        args, kw = self.problem.args, self.problem.kwargs
        done = kw["done"].float()
        if self.algo == "gae":
            r, v = args
            return {f"{SEED} (advantages only)":
                    lambda: (seed.compute_gae(r, v, done, gamma=GAMMA, lambda_=LMBDA),)}
        if self.algo == "td_lambda_return":
            # G[T-1] takes gamma * lambda * bootstrap_values[:, -1] where ours takes the same weight of
            # next_values[:, -1] (the window end bootstraps from the last next value)
            r, nv = args
            boot = torch.zeros_like(r)
            boot[:, -1] = nv[:, -1]
            return {f"{SEED} (bootstrap_values[:, -1] = next_values[:, -1])":
                    lambda: (seed.compute_lambda_returns(r, nv, done, gamma=GAMMA, lambda_=LMBDA,
                                                         bootstrap_values=boot),)}
        if self.algo == "discounted_return":
            r, = args
            return {SEED: lambda: (seed.compute_discounted_returns(r, done, gamma=GAMMA),)}
        if self.algo == "vtrace":
            r, v, log_pi, log_mu = args
            return {SEED: lambda: seed.compute_vtrace(log_pi, log_mu, v, r, done, gamma=GAMMA, rho_bar=1.0, c_bar=1.0)}
        if self.algo == "retrace":
            # the seed takes the target policy over all actions, the behaviour probability of the
            # taken action and Q(s_{t+1}, .) per action; one action with pi = exp(log_pi),
            # mu = exp(log_mu) and Q(s_{t+1}, 0) = next_expected_q / pi gives our ratio
            # exp(log_pi - log_mu) and pi . Q(s_{t+1}, .) = next_expected_q
            r, q, log_pi, log_mu = args
            pi = log_pi.exp()[..., None]
            mu = log_mu.exp()
            next_q = kw["next_expected_q"][..., None] / pi
            actions = torch.zeros(r.shape, dtype=torch.int64, device=r.device)
            no_trunc = torch.zeros_like(done)
            return {f"{SEED} (also writes advantages; one action, pi = exp(log_pi))":
                    lambda: seed.compute_retrace(pi, mu, q, next_q, actions, r, done, no_trunc, gamma=GAMMA,
                                                 lambda_=1.0, c_bar=1.0)[:1]}
        if self.algo == "eligibility_trace":
            x, = args
            return {SEED: lambda: (seed.compute_eligibility_traces(x, done, GAMMA, TRACE_LMBDA),)}
        if self.algo == "episodic_cumsum":
            x, = args
            return {SEED: lambda: (seed.compute_episodic_prefix_sum(x, done),)}
        return {}

    def _pufferlib(self, op) -> dict:
        """PufferLib's advantage kernel for GAE, called as PufferLib's trainer calls it: a zeroed
        advantages tensor, then the op (importance 1, clips 1: plain GAE).

        PufferLib's buffers are observation-aligned: column t holds observation t's value and the
        reward and done that arrived with it, and the kernel writes the advantages of columns
        0..H-2 of an H-column buffer. Our T steps are therefore given as T + 1 columns: values
        followed by the value after the window (0, our problem's bootstrap), rewards and dones
        one column later; columns 0..T-1 of its output are our advantages."""
        if self.algo != "gae":
            return {}
        r, v = self.problem.args
        R, T = r.shape
        values, rewards, dones = (torch.zeros(R, T + 1, device=r.device) for _ in range(3))
        values[:, :T] = v
        rewards[:, 1:] = r
        dones[:, 1:] = self.problem.kwargs["done"].float()
        importance = torch.ones_like(values)

        def run():
            advantages = torch.zeros(R, T + 1, device=r.device)
            op(values, rewards, dones, importance, advantages, GAMMA, LMBDA, 1.0, 1.0)
            return (advantages[:, :T],)

        return {f"{PUFFERLIB} (advantages only; T + 1 observation-aligned columns)": run}

    def _torchrl(self, loops: bool) -> dict:
        if self.algo not in ("gae", "td_lambda_return", "vtrace"):  # the algorithms TorchRL's functionals have
            return {}
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
    """Max of |y - ref| / (1 + |ref|) over the rows the oracle covers, for each output given (the
    first ``len(outputs)`` of the oracle's). ``outputs`` is a tuple or list of tensors, or one
    tensor (the functions of one output return it alone); NaN anywhere gives NaN."""
    if isinstance(outputs, torch.Tensor):
        outputs = (outputs,)
    if not outputs or len(outputs) > len(expected):
        raise ValueError(f"{len(outputs)} outputs to check against the oracle's {len(expected)}")
    worst = 0.0
    for y, ref in zip(outputs, expected):
        if tuple(y.shape[1:]) != tuple(ref.shape[1:]) or y.shape[0] < ref.shape[0]:
            raise ValueError(f"an output of shape {tuple(y.shape)} against the oracle's {ref.shape}")
        y = y[: ref.shape[0]].double().cpu().numpy()
        err = float(np.max(np.abs(y - ref) / (1.0 + np.abs(ref)))) if ref.size else 0.0
        if np.isnan(err):  # max() would drop it
            return err
        worst = max(worst, err)
    return worst
