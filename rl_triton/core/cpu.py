"""Compiled CPU backend: one numba loop per algorithm of ``rl_triton/core/spec.py``, parallel over
rows, one pass over time.

Each kernel's parameters are the spec's argument names, then its output names, in that order
(tests/test_spec.py holds them to it). Arrays arrive as ``[R, T]`` numpy views of the caller's
tensors (any strides, broadcast inputs with stride 0). Absent inputs and number coefficients
become stride-0 arrays, so each kernel has one signature per float dtype and compiles once
(lazily, cached on disk). The one call that dominates CPU use, SB3's and CleanRL's GAE (episode
starts, implied next values, number coefficients), has kernels of its own without those
stand-ins; in time-major memory they advance blocks of rows through time together.
"""

from __future__ import annotations

import functools
import math
import threading
import types as pytypes

import numpy as np
import torch

from . import coefficients as C
from . import spec
from .spec import DONE_ARRAY, DONE_OBS_ALIGNED, EV_GIVEN, KL_CLAMPED, KL_NONE, NV_EXPLICIT_EDGE, NV_IMPLIED

# numba is imported on the first CPU launch, not with the package (the import alone takes most of
# a second): until then the loops below are plain functions, and the names they call (``prange``
# and the inline helpers) are bound into this module by _load_numba().
nb = None
_LOADED = None  # None: not tried yet; then whether numba imported
_SMALLEST_NORMAL = float(np.finfo(np.float64).tiny)  # 2.2e-308: smaller edge-map gains are 0 (_gain)
_LOAD_LOCK = threading.Lock()


def available() -> bool:
    """Whether numba imports (tried once, on the first call); without it the torch backend
    serves CPU tensors."""
    return _LOADED if _LOADED is not None else _load_numba()


def __getattr__(name):
    if name == "AVAILABLE":
        return available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _load_numba() -> bool:
    global _LOADED
    with _LOAD_LOCK:
        if _LOADED is None:
            try:
                import numba
            except ImportError:
                _LOADED = False
            else:
                _bind(numba)
                _LOADED = True
    return _LOADED


def _bind(numba):
    """Define the numba helpers and bind them, with ``nb`` and ``prange``, as module globals."""
    global nb, prange, _inline, _where, _c_step, _c_gae, _c_masked_gae, _c_td_lambda_return, _c_discounted_return
    global _c_vtrace, _c_vtrace_pg, _c_retrace, _c_arrival_gae, _not, _flags, _clip, _gain, _edge, _masked_step
    global _valid, _next_value, _all_binary, _implies, _nonzero_bytes, _spread_rows, _kl_reward, _kl_numbers
    global _kl_none, _kl_shaped, _c_valid_gae, _c_valid_discounted_return
    nb, prange = numba, numba.prange
    _inline = nb.njit(inline="always", cache=True)

    @_inline
    def _where(cond, a, b):
        return a if cond else b

    def _shared(fn):
        """A coefficients function compiled inline, its ``where`` a conditional on numbers."""
        return _inline(pytypes.FunctionType(fn.__code__, {**fn.__globals__, "where": _where}, fn.__name__))

    _c_step = _shared(C.step)
    _c_gae = _shared(C.gae)
    _c_masked_gae = _shared(C.masked_gae)
    _c_td_lambda_return = _shared(C.td_lambda_return)
    _c_discounted_return = _shared(C.discounted_return)
    _c_vtrace = _shared(C.vtrace)
    _c_vtrace_pg = _shared(C.vtrace_pg)
    _c_retrace = _shared(C.retrace)
    _c_arrival_gae = _shared(C.arrival_gae)
    _c_valid_gae = _shared(C.valid_gae)
    _c_valid_discounted_return = _shared(C.valid_discounted_return)

    # helpers take scalars: passing arrays into a call in the loop costs reference counting.
    # Kernels pass gamma as ``gamma[i, t] * 1.0`` so that products like gamma * lambda are formed
    # in float64, not rounded to float32 first

    @_inline
    def _not(flag):
        return 0.0 if flag != 0 else 1.0

    @_inline
    def _flags(terminated, done, done_next, truncated, last_done, done_mode, last):
        """(1 - terminated, 1 - done) from the flag group (spec.FLAGS) at one step; ``done_next``
        is done[t+1] (episode starts, when observation-aligned), ``last`` whether t = T-1."""
        if done_mode == DONE_OBS_ALIGNED:
            nd = _not(last_done if last else done_next)
            return nd, nd
        k = terminated != 0
        d = (done != 0) if done_mode == DONE_ARRAY else (k or truncated != 0)
        return _not(k), _not(d)

    @_inline
    def _clip(x, bar):
        """min(x, bar) with NaN kept (as torch.minimum; Python's min drops it)."""
        return bar if x > bar else x

    @_inline
    def _gain(gain, b):
        """The running product of the betas in scan order, 0 from a zero beta on (the engine's
        ``combine``): how the value handed on moves with the carry. A product below the smallest
        normal float64 is 0: multiplied by a beta above 1/2 a subnormal rounds back to itself, so
        it would never reach 0 (and the tails of sharded.py's second pass would never be cut),
        and every subnormal product costs tens of times a normal one; the carry's share it drops
        is below 2.3e-308 times the carry."""
        product = 0.0 if b == 0 else gain * b
        return 0.0 if abs(product) < _SMALLEST_NORMAL else product

    @_inline
    def _edge(edge, i, handed, gain):
        """Row i's edge map (spec.py), where one is asked for (``edge`` has rows)."""
        if edge.shape[0] > 0:
            edge[i, 0] = handed
            edge[i, 1] = gain

    @_inline
    def _masked_step(r, v, m, g, l, acc, nxt):
        """(v, the advantage, the next unmasked value) one step earlier in masked_gae."""
        on = m != 0
        v = v * 1.0
        a, b = _c_masked_gae(r, v, nxt, 1.0 if on else 0.0, g * 1.0, l)
        return v, _c_step(a, b, acc), v if on else nxt

    @_inline
    def _kl_reward(r, log_prob, ref_log_prob, coef, clamp, kl_mode):
        """r - coef*kl, the KL-shaped reward of one step (docs/semantics.md, section 13.1), for
        kl_mode other than KL_NONE; NaN stays NaN through every clamp. The GAE loops call it as
        ``_kl_shaped``, which their builds without KL bind to ``_kl_none`` (see _kernel)."""
        d = log_prob * 1.0 - ref_log_prob
        estimator = kl_mode % KL_CLAMPED
        if estimator == 1:
            kl = d
        elif estimator == 2:
            kl = 0.5 * d * d
        elif estimator == 3:
            e = -d
            e = -20.0 if e < -20.0 else e
            e = 20.0 if e > 20.0 else e
            kl = math.exp(e) - e - 1.0
            kl = 10.0 if kl > 10.0 else kl
        else:
            kl = abs(d)
        if kl_mode >= KL_CLAMPED:
            kl = clamp if kl > clamp else kl
            kl = -clamp if kl < -clamp else kl
        return r - coef * kl

    @_inline
    def _kl_none(r, log_prob, ref_log_prob, coef, clamp, kl_mode):
        """The reward itself: ``_kl_shaped`` in the builds of the GAE loops without KL, where the
        unused loads of the log-probs then compile away."""
        return r

    _kl_shaped = _kl_reward

    @_inline
    def _kl_numbers(kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode):
        """(coefficient, clamp) of the KL group: numbers (stride-0 arrays), the coefficient in
        the slot of the estimator chosen and 0 in the others; (0, 0) without KL."""
        if kl_mode == KL_NONE:
            return 0.0, 0.0
        return kl_k1[0, 0] * 1.0 + kl_k2[0, 0] + kl_k3[0, 0] + kl_abs[0, 0], kl_clamp[0, 0] * 1.0

    @_inline
    def _valid(x, m, shift):
        """x - shift where the mask m is nonzero, else 0 (x not read: NaN outside the mask stays out)."""
        return x * 1.0 - shift if m != 0 else 0.0

    @_inline
    def _next_value(nv, v_next, boot, nv_mode, last):
        if nv_mode != NV_IMPLIED:
            return nv
        return boot if last else v_next

    @nb.njit(cache=True, nogil=True)
    def _all_binary(a):
        bad = False
        for i in range(a.size):  # no early exit: the loop vectorises
            bad |= (a[i] != 0) & (a[i] != 1)
        return not bad

    @nb.njit(cache=True, nogil=True)
    def _implies(a, b):
        bad = False
        for i in range(a.size):  # no early exit: the loop vectorises
            bad |= (a[i] != 0) & (b[i] == 0)
        return not bad

    @nb.njit(cache=True, nogil=True)
    def _nonzero_bytes(a, out):
        for i in range(a.size):
            out[i] = a[i] != 0

    @nb.njit(cache=True, nogil=True)
    def _spread_rows(values, mask, out):
        for i in range(mask.shape[0]):
            v = values[i]
            for t in range(mask.shape[1]):
                out[i, t] = v if mask[i, t] != 0 else 0.0

    # every helper must be a module global, where the loops (plain functions of this module) find
    # them; a name left out of the global statements above would stay local to this function
    local = [name for name in _bind.__code__.co_varnames if name.startswith("_") and name != "_shared"]
    if local:
        raise RuntimeError(f"cpu._bind: declare {local} global")


