"""Shared test helpers: layout adapters, tensor builders, tolerances and hypothesis strategies.

Nothing here imports rl_triton: cases are described by plain tensors plus an ``expected``
closure that feeds the float64 oracle (tests/oracle.py) with the values actually passed to
the library (so low-precision inputs are compared against the oracle on the rounded data).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from hypothesis import strategies as st

import oracle

# --------------------------------------------------------------------------------------
# profile scaling (see conftest.py)
# --------------------------------------------------------------------------------------

_PROFILE_SCALE = {"quick": 0.1, "ci": 1.0, "thorough": 10.0}


def n_examples(base: int) -> int:
    prof = os.environ.get("RL_TRITON_HYPOTHESIS_PROFILE", "ci")
    return max(5, int(base * _PROFILE_SCALE.get(prof, 1.0)))


# --------------------------------------------------------------------------------------
# layout adapters: caller layout  <->  oracle rows [R, T]
# --------------------------------------------------------------------------------------


def as_f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


def align_leading(x: np.ndarray, ndim: int) -> np.ndarray:
    """Append trailing singleton dims (a `done` aligned with x's leading dims)."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def to_rows(x, shape, td) -> np.ndarray:
    """Broadcast `x` (torch broadcasting rules) to `shape`, move time `td` last, -> [R, T]."""
    a = np.broadcast_to(as_f64(x), shape)
    T = shape[td]
    R = _prod(s for i, s in enumerate(shape) if i != td)
    return np.ascontiguousarray(np.moveaxis(a, td, -1)).reshape(R, T)


def to_rows_actions(x, shape, td) -> np.ndarray:
    """x of shape `shape + (A,)` (action dim last) -> [R, T, A]."""
    a = as_f64(x)
    A = a.shape[-1]
    a = np.broadcast_to(a, tuple(shape) + (A,))
    T = shape[td]
    R = _prod(s for i, s in enumerate(shape) if i != td)
    return np.ascontiguousarray(np.moveaxis(a, td, -2)).reshape(R, T, A)


def per_row(x, shape, td) -> np.ndarray:
    """A tensor of shape `shape` without the time dim (broadcastable) -> [R]."""
    rest = tuple(s for i, s in enumerate(shape) if i != td)
    return np.ascontiguousarray(np.broadcast_to(as_f64(x), rest)).reshape(-1)


def from_rows(y: np.ndarray, shape, td) -> np.ndarray:
    rest = tuple(s for i, s in enumerate(shape) if i != td)
    T = shape[td]
    return np.moveaxis(np.asarray(y).reshape(rest + (T,)), -1, td)


def coef_rows(value, shape, td) -> np.ndarray:
    """gamma / lmbda given as float, 0-d tensor or broadcastable tensor -> [R, T]."""
    if isinstance(value, torch.Tensor):
        return to_rows(value, shape, td)
    return to_rows(np.full((), float(value)), shape, td)


# --------------------------------------------------------------------------------------
# tolerances / comparison
# --------------------------------------------------------------------------------------

TOL = {
    # float64 is "exact": far tighter than float32 epsilon so a float32 accumulation is caught
    torch.float64: 1e-9,
    torch.float32: 1e-5,
    torch.bfloat16: 1.6e-2,
    torch.float16: 4e-3,
}


def assert_matches(got: torch.Tensor, expected: np.ndarray, dtype, what: str = "output",
                   scale_extra: float = 0.0):
    exp = np.asarray(expected, dtype=np.float64)
    g = as_f64(got)
    assert g.shape == exp.shape, f"{what}: shape {g.shape} != expected {exp.shape}"
    if exp.size == 0:
        return
    tol = TOL[dtype]
    scale = max(1.0, float(np.max(np.abs(exp))), scale_extra)
    err = np.abs(g - exp)
    bound = tol * scale + tol * np.abs(exp)
    bad = ~(err <= bound)  # also catches NaN
    if bad.any():
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        raise AssertionError(
            f"{what} mismatch ({int(bad.sum())}/{bad.size} elements, dtype {dtype}, tol {tol}): "
            f"first bad index {idx}: got {g[idx]!r}, expected {exp[idx]!r}; "
            f"max abs err {float(np.nanmax(err)) if np.isfinite(err).any() else err.max()!r}\n"
            f"got=\n{g}\nexpected=\n{exp}"
        )


def is_dense(t: torch.Tensor) -> bool:
    """non-overlapping and dense (a permutation of a contiguous layout)."""
    if t.numel() == 0:
        return False
    dims = [(t.stride(i), t.shape[i]) for i in range(t.dim()) if t.shape[i] != 1]
    dims.sort()
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def assert_layout(out: torch.Tensor, like: torch.Tensor, shape, dtype, what="output"):
    assert isinstance(out, torch.Tensor), f"{what} is not a tensor: {type(out)}"
    assert tuple(out.shape) == tuple(shape), f"{what}: shape {tuple(out.shape)} != {tuple(shape)}"
    assert out.dtype == dtype, f"{what}: dtype {out.dtype} != {dtype}"
    assert out.device == like.device, f"{what}: device {out.device} != {like.device}"
    if tuple(like.shape) == tuple(shape) and is_dense(like):
        for i in range(like.dim()):
            if like.shape[i] > 1:
                assert out.stride(i) == like.stride(i), (
                    f"{what}: strides {out.stride()} do not preserve the input layout "
                    f"{like.stride()} (shape {tuple(shape)})"
                )


# --------------------------------------------------------------------------------------
# a drawn case
# --------------------------------------------------------------------------------------


@dataclass
class Case:
    fn: str                                   # public function name in rl_triton
    args: tuple
    kwargs: dict
    expected: Callable[[], tuple]             # -> tuple of float64 arrays in caller layout
    like: torch.Tensor                        # tensor whose layout outputs follow
    shape: tuple
    dtype: torch.dtype
    n_out: int
    notes: dict = field(default_factory=dict)

    def call(self, mod, backend):
        return getattr(mod, self.fn)(*self.args, **self.kwargs, backend=backend)

    def __repr__(self):
        def d(v):
            if isinstance(v, torch.Tensor):
                return f"Tensor(shape={tuple(v.shape)}, stride={v.stride()}, dtype={v.dtype})"
            return repr(v)

        lines = [f"Case {self.fn}: shape={self.shape} dtype={self.dtype} notes={self.notes}"]
        for i, a in enumerate(self.args):
            lines.append(f"  arg{i} = {d(a)}")
            if isinstance(a, torch.Tensor) and a.numel() <= 200:
                lines.append(f"         {a.tolist()}")
        for k, v in self.kwargs.items():
            lines.append(f"  {k} = {d(v)}")
            if isinstance(v, torch.Tensor) and v.numel() <= 200:
                lines.append(f"         {v.tolist()}")
        return "\n".join(lines)


def check_case(case: Case, mod, backend):
    """Run a case on one backend and compare every output against the oracle."""
    snapshot = {k: v.clone() for k, v in case.kwargs.items() if isinstance(v, torch.Tensor)}
    snap_args = [a.clone() for a in case.args]
    out = case.call(mod, backend)
    outs = out if case.n_out > 1 else (out,)
    assert isinstance(outs, tuple) and len(outs) == case.n_out, \
        f"expected {case.n_out} outputs, got {type(out)}"
    exp = case.expected()
    for i, (o, e) in enumerate(zip(outs, exp)):
        assert_layout(o, case.like, case.shape, case.dtype, what=f"{case.fn} output {i}")
        assert_matches(o, e, case.dtype, what=f"{case.fn} output {i} [{backend}]")
    # inputs untouched
    for a, s in zip(case.args, snap_args):
        assert torch.equal(a, s), "an input tensor was modified"
    for k, s in snapshot.items():
        assert torch.equal(case.kwargs[k], s), f"input {k} was modified"


# --------------------------------------------------------------------------------------
# kwargs-driven reference: the api_decisions argument rules applied to an actual call
# --------------------------------------------------------------------------------------

_DEFAULTS = {
    "gae": dict(gamma=0.99, lmbda=0.95),
    "td_lambda_return": dict(gamma=0.99, lmbda=0.95),
    "discounted_return": dict(gamma=0.99),
    "vtrace": dict(gamma=0.99, lmbda=1.0, rho_bar=1.0, c_bar=1.0, rho_bar_pg=None),
    "retrace": dict(gamma=0.99, lmbda=1.0, c_bar=1.0),
    "eligibility_trace": dict(gamma=0.99, lmbda=1.0),
    "episodic_cumsum": dict(),
    "affine_scan": dict(reverse=True),
}


def reference(fn: str, args, kwargs) -> tuple:
    """Expected outputs (float64 numpy, caller layout) of ``rl_triton.<fn>(*args, **kwargs)``.

    Applies api_decisions 1-11 (flag conventions, next-value forms, defaults, broadcasting,
    time_dim) and calls the oracle."""
    kw = dict(_DEFAULTS[fn])
    kw.update(kwargs)
    if fn == "affine_scan":
        shape = tuple(torch.broadcast_shapes(args[0].shape, args[1].shape))
    else:
        shape = tuple(args[0].shape)
    nd = len(shape)
    td = kw.get("time_dim", -1)
    td = td + nd if td < 0 else td
    T = shape[td] if nd else 0
    rows = lambda x: to_rows(x, shape, td)  # noqa: E731

    def flag(x):
        if x is None:
            return None
        a = as_f64(x) != 0
        if fn in ("eligibility_trace", "episodic_cumsum"):
            a = align_leading(a, nd)
        return rows(a) != 0

    done, term, trunc = flag(kw.get("done")), flag(kw.get("terminated")), flag(kw.get("truncated"))
    zeros = rows(np.zeros(())) != 0
    if done is None:
        done = zeros
        for f in (term, trunc):
            if f is not None:
                done = done | f
    term_eff = term if term is not None else (flag(kw.get("done")) if kw.get("done") is not None
                                              else zeros)
    g = coef_rows(kw["gamma"], shape, td) if "gamma" in kw else None
    lam = coef_rows(kw["lmbda"], shape, td) if "lmbda" in kw else None
    boot = kw.get("bootstrap_value")
    boot_rows = None if boot is None else per_row(boot, shape, td)
    out = lambda *ys: tuple(from_rows(y, shape, td) for y in ys)  # noqa: E731

    def next_values(values_rows):
        if kw.get("next_values") is not None:
            return rows(kw["next_values"])
        return oracle.implied_next_values(values_rows, boot_rows)

    if fn == "gae":
        v = rows(args[1])
        return out(*oracle.gae(rows(args[0]), v, next_values(v), term_eff, done, g, lam))
    if fn == "td_lambda_return":
        return out(oracle.td_lambda_return(rows(args[0]), rows(args[1]), term_eff, done, g, lam))
    if fn == "discounted_return":
        nv = None if kw.get("next_values") is None else rows(kw["next_values"])
        if boot_rows is not None:
            carry = boot_rows
        elif nv is not None and T > 0:
            carry = nv[:, -1]
        else:
            carry = None
        return out(oracle.discounted_return(rows(args[0]), term_eff, done, g, next_values=nv,
                                            carry=carry))
    if fn == "vtrace":
        v = rows(args[1])
        rho_bar = float(kw["rho_bar"])
        pg = rho_bar if kw["rho_bar_pg"] is None else float(kw["rho_bar_pg"])
        return out(*oracle.vtrace(rows(args[0]), v, next_values(v), rows(args[2]), rows(args[3]),
                                  term_eff, done, g, lam, rho_bar, float(kw["c_bar"]), pg))
    if fn == "retrace":
        extra = {}
        if kw.get("next_expected_q") is not None:
            extra["next_expected_q"] = rows(kw["next_expected_q"])
        else:
            extra["next_pi"] = to_rows_actions(kw["next_pi"], shape, td)
            extra["next_q"] = to_rows_actions(kw["next_q"], shape, td)
        return out(oracle.retrace(rows(args[0]), rows(args[1]), rows(args[2]), rows(args[3]),
                                  term_eff, done, g, lam, float(kw["c_bar"]), **extra))
    init = kw.get("initial")
    init_rows = None if init is None else per_row(init, shape, td)
    if fn == "eligibility_trace":
        return out(oracle.eligibility_trace(rows(args[0]), done, g, lam, init_rows))
    if fn == "episodic_cumsum":
        return out(oracle.episodic_cumsum(rows(args[0]), done, init_rows))
    if fn == "affine_scan":
        return out(oracle.affine_scan(rows(args[0]), rows(args[1]), reverse=kw["reverse"],
                                      initial=init_rows))
    raise KeyError(fn)


def expected_for(case) -> Callable[[], tuple]:
    return lambda: reference(case.fn, case.args, case.kwargs)


# --------------------------------------------------------------------------------------
# building tensors with various memory layouts
# --------------------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float64, torch.float64, torch.float32, torch.float32, torch.bfloat16,
                torch.float16]
