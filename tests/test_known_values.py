"""Hand-computed small cases, one block per algorithm.

Every expected number below was worked out by hand from the formulas of docs/semantics.md
section 6 (arithmetic in the comments); inputs are dyadic so float32 holds them exactly.  Each
case runs on every backend and in three layouts of the same single row: 1-D [T], batch-major
[1, T] and time-major [T, 1] (time_dim=0).  The same cases are also fed to the oracle, which
checks the oracle itself.
"""

from __future__ import annotations

import ast
import math

import numpy as np
import pytest
import torch

from rl_triton.testing import oracle

LAYOUTS = ["1d", "batch_major", "time_major"]
DTYPES = [torch.float64, torch.float32]


class Row:
    """Maps 1-D python lists to one layout and back."""

    def __init__(self, layout, dtype):
        self.layout, self.dtype = layout, dtype

    def __call__(self, xs, dtype=None):  # per-step tensor
        t = torch.tensor(xs, dtype=dtype or self.dtype)
        if self.layout == "batch_major":
            return t.reshape(1, -1)
        if self.layout == "time_major":
            return t.reshape(-1, 1)
        return t

    def flag(self, xs):
        return self(xs, dtype=torch.bool)

    def scalar(self, x):  # per-row tensor (shape without the time dim)
        t = torch.tensor(x, dtype=self.dtype)
        return t if self.layout == "1d" else t.reshape(1)

    def actions(self, xss):  # [T, A] -> layout + (A,)
        t = torch.tensor(xss, dtype=self.dtype)
        if self.layout == "batch_major":
            return t.unsqueeze(0)
        if self.layout == "time_major":
            return t.unsqueeze(1)
        return t

    @property
    def kw(self):
        return {"time_dim": 0} if self.layout == "time_major" else {}

    def check(self, out, expected, atol=1e-6):
        exp = torch.tensor(expected, dtype=torch.float64)
        assert out.dtype == self.dtype
        got = out.detach().double().reshape(-1)
        assert got.shape == exp.shape, (tuple(out.shape), exp.shape)
        torch.testing.assert_close(got, exp, rtol=1e-6, atol=atol)


@pytest.fixture(params=[(lay, dt) for lay in LAYOUTS for dt in DTYPES],
                ids=lambda p: f"{p[0]}-{str(p[1]).split('.')[-1]}")
def row(request):
    return Row(*request.param)


def _o(xs):  # oracle row [1, T]
    return np.asarray(xs, dtype=np.float64).reshape(1, -1)


def _full(v, T):
    return np.full((1, T), float(v))


# ----------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------
# r = [1, 0, 2], v = [0.5, 1, 2], gamma = lambda = 0.5 (gamma*lambda = 0.25)
#
# (a) terminated at t=1, implied next values with bootstrap_value = 4: nv = [1, 2, 4]
#   delta0 = 1 + 0.5*1 - 0.5 = 1.0
#   delta1 = 0 + 0.5*0*2 - 1 = -1.0          (terminated: no bootstrap)
#   delta2 = 2 + 0.5*4 - 2 = 2.0             (window end bootstraps bootstrap_value)
#   A2 = 2 ;  A1 = -1 + 0.25*(1-1)*2 = -1 ;  A0 = 1 + 0.25*(-1) = 0.75
#   targets = A + v = [1.25, 0.0, 4.0]
#
# (b) truncated at t=1, explicit nv = [1, 3, 4]
#   delta1 = 0 + 0.5*3 - 1 = 0.5 ; A2 = 2 ; A1 = 0.5 (trace cut) ; A0 = 1 + 0.25*0.5 = 1.125
#   targets = [1.625, 1.5, 4.0]
GAE_A = dict(adv=[0.75, -1.0, 2.0], tgt=[1.25, 0.0, 4.0])
GAE_B = dict(adv=[1.125, 0.5, 2.0], tgt=[1.625, 1.5, 4.0])


