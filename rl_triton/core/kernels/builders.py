"""Per-algorithm coefficient builders, initial carries and epilogues for the scan engine.

Each algorithm's ``ins`` tuple follows its argument order in ``rl_triton/core/cpu.py``
(the mode integers there are implied here by which inputs are None). The arithmetic is the
shared definitions of ``rl_triton/core/coefficients.py``.
"""

import types

import triton
import triton.language as tl

from .. import coefficients as C
from .engine import coef, load, load_flag, load_row, store



def _jit_shared(fn):
    """triton.jit of a coefficients function, with triton.language in its globals (the
    interpreter requires it; the module itself stays free of triton)."""
    return triton.jit(types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl}, fn.__name__))


_gae = _jit_shared(C.gae)
_td_lambda = _jit_shared(C.td_lambda)
_discounted = _jit_shared(C.discounted)
_vtrace = _jit_shared(C.vtrace)
_vtrace_pg = _jit_shared(C.vtrace_pg)
_retrace = _jit_shared(C.retrace)


@triton.jit
def _not(flag, ACC: tl.constexpr):
    return tl.where(flag, 0.0, 1.0).to(ACC)


@triton.jit
def _flags(term, done, trunc, last, rows, t, mask, T, ACC: tl.constexpr):
    """(1 - terminated, 1 - done); done = the done array, else terminated | truncated; with a
    last-done input, observation-aligned: done[t] = episode_starts[t+1] (the ``done`` slot),
    last_done at t = T-1, every done a termination. A done array without terminated: every
    done is a termination (the launcher drops terminated when it is the done tensor itself)."""
    if last is not None:
        is_last = (t == T - 1)[None, :]
        following = load_flag(done, rows, t + 1, mask & ~is_last)
        edge = tl.load(last[0] + rows[:, None] * last[1] + 0 * t[None, :], mask=mask & is_last, other=0)
        d = tl.where(is_last, edge != 0, following)
        k = d
    elif done is not None:
        d = load_flag(done, rows, t, mask)
        if term is None:
            k = d
        else:
            k = load_flag(term, rows, t, mask)
    else:
        k = load_flag(term, rows, t, mask)
        d = k | load_flag(trunc, rows, t, mask)
    return _not(k, ACC), _not(d, ACC)


@triton.jit
def _next_value(nv, v, boot, rows, t, mask, T, ACC: tl.constexpr):
    """V(s_{t+1}): explicit next values, or values[t+1] with the bootstrap value at t = T-1."""
    if nv is not None:
        return load(nv, rows, t, mask, ACC)
    else:
        last = (t == T - 1)[None, :]
        inner = load(v, rows, t + 1, mask & ~last, ACC)
        if boot is None:
            return inner
        else:
            edge = tl.load(boot[0] + rows[:, None] * boot[1] + 0 * t[None, :], mask=mask & last, other=0.0)
            return tl.where(last, edge.to(ACC), inner)


@triton.jit
def zero_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return tl.zeros((rows.shape[0],), ACC)


# -- GAE: r, v, nv, boot, term, done, trunc, last_done, g, l | adv, target ---------------------------
@triton.jit
def gae_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    v = load(ins[1], rows, t, mask, ACC)
    nv = _next_value(ins[2], ins[1], ins[3], rows, t, mask, T, ACC)
    nterm, ndone = _flags(ins[4], ins[5], ins[6], ins[7], rows, t, mask, T, ACC)
    g = coef(ins[8], rows, t, mask, ACC)
    l = coef(ins[9], rows, t, mask, ACC)
    alpha, beta = _gae(load(ins[0], rows, t, mask, ACC), v, nv, nterm, ndone, g, l)
    return alpha, beta, v


@triton.jit
def gae_store(ins, outs, rows, t, mask, y, y_prev, v, T, ACC: tl.constexpr):
    store(outs[0], rows, t, mask, y)
    store(outs[1], rows, t, mask, y + v)


# -- TD(lambda): r, nv, term, done, trunc, last_done, g, l | returns; carry nv[T-1] --------------------
@triton.jit
def td_lambda_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    nterm, ndone = _flags(ins[2], ins[3], ins[4], ins[5], rows, t, mask, T, ACC)
    alpha, beta = _td_lambda(load(ins[0], rows, t, mask, ACC), load(ins[1], rows, t, mask, ACC),
                             nterm, ndone, coef(ins[6], rows, t, mask, ACC), coef(ins[7], rows, t, mask, ACC))
    return alpha, beta, 0


@triton.jit
def td_lambda_init(ins, rows, rmask, T, ACC: tl.constexpr):
    nv = ins[1]
    t_last = rows * 0 + (T - 1)  # in the index type of rows
    return tl.load(nv[0] + rows * nv[1] + t_last * nv[2], mask=rmask, other=0.0).to(ACC)


@triton.jit
def store_y(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC: tl.constexpr):
    store(outs[0], rows, t, mask, y)


# -- discounted return: r, nv, carry, term, done, trunc, last_done, g | returns ----------------------
@triton.jit
def discounted_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    nterm, ndone = _flags(ins[3], ins[4], ins[5], ins[6], rows, t, mask, T, ACC)
    alpha, beta = _discounted(load(ins[0], rows, t, mask, ACC), load(ins[1], rows, t, mask, ACC),
                              nterm, ndone, coef(ins[7], rows, t, mask, ACC))
    return alpha, beta, 0