# "float" = the data's float dtype; "float32" regardless of the data's dtype (api 1: flags of
# any dtype are read as-is, true where nonzero)
FLAG_KINDS = ["bool", "bool", "uint8", "int64", "int32", "float", "float32"]


@st.composite
def layout_variant(draw, ndim):
    kind = draw(st.sampled_from(["contiguous", "contiguous", "reversed", "reversed", "permuted",
                                 "sliced", "offset"]))
    if kind == "reversed" and ndim >= 2:  # e.g. [N, T] seen through .t() of a [T, N] buffer
        return ("permuted", tuple(reversed(range(ndim))))
    if kind == "permuted" and ndim >= 2:
        perm = draw(st.permutations(list(range(ndim))))
        return ("permuted", tuple(perm))
    if kind == "sliced" and ndim >= 1:
        return ("sliced", draw(st.integers(0, ndim - 1)))
    if kind == "offset":
        return ("offset", None)
    return ("contiguous", None)


def make_tensor(arr: np.ndarray, dtype: torch.dtype, variant=("contiguous", None)) -> torch.Tensor:
    """A tensor holding `arr` (cast to `dtype`) with the requested memory layout."""
    arr = np.asarray(arr)
    kind, p = variant
    base = torch.from_numpy(np.array(arr, dtype=arr.dtype, order="C", copy=True))
    if kind == "permuted" and arr.ndim >= 2:
        # build in the permuted order, contiguous, then view back: e.g. [T, N] built, .t() view
        perm = list(p)
        inv = [perm.index(i) for i in range(len(perm))]
        t = base.permute(*perm).contiguous().to(dtype)
        return t.permute(*inv)
    if kind == "sliced" and arr.ndim >= 1:
        d = p
        shape = list(arr.shape)
        shape[d] = 2 * shape[d]
        big = torch.full(shape, float("nan") if dtype.is_floating_point else 7, dtype=torch.float64)
        idx = [slice(None)] * arr.ndim
        idx[d] = slice(None, None, 2)
        big = big.to(dtype)
        big[tuple(idx)] = base.to(dtype)
        return big[tuple(idx)]
    if kind == "offset":
        flat = torch.empty(arr.size + 3, dtype=dtype)
        if dtype.is_floating_point:
            flat.fill_(float("nan"))
        t = flat[3:].view(arr.shape)
        t.copy_(base.to(dtype))
        return t
    return base.to(dtype).contiguous()