def test_gae_known(row, backend, rt):
    r, v = row([1.0, 0.0, 2.0]), row([0.5, 1.0, 2.0])
    adv, tgt = rt.gae(r, v, terminated=row.flag([0, 1, 0]), bootstrap_value=row.scalar(4.0),
                      gamma=0.5, lmbda=0.5, backend=backend, **row.kw)
    row.check(adv, GAE_A["adv"])
    row.check(tgt, GAE_A["tgt"])
    # same thing TorchRL style: done = terminated
    adv, tgt = rt.gae(r, v, done=row.flag([0, 1, 0]), bootstrap_value=row.scalar(4.0),
                      gamma=0.5, lmbda=0.5, backend=backend, **row.kw)
    row.check(adv, GAE_A["adv"])
    # (b) truncation, gymnasium style and TorchRL style
    nv = row([1.0, 3.0, 4.0])
    adv, tgt = rt.gae(r, v, next_values=nv, truncated=row.flag([0, 1, 0]),
                      gamma=0.5, lmbda=0.5, backend=backend, **row.kw)
    row.check(adv, GAE_B["adv"])
    row.check(tgt, GAE_B["tgt"])
    adv, tgt = rt.gae(r, v, next_values=nv, done=row.flag([0, 1, 0]),
                      terminated=row.flag([0, 0, 0]), gamma=0.5, lmbda=0.5, backend=backend,
                      **row.kw)
    row.check(adv, GAE_B["adv"])
    row.check(tgt, GAE_B["tgt"])


def test_gae_known_per_step_gamma(row, backend, rt):
    # r = [1, 1], v = [0, 0], bootstrap 0 (default), gamma = [0.5, 0.25], lambda = 1
    # delta1 = 1 + 0.25*0 - 0 = 1 ; A1 = 1
    # delta0 = 1 + 0.5*v1 - 0 = 1 ; A0 = 1 + gamma0*lambda*A1 = 1 + 0.5 = 1.5
    adv, _ = rt.gae(row([1.0, 1.0]), row([0.0, 0.0]), gamma=row([0.5, 0.25]), lmbda=1.0,
                    backend=backend, **row.kw)
    row.check(adv, [1.5, 1.0])


def test_gae_oracle_known():
    adv, tgt = oracle.gae(_o([1, 0, 2]), _o([0.5, 1, 2]), _o([1, 2, 4]), _o([0, 1, 0]),
                          _o([0, 1, 0]), _full(0.5, 3), _full(0.5, 3))
    np.testing.assert_allclose(adv[0], GAE_A["adv"])
    np.testing.assert_allclose(tgt[0], GAE_A["tgt"])
    np.testing.assert_allclose(oracle.implied_next_values(_o([0.5, 1, 2]), [4.0])[0], [1, 2, 4])
    adv, tgt = oracle.gae(_o([1, 0, 2]), _o([0.5, 1, 2]), _o([1, 3, 4]), _o([0, 0, 0]),
                          _o([0, 1, 0]), _full(0.5, 3), _full(0.5, 3))
    np.testing.assert_allclose(adv[0], GAE_B["adv"])
    np.testing.assert_allclose(tgt[0], GAE_B["tgt"])


# ----------------------------------------------------------------------------------------
# TD(lambda)
# ----------------------------------------------------------------------------------------
# r = [1, 0, 2], nv = [1, 3, 4], gamma = lambda = 0.5
# no flags:
#   G2 = 2 + 0.5*((0.5)*4 + 0.5*4) = 4                 (window end: G' = nv2)
#   G1 = 0 + 0.5*(0.5*3 + 0.5*4) = 1.75
#   G0 = 1 + 0.5*(0.5*1 + 0.5*1.75) = 1 + 0.6875 = 1.6875
# truncated at t=1:  G1 = 0.5*(0.5*3 + 0.5*3) = 1.5 ; G0 = 1 + 0.5*(0.5 + 0.75) = 1.625
# terminated at t=1: G1 = 0 ; G0 = 1 + 0.5*(0.5*1 + 0.5*0) = 1.25
TD_NONE = [1.6875, 1.75, 4.0]
TD_TRUNC = [1.625, 1.5, 4.0]
TD_TERM = [1.25, 0.0, 4.0]


