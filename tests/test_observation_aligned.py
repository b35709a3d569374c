"""Observation-aligned flags (SB3's episode_starts, CleanRL's dones): ``episode_starts`` with
``last_done`` mean done[t] = episode_starts[t+1], done[T-1] = last_done, all terminations. Every
backend reads them in place; results are checked against the float64 oracle fed with the
shifted, transition-aligned flags."""

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
from helpers import (FLAG_KINDS, as_f64, assert_matches, layout_variant, make_flag_with_layout, make_tensor,
                     n_examples)
import rl_triton as rt
from rl_triton.core import kernels

INTERPRET_OR_GPU = kernels.AVAILABLE and (kernels.INTERPRET or torch.cuda.is_available())
BACKENDS = ["torch", "cpu"] + (["triton"] if INTERPRET_OR_GPU else [])
DEVICE = "cuda" if torch.cuda.is_available() and not kernels.INTERPRET else "cpu"
PLANS = [{}, dict(block_t=4, block_r=2), dict(block_t=2, block_r=2, n_seg=3)]
G, L = 0.9, 0.8


def _case(seed, R=3, T=11):
    g = torch.Generator().manual_seed(seed)
    x = {k: torch.randn(R, T, generator=g, dtype=torch.float64) for k in ("r", "v", "nv", "lp", "lm")}
    x["lp"], x["lm"] = 0.4 * x["lp"], 0.4 * x["lm"]
    starts = torch.rand(R, T, generator=g) < 0.25
    starts[:, 0] = torch.tensor([True, False, True])[:R]
    last = torch.tensor([True, False, True])[:R]
    x["boot"] = torch.randn(R, generator=g, dtype=torch.float64)
    done = torch.cat([starts[:, 1:], last[:, None]], 1)  # the transition-aligned equivalent
    return x, starts, last, done


def _np(t):
    return t.detach().cpu().numpy()


CALLS = {
    "gae": (
        lambda x, kw: rt.gae(x["r"], x["v"], bootstrap_value=x["boot"], gamma=G, lmbda=L, **kw),
        lambda x, d, g, l: oracle.gae(_np(x["r"]), _np(x["v"]), oracle.implied_next_values(_np(x["v"]), _np(x["boot"])),
                                      d, d, g, l),
    ),
    "td_lambda_return": (
        lambda x, kw: (rt.td_lambda_return(x["r"], x["nv"], gamma=G, lmbda=L, **kw),),
        lambda x, d, g, l: (oracle.td_lambda_return(_np(x["r"]), _np(x["nv"]), d, d, g, l),),
    ),
    "discounted_return": (
        lambda x, kw: (rt.discounted_return(x["r"], bootstrap_value=x["boot"], gamma=G, **kw),),
        lambda x, d, g, l: (oracle.discounted_return(_np(x["r"]), d, d, g, carry=_np(x["boot"])),),
    ),
    "vtrace": (
        lambda x, kw: rt.vtrace(x["r"], x["v"], x["lp"], x["lm"], bootstrap_value=x["boot"], gamma=G, lmbda=L,
                                rho_bar=1.3, c_bar=0.9, **kw),
        lambda x, d, g, l: oracle.vtrace(_np(x["r"]), _np(x["v"]),
                                         oracle.implied_next_values(_np(x["v"]), _np(x["boot"])), _np(x["lp"]),
                                         _np(x["lm"]), d, d, g, l, 1.3, 0.9, 1.3),
    ),
    "retrace": (
        lambda x, kw: (rt.retrace(x["r"], x["v"], x["lp"], x["lm"], next_expected_q=x["nv"], gamma=G, lmbda=L, **kw),),
        lambda x, d, g, l: (oracle.retrace(_np(x["r"]), _np(x["v"]), _np(x["lp"]), _np(x["lm"]), d, d, g, l, 1.0,
                                           next_expected_q=_np(x["nv"])),),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", list(CALLS))
def test_matches_oracle(algo, backend):
    run, ref = CALLS[algo]
    x, starts, last, done = _case(seed=len(algo))
    want = ref(x, _np(done), np.full(done.shape, G), np.full(done.shape, L))
    plans = PLANS if backend == "triton" else [{}]
    for plan in plans:
        with kernels.forced_plan(**plan) if backend == "triton" else contextlib.nullcontext():
            got = run({k: v.to(DEVICE) if backend == "triton" else v for k, v in x.items()},
                      dict(episode_starts=starts.to(DEVICE) if backend == "triton" else starts,
                           last_done=last.to(DEVICE) if backend == "triton" else last, backend=backend))
        for g_, w in zip(got, want):
            np.testing.assert_allclose(_np(g_), w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_time_major_float_flags_in_place(backend):
    """CleanRL's layout: [T, N] float flags, read without a shifted copy."""
    x, starts, last, done = _case(seed=7)
    tm = lambda t: t.t().contiguous()  # noqa: E731
    adv, tgt = rt.gae(tm(x["r"]), tm(x["v"]), bootstrap_value=x["boot"], episode_starts=tm(starts).float(),
                      last_done=last.float(), gamma=G, lmbda=L, time_dim=0, backend=backend)
    ref_adv, _ = rt.gae(x["r"], x["v"], bootstrap_value=x["boot"], done=done, gamma=G, lmbda=L, backend="torch")
    np.testing.assert_allclose(_np(adv.t()), _np(ref_adv), rtol=1e-12, atol=1e-12)


def test_gradients_flow():
    x, starts, last, _ = _case(seed=3)
    r = x["r"].clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda r: rt.gae(r, x["v"], bootstrap_value=x["boot"], episode_starts=starts, last_done=last)[0], (r,))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(last_done="missing"), "go together"),
        (dict(done="given"), "not both"),
        (dict(last_done_shape=(5,)), "last_done"),
        (dict(last_done_dtype=torch.complex64), "last_done"),
    ],
)
def test_bad_input(kwargs, match):
    x, starts, last, done = _case(seed=1)
    call = dict(episode_starts=starts, last_done=last)
    if kwargs.get("last_done") == "missing":
        call.pop("last_done")
    if "done" in kwargs:
        call["done"] = done
    if "last_done_shape" in kwargs:
        call["last_done"] = torch.zeros(kwargs["last_done_shape"], dtype=torch.bool)
    if "last_done_dtype" in kwargs:
        call["last_done"] = torch.zeros(3, dtype=kwargs["last_done_dtype"])
    with pytest.raises((ValueError, TypeError), match=match):
        rt.gae(x["r"], x["v"], **call)


