"""Test helpers: hypothesis strategies for layouts, flags, coefficients and whole calls,
tensor builders for memory layouts, tolerances and assertions.

Every case strategy draws a ``rl_triton.testing.Problem`` (a public function's name, tensors
and keywords); its expected outputs come from the catalog's one kwargs-driven reference, which
feeds the float64 oracle with the values actually passed to the library (so low-precision
inputs are compared against the oracle on the rounded data).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

from rl_triton.testing.catalog import Problem, as_f64

# --------------------------------------------------------------------------------------
# profile scaling (see conftest.py)
# --------------------------------------------------------------------------------------

_PROFILE_SCALE = {"quick": 0.1, "ci": 1.0, "thorough": 10.0}


def n_examples(base: int) -> int:
    prof = os.environ.get("RL_TRITON_HYPOTHESIS_PROFILE", "ci")
    return max(5, int(base * _PROFILE_SCALE.get(prof, 1.0)))


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
# checking a drawn problem
# --------------------------------------------------------------------------------------


def check_case(case: Problem, backend):
    """Run a problem on one backend and compare every output against the oracle."""
    snapshot = {k: v.clone() for k, v in case.kwargs.items() if isinstance(v, torch.Tensor)}
    snap_args = [a.clone() for a in case.args]
    outs = case.call(backend)
    assert len(outs) == case.n_out, f"expected {case.n_out} outputs, got {len(outs)}"
    for i, (o, e) in enumerate(zip(outs, case.expected())):
        assert_layout(o, case.args[0], case.shape, case.dtype, what=f"{case.fn} output {i}")
        assert_matches(o, e, case.dtype, what=f"{case.fn} output {i} [{backend}]")
    # inputs untouched
    for a, s in zip(case.args, snap_args):
        assert torch.equal(a, s), "an input tensor was modified"
    for k, s in snapshot.items():
        assert torch.equal(case.kwargs[k], s), f"input {k} was modified"


# --------------------------------------------------------------------------------------
# building tensors with various memory layouts
# --------------------------------------------------------------------------------------

FLOAT_DTYPES = [torch.float64, torch.float64, torch.float32, torch.float32, torch.bfloat16,
                torch.float16]
# "float" = the data's float dtype; "float32" regardless of the data's dtype (flags of any
# dtype are read as they are, true where nonzero: docs/semantics.md section 1)
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
    # gamma/lmbda tensors may have any float dtype, whatever the data's (docs/semantics.md
    # section 1)
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
    """Draw flag kwargs.  Returns (kwargs, description)."""
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
    if style == "gym_term_only":
        kw["terminated"] = mk(term if draw(st.booleans()) else done, "terminated")
    elif style == "done_only":
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
    return kw, f"{style}:{desc}:{kinds}"


# --------------------------------------------------------------------------------------
# algorithm case strategies: each draws a Problem
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
    """Explicit next_values, or the implied form with an optional bootstrap_value; fills ``kw``.
    Returns whether the form is explicit."""
    explicit = draw(st.booleans())
    if explicit:
        kw["next_values"] = _data(draw, rng, lay.shape, dtype)
    elif draw(st.booleans()):
        kw["bootstrap_value"] = draw(bootstrap_value(lay, dtype, rng))
    return explicit


def _gamma_lmbda(draw, lay, dtype, rng, kw, **coef_kw):
    """gamma and lmbda in any accepted form, or left to their defaults; fills ``kw``.
    Returns their forms."""
    gamma, gform = draw(coefficient(lay, dtype, rng, allow_default=True, **coef_kw))
    lmbda, lform = draw(coefficient(lay, dtype, rng, allow_default=True, **coef_kw))
    if gamma is not None:
        kw["gamma"] = gamma
    if lmbda is not None:
        kw["lmbda"] = lmbda
    return gform, lform


@st.composite
def gae_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    r = _data(draw, rng, lay.shape, dtype)
    v = _data(draw, rng, lay.shape, dtype)
    kw: dict[str, Any] = {}
    explicit = _next_value_form(draw, lay, dtype, rng, kw)
    fkw, fdesc = draw(flags(lay, dtype, rng, allow_truncation=explicit))
    kw.update(fkw)
    gform, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    kw.update(lay.kw())
    return Problem("gae", (r, v), kw,
                   dict(layout=lay.kind, explicit=explicit, flags=fdesc, gamma=gform, lmbda=lform))


@st.composite
def td_lambda_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    r = _data(draw, rng, lay.shape, dtype)
    nv = _data(draw, rng, lay.shape, dtype)
    kw: dict[str, Any] = {}
    fkw, fdesc = draw(flags(lay, dtype, rng, allow_truncation=True))
    kw.update(fkw)
    gform, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    kw.update(lay.kw())
    return Problem("td_lambda_return", (r, nv), kw,
                   dict(layout=lay.kind, flags=fdesc, gamma=gform, lmbda=lform))


@st.composite
def discounted_return_cases(draw, dtypes=None):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts())
    rng = _rng(draw)
    r = _data(draw, rng, lay.shape, dtype)
    kw: dict[str, Any] = {}
    mode = draw(st.sampled_from(["mc", "bootstrap", "next_values"]))
    if mode == "next_values":
        kw["next_values"] = _data(draw, rng, lay.shape, dtype)
    elif mode == "bootstrap":
        kw["bootstrap_value"] = draw(bootstrap_value(lay, dtype, rng))
    fkw, fdesc = draw(flags(lay, dtype, rng, allow_truncation=(mode == "next_values")))
    kw.update(fkw)
    gamma, gform = draw(coefficient(lay, dtype, rng, allow_default=True))
    if gamma is not None:
        kw["gamma"] = gamma
    kw.update(lay.kw())
    return Problem("discounted_return", (r,), kw, dict(layout=lay.kind, mode=mode, flags=fdesc, gamma=gform))


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
    kw: dict[str, Any] = {}
    explicit = _next_value_form(draw, lay, dtype, rng, kw)
    fkw, fdesc = draw(flags(lay, dtype, rng, allow_truncation=explicit))
    kw.update(fkw)
    gform, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    clips = {}
    for name in ("rho_bar", "c_bar", "rho_bar_pg"):
        if draw(st.booleans()):
            clips[name] = float(draw(CLIP))
            kw[name] = clips[name]
    kw.update(lay.kw())
    return Problem("vtrace", (r, v, log_pi, log_mu), kw,
                   dict(layout=lay.kind, explicit=explicit, flags=fdesc, gamma=gform, lmbda=lform, clips=clips))


@st.composite
def retrace_cases(draw, dtypes=None):
    dtype, lay, rng, r, q, log_pi, log_mu = draw(_off_policy_inputs(dtypes, [0.0, 0.5, 1.5]))
    S = lay.shape
    kw: dict[str, Any] = {}
    form = draw(st.sampled_from(["expected", "full"]))
    if form == "expected":
        kw["next_expected_q"] = _data(draw, rng, S, dtype)
    else:
        A = draw(st.integers(1, 4))
        logits = rng.normal(size=tuple(S) + (A,))
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = probs / probs.sum(axis=-1, keepdims=True)
        kw["next_pi"] = make_tensor(probs, dtype, draw(layout_variant(len(S) + 1)))
        kw["next_q"] = make_tensor(rng.uniform(-2, 2, size=tuple(S) + (A,)), dtype,
                                   draw(layout_variant(len(S) + 1)))
    fkw, fdesc = draw(flags(lay, dtype, rng, allow_truncation=True))
    kw.update(fkw)
    gform, lform = _gamma_lmbda(draw, lay, dtype, rng, kw)
    c_bar = None
    if draw(st.booleans()):
        c_bar = float(draw(CLIP))
        kw["c_bar"] = c_bar
    kw.update(lay.kw())
    return Problem("retrace", (r, q, log_pi, log_mu), kw,
                   dict(layout=lay.kind, form=form, flags=fdesc, gamma=gform, lmbda=lform, c_bar=c_bar))


@st.composite
def _trace_common(draw, dtypes):
    dtype = draw(st.sampled_from(dtypes or FLOAT_DTYPES))
    lay = draw(layouts(features=True))
    rng = _rng(draw)
    S, td = lay.shape, lay.td
    x = _data(draw, rng, S, dtype)
    kw: dict[str, Any] = {}
    done_desc = "none"
    if draw(st.integers(0, 3)) > 0:
        # done covers x's leading dims up to at least the time dim
        k = draw(st.integers(td + 1, len(S)))
        dshape = S[:k]
        done_arr, _, done_desc = draw_done_term(draw, rng, dshape, td)
        kind = draw(st.sampled_from(FLAG_KINDS))
        kw["done"] = make_flag_with_layout(done_arr, kind, dtype, draw(layout_variant(len(dshape))))
        done_desc = f"{done_desc}:{kind}:{dshape}"
    if draw(st.booleans()):
        kw["initial"] = draw(bootstrap_value(lay, dtype, rng))
    return dtype, lay, rng, x, kw, done_desc


@st.composite
def eligibility_cases(draw, dtypes=None):
    dtype, lay, rng, x, kw, ddesc = draw(_trace_common(dtypes))
    gform, lform = _gamma_lmbda(draw, lay, dtype, rng, kw, feature_from=lay.td + 1)
    kw.update(lay.kw())
    return Problem("eligibility_trace", (x,), kw,
                   dict(layout=lay.kind, done=ddesc, gamma=gform, lmbda=lform, initial="initial" in kw))


@st.composite
def cumsum_cases(draw, dtypes=None):
    dtype, lay, rng, x, kw, ddesc = draw(_trace_common(dtypes))
    kw.update(lay.kw())
    return Problem("episodic_cumsum", (x,), kw, dict(layout=lay.kind, done=ddesc, initial="initial" in kw))


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
        # alpha per-row, beta full: the output has beta's shape; its layout follows alpha, which
        # a broadcast alpha leaves unspecified
        alpha = make_tensor(rng.uniform(-2, 2, size=bshape), dtype, ("contiguous", None))
        beta = _data(draw, rng, S, dtype)
    reverse = draw(st.sampled_from([True, False, None]))
    kw: dict[str, Any] = {}
    if reverse is not None:
        kw["reverse"] = reverse
    if draw(st.booleans()):
        kw["initial"] = draw(bootstrap_value(lay, dtype, rng))
    kw.update(lay.kw())
    return Problem("affine_scan", (alpha, beta), kw,
                   dict(layout=lay.kind, beta=bform, reverse=reverse, initial="initial" in kw))


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


# -- patching across threads (the integrations' patch()/patched()) ---------------------------------

def nested_blocks_across_threads(patched, routes_ours) -> list:
    """Thread A opens a ``patched()`` block, B opens one, A closes its own: what ``routes_ours()``
    says inside B's block afterwards (``[True]`` when B's block stayed patched)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def a():
        with patched():
            a_in.set()
            b_in.wait(5)
        a_out.set()

    def b():
        a_in.wait(5)
        with patched():
            b_in.set()
            a_out.wait(5)
            seen.append(routes_ours())

    _run_threads([a, b])
    return seen


