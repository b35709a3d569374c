"""Independent float64 reference for rl_triton.

Written directly from the formulas of docs/semantics.md (section 6 for each algorithm, with
the flag rules of section 2, the window bootstrap of section 3 and the rules for non-finite
values of section 11), one plain Python loop per algorithm over rows and time. It shares no code
with the library (this module never imports ``rl_triton``) and does not use the alpha/beta
affine rewriting of the estimators (except for ``affine_scan`` itself, which *is* that
recurrence), so agreement with the library also checks the library's rewriting.

Flags and zero coefficients select terms: a term that a flag switches off, or whose coefficient
is exactly 0, is left out of the sum, never multiplied by 0, so an inf or NaN in it does not
reach the result (``0 * inf`` would be NaN). Everything else is plain IEEE arithmetic: inf and
NaN are values here, not errors or warnings.

Conventions
-----------
Every per-step input is a numpy array of shape ``[R, T]`` (rows x time), float64.
Flags (``term``, ``done``) are ``[R, T]`` arrays read as "true where nonzero".
``gamma`` / ``lmbda`` are ``[R, T]`` arrays (already broadcast; per-step value at index t).
Per-row inputs (``bootstrap``, ``initial``) are ``[R]`` arrays.
Retrace's full-distribution form takes ``next_pi`` / ``next_q`` of shape ``[R, T, A]``.
The whitening functions (section 15) take ``x`` of any shape and a ``mask`` of its shape.
rl_triton.testing.catalog maps a library call's arguments to these arrays.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "affine_scan",
    "arrival_gae",
    "discounted_return",
    "eligibility_trace",
    "episodic_cumsum",
    "gae",
    "gae_masked",
    "group_advantages",
    "implied_next_values",
    "kl_shaped_rewards",
    "masked_moments",
    "masked_whiten",
    "retrace",
    "td_lambda_return",
    "valid_discounted_return",
    "valid_gae",
    "vtrace",
]


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _b(x):
    return np.asarray(x) != 0


def _ieee(fn):
    """Run ``fn`` with numpy's floating-point warnings off: an overflow to inf, ``inf - inf``
    or ``0 * inf`` gives its IEEE value silently."""

    def quiet(*args, **kwargs):
        with np.errstate(all="ignore"):
            return fn(*args, **kwargs)

    quiet.__name__, quiet.__doc__ = fn.__name__, fn.__doc__
    return quiet


def _ratio(log_pi, log_mu):
    """The importance ratio exp(log_pi - log_mu) (inf where it overflows)."""
    return np.exp(log_pi - log_mu)


def _clip(ratio, bar):
    """min(bar, ratio), NaN where the ratio is NaN (as torch.minimum; Python's min drops it)."""
    return bar if ratio > bar else ratio


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


@_ieee
def gae(rewards, values, next_values, term, done, gamma, lmbda):
    """GAE.  delta[t] = r - v + (g nv unless term) ;
    A[t] = delta + (g l A[t+1] unless done or g l = 0), A[T] = 0.

    Returns (advantages, value_targets = advantages + values).
    """
    r, v, nv, g, lam = map(_f, (rewards, values, next_values, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    adv = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            if term[i, t]:
                delta = r[i, t] - v[i, t]
            else:
                delta = r[i, t] + g[i, t] * nv[i, t] - v[i, t]
            adv[i, t] = delta
            decay = g[i, t] * lam[i, t]
            if not done[i, t] and decay != 0:
                a_next = adv[i, t + 1] if t + 1 < T else 0.0
                adv[i, t] = delta + decay * a_next
    targets = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            targets[i, t] = adv[i, t] + v[i, t]
    return adv, targets


@_ieee
def gae_masked(rewards, values, mask, gamma, lmbda, mode="skip", bootstrap=None):
    """GAE over response tokens (docs/semantics.md, section 13), one row at a time.

    skip: a masked step is not a step: the TD error of an unmasked step t uses the value of the
    next unmasked step (``bootstrap``, default 0, past the last one) and its advantage adds
    gamma*lmbda times the advantage of that step; a masked step holds the advantage of the next
    unmasked step (0 past the last). Value targets: advantage + value at every step.
    pad: rewards and values read as 0 where the mask is 0, then plain GAE to the window end
    (``bootstrap`` past it); value targets: advantage + the zeroed value.
    Returns (advantages, value_targets)."""
    r, v, g, l = _f(rewards), _f(values), _f(gamma), _f(lmbda)
    m = _b(mask)
    R, T = r.shape
    boot = np.zeros(R) if bootstrap is None else _f(bootstrap)
    adv, tgt = np.zeros((R, T)), np.zeros((R, T))
    for i in range(R):
        if mode == "skip":
            valid = [t for t in range(T) if m[i, t]]
            following = {}  # unmasked step -> the next unmasked step (None past the last)
            for k, t in enumerate(valid):
                following[t] = valid[k + 1] if k + 1 < len(valid) else None
            a_of = {}
            for t in reversed(valid):
                n = following[t]
                nv = boot[i] if n is None else v[i, n]
                a = r[i, t] + g[i, t] * nv - v[i, t]
                if n is not None and g[i, t] * l[i, t] != 0:
                    a = a + g[i, t] * l[i, t] * a_of[n]
                a_of[t] = a
            held = 0.0  # the advantage of the first unmasked step at or after t
            for t in reversed(range(T)):
                if m[i, t]:
                    held = a_of[t]
                adv[i, t] = held
                tgt[i, t] = held + v[i, t]
        else:
            rr = np.where(m[i], r[i], 0.0)
            vv = np.where(m[i], v[i], 0.0)
            a = 0.0
            for t in reversed(range(T)):
                nv = boot[i] if t == T - 1 else vv[t + 1]
                delta = rr[t] + g[i, t] * nv - vv[t]
                a = delta + (g[i, t] * l[i, t] * a if (t < T - 1 and g[i, t] * l[i, t] != 0) else 0.0)
                adv[i, t] = a
                tgt[i, t] = a + vv[t]
    return adv, tgt


@_ieee
def kl_shaped_rewards(rewards, log_probs, ref_log_probs, coef, estimator="k1", clamp=None):
    """The KL-shaped rewards of docs/semantics.md, section 13.1: r[t] - coef*kl[t] with
    d = log_probs - ref_log_probs and kl = d (k1), d*d/2 (k2), min(exp(q) - q - 1, 10) with
    q = -d clipped to [-20, 20] (k3), |d| (abs), then clipped to [-clamp, clamp] where clamp is
    given. NaN stays NaN (the clips keep it)."""
    r, lp, ref = _f(rewards), _f(log_probs), _f(ref_log_probs)
    R, T = r.shape
    out = np.zeros((R, T))

    def clip(x, lo, hi):
        if math.isnan(x):
            return x
        return lo if x < lo else hi if x > hi else x

    for i in range(R):
        for t in range(T):
            d = float(lp[i, t]) - float(ref[i, t])
            if estimator == "k1":
                kl = d
            elif estimator == "k2":
                kl = d * d / 2.0
            elif estimator == "k3":
                q = clip(-d, -20.0, 20.0)
                kl = clip(math.exp(q) - q - 1.0, -math.inf, 10.0) if not math.isnan(q) else q
            elif estimator == "abs":
                kl = abs(d)
            else:
                raise ValueError(f"unknown estimator {estimator!r}")
            if clamp is not None:
                kl = clip(kl, -clamp, clamp)
            out[i, t] = r[i, t] - coef * kl
    return out


@_ieee
def td_lambda_return(rewards, next_values, term, done, gamma, lmbda):
    """G[t] = r                                                  if term[t],
            = r + g nv[t]                                        if done[t],
            = r + g (1-l) nv[t] + (g l G'[t+1] unless g l = 0)   otherwise,
    G'[t+1] = nv[t] at t = T-1, else G[t+1]."""
    r, nv, g, lam = map(_f, (rewards, next_values, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    G = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            if term[i, t]:
                G[i, t] = r[i, t]
            elif done[i, t]:  # the lambda-mixture of nv with itself is nv
                G[i, t] = r[i, t] + g[i, t] * nv[i, t]
            else:
                G[i, t] = r[i, t] + g[i, t] * (1.0 - lam[i, t]) * nv[i, t]
                decay = g[i, t] * lam[i, t]
                if decay != 0:
                    g_next = nv[i, t] if t == T - 1 else G[i, t + 1]
                    G[i, t] = G[i, t] + decay * g_next
    return G


@_ieee
def discounted_return(rewards, term, done, gamma, next_values=None, carry=None):
    """Reward-to-go.  R[t] = r                      if term[t],
                            = r + g nv[t]            if done[t] (truncation),
                            = r + (g X unless g = 0) otherwise,
    X = carry at t = T-1, else R[t+1]; carry (per row) defaults to 0 (Monte Carlo)."""
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
            elif done[i, t]:
                if nv is None:
                    raise ValueError("oracle: truncation without next_values")
                out[i, t] = r[i, t] + g[i, t] * nv[i, t]
            elif g[i, t] == 0:
                out[i, t] = r[i, t]
            else:
                x = c if t == T - 1 else out[i, t + 1]
                out[i, t] = r[i, t] + g[i, t] * x
    return out


@_ieee
def valid_gae(rewards, values, next_values, valid, next_valid, done, gamma, trace):
    """GAE over valid steps (Sample Factory, section 6.11).
    delta[t] = (r - v if valid[t]) + (g nv if next_valid[t] and not done[t]);
    A[t] = delta + (1 if not valid[t] else trace) * A[t+1] unless done[t] or that factor is 0;
    A[T] = 0."""
    r, v, nv, g, trace = map(_f, (rewards, values, next_values, gamma, trace))
    valid, next_valid, done = _b(valid), _b(next_valid), _b(done)
    R, T = r.shape
    adv = np.zeros((R, T))
    for i in range(R):
        a_next = 0.0
        for t in reversed(range(T)):
            delta = 0.0
            if valid[i, t]:
                delta += r[i, t] - v[i, t]
            if next_valid[i, t] and not done[i, t]:
                delta += g[i, t] * nv[i, t]
            factor = trace[i, t] if valid[i, t] else 1.0
            if not done[i, t] and factor != 0:
                delta += factor * a_next
            adv[i, t] = a_next = delta
    return adv


@_ieee
def valid_discounted_return(x, valid, done, gamma, initial=None):
    """Discounted sum over valid steps (Sample Factory, section 6.11).
    S[t] = x[t] + (g if valid[t] else 1) * S[t+1] unless done[t] or that factor is 0;
    S[T] = initial (per row), default 0."""
    x, g = _f(x), _f(gamma)
    valid, done = _b(valid), _b(done)
    R, T = x.shape
    out = np.zeros((R, T))
    for i in range(R):
        s_next = 0.0 if initial is None else float(initial[i])
        for t in reversed(range(T)):
            s = x[i, t]
            factor = g[i, t] if valid[i, t] else 1.0
            if not done[i, t] and factor != 0:
                s = s + factor * s_next
            out[i, t] = s_next = s
    return out


@_ieee
def vtrace(rewards, values, next_values, log_pi, log_mu, term, done, gamma, lmbda,
           rho_bar, c_bar, rho_bar_pg):
    """V-trace (IMPALA), lambda as in rlax/TorchRL.

    ratio = exp(log_pi - log_mu); rho = min(rho_bar, ratio); c = l*min(c_bar, ratio)
    delta[t] = rho (r - v + (g nv unless term))
    (vs - v)[t] = delta[t] + (g c[t] (vs - v)[t+1] unless done or g c = 0),  (vs - v)[T] = 0
    vs = v + (vs - v)
    pg[t] = min(rho_bar_pg, ratio) (r - v + (g vs_next unless term)),
    vs_next = vs[t+1] if t < T-1 and not done[t] else nv[t].
    """
    r, v, nv, lp, lm, g, lam = map(_f, (rewards, values, next_values, log_pi, log_mu, gamma, lmbda))
    term, done = _b(term), _b(done)
    R, T = r.shape
    diff = np.zeros((R, T))  # vs - v
    vs = np.zeros((R, T))
    pg = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            ratio = _ratio(lp[i, t], lm[i, t])
            rho = _clip(ratio, rho_bar)
            c = lam[i, t] * _clip(ratio, c_bar)
            if term[i, t]:
                delta = rho * (r[i, t] - v[i, t])
            else:
                delta = rho * (r[i, t] + g[i, t] * nv[i, t] - v[i, t])
            diff[i, t] = delta
            trace = g[i, t] * c
            if not done[i, t] and trace != 0:
                diff_next = diff[i, t + 1] if t + 1 < T else 0.0
                diff[i, t] = delta + trace * diff_next
            vs[i, t] = v[i, t] + diff[i, t]
        for t in range(T):
            rho_pg = _clip(_ratio(lp[i, t], lm[i, t]), rho_bar_pg)
            if term[i, t]:
                pg[i, t] = rho_pg * (r[i, t] - v[i, t])
                continue
            if t < T - 1 and not done[i, t]:
                vs_next = vs[i, t + 1]
            else:
                vs_next = nv[i, t]
            pg[i, t] = rho_pg * (r[i, t] + g[i, t] * vs_next - v[i, t])
    return vs, pg


@_ieee
def arrival_gae(rewards, values, ratio, done, gamma, lmbda, rho_bar, c_bar):
    """GAE with clipped importance weights on arrival-aligned rows (semantics section 6.9):
    the step from observation t has the reward and the flag that arrive with observation t+1.

    rho = min(rho_bar, ratio[t]); c = min(c_bar, ratio[t])
    A[t] = rho (r[t+1] - v[t] + (g v[t+1] unless done[t+1]))
           + (g l c A[t+1] unless done[t+1] or g l c = 0),   t < T-1
    A[T-1] = 0 (the last observation has no step in the row).
    """
    r, v, x, g, lam = map(_f, (rewards, values, ratio, gamma, lmbda))
    done = _b(done)
    R, T = r.shape
    adv = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T - 1)):
            rho = _clip(x[i, t], rho_bar)
            c = _clip(x[i, t], c_bar)
            if done[i, t + 1]:
                adv[i, t] = rho * (r[i, t + 1] - v[i, t])
                continue
            adv[i, t] = rho * (r[i, t + 1] + g[i, t] * v[i, t + 1] - v[i, t])
            trace = g[i, t] * lam[i, t] * c
            if trace != 0:
                adv[i, t] += trace * adv[i, t + 1]
    return adv


@_ieee
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


@_ieee
def trace_coefficient(trace, lam, log_pi=None, log_mu=None, greedy=None, c_bar=1.0):
    """c of one step for each trace of Munos et al. 2016 (table 1) and Watkins' Q(lambda):
    retrace lam*min(c_bar, pi/mu), importance lam*pi/mu, tree_backup lam*pi, q_lambda lam where the
    action is greedy (else 0), peng lam."""
    if trace == "retrace":
        return lam * _clip(_ratio(log_pi, log_mu), c_bar)
    if trace == "importance":
        return lam * _ratio(log_pi, log_mu)
    if trace == "tree_backup":
        return lam * np.exp(log_pi)
    if trace == "q_lambda":
        return lam if greedy else 0.0
    if trace == "peng":
        return lam
    raise ValueError(trace)


def retrace(rewards, q_values, log_pi, log_mu, term, done, gamma, lmbda, c_bar,
            next_expected_q=None, next_pi=None, next_q=None, trace="retrace", greedy=None):
    """Off-policy Q targets with a trace (Munos et al. 2016); Retrace(lambda) by default.

    c[t] = trace_coefficient(trace, l[t], log_pi[t], log_mu[t], greedy[t], c_bar), c[T] = 0
    Q_ret[t] = r                                                if term[t],
             = r + g (ev[t] + c[t+1] (Q_ret[t+1] - q[t+1]))     if not done[t] and g c[t+1] != 0,
             = r + g ev[t]                                      otherwise.
    """
    if next_expected_q is None:
        ev = expected_q(next_pi, next_q)
    else:
        ev = _f(next_expected_q)
    r, q, g, lam = map(_f, (rewards, q_values, gamma, lmbda))
    R, T = r.shape
    lp = _f(log_pi) if log_pi is not None else np.zeros((R, T))
    lm = _f(log_mu) if log_mu is not None else np.zeros((R, T))
    greedy = _b(greedy) if greedy is not None else np.zeros((R, T), dtype=bool)
    term, done = _b(term), _b(done)
    out = np.zeros((R, T))
    for i in range(R):
        for t in reversed(range(T)):
            if term[i, t]:
                out[i, t] = r[i, t]
                continue
            out[i, t] = r[i, t] + g[i, t] * ev[i, t]
            if t + 1 < T and not done[i, t]:
                c_next = trace_coefficient(trace, lam[i, t + 1], lp[i, t + 1], lm[i, t + 1], greedy[i, t + 1], c_bar)
                if g[i, t] * c_next != 0:
                    tail = c_next * (out[i, t + 1] - q[i, t + 1])
                    out[i, t] = r[i, t] + g[i, t] * (ev[i, t] + tail)
    return out


@_ieee
def nstep_return(rewards, next_values, term, done, gamma, n):
    """R[t] = sum_{k<m} g^k r[t+k] + g^m (1 - term[t+m-1]) nv[t+m-1], the window of m = min(n,
    steps to the episode's end, steps to the rollout's end) rewards from t (docs/semantics.md, 6.10);
    g^k the product of the window's discounts. One row at a time, one window at a time."""
    r, nv, g = _f(rewards), _f(next_values), _f(gamma)
    term, done = _b(term), _b(done)
    R, T = r.shape
    out = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            total, discount = 0.0, 1.0
            for k in range(n):
                s = t + k
                total += discount * r[i, s]
                if term[i, s]:
                    break
                if done[i, s] or k == n - 1 or s == T - 1:
                    total += discount * g[i, s] * nv[i, s]
                    break
                discount *= g[i, s]
            out[i, t] = total
    return out


@_ieee
def eligibility_trace(x, done, gamma, lmbda, initial=None):
    """e[t] = x[t] + (g[t] l[t] e[t-1] unless done[t-1] or g[t] l[t] = 0),
    done[-1] = 0, e[-1] = initial (0)."""
    x, g, lam = _f(x), _f(gamma), _f(lmbda)
    done = _b(done)
    R, T = x.shape
    e = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            e[i, t] = x[i, t]
            decay = g[i, t] * lam[i, t]
            if t == 0:
                prev = 0.0 if initial is None else float(initial[i])
                cut = False
            else:
                prev = e[i, t - 1]
                cut = done[i, t - 1]
            if not cut and decay != 0:
                e[i, t] = x[i, t] + decay * prev
    return e


@_ieee
def episodic_cumsum(x, done, initial=None):
    """c[t] = x[t] + (c[t-1] unless done[t-1]), done[-1] = 0, c[-1] = initial (0)."""
    x = _f(x)
    done = _b(done)
    R, T = x.shape
    c = np.zeros((R, T))
    for i in range(R):
        for t in range(T):
            if t == 0:
                c[i, t] = x[i, t] + (0.0 if initial is None else float(initial[i]))
            elif done[i, t - 1]:
                c[i, t] = x[i, t]
            else:
                c[i, t] = x[i, t] + c[i, t - 1]
    return c


@_ieee
def affine_scan(alpha, beta, reverse=True, initial=None):
    """reverse: y[t] = a[t] + b[t] y[t+1], y[T] = initial;
    forward: y[t] = a[t] + b[t] y[t-1], y[-1] = initial (default 0);
    y[t] = a[t] where b[t] = 0 (the neighbour is not read)."""
    a, b = _f(alpha), _f(beta)
    R, T = a.shape
    y = np.zeros((R, T))
    for i in range(R):
        carry = 0.0 if initial is None else float(initial[i])
        order = reversed(range(T)) if reverse else range(T)
        for t in order:
            carry = a[i, t] if b[i, t] == 0 else a[i, t] + b[i, t] * carry
            y[i, t] = carry
    return y


# -- masked whitening (docs/semantics.md, section 15.1) ---------------------------------------------
def _sum(values):
    """The float64 sum of ``values``, correctly rounded (``math.fsum``) where the exact sum is a
    finite number; the IEEE sum (inf, NaN) where it is not."""
    try:
        return math.fsum(values)
    except (ValueError, OverflowError):  # inf - inf, or a sum past the float64 range
        return float(np.sum(values))


@_ieee
def masked_moments(x, mask=None):
    """(n, mean, M2) of the valid elements of ``x`` (``mask`` nonzero; all when None), as Python
    numbers: n = #valid, mean = sum(x[valid]) / n, M2 = sum((x[valid] - mean)**2); the sums
    correctly rounded in float64; n = 0 gives mean = NaN, M2 = 0."""
    x = _f(x).reshape(-1)
    valid = [float(v) for v, keep in zip(x, np.ones(x.shape, bool) if mask is None else _b(mask).reshape(-1))
             if keep]
    n = len(valid)
    mean = float(np.float64(_sum(valid)) / np.float64(n))
    return n, mean, _sum([(v - mean) * (v - mean) for v in valid])


@_ieee
def masked_whiten(x, mask=None, *, unbiased=True, shift_mean=True, scale=True, eps=1e-8, eps_mode="add"):
    """y = (x - mean) * rstd at every position (masked ones included), plus mean again where not
    ``shift_mean``; the statistics of :func:`masked_moments` over the valid elements, and
    var  = M2 / (n - 1) (unbiased) or M2 / n,
    rstd = 1 / sqrt(var + eps) ("add"), 1 / sqrt(max(var, eps)) ("clamp", NaN stays NaN),
           1 / (sqrt(var) + eps) ("std"), or 1 where not ``scale``.
    float64 array of ``x``'s shape."""
    n, mean, m2 = masked_moments(x, mask)
    x = _f(x)
    rstd = np.float64(1.0)
    if scale:
        var = np.float64(m2) / np.float64(n - 1 if unbiased else n)
        if eps_mode == "std":
            rstd = 1.0 / (np.sqrt(var) + eps)
        elif eps_mode == "clamp":
            rstd = 1.0 / np.sqrt(var if (var > eps or np.isnan(var)) else np.float64(eps))
        elif eps_mode == "add":
            rstd = 1.0 / np.sqrt(var + eps)
        else:
            raise ValueError(f"eps_mode must be 'add', 'clamp' or 'std', got {eps_mode!r}")
    y = (x - mean) * rstd  # elementwise float64, one rounding per operation
    return y if shift_mean else y + mean
@_ieee
def group_advantages(scores, labels, mode="grpo", mask=None, eps=1e-6):
    """Group advantages (docs/semantics.md, section 16.2), one group at a time.

    ``scores``: ``[B]``; ``labels``: ``B`` hashable group ids (equal ids form a group);
    ``mode``: "grpo", "drgrpo", "rloo" or "reinforce_plus_plus_baseline"; ``mask``: optional
    ``[B, L]``, valid where nonzero (required by "reinforce_plus_plus_baseline").
    For a group of n > 1 with mean m and unbiased standard deviation s: grpo (x - m) / (s + eps),
    drgrpo and reinforce_plus_plus_baseline x - m, rloo x minus the mean of the other n - 1
    scores. A group of one: grpo x / (1 + eps) with 1 + eps rounded to float32, the others x.
    reinforce_plus_plus_baseline then whitens over the valid tokens: each row counts once per
    valid token, (a - mu) / sqrt(var + 1e-8) with the unbiased variance. With ``mask`` the
    result is ``[B, L]``: the advantage where the mask is nonzero, 0 elsewhere.
    """
    s = _f(scores)
    members = {}
    for i, label in enumerate(labels):
        members.setdefault(label, []).append(i)
    a = np.zeros(len(s))
    one_eps = float(np.float32(1.0) + np.float32(eps))
    for idx in members.values():
        n = len(idx)
        if n == 1:
            a[idx[0]] = s[idx[0]] / one_eps if mode == "grpo" else s[idx[0]]
            continue
        mean = sum(s[j] for j in idx) / n
        std = math.sqrt(sum((s[j] - mean) ** 2 for j in idx) / (n - 1))
        for i in idx:
            if mode == "grpo":
                a[i] = (s[i] - mean) / (std + eps)
            elif mode == "rloo":
                a[i] = s[i] - sum(s[j] for j in idx if j != i) / (n - 1)
            else:
                a[i] = s[i] - mean
    if mask is None:
        return a
    valid = _b(mask)
    if mode == "reinforce_plus_plus_baseline":
        # one valid token gives var = 0 / 0 (NaN), none an all-zero result: float64 division
        tokens = [a[i] for i in range(len(a)) for _ in range(int(valid[i].sum()))]
        mu = np.float64(sum(tokens)) / len(tokens)
        var = np.float64(sum((x - mu) ** 2 for x in tokens)) / (len(tokens) - 1)
        a = (a - mu) / np.sqrt(var + 1e-8)
    out = np.zeros(valid.shape)
    for i in range(valid.shape[0]):
        for t in range(valid.shape[1]):
            if valid[i, t]:
                out[i, t] = a[i]
    return out