KERNELS: dict = {}  # algorithm name: its loop


def loop(algo: spec.Algorithm):
    """Register the function below as ``algo``'s loop: its parameters are the spec's arguments,
    then its outputs, then ``edge``."""
    def register(fn):
        KERNELS[algo.name] = fn
        return fn

    return register


@loop(spec.GAE)
def gae(rewards, values, carry, next_values, bootstrap_value, terminated, done, truncated, last_done, gamma, lmbda,
        nv_mode, done_mode, log_probs, ref_log_probs, kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp,
        kl_mode, advantages, value_targets, edge):
    R, T = rewards.shape
    kl_coef, clamp = _kl_numbers(kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode)
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        for t in range(T - 1, -1, -1):
            tn = min(t + 1, T - 1)
            nterm, ndone = _flags(terminated[i, t], done[i, t], done[i, tn], truncated[i, t], last_done[i], done_mode,
                                  t == T - 1)
            nvt = _next_value(next_values[i, t], values[i, tn], bootstrap_value[i], nv_mode, t == T - 1)
            r = _kl_shaped(rewards[i, t], log_probs[i, t], ref_log_probs[i, t], kl_coef, clamp, kl_mode)
            a, b = _c_gae(r, values[i, t], nvt, nterm, ndone, gamma[i, t] * 1.0, lmbda[i, t])
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            advantages[i, t] = acc
            value_targets[i, t] = acc + values[i, t]
        _edge(edge, i, acc, gain)


ROW_BLOCK = 256  # rows advanced together per time step in time-major memory (1 KB of float32)
# below this many elements a time-major rollout stays in cache and walking its rows one by one
# is faster (re-tune: python benchmarks/torchrl_cpu.py --shapes ... on a CPU machine)
ROW_BLOCK_MIN_ELEMENTS = 1 << 20