def concurrent_patch_use(patched, patch, unpatch, routes_ours, rounds=40, n=8) -> list:
    """``n`` threads open ``patched()`` blocks ``rounds`` times each while every fourth also
    patches and unpatches; the (thread, round) pairs where a block did not route to ours."""
    barrier = threading.Barrier(n)
    failures = []

    def worker(i):
        barrier.wait()
        for k in range(rounds):
            with patched():
                time.sleep(0.0002)  # let the other threads run inside the block
                if not routes_ours():
                    failures.append((i, k))
            if i % 4 == 0:
                (patch if k % 2 == 0 else unpatch)()

    _run_threads([functools.partial(worker, i) for i in range(n)])
    unpatch()
    return failures


def _run_threads(targets):
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --------------------------------------------------------------------------------------
# RLlib: a PPO with one remote Learner actor (tests/test_rllib_actors.py, test_rllib_setup_hook.py)
# --------------------------------------------------------------------------------------

def rllib_ray_init(**kwargs) -> None:
    """A small local Ray cluster for one test module (two CPUs, no dashboard)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, **kwargs)


# --------------------------------------------------------------------------------------
# the documentation's snippets
# --------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_block(page: str, index: int = 0) -> str:
    """The ``index``-th ```python block of ``page`` (a path relative to the repository root)."""
    return re.findall(r"```python\n(.*?)```", open(os.path.join(ROOT, page)).read(), re.S)[index]


def run_python_block(page: str, cwd, path=(), index: int = 0):
    """Run the ``index``-th ```python block of ``page`` (default: the first) as written, in a
    fresh Python process in the directory ``cwd`` with the repository (and the directories
    ``path``) first on sys.path; the finished process (returncode, stdout, stderr)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*map(str, path), ROOT, os.environ.get("PYTHONPATH", "")]),
               MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-c", python_block(page, index)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def rllib_docs_counts_recipe() -> str:
    """docs/rllib.md's Python expression (in backticks) for rl_triton's call counts in the
    Learner actors."""
    text = open(os.path.join(ROOT, "docs", "rllib.md")).read()
    (recipe,) = re.findall(r"`([^`]*foreach_learner[^`]*call_counts\(\)[^`]*)`", text)
    return recipe


