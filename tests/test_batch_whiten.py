"""The advantage normalisation of the GPU-simulation frameworks (rsl_rl, skrl, rl_games):
``(A - A.mean()) / (A.std() + 1e-8)`` over every element of the batch, as
``masked_whiten(eps_mode="std")`` and as ``gae(whiten=...)`` without a mask, on every backend,
against float64 formulas and the float64 GAE oracle (docs/semantics.md, section 15)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import rl_triton as rt
from rl_triton.testing import oracle

F64, F32 = torch.float64, torch.float32
TOL = {F64: 1e-12, F32: 2e-6}
STD = dict(eps_mode="std")


def _std_whitened(x, mask=None, unbiased=True, eps=1e-8, shift_mean=True, scale=True):
    """``(x - mean) / (std + eps)`` over the valid elements, in float64 numpy, two-pass."""
    a = np.asarray(x, dtype=np.float64)
    valid = np.ones(a.shape, bool) if mask is None else np.asarray(mask, bool)
    sel = a[valid]
    n = sel.size
    mean = sel.sum() / n if n else math.nan
    m2 = ((sel - mean) ** 2).sum()
    var = m2 / (n - 1) if unbiased else m2 / n
    rstd = 1.0 / (math.sqrt(var) + eps) if scale else 1.0
    y = (a - mean) * rstd
    return y if shift_mean else y + mean


def _close(got, want, dtype):
    want = torch.as_tensor(np.asarray(want), dtype=F64)
    torch.testing.assert_close(got.double(), want, rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)


def _x(shape, dtype, seed=0, loc=0.3, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=F64) * scale + loc).to(dtype)


# -- masked_whiten(eps_mode="std") ------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("shape", [(1,), (7,), (24, 300, 1), (5000,), (3, 40000)])
def test_std_mode_matches_the_formula(backend, dtype, shape):
    """Across one and many blocks (numba's 16384, Triton's 4096 elements), with and without a mask."""
    if backend == "triton" and math.prod(shape) > 20000:
        pytest.skip("the interpreter's time")
    x = _x(shape, dtype, seed=len(shape))
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(shape, generator=g) < 0.6
    mask.view(-1)[:2] = True
    for m in (None, mask):
        want = _std_whitened(x.double(), m)
        _close(rt.masked_whiten(x, m, eps_mode="std", backend=backend), want, dtype)
        out = x.clone()
        assert rt.masked_whiten(out, m, eps_mode="std", backend=backend, out=out) is out
        _close(out, want, dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_std_mode_is_the_frameworks_expression(backend, dtype):
    """rsl_rl 5.5.1 (rsl_rl/algorithms/ppo.py, PPO.compute_returns), skrl 2.1.1
    (skrl/agents/torch/ppo/ppo.py, compute_gae) and rl-games 1.6.5 (rl_games/common/
    a2c_common.py, the training step) all normalise with this one expression."""
    x = _x((24, 512, 1), dtype, seed=3)
    theirs = (x - x.mean()) / (x.std() + 1e-8)
    got = rt.masked_whiten(x, eps_mode="std", backend=backend)
    torch.testing.assert_close(got, theirs, rtol=TOL[dtype] * 5, atol=TOL[dtype] * 5)


@pytest.mark.parametrize("options", [dict(unbiased=False), dict(eps=0.5), dict(shift_mean=False),
                                     dict(scale=False)])
def test_std_mode_options(backend, options):
    x = _x((8, 33), F64, seed=4)
    _close(rt.masked_whiten(x, eps_mode="std", backend=backend, **options), _std_whitened(x, **options), F64)


def test_std_mode_eps_is_added_to_the_std_not_the_variance(cpu_backend):
    x = torch.tensor([0.0, 2.0], dtype=F64)  # mean 1, unbiased std sqrt(2)
    eps = 0.25
    y = rt.masked_whiten(x, eps_mode="std", eps=eps, backend=cpu_backend)
    _close(y, [-1 / (math.sqrt(2) + eps), 1 / (math.sqrt(2) + eps)], F64)
    assert abs(float(y[1]) - 1 / math.sqrt(2 + eps)) > 1e-2  # not eps_mode="add"


# -- degenerate selections and non-finite values (as for the other conventions) ------------------------
def test_std_mode_degenerate_selections(backend):
    x = _x((3, 4), F64)
    nothing = torch.zeros(3, 4, dtype=torch.bool)
    assert torch.isnan(rt.masked_whiten(x, nothing, eps_mode="std", backend=backend)).all()
    assert rt.masked_whiten(x[:0], eps_mode="std", backend=backend).shape == (0, 4)
    one = nothing.clone()
    one[1, 2] = True
    assert torch.isnan(rt.masked_whiten(x, one, eps_mode="std", backend=backend)).all()  # unbiased: 0 / 0
    y = rt.masked_whiten(x, one, eps_mode="std", unbiased=False, eps=1e-3, backend=backend)  # std 0: / eps
    _close(y, (x - x[1, 2]) / 1e-3, F64)
    single = rt.masked_whiten(x[:1, :1], eps_mode="std", backend=backend)  # one element, unbiased: torch's NaN std
    assert torch.isnan(single).all() and torch.isnan(x[:1, :1].std())


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_std_mode_non_finite(backend, value):
    x, g = _x((8, 33), F64), torch.Generator().manual_seed(2)
    m = torch.rand(8, 33, generator=g) < 0.7
    m[0, 0], m[0, 1] = True, False
    clean = rt.masked_whiten(x, m, eps_mode="std", backend=backend)
    bad = x.clone()
    bad[0, 1] = value  # outside the mask: only that position is affected
    y = rt.masked_whiten(bad, m, eps_mode="std", backend=backend)
    _close(y[m], clean[m], F64)
    assert not torch.isfinite(y[0, 1])
    bad[0, 0] = value  # inside: the mean is non-finite, M2 NaN, everything NaN
    assert torch.isnan(rt.masked_whiten(bad, m, eps_mode="std", backend=backend)).all()
    assert torch.isnan(rt.masked_whiten(bad, eps_mode="std", backend=backend)).all()


def test_std_mode_autograd():
    a = _x((4, 6), F64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: rt.masked_whiten(t, eps_mode="std", eps=1e-3), (a,))
    theirs = torch.autograd.grad(((a - a.mean()) / (a.std() + 1e-3)).pow(3).sum(), a)[0]
    ours = torch.autograd.grad(rt.masked_whiten(a, eps_mode="std", eps=1e-3).pow(3).sum(), a)[0]
    torch.testing.assert_close(ours, theirs)


# -- gae(whiten=...) without a mask ---------------------------------------------------------------------
def _rollout(T, N, dtype, seed):
    """Time-major [T, N, 1] rollouts with dones (rsl_rl's layout) and float next values."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, N, 1, generator=g, dtype=F64).to(dtype)
    v = torch.randn(T, N, 1, generator=g, dtype=F64).to(dtype)
    last = torch.randn(N, 1, generator=g, dtype=F64).to(dtype)
    done = torch.rand(T, N, 1, generator=g) < 0.1
    return r, v, last, done


def _oracle_adv(r, v, last, done, gamma, lmbda, term=None):
    """Oracle GAE on the [N, T] rows of a [T, N, 1] rollout; advantages [T, N, 1] and targets."""
    rows = lambda x: x.double()[..., 0].T.numpy()  # noqa: E731
    R, T = rows(r).shape
    nv = np.concatenate([rows(v)[:, 1:], last.double().numpy().reshape(R, 1)], 1)
    adv, ret = oracle.gae(rows(r), rows(v), nv, rows(done if term is None else term), rows(done),
                          np.full((R, T), gamma), np.full((R, T), lmbda))
    return adv.T[..., None], ret.T[..., None]


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("shape", [(24, 50), (5, 4096), (3, 1)])
def test_gae_whitens_every_element(backend, dtype, shape):
    if backend == "triton" and shape[1] > 1000:
        pytest.skip("the interpreter's time")
    T, N = shape
    r, v, last, done = _rollout(T, N, dtype, seed=N)
    raw, want_ret = _oracle_adv(r, v, last, done, 0.99, 0.95)
    adv, ret = rt.gae(r, v, bootstrap_value=last, done=done, time_dim=0, whiten=STD, backend=backend)
    tol = TOL[dtype] * (1 if dtype == F64 else 10)
    torch.testing.assert_close(ret.double(), torch.from_numpy(want_ret), rtol=tol, atol=tol)
    torch.testing.assert_close(adv.double(), torch.from_numpy(_std_whitened(raw)), rtol=tol, atol=tol)
    assert adv.shape == r.shape and adv.dtype == dtype
    out = (torch.empty_like(r), torch.empty_like(r))
    got = rt.gae(r, v, bootstrap_value=last, done=done, time_dim=0, whiten=STD, backend=backend, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    torch.testing.assert_close(out[0], adv, rtol=0, atol=0)
    torch.testing.assert_close(out[1], ret, rtol=0, atol=0)


@pytest.mark.parametrize("whiten", [True, dict(unbiased=False, eps_mode="clamp"), dict(STD, shift_mean=False)])
def test_gae_whiten_conventions_and_flags(cpu_backend, whiten):
    """Any convention, with terminations apart from dones and explicit next values (time-outs)."""
    T, N = 9, 13
    r, v, last, done = _rollout(T, N, F64, seed=5)
    g = torch.Generator().manual_seed(6)
    term = done & (torch.rand(T, N, 1, generator=g) < 0.5)
    nv = torch.cat([v[1:], last[None]], 0)
    adv, ret = rt.gae(r, v, next_values=nv, terminated=term, done=done, time_dim=0, whiten=whiten,
                      backend=cpu_backend)
    raw, want_ret = _oracle_adv(r, v, last, done, 0.99, 0.95, term=term)
    options = {} if whiten is True else whiten
    _close(ret, want_ret, F64)
    _close(adv, rt.masked_whiten(torch.from_numpy(raw), backend="torch", **options), F64)


def test_gae_whiten_nan(backend):
    r, v, last, done = _rollout(6, 7, F64, seed=8)
    r[2, 3, 0] = float("nan")
    adv, ret = rt.gae(r, v, bootstrap_value=last, done=done, time_dim=0, whiten=STD, backend=backend)
    assert torch.isnan(adv).all()  # the NaN reaches the statistics
    assert torch.isfinite(ret[3:]).all() and torch.isnan(ret[2, 3, 0])  # targets as without whitening


def test_gae_whiten_empty(cpu_backend):
    r = torch.empty(0, 4, 1)
    adv, ret = rt.gae(r, r, time_dim=0, whiten=STD, backend=cpu_backend)
    assert adv.shape == ret.shape == (0, 4, 1)


def test_gae_whiten_bad_arguments():
    r = torch.zeros(4, 3)
    with pytest.raises(ValueError, match="whiten with cu_seqlens needs a mask"):
        rt.gae(r.view(-1), r.view(-1), cu_seqlens=torch.tensor([0, 5, 12]), whiten=True)
    with pytest.raises(ValueError, match="eps_mode must be one of"):
        rt.gae(r, r, whiten=dict(eps_mode="sqrt"))
    with pytest.raises(TypeError, match="whiten must be"):
        rt.gae(r, r, whiten="std")
    with pytest.raises(ValueError, match="does not support autograd"):
        rt.gae(r, r.clone().requires_grad_(), whiten=STD)