def make_flag_with_layout(mask, kind, float_dtype, variant):
    """Like make_flag but preserving the layout variant for non-float dtypes too."""
    dt = {
        "bool": torch.bool,
        "uint8": torch.uint8,
        "int64": torch.int64,
        "int32": torch.int32,
        "float": float_dtype,
        "float32": torch.float32,
    }[kind]
    arr = np.asarray(mask).astype(np.float64)
    vkind, p = variant
    base = torch.from_numpy(np.array(arr, dtype=arr.dtype, order="C", copy=True)).to(dt)
    if vkind == "permuted" and arr.ndim >= 2:
        perm = list(p)
        inv = [perm.index(i) for i in range(len(perm))]
        return base.permute(*perm).contiguous().permute(*inv)
    if vkind == "sliced" and arr.ndim >= 1:
        shape = list(arr.shape)
        shape[p] = 2 * shape[p]
        big = torch.ones(shape, dtype=dt)
        idx = [slice(None)] * arr.ndim
        idx[p] = slice(None, None, 2)
        big[tuple(idx)] = base
        return big[tuple(idx)]
    if vkind == "offset":
        flat = torch.ones(arr.size + 5, dtype=dt)
        t = flat[5:].view(arr.shape)
        t.copy_(base)
        return t
    return base.contiguous()


