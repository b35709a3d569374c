"""Non-finite values (docs/semantics.md, "Non-finite values and aliasing").

First, hand-worked cases on every backend: a NaN log-probability survives the clip, and an inf
or NaN of a terminal state, of the next episode or beyond a zero coefficient does not reach the
steps before it (the term that would carry it is absent, not ``0 * inf``). They use the public
functions only.

Then a property test: NaN, +inf and -inf at random positions of every float data input, random
flags in every style, gamma and lambda from {0, 0.5, 0.9, 1}; every backend gives the oracle's
NaN / +inf / -inf pattern and its finite values, and leaves the inputs as they were.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import FLAG_KINDS, Layout, assert_matches, flags, make_flag_with_layout, make_tensor, n_examples
from rl_triton.core import kernels
from rl_triton.testing import Problem
from rl_triton.testing.catalog import as_f64, from_rows

# inf and NaN arithmetic is the point here (the Triton interpreter computes with numpy)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
NAN, INF = math.nan, math.inf


def _row(xs, dtype=torch.float32):
    return torch.tensor([xs], dtype=dtype)


def _check(got, expected):
    """got: one [1, T] tensor; NaN where expected is NaN, the same infinities, close elsewhere."""
    want = torch.tensor([expected], dtype=torch.float64)
    torch.testing.assert_close(got.detach().double(), want, rtol=1e-6, atol=1e-6, equal_nan=True)


# --------------------------------------------------------------------------------------
# a NaN log-probability: the clip keeps it (docs/semantics.md, section 6.4 and 6.5)
# --------------------------------------------------------------------------------------
# r = 1, v = q = ev = 0, log_pi = log_mu = -1 except log_pi[2] = NaN; gamma = 0.99, lambda = 1,
# thresholds 1 (or inf): ratio = 1 (NaN at t = 2).
# V-trace: (vs - v)[4] = 1, [3] = 1 + 0.99 * 1 = 1.99, [2] = NaN (rho NaN), [1], [0] = NaN
#   through c = 1.
# Retrace: Q[4] = 1, Q[3] = 1 + 0.99 * (0 + 1 * (1 - 0)) = 1.99, Q[2] = 1 + 0.99 * 1.99 = 2.9701,
#   Q[1] = NaN (c[2] NaN), Q[0] = NaN.
VTRACE_NAN = [NAN, NAN, NAN, 1.99, 1.0]
RETRACE_NAN = [NAN, NAN, 2.9701, 1.99, 1.0]
CLIPS = {"clipped": 1.0, "unclipped": INF}  # rho_bar and c_bar


def _nan_log_pi(requires_grad):
    r, v = torch.ones(1, 5), torch.zeros(1, 5)
    lm = torch.full((1, 5), -1.0)
    lp = lm.clone()
    lp[0, 2] = NAN
    if requires_grad:
        for x in (r, v, lp, lm):
            x.requires_grad_(True)
    return r, v, lp, lm


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "requires_grad"])
@pytest.mark.parametrize("clips", list(CLIPS))
def test_vtrace_keeps_a_nan_log_prob(backend, rt, clips, requires_grad):
    r, v, lp, lm = _nan_log_pi(requires_grad)
    _check(rt.vtrace(r, v, lp, lm, rho_bar=CLIPS[clips], c_bar=CLIPS[clips], backend=backend)[0], VTRACE_NAN)


@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain", "requires_grad"])
@pytest.mark.parametrize("clips", list(CLIPS))
def test_retrace_keeps_a_nan_log_prob(backend, rt, clips, requires_grad):
    r, q, lp, lm = _nan_log_pi(requires_grad)
    _check(rt.retrace(r, q, lp, lm, next_expected_q=torch.zeros(1, 5), c_bar=CLIPS[clips], backend=backend),
           RETRACE_NAN)


# --------------------------------------------------------------------------------------
# nothing crosses a done, nothing is read through a zero coefficient
# --------------------------------------------------------------------------------------
# One episode ends at t = 1 (done = terminated there unless said otherwise); the next one holds
# an inf. Steps 0 and 1 must not see it (the terms that would carry it are absent, not 0 * inf).
DONE = [False, True, False, False]


def _done():
    return _row(DONE, torch.bool)


def _discounted(rt, b):
    # R[3] = 1 ; R[2] = inf + 0.5 * 1 = inf ; R[1] = 1 (terminated) ; R[0] = 1 + 0.5 * 1 = 1.5
    return rt.discounted_return(_row([1, 1, INF, 1]), done=_done(), gamma=0.5, backend=b), [1.5, 1.0, INF, 1.0]


def _cumsum(rt, b):
    # c = [1, 1 + inf, 1 (fresh after the done), 1 + 1]
    return rt.episodic_cumsum(_row([1, INF, 1, 1]), done=_done(), backend=b), [1.0, INF, 1.0, 2.0]


def _gae_reward(rt, b):
    # v = 0, so delta = r: A[3] = 1, A[2] = inf + 0.5 * 1 = inf, A[1] = 1 (done), A[0] = 1 + 0.5 * 1
    adv, tgt = rt.gae(_row([1, 1, INF, 1]), _row([0, 0, 0, 0]), done=_done(), gamma=0.5, lmbda=1.0, backend=b)
    return torch.cat([adv, tgt]), [[1.5, 1.0, INF, 1.0]] * 2


def _gae_terminal_value(rt, b):
    # v[2] = inf is V(s_2), the terminal successor of step 1: delta[1] = 1 - 0 (no bootstrap term),
    # delta[2] = 1 - inf = -inf, A[2] = -inf, A[1] = 1, A[0] = 1 + 0.5 * 0 - 0 + 0.5 * 1 = 1.5;
    # targets = A + v: [1.5, 1, -inf + inf = NaN, 1]
    adv, tgt = rt.gae(_row([1, 1, 1, 1]), _row([0, 0, INF, 0]), done=_done(), gamma=0.5, lmbda=1.0, backend=b)
    return torch.cat([adv, tgt]), [[1.5, 1.0, -INF, 1.0], [1.5, 1.0, NAN, 1.0]]


def _td_lambda(rt, b):
    # nv[1] = inf is the terminal state's value (absent); lambda = 0.5:
    # G[3] = 1 + 0.5 * 0.5 * 0 + 0.25 * nv[3] = 1 ; G[2] = inf ; G[1] = r = 1 (terminated) ;
    # G[0] = 1 + 0.5 * 0.5 * nv[0] + 0.25 * G[1] = 1.25
    return (rt.td_lambda_return(_row([1, 1, INF, 1]), _row([0, INF, 0, 0]), done=_done(), gamma=0.5, lmbda=0.5,
                                backend=b), [1.25, 1.0, INF, 1.0])


def _td_lambda_truncated(rt, b):
    # truncated at t = 1 with nv[1] = 2: G[1] = 1 + 0.5 * 2 = 2 ; G[0] = 1 + 0.25 * 0 + 0.25 * 2 = 1.5
    return (rt.td_lambda_return(_row([1, 1, INF, 1]), _row([0, 2, 0, 0]), truncated=_done(), gamma=0.5,
                                lmbda=0.5, backend=b), [1.5, 2.0, INF, 1.0])


def _vtrace(rt, b):
    # ratio 1, v = 0, bootstrap 0: (vs - v) = [1.5, 1, inf, 1] as GAE with lambda = 1;
    # pg[3] = 1 + 0.5 * 0 ; pg[2] = inf + 0.5 * vs[3] ; pg[1] = 1 (terminated) ; pg[0] = 1 + 0.5 * vs[1]
    zeros = _row([0, 0, 0, 0])
    vs, pg = rt.vtrace(_row([1, 1, INF, 1]), zeros, zeros, zeros, done=_done(), gamma=0.5, backend=b)
    return torch.cat([vs, pg]), [[1.5, 1.0, INF, 1.0]] * 2


def _retrace_reward(rt, b):
    # c = 1, q = ev = 0: Q[3] = 1 ; Q[2] = inf + 0.5 * (0 + 1 * (1 - 0)) = inf ; Q[1] = 1 ;
    # Q[0] = 1 + 0.5 * (0 + 1 * (1 - 0)) = 1.5
    zeros = _row([0, 0, 0, 0])
    return (rt.retrace(_row([1, 1, INF, 1]), zeros, zeros, zeros, next_expected_q=zeros, done=_done(), gamma=0.5,
                       backend=b), [1.5, 1.0, INF, 1.0])


def _retrace_q(rt, b):
    # q[2] = inf: Q[3] = 1 ; Q[2] = 1 + 0.5 * (0 + 1 * (1 - 0)) = 1.5 ; Q[1] = 1 (neither Q[2] nor
    # q[2] is read) ; Q[0] = 1 + 0.5 * (0 + 1 * (1 - 0)) = 1.5
    zeros = _row([0, 0, 0, 0])
    return (rt.retrace(_row([1, 1, 1, 1]), _row([0, 0, INF, 0]), zeros, zeros, next_expected_q=zeros, done=_done(),
                       gamma=0.5, backend=b), [1.5, 1.0, 1.5, 1.0])


def _eligibility(rt, b):
    # e[0] = 1 ; e[1] = inf + 0.5 * 1 ; e[2] = 1 (fresh after the done) ; e[3] = 1 + 0.5 * 1
    return (rt.eligibility_trace(_row([1, INF, 1, 1]), done=_done(), gamma=0.5, lmbda=1.0, backend=b),
            [1.0, INF, 1.0, 1.5])


def _vtrace_nan_after_done(rt, b):
    # log_pi[1] = NaN makes rho[1] and c[1] NaN; step 0 is done, so (vs - v)[0] = delta[0] = 1
    zeros, lp = _row([0, 0, 0]), _row([0, NAN, 0])
    vs, _ = rt.vtrace(_row([1, 1, 1]), zeros, lp, zeros, done=_row([True, False, False], torch.bool), gamma=0.5,
                      backend=b)
    return vs, [1.0, NAN, 1.0]


def _retrace_nan_after_zero_trace(rt, b):
    # log_pi[1] = -inf: c[1] = 0 cuts the tail of step 0, so Q[0] = 1 + 0.5 * 0 although
    # Q[1] is NaN (c[2] NaN)
    zeros = _row([0, 0, 0])
    return (rt.retrace(_row([1, 1, 1]), zeros, _row([0, -INF, NAN]), zeros, next_expected_q=zeros, gamma=0.5,
                       backend=b), [1.0, NAN, 1.0])


def _gae_zero_lambda(rt, b):
    # lambda = 0 cuts the trace without a flag: A[1] = inf, A[0] = delta[0] = 1 + 0.5 * 0 - 0
    adv, _ = rt.gae(_row([1, INF]), _row([0, 0]), gamma=0.5, lmbda=0.0, backend=b)
    return adv, [1.0, INF]


def _discounted_zero_gamma(rt, b):
    # gamma = 0: R = r, the inf bootstrap value is not read
    return rt.discounted_return(_row([1, 2]), bootstrap_value=torch.tensor([INF]), gamma=0.0, backend=b), [1.0, 2.0]


def _affine_zero_beta(rt, b):
    # y[1] = inf + 1 * 0 ; y[0] = 1 (beta[0] = 0: y[1] is not read)
    return rt.affine_scan(_row([1, INF]), _row([0, 1]), backend=b), [1.0, INF]


LEAKS = {f.__name__[1:]: f for f in (
    _discounted, _cumsum, _gae_reward, _gae_terminal_value, _td_lambda, _td_lambda_truncated, _vtrace,
    _retrace_reward, _retrace_q, _eligibility, _vtrace_nan_after_done, _retrace_nan_after_zero_trace,
    _gae_zero_lambda, _discounted_zero_gamma, _affine_zero_beta)}
@pytest.mark.parametrize("case", list(LEAKS))
def test_nothing_crosses_a_cut(backend, rt, case):
    got, expected = LEAKS[case](rt, backend)
    _check(got.reshape(1, -1), np.ravel(expected).tolist())


# --------------------------------------------------------------------------------------
# property test against the oracle
# --------------------------------------------------------------------------------------

COEFFICIENTS = [0.0, 0.5, 0.9, 1.0]
THRESHOLDS = [0.5, 1.0, 2.0, INF]
BETAS = [0.0, 0.5, -0.5, 0.9, -0.9, 1.0, -1.0]  # affine_scan: finite, none close to underflow in 12 steps
DTYPES = [torch.float64, torch.float32, torch.float32, torch.float16, torch.bfloat16]
LAYOUTS = {  # shape from (rows, steps), time dim as passed
    "batch_major": (lambda R, T: (R, T), -1),
    "time_major": (lambda R, T: (T, R), 0),
    "torchrl": (lambda R, T: (R, T, 1), -2),
    "one_row": (lambda R, T: (T,), -1),
}
PLANS = [{}, dict(block_t=4, block_r=1), dict(block_t=2, block_r=2, n_seg=3)]
EXAMPLES = {"torch": 60, "cpu": 60, "triton": 20}


class _Inputs:
    """Draws the tensors of one call: finite values with NaN, +inf and -inf at random places."""

    def __init__(self, draw):
        self.draw = draw
        self.dtype = draw(st.sampled_from(DTYPES))
        R, T = draw(st.integers(1, 3)), draw(st.integers(1, 12))
        kind = draw(st.sampled_from(list(LAYOUTS)))
        make_shape, time_dim = LAYOUTS[kind]
        R = 1 if kind == "one_row" else R
        self.shape = make_shape(R, T)
        td = time_dim % len(self.shape)
        self.layout = Layout(self.shape, td, time_dim, kind, time_dim != -1)
        self.rest = self.layout.rest
        self.R, self.T = R, T
        self.rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        self.p = draw(st.sampled_from([0.05, 0.15, 0.4]))

    def values(self, size, low=-2.0, high=2.0):
        """Finite values (a tenth exactly 0), a fraction p of them NaN, +inf or -inf."""
        x = self.rng.uniform(low, high, size)
        x[self.rng.random(size) < 0.1] = 0.0
        hit = self.rng.random(size) < self.p
        x[hit] = self.rng.choice([NAN, INF, -INF], size=int(hit.sum()))
        return x

    def _tensor(self, a):
        variant = ("permuted", tuple(reversed(range(a.ndim)))) if a.ndim >= 2 and self.draw(st.booleans()) else \
            ("contiguous", None)
        return make_tensor(a, self.dtype, variant)

    def step(self, low=-2.0, high=2.0, rows=None):
        """A per-step input (drawn, or given as [R, T] rows), in the caller's layout."""
        rows = self.values((self.R, self.T), low, high) if rows is None else rows
        return self._tensor(from_rows(rows, self.shape, self.layout.td))

    def log_probs(self, kw):
        """log_pi and log_mu; with c_bar = inf no infinite ratio (an infinite trace coefficient is
        an infinite recurrence coefficient, out of this test)."""
        lp, lm = self.values((self.R, self.T), -1.0, 1.0), self.values((self.R, self.T), -1.0, 1.0)
        if kw.get("c_bar") == INF:
            lp[lp == INF] = NAN
            lm[lm == -INF] = NAN
        return self.step(rows=lp), self.step(rows=lm)

    def per_row(self):
        return self._tensor(self.values(self.R).reshape(self.rest))

    def per_action(self, A, low):
        return self._tensor(from_rows(self.values((self.R, self.T, A), low, 2.0), self.shape, self.layout.td))

    def coefficient(self, kw, name):
        """gamma / lmbda from COEFFICIENTS: left out, a number, or a 0-d, per-row or per-step tensor."""
        form = self.draw(st.sampled_from(["default", "number", "zero_dim", "per_row", "per_step"]))
        pick = self.draw(st.sampled_from(COEFFICIENTS))
        if form == "default":
            return
        if form == "number":
            kw[name] = pick
            return
        dtype = self.draw(st.sampled_from([torch.float32, torch.float64, self.dtype]))
        if form == "zero_dim":
            kw[name] = torch.tensor(pick, dtype=dtype)
            return
        steps = 1 if form == "per_row" else self.T
        rows = self.rng.choice(COEFFICIENTS, size=(self.R, steps))
        shape = list(self.shape)
        shape[self.layout.td] = steps
        kw[name] = torch.from_numpy(np.ascontiguousarray(
            np.moveaxis(rows.reshape(self.rest + (steps,)), -1, self.layout.td).reshape(shape))).to(dtype)

    def flags(self, kw, allow_truncation=True, observation_aligned=True, styles=None):
        """Flags in any style helpers.flags draws, or SB3's episode_starts with last_done."""
        if observation_aligned and self.draw(st.integers(0, 4)) == 0:
            starts = self.rng.random((self.R, self.T)) < 0.3
            kind = self.draw(st.sampled_from(FLAG_KINDS))
            kw["episode_starts"] = make_flag_with_layout(from_rows(starts, self.shape, self.layout.td), kind,
                                                         self.dtype, ("contiguous", None))
            kw["last_done"] = torch.from_numpy(self.rng.random(self.R) < 0.3).reshape(self.rest)
            return
        kw.update(self.draw(flags(self.layout, self.dtype, self.rng, allow_truncation, styles))[0])

    def next_values(self, kw):
        """Explicit next_values (truncations allowed) or the implied form, maybe bootstrapped."""
        form = self.draw(st.sampled_from(["next_values", "bootstrap_value", "implied"]))
        if form == "next_values":
            kw["next_values"] = self.step()
        elif form == "bootstrap_value":
            kw["bootstrap_value"] = self.per_row()
        return form

    def thresholds(self, kw, names):
        for name in names:
            if self.draw(st.booleans()):
                kw[name] = self.draw(st.sampled_from(THRESHOLDS))