def test_td_lambda_known(row, backend, rt):
    r, nv = row([1.0, 0.0, 2.0]), row([1.0, 3.0, 4.0])
    kw = dict(gamma=0.5, lmbda=0.5, backend=backend, **row.kw)
    row.check(rt.td_lambda_return(r, nv, **kw), TD_NONE)
    row.check(rt.td_lambda_return(r, nv, truncated=row.flag([0, 1, 0]), **kw), TD_TRUNC)
    row.check(rt.td_lambda_return(r, nv, terminated=row.flag([0, 1, 0]), **kw), TD_TERM)
    row.check(rt.td_lambda_return(r, nv, done=row.flag([0, 1, 0]), **kw), TD_TERM)
    # TD(0): r + gamma*nv = [1.5, 1.5, 4] ; TD(1) no flags: G2 = 4, G1 = 0 + 0.5*4 = 2,
    # G0 = 1 + 0.5*2 = 2
    row.check(rt.td_lambda_return(r, nv, **{**kw, "lmbda": 0.0}), [1.5, 1.5, 4.0])
    row.check(rt.td_lambda_return(r, nv, **{**kw, "lmbda": 1.0}), [2.0, 2.0, 4.0])


def test_td_lambda_oracle_known():
    z = _o([0, 0, 0])
    f = _o([0, 1, 0])
    args = (_o([1, 0, 2]), _o([1, 3, 4]))
    np.testing.assert_allclose(oracle.td_lambda_return(*args, z, z, _full(.5, 3), _full(.5, 3))[0],
                               TD_NONE)
    np.testing.assert_allclose(oracle.td_lambda_return(*args, z, f, _full(.5, 3), _full(.5, 3))[0],
                               TD_TRUNC)
    np.testing.assert_allclose(oracle.td_lambda_return(*args, f, f, _full(.5, 3), _full(.5, 3))[0],
                               TD_TERM)


# ----------------------------------------------------------------------------------------
# discounted return
# ----------------------------------------------------------------------------------------
# r = [1, 2, 3, 4], gamma = 0.5, terminated at t=1
#   Monte Carlo: R3 = 4 ; R2 = 3 + 0.5*4 = 5 ; R1 = 2 (terminal) ; R0 = 1 + 0.5*2 = 2
#   bootstrap_value = 8: R3 = 4 + 0.5*8 = 8 ; R2 = 3 + 4 = 7 ; R1 = 2 ; R0 = 2
# truncated at t=1, next_values = [0, 10, 0, 6] (carry = nv[T-1] = 6):
#   R3 = 4 + 3 = 7 ; R2 = 3 + 3.5 = 6.5 ; R1 = 2 + 0.5*10 = 7 ; R0 = 1 + 0.5*7 = 4.5
# per-step gamma [0.5, 0.25, 1.0], r = [1, 2, 4], MC: R2 = 4 ; R1 = 2 + 0.25*4 = 3 ;
#   R0 = 1 + 0.5*3 = 2.5
DR_MC = [2.0, 2.0, 5.0, 4.0]
DR_BOOT = [2.0, 2.0, 7.0, 8.0]
DR_TRUNC = [4.5, 7.0, 6.5, 7.0]


def test_discounted_return_known(row, backend, rt):
    r = row([1.0, 2.0, 3.0, 4.0])
    kw = dict(gamma=0.5, backend=backend, **row.kw)
    term = row.flag([0, 1, 0, 0])
    row.check(rt.discounted_return(r, terminated=term, **kw), DR_MC)
    row.check(rt.discounted_return(r, done=term, **kw), DR_MC)
    row.check(rt.discounted_return(r, terminated=term, bootstrap_value=row.scalar(8.0), **kw),
              DR_BOOT)
    row.check(rt.discounted_return(r, truncated=term, next_values=row([0.0, 10.0, 0.0, 6.0]),
                                   **kw), DR_TRUNC)
    row.check(rt.discounted_return(row([1.0, 2.0, 4.0]), gamma=row([0.5, 0.25, 1.0]),
                                   backend=backend, **row.kw), [2.5, 3.0, 4.0])
    # no flags, gamma = 1: plain reversed cumsum 10, 9, 7, 4
    row.check(rt.discounted_return(r, gamma=1.0, backend=backend, **row.kw), [10.0, 9.0, 7.0, 4.0])