# --------------------------------------------------------------------------------------
# strategies: shapes / layouts
# --------------------------------------------------------------------------------------


@dataclass
class Layout:
    shape: tuple
    td: int          # normalized (non-negative) time dim
    time_dim: int    # as passed to the library (may be negative)
    kind: str
    pass_time_dim: bool

    @property
    def T(self):
        return self.shape[self.td]

    @property
    def rest(self):
        return tuple(s for i, s in enumerate(self.shape) if i != self.td)

    def kw(self):
        return {"time_dim": self.time_dim} if self.pass_time_dim else {}


T_STRAT = st.one_of(st.integers(2, 40), st.integers(2, 40), st.integers(2, 12), st.just(1),
                    st.sampled_from([0, 1, 2, 3, 5, 17, 32, 33, 40]))
BATCH_SIZE = st.one_of(st.integers(1, 3), st.integers(2, 4), st.sampled_from([0, 1, 4, 5, 2, 3]))


@st.composite
def layouts(draw, features: bool = False, max_T=None):
    nb = draw(st.integers(0, 2))
    B = [draw(BATCH_SIZE) for _ in range(nb)]
    T = draw(T_STRAT)
    if max_T is not None:
        T = min(T, max_T)
    kinds = ["batch_major", "batch_major", "time_major", "torchrl"]
    if nb == 2:
        kinds.append("middle")
    kind = draw(st.sampled_from(kinds))
    if kind == "batch_major":
        shape, td = B + [T], nb
    elif kind == "time_major":
        shape, td = [T] + B, 0
    elif kind == "torchrl":
        shape, td = B + [T, 1], nb
    else:  # middle
        shape, td = [B[0], T, B[1]], 1
    if features:
        nf = draw(st.integers(0, 2))
        F = [draw(st.integers(1, 3)) for _ in range(nf)]
        shape = shape + F
    shape = tuple(shape)
    ndim = len(shape)
    negative = draw(st.booleans())
    time_dim = td - ndim if negative else td
    # the default time_dim=-1 may be left out
    pass_td = True
    if time_dim == -1 or (td == ndim - 1 and not negative):
        pass_td = draw(st.booleans())
        if not pass_td:
            time_dim = -1
    return Layout(shape, td, time_dim, kind, pass_td)


def _strip_leading_ones(shape, n):
    shape = list(shape)
    while n > 0 and shape and shape[0] == 1:
        shape.pop(0)
        n -= 1
    return tuple(shape)


@st.composite
def coefficient(draw, layout: Layout, dtype, rng, name="gamma", lo=0.0, hi=1.0,
                allow_default=False, feature_from=None):
    """gamma/lmbda as python float, 0-d tensor, per-row tensor or per-step tensor.

    Returns (value or None for "not passed", form string)."""
    forms = ["float", "float", "zero_dim", "per_row", "per_step"]
    if allow_default:
        forms.append("default")
    form = draw(st.sampled_from(forms))
    # api 9: gamma/lmbda tensors may be any float dtype (independent of the data's dtype)
    tdtype = draw(st.sampled_from([torch.float32, torch.float64, dtype, dtype, torch.bfloat16,
                                   torch.float16]))
    if form == "default":
        return None, form
    if form == "float":
        v = draw(st.one_of(st.sampled_from([lo, hi, 0.5, 0.9, 0.99]), st.floats(lo, hi)))
        return float(v), form
    if form == "zero_dim":
        v = draw(st.one_of(st.sampled_from([lo, hi, 0.95]), st.floats(lo, hi)))
        return torch.tensor(float(v), dtype=tdtype), form
    shape = list(layout.shape)
    if form == "per_row":
        shape[layout.td] = 1
    if feature_from is not None:  # dims after feature_from (eligibility features) maybe 1
        for i in range(feature_from, len(shape)):
            if draw(st.booleans()):
                shape[i] = 1
    vals = rng.uniform(lo, hi, size=shape)
    # exact endpoints sometimes
    if vals.size and draw(st.booleans()):
        m = rng.random(size=shape)
        vals = np.where(m < 0.15, lo, np.where(m > 0.85, hi, vals))
    n_strip = draw(st.integers(0, len(shape)))
    new_shape = _strip_leading_ones(shape, n_strip)
    vals = vals.reshape(new_shape)
    t = torch.from_numpy(vals).to(tdtype)
    if len(new_shape) >= 2 and draw(st.booleans()):
        t = make_tensor(vals, tdtype, ("permuted", tuple(reversed(range(len(new_shape))))))
    return t, form


