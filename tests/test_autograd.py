"""Autograd: torch.autograd.gradcheck (float64, small shapes) for every public function, w.r.t.
every float tensor input (docs/semantics.md section 10), plus gradgradcheck.

Backends: torch and cpu (numba) always, with gradgradcheck; triton when usable (CUDA, or
TRITON_INTERPRET=1 before import), first order only (the interpreter is slow)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

F64 = torch.float64
N, T = 2, 5


def _r(*shape, seed, low=-1.0, high=1.0, grad=True):
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(*shape, generator=g, dtype=F64) * (high - low) + low
    return t.requires_grad_(grad)


def _flags(seed):
    """done with one termination and one truncation per row, away from the window end."""
    done = torch.zeros(N, T, dtype=torch.bool)
    term = torch.zeros(N, T, dtype=torch.bool)
    done[0, 1] = True           # row 0: terminated at t=1
    term[0, 1] = True
    done[1, 2] = True           # row 1: truncated at t=2
    if seed % 2:
        done[1, 0] = True       # and terminated at t=0
        term[1, 0] = True
    return done, term


def _log_probs(seed, kink=1.0):
    """log_pi, log_mu with log(pi/mu) at least 0.25 away from log(kink)."""
    g = torch.Generator().manual_seed(seed)
    log_mu = torch.rand(N, T, generator=g, dtype=F64) - 1.5
    mag = 0.25 + 0.45 * torch.rand(N, T, generator=g, dtype=F64)
    sign = torch.where(torch.rand(N, T, generator=g) < 0.5, -1.0, 1.0).to(F64)
    log_pi = log_mu + math.log(kink) + sign * mag
    return log_pi.requires_grad_(), log_mu.requires_grad_()


_SECOND_ORDER_BACKENDS = ("torch", "cpu")  # the Triton interpreter is too slow for gradgradcheck


def _check(fn, inputs, second_order=False, backend=None):
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-7, rtol=1e-6)
    if second_order and backend in _SECOND_ORDER_BACKENDS:
        assert gradgradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# affine_scan
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [True, False])
@pytest.mark.parametrize("with_initial", [True, False])
def test_affine_scan_grad(reverse, with_initial, backend, rt):
    a = _r(N, T, seed=1)
    b = _r(N, T, seed=2, low=-0.9, high=0.9)
    inputs = [a, b]
    if with_initial:
        inputs.append(_r(N, seed=3))

    def fn(a, b, *init):
        return rt.affine_scan(a, b, reverse=reverse, initial=init[0] if init else None,
                              backend=backend)

    _check(fn, tuple(inputs), second_order=True, backend=backend)


@pytest.mark.parametrize("reverse", [True, False])
def test_affine_scan_grad_broadcast_and_time_major(reverse, backend, rt):
    """beta per-row [1, N] with time-major alpha [T, N] (time_dim=0); grads reduce over the
    broadcast dim."""
    a = _r(T, N, seed=4)
    b = _r(1, N, seed=5, low=-0.9, high=0.9)
    i = _r(N, seed=6)

    def fn(a, b, i):
        return rt.affine_scan(a, b, reverse=reverse, initial=i, time_dim=0, backend=backend)

    _check(fn, (a, b, i), second_order=True, backend=backend)


def test_affine_scan_grad_noncontiguous(backend, rt):
    a = _r(T, N, seed=7).detach().t().requires_grad_()   # [N, T] view of time-major memory
    b = _r(T, N, seed=8, low=-0.9, high=0.9).detach().t().requires_grad_()
    assert not a.is_contiguous()
    _check(lambda a, b: rt.affine_scan(a, b, backend=backend), (a, b), second_order=True,
           backend=backend)


# ----------------------------------------------------------------------------------------
# GAE
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["next_values", "bootstrap_value"])
def test_gae_grad(form, backend, rt):
    r, v = _r(N, T, seed=1), _r(N, T, seed=2)
    gamma = _r(N, T, seed=3, low=0.3, high=0.95)
    lmbda = _r(N, 1, seed=4, low=0.3, high=0.95)
    done, term = _flags(0)
    if form == "next_values":
        extra = _r(N, T, seed=5)

        def fn(r, v, nv, g, l):
            return rt.gae(r, v, next_values=nv, done=done, terminated=term, gamma=g, lmbda=l,
                          backend=backend)
    else:
        extra = _r(N, seed=5)

        def fn(r, v, bv, g, l):
            return rt.gae(r, v, bootstrap_value=bv, done=term, gamma=g, lmbda=l,
                          backend=backend)

    _check(fn, (r, v, extra, gamma, lmbda), second_order=True, backend=backend)


def test_gae_grad_zero_dim_gamma_time_major(backend, rt):
    r, v, nv = _r(T, N, seed=1), _r(T, N, seed=2), _r(T, N, seed=3)
    g = torch.tensor(0.9, dtype=F64, requires_grad=True)
    done, term = _flags(1)

    def fn(r, v, nv, g):
        return rt.gae(r, v, next_values=nv, terminated=term.t(), truncated=(done & ~term).t(),
                      gamma=g, lmbda=0.8, time_dim=0, backend=backend)

    _check(fn, (r, v, nv, g))


# ----------------------------------------------------------------------------------------
# TD(lambda), discounted return
# ----------------------------------------------------------------------------------------


def test_td_lambda_grad(backend, rt):
    r, nv = _r(N, T, seed=1), _r(N, T, seed=2)
    g = _r(N, T, seed=3, low=0.3, high=0.95)
    lam = _r(N, T, seed=4, low=0.1, high=0.9)
    done, term = _flags(1)

    def fn(r, nv, g, lam):
        return rt.td_lambda_return(r, nv, done=done, terminated=term, gamma=g, lmbda=lam,
                                   backend=backend)

    _check(fn, (r, nv, g, lam), second_order=True, backend=backend)


@pytest.mark.parametrize("form", ["mc", "bootstrap_value", "next_values"])
def test_discounted_return_grad(form, backend, rt):
    r = _r(N, T, seed=1)
    g = _r(N, 1, seed=3, low=0.3, high=0.95)
    done, term = _flags(0)
    if form == "mc":
        def fn(r, g):
            return rt.discounted_return(r, terminated=term, gamma=g, backend=backend)
        inputs = (r, g)
    elif form == "bootstrap_value":
        def fn(r, g, bv):
            return rt.discounted_return(r, done=term, bootstrap_value=bv, gamma=g,
                                        backend=backend)
        inputs = (r, g, _r(N, seed=4))
    else:
        def fn(r, g, nv):
            return rt.discounted_return(r, done=done, terminated=term, next_values=nv, gamma=g,
                                        backend=backend)
        inputs = (r, g, _r(N, T, seed=4))
    _check(fn, inputs, second_order=True, backend=backend)


# ----------------------------------------------------------------------------------------
# V-trace, Retrace
# ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["next_values", "bootstrap_value"])
def test_vtrace_grad_values(form, backend, rt):
    r, v = _r(N, T, seed=1), _r(N, T, seed=2)
    g = _r(N, T, seed=3, low=0.3, high=0.95)
    lam = _r(N, T, seed=4, low=0.3, high=0.95)
    log_pi, log_mu = _log_probs(5)
    log_pi, log_mu = log_pi.detach(), log_mu.detach()
    done, term = _flags(1)
    if form == "next_values":
        extra = _r(N, T, seed=6)

        def fn(r, v, nv, g, lam):
            return rt.vtrace(r, v, log_pi, log_mu, next_values=nv, done=done, terminated=term,
                             gamma=g, lmbda=lam, backend=backend)
    else:
        extra = _r(N, seed=6)

        def fn(r, v, bv, g, lam):
            return rt.vtrace(r, v, log_pi, log_mu, bootstrap_value=bv, terminated=term,
                             gamma=g, lmbda=lam, backend=backend)

    _check(fn, (r, v, extra, g, lam), second_order=True, backend=backend)


@pytest.mark.parametrize("rho_bar,c_bar", [(1.0, 1.0), (math.inf, math.inf), (2.0, 0.5)])
def test_vtrace_grad_log_probs(rho_bar, c_bar, backend, rt):
    """Gradients through the importance ratios, inside the smooth (unclipped or clipped) region."""
    r, v, nv = _r(N, T, seed=1), _r(N, T, seed=2), _r(N, T, seed=3)
    # log ratios at least 0.25 away from 0: ratios in [0.50, 0.78] or [1.28, 2.01]
    log_pi, log_mu = _log_probs(7)
    if rho_bar == 2.0:
        # keep away from both kinks (0.5 and 2.0): ratios near 1
        g = torch.Generator().manual_seed(8)
        log_mu = (torch.rand(N, T, generator=g, dtype=F64) - 1.5).requires_grad_()
        log_pi = (log_mu.detach() + 0.3 * (torch.rand(N, T, generator=g, dtype=F64) - 0.5)
                  ).requires_grad_()
    done, term = _flags(0)

    def fn(lp, lm, r, v, nv):
        return rt.vtrace(r, v, lp, lm, next_values=nv, done=done, terminated=term, gamma=0.9,
                         lmbda=0.9, rho_bar=rho_bar, c_bar=c_bar, backend=backend)

    _check(fn, (log_pi, log_mu, r, v, nv))


@pytest.mark.parametrize("form", ["expected", "full"])
def test_retrace_grad(form, backend, rt):
    r, q = _r(N, T, seed=1), _r(N, T, seed=2)
    g = _r(N, T, seed=3, low=0.3, high=0.95)
    lam = _r(N, T, seed=4, low=0.3, high=0.95)
    log_pi, log_mu = _log_probs(5)
    done, term = _flags(1)
    if form == "expected":
        extra = (_r(N, T, seed=6),)

        def fn(r, q, lp, lm, g, lam, ev):
            return rt.retrace(r, q, lp, lm, next_expected_q=ev, done=done, terminated=term,
                              gamma=g, lmbda=lam, backend=backend)
    else:
        pi = torch.softmax(_r(N, T, 3, seed=6, grad=False), -1).requires_grad_()
        extra = (pi, _r(N, T, 3, seed=7))

        def fn(r, q, lp, lm, g, lam, pi, nq):
            return rt.retrace(r, q, lp, lm, next_pi=pi, next_q=nq, done=done, terminated=term,
                              gamma=g, lmbda=lam, backend=backend)

    _check(fn, (r, q, log_pi, log_mu, g, lam) + extra, second_order=True, backend=backend)


# ----------------------------------------------------------------------------------------
# forward traces
# ----------------------------------------------------------------------------------------


def test_eligibility_trace_grad(backend, rt):
    x = _r(N, T, seed=1)
    init = _r(N, seed=2)
    g = _r(N, T, seed=3, low=0.3, high=0.95)
    lam = torch.tensor(0.7, dtype=F64, requires_grad=True)
    done, _ = _flags(0)

    def fn(x, init, g, lam):
        return rt.eligibility_trace(x, done=done, gamma=g, lmbda=lam, initial=init,
                                    backend=backend)

    _check(fn, (x, init, g, lam), second_order=True, backend=backend)


def test_eligibility_trace_grad_features(backend, rt):
    x = _r(N, T, 3, seed=1)
    init = _r(N, 3, seed=2)
    done, _ = _flags(1)

    def fn(x, init):
        return rt.eligibility_trace(x, done=done, gamma=0.9, lmbda=0.8, initial=init, time_dim=1,
                                    backend=backend)

    _check(fn, (x, init))


def test_episodic_cumsum_grad(backend, rt):
    x = _r(N, T, seed=1)
    init = _r(N, seed=2)
    done, _ = _flags(1)

    def fn(x, init):
        return rt.episodic_cumsum(x, done=done, initial=init, backend=backend)

    _check(fn, (x, init), second_order=True, backend=backend)


def test_no_grad_inputs_give_plain_outputs(backend, rt):
    r, v = _r(N, T, seed=1, grad=False), _r(N, T, seed=2, grad=False)
    adv, tgt = rt.gae(r, v, backend=backend)
    assert not adv.requires_grad and not tgt.requires_grad


def test_backward_matches_explicit_adjoint(backend, rt):
    """d/d alpha of sum(w * y) for the reverse scan is the forward scan of w with beta shifted:
    g[t] = w[t] + beta[t-1] g[t-1]."""
    a = _r(N, T, seed=1)
    b = _r(N, T, seed=2, low=-0.9, high=0.9, grad=False)
    w = _r(N, T, seed=3, grad=False)
    y = rt.affine_scan(a, b, reverse=True, backend=backend)
    (y * w).sum().backward()
    expected = torch.zeros(N, T, dtype=F64)
    for i in range(N):
        acc = 0.0
        for t in range(T):
            acc = w[i, t].item() + (b[i, t - 1].item() * acc if t > 0 else 0.0)
            expected[i, t] = acc
    torch.testing.assert_close(a.grad, expected, rtol=1e-12, atol=1e-12)
