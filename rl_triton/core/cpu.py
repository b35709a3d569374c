"""Compiled CPU backend: one numba loop per algorithm, parallel over rows, one pass over time.

Arrays arrive as ``[R, T]`` numpy views of the caller's tensors (any strides, broadcast
inputs with stride 0). Absent inputs and number coefficients become stride-0 arrays, so each
kernel has one signature per float dtype and compiles once (lazily, cached on disk). The one
call that dominates CPU use, SB3's and CleanRL's GAE (episode starts, implied next values,
number coefficients), has kernels of its own without those stand-ins; in time-major memory
they advance blocks of rows through time together.
"""

from __future__ import annotations

import functools
import types as pytypes

import numpy as np
import torch

try:
    import numba as nb
    from numba import prange
except ImportError:  # the torch backend serves CPU tensors without numba
    nb = None

from . import coefficients as C

AVAILABLE = nb is not None

from .signatures import DONE_ARRAY, DONE_OBS_ALIGNED, NV_EXPLICIT, NV_IMPLIED, kinds


if AVAILABLE:
    _inline = nb.njit(inline="always", cache=True)
    _c_gae = _inline(C.gae)
    _c_td_lambda = _inline(C.td_lambda)
    _c_discounted = _inline(C.discounted)
    _c_vtrace = _inline(C.vtrace)
    _c_vtrace_pg = _inline(C.vtrace_pg)
    _c_retrace = _inline(C.retrace)

    # helpers take scalars: passing arrays into a call in the loop costs reference counting.
    # Kernels pass gamma as ``g[i, t] * 1.0`` so that products like gamma * lambda are formed in
    # float64, not rounded to float32 first

    @_inline
    def _flags(term, done, done_next, trunc, last_done, done_mode, last):
        if done_mode == DONE_OBS_ALIGNED:
            k = (last_done if last else done_next) != 0
            d = k
        else:
            k = term != 0
            d = (done != 0) if done_mode == DONE_ARRAY else (k or trunc != 0)
        return (0.0 if k else 1.0), (0.0 if d else 1.0)

    @_inline
    def _next_value(nv, v_next, boot, nv_mode, last):
        if nv_mode == NV_EXPLICIT:
            return nv
        return boot if last else v_next


def _gae(r, v, nv, boot, term, done, trunc, last, g, l, nv_mode, done_mode, adv, tgt):
    R, T = r.shape
    for i in prange(R):
        acc = 0.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(term[i, t], done[i, t], done[i, min(t + 1, T - 1)], trunc[i, t], last[i],
                                  done_mode, t == T - 1)
            nvt = _next_value(nv[i, t], v[i, min(t + 1, T - 1)], boot[i], nv_mode, t == T - 1)
            a, b = _c_gae(r[i, t], v[i, t], nvt, nterm, ndone, g[i, t] * 1.0, l[i, t])
            acc = a + b * acc
            adv[i, t] = acc
            tgt[i, t] = acc + v[i, t]


ROW_BLOCK = 256  # rows advanced together per time step in time-major memory (1 KB of float32)
# below this many elements the rows of a time-major rollout stay in cache and walking them one
# by one is faster (measured on the 2-core CPU machine: 0.8-0.95x at 1k-512k elements, 2x at 2M)
ROW_BLOCK_MIN_ELEMENTS = 1 << 20