# --------------------------------------------------------------------------------------
# strategies: flags
# --------------------------------------------------------------------------------------


def draw_done_term(draw, rng, shape, td):
    """(done, term) boolean numpy masks of `shape` with term a subset of done."""
    T = shape[td]
    pattern = draw(st.sampled_from(["random", "edges", "random", "sparse", "all", "zeros"]))
    if pattern == "zeros":
        done = np.zeros(shape, bool)
    elif pattern == "all":
        done = np.ones(shape, bool)
    elif pattern == "random":
        p = draw(st.sampled_from([0.1, 0.3, 0.6]))
        done = rng.random(shape) < p
    elif pattern == "sparse":
        done = rng.random(shape) < 0.05
    else:  # edges: done at t=0 and t=T-1, plus a few random
        done = rng.random(shape) < 0.2
        if T > 0:
            idx0 = [slice(None)] * len(shape)
            idx0[td] = 0
            done[tuple(idx0)] = True
            idx1 = [slice(None)] * len(shape)
            idx1[td] = T - 1
            done[tuple(idx1)] = True
    mix = draw(st.sampled_from(["mixed", "no_term", "mixed", "all_term", "mixed"]))
    if mix == "all_term":
        term = done.copy()
    elif mix == "no_term":
        term = np.zeros(shape, bool)
    else:
        term = done & (rng.random(shape) < 0.5)
    return done, term, f"{pattern}/{mix}"


@st.composite
def flags(draw, layout: Layout, dtype, rng, allow_truncation=True, styles=None):
    """Draw flag kwargs.  Returns (kwargs, done_mask, term_mask, description)."""
    shape = layout.shape
    done, term, desc = draw_done_term(draw, rng, shape, layout.td)
    if styles is None:
        # hypothesis favours the first entries: the interesting styles come first
        styles = ["gym_term_only", "done_only", "none"]
        if allow_truncation:
            styles = ["torchrl", "gym", "gym_overlap", "torchrl", "gym"] + styles
    style = draw(st.sampled_from(styles))
    kinds = {}

    def mk(mask, name):
        kind = draw(st.sampled_from(FLAG_KINDS))
        kinds[name] = kind
        var = draw(layout_variant(len(shape)))
        return make_flag_with_layout(mask, kind, dtype, var)

    kw: dict[str, Any] = {}
    if style == "none":
        done = np.zeros(shape, bool)
        term = np.zeros(shape, bool)
    elif style == "gym_term_only":
        done = term.copy() if draw(st.booleans()) else done.copy()
        term = done
        kw["terminated"] = mk(term, "terminated")
    elif style == "done_only":
        term = done
        kw["done"] = mk(done, "done")
    elif style == "gym":
        kw["terminated"] = mk(term, "terminated")
        kw["truncated"] = mk(done & ~term, "truncated")
    elif style == "gym_overlap":
        # truncated may also be set where terminated is set: terminated wins (no bootstrap)
        trunc = (done & ~term) | (term & (rng.random(shape) < 0.5))
        kw["terminated"] = mk(term, "terminated")
        kw["truncated"] = mk(trunc, "truncated")
    elif style == "torchrl":
        kw["done"] = mk(done, "done")
        kw["terminated"] = mk(term, "terminated")
    if draw(st.booleans()):  # keyword order does not matter, but shuffle anyway
        kw = dict(reversed(list(kw.items())))
    return kw, done, term, f"{style}:{desc}:{kinds}"


# --------------------------------------------------------------------------------------
# algorithm case strategies
# --------------------------------------------------------------------------------------


def _rng(draw):
    return np.random.default_rng(draw(st.integers(0, 2**32 - 1)))


def _data(draw, rng, shape, dtype, low=-2.0, high=2.0):
    arr = rng.uniform(low, high, size=shape)
    var = draw(layout_variant(len(shape)))
    return make_tensor(arr, dtype, var)


@st.composite
def bootstrap_value(draw, layout: Layout, dtype, rng):
    rest = list(layout.rest)
    form = draw(st.sampled_from(["full", "full", "zero_dim", "broadcast"]))
    if form == "zero_dim":
        shape = []
    elif form == "broadcast":
        shape = [1 if draw(st.booleans()) else s for s in rest]
    else:
        shape = rest
    arr = rng.uniform(-2, 2, size=shape)
    return make_tensor(arr, dtype, draw(layout_variant(len(shape))))


