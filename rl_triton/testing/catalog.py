"""Problems for every public function: how to draw inputs, call rl_triton, and compute what
the float64 oracle says the call returns.

A :class:`Problem` is one call ``rl_triton.<fn>(*args, **kwargs)`` with tensors in the caller's
layout. ``Problem.call`` runs it on the library; ``Problem.expected`` runs :func:`reference`,
which applies the argument rules of docs/semantics.md to the call's own arguments (layouts,
broadcasting and dtypes, section 1; flag conventions, section 2; next values and the window
bootstrap, section 3; observation-aligned flags, section 4; defaults, section 6) and hands
``[rows, time]`` float64 arrays to :mod:`rl_triton.testing.oracle`. :func:`make` draws a
Problem for one function and one named variant of its inputs (:data:`VARIANTS`) from a numpy
Generator.

The oracle is fed the values actually passed: tensors as stored (rounded to their dtype), and
Python-number hyperparameters as the kernels apply them (:func:`hyperparameter`). Only
rl_triton's public functions are called, so a Problem runs on any version of the library that
has the same API.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Optional

import numpy as np
import torch

import rl_triton

from ..core.estimators import TRACE_READS
from . import oracle

__all__ = [
    "DEFAULTS",
    "as_f64",
    "POSITIONAL",
    "Problem",
    "VARIANTS",
    "from_rows",
    "hyperparameter",
    "make",
    "reference",
    "takes",
    "to_rows",
]

# Python-number arguments of each function with their defaults (docs/semantics.md section 6)
DEFAULTS: dict[str, dict[str, Any]] = {
    "gae": dict(gamma=0.99, lmbda=0.95),
    "td_lambda_return": dict(gamma=0.99, lmbda=0.95),
    "discounted_return": dict(gamma=0.99),
    "vtrace": dict(gamma=0.99, lmbda=1.0, rho_bar=1.0, c_bar=1.0, rho_bar_pg=None),
    "retrace": dict(gamma=0.99, lmbda=1.0, c_bar=1.0),
    "eligibility_trace": dict(gamma=0.99, lmbda=1.0),
    "episodic_cumsum": dict(),
    "affine_scan": dict(reverse=True),
    "arrival_gae": dict(gamma=0.99, lmbda=0.95, rho_bar=1.0, c_bar=1.0),
    "nstep_return": dict(gamma=0.99),
}

# the positional tensors of each function; make() draws each by its name (_Draw.tensor)
POSITIONAL: dict[str, tuple[str, ...]] = {
    "gae": ("rewards", "values"),
    "td_lambda_return": ("rewards", "next_values"),
    "discounted_return": ("rewards",),
    "vtrace": ("rewards", "values", "log_pi", "log_mu"),
    "retrace": ("rewards", "q_values", "log_pi", "log_mu"),
    "eligibility_trace": ("x",),
    "episodic_cumsum": ("x",),
    "affine_scan": ("alpha", "beta"),
    "arrival_gae": ("rewards", "values"),
    "nstep_return": ("rewards", "next_values"),
}

# variant -> the keyword arguments make() draws for it, by name; a flag may name its dtype
# ("done:uint8"; bool otherwise). "episode_starts" draws the pair episode_starts (float32)
# and last_done (bool); "gamma" a per-step tensor; "n=K" the int argument n (nstep_return's).
# The first variant is the default. Flag dtypes differ across variants on purpose, so that
# running every variant covers bool, uint8 and float32 flags.
VARIANTS: dict[str, dict[str, str]] = {
    "gae": {
        "terminated+bootstrap": "bootstrap_value terminated",
        "done+bootstrap": "bootstrap_value done:uint8",
        "done": "done",
        "gym": "next_values terminated truncated",
        "gym with per-step gamma": "next_values terminated truncated gamma",
        "episode_starts": "bootstrap_value episode_starts",
        "plain": "",
    },
    "td_lambda_return": {
        "torchrl": "done:uint8 terminated",
        "gym": "terminated truncated",
        "done": "done",
        "episode_starts": "episode_starts",
        "plain": "",
    },
    "discounted_return": {
        "gym": "next_values terminated truncated:float32",
        "done": "done",
        "episode_starts": "bootstrap_value episode_starts",
        "plain": "",
    },
    "vtrace": {
        "gym": "next_values terminated truncated",
        "done+bootstrap": "bootstrap_value done:uint8",
        "done": "done",
        "episode_starts": "bootstrap_value episode_starts",
        "plain": "",
    },
    "retrace": {
        "expected": "next_expected_q terminated truncated",
        "pairs": "next_pi next_q terminated truncated",
        "done": "next_expected_q done",
        "episode_starts": "next_expected_q episode_starts",
        "plain": "next_expected_q",
        # the other traces (section 6.5): each reads only its inputs, the others passed as None
        "importance": "next_expected_q done trace=importance",
        "tree_backup": "next_expected_q terminated truncated trace=tree_backup",
        "q_lambda": "next_expected_q done greedy trace=q_lambda",
        "peng": "next_expected_q done trace=peng",
    },
    "eligibility_trace": {
        "done+initial": "done:float32 initial",
        "done": "done",
        "plain": "",
    },
    "episodic_cumsum": {
        "done+initial": "done initial",
        "done": "done",
        "plain": "",
    },
    "affine_scan": {
        "reverse": "reverse=True initial",
        "forward": "reverse=False initial",
        "plain": "",
    },
    "arrival_gae": {
        "ratio+done": "ratio done:float32",
        "done": "done",
        "ratio": "ratio",
        "plain": "",
    },
    "nstep_return": {
        "gym": "n=5 terminated truncated",
        "done": "n=5 done:uint8",
        "torchrl": "n=3 done terminated:float32",
        "gym with per-step gamma": "n=4 terminated truncated gamma",
        "episode_starts": "n=5 episode_starts",
        "beyond the window": "n=100000 terminated truncated",
        "plain": "n=1",
    },
}

# functions whose ``group=`` raises NotImplementedError (not a scan: a window reads past its chunk)
NO_GROUP = frozenset(("nstep_return",))


def takes(fn: str, keyword: str) -> bool:
    """Whether ``rl_triton.<fn>`` takes ``keyword`` (``arrival_gae`` takes no ``group`` or
    ``cu_seqlens``; the functions of ``NO_GROUP`` raise for ``group``)."""
    if keyword == "group" and fn in NO_GROUP:
        return False
    return keyword in inspect.signature(getattr(rl_triton, fn)).parameters

_PER_ROW = ("bootstrap_value", "initial", "last_done")  # the rewards' shape without the time dim
_PER_ACTION = ("next_pi", "next_q")  # the rewards' shape + (A,)
_ACTIONS = 4  # make(): actions of Retrace's next_pi / next_q


# --------------------------------------------------------------------------------------
# layout adapters: caller layout <-> oracle rows [R, T]
# --------------------------------------------------------------------------------------


def as_f64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def _rest(shape, td) -> tuple:
    return tuple(s for i, s in enumerate(shape) if i != td)


def align_leading(x: np.ndarray, ndim: int) -> np.ndarray:
    """Append trailing singleton dims (a `done` aligned with x's leading dims)."""
    return x.reshape(x.shape + (1,) * (ndim - x.ndim))


def to_rows(x, shape, td) -> np.ndarray:
    """Broadcast `x` (torch broadcasting rules) to `shape`, move time `td` last, -> [R, T]."""
    a = np.broadcast_to(as_f64(x), shape)
    return np.ascontiguousarray(np.moveaxis(a, td, -1)).reshape(math.prod(_rest(shape, td)), shape[td])


def to_rows_actions(x, shape, td) -> np.ndarray:
    """x of shape `shape + (A,)` (action dim last) -> [R, T, A]."""
    a = as_f64(x)
    A = a.shape[-1]
    a = np.broadcast_to(a, tuple(shape) + (A,))
    return np.ascontiguousarray(np.moveaxis(a, td, -2)).reshape(math.prod(_rest(shape, td)), shape[td], A)


def per_row(x, shape, td) -> np.ndarray:
    """A tensor of shape `shape` without the time dim (broadcastable) -> [R]."""
    return np.ascontiguousarray(np.broadcast_to(as_f64(x), _rest(shape, td))).reshape(-1)


def from_rows(y: np.ndarray, shape, td) -> np.ndarray:
    """[R, T] (or [R, T, A]) rows -> `shape` (or `shape + (A,)`), time at `td`."""
    y = np.asarray(y)
    extra = y.shape[2:]
    return np.moveaxis(y.reshape(_rest(shape, td) + (shape[td],) + extra), len(shape) - 1, td)


def hyperparameter(x: float, dtype: torch.dtype) -> float:
    """A Python-number hyperparameter as the kernels apply it: in float32 unless the data is
    float64, as PyTorch applies a Python scalar to a float32 tensor (docs/semantics.md
    section 1)."""
    return float(x) if dtype == torch.float64 else float(np.float32(x))


# --------------------------------------------------------------------------------------
# the kwargs-driven reference
# --------------------------------------------------------------------------------------


def _shape(fn, args) -> tuple:
    if fn == "affine_scan":
        return tuple(torch.broadcast_shapes(args[0].shape, args[1].shape))
    return tuple(args[0].shape)


def _time_dim(kwargs, ndim) -> int:
    td = kwargs.get("time_dim", -1)
    return td + ndim if td < 0 else td


def reference(fn: str, args, kwargs) -> tuple:
    """Expected outputs (float64 numpy, caller layout) of ``rl_triton.<fn>(*args, **kwargs)``.

    Applies the argument rules of docs/semantics.md (flag conventions and observation-aligned
    flags, next-value forms and the window bootstrap, defaults, broadcasting, time_dim) to the
    call's arguments and calls the oracle. Keywords the rules do not read (``out=``,
    ``backend=``) are ignored."""
    kw = dict(DEFAULTS[fn])
    kw.update(kwargs)
    shape = _shape(fn, args)
    nd = len(shape)
    td = _time_dim(kw, nd)
    T = shape[td]
    dtype = args[0].dtype

    def rows(x):
        return to_rows(x, shape, td)

    def rows_of_row(x):
        return None if x is None else per_row(x, shape, td)

    def flag(x):
        if x is None:
            return None
        a = as_f64(x) != 0
        if fn in ("eligibility_trace", "episodic_cumsum"):
            a = align_leading(a, nd)
        return rows(a) != 0

    def coefficient(name):
        value = kw[name]
        if isinstance(value, torch.Tensor):
            return rows(value)
        return rows(np.full((), hyperparameter(value, dtype)))

    def clip(name):
        return hyperparameter(kw[name], dtype)

    done, term = _effective_flags(kw, flag, rows_of_row, rows(np.zeros(())) != 0, T)
    boot = rows_of_row(kw.get("bootstrap_value"))

    def out(*ys):
        return tuple(from_rows(y, shape, td) for y in ys)

    def next_values(values_rows):
        if kw.get("next_values") is not None:
            return rows(kw["next_values"])
        return oracle.implied_next_values(values_rows, boot)

    if fn == "gae":
        v = rows(args[1])
        return out(*oracle.gae(rows(args[0]), v, next_values(v), term, done, coefficient("gamma"),
                               coefficient("lmbda")))
    if fn == "td_lambda_return":
        return out(oracle.td_lambda_return(rows(args[0]), rows(args[1]), term, done, coefficient("gamma"),
                                           coefficient("lmbda")))
    if fn == "discounted_return":
        nv = None if kw.get("next_values") is None else rows(kw["next_values"])
        if boot is not None:
            carry = boot
        elif nv is not None and T > 0:
            carry = nv[:, -1]
        else:
            carry = None
        return out(oracle.discounted_return(rows(args[0]), term, done, coefficient("gamma"), next_values=nv,
                                            carry=carry))
    if fn == "vtrace":
        v = rows(args[1])
        rho_bar = clip("rho_bar")
        rho_bar_pg = rho_bar if kw["rho_bar_pg"] is None else clip("rho_bar_pg")
        return out(*oracle.vtrace(rows(args[0]), v, next_values(v), rows(args[2]), rows(args[3]), term, done,
                                  coefficient("gamma"), coefficient("lmbda"), rho_bar, clip("c_bar"), rho_bar_pg))
    if fn == "retrace":
        if kw.get("next_expected_q") is not None:
            ev = dict(next_expected_q=rows(kw["next_expected_q"]))
        else:
            ev = {k: to_rows_actions(kw[k], shape, td) for k in _PER_ACTION}
        log_probs = [None if x is None else rows(x) for x in args[2:4]]
        return out(oracle.retrace(rows(args[0]), rows(args[1]), *log_probs, term, done, coefficient("gamma"),
                                  coefficient("lmbda"), clip("c_bar"), trace=kw.get("trace", "retrace"),
                                  greedy=flag(kw.get("greedy")), **ev))
    initial = rows_of_row(kw.get("initial"))
    if fn == "eligibility_trace":
        return out(oracle.eligibility_trace(rows(args[0]), done, coefficient("gamma"), coefficient("lmbda"),
                                            initial))
    if fn == "episodic_cumsum":
        return out(oracle.episodic_cumsum(rows(args[0]), done, initial))
    if fn == "arrival_gae":
        ratio = rows(np.ones(())) if kw.get("ratio") is None else rows(kw["ratio"])
        return out(oracle.arrival_gae(rows(args[0]), rows(args[1]), ratio, done, coefficient("gamma"),
                                      coefficient("lmbda"), clip("rho_bar"), clip("c_bar")))
    if fn == "affine_scan":
        return out(oracle.affine_scan(rows(args[0]), rows(args[1]), reverse=kw["reverse"], initial=initial))
    if fn == "nstep_return":
        return out(oracle.nstep_return(rows(args[0]), rows(args[1]), term, done, coefficient("gamma"), kw["n"]))
    raise KeyError(fn)


def _effective_flags(kw, flag, rows_of_row, no_flags, T):
    """(done, term) as [R, T] bool rows (docs/semantics.md sections 2 and 4)."""
    if kw.get("episode_starts") is not None:
        starts, last = flag(kw["episode_starts"]), rows_of_row(kw["last_done"]) != 0
        done = np.concatenate([starts[:, 1:], last[:, None]], axis=1)[:, :T]
        return done, done
    done, term, trunc = flag(kw.get("done")), flag(kw.get("terminated")), flag(kw.get("truncated"))
    if done is None:
        done = no_flags
        for f in (term, trunc):
            if f is not None:
                done = done | f
        return done, no_flags if term is None else term
    return done, done if term is None else term


# --------------------------------------------------------------------------------------
# a problem
# --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    """One call ``rl_triton.<fn>(*args, **kwargs)``, with the tensors in the caller's layout."""

    fn: str
    args: tuple
    kwargs: dict
    notes: dict = dataclasses.field(default_factory=dict)

    @property
    def shape(self) -> tuple:
        """The outputs' shape (the rewards', or alpha and beta broadcast)."""
        return _shape(self.fn, self.args)

    @property
    def dtype(self) -> torch.dtype:
        return self.args[0].dtype

    @property
    def n_out(self) -> int:
        return 2 if self.fn in ("gae", "vtrace") else 1

    def call(self, backend: Optional[str] = None, **overrides) -> tuple:
        """The library's outputs, always a tuple; ``overrides`` (``out=``, another
        hyperparameter) replace or add keyword arguments of this call only."""
        out = getattr(rl_triton, self.fn)(*self.args, **{**self.kwargs, **overrides}, backend=backend)
        return out if isinstance(out, tuple) else (out,)

    def expected(self) -> tuple:
        """The oracle's outputs: float64 numpy arrays in the caller's layout."""
        return reference(self.fn, self.args, self.kwargs)

    def updated(self, **kwargs) -> "Problem":
        """The same problem with these keyword arguments replaced or added."""
        return dataclasses.replace(self, kwargs={**self.kwargs, **kwargs})

    def head(self, n: int) -> "Problem":
        """The same problem on its first ``n`` rows (a problem with one batch dim)."""
        return self.rows(slice(0, n))

    def rows(self, index) -> "Problem":
        """The same problem on the rows ``index`` selects (a slice, or a sequence of row numbers;
        a problem with one batch dim)."""
        shape = self.shape
        if len(shape) != 2:
            raise ValueError(f"rows() needs one batch dim and the time dim, not shape {shape}")
        row_dim = 1 - _time_dim(self.kwargs, 2)

        def cut(name, x):
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return x
            if name in _PER_ROW:
                dim = x.dim() - 1
            elif name in _PER_ACTION:
                dim = row_dim
            else:  # per-step, broadcast from the right
                dim = row_dim - (2 - x.dim())
            if dim < 0 or x.shape[dim] == 1:
                return x
            if isinstance(index, slice):
                return x[(slice(None),) * dim + (index,)]
            return x.index_select(dim, torch.as_tensor(index, dtype=torch.long, device=x.device))

        args = tuple(cut(None, a) for a in self.args)
        return dataclasses.replace(self, args=args, kwargs={k: cut(k, v) for k, v in self.kwargs.items()})

    def steps(self, lo: int, hi: int) -> "Problem":
        """The same problem on steps ``[lo, hi)``: every per-step tensor cut along time (a chunk
        of a sequence split across ranks); per-row inputs stay whole."""
        return self.pieces([(lo, hi)])

    def pieces(self, ranges) -> "Problem":
        """The same problem on the steps of ``ranges`` (``(lo, hi)`` pairs) concatenated along time
        in that order (the pieces of a sequence that one rank holds); per-row inputs stay whole."""
        shape = self.shape
        td = _time_dim(self.kwargs, len(shape))

        def cut(x):
            if isinstance(x, torch.Tensor) and (tuple(x.shape) == tuple(shape) or tuple(x.shape[:-1]) == tuple(shape)):
                return torch.cat([x.narrow(td, lo, hi - lo) for lo, hi in ranges], td)
            return x

        return dataclasses.replace(self, args=tuple(cut(a) for a in self.args),
                                   kwargs={k: cut(v) for k, v in self.kwargs.items()})

    def flagged_at(self, steps) -> "Problem":
        """The same problem with its episode flags set on both sides of each of ``steps``: row 0
        at step t - 1 (its last before t), row 1 at step t (chunk boundaries of a sequence split
        at those steps); ``terminated`` is then cleared where ``done`` is not, so that it still
        implies done."""
        kw = dict(self.kwargs)
        shape = self.shape
        td = _time_dim(kw, len(shape))
        for name in ("terminated", "truncated", "done", "episode_starts"):
            if isinstance(kw.get(name), torch.Tensor) and tuple(kw[name].shape) == tuple(shape):
                x = kw[name].clone()
                for t in steps:
                    for row, at in ((0, t - 1), (1, t)):
                        if 0 <= at < shape[td] and row < x.numel() // shape[td]:
                            x.select(td, at).view(-1)[row] = 1
                kw[name] = x
        if isinstance(kw.get("done"), torch.Tensor) and isinstance(kw.get("terminated"), torch.Tensor):
            kw["terminated"] = kw["terminated"] & (kw["done"] != 0) if kw["terminated"].dtype == torch.bool else \
                kw["terminated"] * (kw["done"] != 0).to(kw["terminated"].dtype)
        return dataclasses.replace(self, kwargs=kw)

    def __repr__(self):
        def describe(v):
            if isinstance(v, torch.Tensor):
                text = f"Tensor(shape={tuple(v.shape)}, stride={v.stride()}, dtype={v.dtype})"
                if v.numel() <= 200:
                    text += f"\n         {v.tolist()}"
                return text
            return repr(v)

        lines = [f"Problem {self.fn}: shape={self.shape} dtype={self.dtype} notes={self.notes}"]
        lines += [f"  arg{i} = {describe(a)}" for i, a in enumerate(self.args)]
        lines += [f"  {k} = {describe(v)}" for k, v in self.kwargs.items()]
        return "\n".join(lines)


# --------------------------------------------------------------------------------------
# drawing problems
# --------------------------------------------------------------------------------------


class _Draw:
    """Draws the tensors of one problem from a numpy Generator: as [R, T] rows, then moved to
    the caller's ``shape`` (time at ``td``), contiguous, in ``dtype`` on ``device``."""

    def __init__(self, shape, td, dtype, device, seed, p_term, p_trunc):
        self.shape, self.td, self.dtype, self.device = tuple(shape), td, dtype, device
        self.rest = _rest(self.shape, td)
        self.R, self.T = math.prod(self.rest), self.shape[td]
        self.rng = np.random.default_rng(seed)
        self.np_dtype = np.float64 if dtype == torch.float64 else np.float32
        self.p_term, self.p_trunc = p_term, p_trunc
        self._masks = None

    def _tensor(self, a: np.ndarray, dtype=None, shape=None) -> torch.Tensor:
        if shape is None:
            a = from_rows(a, self.shape, self.td)
        else:
            a = a.reshape(shape)
        return torch.from_numpy(np.asarray(a, order="C")).to(dtype or self.dtype).to(self.device)

    def normal(self, scale=1.0, extra=()) -> np.ndarray:
        return self.rng.standard_normal((self.R, self.T) + extra, dtype=self.np_dtype) * scale

    def uniform(self, low, high) -> np.ndarray:
        return self.rng.random((self.R, self.T), dtype=self.np_dtype) * (high - low) + low

    def bernoulli(self, p) -> np.ndarray:
        """[R, T] bool, true with probability p (rounded to a multiple of 2**-16)."""
        return self.rng.integers(0, 1 << 16, (self.R, self.T), dtype=np.uint16) < round(p * (1 << 16))

    @property
    def masks(self):
        """(terminated, truncated) [R, T] bool rows, disjoint, as make() describes them."""
        if self._masks is None:
            term = self.bernoulli(self.p_term)
            trunc = self.bernoulli(self.p_trunc) & ~term
            if self.R and self.T:
                term[0, -1], trunc[0, -1] = True, False
                r = min(1, self.R - 1)
                if (r, self.T) != (0, 1):
                    trunc[r, 0], term[r, 0] = True, False
            self._masks = term, trunc
        return self._masks

    def flag(self, name, dtype):
        term, trunc = self.masks
        return self._tensor({"terminated": term, "truncated": trunc, "done": term | trunc}[name], dtype)

    def observation_aligned(self) -> dict:
        """episode_starts[t+1] = done[t], last_done = done[T-1]; the window's first observation
        starts an episode in every other row (it ends no step of the window)."""
        term, trunc = self.masks
        done = term | trunc
        starts = np.empty_like(done)
        starts[:, 1:] = done[:, :-1]
        starts[:, :1] = (np.arange(self.R) % 2 == 0)[:, None]
        last = done[:, -1] if self.T else np.zeros(self.R, bool)
        return dict(episode_starts=self._tensor(starts, torch.float32),
                    last_done=self._tensor(last, torch.bool, self.rest))

    def tensor(self, name) -> torch.Tensor:
        """A tensor argument, drawn by its name."""
        if name == "greedy":  # Q(lambda)'s greedy actions (bool): 70% of the steps
            return self._tensor(self.bernoulli(0.7), torch.bool)
        if name in ("log_pi", "log_mu"):
            return self._tensor(self.normal(0.3))
        if name == "ratio":  # importance ratios far from 1 on both sides of the clips
            return self._tensor(np.exp(self.normal(0.7)))
        if name == "beta":  # decays in [0.9, 1), cut to 0 at 2% of the steps
            return self._tensor(self.uniform(0.9, 1.0) * ~self.bernoulli(0.02))
        if name == "gamma":
            return self._tensor(self.uniform(0.9, 1.0))
        if name in _PER_ROW:
            return self._tensor(self.rng.standard_normal(self.R, dtype=self.np_dtype), shape=self.rest)
        if name == "next_pi":
            logits = self.normal(extra=(_ACTIONS,))
            pi = np.exp(logits - logits.max(-1, keepdims=True))
            return self._tensor(pi / pi.sum(-1, keepdims=True))
        if name == "next_q":
            return self._tensor(self.normal(extra=(_ACTIONS,)))
        return self._tensor(self.normal())


def make(fn: str, shape, variant: Optional[str] = None, *, time_dim: int = -1, dtype: torch.dtype = torch.float32,
         device="cpu", seed: int = 0, p_term: float = 0.02, p_trunc: float = 0.02, **hyperparameters) -> Problem:
    """Draw a Problem for ``rl_triton.<fn>``.

    The inputs have ``shape`` with time at ``time_dim`` (``(R, T)`` batch-major; ``(T, R)``
    with ``time_dim=0`` time-major), float ``dtype``, live on ``device`` and are contiguous;
    they come from ``numpy.random.default_rng(seed)``, the same values on every device. Data
    are standard normal (log-probabilities 0.3 times that). Each step terminates with
    probability ``p_term``, else truncates with ``p_trunc``; besides, row 0 terminates at its
    last step and row 1 (row 0 if alone) truncates at its first. ``variant`` is a key of
    ``VARIANTS[fn]`` (default: the first); a variant that draws ``gamma`` overrides the one
    given. ``hyperparameters`` (``gamma``, ``lmbda``, ``rho_bar``, ``c_bar``, ``rho_bar_pg``)
    go to the call of every function that takes them (None: left to the library's default); the
    other functions leave them out."""
    variants = VARIANTS[fn]
    variant = next(iter(variants)) if variant is None else variant
    known = {k for defaults in DEFAULTS.values() for k in defaults} - {"reverse"}
    unknown = set(hyperparameters) - known
    if unknown:
        raise TypeError(f"make(): unknown hyperparameters {sorted(unknown)}")
    d = _Draw(shape, time_dim % len(shape), dtype, device, seed, p_term, p_trunc)
    args = tuple(d.tensor(name) for name in POSITIONAL[fn])
    kwargs: dict[str, Any] = {}
    for item in variants[variant].split():
        name, _, spec = item.partition(":")
        if name in ("terminated", "truncated", "done"):
            kwargs[name] = d.flag(name, getattr(torch, spec or "bool"))
        elif name == "episode_starts":
            kwargs.update(d.observation_aligned())
        elif name.startswith("reverse="):
            kwargs["reverse"] = name == "reverse=True"
        elif name.startswith("n="):
            kwargs["n"] = int(name[2:])
        elif name.startswith("trace="):
            kwargs["trace"] = name[6:]
            # the log-probabilities a trace does not read are passed as None
            reads = TRACE_READS[kwargs["trace"]]
            args = tuple(None if n in ("log_pi", "log_mu") and n not in reads else a
                         for n, a in zip(POSITIONAL[fn], args))
        else:
            kwargs[name] = d.tensor(name)
    for name, value in hyperparameters.items():
        if name in DEFAULTS[fn] and name not in kwargs and value is not None:
            kwargs[name] = value
    if time_dim != -1:
        kwargs["time_dim"] = time_dim
    return Problem(fn, args, kwargs, notes=dict(variant=variant, seed=seed))