def test_discounted_return_oracle_known():
    r, f, z = _o([1, 2, 3, 4]), _o([0, 1, 0, 0]), _o([0, 0, 0, 0])
    g = _full(0.5, 4)
    np.testing.assert_allclose(oracle.discounted_return(r, f, f, g)[0], DR_MC)
    np.testing.assert_allclose(oracle.discounted_return(r, f, f, g, carry=[8.0])[0], DR_BOOT)
    np.testing.assert_allclose(
        oracle.discounted_return(r, z, f, g, next_values=_o([0, 10, 0, 6]), carry=[6.0])[0],
        DR_TRUNC)


# ----------------------------------------------------------------------------------------
# V-trace
# ----------------------------------------------------------------------------------------
# r = [1, 1], v = [1, 0.5], bootstrap_value = 2 -> nv = [0.5, 2], gamma = 0.5
# log_mu = [0, 0], log_pi = [ln 2, ln 0.5] -> ratio = [2, 0.5]
# rho_bar = c_bar = 1: rho = [1, 0.5] (t=0 clipped), c = [1, 0.5]
#   delta1 = 0.5*(1 + 0.5*2 - 0.5) = 0.75
#   delta0 = 1*(1 + 0.5*0.5 - 1) = 0.25
#   (vs-v)1 = 0.75 ; (vs-v)0 = 0.25 + 0.5*c0*0.75 = 0.25 + 0.375 = 0.625
#   vs = [1.625, 1.25]
#   pg0 = min(1, 2)*(1 + 0.5*vs1 - v0) = 1 + 0.625 - 1 = 0.625
#   pg1 = min(1, 0.5)*(1 + 0.5*nv1 - v1) = 0.5*(1 + 1 - 0.5) = 0.75
# c_bar = 0.5 (or lmbda = 0.5): c0 = 0.5 -> (vs-v)0 = 0.25 + 0.5*0.5*0.75 = 0.4375,
#   vs = [1.4375, 1.25], pg unchanged (vs1 unchanged)
# rho_bar_pg = 2: pg0 = min(2, 2)*0.625 = 1.25, pg1 = 0.75
# terminated at t=0: delta0 = 1*(1 + 0 - 1) = 0, (vs-v)0 = 0 -> vs0 = 1 ; pg0 = 1*(1 - 1) = 0
VT_VS = [1.625, 1.25]
VT_PG = [0.625, 0.75]
VT_VS_C = [1.4375, 1.25]


def test_vtrace_known(row, backend, rt):
    r, v = row([1.0, 1.0]), row([1.0, 0.5])
    lp, lm = row([math.log(2.0), math.log(0.5)]), row([0.0, 0.0])
    b = row.scalar(2.0)
    kw = dict(gamma=0.5, backend=backend, **row.kw)
    vs, pg = rt.vtrace(r, v, lp, lm, bootstrap_value=b, **kw)
    row.check(vs, VT_VS)
    row.check(pg, VT_PG)
    vs, pg = rt.vtrace(r, v, lp, lm, bootstrap_value=b, rho_bar=1.0, c_bar=1.0, lmbda=1.0, **kw)
    row.check(vs, VT_VS)
    row.check(pg, VT_PG)
    vs, pg = rt.vtrace(r, v, lp, lm, bootstrap_value=b, c_bar=0.5, **kw)
    row.check(vs, VT_VS_C)
    row.check(pg, VT_PG)
    vs, pg = rt.vtrace(r, v, lp, lm, bootstrap_value=b, lmbda=0.5, **kw)
    row.check(vs, VT_VS_C)
    row.check(pg, VT_PG)
    vs, pg = rt.vtrace(r, v, lp, lm, bootstrap_value=b, rho_bar_pg=2.0, **kw)
    row.check(vs, VT_VS)
    row.check(pg, [1.25, 0.75])
    # explicit next_values equal to the implied ones
    vs, pg = rt.vtrace(r, v, lp, lm, next_values=row([0.5, 2.0]), **kw)
    row.check(vs, VT_VS)
    row.check(pg, VT_PG)
    # terminated at t=0
    vs, pg = rt.vtrace(r, v, lp, lm, bootstrap_value=b, terminated=row.flag([1, 0]), **kw)
    row.check(vs, [1.0, 1.25])
    row.check(pg, [0.0, 0.75])