def gae_row_blocks(rewards, values, carry, next_values, bootstrap_value, terminated, done, truncated, last_done,
                   gamma, lmbda, nv_mode, done_mode, log_probs, ref_log_probs, kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp,
                   kl_mode, advantages, value_targets, edge):
    """``gae`` for time-major memory (rows adjacent): blocks of rows step through time together,
    so each step reads contiguous runs instead of one element per cache line (no edge maps: a
    call that asks for one runs ``gae``)."""
    R, T = rewards.shape
    kl_coef, clamp = _kl_numbers(kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode)
    for blk in prange((R + ROW_BLOCK - 1) // ROW_BLOCK):
        lo = blk * ROW_BLOCK
        hi = min(lo + ROW_BLOCK, R)
        acc = np.zeros(ROW_BLOCK)
        for i in range(lo, hi):
            acc[i - lo] = carry[i]
        for t in range(T - 1, -1, -1):
            tn = min(t + 1, T - 1)
            end = t == T - 1
            for i in range(lo, hi):
                nterm, ndone = _flags(terminated[i, t], done[i, t], done[i, tn], truncated[i, t], last_done[i],
                                      done_mode, end)
                nvt = _next_value(next_values[i, t], values[i, tn], bootstrap_value[i], nv_mode, end)
                r = _kl_shaped(rewards[i, t], log_probs[i, t], ref_log_probs[i, t], kl_coef, clamp, kl_mode)
                a, b = _c_gae(r, values[i, t], nvt, nterm, ndone, gamma[i, t] * 1.0, lmbda[i, t])
                x = _c_step(a, b, acc[i - lo])
                acc[i - lo] = x
                advantages[i, t] = x
                value_targets[i, t] = x + values[i, t]


def gae_episode_starts(rewards, values, episode_starts, bootstrap_value, last_done, gamma, lmbda, advantages,
                       value_targets):
    """``gae`` for SB3's and CleanRL's call (observation-aligned flags, implied next values,
    number coefficients, no carry), without the stand-in inputs and mode branches of the general
    kernel: done[t] = episode_starts[t+1], done[T-1] = last_done, every done a termination."""
    R, T = rewards.shape
    for i in prange(R):
        nd = _not(last_done[i])
        acc, b = _c_gae(rewards[i, T - 1], values[i, T - 1], bootstrap_value[i], nd, nd, gamma, lmbda)
        advantages[i, T - 1] = acc
        value_targets[i, T - 1] = acc + values[i, T - 1]
        for t in range(T - 2, -1, -1):
            nd = _not(episode_starts[i, t + 1])
            a, b = _c_gae(rewards[i, t], values[i, t], values[i, t + 1], nd, nd, gamma, lmbda)
            acc = _c_step(a, b, acc)
            advantages[i, t] = acc
            value_targets[i, t] = acc + values[i, t]


def gae_episode_starts_blocks(rewards, values, episode_starts, bootstrap_value, last_done, gamma, lmbda, advantages,
                              value_targets):
    """``gae_episode_starts`` for time-major memory: blocks of rows step through time together."""
    R, T = rewards.shape
    for blk in prange((R + ROW_BLOCK - 1) // ROW_BLOCK):
        lo = blk * ROW_BLOCK
        hi = min(lo + ROW_BLOCK, R)
        acc = np.empty(ROW_BLOCK)
        for i in range(lo, hi):
            nd = _not(last_done[i])
            a, b = _c_gae(rewards[i, T - 1], values[i, T - 1], bootstrap_value[i], nd, nd, gamma, lmbda)
            acc[i - lo] = a
            advantages[i, T - 1] = a
            value_targets[i, T - 1] = a + values[i, T - 1]
        for t in range(T - 2, -1, -1):
            for i in range(lo, hi):
                nd = _not(episode_starts[i, t + 1])
                a, b = _c_gae(rewards[i, t], values[i, t], values[i, t + 1], nd, nd, gamma, lmbda)
                x = _c_step(a, b, acc[i - lo])
                acc[i - lo] = x
                advantages[i, t] = x
                value_targets[i, t] = x + values[i, t]


# rows a thread advances through time together in ``gae_time_major`` (4 KB of float64 carries)
TIME_MAJOR_BLOCK = 512
# from this many rows on, time-major GAE takes ``gae_time_major`` (below it a row walks its
# column faster than a block fills its vector lanes; re-tune: python benchmarks/rsl_rl_cpu.py)
TIME_MAJOR_MIN_ROWS = 64


def gae_time_major(rewards, values, bootstrap_value, done, last_done, carry, gamma, lmbda, done_mode, advantages,
                   value_targets, edge):
    """``gae`` for wide, short time-major rollouts (rsl_rl's, skrl's and rl_games's ``[T, N, 1]``):
    implied next values, number coefficients, the ``[R, T]`` arrays F-contiguous (rows adjacent
    in memory). Time runs in the outer loop and a block of rows in the inner one, which reads and
    writes contiguous runs and runs in vector lanes; threads take blocks of rows. ``carry`` and
    the edge map serve a chunk of a sequence split across ranks (rl_triton/core/sharded.py); the
    gain is kept only where ``edge`` has rows.

    Flags: with implied next values every done is a termination (a truncation needs next
    values), so one array serves: the dones (``done_mode`` DONE_ARRAY, or terminated alone), or
    the episode starts read one step later (DONE_OBS_ALIGNED: done[t] = starts[t+1], ``last_done``
    at t = T-1). The arithmetic is ``gae``'s, and so are the results, bit for bit."""
    R, T = rewards.shape
    shift = 1 if done_mode == DONE_OBS_ALIGNED else 0
    track = edge.shape[0] > 0
    for blk in prange((R + TIME_MAJOR_BLOCK - 1) // TIME_MAJOR_BLOCK):
        # unsigned row indices: numba adds no negative-index wraparound to them, which keeps the
        # inner loops in vector lanes
        lo = np.uint64(blk * TIME_MAJOR_BLOCK)
        width = min(TIME_MAJOR_BLOCK, R - blk * TIME_MAJOR_BLOCK)
        acc = np.empty(TIME_MAJOR_BLOCK)
        gain = np.ones(TIME_MAJOR_BLOCK)
        t = np.uint64(T - 1)
        for j in range(width):
            i = lo + np.uint64(j)
            nd = _not(last_done[i]) if shift else _not(done[i, t])
            a, b = _c_gae(rewards[i, t], values[i, t], bootstrap_value[i], nd, nd, gamma, lmbda)
            x = _c_step(a, b, carry[i] * 1.0)
            acc[j] = x
            gain[j] = _gain(1.0, b)
            advantages[i, t] = x
            value_targets[i, t] = x + values[i, t]
        for s in range(T - 1):
            t = np.uint64(T - 2 - s)
            f = t + np.uint64(shift)
            if track:
                for j in range(width):
                    i = lo + np.uint64(j)
                    gain[j] = _gain(gain[j], _c_gae(rewards[i, t], values[i, t], values[i, t + np.uint64(1)],
                                                    _not(done[i, f]), _not(done[i, f]), gamma, lmbda)[1])
            for j in range(width):
                i = lo + np.uint64(j)
                nd = _not(done[i, f])
                a, b = _c_gae(rewards[i, t], values[i, t], values[i, t + np.uint64(1)], nd, nd, gamma, lmbda)
                x = _c_step(a, b, acc[j])
                acc[j] = x
                advantages[i, t] = x
                value_targets[i, t] = x + values[i, t]
        if track:
            for j in range(width):
                _edge(edge, lo + np.uint64(j), acc[j], gain[j])


@loop(spec.MASKED_GAE)
def masked_gae(rewards, values, mask, bootstrap_value, carry, gamma, lmbda, log_probs, ref_log_probs, kl_k1,
               kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode, advantages, value_targets, edge):
    """GAE over the unmasked steps: the next value and the advantage carry across masked steps;
    value targets are advantages + values at every step. The edge map is the two-state one
    ``(a1, b1, a2, b2, c)`` of (next unmasked value, advantage) at t = 0 on (bootstrap, carry)."""
    R, T = rewards.shape
    kl_coef, clamp = _kl_numbers(kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode)
    for i in prange(R):
        acc = carry[i] * 1.0
        nxt = bootstrap_value[i] * 1.0
        b1, b2, c = 1.0, 1.0, 0.0  # d nxt / d bootstrap, d acc / d carry, d acc / d bootstrap
        for t in range(T - 1, -1, -1):
            m = mask[i, t] != 0
            v = values[i, t] * 1.0
            g = gamma[i, t] * 1.0
            r = _kl_shaped(rewards[i, t], log_probs[i, t], ref_log_probs[i, t], kl_coef, clamp, kl_mode)
            a, b = _c_masked_gae(r, v, nxt, 1.0 if m else 0.0, g, lmbda[i, t])
            if m:
                nxt = v
                c = _gain(c, b) + _gain(b1, g)
                b1 = 0.0
                b2 = _gain(b2, b)
            acc = _c_step(a, b, acc)
            advantages[i, t] = acc
            value_targets[i, t] = acc + v
        if edge.shape[0] > 0:
            edge[i, 0] = nxt
            edge[i, 1] = b1
            edge[i, 2] = acc
            edge[i, 3] = b2
            edge[i, 4] = c


def masked_gae_pairs(rewards, values, mask, bootstrap_value, carry, gamma, lmbda, log_probs, ref_log_probs, kl_k1,
                     kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode, advantages, value_targets, edge):
    """masked_gae without the edge map (``edge`` unused), each thread walking two rows (i and
    i + H) through time together so that their recurrences overlap in the pipeline; a lone last
    row is walked twice, writing the same values."""
    R, T = rewards.shape
    kl_coef, clamp = _kl_numbers(kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode)
    H = (R + 1) // 2
    # number coefficients (stride-0 arrays) read once
    fixed = gamma.strides[0] == 0 and gamma.strides[1] == 0 and lmbda.strides[0] == 0 and lmbda.strides[1] == 0
    g0, l0 = gamma[0, 0] * 1.0, lmbda[0, 0] * 1.0
    for p in prange(H):
        i = np.int64(p)  # the prange index may be unsigned, and unsigned + signed is a float
        k = i + H if i + H < R else i
        acc_i, nxt_i = carry[i] * 1.0, bootstrap_value[i] * 1.0
        acc_k, nxt_k = carry[k] * 1.0, bootstrap_value[k] * 1.0
        for t in range(T - 1, -1, -1):
            g_i, l_i = (g0, l0) if fixed else (gamma[i, t] * 1.0, lmbda[i, t] * 1.0)
            g_k, l_k = (g0, l0) if fixed else (gamma[k, t] * 1.0, lmbda[k, t] * 1.0)
            r_i = _kl_shaped(rewards[i, t], log_probs[i, t], ref_log_probs[i, t], kl_coef, clamp, kl_mode)
            r_k = _kl_shaped(rewards[k, t], log_probs[k, t], ref_log_probs[k, t], kl_coef, clamp, kl_mode)
            v_i, acc_i, nxt_i = _masked_step(r_i, values[i, t], mask[i, t], g_i, l_i, acc_i, nxt_i)
            v_k, acc_k, nxt_k = _masked_step(r_k, values[k, t], mask[k, t], g_k, l_k, acc_k, nxt_k)
            advantages[i, t] = acc_i
            value_targets[i, t] = acc_i + v_i
            advantages[k, t] = acc_k
            value_targets[k, t] = acc_k + v_k


@loop(spec.PADDED_GAE)
def padded_gae(rewards, values, mask, bootstrap_value, carry, gamma, lmbda, log_probs, ref_log_probs, kl_k1,
               kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode, advantages, value_targets, edge):
    """GAE with rewards and values read as 0 where the mask is 0; value targets are advantages +
    the zeroed values."""
    R, T = rewards.shape
    kl_coef, clamp = _kl_numbers(kl_k1, kl_k2, kl_k3, kl_abs, kl_clamp, kl_mode)
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        nxt = bootstrap_value[i] * 1.0
        for t in range(T - 1, -1, -1):
            m = mask[i, t] != 0
            v = values[i, t] * 1.0 if m else 0.0
            r = 0.0 if not m else _kl_shaped(rewards[i, t], log_probs[i, t], ref_log_probs[i, t], kl_coef, clamp,
                                             kl_mode)
            a, b = _c_gae(r, v, nxt, 1.0, 1.0, gamma[i, t] * 1.0, lmbda[i, t])
            nxt = v
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            advantages[i, t] = acc
            value_targets[i, t] = acc + v
        _edge(edge, i, acc, gain)


WHITEN_ROW = 16384  # elements whose (n, mean, M2) ``whiten_all`` forms in one pass pair (in cache)
EPS_ADD, EPS_CLAMP, EPS_STD = 0, 1, 2  # whiten_all's eps_mode (rl_triton/core/whiten.py: "add", "clamp", "std")


def whiten_all(x, out, parts, unbiased, shift_mean, scale, eps, eps_mode):
    """``masked_whiten`` over every element of the flat ``x`` into ``out`` (may be ``x``): each
    run of WHITEN_ROW elements reduced to its ``(n, mean, M2)`` in float64 (``parts``, float64
    ``[P, 3]``), the runs folded by Chan et al.'s formula, then y = (x - mean) * rstd (+ mean
    where not ``shift_mean``) in float64, rounded once to ``out``'s dtype. IEEE throughout
    (compiled with numpy's error model): an empty x or n = 1 unbiased gives NaN."""
    n = x.shape[0]
    P = parts.shape[0]
    for p in prange(P):
        run = x[p * WHITEN_ROW:(p + 1) * WHITEN_ROW]  # indices from 0: no wraparound checks, vector lanes
        total = 0.0
        for i in range(run.shape[0]):
            total += run[i]
        mean = total / run.shape[0]
        m2 = 0.0
        for i in range(run.shape[0]):
            d = run[i] - mean
            m2 += d * d
        parts[p, 0] = run.shape[0]
        parts[p, 1] = mean
        parts[p, 2] = m2
    weighted = 0.0
    for p in range(P):
        weighted += parts[p, 0] * parts[p, 1]
    mean = weighted / n
    m2 = 0.0
    for p in range(P):
        d = parts[p, 1] - mean
        m2 += parts[p, 2] + parts[p, 0] * d * d
    var = m2 / (n - 1) if unbiased else m2 / n
    rstd = 1.0
    if scale:
        if eps_mode == EPS_STD:
            rstd = 1.0 / (math.sqrt(var) + eps)
        elif eps_mode == EPS_CLAMP:
            rstd = 1.0 / math.sqrt(var if var > eps or var != var else eps)
        else:
            rstd = 1.0 / math.sqrt(var + eps)
    back = 0.0 if shift_mean else mean
    for p in prange(P):
        run, dest = x[p * WHITEN_ROW:(p + 1) * WHITEN_ROW], out[p * WHITEN_ROW:(p + 1) * WHITEN_ROW]
        for i in range(run.shape[0]):
            dest[i] = (run[i] - mean) * rstd + back


def whiten_output(x, out, mean, rstd, shift_mean):
    """``out = (x - mean) * rstd`` (``+ mean`` where not ``shift_mean``) over the flat ``x``, in
    float64 and rounded once to ``out``'s dtype; ``out`` may be ``x`` (each element is read
    before it is written)."""
    back = 0.0 if shift_mean else mean
    P = -(-x.shape[0] // WHITEN_ROW)
    for p in prange(P):
        run, dest = x[p * WHITEN_ROW:(p + 1) * WHITEN_ROW], out[p * WHITEN_ROW:(p + 1) * WHITEN_ROW]
        for i in range(run.shape[0]):
            dest[i] = (run[i] - mean) * rstd + back


def masked_moments(x, mask, moments):
    """Each row's ``(n, mean, M2)`` of ``x`` at the steps where ``mask`` is nonzero (the row's
    mean first, then the sum of squared deviations from it; both passes read the row while it is
    in cache), into ``moments`` (float64 ``[R, 3]``). NaN at a valid step makes its row's mean and
    M2 NaN; values at other steps are never read into the sums. Compiled with reassociation
    allowed (``REASSOCIATE``): the sums run in vector lanes, in an order fixed by the build."""
    R, T = x.shape
    for i in prange(R):
        n, total = 0, 0.0
        for t in range(T):
            n += mask[i, t] != 0
            total += _valid(x[i, t], mask[i, t], 0.0)
        mean = total / n if n > 0 else 0.0
        m2 = 0.0
        for t in range(T):
            d = _valid(x[i, t], mask[i, t], mean)
            m2 += d * d
        moments[i, 0] = n
        moments[i, 1] = mean
        moments[i, 2] = m2


@loop(spec.TD_LAMBDA_RETURN)
def td_lambda_return(rewards, next_values, carry, terminated, done, truncated, last_done, gamma, lmbda, done_mode,
                     returns, edge):
    R, T = rewards.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(terminated[i, t], done[i, t], done[i, min(t + 1, T - 1)], truncated[i, t],
                                  last_done[i], done_mode, t == T - 1)
            a, b = _c_td_lambda_return(rewards[i, t], next_values[i, t], nterm, ndone, gamma[i, t] * 1.0,
                                       lmbda[i, t])
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            returns[i, t] = acc
        _edge(edge, i, acc, gain)


@loop(spec.DISCOUNTED_RETURN)
def discounted_return(rewards, next_values, carry, terminated, done, truncated, last_done, gamma, done_mode,
                      returns, edge):
    R, T = rewards.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(terminated[i, t], done[i, t], done[i, min(t + 1, T - 1)], truncated[i, t],
                                  last_done[i], done_mode, t == T - 1)
            a, b = _c_discounted_return(rewards[i, t], next_values[i, t], nterm, ndone, gamma[i, t])
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            returns[i, t] = acc
        _edge(edge, i, acc, gain)


@loop(spec.NSTEP_RETURN)
def nstep_return(rewards, next_values, terminated, done, truncated, last_done, gamma, n, done_mode, returns, edge):
    """n-step returns by min(n, T) - 1 passes over each row (no scan, no edge map), in float64:
    ``one[t]`` the one-step return r + gamma*(1-term)*nv (a termination reads no nv and no
    gamma), then every pass lengthens each window by a step, R[t] = one[t] where step t ends its
    episode or the rollout, else r[t] + gamma[t]*R[t+1] (the ascending loop reads R[t+1] of the
    pass before: independent steps, which the compiler vectorises). O(n*T) per row. The rows
    go NSTEP_ROWS at a time, which share the buffers."""
    R, T = rewards.shape
    for blk in prange((R + NSTEP_ROWS - 1) // NSTEP_ROWS):
        one = np.empty(T)
        rew = np.empty(T)
        gam = np.empty(T)
        ret = np.empty(T)
        stops = np.empty(T, np.bool_)
        for i in range(blk * NSTEP_ROWS, min((blk + 1) * NSTEP_ROWS, R)):
            for s in range(T):
                nterm, ndone = _flags(terminated[i, s], done[i, s], done[i, min(s + 1, T - 1)], truncated[i, s],
                                      last_done[i], done_mode, s == T - 1)
                r = rewards[i, s] * 1.0
                g = gamma[i, s] * 1.0
                one[s] = r if nterm == 0 else r + g * next_values[i, s]
                ret[s] = one[s]
                rew[s] = r
                gam[s] = g
                stops[s] = ndone == 0
            for _ in range(min(n, T) - 1):
                for t in range(T - 1):  # the rollout's last step keeps its one-step return
                    ret[t] = one[t] if stops[t] else rew[t] + gam[t] * ret[t + 1]
            for t in range(T):
                returns[i, t] = ret[t]


# rows an n-step kernel's parallel iteration takes, which share its buffers (one allocation each)
NSTEP_ROWS = 64
# n-step returns of a larger n take nstep_return_blocks, O(T) per row instead of O(n*T) (one
# thread, 64x2048 float32 under load, best of 7: the passes 0.55 ms at n = 5, 0.70 at 8, 1.47
# at 16, 1.66 at 32; the blocks 1.17, 1.06, 1.02, 1.11)
NSTEP_DIRECT_MAX = 12


def nstep_return_blocks(rewards, next_values, terminated, done, truncated, last_done, gamma, n, done_mode, returns,
                        edge):
    """``nstep_return`` in O(T) per row, for large n: the row cut into blocks of n steps, so
    that a window starting in a block ends in it or in the next one. Per row, three passes:

    - forward, within each block from its first step b: ``head[u]`` the value of the window
      from b that ends at u (its discounted rewards, then u's bootstrap unless u terminates),
      up to the block's first end;
    - backward, within each block: ``part[t]`` the discounted rewards from t to the block's
      end, ``gain[t]`` their discount product G(t, block end + 1), where no window end lies
      between (``through[t]``); else the whole window from t, which ends in the block;
    - the returns: the window from t crossing into the next block, whose first step is b', is
      ``part[t] + gain[t] * head[e]`` with e = min(t + n - 1, the first end from b'); the one
      from the block's first step ends at the block's last, ``part + gain * next_values``.

    Only sums of a window's own terms, each with its discount (no differences of running sums,
    which would cancel); each window reads its own steps alone. The rows go NSTEP_ROWS at a
    time, which share the buffers."""
    R, T = rewards.shape
    for blk in prange((R + NSTEP_ROWS - 1) // NSTEP_ROWS):
        ends = np.empty(T, np.uint8)
        head = np.empty(T)
        first_end = np.empty(T, np.int64)  # per block's first step: its first end (T: none)
        part = np.empty(T)
        gain = np.empty(T)
        through = np.empty(T, np.uint8)
        for i in range(blk * NSTEP_ROWS, min((blk + 1) * NSTEP_ROWS, R)):
            for s in range(T):
                nterm, ndone = _flags(terminated[i, s], done[i, s], done[i, min(s + 1, T - 1)], truncated[i, s],
                                      last_done[i], done_mode, s == T - 1)
                ends[s] = 1 if nterm == 0 else 2 if ndone == 0 or s == T - 1 else 0
            for b in range(0, T, n):
                total = 0.0
                discount = 1.0
                first_end[b] = T
                for u in range(b, min(b + n, T)):
                    total += discount * rewards[i, u]
                    if ends[u] == 1:
                        head[u] = total
                        first_end[b] = u
                        break
                    g = gamma[i, u] * 1.0
                    head[u] = total + discount * g * next_values[i, u]
                    if ends[u] == 2:
                        first_end[b] = u
                        break
                    discount *= g
            for b in range(0, T, n):
                last = min(b + n, T) - 1
                for t in range(last, b - 1, -1):
                    end = ends[t]
                    through[t] = 0
                    if end == 1:
                        part[t] = rewards[i, t] * 1.0
                        continue
                    g = gamma[i, t] * 1.0
                    if end == 2:
                        part[t] = rewards[i, t] + g * next_values[i, t]
                    elif t == last:
                        part[t] = rewards[i, t] * 1.0
                        gain[t] = g
                        through[t] = 1
                    else:
                        part[t] = rewards[i, t] + g * part[t + 1]
                        if through[t + 1]:
                            gain[t] = g * gain[t + 1]
                            through[t] = 1
                for t in range(b, last + 1):
                    if not through[t]:
                        returns[i, t] = part[t]
                    elif t == b:
                        returns[i, t] = part[t] + gain[t] * next_values[i, last]
                    else:
                        e = min(t + n - 1, first_end[last + 1])
                        returns[i, t] = part[t] + gain[t] * head[e]


@loop(spec.VTRACE)
def vtrace(rewards, values, carry, next_values, bootstrap_value, log_pi, log_mu, terminated, done, truncated,
           last_done, gamma, lmbda, rho_bar, c_bar, rho_bar_pg, nv_mode, done_mode, vs, pg_advantages, edge):
    R, T = rewards.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        vs_next = 0.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(terminated[i, t], done[i, t], done[i, min(t + 1, T - 1)], truncated[i, t],
                                  last_done[i], done_mode, t == T - 1)
            nvt = _next_value(next_values[i, t], values[i, min(t + 1, T - 1)], bootstrap_value[i], nv_mode,
                              t == T - 1)
            ratio = np.exp(log_pi[i, t] * 1.0 - log_mu[i, t])
            rho = _clip(ratio, rho_bar)
            c = lmbda[i, t] * _clip(ratio, c_bar)
            if ndone == 0.0:
                vs_next = nvt
            elif t == T - 1:  # vs[T] = V(s_T) + the carry, (vs - v)[T]
                vs_next = (bootstrap_value[i] * 1.0 if nv_mode == NV_EXPLICIT_EDGE else nvt) + acc
            pg_advantages[i, t] = _c_vtrace_pg(rewards[i, t], values[i, t], vs_next, nterm, gamma[i, t],
                                               _clip(ratio, rho_bar_pg))
            a, b = _c_vtrace(rewards[i, t], values[i, t], nvt, nterm, ndone, gamma[i, t], rho, c)
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            vs_next = acc + values[i, t]
            vs[i, t] = vs_next
        _edge(edge, i, acc, gain)


@loop(spec.ARRIVAL_GAE)
def arrival_gae(rewards, values, done, ratio, gamma, lmbda, carry, rho_bar, c_bar, write_last, advantages, edge):
    R, T = rewards.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        if write_last != 0 and T > 0:  # the last column has no step: the carry passes through it
            advantages[i, T - 1] = acc
        for t in range(T - 2, -1, -1):
            x = ratio[i, t] * 1.0
            a, b = _c_arrival_gae(rewards[i, t + 1], values[i, t], values[i, t + 1], _not(done[i, t + 1]),
                                  gamma[i, t] * 1.0, lmbda[i, t], _clip(x, rho_bar), _clip(x, c_bar))
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            advantages[i, t] = acc
        _edge(edge, i, acc, gain)


@loop(spec.VALID_GAE)
def valid_gae(rewards, values, next_values, valid, next_valid, done, gamma, trace, carry, advantages, edge):
    """Sample Factory's GAE over valid steps (docs/semantics.md, section 6.11)."""
    R, T = rewards.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        for t in range(T - 1, -1, -1):
            a, b = _c_valid_gae(rewards[i, t] * 1.0, values[i, t], next_values[i, t], 1.0 - _not(valid[i, t]),
                                1.0 - _not(next_valid[i, t]), _not(done[i, t]), gamma[i, t] * 1.0, trace[i, t])
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            advantages[i, t] = acc
        _edge(edge, i, acc, gain)


@loop(spec.VALID_DISCOUNTED_RETURN)
def valid_discounted_return(rewards, valid, done, gamma, carry, returns, edge):
    """Sample Factory's discounted sum over valid steps (docs/semantics.md, section 6.11)."""
    R, T = rewards.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        for t in range(T - 1, -1, -1):
            a, b = _c_valid_discounted_return(rewards[i, t] * 1.0, 1.0 - _not(valid[i, t]), _not(done[i, t]),
                                              gamma[i, t] * 1.0)
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            returns[i, t] = acc
        _edge(edge, i, acc, gain)


@loop(spec.RETRACE)
def retrace(rewards, q_values, carry, log_pi, log_mu, next_expected_q, next_pi, next_q, terminated, done, truncated,
            last_done, gamma, lmbda, c_bar, ev_mode, done_mode, q_targets, edge):
    """The edge map is that of Q_ret[0] (the handed value c[0]*(Q_ret[0] - q[0]) is formed from it
    by rl_triton/core/sharded.py)."""
    R, T = rewards.shape
    A = next_pi.shape[2]
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        c_next = 1.0  # at the window end c[T] = 1 and q[T] = 0: the carry is c[T]*(Q_ret[T] - q[T])
        q_next = 0.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(terminated[i, t], done[i, t], done[i, min(t + 1, T - 1)], truncated[i, t],
                                  last_done[i], done_mode, t == T - 1)
            if ev_mode == EV_GIVEN:
                evt = next_expected_q[i, t] * 1.0
            else:
                evt = 0.0
                for a_ in range(A):
                    evt += next_pi[i, t, a_] * next_q[i, t, a_]
            a, b = _c_retrace(rewards[i, t], evt, q_next, nterm, ndone, gamma[i, t], c_next)
            acc = _c_step(a, b, acc)
            gain = _gain(gain, b)
            q_targets[i, t] = acc
            c_next = lmbda[i, t] * _clip(np.exp(log_pi[i, t] * 1.0 - log_mu[i, t]), c_bar)
            q_next = q_values[i, t] * 1.0
        _edge(edge, i, acc, gain)


@loop(spec.ELIGIBILITY_TRACE)
def eligibility_trace(x, done, carry, gamma, lmbda, traces, edge):
    """e[t] = x[t] + g[t]*l[t]*(1-done[t-1])*e[t-1], e[-1] = carry. The edge map is that of
    e[T-1] (the handed value (1 - done[T-1])*e[T-1] is formed by rl_triton/core/sharded.py)."""
    R, T = x.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        cut = False
        for t in range(T):
            if cut:
                acc = x[i, t] * 1.0
                gain = 0.0
            else:
                b = gamma[i, t] * 1.0 * lmbda[i, t]
                acc = _c_step(x[i, t] * 1.0, b, acc)
                gain = _gain(gain, b)
            traces[i, t] = acc
            cut = done[i, t] != 0
        _edge(edge, i, acc, gain)


@loop(spec.AFFINE_SCAN)
def affine_scan(alpha, beta, carry, reverse, y, edge):
    R, T = alpha.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        gain = 1.0
        for s in range(T):
            t = T - 1 - s if reverse else s
            b = beta[i, t]
            acc = _c_step(alpha[i, t] * 1.0, b, acc)
            gain = _gain(gain, b)
            y[i, t] = acc
        _edge(edge, i, acc, gain)


# each algorithm's kernel is the function of its name; GAE's variants for time-major memory and
# for SB3's and CleanRL's call are chosen in run()
_EPISODE_STARTS_KINDS = ("f2", "f2", "u2", "f1", "u1", "s", "s")
_TIME_MAJOR_KINDS = ("F2", "F2", "f1", "Fu2", "u1", "f1", "s", "s", "i")

_compiled: dict = {}

# from this many elements on, rows run in parallel: below it starting the thread pool costs more
# than it saves (re-tune: python benchmarks/torchrl_cpu.py and benchmarks/run.py --cpu)
PARALLEL_MIN_ELEMENTS = 1 << 15
# parallel kernels run one at a time: numba's workqueue threading layer (its fallback where
# neither TBB nor OpenMP loads) aborts the process when two threads enter parallel code at once,
# and a parallel kernel already uses every core
_PARALLEL = threading.Lock()


# kernels whose floating-point sums may be reassociated (vectorised); NaN and inf keep their meaning
REASSOCIATE = frozenset(("masked_moments", "whiten_all", "whiten_output"))
# kernels compiled with numpy's error model: a division by zero gives inf or NaN, as in IEEE
IEEE = frozenset(("whiten_all", "whiten_output"))


def _kernel(fn, arg_kinds, dtype: np.dtype, parallel: bool, kl: bool = True):
    """``fn`` compiled for arguments of ``arg_kinds`` (spec kinds, ``o2`` outputs) in float ``dtype``;
    with ``kl`` False, a GAE loop's build without KL shaping (``_kl_shaped`` bound to ``_kl_none``:
    no branch on kl_mode per step)."""
    kl = kl or "_kl_shaped" not in fn.__code__.co_names
    key = (fn.__name__, dtype, parallel, tuple(arg_kinds), kl)
    if key not in _compiled:
        if not available():
            raise RuntimeError("the numba backend needs numba: pip install -e '.[cpu]'")
        ft = nb.from_dtype(dtype)
        types = {
            "f1": nb.types.Array(ft, 1, "A", readonly=True), "f2": nb.types.Array(ft, 2, "A", readonly=True),
            "f3": nb.types.Array(ft, 3, "A", readonly=True),
            "u2": nb.types.Array(nb.types.uint8, 2, "A", readonly=True),
            "u1": nb.types.Array(nb.types.uint8, 1, "A", readonly=True), "o2": nb.types.Array(ft, 2, "A"),
            # C-contiguous rows (simpler addressing; loops that vectorise)
            "c2": nb.types.Array(ft, 2, "C", readonly=True), "oc2": nb.types.Array(ft, 2, "C"),
            "c1": nb.types.Array(ft, 1, "C", readonly=True), "oc1": nb.types.Array(ft, 1, "C"),
            "cu2": nb.types.Array(nb.types.uint8, 2, "C", readonly=True),
            "e": nb.types.Array(nb.types.float64, 2, "C"),
            # F-contiguous [R, T] rows of time-major memory (rows adjacent: the inner loop's stride)
            "F2": nb.types.Array(ft, 2, "F", readonly=True), "oF2": nb.types.Array(ft, 2, "F"),
            "Fu2": nb.types.Array(nb.types.uint8, 2, "F", readonly=True),
            "s": nb.types.float64, "i": nb.types.int64, "n": nb.types.int64, "b": nb.types.boolean,
        }
        sig = nb.types.void(*(types[k] for k in arg_kinds))
        fastmath = {"reassoc", "contract"} if fn.__name__ in REASSOCIATE else False
        build = fn if kl else _renamed(fn, "_nokl", _kl_shaped=_kl_none)
        _compiled[key] = nb.njit(sig, parallel=parallel, cache=True, nogil=True, fastmath=fastmath,
                                 error_model="numpy" if fn.__name__ in IEEE else "python")(
            _renamed(build, "_parallel") if parallel else build)
    return _compiled[key]


def _renamed(fn, suffix: str, **bound):
    """``fn`` under another name (and with the globals ``bound`` replaced). numba's on-disk cache
    keys a build by function name and signature, not by compile flags, so without this the serial
    and the parallel build of one kernel share an entry and whichever was compiled first is loaded
    for both."""
    scope = {**fn.__globals__, **bound} if bound else fn.__globals__
    copy = pytypes.FunctionType(fn.__code__, scope, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    return copy


_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


@functools.lru_cache(maxsize=64)
def _constant(value: float, np_dtype, shape: tuple):
    """A read-only stride-0 array standing for an absent or constant input."""
    return np.broadcast_to(np.array(value, dtype=np_dtype), shape)


def _dense(x: torch.Tensor):
    """The numpy view of a CPU tensor that numba reads (not float16/bfloat16) and whose memory is
    dense (C or F order, so ``ravel(order="K")`` is a view), else None."""
    if x.device.type != "cpu" or x.dtype in (torch.float16, torch.bfloat16):
        return None
    a = x.detach().numpy()
    return a if a.flags.c_contiguous or a.flags.f_contiguous else None


def _flag_bytes(x: torch.Tensor) -> np.ndarray:
    """A flag tensor as a 0/1 uint8 numpy array of its shape: bool and int8 viewed, others
    converted in one numba pass."""
    if x.dtype == torch.bool or x.dtype == torch.int8:
        return _numpy_bytes(x)
    if x.dtype == torch.uint8:
        return x.numpy()
    a = _dense(x) if available() else None
    if a is None:
        return (x != 0).view(torch.uint8).numpy()
    out = np.empty_like(a, dtype=np.uint8)  # same memory order as a
    _nonzero_bytes(a.ravel(order="K"), out.ravel(order="K"))
    return out


def same_dense_layout(x: torch.Tensor, out: torch.Tensor) -> bool:
    """True when the numba whitening kernels can take ``x`` and ``out``: float32 or float64 CPU
    tensors of one shape, dtype and strides, C- or F-contiguous (a transposed matrix too)."""
    return x.shape == out.shape and x.dtype == out.dtype and x.stride() == out.stride() \
        and _dense(x) is not None and _dense(out) is not None


def _memory_order(x: torch.Tensor) -> np.ndarray:
    """The 1-D numpy view of a :func:`same_dense_layout` tensor in memory order."""
    return _dense(x).ravel(order="K")


def whiten_flat(x: torch.Tensor, out: torch.Tensor, unbiased: bool, shift_mean: bool, scale: bool, eps: float,
                eps_mode: int) -> None:
    """:func:`whiten_all` on ``x`` and ``out`` (:func:`same_dense_layout`; ``out`` may be ``x``),
    over their elements in memory order."""
    a, y = _memory_order(x), _memory_order(out)
    parts = np.empty((max(1, -(-a.shape[0] // WHITEN_ROW)), 3))
    parallel = parts.shape[0] > 1 and a.shape[0] >= PARALLEL_MIN_ELEMENTS
    kernel = _kernel(whiten_all, ("c1", "oc1", "e", "b", "b", "b", "s", "i"), _NUMPY_DTYPES[x.dtype], parallel)
    if parallel:
        with _PARALLEL:
            kernel(a, y, parts, unbiased, shift_mean, scale, eps, eps_mode)
    else:
        kernel(a, y, parts, unbiased, shift_mean, scale, eps, eps_mode)


def whiten_apply(x: torch.Tensor, out: torch.Tensor, mean: float, rstd: float, shift_mean: bool) -> None:
    """:func:`whiten_output` on ``x`` and ``out`` (:func:`same_dense_layout`; ``out``
    may be ``x``), over their elements in memory order."""
    a, y = _memory_order(x), _memory_order(out)
    parallel = a.shape[0] > WHITEN_ROW and a.shape[0] >= PARALLEL_MIN_ELEMENTS
    kernel = _kernel(whiten_output, ("c1", "oc1", "s", "s", "b"), _NUMPY_DTYPES[x.dtype], parallel)
    if parallel:
        with _PARALLEL:
            kernel(a, y, mean, rstd, shift_mean)
    else:
        kernel(a, y, mean, rstd, shift_mean)


def row_moments(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """float64 ``[R, 3]``: ``(n, mean, M2)`` of each row of the 2-D float32 or float64 CPU
    tensor ``x`` over the nonzero elements of ``mask`` (its shape, any dtype; None: every
    element), by :func:`masked_moments`."""
    R, T = x.shape
    parallel = R > 1 and R * T >= PARALLEL_MIN_ELEMENTS
    kernel = _kernel(masked_moments, ("c2", "cu2", "e"), _NUMPY_DTYPES[x.dtype], parallel)
    flags = np.ones((R, T), np.uint8) if mask is None else np.ascontiguousarray(_flag_bytes(mask))
    values = np.ascontiguousarray(x.detach().numpy())
    out = np.empty((R, 3))
    if parallel:
        with _PARALLEL:
            kernel(values, flags, out)
    else:
        kernel(values, flags, out)
    return torch.from_numpy(out)


def spread_rows(values: torch.Tensor, mask: torch.Tensor, out: torch.Tensor | None = None):
    """``[B, L]``: ``values[i]`` where ``mask[i, t]`` is nonzero, else 0 (``out``, where given, is
    written), in one pass with no temporaries; None where numba does not read these tensors (then
    the caller's torch ops serve)."""
    if not available() or values.requires_grad or values.dtype not in _NUMPY_DTYPES:
        return None
    m = _dense(mask)
    if m is None or m.ndim != 2:
        return None
    if out is None:
        out = torch.empty(mask.shape, dtype=values.dtype)
    elif out.dtype not in _NUMPY_DTYPES:
        return None
    _spread_rows(values.detach().numpy(), m, out.numpy())
    return out


def all_binary(x: torch.Tensor) -> bool:
    """True when every element of a flag tensor is 0 or 1 (one pass, no temporaries on CPU)."""
    a = _dense(x) if available() else None
    if a is not None:
        return bool(_all_binary(a.ravel(order="K")))
    return bool(((x == 0) | (x == 1)).all())


def implies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``b`` is set (nonzero) wherever ``a`` is: one pass over two flag tensors of one
    shape and layout on CPU, the torch ops otherwise."""
    x = _dense(a) if available() and a.shape == b.shape and a.stride() == b.stride() else None
    y = _dense(b) if x is not None else None
    if y is not None:
        x, y = (z.view(np.uint8) if z.dtype == np.bool_ else z for z in (x, y))
        return bool(_implies(x.ravel(order="K"), y.ravel(order="K")))
    return not bool(((a != 0) & (b == 0)).any())


def _adapt(kind: str, x, rows: int, steps: int, dtype: torch.dtype):
    """One kernel argument from the launcher's form (tensor, None or number) to numba's.

    Absent or constant arrays become stride-0 broadcasts, flags become uint8 0/1. A numpy array
    stands for the tensor sharing its memory.
    """
    if type(x) is np.ndarray:
        x = torch.from_numpy(x)
    if isinstance(x, torch.Tensor):
        if x.requires_grad:  # the fused path runs with autograd off; numpy() refuses such tensors
            x = x.detach()
        if kind[0] == "u":
            return _flag_bytes(x)
        return (x if x.dtype == dtype else x.to(dtype)).numpy()
    if kind in ("s", "i", "n", "b"):
        return x
    if kind[0] == "u":
        return _constant(0, np.uint8, (rows, steps)[: int(kind[1])])
    shape = {"f1": (rows,), "f2": (rows, steps), "f3": (rows, steps, 1)}[kind]
    return _constant(0.0 if x is None else float(x), _NUMPY_DTYPES[dtype], shape)


_EPISODE_STARTS_ARGS = ("rewards", "values", "done", "bootstrap_value", "last_done", "gamma", "lmbda")


def _episode_starts_call(args) -> bool:
    """Whether a GAE call is SB3's or CleanRL's (observation-aligned flags, implied next values,
    a bootstrap value, number coefficients), which ``gae_episode_starts`` serves."""
    return (args.nv_mode == NV_IMPLIED and args.done_mode == DONE_OBS_ALIGNED and args.bootstrap_value is not None
            and args.carry is None and args.kl_mode == KL_NONE and not isinstance(args.gamma, torch.Tensor)
            and not isinstance(args.lmbda, torch.Tensor))


_TIME_MAJOR_ARGS = ("rewards", "values", "bootstrap_value", "done", "last_done", "carry", "gamma", "lmbda",
                    "done_mode")
# terminated alone: the dones are the terminations
_TIME_MAJOR_TERMINATED_ARGS = ("rewards", "values", "bootstrap_value", "terminated", "last_done", "carry", "gamma",
                               "lmbda", "done_mode")


def _f_rows(x, dtype) -> bool:
    """Whether ``x`` is an F-contiguous ``[R, T]`` tensor (rows adjacent: a time-major view) that
    reaches the kernel F-contiguous: a float of ``dtype``, or for ``dtype`` None a flag tensor
    (bytes viewed, other dtypes but float16/bfloat16 converted in memory order)."""
    if isinstance(x, np.ndarray):  # an output buffer of a call plan
        return x.ndim == 2 and x.flags.f_contiguous and dtype is not None and x.dtype == _NUMPY_DTYPES[dtype]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.t().is_contiguous() or x.requires_grad:
        return False
    return x.dtype not in (torch.float16, torch.bfloat16) if dtype is None else x.dtype == dtype


def _time_major_call(args, dtype, outs) -> bool:
    """Whether a GAE call is one that ``gae_time_major`` serves: implied next values (so every
    done a termination), number coefficients, flags as dones, terminations alone or episode
    starts, every array F-contiguous in its kernel form."""
    if args.nv_mode != NV_IMPLIED or args.kl_mode != KL_NONE or isinstance(args.gamma, torch.Tensor) \
            or isinstance(args.lmbda, torch.Tensor) or args.truncated is not None:
        return False
    flags = args.done if args.done is not None else args.terminated
    return _f_rows(flags, None) and _f_rows(args.rewards, dtype) and _f_rows(args.values, dtype) \
        and all(_f_rows(o, dtype) for o in outs)


NO_EDGE = np.zeros((0, 5))  # the edge argument of a launch that asks for no edge map
_CONTIGUOUS = {"f2": "c2", "u2": "cu2"}  # C-contiguous forms of the kinds
_BASE_KIND = {"c2": "f2", "cu2": "u2", "F2": "f2", "Fu2": "u2"}


def _c_rows(x, dtype) -> bool:
    """Whether ``x`` is a C-contiguous ``[R, T]`` tensor that reaches the kernel as it is (float of
    ``dtype``; for ``dtype`` None a flag tensor of bytes)."""
    if isinstance(x, np.ndarray):  # an output buffer of a call plan
        return x.ndim == 2 and x.flags.c_contiguous and dtype is not None and x.dtype == _NUMPY_DTYPES[dtype]
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_contiguous() or x.requires_grad:
        return False
    return x.dtype in (torch.bool, torch.uint8, torch.int8) if dtype is None else x.dtype == dtype


class Launch:
    """The launch of one algorithm for one call signature (shapes, strides, dtypes, which inputs
    are present, the numbers), decided once: the kernel variant and its build, and every argument
    the signature fixes (stand-ins for absent inputs, constants); a launch converts only the
    tensors. ``launch(args, outs)``: ``args`` is ``algo.Args`` of ``[R, T]`` views of this
    signature, ``outs`` the output views; floats are computed in ``dtype``. ``edge``: the launch
    also writes each row's edge map (spec.py) into a float64 ``[R, k]`` array."""

    def __init__(self, algo: spec.Algorithm, dtype: torch.dtype, args, outs, edge: bool = False):
        ref = args[0]
        rows, steps = ref.shape[:2]
        np_dtype = _NUMPY_DTYPES[dtype]
        time_major = rows > 1 and ref.stride(0) < ref.stride(1)
        fn, names, kinds = KERNELS[algo.name], algo.names, algo.kinds
        has_edge = 1  # every kernel but the episode-starts ones takes the edge argument
        out_kind = "o2"
        # (one step: [R, 1] arrays are C-contiguous too, which numba types as C)
        if algo is spec.GAE and time_major and rows >= TIME_MAJOR_MIN_ROWS and steps > 1 \
                and _time_major_call(args, dtype, outs):
            fn, kinds, out_kind = gae_time_major, _TIME_MAJOR_KINDS, "oF2"
            names = _TIME_MAJOR_ARGS if args.done is not None else _TIME_MAJOR_TERMINATED_ARGS
        elif algo is spec.GAE and not edge:
            if _episode_starts_call(args):
                fn = gae_episode_starts_blocks if time_major else gae_episode_starts
                names, kinds, has_edge = _EPISODE_STARTS_ARGS, _EPISODE_STARTS_KINDS, 0
            elif time_major and rows * steps >= ROW_BLOCK_MIN_ELEMENTS:
                fn = gae_row_blocks
        if algo is spec.NSTEP_RETURN and args.n > NSTEP_DIRECT_MAX:
            fn = nstep_return_blocks
        if algo is spec.MASKED_GAE and not edge and rows > 1:
            fn = masked_gae_pairs
            if _c_rows(args.rewards, dtype) and _c_rows(args.values, dtype) and _c_rows(args.mask, None) \
                    and all(_c_rows(o, dtype) for o in outs):
                # C-contiguous rows: simpler addressing (measured: 1.6x the strided build's speed)
                kinds = tuple(_CONTIGUOUS.get(k, k) if n in ("rewards", "values", "mask") else k
                              for n, k in zip(names, kinds))
                out_kind = "oc2"
        # the kernel's arguments as far as the signature fixes them (stand-ins, constants; a number
        # coefficient of a scalar parameter applied in the compute dtype, as everywhere), and per
        # tensor argument its position in the converted list, in args, and its conversion; a
        # tensor passed twice (done alone stands for terminated too) is converted once
        self.fixed, self.tensors, self.repeats = [], [], []
        seen = {}
        for j, (name, kind) in enumerate(zip(names, kinds)):
            x = getattr(args, name)
            if isinstance(x, torch.Tensor):
                self.fixed.append(None)
                if (id(x), kind) in seen:
                    self.repeats.append((j, seen[id(x), kind]))
                else:
                    seen[id(x), kind] = j
                    self.tensors.append((j, algo.names.index(name), _converter(kind, x, dtype)))
            elif kind == "s" and name in ("gamma", "lmbda"):
                self.fixed.append(float(np_dtype.type(x)))
            else:
                self.fixed.append(_adapt(kind, x, rows, steps, dtype))
        self.parallel = rows > 1 and rows * steps >= PARALLEL_MIN_ELEMENTS
        self.has_edge = has_edge
        self.kernel = _kernel(fn, (*kinds, *(out_kind,) * len(outs), *("e",) * has_edge), np_dtype, self.parallel,
                              kl=getattr(args, "kl_mode", KL_NONE) != KL_NONE)

    def launch(self, args, outs, edge=None) -> None:
        converted = self.fixed.copy()
        for j, pos, convert in self.tensors:
            converted[j] = convert(args[pos])
        for j, first in self.repeats:
            converted[j] = converted[first]
        converted += [o if type(o) is np.ndarray else o.numpy() for o in outs]
        if self.has_edge:
            converted.append(NO_EDGE if edge is None else edge)
        if self.parallel:
            with _PARALLEL:
                self.kernel(*converted)
        else:
            self.kernel(*converted)

    def source(self, args: dict, outs, namespace: dict):
        """Python source lines launching the kernel: ``args`` maps each tensor argument's
        position to (an expression for its view, whether that is a numpy array), ``outs`` the
        outputs likewise; the objects the lines name go into ``namespace``."""
        lines, items = [], []
        for j, value in enumerate(self.fixed):
            namespace[f"_f{j}"] = value
            items.append(f"_f{j}")
        namespace.update(_uint8=np.uint8, _kernel=self.kernel, _lock=_PARALLEL)
        for j, pos, convert in self.tensors:
            expr, is_array = args[pos]
            if is_array and convert is _numpy:
                lines.append(f"x{j} = {expr}")
            elif is_array and convert is _numpy_bytes:
                lines.append(f"x{j} = {expr}.view(_uint8)")
            else:
                namespace[f"_convert{j}"] = convert
                lines.append(f"x{j} = _convert{j}({expr})")
            items[j] = f"x{j}"
        for j, first in self.repeats:
            items[j] = f"x{first}"
        items += [expr if is_array else f"{expr}.numpy()" for expr, is_array in outs]
        if self.has_edge:
            namespace["_no_edge"] = NO_EDGE
            items.append("_no_edge")
        call = f"_kernel({', '.join(items)})"
        return lines + (["with _lock:", f"    {call}"] if self.parallel else [call])


def new_output(shape: tuple, dtype: torch.dtype, transposed: bool):
    """A fresh C-ordered output as a tensor and, for the kernels, the numpy array (transposed for
    ``[R, T]`` rows of a time-major output) whose memory it shares."""
    a = np.empty(shape, _NUMPY_DTYPES[dtype])
    return torch.from_numpy(a), a.T if transposed else a


def _numpy(x):
    return x if type(x) is np.ndarray else x.numpy()


def _numpy_bytes(x):
    return _numpy(x).view(np.uint8)


def _converter(kind: str, x: torch.Tensor, dtype: torch.dtype):
    """The conversion of tensors like ``x`` to the kernel's argument of ``kind`` (as ``_adapt``)."""
    kind = _BASE_KIND.get(kind, kind)
    if not x.requires_grad:
        if kind[0] == "u" and x.dtype in (torch.bool, torch.int8):
            return _numpy_bytes
        if (kind[0] == "u" and x.dtype == torch.uint8) or (kind[0] == "f" and x.dtype == dtype):
            return _numpy
    return functools.partial(_adapt, kind, rows=0, steps=0, dtype=dtype)

def run(algo: spec.Algorithm, dtype: torch.dtype, args, outs) -> None:
    """Run ``algo``'s kernel: ``args`` is ``algo.Args``, ``outs`` the ``[R, T]`` output views;
    floats are computed in ``dtype``."""
    Launch(algo, dtype, args, outs).launch(args, outs)


# -- GAE over one flat buffer cut at its end flags ---------------------------------------------
# Tianshou's layout: every field one 1-D array in buffer order, the episodes of all environments
# one after another, an end flag after the last step of each. An end cuts the trace, so the
# stretches between chosen ends are independent: FLAT_LANES of them advance together in one
# loop (eight dependency chains in flight instead of one: a step's multiply-add waits on the
# previous step's, which leaves the core idle between the steps of one chain), and with threads
# each thread takes FLAT_LANES stretches of its own.
FLAT_LANES = 8
_flat_compiled: dict = {}


def flat_bounds(ends, pieces, bounds):
    """Cut ``n = ends.shape[0]`` steps into ``pieces`` stretches ``[bounds[k], bounds[k+1])``:
    bounds[0] = 0, bounds[pieces] = n, and every other bound is the first step at or after
    ``k * n // pieces`` (and after the previous bound) that follows an end (``ends[b - 1]``
    nonzero), or n where none does, so stretches may be empty. One pass over the flags at most."""
    n = ends.shape[0]
    bounds[0] = 0
    for k in range(1, pieces):
        i = max(k * n // pieces, bounds[k - 1])
        while i < n and (i == 0 or ends[i - 1] == 0):
            i += 1
        bounds[k] = i
    bounds[pieces] = n


def flat_flags(indices, terminated, truncated, slot_off, slot_end, ends, keep):
    """The flags of a batch drawn from a buffer at ``indices``, in one pass: per step i with
    slot k = indices[i], ``ends[i] = terminated[i] | truncated[i] | slot_end[k]`` and
    ``keep[i] = not slot_off[k]`` (``slot_off`` and ``slot_end`` are per-slot bool arrays of the
    buffer's length L; a negative k reads slot_off[k + L], as numpy indexing does, and counts as no
    slot_end). Returns -1, or the first i whose slot is outside [-L, L) (the outputs are then
    incomplete)."""
    size = slot_off.shape[0]
    n = indices.shape[0]
    low, high = 0, 0
    for i in range(n):  # no early exit: the loop vectorises
        low = min(low, indices[i])
        high = max(high, indices[i])
    if low >= 0 and high < size:  # the common case, without branches in the loop
        for i in range(n):
            k = np.uint64(indices[i])  # unsigned: no negative-index wraparound
            ends[i] = terminated[i] | truncated[i] | slot_end[k]
            keep[i] = not slot_off[k]
        return -1
    for i in range(n):
        k = indices[i]
        if k < -size or k >= size:
            return i
        at_end = False
        if k < 0:
            k += size
        else:
            at_end = slot_end[k]
        ends[i] = terminated[i] | truncated[i] | at_end
        keep[i] = not slot_off[k]
    return -1


def _flat_delta(r, v, nv, m, gamma):
    """delta = r + nv * m * gamma - v in float64 (each input widened first), as Tianshou's loop
    forms it from its masked next values."""
    return r * 1.0 + nv * 1.0 * m * gamma - v * 1.0


def _flat_carry(delta, e, gl, acc):
    """A = delta where the step ends an episode or gl = gamma * lambda is 0 (the carried A is not
    read), else delta + gl * A."""
    return delta if e != 0 or gl == 0.0 else delta + gl * acc


def gae_flat(rewards, values, next_values, next_mask, ends, bounds, gamma, lmbda, targets, advantages,
             value_targets):
    """GAE over one flat buffer, float64 whatever the inputs' float dtypes:

        A[i] = r[i] + gamma * nv[i] * m[i] - v[i] + gamma * lmbda * A[i+1]   (A[i+1] absent
               where ends[i] is set, after the last step, and where gamma * lmbda is 0),
        value_targets[i] = A[i] + v[i]   (written where ``targets`` is True),

    with ``m`` the 0/1 ``next_mask`` (a product, so NaN * 0 stays NaN, as a framework that masks
    its next values by multiplying has it). The stretches of ``bounds`` (:func:`flat_bounds`,
    ``FLAT_LANES * groups + 1`` entries) must each end at an end flag or at the last step; each
    group of FLAT_LANES stretches is one task of the threads. A task forms its TD errors in one
    pass (in vector lanes), runs the recurrence over its stretches together, then adds the
    values. Unsigned indices throughout: numba adds no negative-index wraparound to them."""
    gl = gamma * lmbda
    L = FLAT_LANES
    for g in prange((bounds.shape[0] - 1) // L):
        first, last = np.uint64(bounds[g * L]), np.uint64(bounds[(g + 1) * L])
        for i in range(first, last):
            advantages[i] = _c_flat_delta(rewards[i], values[i], next_values[i], next_mask[i], gamma)
        common = bounds[g * L + 1] - bounds[g * L]
        for lane in range(1, L):
            common = min(common, bounds[g * L + lane + 1] - bounds[g * L + lane])
        acc = np.zeros(L)
        for j in range(1, common + 1):
            for lane in range(L):
                i = np.uint64(bounds[g * L + lane + 1] - j)
                acc[lane] = _c_flat_carry(advantages[i], ends[i], gl, acc[lane])
                advantages[i] = acc[lane]
        for lane in range(L):  # the rest of each stretch, one by one
            x = acc[lane]
            for j in range(common + 1, bounds[g * L + lane + 1] - bounds[g * L + lane] + 1):
                i = np.uint64(bounds[g * L + lane + 1] - j)
                x = _c_flat_carry(advantages[i], ends[i], gl, x)
                advantages[i] = x
        if targets:
            for i in range(first, last):
                value_targets[i] = advantages[i] + values[i]


def _flat_kernels(parallel: bool):
    """(flat_bounds, gae_flat, flat_flags) compiled (lazily; numba types each call's dtypes and
    layouts)."""
    if parallel not in _flat_compiled:
        if not available():
            raise RuntimeError("the numba backend needs numba: pip install -e '.[cpu]'")
        global _c_flat_delta, _c_flat_carry
        _c_flat_delta, _c_flat_carry = _inline(_flat_delta), _inline(_flat_carry)
        bounds = nb.njit(cache=True, nogil=True)(flat_bounds)
        kernel = nb.njit(cache=True, nogil=True, parallel=parallel)(
            _renamed(gae_flat, "_parallel") if parallel else gae_flat)
        _flat_compiled[parallel] = (bounds, kernel, nb.njit(cache=True, nogil=True)(flat_flags))
    return _flat_compiled[parallel]


def gae_flat_run(rewards: np.ndarray, values: np.ndarray, next_values: np.ndarray, next_mask: np.ndarray | None,
                 ends: np.ndarray, gamma: float, lmbda: float, threads: int = 1,
                 targets: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """``(advantages, value_targets)`` of :func:`gae_flat` as new float64 arrays (targets None
    where ``targets`` is False).

    Args:
        rewards, values, next_values: 1-D float32 or float64 numpy arrays of one length n (any
            strides, a stride-0 broadcast too).
        next_mask: 1-D bool or uint8 0/1 array multiplying the next values, or None (all 1).
        ends: 1-D bool or uint8 0/1 array, nonzero where an episode ends after the step.
        gamma, lmbda: the discount and the GAE parameter (numbers).
        threads: threads to spread the stretches over (1: this thread alone, no parallel region).
        targets: whether to form value_targets = advantages + values.
    """
    n = rewards.shape[0]
    for name, x in (("values", values), ("next_values", next_values), ("ends", ends)) + \
            ((("next_mask", next_mask),) if next_mask is not None else ()):
        if x.ndim != 1 or x.shape[0] != n:
            raise ValueError(f"{name} must be 1-D of the rewards' length {n}, got shape {x.shape}")
    for name, x in (("rewards", rewards), ("values", values), ("next_values", next_values)):
        if x.dtype not in (np.float32, np.float64):
            raise TypeError(f"{name} must be float32 or float64, got {x.dtype}")
    for name, x in (("ends", ends), ("next_mask", next_mask)):
        if x is not None and x.dtype not in (np.bool_, np.uint8):
            raise TypeError(f"{name} must be bool or uint8, got {x.dtype}")
    parallel = threads > 1
    find_bounds, kernel, _ = _flat_kernels(parallel)
    flags = ends.view(np.uint8)
    # a contiguous mask of ones, not a stride-0 one: the TD-error pass then runs in vector lanes
    mask = np.ones(n, np.uint8) if next_mask is None else next_mask.view(np.uint8)
    bounds = np.empty(FLAT_LANES * max(1, threads) + 1, np.int64)
    find_bounds(flags, bounds.shape[0] - 1, bounds)
    advantages = np.empty(n)
    value_targets = np.empty(n) if targets else advantages
    if parallel:
        with _PARALLEL:
            kernel(rewards, values, next_values, mask, flags, bounds, float(gamma), float(lmbda), targets, advantages,
                   value_targets)
    else:
        kernel(rewards, values, next_values, mask, flags, bounds, float(gamma), float(lmbda), targets, advantages,
               value_targets)
    return advantages, value_targets if targets else None


def flat_flags_run(indices: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, slot_off: np.ndarray,
                   slot_end: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``(ends, keep)`` of :func:`flat_flags` as new bool arrays, or None where an index is
    outside [-L, L) (the caller's own indexing then says what is wrong).

    Args:
        indices: 1-D signed integer array, the batch's slots in the buffer.
        terminated, truncated: 1-D bool arrays of the batch (``indices``' length).
        slot_off: bool array over the buffer's L slots; keep[i] is its negation at slot indices[i].
        slot_end: bool array of the same length; a set slot ends the step's episode.
    """
    if indices.dtype.kind != "i":
        raise TypeError(f"indices must be signed integers, got {indices.dtype}")
    for name, x in (("terminated", terminated), ("truncated", truncated), ("slot_off", slot_off),
                    ("slot_end", slot_end)):
        if x.dtype != np.bool_ or x.ndim != 1:
            raise TypeError(f"{name} must be a 1-D bool array, got {x.dtype} of shape {x.shape}")
    if terminated.shape != indices.shape or truncated.shape != indices.shape or slot_end.shape != slot_off.shape:
        raise ValueError(f"shapes differ: indices {indices.shape}, terminated {terminated.shape}, truncated "
                         f"{truncated.shape}, slot_off {slot_off.shape}, slot_end {slot_end.shape}")
    ends, keep = np.empty(indices.shape[0], np.bool_), np.empty(indices.shape[0], np.bool_)
    bad = _flat_kernels(False)[2](indices, terminated, truncated, slot_off, slot_end, ends, keep)
    return None if bad >= 0 else (ends, keep)
