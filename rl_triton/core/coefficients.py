"""Per-step coefficients of each estimator's affine recurrence ``y = alpha + beta * y_next``.

Plain arithmetic on numbers or tensors, so every backend (torch ops, numba, Triton) evaluates
the same definitions. ``nterm = 1 - terminated`` and ``ndone = 1 - done`` are 0/1 numbers,
``nv`` is V(s_{t+1}) of the true successor.

A term that a flag switches off is selected away, not multiplied by 0, so an inf or NaN that
belongs to a terminal state or to the next episode stays out (``0 * inf`` would be NaN):
``where`` is ``torch.where`` here; the numba backend rebinds it to a conditional on numbers
and the Triton backend to ``tl.where``. The recurrence itself drops ``y_next`` where ``beta``
is 0 (:func:`step`, and the scan engine's combine).
"""

import torch

where = torch.where


def step(alpha, beta, y_next):
    """alpha + beta * y_next, and alpha alone where beta is 0 (y_next is not read)."""
    return where(beta == 0, alpha, alpha + beta * y_next)


def gae(r, v, nv, nterm, ndone, g, l):
    """delta = r + g*(1-term)*nv - v; A[t] = delta + g*l*(1-done)*A[t+1]."""
    return r + where(nterm == 0, 0.0, g * nterm * nv) - v, where(ndone == 0, 0.0, g * l * ndone)


def masked_gae(r, v, nv, m, g, l):
    """GAE skipping masked steps: where m, delta = r + g*nv - v and beta = g*l (nv: the value of
    the next unmasked step); where not, (0, 1), which passes the carried advantage on."""
    return where(m == 0, 0.0, r + g * nv - v), where(m == 0, 1.0, g * l * m)


def valid_gae(r, v, nv, valid, next_valid, ndone, g, trace):
    """Sample Factory's GAE over valid steps (0/1 numbers ``valid``, ``next_valid``; ``trace`` =
    gamma*lambda): delta = valid*(r - v) + g*(1-done)*next_valid*nv,
    beta = (1-done)*(trace if valid else 1)."""
    own = where(valid == 0, 0.0, r - v)
    return own + where(ndone * next_valid == 0, 0.0, g * nv), where(ndone == 0, 0.0, where(valid == 0, 1.0, trace))


def valid_discounted_return(x, valid, ndone, g):
    """Sample Factory's discounted sum over valid steps: S = x + (1-done)*(g if valid else 1)*S[t+1]."""
    return x, where(ndone == 0, 0.0, where(valid == 0, 1.0, g))


def td_lambda_return(r, nv, nterm, ndone, g, l):
    """G[t] = r + g*(1-term)*((1-l)*nv + l*G'[t+1]); G' = nv where done (carry nv[T-1])."""
    return r + where(nterm == 0, 0.0, g * nterm * nv * (1.0 - l * ndone)), where(ndone == 0, 0.0, g * l * ndone)


def discounted_return(r, nv, nterm, ndone, g):
    """R[t] = r + g*(1-term)*(R[t+1] if not done else nv): truncations restart from nv."""
    return r + where((nterm == 0) | (ndone != 0), 0.0, g * nterm * (1.0 - ndone) * nv), where(ndone == 0, 0.0, g * ndone)


def vtrace(r, v, nv, nterm, ndone, g, rho, c):
    """(vs - v)[t] = rho*(r + g*(1-term)*nv - v) + g*(1-done)*c*(vs - v)[t+1]."""
    return rho * (r + where(nterm == 0, 0.0, g * nterm * nv) - v), where(ndone == 0, 0.0, g * ndone * c)


def arrival_gae(r, v, nv, ndone, g, l, rho, c):
    """One step of V-trace's advantage on arrival-aligned rows (r, ndone of the next observation,
    nv its value): delta = rho*(r + g*(1-done)*nv - v), beta = g*l*c*(1-done)."""
    return rho * (r + where(ndone == 0, 0.0, g * nv) - v), where(ndone == 0, 0.0, g * l * c)


def vtrace_pg(r, v, vs_next, nterm, g, rho_pg):
    """Policy-gradient advantage rho_pg*(r + g*(1-term)*vs_next - v)."""
    return rho_pg * (r + where(nterm == 0, 0.0, g * nterm * vs_next) - v)


def retrace(r, ev, q_next, nterm, ndone, g, c_next):
    """Q_ret[t] = r + g*(1-term)*(ev + (1-done)*c[t+1]*(Q_ret[t+1] - q[t+1])), as
    alpha = r + g*(1-term)*ev - beta*q[t+1], beta = g*(1-done)*c[t+1] (term implies done)."""
    beta = where(ndone == 0, 0.0, g * ndone * c_next)
    return r + where(nterm == 0, 0.0, g * nterm * ev) - where(beta == 0, 0.0, beta * q_next), beta