def test_vtrace_known_truncation(row, backend, rt):
    # same data, truncated at t=0 with nv = [3, 2]:
    #   delta0 = 1*(1 + 0.5*3 - 1) = 1.5 ; trace cut -> vs0 = 1 + 1.5 = 2.5 ; vs1 = 1.25
    #   pg0: vs_next0 = nv0 = 3 (done) -> 1*(1 + 1.5 - 1) = 1.5 ; pg1 = 0.75
    r, v = row([1.0, 1.0]), row([1.0, 0.5])
    lp, lm = row([math.log(2.0), math.log(0.5)]), row([0.0, 0.0])
    vs, pg = rt.vtrace(r, v, lp, lm, next_values=row([3.0, 2.0]), truncated=row.flag([1, 0]),
                       gamma=0.5, backend=backend, **row.kw)
    row.check(vs, [2.5, 1.25])
    row.check(pg, [1.5, 0.75])


def test_vtrace_oracle_known():
    args = (_o([1, 1]), _o([1, 0.5]), _o([0.5, 2]), _o([math.log(2), math.log(0.5)]), _o([0, 0]))
    z = _o([0, 0])
    vs, pg = oracle.vtrace(*args, z, z, _full(.5, 2), _full(1, 2), 1.0, 1.0, 1.0)
    np.testing.assert_allclose(vs[0], VT_VS)
    np.testing.assert_allclose(pg[0], VT_PG)
    vs, pg = oracle.vtrace(*args, z, z, _full(.5, 2), _full(1, 2), 1.0, 0.5, 1.0)
    np.testing.assert_allclose(vs[0], VT_VS_C)
    vs, pg = oracle.vtrace(*args, z, z, _full(.5, 2), _full(1, 2), 1.0, 1.0, 2.0)
    np.testing.assert_allclose(pg[0], [1.25, 0.75])


# ----------------------------------------------------------------------------------------
# Retrace
# ----------------------------------------------------------------------------------------
# r = [1, 0, 2], q = [0.5, 1, 1], ev = [2, 1, 3], gamma = 0.5, lambda = 1
# pi/mu = [1, 2, 0.5] (log_pi = [0, ln 2, ln 0.5], log_mu = 0)
# c_bar = 1: c1 = min(1, 2) = 1 (clipped), c2 = 0.5 ; c3 = 0 (window end)
#   Q2 = 2 + 0.5*(3 + 0) = 3.5
#   Q1 = 0 + 0.5*(1 + c2*(Q2 - q2)) = 0.5*(1 + 0.5*2.5) = 1.125
#   Q0 = 1 + 0.5*(2 + c1*(Q1 - q1)) = 1 + 0.5*(2 + 0.125) = 2.0625
# c_bar = 0.25: c1 = c2 = 0.25
#   Q1 = 0.5*(1 + 0.25*2.5) = 0.8125 ; Q0 = 1 + 0.5*(2 + 0.25*(-0.1875)) = 1.9765625
# truncated at t=1 (c_bar = 1): Q1 = 0.5*(1 + 0) = 0.5 ; Q0 = 1 + 0.5*(2 + 1*(0.5-1)) = 1.75
# terminated at t=1: Q1 = 0 ; Q0 = 1 + 0.5*(2 + 1*(0 - 1)) = 1.5
# per-step lambda [0.9, 0.5, 0.2]: c1 = 0.5*1 = 0.5, c2 = 0.2*0.5 = 0.1
#   Q1 = 0.5*(1 + 0.1*2.5) = 0.625 ; Q0 = 1 + 0.5*(2 + 0.5*(0.625 - 1)) = 1.90625
# full form: next_pi = [[.5,.5],[1,0],[.25,.75]], next_q = [[1,3],[1,7],[0,4]]
#   ev = [0.5+1.5, 1+0, 0+3] = [2, 1, 3]
RT_BASE = [2.0625, 1.125, 3.5]
RT_CBAR = [1.9765625, 0.8125, 3.5]
RT_TRUNC = [1.75, 0.5, 3.5]
RT_TERM = [1.5, 0.0, 3.5]
RT_LAM = [1.90625, 0.625, 3.5]