def rllib_remote_ppo_counts(learner_class=None) -> dict:
    """Train a tiny CartPole PPO for one iteration with ``num_learners=1`` (the Learner in its own
    actor process) and return what that Learner process reports: whether the Learner is
    rl_triton's ``PPOTorchLearner``, whether RLlib is patched there, rl_triton's call counts,
    the iteration's mean total loss, and (``docs_recipe``) what docs/rllib.md's expression for
    the Learners' call counts gives, evaluated as written with this ``algo``."""
    import rl_triton.integrations.rllib as rt_rllib
    from ray.rllib.algorithms.ppo import PPOConfig

    config = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=0)
              .training(train_batch_size=200, minibatch_size=100, num_epochs=1)
              .learners(num_learners=1).debugging(seed=0))
    if learner_class is not None:
        config = config.learners(learner_class=learner_class)
    algo = config.build_algo()
    try:
        result = algo.train()
        (report,) = [r.get() for r in algo.learner_group.foreach_learner(
            lambda learner: {"ours": isinstance(learner, rt_rllib.PPOTorchLearner), "patched": rt_rllib.is_patched(),
                             "counts": rt_rllib.call_counts()})]
        report["loss"] = float(result["learners"]["default_policy"]["total_loss"])
        report["docs_recipe"] = eval(rllib_docs_counts_recipe(), {"algo": algo, "rt_rllib": rt_rllib})
        return report
    finally:
        algo.stop()