def _gae_row_blocks(r, v, nv, boot, term, done, trunc, last, g, l, nv_mode, done_mode, adv, tgt):
    """``_gae`` for time-major memory (rows adjacent): blocks of rows step through time together,
    so each step reads contiguous runs instead of one element per cache line."""
    R, T = r.shape
    for blk in prange((R + ROW_BLOCK - 1) // ROW_BLOCK):
        lo = blk * ROW_BLOCK
        hi = min(lo + ROW_BLOCK, R)
        acc = np.zeros(ROW_BLOCK)
        for t in range(T - 1, -1, -1):
            tn = min(t + 1, T - 1)
            end = t == T - 1
            for i in range(lo, hi):
                nterm, ndone = _flags(term[i, t], done[i, t], done[i, tn], trunc[i, t], last[i], done_mode, end)
                nvt = _next_value(nv[i, t], v[i, tn], boot[i], nv_mode, end)
                a, b = _c_gae(r[i, t], v[i, t], nvt, nterm, ndone, g[i, t] * 1.0, l[i, t])
                x = a + b * acc[i - lo]
                acc[i - lo] = x
                adv[i, t] = x
                tgt[i, t] = x + v[i, t]


def _gae_episode_starts(r, v, starts, boot, last, g, l, adv, tgt):
    """``_gae`` for SB3's and CleanRL's call (observation-aligned flags, implied next values,
    constant gamma and lambda), without the stand-in inputs and mode branches of the general
    kernel: done[t] = starts[t+1], done[T-1] = last, every done a termination."""
    R, T = r.shape
    for i in prange(R):
        nd = 0.0 if last[i] != 0 else 1.0
        acc, b = _c_gae(r[i, T - 1], v[i, T - 1], boot[i], nd, nd, g, l)
        adv[i, T - 1] = acc
        tgt[i, T - 1] = acc + v[i, T - 1]
        for t in range(T - 2, -1, -1):
            nd = 0.0 if starts[i, t + 1] != 0 else 1.0
            a, b = _c_gae(r[i, t], v[i, t], v[i, t + 1], nd, nd, g, l)
            acc = a + b * acc
            adv[i, t] = acc
            tgt[i, t] = acc + v[i, t]


def _gae_episode_starts_blocks(r, v, starts, boot, last, g, l, adv, tgt):
    """``_gae_episode_starts`` for time-major memory: blocks of rows step through time together
    (A/B on the CPU machine: 1.3x walking the rows at 8 rows, 1.9x from 16 rows on)."""
    R, T = r.shape
    for blk in prange((R + ROW_BLOCK - 1) // ROW_BLOCK):
        lo = blk * ROW_BLOCK
        hi = min(lo + ROW_BLOCK, R)
        acc = np.empty(ROW_BLOCK)
        for i in range(lo, hi):
            nd = 0.0 if last[i] != 0 else 1.0
            a, b = _c_gae(r[i, T - 1], v[i, T - 1], boot[i], nd, nd, g, l)
            acc[i - lo] = a
            adv[i, T - 1] = a
            tgt[i, T - 1] = a + v[i, T - 1]
        for t in range(T - 2, -1, -1):
            for i in range(lo, hi):
                nd = 0.0 if starts[i, t + 1] != 0 else 1.0
                a, b = _c_gae(r[i, t], v[i, t], v[i, t + 1], nd, nd, g, l)
                x = a + b * acc[i - lo]
                acc[i - lo] = x
                adv[i, t] = x
                tgt[i, t] = x + v[i, t]


def _td_lambda(r, nv, term, done, trunc, last, g, l, done_mode, out):
    R, T = r.shape
    for i in prange(R):
        acc = nv[i, T - 1] * 1.0 if T > 0 else 0.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(term[i, t], done[i, t], done[i, min(t + 1, T - 1)], trunc[i, t], last[i],
                                  done_mode, t == T - 1)
            a, b = _c_td_lambda(r[i, t], nv[i, t], nterm, ndone, g[i, t] * 1.0, l[i, t])
            acc = a + b * acc
            out[i, t] = acc


def _discounted(r, nv, carry, term, done, trunc, last, g, done_mode, out):
    R, T = r.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(term[i, t], done[i, t], done[i, min(t + 1, T - 1)], trunc[i, t], last[i],
                                  done_mode, t == T - 1)
            a, b = _c_discounted(r[i, t], nv[i, t], nterm, ndone, g[i, t])
            acc = a + b * acc
            out[i, t] = acc


def _vtrace(r, v, nv, boot, lp, lm, term, done, trunc, last, g, l, rho_bar, c_bar, rho_bar_pg,
            nv_mode, done_mode, vs_out, pg_out):
    R, T = r.shape
    for i in prange(R):
        acc = 0.0
        vs_next = 0.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(term[i, t], done[i, t], done[i, min(t + 1, T - 1)], trunc[i, t], last[i],
                                  done_mode, t == T - 1)
            nvt = _next_value(nv[i, t], v[i, min(t + 1, T - 1)], boot[i], nv_mode, t == T - 1)
            ratio = np.exp(lp[i, t] * 1.0 - lm[i, t])
            rho = min(rho_bar, ratio)
            c = l[i, t] * min(c_bar, ratio)
            if ndone == 0.0 or t == T - 1:
                vs_next = nvt
            pg_out[i, t] = _c_vtrace_pg(r[i, t], v[i, t], vs_next, nterm, g[i, t], min(rho_bar_pg, ratio))
            a, b = _c_vtrace(r[i, t], v[i, t], nvt, nterm, ndone, g[i, t], rho, c)
            acc = a + b * acc
            vs_next = acc + v[i, t]
            vs_out[i, t] = vs_next


def _retrace(r, q, lp, lm, ev, pi, nq, term, done, trunc, last, g, l, c_bar, ev_mode, done_mode, out):
    R, T = r.shape
    A = pi.shape[2]
    for i in prange(R):
        acc = 0.0
        c_next = 0.0
        for t in range(T - 1, -1, -1):
            nterm, ndone = _flags(term[i, t], done[i, t], done[i, min(t + 1, T - 1)], trunc[i, t], last[i],
                                  done_mode, t == T - 1)
            if ev_mode == 0:
                evt = ev[i, t] * 1.0
            else:
                evt = 0.0
                for a_ in range(A):
                    evt += pi[i, t, a_] * nq[i, t, a_]
            a, b = _c_retrace(r[i, t], q[i, t], evt, nterm, ndone, g[i, t], c_next)
            acc = a + b * acc
            out[i, t] = acc + q[i, t]
            c_next = l[i, t] * min(c_bar, np.exp(lp[i, t] * 1.0 - lm[i, t]))


def _forward_trace(x, done, g, l, initial, out):
    """e[t] = x[t] + g[t]*l[t]*(1-done[t-1])*e[t-1], e[-1] = initial."""
    R, T = x.shape
    for i in prange(R):
        acc = initial[i] * 1.0
        cut = False
        for t in range(T):
            if cut:
                acc = x[i, t] * 1.0
            else:
                acc = x[i, t] + g[i, t] * 1.0 * l[i, t] * acc
            out[i, t] = acc
            cut = done[i, t] != 0


def _affine_scan(alpha, beta, carry, reverse, out):
    R, T = alpha.shape
    for i in prange(R):
        acc = carry[i] * 1.0
        for s in range(T):
            t = T - 1 - s if reverse else s
            acc = alpha[i, t] + beta[i, t] * acc
            out[i, t] = acc


_compiled: dict = {}


# below this, starting the thread pool costs more than it saves. Measured on the 2-core CPU
# machine once the parallel builds were really parallel (cached apart): 1.1-1.3x from 32k
# elements on, for SB3/CleanRL's and TorchRL's GAE calls, about even at 1k-16k
PARALLEL_MIN_ELEMENTS = 1 << 15


def _kernel(fn, arg_kinds, dtype: np.dtype, parallel: bool):
    """``fn`` compiled for arguments of ``arg_kinds`` (``signatures.KINDS``) in float ``dtype``."""
    key = (fn.__name__, dtype, parallel)
    if key not in _compiled:
        ft = nb.from_dtype(dtype)
        types = {
            "f1": nb.types.Array(ft, 1, "A", readonly=True), "f2": nb.types.Array(ft, 2, "A", readonly=True),
            "f3": nb.types.Array(ft, 3, "A", readonly=True),
            "u2": nb.types.Array(nb.types.uint8, 2, "A", readonly=True),
            "u1": nb.types.Array(nb.types.uint8, 1, "A", readonly=True), "o2": nb.types.Array(ft, 2, "A"),
            "s": nb.types.float64, "i": nb.types.int64, "b": nb.types.boolean,
        }
        sig = nb.types.void(*(types[k] for k in arg_kinds))
        _compiled[key] = nb.njit(sig, parallel=parallel, cache=True, nogil=True)(
            _renamed(fn, "_parallel") if parallel else fn)
    return _compiled[key]


def _renamed(fn, suffix: str):
    """``fn`` under another name. numba's on-disk cache keys a build by function name and
    signature, not by compile flags, so without this the serial and the parallel build of one
    kernel share an entry and whichever was compiled first is loaded for both."""
    copy = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + suffix, fn.__defaults__, fn.__closure__)
    copy.__qualname__ = fn.__qualname__ + suffix
    return copy


KERNELS = {
    "gae": _gae, "td_lambda": _td_lambda, "discounted": _discounted, "vtrace": _vtrace,
    "retrace": _retrace, "forward_trace": _forward_trace, "affine_scan": _affine_scan,
}
_KINDS = {name: kinds(name, outputs="o2") for name in KERNELS}
# time-major variant of the general GAE kernel (SB3's and CleanRL's call has its own,
# _gae_episode_starts_blocks); the other algorithms walk one row at a time
ROW_BLOCK_KERNELS = {"gae": _gae_row_blocks}
_EPISODE_STARTS_KINDS = "f2 f2 u2 f1 u1 s s o2 o2".split()


_NUMPY_DTYPES = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}