def test_retrace_known(row, backend, rt):
    r, q = row([1.0, 0.0, 2.0]), row([0.5, 1.0, 1.0])
    lp, lm = row([0.0, math.log(2.0), math.log(0.5)]), row([0.0, 0.0, 0.0])
    ev = row([2.0, 1.0, 3.0])
    kw = dict(gamma=0.5, backend=backend, **row.kw)
    row.check(rt.retrace(r, q, lp, lm, next_expected_q=ev, **kw), RT_BASE)
    row.check(rt.retrace(r, q, lp, lm, next_expected_q=ev, c_bar=1.0, lmbda=1.0, **kw), RT_BASE)
    row.check(rt.retrace(r, q, lp, lm, next_expected_q=ev, c_bar=0.25, **kw), RT_CBAR)
    row.check(rt.retrace(r, q, lp, lm, next_expected_q=ev, truncated=row.flag([0, 1, 0]), **kw),
              RT_TRUNC)
    row.check(rt.retrace(r, q, lp, lm, next_expected_q=ev, terminated=row.flag([0, 1, 0]), **kw),
              RT_TERM)
    row.check(rt.retrace(r, q, lp, lm, next_expected_q=ev, lmbda=row([0.9, 0.5, 0.2]), **kw),
              RT_LAM)
    pi = row.actions([[0.5, 0.5], [1.0, 0.0], [0.25, 0.75]])
    nq = row.actions([[1.0, 3.0], [1.0, 7.0], [0.0, 4.0]])
    row.check(rt.retrace(r, q, lp, lm, next_pi=pi, next_q=nq, **kw), RT_BASE)
    row.check(rt.retrace(r, q, lp, lm, next_pi=pi, next_q=nq, c_bar=0.25, **kw), RT_CBAR)


def test_retrace_oracle_known():
    args = (_o([1, 0, 2]), _o([0.5, 1, 1]), _o([0, math.log(2), math.log(0.5)]), _o([0, 0, 0]))
    z, f = _o([0, 0, 0]), _o([0, 1, 0])
    g, one = _full(0.5, 3), _full(1, 3)
    ev = _o([2, 1, 3])
    np.testing.assert_allclose(oracle.retrace(*args, z, z, g, one, 1.0, next_expected_q=ev)[0],
                               RT_BASE)
    np.testing.assert_allclose(oracle.retrace(*args, z, z, g, one, 0.25, next_expected_q=ev)[0],
                               RT_CBAR)
    np.testing.assert_allclose(oracle.retrace(*args, z, f, g, one, 1.0, next_expected_q=ev)[0],
                               RT_TRUNC)
    np.testing.assert_allclose(oracle.retrace(*args, f, f, g, one, 1.0, next_expected_q=ev)[0],
                               RT_TERM)
    np.testing.assert_allclose(
        oracle.retrace(*args, z, z, g, _o([0.9, 0.5, 0.2]), 1.0, next_expected_q=ev)[0], RT_LAM)
    pi = np.array([[[0.5, 0.5], [1, 0], [0.25, 0.75]]])
    nq = np.array([[[1, 3], [1, 7], [0, 4]]], dtype=float)
    np.testing.assert_allclose(oracle.retrace(*args, z, z, g, one, 1.0, next_pi=pi, next_q=nq)[0],
                               RT_BASE)


# ----------------------------------------------------------------------------------------
# eligibility trace (forward)
# ----------------------------------------------------------------------------------------
# x = [1, 1, 1, 1], gamma = 0.5, lambda = 1 (default), done at t=1
#   e0 = 1 ; e1 = 1 + 0.5*1 = 1.5 ; e2 = 1 + 0.5*(1 - done1)*1.5 = 1 ; e3 = 1 + 0.5 = 1.5
# initial = 2: e0 = 1 + 0.5*2 = 2 ; e1 = 1 + 1 = 2 ; e2 = 1 ; e3 = 1.5
# gamma = 0.8, lambda = 0.5 (product 0.4), x = [1, 2, 3]: e = [1, 2.4, 3 + 0.96 = 3.96]
# per-step gamma [0.1, 0.5, 0.25], lambda 1, x = [1,1,1], initial 2:
#   e0 = 1 + 0.1*2 = 1.2 ; e1 = 1 + 0.5*1.2 = 1.6 ; e2 = 1 + 0.25*1.6 = 1.4
EL_DONE = [1.0, 1.5, 1.0, 1.5]
EL_INIT = [2.0, 2.0, 1.0, 1.5]