@st.composite
def nonfinite_cases(draw, fn):
    d = _Inputs(draw)
    kw: dict = {}
    if fn in ("gae", "vtrace"):
        args = (d.step(), d.step())
        if fn == "vtrace":
            d.thresholds(kw, ("rho_bar", "c_bar", "rho_bar_pg"))
            args += d.log_probs(kw)
        form = d.next_values(kw)
        d.flags(kw, allow_truncation=form == "next_values")
        d.coefficient(kw, "gamma")
        d.coefficient(kw, "lmbda")
    elif fn == "td_lambda_return":
        args = (d.step(), d.step())
        d.flags(kw)
        d.coefficient(kw, "gamma")
        d.coefficient(kw, "lmbda")
    elif fn == "discounted_return":
        args = (d.step(),)
        form = d.next_values(kw)
        d.flags(kw, allow_truncation=form == "next_values")
        d.coefficient(kw, "gamma")
    elif fn == "retrace":
        d.thresholds(kw, ("c_bar",))
        args = (d.step(), d.step()) + d.log_probs(kw)
        if draw(st.booleans()):
            kw["next_expected_q"] = d.step()
        else:
            actions = draw(st.integers(1, 3))
            kw["next_pi"], kw["next_q"] = d.per_action(actions, 0.0), d.per_action(actions, -2.0)
        d.flags(kw)
        d.coefficient(kw, "gamma")
        d.coefficient(kw, "lmbda")
    elif fn in ("eligibility_trace", "episodic_cumsum"):
        args = (d.step(),)
        d.flags(kw, observation_aligned=False, styles=["done_only", "none"])
        if fn == "eligibility_trace":
            d.coefficient(kw, "gamma")
            d.coefficient(kw, "lmbda")
    else:  # affine_scan: infinite betas are out (a parallel scan's grouping decides inf or NaN)
        beta = d.rng.choice(BETAS, size=(d.R, d.T))
        args = (d.step(), d._tensor(from_rows(beta, d.shape, d.layout.td)))
        kw["reverse"] = draw(st.booleans())
    if fn in ("eligibility_trace", "episodic_cumsum", "affine_scan") and draw(st.booleans()):
        kw["initial"] = d.per_row()
    if d.layout.pass_time_dim:
        kw["time_dim"] = d.layout.time_dim
    return Problem(fn, args, kw, notes=dict(layout=d.layout.kind, p=d.p))