def _next_value_form(draw, lay, dtype, rng, kw):
    """Explicit next_values, or the implied form with an optional bootstrap_value; fills ``kw``."""
    explicit = draw(st.booleans())
    nv_t = bv = None
    if explicit:
        nv_t = _data(draw, rng, lay.shape, dtype)
        kw["next_values"] = nv_t
    elif draw(st.booleans()):
        bv = draw(bootstrap_value(lay, dtype, rng))
        kw["bootstrap_value"] = bv
    return explicit, nv_t, bv


def _next_value_rows(explicit, nv_t, bv, values_rows, S, td):
    if explicit:
        return to_rows(nv_t, S, td)
    return oracle.implied_next_values(values_rows, None if bv is None else per_row(bv, S, td))


def _gamma_lmbda(draw, lay, dtype, rng, kw, **coef_kw):
    """gamma and lmbda in any accepted form, or left to their defaults; fills ``kw``."""
    gamma, gform = draw(coefficient(lay, dtype, rng, allow_default=True, **coef_kw))
    lmbda, lform = draw(coefficient(lay, dtype, rng, allow_default=True, **coef_kw))
    if gamma is not None:
        kw["gamma"] = gamma
    if lmbda is not None:
        kw["lmbda"] = lmbda
    return gamma, gform, lmbda, lform


@st.composite
def gae_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    S, td = lay.shape, lay.td
    r = _data(draw, rng, S, dtype)
    v = _data(draw, rng, S, dtype)
    kw: dict[str, Any] = {}
    explicit, nv_t, bv = _next_value_form(draw, lay, dtype, rng, kw)
    fkw, done, term, fdesc = draw(flags(lay, dtype, rng, allow_truncation=explicit))
    kw.update(fkw)
    gamma, gform, lmbda, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    kw.update(lay.kw())

    def expected():
        rr, vv = to_rows(r, S, td), to_rows(v, S, td)
        nv = _next_value_rows(explicit, nv_t, bv, vv, S, td)
        g = coef_rows(0.99 if gamma is None else gamma, S, td)
        lam = coef_rows(0.95 if lmbda is None else lmbda, S, td)
        adv, tgt = oracle.gae(rr, vv, nv, to_rows(term, S, td), to_rows(done, S, td), g, lam)
        return from_rows(adv, S, td), from_rows(tgt, S, td)

    return Case("gae", (r, v), kw, expected, r, S, dtype, 2,
                dict(layout=lay.kind, explicit=explicit, flags=fdesc, gamma=gform, lmbda=lform))


@st.composite
def td_lambda_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    S, td = lay.shape, lay.td
    r = _data(draw, rng, S, dtype)
    nv_t = _data(draw, rng, S, dtype)
    kw: dict[str, Any] = {}
    fkw, done, term, fdesc = draw(flags(lay, dtype, rng, allow_truncation=True))
    kw.update(fkw)
    gamma, gform, lmbda, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    kw.update(lay.kw())

    def expected():
        g = coef_rows(0.99 if gamma is None else gamma, S, td)
        lam = coef_rows(0.95 if lmbda is None else lmbda, S, td)
        G = oracle.td_lambda_return(to_rows(r, S, td), to_rows(nv_t, S, td), to_rows(term, S, td),
                                    to_rows(done, S, td), g, lam)
        return (from_rows(G, S, td),)

    return Case("td_lambda_return", (r, nv_t), kw, expected, r, S, dtype, 1,
                dict(layout=lay.kind, flags=fdesc, gamma=gform, lmbda=lform))


@st.composite
def discounted_return_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    S, td = lay.shape, lay.td
    r = _data(draw, rng, S, dtype)
    kw: dict[str, Any] = {}
    mode = draw(st.sampled_from(["mc", "bootstrap", "next_values"]))
    nv_t = bv = None
    if mode == "next_values":
        nv_t = _data(draw, rng, S, dtype)
        kw["next_values"] = nv_t
    elif mode == "bootstrap":
        bv = draw(bootstrap_value(lay, dtype, rng))
        kw["bootstrap_value"] = bv
    fkw, done, term, fdesc = draw(flags(lay, dtype, rng, allow_truncation=(mode == "next_values")))
    kw.update(fkw)
    gamma, gform = draw(coefficient(lay, dtype, rng, allow_default=True))
    if gamma is not None:
        kw["gamma"] = gamma
    kw.update(lay.kw())

    def expected():
        g = coef_rows(0.99 if gamma is None else gamma, S, td)
        nv = None if nv_t is None else to_rows(nv_t, S, td)
        if bv is not None:
            carry = per_row(bv, S, td)
        elif nv is not None:
            carry = nv[:, -1] if nv.shape[1] else None
        else:
            carry = None
        out = oracle.discounted_return(to_rows(r, S, td), to_rows(term, S, td),
                                       to_rows(done, S, td), g, next_values=nv, carry=carry)
        return (from_rows(out, S, td),)

    return Case("discounted_return", (r,), kw, expected, r, S, dtype, 1,
                dict(layout=lay.kind, mode=mode, flags=fdesc, gamma=gform))


CLIP = st.one_of(st.sampled_from([1.0, 1.0, 0.5, 2.0, math.inf]), st.floats(0.05, 3.0))


