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

from helpers import FLAG_KINDS, assert_matches, layout_variant, make_flag_with_layout, make_tensor, n_examples
import rl_triton as rt
from rl_triton.core import kernels
from rl_triton.testing import Problem, make

INTERPRET_OR_GPU = kernels.AVAILABLE and (kernels.INTERPRET or torch.cuda.is_available())
BACKENDS = ["torch", "cpu"] + (["triton"] if INTERPRET_OR_GPU else [])
DEVICE = "cuda" if torch.cuda.is_available() and not kernels.INTERPRET else "cpu"
PLANS = [{}, dict(block_t=4, block_r=2), dict(block_t=2, block_r=2, n_seg=3)]
G, L = 0.9, 0.8
# the functions that take episode_starts, with other keyword arguments
ALGOS = {"gae": {}, "td_lambda_return": {}, "discounted_return": {}, "vtrace": dict(rho_bar=1.3, c_bar=0.9),
         "retrace": {}}


def _problem(algo, seed, R=3, T=11, time_dim=-1, device="cpu"):
    """The catalog's observation-aligned variant: about a quarter of the steps end an episode,
    and the window's first observation starts one in rows 0 and 2."""
    shape = (R, T) if time_dim == -1 else (T, R)
    return make(algo, shape, "episode_starts", time_dim=time_dim, dtype=torch.float64, device=device, seed=seed,
                p_term=0.15, p_trunc=0.1, gamma=G, lmbda=L, **ALGOS[algo])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("algo", list(ALGOS))
def test_matches_oracle(algo, backend):
    problem = _problem(algo, seed=len(algo), device=DEVICE if backend == "triton" else "cpu")
    want = problem.expected()
    plans = PLANS if backend == "triton" else [{}]
    for plan in plans:
        with kernels.forced_plan(**plan) if backend == "triton" else contextlib.nullcontext():
            got = problem.call(backend)
        for g_, w in zip(got, want):
            np.testing.assert_allclose(g_.cpu().numpy(), w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_time_major_float_flags_in_place(backend):
    """CleanRL's layout: [T, N] float flags, read without a shifted copy."""
    problem = _problem("gae", seed=7, time_dim=0)
    problem = problem.updated(last_done=problem.kwargs["last_done"].float())
    assert problem.kwargs["episode_starts"].dtype == torch.float32
    for g_, w in zip(problem.call(backend), problem.expected()):
        np.testing.assert_allclose(g_.numpy(), w, rtol=1e-12, atol=1e-12)


def test_gradients_flow():
    problem = _problem("gae", seed=3)
    (r, v), kw = problem.args, problem.kwargs
    assert torch.autograd.gradcheck(lambda r: rt.gae(r, v, **kw)[0], (r.clone().requires_grad_(),))


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
    problem = _problem("gae", seed=1)
    call = {k: problem.kwargs[k] for k in ("episode_starts", "last_done")}
    if kwargs.get("last_done") == "missing":
        call.pop("last_done")
    if "done" in kwargs:
        call["done"] = torch.zeros(3, 11, dtype=torch.bool)
    if "last_done_shape" in kwargs:
        call["last_done"] = torch.zeros(kwargs["last_done_shape"], dtype=torch.bool)
    if "last_done_dtype" in kwargs:
        call["last_done"] = torch.zeros(3, dtype=kwargs["last_done_dtype"])
    with pytest.raises((ValueError, TypeError), match=match):
        rt.gae(*problem.args, **call)


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
    r, v = (make_tensor(a, dtype, draw(layout_variant(2))) for a in data.values())
    flag_kind = draw(st.sampled_from(FLAG_KINDS))
    kw = dict(episode_starts=make_flag_with_layout(starts, flag_kind, dtype, draw(layout_variant(2))),
              last_done=make_flag_with_layout(last, flag_kind, dtype, ("contiguous", None)),
              bootstrap_value=make_tensor(rng.standard_normal(R), dtype))
    coef_form = draw(st.sampled_from(["number", "number", "per-row tensor"]))
    gamma, lmbda = draw(st.floats(0.0, 1.0)), draw(st.floats(0.0, 1.0))
    if coef_form == "number":
        kw.update(gamma=gamma, lmbda=lmbda)
    else:
        kw.update(gamma=torch.full((R, 1), gamma, dtype=dtype), lmbda=torch.full((R, 1), lmbda, dtype=dtype))
    return Problem("gae", (r, v), kw)


@settings(max_examples=n_examples(60))
@given(case=_obs_aligned_gae_case())
@pytest.mark.parametrize("backend", BACKENDS)
def test_obs_aligned_gae_any_layout_matches_oracle(backend, case):
    if backend == "triton":
        case = Problem(case.fn, tuple(a.to(DEVICE) for a in case.args), {k: v.to(DEVICE) if isinstance(
            v, torch.Tensor) else v for k, v in case.kwargs.items()})
    for g_, w, what in zip(case.call(backend), case.expected(), ("advantages", "value targets")):
        assert_matches(g_, w, case.dtype, what)
