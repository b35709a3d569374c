"""Per-algorithm coefficient builders and epilogues for the scan engine.

Each algorithm of ``rl_triton/core/spec.py`` has a BUILD function here and an epilogue (STORE)
where storing y itself is not enough, each registered with ``@part(spec.NAME, "build")`` (the
engine's docstring gives their signatures). ``ins`` and ``outs`` are tuples in the spec's order,
read by name through the spec's positions: ``ins[GAE.values]``. The arithmetic is the shared
definitions of ``rl_triton/core/coefficients.py``. Absent inputs arrive as None, so each mode of
an algorithm compiles to its own kernel.
"""

import types

import triton
import triton.language as tl

from .. import coefficients as C
from .. import spec
from .engine import coef, load, load_flag, load_row, store


def _positions(algo: spec.Algorithm):
    """The position of each argument in ``ins`` and of each output in ``outs``, as attributes of
    a module object: jit code may read module globals (triton 3.6 drops the field names of
    named-tuple kernel arguments, and rejects other objects as globals)."""
    positions = types.ModuleType(f"{algo.name}_positions")
    positions.__dict__.update(algo.at._asdict())
    return positions


GAE = _positions(spec.GAE)
TD_LAMBDA_RETURN = _positions(spec.TD_LAMBDA_RETURN)
DISCOUNTED_RETURN = _positions(spec.DISCOUNTED_RETURN)
VTRACE = _positions(spec.VTRACE)
RETRACE = _positions(spec.RETRACE)
ELIGIBILITY_TRACE = _positions(spec.ELIGIBILITY_TRACE)
AFFINE_SCAN = _positions(spec.AFFINE_SCAN)
MASKED_GAE = _positions(spec.MASKED_GAE)
PADDED_GAE = _positions(spec.PADDED_GAE)
ARRIVAL_GAE = _positions(spec.ARRIVAL_GAE)
VALID_GAE = _positions(spec.VALID_GAE)
VALID_DISCOUNTED_RETURN = _positions(spec.VALID_DISCOUNTED_RETURN)
CARRY = tl.constexpr(spec.CARRY)  # the carry argument

_registered: dict = {}  # algorithm name: {"build": BUILD, "init": INIT, "store": STORE}


def part(algo: spec.Algorithm, role: str):
    """Register the jitted function below as ``algo``'s BUILD, INIT or STORE (``role``); an
    algorithm without an INIT loads its carry argument, one without a STORE stores y itself."""
    if role not in ("build", "init", "store"):
        raise ValueError(f"role must be 'build', 'init' or 'store', got {role!r}")

    def register(fn):
        _registered.setdefault(algo.name, {})[role] = fn
        return fn

    return register


@triton.jit
def _where(cond, a, b):
    return tl.where(cond, a, b)


def _jit_shared(fn):
    """triton.jit of a coefficients function, with triton.language in its globals (the
    interpreter requires it; the module itself stays free of triton) and ``tl.where`` as its
    ``where``."""
    return triton.jit(types.FunctionType(fn.__code__, {**fn.__globals__, "tl": tl, "where": _where}, fn.__name__))


_gae = _jit_shared(C.gae)
_masked_gae = _jit_shared(C.masked_gae)
_td_lambda_return = _jit_shared(C.td_lambda_return)
_discounted_return = _jit_shared(C.discounted_return)
_vtrace = _jit_shared(C.vtrace)
_vtrace_pg = _jit_shared(C.vtrace_pg)
_arrival_gae = _jit_shared(C.arrival_gae)
_retrace = _jit_shared(C.retrace)
_valid_gae = _jit_shared(C.valid_gae)
_valid_discounted_return = _jit_shared(C.valid_discounted_return)


@triton.jit
def _not(flag, ACC: tl.constexpr):
    return tl.where(flag, 0.0, 1.0).to(ACC)


