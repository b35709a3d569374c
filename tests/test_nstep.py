"""``nstep_return`` (docs/semantics.md, section 6.10) against the float64 oracle's window sums
(rl_triton/testing/oracle.py): every n from 1 past the window, every flag form, per-step
discounts, dtypes, layouts, ``out=``, autograd, non-finite values outside a window, and the
argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.testing import oracle

from conftest import TRITON_INTERPRET_AT_STARTUP

BACKENDS = ["cpu", "torch"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])
T = 23


def _problem(seed, dtype=torch.float64, R=3):
    g = torch.Generator().manual_seed(seed)
    return dict(rewards=torch.randn(R, T, generator=g, dtype=torch.float64).to(dtype),
                next_values=torch.randn(R, T, generator=g, dtype=torch.float64).to(dtype),
                terminated=torch.rand(R, T, generator=g) < 0.08, truncated=torch.rand(R, T, generator=g) < 0.08,
                gamma=torch.rand(R, T, generator=g, dtype=torch.float64).to(dtype))


def _expected(p, n, flags, gamma):
    term = p["terminated"] if "terminated" in flags else p["done"]
    done = p["done"] if "done" in flags else p["terminated"] | p["truncated"]
    g = np.broadcast_to(gamma.double().numpy() if isinstance(gamma, torch.Tensor) else gamma, p["rewards"].shape)
    return oracle.nstep_return(p["rewards"].double().numpy(), p["next_values"].double().numpy(), term.numpy(),
                               done.numpy(), g, n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("flags", [("done",), ("terminated", "truncated")])
@pytest.mark.parametrize("n", [1, 2, 5, T, T + 3])
def test_matches_the_oracle(n, flags, dtype, tol, backend):
    p = _problem(n, dtype)
    p["done"] = p["terminated"] | p["truncated"]
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, **{f: p[f] for f in flags}, gamma=0.9,
                                 backend=backend)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.double().numpy(), _expected(p, n, flags, 0.9), rtol=tol, atol=tol)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_per_step_discounts(n):
    p = _problem(10 + n)
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, terminated=p["terminated"],
                                 truncated=p["truncated"], gamma=p["gamma"])
    np.testing.assert_allclose(got.numpy(), _expected(p, n, ("terminated", "truncated"), p["gamma"]), rtol=1e-12,
                               atol=1e-12)


def test_observation_aligned_flags_and_time_major_out():
    p = _problem(20)
    done = p["terminated"]
    starts = torch.cat([torch.zeros(3, 1, dtype=torch.bool), done[:, :-1]], 1)
    out = torch.empty(T, 3, dtype=torch.float64)
    got = rl_triton.nstep_return(p["rewards"].t().contiguous(), p["next_values"].t().contiguous(), n=4,
                                 episode_starts=starts.t().contiguous(), last_done=done[:, -1], gamma=0.95,
                                 time_dim=0, out=out)
    assert got is out
    p["done"] = done
    np.testing.assert_allclose(got.t().numpy(), _expected(p, 4, ("done",), 0.95), rtol=1e-12, atol=1e-12)


def test_a_window_reads_nothing_beyond_itself():
    """A NaN reward or value outside every window of a step leaves that step's return finite."""
    p = _problem(30)
    p["rewards"][:, 15] = float("nan")
    p["next_values"][:, 15] = float("inf")
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=3, done=torch.zeros(3, T, dtype=torch.bool))
    expected = _expected(dict(p, done=torch.zeros(3, T, dtype=torch.bool)), 3, ("done",), 0.99)
    assert torch.isfinite(got[:, :13]).all() and torch.isfinite(got[:, 16:]).all()
    assert not torch.isfinite(got[:, 13:16]).any()
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_gradients():
    p = _problem(40, R=2)
    r, v = p["rewards"][:, :9].clone().requires_grad_(), p["next_values"][:, :9].clone().requires_grad_()
    done = p["terminated"][:, :9]
    assert torch.autograd.gradcheck(lambda r, v: rl_triton.nstep_return(r, v, n=3, done=done, gamma=0.9), (r, v))


@pytest.mark.parametrize("n,error,message", [(0, ValueError, "n must be >= 1"), (1.5, TypeError, "n must be an int"),
                                             (True, TypeError, "n must be an int")])
def test_bad_n(n, error, message):
    p = _problem(50)
    with pytest.raises(error, match=message):
        rl_triton.nstep_return(p["rewards"], p["next_values"], n=n)


def test_next_values_must_broadcast_to_the_rewards():
    p = _problem(51)
    with pytest.raises(ValueError, match="next_values has shape"):
        rl_triton.nstep_return(p["rewards"], p["next_values"][:, :5], n=2)