@triton.jit
def carry_init_2(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[2], rows, rmask, ACC)


# -- V-trace: r, v, nv, boot, log_pi, log_mu, term, done, trunc, last_done, g, l, rho_bar, c_bar,
#    rho_bar_pg | vs, pg_advantages --------------------------------------------------------
@triton.jit
def vtrace_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    r = load(ins[0], rows, t, mask, ACC)
    v = load(ins[1], rows, t, mask, ACC)
    nv = _next_value(ins[2], ins[1], ins[3], rows, t, mask, T, ACC)
    nterm, ndone = _flags(ins[6], ins[7], ins[8], ins[9], rows, t, mask, T, ACC)
    g = coef(ins[10], rows, t, mask, ACC)
    ratio = tl.exp(load(ins[4], rows, t, mask, ACC) - load(ins[5], rows, t, mask, ACC))
    rho = tl.minimum(ratio, ins[12])
    c = coef(ins[11], rows, t, mask, ACC) * tl.minimum(ratio, ins[13])
    alpha, beta = _vtrace(r, v, nv, nterm, ndone, g, rho, c)
    return alpha, beta, (r, v, nv, nterm, ndone, g, tl.minimum(ratio, ins[14]))


@triton.jit
def vtrace_store(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC: tl.constexpr):
    r, v, nv, nterm, ndone, g, rho_pg = ctx
    store(outs[0], rows, t, mask, y + v)
    # vs[t+1] = (vs - v)[t+1] + v[t+1], or V(s_{t+1}) where done or at the window end
    cut = (ndone == 0) | (t == T - 1)[None, :]
    vs_next = tl.where(cut, nv, y_prev + load(ins[1], rows, t + 1, mask & ~cut, ACC))
    store(outs[1], rows, t, mask, _vtrace_pg(r, v, vs_next, nterm, g, rho_pg))


# -- Retrace: r, q, log_pi, log_mu, ev, pi, next_q, term, done, trunc, last_done, g, l, c_bar | q_ret
#    (pi and next_q arrive as (tensor, strides..., A))
@triton.jit
def _trace_coef(ins, rows, t, mask, ACC: tl.constexpr):
    ratio = tl.exp(load(ins[2], rows, t, mask, ACC) - load(ins[3], rows, t, mask, ACC))
    return coef(ins[12], rows, t, mask, ACC) * tl.minimum(ratio, ins[13])


@triton.jit
def retrace_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    q = load(ins[1], rows, t, mask, ACC)
    if ins[4] is not None:
        ev = load(ins[4], rows, t, mask, ACC)
    else:
        pi = ins[5]
        nq = ins[6]
        ev = tl.zeros((rows.shape[0], t.shape[0]), ACC)
        base = rows[:, None] * pi[1] + t[None, :] * pi[2]
        base_q = rows[:, None] * nq[1] + t[None, :] * nq[2]
        for a in range(pi[4]):
            action = rows[:, None] * 0 + a  # in the index type of rows
            p = tl.load(pi[0] + base + action * pi[3], mask=mask, other=0.0).to(ACC)
            ev += p * tl.load(nq[0] + base_q + action * nq[3], mask=mask, other=0.0).to(ACC)
    nterm, ndone = _flags(ins[7], ins[8], ins[9], ins[10], rows, t, mask, T, ACC)
    nxt = mask & (t + 1 < T)[None, :]
    c_next = tl.where(nxt, _trace_coef(ins, rows, t + 1, nxt, ACC), 0.0)
    alpha, beta = _retrace(load(ins[0], rows, t, mask, ACC), q, ev, nterm, ndone,
                           coef(ins[11], rows, t, mask, ACC), c_next)
    return alpha, beta, q


@triton.jit
def retrace_store(ins, outs, rows, t, mask, y, y_prev, q, T, ACC: tl.constexpr):
    store(outs[0], rows, t, mask, y + q)


# -- forward traces: x, done, g, l, initial | y; e[t] = x[t] + g[t]*l[t]*(1-done[t-1])*e[t-1]
@triton.jit
def forward_trace_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    prev_done = load_flag(ins[1], rows, t - 1, mask & (t >= 1)[None, :])
    decay = coef(ins[2], rows, t, mask, ACC) * coef(ins[3], rows, t, mask, ACC)
    beta = decay * _not(prev_done, ACC)
    return load(ins[0], rows, t, mask, ACC), beta, 0


@triton.jit
def carry_init_4(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[4], rows, rmask, ACC)


# -- affine scan: alpha, beta, carry | y -----------------------------------------------------
@triton.jit
def affine_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    return load(ins[0], rows, t, mask, ACC), load(ins[1], rows, t, mask, ACC), 0


ALGORITHMS = {
    # name: (BUILD, INIT, STORE, reverse (None: an argument), NEED_PREV)
    "gae": (gae_build, zero_init, gae_store, True, False),
    "td_lambda": (td_lambda_build, td_lambda_init, store_y, True, False),
    "discounted": (discounted_build, carry_init_2, store_y, True, False),
    "vtrace": (vtrace_build, zero_init, vtrace_store, True, True),
    "retrace": (retrace_build, zero_init, retrace_store, True, False),
    "forward_trace": (forward_trace_build, carry_init_4, store_y, False, False),
    "affine_scan": (affine_build, carry_init_2, store_y, None, False),
}