def test_eligibility_known(row, backend, rt):
    x = row([1.0, 1.0, 1.0, 1.0])
    d = row.flag([0, 1, 0, 0])
    kw = dict(backend=backend, **row.kw)
    row.check(rt.eligibility_trace(x, done=d, gamma=0.5, **kw), EL_DONE)
    row.check(rt.eligibility_trace(x, done=d, gamma=0.5, lmbda=1.0, **kw), EL_DONE)
    row.check(rt.eligibility_trace(x, done=d, gamma=0.5, initial=row.scalar(2.0), **kw), EL_INIT)
    row.check(rt.eligibility_trace(row([1.0, 2.0, 3.0]), gamma=0.8, lmbda=0.5, **kw),
              [1.0, 2.4, 3.96])
    row.check(rt.eligibility_trace(row([1.0, 1.0, 1.0]), gamma=row([0.1, 0.5, 0.25]),
                                   initial=row.scalar(2.0), **kw), [1.2, 1.6, 1.4])


def test_eligibility_known_features(backend, rt):
    # x [T=3, F=2] with time_dim=0, done [T] broadcast over features, gamma 0.5:
    #   column 0: x = [1, 1, 1], done = [1, 0, 0] -> e = [1, 1 + 0 = 1, 1 + 0.5 = 1.5]
    #   column 1: x = [2, 0, 4]                      -> e = [2, 0, 4]
    x = torch.tensor([[1.0, 2.0], [1.0, 0.0], [1.0, 4.0]], dtype=torch.float64)
    out = rt.eligibility_trace(x, done=torch.tensor([True, False, False]), gamma=0.5, time_dim=0,
                               backend=backend)
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0], [1.0, 0.0], [1.5, 4.0]],
                                                 dtype=torch.float64))


def test_eligibility_oracle_known():
    x = _o([1, 1, 1, 1])
    d = _o([0, 1, 0, 0])
    np.testing.assert_allclose(oracle.eligibility_trace(x, d, _full(.5, 4), _full(1, 4))[0],
                               EL_DONE)
    np.testing.assert_allclose(
        oracle.eligibility_trace(x, d, _full(.5, 4), _full(1, 4), initial=[2.0])[0], EL_INIT)


# ----------------------------------------------------------------------------------------
# episodic running sum (forward)
# ----------------------------------------------------------------------------------------
# step counter: x = 1, done = [0,0,1,0,1,0] -> c = [1, 2, 3, 1, 2, 1]
#   (done[t-1] restarts the count at t)
# initial = 5: [6, 7, 8, 1, 2, 1]
# episode returns so far: x = [1, 2, 3, 4], done = [1, 0, 0, 0] -> [1, 2, 5, 9]
CS_COUNT = [1.0, 2.0, 3.0, 1.0, 2.0, 1.0]
CS_INIT = [6.0, 7.0, 8.0, 1.0, 2.0, 1.0]


def test_episodic_cumsum_known(row, backend, rt):
    ones = row([1.0] * 6)
    d = row.flag([0, 0, 1, 0, 1, 0])
    kw = dict(backend=backend, **row.kw)
    row.check(rt.episodic_cumsum(ones, done=d, **kw), CS_COUNT)
    row.check(rt.episodic_cumsum(ones, done=d, initial=row.scalar(5.0), **kw), CS_INIT)
    row.check(rt.episodic_cumsum(row([1.0, 2.0, 3.0, 4.0]), done=row.flag([1, 0, 0, 0]), **kw),
              [1.0, 2.0, 5.0, 9.0])
    row.check(rt.episodic_cumsum(row([1.0, 2.0, 3.0, 4.0]), **kw), [1.0, 3.0, 6.0, 10.0])