def count_calls(monkeypatch, module, name: str = "gae") -> list:
    """Replace ``module.name`` (for the test) by a wrapper that counts its calls: the list it
    appends one item to per call."""
    calls = []
    inner = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@contextlib.contextmanager
def held_in_thread(context):
    """Enter ``context()`` (a ``patched`` of an integration) in another thread and hold it
    until this block ends; the thread's block then closes."""
    opened, release = threading.Event(), threading.Event()

    def hold():
        with context():
            opened.set()
            release.wait(10)

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        assert opened.wait(10), "the thread's block did not open"
        yield
    finally:
        release.set()
        thread.join()


def leave_rank_process() -> None:
    """The end of a rank process of ``torch.multiprocessing.spawn`` whose work succeeded: exit 0
    without the interpreter's shutdown, in which the Triton interpreter's threads
    (TRITON_INTERPRET=1) now and then abort the process ("terminate called without an active
    exception", SIGABRT). Call it after ``destroy_process_group``, outside ``finally``, so that an
    exception still reaches torch.multiprocessing as the rank's error."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gloo_rank(rank, world, port, worker, args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        worker(rank, world, dist.group.WORLD, *args)
    finally:
        dist.destroy_process_group()
    leave_rank_process()


def spawn_gloo(worker, world: int, *args) -> None:
    """``worker(rank, world, group, *args)`` in ``world`` processes joined by a gloo process
    group on this machine (``group`` is ``dist.group.WORLD``); a rank's exception fails the call.
    ``worker`` is a module-level function, which the spawned processes import by name."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_gloo_rank, args=(world, port, worker, args), nprocs=world, join=True)


def concatenated_normalisation(parts, masks=None, eps: float = 1e-8) -> list:
    """Each of ``parts`` (one rank's raw advantages each) normalised with the statistics of all
    of them concatenated, in float64: ``(A - mean) / (std + eps)`` with the unbiased std, the
    rollout normalisation of rsl_rl, skrl and rl_games over the ranks' joint batch; with
    ``masks`` (one per part, nonzero: valid) the statistics of the valid elements."""
    from rl_triton.testing import oracle

    def joined(arrays):
        return np.concatenate([np.asarray(p, dtype=np.float64).ravel() for p in arrays])

    flat = joined(parts)
    whitened = oracle.masked_whiten(flat, None if masks is None else joined(masks) != 0, eps=eps, eps_mode="std")
    out, start = [], 0
    for p in parts:
        out.append(whitened[start:start + np.size(p)].reshape(np.shape(p)))
        start += np.size(p)
    return out