@functools.lru_cache(maxsize=64)
def _constant(value: float, np_dtype, shape: tuple):
    """A read-only stride-0 array standing for an absent or constant input."""
    return np.broadcast_to(np.array(value, dtype=np_dtype), shape)


if AVAILABLE:

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


def _dense(x: torch.Tensor):
    """The numpy view of a CPU tensor that numba reads (not float16/bfloat16) and whose memory is
    dense (C or F order, so ``ravel(order="K")`` is a view), else None."""
    if x.device.type != "cpu" or x.dtype in (torch.float16, torch.bfloat16):
        return None
    a = x.detach().numpy()
    return a if a.flags.c_contiguous or a.flags.f_contiguous else None


def _flag_bytes(x: torch.Tensor) -> np.ndarray:
    """A flag tensor as a 0/1 uint8 numpy array of its shape: bool and int8 viewed, others
    converted in one numba pass (5x the torch comparison on the CPU machine)."""
    if x.dtype == torch.bool or x.dtype == torch.int8:
        return x.numpy().view(np.uint8)
    if x.dtype == torch.uint8:
        return x.numpy()
    a = _dense(x)
    if a is None:
        return (x != 0).view(torch.uint8).numpy()
    out = np.empty_like(a, dtype=np.uint8)  # same memory order as a
    _nonzero_bytes(a.ravel(order="K"), out.ravel(order="K"))
    return out