@triton.jit
def _clip(x, bar):
    """min(x, bar) with NaN kept (as torch.minimum)."""
    return tl.minimum(x, bar, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _clip_at(x, bar, rows, t, mask, ACC: tl.constexpr):
    """min(x, bar) for a threshold argument ``bar`` (a number in the engine's coefficient form, so
    exact in a float64 launch)."""
    return _clip(x, coef(bar, rows, t, mask, ACC))


@triton.jit
def _kl_reward(r, ins, KL: tl.constexpr, rows, t, mask, ACC: tl.constexpr):
    """r - coef*kl, the KL-shaped reward (docs/semantics.md, section 13.1), from the group
    spec.KL, which starts at position KL of ``ins``: the log-probs, the reference log-probs, then
    one coefficient slot per estimator of spec.KL_ESTIMATORS (the one present names the
    estimator, at compile time) and the clamp; r itself without log-probs. NaN stays NaN through
    every clamp."""
    if ins[KL] is None:
        return r
    else:
        d = load(ins[KL], rows, t, mask, ACC) - load(ins[KL + 1], rows, t, mask, ACC)
        if ins[KL + 2] is not None:  # k1
            kl = d
            c = coef(ins[KL + 2], rows, t, mask, ACC)
        elif ins[KL + 3] is not None:  # k2
            kl = 0.5 * d * d
            c = coef(ins[KL + 3], rows, t, mask, ACC)
        elif ins[KL + 4] is not None:  # k3, its log-ratio within [-20, 20] and its value at most 10
            e = tl.minimum(tl.maximum(-d, -20.0, propagate_nan=tl.PropagateNan.ALL), 20.0,
                           propagate_nan=tl.PropagateNan.ALL)
            kl = _clip(tl.exp(e) - e - 1.0, 10.0)
            c = coef(ins[KL + 4], rows, t, mask, ACC)
        else:  # abs
            kl = tl.abs(d)
            c = coef(ins[KL + 5], rows, t, mask, ACC)
        if ins[KL + 6] is not None:
            bound = coef(ins[KL + 6], rows, t, mask, ACC)
            kl = tl.maximum(_clip(kl, bound), -bound, propagate_nan=tl.PropagateNan.ALL)
        return r - c * kl


@triton.jit
def _flags(ins, FLAGS: tl.constexpr, rows, t, mask, T, ACC: tl.constexpr):
    """(1 - terminated, 1 - done) from the flag group spec.FLAGS, which starts at position FLAGS
    of ``ins``: done = the done array, else terminated | truncated; with last_done,
    observation-aligned: done[t] = episode_starts[t+1] (the ``done`` slot), last_done at t = T-1,
    every done a termination. A done array without terminated: every done is a termination (the
    launcher drops terminated when it is the done tensor itself)."""
    terminated = ins[FLAGS]
    done = ins[FLAGS + 1]
    truncated = ins[FLAGS + 2]
    last_done = ins[FLAGS + 3]
    if last_done is not None:
        is_last = (t == T - 1)[None, :]
        following = load_flag(done, rows, t + 1, mask & ~is_last)
        edge = tl.load(last_done[0] + rows[:, None] * last_done[1] + 0 * t[None, :], mask=mask & is_last, other=0)
        d = tl.where(is_last, edge != 0, following)
        k = d
    elif done is not None:
        d = load_flag(done, rows, t, mask)
        if terminated is None:
            k = d
        else:
            k = load_flag(terminated, rows, t, mask)
    else:
        k = load_flag(terminated, rows, t, mask)
        d = k | load_flag(truncated, rows, t, mask)
    return _not(k, ACC), _not(d, ACC)


@triton.jit
def _next_value(next_values, values, bootstrap_value, rows, t, mask, T, ACC: tl.constexpr):
    """V(s_{t+1}): explicit next values, or values[t+1] with the bootstrap value at t = T-1."""
    if next_values is not None:
        return load(next_values, rows, t, mask, ACC)
    else:
        last = (t == T - 1)[None, :]
        inner = load(values, rows, t + 1, mask & ~last, ACC)
        if bootstrap_value is None:
            return inner
        else:
            boot = bootstrap_value
            edge = tl.load(boot[0] + rows[:, None] * boot[1] + 0 * t[None, :], mask=mask & last, other=0.0)
            return tl.where(last, edge.to(ACC), inner)


@triton.jit
def carry_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[CARRY], rows, rmask, ACC)


@triton.jit
def store_y(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC: tl.constexpr):
    store(outs[0], rows, t, mask, y)


@part(spec.GAE, "build")
@triton.jit
def gae_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    v = load(ins[GAE.values], rows, t, mask, ACC)
    nv = _next_value(ins[GAE.next_values], ins[GAE.values], ins[GAE.bootstrap_value], rows, t, mask, T, ACC)
    nterm, ndone = _flags(ins, GAE.terminated, rows, t, mask, T, ACC)
    g = coef(ins[GAE.gamma], rows, t, mask, ACC)
    l = coef(ins[GAE.lmbda], rows, t, mask, ACC)
    r = _kl_reward(load(ins[GAE.rewards], rows, t, mask, ACC), ins, GAE.log_probs, rows, t, mask, ACC)
    alpha, beta = _gae(r, v, nv, nterm, ndone, g, l)
    return alpha, beta, v


