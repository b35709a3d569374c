"""Independent float64 reference for rl_triton.

Written directly from the formulas of docs/semantics.md (section 6 for each algorithm, with
the flag rules of section 2 and the window bootstrap of section 3), one plain Python loop per
algorithm over rows and time.  It shares no code with the library (this module never imports
``rl_triton``) and does not use the alpha/beta affine rewriting of the estimators (except for
``affine_scan`` itself, which *is* that recurrence), so agreement with the library also checks
the library's rewriting.

Conventions
-----------
Every per-step input is a numpy array of shape ``[R, T]`` (rows x time), float64.
Flags (``term``, ``done``) are ``[R, T]`` arrays read as "true where nonzero".
``gamma`` / ``lmbda`` are ``[R, T]`` arrays (already broadcast; per-step value at index t).
Per-row inputs (``bootstrap``, ``initial``) are ``[R]`` arrays.
Retrace's full-distribution form takes ``next_pi`` / ``next_q`` of shape ``[R, T, A]``.
rl_triton.testing.catalog maps a library call's arguments to these arrays.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "affine_scan",
    "discounted_return",
    "eligibility_trace",
    "episodic_cumsum",
    "gae",
    "implied_next_values",
    "retrace",
    "td_lambda_return",
    "vtrace",
]


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _b(x):
    return np.asarray(x) != 0


def implied_next_values(values, bootstrap=None):
    """next_values[t] = values[t+1] for t < T-1 and bootstrap (default 0) at t = T-1."""
    values = _f(values)
    R, T = values.shape
    nv = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            if t + 1 < T:
                nv[i, t] = values[i, t + 1]
            else:
                nv[i, t] = 0.0 if bootstrap is None else float(bootstrap[i])
    return nv


def gae(rewards, values, next_values, term, done, gamma, lmbda):
    """GAE.  delta[t] = r + g(1-term) nv - v ;  A[t] = delta + g l (1-done) A[t+1], A[T] = 0.

    Returns (advantages, value_targets = advantages + values).
    """
    r, v, nv, g, lam = map(_f, (rewards, values, next_values, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    adv = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            not_term = 0.0 if term[i, t] else 1.0
            not_done = 0.0 if done[i, t] else 1.0
            delta = r[i, t] + g[i, t] * not_term * nv[i, t] - v[i, t]
            a_next = adv[i, t + 1] if t + 1 < T else 0.0
            adv[i, t] = delta + g[i, t] * lam[i, t] * not_done * a_next
    targets = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            targets[i, t] = adv[i, t] + v[i, t]
    return adv, targets


def td_lambda_return(rewards, next_values, term, done, gamma, lmbda):
    """G[t] = r + g (1-term) ((1-l) nv[t] + l G'[t+1]),
    G'[t+1] = nv[t] if done[t] or t = T-1 else G[t+1]."""
    r, nv, g, lam = map(_f, (rewards, next_values, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    G = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            if done[i, t] or t == T - 1:
                g_next = nv[i, t]
            else:
                g_next = G[i, t + 1]
            not_term = 0.0 if term[i, t] else 1.0
            G[i, t] = r[i, t] + g[i, t] * not_term * (
                (1.0 - lam[i, t]) * nv[i, t] + lam[i, t] * g_next
            )
    return G


def discounted_return(rewards, term, done, gamma, next_values=None, carry=None):
    """Reward-to-go.  R[t] = r + g (1-term) * X with
       X = nv[t]      if done[t] (truncation; irrelevant when terminated),
       X = carry      if t = T-1 and not done,
       X = R[t+1]     otherwise.
    carry (per row) defaults to 0 (Monte Carlo)."""
    r, g = _f(rewards), _f(gamma)
    term, done = _b(term), _b(done)
    R, T = r.shape
    nv = None if next_values is None else _f(next_values)
    out = np.zeros((R, T))
    for i in range(R):
        c = 0.0 if carry is None else float(carry[i])
        for t in reversed(range(T)):
            if term[i, t]:
                out[i, t] = r[i, t]
                continue
            if done[i, t]:
                if nv is None:
                    raise ValueError("oracle: truncation without next_values")
                x = nv[i, t]
            elif t == T - 1:
                x = c
            else:
                x = out[i, t + 1]
            out[i, t] = r[i, t] + g[i, t] * x
    return out


def vtrace(rewards, values, next_values, log_pi, log_mu, term, done, gamma, lmbda,
           rho_bar, c_bar, rho_bar_pg):
    """V-trace (IMPALA), lambda as in rlax/TorchRL.

    ratio = exp(log_pi - log_mu); rho = min(rho_bar, ratio); c = l*min(c_bar, ratio)
    delta[t] = rho (r + g (1-term) nv - v)
    (vs - v)[t] = delta[t] + g (1-done) c[t] (vs - v)[t+1],  (vs - v)[T] = 0
    pg[t] = min(rho_bar_pg, ratio) (r + g (1-term) vs_next - v),
    vs_next = vs[t+1] if t < T-1 and not done[t] else nv[t].
    """
    r, v, nv, lp, lm, g, lam = map(_f, (rewards, values, next_values, log_pi, log_mu, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    vs = np.zeros((R, T))
    pg = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            ratio = math.exp(lp[i, t] - lm[i, t])
            rho = min(rho_bar, ratio)
            c = lam[i, t] * min(c_bar, ratio)
            not_term = 0.0 if term[i, t] else 1.0
            not_done = 0.0 if done[i, t] else 1.0
            delta = rho * (r[i, t] + g[i, t] * not_term * nv[i, t] - v[i, t])
            diff_next = (vs[i, t + 1] - v[i, t + 1]) if t + 1 < T else 0.0
            vs[i, t] = v[i, t] + delta + g[i, t] * not_done * c * diff_next
        for t in range(T):
            ratio = math.exp(lp[i, t] - lm[i, t])
            rho_pg = min(rho_bar_pg, ratio)
            if t < T - 1 and not done[i, t]:
                vs_next = vs[i, t + 1]
            else:
                vs_next = nv[i, t]
            not_term = 0.0 if term[i, t] else 1.0
            pg[i, t] = rho_pg * (r[i, t] + g[i, t] * not_term * vs_next - v[i, t])
    return vs, pg


def expected_q(next_pi, next_q):
    """ev[r, t] = sum_a pi(a | s_{t+1}) Q(s_{t+1}, a)."""
    p, q = _f(next_pi), _f(next_q)
    R, T, A = p.shape
    ev = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            s = 0.0
            for a in range(A):
                s += p[i, t, a] * q[i, t, a]
            ev[i, t] = s
    return ev


def retrace(rewards, q_values, log_pi, log_mu, term, done, gamma, lmbda, c_bar,
            next_expected_q=None, next_pi=None, next_q=None):
    """Retrace(lambda) (Munos et al. 2016).

    c[t] = l[t] * min(c_bar, exp(log_pi[t] - log_mu[t])), c[T] = 0
    Q_ret[t] = r + g (1-term) (ev[t] + (1-done) c[t+1] (Q_ret[t+1] - q[t+1]))
    """
    if next_expected_q is None:
        ev = expected_q(next_pi, next_q)
    else:
        ev = _f(next_expected_q)
    r, q, lp, lm, g, lam = map(_f, (rewards, q_values, log_pi, log_mu, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    out = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            if term[i, t]:
                out[i, t] = r[i, t]
                continue
            tail = 0.0
            if t + 1 < T and not done[i, t]:
                c_next = lam[i, t + 1] * min(c_bar, math.exp(lp[i, t + 1] - lm[i, t + 1]))
                tail = c_next * (out[i, t + 1] - q[i, t + 1])
            out[i, t] = r[i, t] + g[i, t] * (ev[i, t] + tail)
    return out


def eligibility_trace(x, done, gamma, lmbda, initial=None):
    """e[t] = x[t] + g[t] l[t] (1 - done[t-1]) e[t-1], done[-1] = 0, e[-1] = initial (0)."""
    x, g, lam = _f(x), _f(gamma), _f(lmbda)
    done = _b(done)
    R, T = x.shape
    e = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            if t == 0:
                prev = 0.0 if initial is None else float(initial[i])
                keep = 1.0
            else:
                prev = e[i, t - 1]
                keep = 0.0 if done[i, t - 1] else 1.0
            e[i, t] = x[i, t] + g[i, t] * lam[i, t] * keep * prev
    return e


def episodic_cumsum(x, done, initial=None):
    """c[t] = x[t] + (1 - done[t-1]) c[t-1], done[-1] = 0, c[-1] = initial (0)."""
    x = _f(x)
    done = _b(done)
    R, T = x.shape
    c = np.zeros((R, T))
    for i in range(R):
        run = 0.0 if initial is None else float(initial[i])
        for t in range(T):
            if t > 0 and done[i, t - 1]:
                run = 0.0
            run = x[i, t] + run
            c[i, t] = run
    return c


def affine_scan(alpha, beta, reverse=True, initial=None):
    """reverse: y[t] = a[t] + b[t] y[t+1], y[T] = initial;
    forward: y[t] = a[t] + b[t] y[t-1], y[-1] = initial (default 0)."""
    a, b = _f(alpha), _f(beta)
    R, T = a.shape
    y = np.zeros((R, T))
    for i in range(R):
        carry = 0.0 if initial is None else float(initial[i])
        order = reversed(range(T)) if reverse else range(T)
        for t in order:
            carry = a[i, t] + b[i, t] * carry
            y[i, t] = carry
    return y