@st.composite
def _off_policy_inputs(draw, dtypes, spreads):
    """dtype, layout, rng, rewards, values (or q), log_pi, log_mu; log_pi - log_mu ~ N(0, spread)."""
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    S = lay.shape
    r = _data(draw, rng, S, dtype)
    v = _data(draw, rng, S, dtype)
    lm_arr = rng.normal(0.0, 1.0, size=S)
    lp_arr = lm_arr + rng.normal(0.0, 1.0, size=S) * draw(st.sampled_from(spreads))
    log_mu = make_tensor(lm_arr, dtype, draw(layout_variant(len(S))))
    log_pi = make_tensor(lp_arr, dtype, draw(layout_variant(len(S))))
    return dtype, lay, rng, r, v, log_pi, log_mu


@st.composite
def vtrace_cases(draw, dtypes=None):
    dtype, lay, rng, r, v, log_pi, log_mu = draw(_off_policy_inputs(dtypes, [0.0, 0.3, 1.0]))
    S, td = lay.shape, lay.td
    kw: dict[str, Any] = {}
    explicit, nv_t, bv = _next_value_form(draw, lay, dtype, rng, kw)
    fkw, done, term, fdesc = draw(flags(lay, dtype, rng, allow_truncation=explicit))
    kw.update(fkw)
    gamma, gform, lmbda, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    clips = {}
    for name in ("rho_bar", "c_bar", "rho_bar_pg"):
        if draw(st.booleans()):
            clips[name] = float(draw(CLIP))
            kw[name] = clips[name]
    kw.update(lay.kw())

    def expected():
        rr, vv = to_rows(r, S, td), to_rows(v, S, td)
        nv = _next_value_rows(explicit, nv_t, bv, vv, S, td)
        g = coef_rows(0.99 if gamma is None else gamma, S, td)
        lam = coef_rows(1.0 if lmbda is None else lmbda, S, td)
        rho_bar = clips.get("rho_bar", 1.0)
        c_bar = clips.get("c_bar", 1.0)
        rho_bar_pg = clips.get("rho_bar_pg", rho_bar)
        vs, pg = oracle.vtrace(rr, vv, nv, to_rows(log_pi, S, td), to_rows(log_mu, S, td),
                               to_rows(term, S, td), to_rows(done, S, td), g, lam,
                               rho_bar, c_bar, rho_bar_pg)
        return from_rows(vs, S, td), from_rows(pg, S, td)

    return Case("vtrace", (r, v, log_pi, log_mu), kw, expected, r, S, dtype, 2,
                dict(layout=lay.kind, explicit=explicit, flags=fdesc, gamma=gform, lmbda=lform,
                     clips=clips))


@st.composite
def retrace_cases(draw, dtypes=None):
    dtype, lay, rng, r, q, log_pi, log_mu = draw(_off_policy_inputs(dtypes, [0.0, 0.5, 1.5]))
    S, td = lay.shape, lay.td
    kw: dict[str, Any] = {}
    form = draw(st.sampled_from(["expected", "full"]))
    ev_t = pi_t = nq_t = None
    if form == "expected":
        ev_t = _data(draw, rng, S, dtype)
        kw["next_expected_q"] = ev_t
    else:
        A = draw(st.integers(1, 4))
        logits = rng.normal(size=tuple(S) + (A,))
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        pi_t = make_tensor(probs, dtype, draw(layout_variant(len(S) + 1)))
        nq_t = make_tensor(rng.uniform(-2, 2, size=tuple(S) + (A,)), dtype,
                           draw(layout_variant(len(S) + 1)))
        kw["next_pi"] = pi_t
        kw["next_q"] = nq_t
    fkw, done, term, fdesc = draw(flags(lay, dtype, rng, allow_truncation=True))
    kw.update(fkw)
    gamma, gform, lmbda, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    c_bar = None
    if draw(st.booleans()):
        c_bar = float(draw(CLIP))
        kw["c_bar"] = c_bar
    kw.update(lay.kw())

    def expected():
        g = coef_rows(0.99 if gamma is None else gamma, S, td)
        lam = coef_rows(1.0 if lmbda is None else lmbda, S, td)
        extra = {}
        if ev_t is not None:
            extra["next_expected_q"] = to_rows(ev_t, S, td)
        else:
            extra["next_pi"] = to_rows_actions(pi_t, S, td)
            extra["next_q"] = to_rows_actions(nq_t, S, td)
        out = oracle.retrace(to_rows(r, S, td), to_rows(q, S, td), to_rows(log_pi, S, td),
                             to_rows(log_mu, S, td), to_rows(term, S, td), to_rows(done, S, td),
                             g, lam, 1.0 if c_bar is None else c_bar, **extra)
        return (from_rows(out, S, td),)

    return Case("retrace", (r, q, log_pi, log_mu), kw, expected, r, S, dtype, 1,
                dict(layout=lay.kind, form=form, flags=fdesc, gamma=gform, lmbda=lform,
                     c_bar=c_bar))