@st.composite
def _obs_aligned_gae_case(draw):
    """SB3/CleanRL-style GAE inputs in any memory layout: [R, T] data (time-major storage or
    not, strided, offset), flags of any kind, gamma/lmbda as numbers or per-row tensors."""
    R, T = draw(st.integers(1, 6)), draw(st.integers(1, 12))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    starts = rng.random((R, T)) < draw(st.sampled_from([0.0, 0.2, 1.0]))
    last = rng.random(R) < 0.5
    data = {k: rng.standard_normal((R, T)) for k in ("r", "v")}
    tensors = {k: make_tensor(a, dtype, draw(layout_variant(2))) for k, a in data.items()}
    flag_kind = draw(st.sampled_from(FLAG_KINDS))
    tensors["starts"] = make_flag_with_layout(starts, flag_kind, dtype, draw(layout_variant(2)))
    tensors["last"] = make_flag_with_layout(last, flag_kind, dtype, ("contiguous", None))
    boot = rng.standard_normal(R)
    tensors["boot"] = make_tensor(boot, dtype)
    coef_form = draw(st.sampled_from(["number", "number", "per-row tensor"]))
    gamma, lmbda = draw(st.floats(0.0, 1.0)), draw(st.floats(0.0, 1.0))
    if coef_form == "number":
        g_kw, l_kw = gamma, lmbda
        # Python numbers apply in the compute dtype (docs/semantics.md)
        gamma, lmbda = (float(torch.tensor(x, dtype=dtype)) for x in (gamma, lmbda))
    else:
        g_kw, l_kw = (torch.full((R, 1), x, dtype=dtype) for x in (gamma, lmbda))
        gamma, lmbda = (float(t[0, 0]) for t in (g_kw, l_kw))
    done = np.concatenate([starts[:, 1:], last[:, None]], 1)
    exact = {k: as_f64(t) for k, t in tensors.items() if k in ("r", "v", "boot")}
    want = oracle.gae(exact["r"], exact["v"], oracle.implied_next_values(exact["v"], exact["boot"]), done, done,
                      np.full((R, T), gamma), np.full((R, T), lmbda))
    return tensors, g_kw, l_kw, want, dtype


@settings(max_examples=n_examples(60))
@given(case=_obs_aligned_gae_case())
@pytest.mark.parametrize("backend", BACKENDS)
def test_obs_aligned_gae_any_layout_matches_oracle(backend, case):
    tensors, g_kw, l_kw, want, dtype = case
    x = {k: v.to(DEVICE) if backend == "triton" else v for k, v in tensors.items()}
    got = rt.gae(x["r"], x["v"], bootstrap_value=x["boot"], episode_starts=x["starts"], last_done=x["last"],
                 gamma=g_kw.to(DEVICE) if isinstance(g_kw, torch.Tensor) and backend == "triton" else g_kw,
                 lmbda=l_kw.to(DEVICE) if isinstance(l_kw, torch.Tensor) and backend == "triton" else l_kw,
                 backend=backend)
    for g_, w, what in zip(got, want, ("advantages", "value targets")):
        assert_matches(g_, w, dtype, what)