@part(spec.GAE, "store")
@triton.jit
def gae_store(ins, outs, rows, t, mask, y, y_prev, v, T, ACC: tl.constexpr):
    store(outs[GAE.advantages], rows, t, mask, y)
    store(outs[GAE.value_targets], rows, t, mask, y + v)


@part(spec.MASKED_GAE, "build")
@triton.jit
def masked_gae_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    # the two-state scan (engine, PAIR): x = the value of the next unmasked step, y = the advantage;
    # at an unmasked step x = v and y = r - v + g*x_next + g*l*y_next, at a masked step both carry
    m = load_flag(ins[MASKED_GAE.mask], rows, t, mask)
    v = load(ins[MASKED_GAE.values], rows, t, mask, ACC)
    r = _kl_reward(load(ins[MASKED_GAE.rewards], rows, t, mask, ACC), ins, MASKED_GAE.log_probs, rows, t, mask, ACC)
    g = coef(ins[MASKED_GAE.gamma], rows, t, mask, ACC)
    l = coef(ins[MASKED_GAE.lmbda], rows, t, mask, ACC)
    ones = tl.full(v.shape, 1.0, ACC)
    delta, decay = _masked_gae(r, v, 0.0, tl.where(m, 1.0, 0.0).to(ACC), g, l)
    return (tl.where(m, v, 0.0), delta), (tl.where(m, 0.0, ones), decay, tl.where(m, g * ones, 0.0)), v


@part(spec.MASKED_GAE, "init")
@triton.jit
def masked_gae_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[MASKED_GAE.bootstrap_value], rows, rmask, ACC), load_row(ins[MASKED_GAE.carry], rows, rmask,
                                                                                  ACC)


@triton.jit
def _advantages_store(outs, rows, t, mask, y, v):
    store(outs[0], rows, t, mask, y)
    store(outs[1], rows, t, mask, y + v)


@part(spec.MASKED_GAE, "store")
@triton.jit
def masked_gae_store(ins, outs, rows, t, mask, y, y_prev, v, T, ACC: tl.constexpr):
    _advantages_store(outs, rows, t, mask, y, v)


@part(spec.PADDED_GAE, "build")
@triton.jit
def padded_gae_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    # rewards, values and the next value read as 0 where the mask is 0
    m = load_flag(ins[PADDED_GAE.mask], rows, t, mask)
    last = (t == T - 1)[None, :]
    m_next = load_flag(ins[PADDED_GAE.mask], rows, t + 1, mask & ~last) | last
    nv = _next_value(None, ins[PADDED_GAE.values], ins[PADDED_GAE.bootstrap_value], rows, t, mask, T, ACC)
    v = tl.where(m, load(ins[PADDED_GAE.values], rows, t, mask, ACC), 0.0)
    ones = tl.full(v.shape, 1.0, ACC)
    r = _kl_reward(load(ins[PADDED_GAE.rewards], rows, t, mask, ACC), ins, PADDED_GAE.log_probs, rows, t, mask, ACC)
    alpha, beta = _gae(tl.where(m, r, 0.0), v,
                       tl.where(m_next, nv, 0.0), ones, ones, coef(ins[PADDED_GAE.gamma], rows, t, mask, ACC),
                       coef(ins[PADDED_GAE.lmbda], rows, t, mask, ACC))
    return alpha, beta, v


@part(spec.PADDED_GAE, "init")
@triton.jit
def padded_gae_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[PADDED_GAE.carry], rows, rmask, ACC)


@part(spec.PADDED_GAE, "store")
@triton.jit
def padded_gae_store(ins, outs, rows, t, mask, y, y_prev, v, T, ACC: tl.constexpr):
    _advantages_store(outs, rows, t, mask, y, v)


@part(spec.TD_LAMBDA_RETURN, "build")
@triton.jit
def td_lambda_return_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    nterm, ndone = _flags(ins, TD_LAMBDA_RETURN.terminated, rows, t, mask, T, ACC)
    r = load(ins[TD_LAMBDA_RETURN.rewards], rows, t, mask, ACC)
    nv = load(ins[TD_LAMBDA_RETURN.next_values], rows, t, mask, ACC)
    g = coef(ins[TD_LAMBDA_RETURN.gamma], rows, t, mask, ACC)
    alpha, beta = _td_lambda_return(r, nv, nterm, ndone, g, coef(ins[TD_LAMBDA_RETURN.lmbda], rows, t, mask, ACC))
    return alpha, beta, 0