def all_binary(x: torch.Tensor) -> bool:
    """True when every element of a flag tensor is 0 or 1 (one pass, no temporaries on CPU)."""
    a = _dense(x) if AVAILABLE else None
    if a is not None:
        return bool(_all_binary(a.ravel(order="K")))
    return bool(((x == 0) | (x == 1)).all())


def implies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``b`` is set (nonzero) wherever ``a`` is: one pass over two flag tensors of one
    shape and layout on CPU, the torch ops otherwise."""
    x = _dense(a) if AVAILABLE and a.shape == b.shape and a.stride() == b.stride() else None
    y = _dense(b) if x is not None else None
    if y is not None:
        x, y = (z.view(np.uint8) if z.dtype == np.bool_ else z for z in (x, y))
        return bool(_implies(x.ravel(order="K"), y.ravel(order="K")))
    return not bool(((a != 0) & (b == 0)).any())


def _adapt(kind: str, x, rows: int, steps: int, dtype: torch.dtype):
    """One kernel argument from the estimators' form (tensor, None or number) to numba's.

    Absent or constant arrays become stride-0 broadcasts, flags become uint8 0/1.
    """
    if isinstance(x, torch.Tensor):
        if x.requires_grad:  # the fused path runs with autograd off; numpy() refuses such tensors
            x = x.detach()
        if kind[0] == "u":
            return _flag_bytes(x)
        return (x if x.dtype == dtype else x.to(dtype)).numpy()
    if kind in ("s", "i", "b"):
        return x
    if kind[0] == "u":
        return _constant(0, np.uint8, (rows, steps)[: int(kind[1])])
    shape = {"f1": (rows,), "f2": (rows, steps), "f3": (rows, steps, 1)}[kind]
    return _constant(0.0 if x is None else float(x), _NUMPY_DTYPES[dtype], shape)


def _episode_starts_args(args, np_dtype):
    """GAE's arguments in ``_gae_episode_starts``'s form when the call is SB3's or CleanRL's,
    else None. Python-number coefficients are applied in the compute dtype, as everywhere."""
    r, v, nv, boot, term, starts, trunc, last, g, l, nv_mode, done_mode, adv, tgt = args
    if (nv_mode != NV_IMPLIED or done_mode != DONE_OBS_ALIGNED or boot is None or isinstance(g, torch.Tensor)
            or isinstance(l, torch.Tensor)):
        return None
    return r, v, starts, boot, last, float(np_dtype.type(g)), float(np_dtype.type(l)), adv, tgt


def run(name: str, dtype: torch.dtype, *args) -> None:
    """Run kernel ``name`` (arguments: ``signatures.KINDS``); floats are computed in ``dtype``."""
    ref = args[0]
    rows, steps = ref.shape[:2]
    np_dtype = _NUMPY_DTYPES[dtype]
    time_major = rows > 1 and ref.stride(0) < ref.stride(1)
    fn, arg_kinds = KERNELS[name], _KINDS[name]
    fast = _episode_starts_args(args, np_dtype) if name == "gae" else None
    if fast is not None:
        fn = _gae_episode_starts_blocks if time_major else _gae_episode_starts
        args, arg_kinds = fast, _EPISODE_STARTS_KINDS
    elif name in ROW_BLOCK_KERNELS and time_major and rows * steps >= ROW_BLOCK_MIN_ELEMENTS:
        fn = ROW_BLOCK_KERNELS[name]
    converted = [_adapt(k, a, rows, steps, dtype) for k, a in zip(arg_kinds, args)]
    parallel = rows > 1 and rows * steps >= PARALLEL_MIN_ELEMENTS
    _kernel(fn, arg_kinds, np_dtype, parallel)(*converted)