@st.composite
def _trace_common(draw, dtypes):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts(features=True))
    rng = _rng(draw)
    S, td = lay.shape, lay.td
    x = _data(draw, rng, S, dtype)
    kw: dict[str, Any] = {}
    done_mask = None
    done_desc = "none"
    if draw(st.integers(0, 3)) > 0:
        # done covers x's leading dims up to at least the time dim
        k = draw(st.integers(td + 1, len(S)))
        dshape = S[:k]
        done_arr, _, done_desc = draw_done_term(draw, rng, dshape, td)
        kind = draw(st.sampled_from(FLAG_KINDS))
        kw["done"] = make_flag_with_layout(done_arr, kind, dtype, draw(layout_variant(len(dshape))))
        done_mask = align_leading(done_arr, len(S))
        done_desc = f"{done_desc}:{kind}:{dshape}"
    init = None
    if draw(st.booleans()):
        init = draw(bootstrap_value(lay, dtype, rng))
        kw["initial"] = init
    return dtype, lay, rng, x, kw, done_mask, init, done_desc


@st.composite
def eligibility_cases(draw, dtypes=None):
    dtype, lay, rng, x, kw, done_mask, init, ddesc = draw(_trace_common(dtypes))
    S, td = lay.shape, lay.td
    feat_from = td + 1
    gamma, gform, lmbda, lform = _gamma_lmbda(draw, lay, dtype, rng, kw, feature_from=feat_from)
    kw.update(lay.kw())

    def expected():
        g = coef_rows(0.99 if gamma is None else gamma, S, td)
        lam = coef_rows(1.0 if lmbda is None else lmbda, S, td)
        dn = np.zeros(S) if done_mask is None else done_mask
        out = oracle.eligibility_trace(to_rows(x, S, td), to_rows(dn, S, td), g, lam,
                                       None if init is None else per_row(init, S, td))
        return (from_rows(out, S, td),)

    return Case("eligibility_trace", (x,), kw, expected, x, S, dtype, 1,
                dict(layout=lay.kind, done=ddesc, gamma=gform, lmbda=lform,
                     initial=init is not None))


@st.composite
def cumsum_cases(draw, dtypes=None):
    dtype, lay, rng, x, kw, done_mask, init, ddesc = draw(_trace_common(dtypes))
    S, td = lay.shape, lay.td
    kw.update(lay.kw())

    def expected():
        dn = np.zeros(S) if done_mask is None else done_mask
        out = oracle.episodic_cumsum(to_rows(x, S, td), to_rows(dn, S, td),
                                     None if init is None else per_row(init, S, td))
        return (from_rows(out, S, td),)

    return Case("episodic_cumsum", (x,), kw, expected, x, S, dtype, 1,
                dict(layout=lay.kind, done=ddesc, initial=init is not None))


@st.composite
def affine_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    S, td = lay.shape, lay.td
    alpha = _data(draw, rng, S, dtype)
    bform = draw(st.sampled_from(["full", "full", "per_row", "scalar_shape", "wide"]))
    if bform == "full":
        bshape = S
    elif bform == "per_row":
        bshape = tuple(1 if i == td else s for i, s in enumerate(S))
    elif bform == "scalar_shape":
        bshape = (1,)
    else:  # wide: |beta| up to 1.5 (not a contraction; short rows keep it bounded)
        bshape = S
    lo, hi = (-1.5, 1.5) if bform == "wide" and S[td] <= 12 else (-1.0, 1.0)
    barr = rng.uniform(lo, hi, size=bshape)
    if barr.size and draw(st.booleans()):
        barr = np.where(rng.random(bshape) < 0.2, 0.0, barr)
    beta = make_tensor(barr, dtype, draw(layout_variant(len(bshape))))
    if bform == "per_row" and draw(st.booleans()):
        # alpha per-row, beta full: output shape is beta's
        alpha = make_tensor(rng.uniform(-2, 2, size=bshape), dtype, ("contiguous", None))
        beta = _data(draw, rng, S, dtype)
        like = alpha  # layout follows alpha; a broadcast alpha leaves the layout unspecified
    else:
        like = alpha
    reverse = draw(st.sampled_from([True, False, None]))
    kw: dict[str, Any] = {}
    if reverse is not None:
        kw["reverse"] = reverse
    init = None
    if draw(st.booleans()):
        init = draw(bootstrap_value(lay, dtype, rng))
        kw["initial"] = init
    kw.update(lay.kw())

    def expected():
        y = oracle.affine_scan(to_rows(alpha, S, td), to_rows(beta, S, td),
                               reverse=True if reverse is None else reverse,
                               initial=None if init is None else per_row(init, S, td))
        return (from_rows(y, S, td),)

    return Case("affine_scan", (alpha, beta), kw, expected, like, S, dtype, 1,
                dict(layout=lay.kind, beta=bform, reverse=reverse, initial=init is not None))


ALL_CASES = {
    "gae": gae_cases,
    "td_lambda_return": td_lambda_cases,
    "discounted_return": discounted_return_cases,
    "vtrace": vtrace_cases,
    "retrace": retrace_cases,
    "eligibility_trace": eligibility_cases,
    "episodic_cumsum": cumsum_cases,
    "affine_scan": affine_cases,
}