def test_episodic_cumsum_oracle_known():
    x, d = _o([1] * 6), _o([0, 0, 1, 0, 1, 0])
    np.testing.assert_allclose(oracle.episodic_cumsum(x, d)[0], CS_COUNT)
    np.testing.assert_allclose(oracle.episodic_cumsum(x, d, initial=[5.0])[0], CS_INIT)


# ----------------------------------------------------------------------------------------
# affine_scan
# ----------------------------------------------------------------------------------------
# alpha = [1, 2, 3], beta = 0.5, initial = 4
#   reverse: y2 = 3 + 0.5*4 = 5 ; y1 = 2 + 2.5 = 4.5 ; y0 = 1 + 2.25 = 3.25
#   forward: y0 = 1 + 0.5*4 = 3 ; y1 = 2 + 1.5 = 3.5 ; y2 = 3 + 1.75 = 4.75
#   no initial: reverse y2 = 3, y1 = 3.5, y0 = 2.75 ; forward y0 = 1, y1 = 2.5, y2 = 4.25
# alpha = 1, beta = [2, 0, 3], initial = 1:
#   reverse: y2 = 1 + 3 = 4 ; y1 = 1 + 0 = 1 ; y0 = 1 + 2 = 3
#   forward: y0 = 1 + 2 = 3 ; y1 = 1 + 0 = 1 ; y2 = 1 + 3 = 4
AS_REV = [3.25, 4.5, 5.0]
AS_FWD = [3.0, 3.5, 4.75]


def test_affine_scan_known(row, backend, rt):
    a, b = row([1.0, 2.0, 3.0]), row([0.5, 0.5, 0.5])
    i = row.scalar(4.0)
    kw = dict(backend=backend, **row.kw)
    row.check(rt.affine_scan(a, b, reverse=True, initial=i, **kw), AS_REV)
    row.check(rt.affine_scan(a, b, initial=i, **kw), AS_REV)  # reverse=True is the default
    row.check(rt.affine_scan(a, b, reverse=False, initial=i, **kw), AS_FWD)
    row.check(rt.affine_scan(a, b, reverse=True, **kw), [2.75, 3.5, 3.0])
    row.check(rt.affine_scan(a, b, reverse=False, **kw), [1.0, 2.5, 4.25])
    a1, b2 = row([1.0, 1.0, 1.0]), row([2.0, 0.0, 3.0])
    row.check(rt.affine_scan(a1, b2, reverse=True, initial=row.scalar(1.0), **kw), [3.0, 1.0, 4.0])
    row.check(rt.affine_scan(a1, b2, reverse=False, initial=row.scalar(1.0), **kw), [3.0, 1.0, 4.0])


def test_affine_scan_known_broadcast(backend, rt):
    # alpha [2, 3], beta [2, 1] (per-row), forward with initial [1, 0]:
    #   row 0: beta 0.5, alpha [1, 1, 1], y-1 = 1 -> [1.5, 1.75, 1.875]
    #   row 1: beta 2,   alpha [1, 0, 0], y-1 = 0 -> [1, 2, 4]
    a = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    b = torch.tensor([[0.5], [2.0]], dtype=torch.float64)
    y = rt.affine_scan(a, b, reverse=False, initial=torch.tensor([1.0, 0.0], dtype=torch.float64),
                       backend=backend)
    torch.testing.assert_close(y, torch.tensor([[1.5, 1.75, 1.875], [1.0, 2.0, 4.0]],
                                               dtype=torch.float64))


def test_affine_scan_oracle_known():
    a, b = _o([1, 2, 3]), _full(0.5, 3)
    np.testing.assert_allclose(oracle.affine_scan(a, b, True, [4.0])[0], AS_REV)
    np.testing.assert_allclose(oracle.affine_scan(a, b, False, [4.0])[0], AS_FWD)


def test_oracle_is_independent_of_the_library():
    """The oracle imports numpy and the standard library only, never rl_triton."""
    with open(oracle.__file__) as f:
        tree = ast.parse(f.read())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] if node.level == 0 else "." for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported <= {"__future__", "math", "numpy"}, imported