@part(spec.DISCOUNTED_RETURN, "build")
@triton.jit
def discounted_return_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    nterm, ndone = _flags(ins, DISCOUNTED_RETURN.terminated, rows, t, mask, T, ACC)
    r = load(ins[DISCOUNTED_RETURN.rewards], rows, t, mask, ACC)
    nv = load(ins[DISCOUNTED_RETURN.next_values], rows, t, mask, ACC)
    alpha, beta = _discounted_return(r, nv, nterm, ndone, coef(ins[DISCOUNTED_RETURN.gamma], rows, t, mask, ACC))
    return alpha, beta, 0


@part(spec.VTRACE, "build")
@triton.jit
def vtrace_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    r = load(ins[VTRACE.rewards], rows, t, mask, ACC)
    v = load(ins[VTRACE.values], rows, t, mask, ACC)
    nv = _next_value(ins[VTRACE.next_values], ins[VTRACE.values], ins[VTRACE.bootstrap_value], rows, t, mask, T, ACC)
    nterm, ndone = _flags(ins, VTRACE.terminated, rows, t, mask, T, ACC)
    g = coef(ins[VTRACE.gamma], rows, t, mask, ACC)
    ratio = tl.exp(load(ins[VTRACE.log_pi], rows, t, mask, ACC) - load(ins[VTRACE.log_mu], rows, t, mask, ACC))
    rho = _clip_at(ratio, ins[VTRACE.rho_bar], rows, t, mask, ACC)
    c = coef(ins[VTRACE.lmbda], rows, t, mask, ACC) * _clip_at(ratio, ins[VTRACE.c_bar], rows, t, mask, ACC)
    alpha, beta = _vtrace(r, v, nv, nterm, ndone, g, rho, c)
    return alpha, beta, (r, v, nv, nterm, ndone, g, _clip_at(ratio, ins[VTRACE.rho_bar_pg], rows, t, mask, ACC))


@part(spec.VTRACE, "store")
@triton.jit
def vtrace_store(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC: tl.constexpr):
    r, v, nv, nterm, ndone, g, rho_pg = ctx
    store(outs[VTRACE.vs], rows, t, mask, y + v)
    # vs[t+1] = (vs - v)[t+1] + v[t+1], or V(s_{t+1}) where done; at the window end y one step
    # back is the carry, (vs - v)[T], and V(s_T) the next value
    last = (t == T - 1)[None, :]
    carry = ins[VTRACE.carry]
    if y_prev is None:
        # the engine's PREV_MEM regime: vs[t+1] read back from the output just written (by this
        # program: this chunk's steps and the previous chunks'); the carry read where t = T-1
        tl.debug_barrier()
        if carry is None:
            cut = (ndone == 0) | last
            vs_next = tl.where(cut, nv, load(outs[VTRACE.vs], rows, t + 1, mask & ~cut, ACC))
        else:
            inner = load(outs[VTRACE.vs], rows, t + 1, mask & ~last & (ndone != 0), ACC)
            edge = tl.load(carry[0] + rows[:, None] * carry[1] + 0 * t[None, :], mask=mask & last, other=0.0)
            after = edge.to(ACC) + _vtrace_after(ins, rows, t, mask & last, nv, T, ACC)
            vs_next = tl.where(ndone == 0, nv, tl.where(last, after, inner))
    elif carry is None:  # (vs - v)[T] = 0: vs[T] = V(s_T), the next value
        cut = (ndone == 0) | last
        vs_next = tl.where(cut, nv, y_prev + load(ins[VTRACE.values], rows, t + 1, mask & ~cut, ACC))
    else:
        inner = load(ins[VTRACE.values], rows, t + 1, mask & ~last & (ndone != 0), ACC)
        after = _vtrace_after(ins, rows, t, mask & last, nv, T, ACC)
        vs_next = tl.where(ndone == 0, nv, y_prev + tl.where(last, after, inner))
    store(outs[VTRACE.pg_advantages], rows, t, mask, _vtrace_pg(r, v, vs_next, nterm, g, rho_pg))


