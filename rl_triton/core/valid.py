"""Sample Factory's valid steps (docs/semantics.md, section 6.11) as fused scans: GAE and the
discounted sum where a step whose ``valid`` flag is 0 passes the accumulated value on with factor
1 and has no TD error of its own. One launch per call on the fused backends, for any mix of valid
and invalid steps; the mask is never read on the host. ``rl_triton.integrations.sample_factory``
calls these; they are not exported at the top level.
"""

from __future__ import annotations

import torch

from . import coefficients as C
from . import routes, scan, spec
from .call import Call


def _flags(c: Call, *named):
    """Each flag (validated: broadcastable to the rewards, 0/1 where values are checked)."""
    return [c.mask(x, name) for name, x in named]


def _composed_flag(c: Call, x):
    """A flag as 0/1 in the compute dtype, ``[R, T]``."""
    return (c.view(x) != 0).to(c.compute_dtype)


@routes.public(None)
def valid_gae(rewards, values, next_values, valid, next_valid, done, *, gamma, trace, time_dim=-1, backend=None,
              out=None):
    """Sample Factory's GAE over valid steps:

    delta[t] = valid[t]*(r[t] - V[t]) + (1 - d[t])*gamma*next_valid[t]*V(s_{t+1}),
    A[t] = delta[t] + (1 - d[t])*(trace if valid[t] else 1)*A[t+1],  A[T] = 0.

    Args:
        rewards: ``r``, a float tensor with time at ``time_dim``.
        values: ``V(s_t)``, broadcastable to the rewards' shape, their dtype.
        next_values: ``V(s_{t+1})``, as ``values`` (the bootstrap value at the last step).
        valid: flags (any dtype, true where nonzero), broadcastable to the rewards: the steps
            that count.
        next_valid: flags as ``valid``: whether ``s_{t+1}`` is valid (``valid[t+1]`` inside the
            window, the bootstrap state's at the last step).
        done: flags as ``valid``: the episode ends after the step (cuts the bootstrap term and
            the trace).
        gamma: the discount, a number in [0, 1] or a tensor broadcastable to the rewards.
        trace: the factor of a valid step on the next advantage (GAE's gamma*lambda), as ``gamma``.
        time_dim: the time dim of every tensor.
        backend: None (auto), ``"triton"``, ``"cpu"`` (numba) or ``"torch"``.
        out: an optional output tensor of the rewards' shape and dtype.

    Returns the advantages, the rewards' shape and dtype.
    """
    c = Call(rewards, "rewards", time_dim)
    c.value(values, "values")
    c.value(next_values, "next_values")
    valid, next_valid, done = _flags(c, ("valid", valid), ("next_valid", next_valid), ("done", done))
    g, trace = c.coefficient(gamma, "gamma"), c.coefficient(trace, "trace")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        return c.bind(spec.VALID_GAE, rewards=c.view(rewards), values=c.view(values),
                      next_values=c.view(next_values), valid=c.view(valid), next_valid=c.view(next_valid),
                      done=c.view(done), gamma=c.view(g), trace=c.view(trace))
    r = c.float_rows(rewards)
    ones = torch.ones_like(r)
    alpha, beta = C.valid_gae(r, c.float_rows(values), c.float_rows(next_values), _composed_flag(c, valid),
                              _composed_flag(c, next_valid), 1.0 - _composed_flag(c, done), c.float_rows(g) * ones,
                              c.float_rows(trace) * ones)
    return c.results([scan.call_scan(c, alpha, beta, c.float_row(None), True)])


@routes.public(None)
def valid_discounted_return(rewards, valid, done, *, gamma, initial=None, time_dim=-1, backend=None, out=None):
    """Sample Factory's discounted sum over valid steps:

    S[t] = x[t] + (1 - d[t])*(gamma if valid[t] else 1)*S[t+1],  S[T] = initial (0).

    Args:
        rewards: ``x``, a float tensor with time at ``time_dim``, added at every step.
        valid: flags (any dtype, true where nonzero), broadcastable to the rewards: the steps
            that are discounted; the others pass the sum on with factor 1.
        done: flags as ``valid``: the episode ends after the step (cuts the sum).
        gamma: the discount of a valid step, a number in [0, 1] or a tensor broadcastable to the
            rewards.
        initial: ``S[T]`` per row, the rewards' shape without the time dim, or None for 0.
        time_dim: the time dim of every tensor.
        backend: None (auto), ``"triton"``, ``"cpu"`` (numba) or ``"torch"``.
        out: an optional output tensor of the rewards' shape and dtype.

    Returns the sums, the rewards' shape and dtype.
    """
    c = Call(rewards, "rewards", time_dim)
    valid, done = _flags(c, ("valid", valid), ("done", done))
    c.per_row(initial, "initial")
    g = c.coefficient(gamma, "gamma")
    fused = c.start(backend, out, 1)
    if c.empty:
        return c.empty_outputs()
    if fused:
        return c.bind(spec.VALID_DISCOUNTED_RETURN, rewards=c.view(rewards), valid=c.view(valid), done=c.view(done),
                      gamma=c.view(g), carry=c.row_view(initial))
    x = c.float_rows(rewards)
    alpha, beta = C.valid_discounted_return(x, _composed_flag(c, valid), 1.0 - _composed_flag(c, done),
                                            c.float_rows(g) * torch.ones_like(x))
    return c.results([scan.call_scan(c, alpha, beta, c.float_row(initial), True)])
