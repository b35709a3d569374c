"""Per-step coefficients of each estimator's affine recurrence ``y = alpha + beta * y_next``.

Plain arithmetic on numbers or tensors, so every backend (torch ops, numba, Triton) evaluates
the same definitions. ``nterm = 1 - terminated`` and ``ndone = 1 - done`` are 0/1 numbers,
``nv`` is V(s_{t+1}) of the true successor.
"""


def gae(r, v, nv, nterm, ndone, g, l):
    """delta = r + g*(1-term)*nv - v; A[t] = delta + g*l*(1-done)*A[t+1]."""
    return r + g * nterm * nv - v, g * l * ndone


def td_lambda_return(r, nv, nterm, ndone, g, l):
    """G[t] = r + g*(1-term)*((1-l)*nv + l*G'[t+1]); G' = nv where done (carry nv[T-1])."""
    return r + g * nterm * nv * (1.0 - l * ndone), g * l * ndone


def discounted_return(r, nv, nterm, ndone, g):
    """R[t] = r + g*(1-term)*(R[t+1] if not done else nv): truncations restart from nv."""
    return r + g * nterm * (1.0 - ndone) * nv, g * ndone


def vtrace(r, v, nv, nterm, ndone, g, rho, c):
    """(vs - v)[t] = rho*(r + g*(1-term)*nv - v) + g*(1-done)*c*(vs - v)[t+1]."""
    return rho * (r + g * nterm * nv - v), g * ndone * c


def vtrace_pg(r, v, vs_next, nterm, g, rho_pg):
    """Policy-gradient advantage rho_pg*(r + g*(1-term)*vs_next - v)."""
    return rho_pg * (r + g * nterm * vs_next - v)


def retrace(r, q, ev, nterm, ndone, g, c_next):
    """(Q_ret - q)[t] = r + g*(1-term)*ev - q + g*(1-done)*c[t+1]*(Q_ret - q)[t+1]."""
    return r + g * nterm * ev - q, g * ndone * c_next