@triton.jit
def _vtrace_after(ins, rows, t, mask, nv, T, ACC: tl.constexpr):
    """V(s_T), added to the carry at the window end: the next value, or the bootstrap value where
    explicit next values come with one (vs[T] = bootstrap_value + carry, spec.py)."""
    if ins[VTRACE.next_values] is not None and ins[VTRACE.bootstrap_value] is not None:
        return _next_value(None, ins[VTRACE.values], ins[VTRACE.bootstrap_value], rows, t, mask, T, ACC)
    else:
        return nv


@part(spec.ARRIVAL_GAE, "build")
@triton.jit
def arrival_gae_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    # step t < T-1 reads the reward, the flag and the value of observation t+1; the last column
    # has no step: (alpha, beta) = (0, 1) passes the carry through it
    last = (t == T - 1)[None, :]
    inner = mask & ~last
    ratio = tl.zeros((rows.shape[0], t.shape[0]), ACC) + coef(ins[ARRIVAL_GAE.ratio], rows, t, mask, ACC)
    r_next = load(ins[ARRIVAL_GAE.rewards], rows, t + 1, inner, ACC)
    v_next = load(ins[ARRIVAL_GAE.values], rows, t + 1, inner, ACC)
    ndone = _not(load_flag(ins[ARRIVAL_GAE.done], rows, t + 1, inner), ACC)
    g = coef(ins[ARRIVAL_GAE.gamma], rows, t, mask, ACC)
    l = coef(ins[ARRIVAL_GAE.lmbda], rows, t, mask, ACC)
    alpha, beta = _arrival_gae(r_next, load(ins[ARRIVAL_GAE.values], rows, t, mask, ACC), v_next, ndone, g, l,
                               _clip_at(ratio, ins[ARRIVAL_GAE.rho_bar], rows, t, mask, ACC),
                               _clip_at(ratio, ins[ARRIVAL_GAE.c_bar], rows, t, mask, ACC))
    return tl.where(last, 0.0, alpha), tl.where(last, 1.0, beta), 0


@part(spec.ARRIVAL_GAE, "init")
@triton.jit
def arrival_gae_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[ARRIVAL_GAE.carry], rows, rmask, ACC)


@part(spec.ARRIVAL_GAE, "store")
@triton.jit
def arrival_gae_store(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC: tl.constexpr):
    # the last column only where write_last is set (PufferLib leaves it as it was)
    keep = mask & ((t < T - 1)[None, :] | (coef(ins[ARRIVAL_GAE.write_last], rows, t, mask, ACC) != 0))
    store(outs[ARRIVAL_GAE.advantages], rows, t, keep, y)


@triton.jit
def _trace_coef(ins, rows, t, mask, ACC: tl.constexpr):
    ratio = tl.exp(load(ins[RETRACE.log_pi], rows, t, mask, ACC) - load(ins[RETRACE.log_mu], rows, t, mask, ACC))
    return coef(ins[RETRACE.lmbda], rows, t, mask, ACC) * _clip_at(ratio, ins[RETRACE.c_bar], rows, t, mask, ACC)


@part(spec.RETRACE, "build")
@triton.jit
def retrace_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    if ins[RETRACE.next_expected_q] is not None:
        ev = load(ins[RETRACE.next_expected_q], rows, t, mask, ACC)
    else:
        # next_pi and next_q arrive as (tensor, row stride, time stride, action stride, A)
        pi = ins[RETRACE.next_pi]
        nq = ins[RETRACE.next_q]
        ev = tl.zeros((rows.shape[0], t.shape[0]), ACC)
        base = rows[:, None] * pi[1] + t[None, :] * pi[2]
        base_q = rows[:, None] * nq[1] + t[None, :] * nq[2]
        for a in range(pi[4]):
            action = rows[:, None] * 0 + a  # in the index type of rows
            p = tl.load(pi[0] + base + action * pi[3], mask=mask, other=0.0).to(ACC)
            ev += p * tl.load(nq[0] + base_q + action * nq[3], mask=mask, other=0.0).to(ACC)
    nterm, ndone = _flags(ins, RETRACE.terminated, rows, t, mask, T, ACC)
    nxt = mask & (t + 1 < T)[None, :]
    # at the window end c[T] = 1 and q[T] = 0: the carry is c[T]*(Q_ret[T] - q[T]) itself
    c_next = tl.where(nxt, _trace_coef(ins, rows, t + 1, nxt, ACC), 1.0)
    q_next = load(ins[RETRACE.q_values], rows, t + 1, nxt, ACC)
    alpha, beta = _retrace(load(ins[RETRACE.rewards], rows, t, mask, ACC), ev, q_next, nterm, ndone,
                           coef(ins[RETRACE.gamma], rows, t, mask, ACC), c_next)
    return alpha, beta, 0