def _pattern(x: np.ndarray) -> np.ndarray:
    """0 finite, 1 NaN, 2 +inf, 3 -inf."""
    return np.select([np.isnan(x), x == INF, x == -INF], [1, 2, 3], 0)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN equal to NaN (flags compare plainly)."""
    return a.shape == b.shape and bool(((a == b) | (a != a) & (b != b)).all())


def _check_case(case: Problem, backend: str, grad: bool):
    before = [(x, x.detach().clone()) for x in (*case.args, *case.kwargs.values()) if isinstance(x, torch.Tensor)]
    if grad:  # the composed path: the forward values of a call that records a graph
        case = dataclasses.replace(case, args=tuple(x.detach().requires_grad_(True) for x in case.args))
    outs = case.call(backend)
    for i, (got, want) in enumerate(zip(outs, case.expected())):
        got = as_f64(got)
        what = f"{case.fn} output {i} [{backend}]"
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        bad = _pattern(got) != _pattern(want)
        assert not bad.any(), (f"{what}: non-finite pattern differs at {np.argwhere(bad).tolist()}\n"
                               f"got=\n{got}\nexpected=\n{want}\n{case}")
        finite = _pattern(want) == 0
        assert_matches(np.where(finite, got, 0.0), np.where(finite, want, 0.0), case.dtype, what)
    for x, copy in before:
        assert _same(x.detach(), copy), f"an input was modified\n{case}"


FUNCTIONS = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace", "eligibility_trace",
             "episodic_cumsum", "affine_scan"]


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_nonfinite_matches_oracle(fn, backend, rt):
    plans = PLANS if backend == "triton" else [{}]


    @settings(max_examples=n_examples(EXAMPLES[backend]))
    @given(case=nonfinite_cases(fn), plan=st.sampled_from(plans), grad=st.sampled_from([False, False, False, True]))
    def run(case, plan, grad):
        with kernels.forced_plan(**plan) if plan else contextlib.nullcontext():
            _check_case(case, backend, grad and case.dtype in (torch.float32, torch.float64))

    run()
