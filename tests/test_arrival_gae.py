"""arrival_gae (docs/semantics.md, section 6.9) against the float64 oracle on every backend:
variants of the catalog, clips on both sides of the ratios, both layouts, the last column left
alone with write_last=False (also where the result goes through a buffer), the relation to
gae at ratio 1, NaN, gradients and validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rl_triton as rt
from conftest import TRITON_INTERPRET_AT_STARTUP
from rl_triton.testing import make, oracle

BACKENDS = ["torch", "cpu"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])
CLIPS = [(1.0, 1.0), (0.8, 1.3), (math.inf, math.inf)]


def _close(got, want, dtype):
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)


# the interpreter is slow: the Triton backend runs the ratio+done and plain variants with finite clips
CASES = [(backend, variant, dtype, clips) for backend in BACKENDS
         for variant in ("ratio+done", "done", "ratio", "plain")
         for dtype in (torch.float64, torch.float32) for clips in CLIPS
         if backend != "triton" or (variant in ("ratio+done", "plain") and clips != CLIPS[2])]


@pytest.mark.parametrize("backend,variant,dtype,clips", CASES)
def test_matches_oracle(backend, variant, dtype, clips):
    # the interpreter is slow: two shapes and one layout per case (the other layout with clips 0.8, 1.3)
    shapes = [(3, 1), (5, 17)] if backend == "triton" else [(3, 1), (4, 2), (6, 40), (2, 129)]
    layouts = (-1, 0) if backend != "triton" or clips == CLIPS[1] else (-1,)
    for seed, shape in enumerate(shapes):
        for time_dim in layouts:
            p = make("arrival_gae", shape if time_dim == -1 else shape[::-1], variant, dtype=dtype, seed=seed,
                     time_dim=time_dim, p_term=0.2, rho_bar=clips[0], c_bar=clips[1], gamma=0.97, lmbda=0.9)
            (got,), (want,) = p.call(backend), p.expected()
            _close(got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_write_last_false_leaves_the_last_column(backend, dtype):
    p = make("arrival_gae", (4, 9), "ratio+done", dtype=dtype, seed=3, p_term=0.2, rho_bar=0.9, c_bar=1.1)
    out = torch.full((4, 9), 7.0, dtype=dtype)
    (got,) = p.call(backend, out=out, write_last=False)
    assert got is out
    assert (out[:, -1] == 7).all()
    (want,) = p.expected()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(out[:, :-1].double().numpy(), want[:, :-1], rtol=tol, atol=tol)
    (full,) = p.call(backend, out=torch.full((4, 9), 7.0, dtype=dtype))
    assert (full[:, -1] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_last_false_with_out_aliasing_an_input(backend):
    p = make("arrival_gae", (3, 8), "ratio+done", dtype=torch.float64, seed=4, p_term=0.2)
    (want,) = p.expected()
    rewards = p.args[0].clone()
    last = rewards[:, -1].clone()
    rt.arrival_gae(rewards, p.args[1], **p.kwargs, out=rewards, write_last=False, backend=backend)
    assert torch.equal(rewards[:, -1], last)
    np.testing.assert_allclose(rewards[:, :-1].numpy(), want[:, :-1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_ratio_one_is_gae_on_the_shifted_views(backend):
    """At ratio 1 with clips >= 1 the row is GAE over its T-1 transitions: rewards and flags of
    observations 1..T-1, values of 0..T-2, V(s_T) = the last value."""
    p = make("arrival_gae", (5, 30), "done", dtype=torch.float64, seed=5, p_term=0.2, rho_bar=1.5, c_bar=2.0)
    r, v = p.args
    d = p.kwargs["done"]
    (got,) = p.call(backend, ratio=torch.ones_like(r))
    adv, _ = rt.gae(r[:, 1:], v[:, :-1], done=d[:, 1:], bootstrap_value=v[:, -1], gamma=0.99, lmbda=0.95,
                    backend=backend)
    torch.testing.assert_close(got[:, :-1], adv, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_ratio_gives_nan_until_a_done(backend):
    r = torch.zeros(1, 6, dtype=torch.float64)
    v = torch.ones(1, 6, dtype=torch.float64)
    ratio = torch.ones(1, 6, dtype=torch.float64)
    ratio[0, 3] = math.nan
    done = torch.zeros(1, 6)
    done[0, 2] = 1  # the step from observation 1 ends there: steps 0 and 1 do not read step 3
    got = rt.arrival_gae(r, v, ratio=ratio, done=done, backend=backend)
    assert torch.isnan(got[0, 2:4]).all() and not torch.isnan(got[0, [0, 1, 4, 5]]).any()


def test_gradients():
    p = make("arrival_gae", (3, 7), "ratio+done", dtype=torch.float64, seed=6, p_term=0.2, rho_bar=0.9, c_bar=1.2)
    r, v = (x.clone().requires_grad_() for x in p.args)
    ratio = p.kwargs["ratio"].clone().requires_grad_()
    kw = {**p.kwargs, "ratio": ratio}
    assert torch.autograd.gradcheck(lambda r, v, x: rt.arrival_gae(r, v, **{**kw, "ratio": x}), (r, v, ratio))


def test_validation():
    r = torch.zeros(2, 5)
    with pytest.raises(ValueError, match="out="):
        rt.arrival_gae(r, r, write_last=False)
    with pytest.raises(TypeError, match="write_last"):
        rt.arrival_gae(r, r, write_last=1)
    with pytest.raises(ValueError, match="rho_bar"):
        rt.arrival_gae(r, r, rho_bar=0.0)
    with pytest.raises(ValueError, match="ratio"):
        rt.arrival_gae(r, r, ratio=torch.ones(3, 5))
    with pytest.raises(TypeError, match="ratio"):
        rt.arrival_gae(r, r, ratio=torch.ones(2, 5, dtype=torch.float64))
    with pytest.raises(ValueError, match="done"):
        rt.arrival_gae(r, r, done=torch.full((2, 5), 2.0))


def test_oracle_by_hand():
    """The oracle on a row worked out by hand: T = 3, a done arriving with observation 2."""
    r = np.array([[9.0, 1.0, 2.0]])  # rewards[0] belongs to no step of the row
    v = np.array([[0.5, 1.5, 4.0]])
    x = np.array([[2.0, 0.5, 3.0]])
    d = np.array([[1, 0, 1]])
    g, l = np.full((1, 3), 0.9), np.full((1, 3), 0.8)
    a1 = 0.5 * (2.0 - 1.5)  # done[2]: no bootstrap, no trace
    a0 = 1.0 * (1.0 + 0.9 * 1.5 - 0.5) + 0.9 * 0.8 * 1.0 * a1  # rho = c = min(1, 2)
    np.testing.assert_allclose(oracle.arrival_gae(r, v, x, d, g, l, 1.0, 1.0), [[a0, a1, 0.0]])