@part(spec.ELIGIBILITY_TRACE, "build")
@triton.jit
def eligibility_trace_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    # e[t] = x[t] + g[t]*l[t]*(1-done[t-1])*e[t-1]
    prev_done = load_flag(ins[ELIGIBILITY_TRACE.done], rows, t - 1, mask & (t >= 1)[None, :])
    decay = coef(ins[ELIGIBILITY_TRACE.gamma], rows, t, mask, ACC) * coef(ins[ELIGIBILITY_TRACE.lmbda], rows, t, mask,
                                                                          ACC)
    beta = tl.where(prev_done, 0.0, decay)
    return load(ins[ELIGIBILITY_TRACE.x], rows, t, mask, ACC), beta, 0


@part(spec.AFFINE_SCAN, "build")
@triton.jit
def affine_scan_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    alpha = load(ins[AFFINE_SCAN.alpha], rows, t, mask, ACC)
    b = ins[AFFINE_SCAN.beta]
    if b[0] is None:  # a number
        beta = tl.full(alpha.shape, b[1], ACC)
    else:
        beta = load(b, rows, t, mask, ACC)
    return alpha, beta, 0


@triton.jit
def _is(flag, ACC: tl.constexpr):
    return tl.where(flag, 1.0, 0.0).to(ACC)


@part(spec.VALID_GAE, "build")
@triton.jit
def valid_gae_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    # Sample Factory's valid steps (docs/semantics.md, section 6.11); the positions module by its
    # own name (compiled Triton takes no local alias of a module)
    alpha, beta = _valid_gae(load(ins[VALID_GAE.rewards], rows, t, mask, ACC),
                             load(ins[VALID_GAE.values], rows, t, mask, ACC),
                             load(ins[VALID_GAE.next_values], rows, t, mask, ACC),
                             _is(load_flag(ins[VALID_GAE.valid], rows, t, mask), ACC),
                             _is(load_flag(ins[VALID_GAE.next_valid], rows, t, mask), ACC),
                             _not(load_flag(ins[VALID_GAE.done], rows, t, mask), ACC),
                             coef(ins[VALID_GAE.gamma], rows, t, mask, ACC),
                             coef(ins[VALID_GAE.trace], rows, t, mask, ACC))
    return alpha, beta, 0


@part(spec.VALID_GAE, "init")
@triton.jit
def valid_gae_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[VALID_GAE.carry], rows, rmask, ACC)


@part(spec.VALID_DISCOUNTED_RETURN, "build")
@triton.jit
def valid_discounted_return_build(ins, rows, t, mask, T, ACC: tl.constexpr):
    alpha, beta = _valid_discounted_return(load(ins[VALID_DISCOUNTED_RETURN.rewards], rows, t, mask, ACC),
                                           _is(load_flag(ins[VALID_DISCOUNTED_RETURN.valid], rows, t, mask), ACC),
                                           _not(load_flag(ins[VALID_DISCOUNTED_RETURN.done], rows, t, mask), ACC),
                                           coef(ins[VALID_DISCOUNTED_RETURN.gamma], rows, t, mask, ACC))
    return alpha, beta, 0


@part(spec.VALID_DISCOUNTED_RETURN, "init")
@triton.jit
def valid_discounted_return_init(ins, rows, rmask, T, ACC: tl.constexpr):
    return load_row(ins[VALID_DISCOUNTED_RETURN.carry], rows, rmask, ACC)


# the STOREs that take y_prev = None in the engine's PREV_MEM regime (they read y one step back
# from their own outputs)
PREV_FROM_OUTPUTS = frozenset({"vtrace"})

# name: (BUILD, INIT, STORE) of every algorithm, as registered with ``part``
PARTS = {name: (parts["build"], parts.get("init", carry_init), parts.get("store", store_y))
         for name, parts in _registered.items()}
_missing = set(spec.ALGORITHMS) - {name for name, parts in _registered.items() if "build" in parts}
if _missing:
    raise ImportError(f"no Triton BUILD registered for {sorted(_missing)} (kernels/builders.py, part())")
