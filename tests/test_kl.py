"""KL shaping inside GAE (``gae(..., kl=...)``, docs/semantics.md section 13.1): every backend
against the float64 oracle and against the two-pass computation (the rewards shaped with torch
ops, then ``gae``), each estimator, with and without a clamp, every mask mode, both time layouts,
log-probs of another dtype than the rewards, packed sequences, autograd, ``out=``, NaN and the
argument checks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import TOL, as_f64, assert_matches

import rl_triton as rt
from rl_triton.core.estimators import kl_estimate
from rl_triton.testing import oracle

ESTIMATORS = ["k1", "k2", "k3", "abs"]
MODES = [None, "skip", "pad"]


def _problem(R, T, dtype, seed, spread=6.0):
    """Rewards, values, a mask with an all-masked row and holes, and log-probs whose differences
    reach past k3's bounds (|d| up to 30, so both clips of k3 and any clamp act)."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(R, T, generator=g, dtype=torch.float64)
    v = torch.randn(R, T, generator=g, dtype=torch.float64)
    lp = -spread * torch.rand(R, T, generator=g, dtype=torch.float64)
    ref = -spread * torch.rand(R, T, generator=g, dtype=torch.float64)
    lp[0, :3] = torch.tensor([-30.0, 0.0, -0.5])
    ref[0, :3] = torch.tensor([0.0, -30.0, -0.5])
    m = torch.rand(R, T, generator=g) < 0.75
    if R > 2:
        m[1] = False
        m[2, 2:4] = False
        m[2, -1] = False
    return [x.to(dtype) for x in (r, v, lp, ref)] + [m]


def _expected(r, v, lp, ref, m, mode, coef, estimator, clamp, gamma, lmbda):
    shaped = oracle.kl_shaped_rewards(as_f64(r), as_f64(lp), as_f64(ref), coef, estimator, clamp)
    R, T = shaped.shape
    g, l = np.full((R, T), gamma), np.full((R, T), lmbda)
    if mode is None:
        nv = oracle.implied_next_values(as_f64(v))
        zeros = np.zeros((R, T))
        return oracle.gae(shaped, as_f64(v), nv, zeros, zeros, g, l)
    return oracle.gae_masked(shaped, as_f64(v), m.numpy(), g, l, mode=mode)


def _mask_kw(m, mode):
    return {} if mode is None else dict(mask=m, mask_mode=mode)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("clamp", [None, 0.7])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_matches_the_oracle(backend, estimator, mode, clamp, dtype):
    r, v, lp, ref, m = _problem(4, 13, dtype, seed=1)
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.3, estimator=estimator, clamp=clamp)
    adv, tgt = rt.gae(r, v, gamma=0.97, lmbda=0.9, kl=kl, backend=backend, **_mask_kw(m, mode))
    want_adv, want_tgt = _expected(r, v, lp, ref, m, mode, 0.3, estimator, clamp, 0.97, 0.9)
    assert_matches(adv, want_adv, dtype, "advantages")
    assert_matches(tgt, want_tgt, dtype, "value_targets")


REGIMES = {
    "one chunk, rows per program": dict(block_t=16, block_r=2),
    "chunked carry": dict(block_t=4, block_r=1),
    "split time": dict(block_t=2, block_r=2, n_seg=3),
}


@pytest.mark.parametrize("plan", list(REGIMES))
@pytest.mark.parametrize("mode", MODES)
def test_triton_launch_regimes(plan, mode):
    """The Triton engine's regimes forced small (tests/test_triton_regimes.py): the KL terms are
    per step, formed in each chunk's BUILD wherever the chunk runs."""
    from conftest import require_backend
    from rl_triton.core import kernels

    require_backend("triton")
    r, v, lp, ref, m = _problem(3, 13, torch.float64, seed=15)
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.3, estimator="k3", clamp=2.0)
    with kernels.forced_plan(**REGIMES[plan]):
        adv, tgt = rt.gae(r, v, gamma=0.9, lmbda=0.8, kl=kl, backend="triton", **_mask_kw(m, mode))
    want_adv, want_tgt = _expected(r, v, lp, ref, m, mode, 0.3, "k3", 2.0, 0.9, 0.8)
    assert_matches(adv, want_adv, torch.float64, "advantages")
    assert_matches(tgt, want_tgt, torch.float64, "value_targets")


def _two_pass(r, v, lp, ref, coef, estimator, clamp, backend, **kw):
    """The rewards shaped with torch ops in the compute dtype, then gae without kl."""
    compute = torch.float64 if r.dtype == torch.float64 else torch.float32
    shaped = r.to(compute) - coef * kl_estimate(lp.to(compute), ref.to(compute), estimator, clamp)
    return rt.gae(shaped.to(r.dtype) if r.dtype != compute else shaped, v, backend=backend, **kw)


@pytest.mark.parametrize("lp_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_two_pass_time_major_and_log_prob_dtypes(backend, estimator, mode, lp_dtype):
    """[T, N] data (time_dim=0) with float32 rewards and log-probs of another dtype, read in
    float32: the same as shaping the rewards first."""
    r, v, lp, ref, m = _problem(5, 11, torch.float32, seed=2)
    r, v, m = r.t().contiguous(), v.t().contiguous(), m.t().contiguous()
    lp, ref = lp.t().contiguous().to(lp_dtype), ref.t().contiguous().to(lp_dtype)
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.05, estimator=estimator, clamp=10.0)
    kw = dict(gamma=1.0, lmbda=0.95, time_dim=0, **_mask_kw(m, mode))
    got = rt.gae(r, v, kl=kl, backend=backend, **kw)
    want = _two_pass(r, v, lp, ref, 0.05, estimator, 10.0, "torch", **kw)
    for a, b in zip(got, want):
        assert a.shape == b.shape == r.shape and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["skip", "pad"])
def test_bfloat16_data(backend, mode):
    """bfloat16 rewards, values and log-probs: computed in float32, written in bfloat16."""
    r, v, lp, ref, m = (x.to(torch.bfloat16) if x.is_floating_point() else x for x in _problem(3, 9, torch.float64, 3))
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.1, estimator="k2")
    adv, tgt = rt.gae(r, v, kl=kl, backend=backend, **_mask_kw(m, mode))
    want_adv, want_tgt = _expected(r, v, lp, ref, m, mode, 0.1, "k2", None, 0.99, 0.95)
    assert adv.dtype == torch.bfloat16
    assert_matches(adv, want_adv, torch.bfloat16, "advantages")
    assert_matches(tgt, want_tgt, torch.bfloat16, "value_targets")


@pytest.mark.parametrize("mode", MODES)
def test_packed_sequences(backend, mode):
    """cu_seqlens: the kl tensors are packed like the rewards, and each sequence is its own row."""
    lengths = [3, 7, 1, 5]
    n = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)])
    r, v, lp, ref, m = _problem(1, n, torch.float64, seed=4)
    r, v, lp, ref, m = (x[0] for x in (r, v, lp, ref, m))
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.2, estimator="k3")
    got = rt.gae(r, v, kl=kl, cu_seqlens=cu, backend=backend, **_mask_kw(m, mode))
    want = _two_pass(r, v, lp, ref, 0.2, "k3", None, "torch", cu_seqlens=cu, **_mask_kw(m, mode))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", MODES)
def test_out(backend, mode):
    r, v, lp, ref, m = _problem(3, 8, torch.float32, seed=5)
    out = (torch.full_like(r, 7.0), torch.full_like(r, 7.0))
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.4, estimator="abs")
    got = rt.gae(r, v, kl=kl, out=out, backend=backend, **_mask_kw(m, mode))
    assert got[0] is out[0] and got[1] is out[1]
    want = _two_pass(r, v, lp, ref, 0.4, "abs", None, "torch", **_mask_kw(m, mode))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_autograd_through_the_log_probs(estimator, mode):
    """Gradients with respect to the log-probs, values and rewards: those of the two-pass graph."""
    r, v, lp, ref, m = _problem(3, 8, torch.float64, seed=6, spread=2.0)
    leaves = [x.clone().requires_grad_(True) for x in (r, v, lp, ref)]
    kl = dict(log_probs=leaves[2], ref_log_probs=leaves[3], coef=0.3, estimator=estimator)
    adv, tgt = rt.gae(leaves[0], leaves[1], kl=kl, **_mask_kw(m, mode))
    (adv.sum() + (tgt ** 2).sum()).backward()
    got = [x.grad for x in leaves]
    twin = [x.clone().requires_grad_(True) for x in (r, v, lp, ref)]
    shaped = twin[0] - 0.3 * kl_estimate(twin[2], twin[3], estimator, None)
    adv, tgt = rt.gae(shaped, twin[1], backend="torch", **_mask_kw(m, mode))
    (adv.sum() + (tgt ** 2).sum()).backward()
    for a, b in zip(got, (x.grad for x in twin)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["skip", "pad"])
def test_nan_at_a_masked_token_stays_out(backend, mode):
    """A NaN or inf log-prob at a masked token is never read; at an unmasked token it makes the
    shaped reward NaN, as a NaN reward would."""
    r, v, lp, ref, m = _problem(3, 8, torch.float32, seed=7)
    m[0, 4] = False
    clean = rt.gae(r, v, kl=dict(log_probs=lp, ref_log_probs=ref, coef=0.1), backend=backend, **_mask_kw(m, mode))
    lp_bad, ref_bad = lp.clone(), ref.clone()
    lp_bad[0, 4], ref_bad[0, 4] = math.nan, math.inf
    dirty = rt.gae(r, v, kl=dict(log_probs=lp_bad, ref_log_probs=ref_bad, coef=0.1), backend=backend,
                   **_mask_kw(m, mode))
    for a, b in zip(clean, dirty):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    m2 = m.clone()
    m2[0, 4] = True
    adv, _ = rt.gae(r, v, kl=dict(log_probs=lp_bad, ref_log_probs=ref, coef=0.1), backend=backend,
                    **_mask_kw(m2, mode))
    assert torch.isnan(adv[0, 4])


def test_k3_bounds_and_infinities():
    """k3 is at most 10, 10 for infinite log-ratios, NaN for NaN (oracle and every formula)."""
    lp = torch.tensor([[0.0, -40.0, 40.0, -math.inf, 0.0, math.nan, -1.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 0.0, 0.0, 0.0, -math.inf, 0.0, -1.0]], dtype=torch.float64)
    zero = torch.zeros_like(lp)
    kl = -oracle.kl_shaped_rewards(zero.numpy(), lp.numpy(), ref.numpy(), 1.0, "k3")
    assert kl[0, 0] == 0.0 and kl[0, 1] == 10.0 and kl[0, 2] == 10.0 and kl[0, 3] == 10.0 and kl[0, 4] == 10.0
    assert math.isnan(kl[0, 5]) and kl[0, 6] == 0.0
    torch.testing.assert_close(kl_estimate(lp, ref, "k3", None), torch.from_numpy(kl), equal_nan=True)


def test_whiten_applies_to_the_shaped_advantages():
    r, v, lp, ref, m = _problem(4, 9, torch.float64, seed=8)
    kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.3, estimator="k1")
    adv, tgt = rt.gae(r, v, mask=m, kl=kl, whiten=True)
    plain_adv, plain_tgt = rt.gae(r, v, mask=m, kl=kl)
    torch.testing.assert_close(tgt, plain_tgt)
    torch.testing.assert_close(adv, rt.masked_whiten(plain_adv, m))


def test_coefficient_zero_and_no_kl_are_gae():
    r, v, lp, ref, m = _problem(3, 7, torch.float64, seed=9, spread=1.0)
    for backend in ("torch", "cpu"):
        got = rt.gae(r, v, mask=m, kl=dict(log_probs=lp, ref_log_probs=ref, coef=0.0), backend=backend)
        want = rt.gae(r, v, mask=m, backend=backend)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kl,error,words", [
    ([1.0], TypeError, "kl must be None or a dict"),
    (dict(log_probs=None, ref_log_probs=None, coef=0.1, beta=1), ValueError, "beta"),
    (dict(ref_log_probs="x", coef=0.1), ValueError, "'log_probs'"),
    (dict(log_probs="x", ref_log_probs="x"), ValueError, "'coef'"),
    (dict(log_probs="x", ref_log_probs="x", coef=0.1, estimator="low_var_kl"), ValueError, "kl['estimator']"),
    (dict(log_probs="x", ref_log_probs="x", coef=True), TypeError, "kl['coef']"),
    (dict(log_probs="x", ref_log_probs="x", coef="0.1"), TypeError, "kl['coef']"),
    (dict(log_probs="x", ref_log_probs="x", coef=math.nan), ValueError, "kl['coef']"),
    (dict(log_probs="x", ref_log_probs="x", coef=0.1, clamp=0.0), ValueError, "kl['clamp']"),
    (dict(log_probs="x", ref_log_probs="x", coef=0.1, clamp="10"), TypeError, "kl['clamp']"),
    (dict(log_probs="x", ref_log_probs=torch.zeros(2, 5), coef=0.1), TypeError, "kl['log_probs']"),
    (dict(log_probs=torch.zeros(2, 5), ref_log_probs=torch.zeros(2, 4), coef=0.1), ValueError,
     "kl['ref_log_probs']"),
    (dict(log_probs=torch.zeros(2, 5, dtype=torch.int64), ref_log_probs=torch.zeros(2, 5), coef=0.1), TypeError,
     "kl['log_probs']"),
])
def test_argument_errors_name_the_key(kl, error, words, monkeypatch):
    """Each bad entry raises before any work: no launch, no scan."""
    from rl_triton.core import launch, scan

    def no_work(*args, **kwargs):
        raise AssertionError("work ran before the arguments were checked")

    monkeypatch.setattr(launch, "run", no_work)
    monkeypatch.setattr(scan, "call_scan", no_work)
    r = torch.zeros(2, 5)
    with pytest.raises(error) as info:
        rt.gae(r, r, mask=torch.ones(2, 5), kl=kl)
    assert words in str(info.value)
    with pytest.raises(error):
        rt.gae(r, r, kl=kl, backend="torch")


def _sharded_worker(rank, world, group):
    """Each rank passes its chunk of steps (the kl tensors cut like the rewards): the same as the
    unsharded call on every backend."""
    from test_distributed import _backends, _bounds

    bounds = _bounds(world)
    lo, hi = bounds[rank], bounds[rank + 1]
    r, v, lp, ref, m = _problem(3, bounds[-1], torch.float64, seed=10 + world)
    for backend in _backends():
        for mode in MODES:
            for estimator in ESTIMATORS:
                kl = dict(log_probs=lp, ref_log_probs=ref, coef=0.3, estimator=estimator)
                whole = rt.gae(r, v, kl=kl, backend=backend, **_mask_kw(m, mode))
                part = dict(kl, log_probs=lp[:, lo:hi], ref_log_probs=ref[:, lo:hi])
                mask = {} if mode is None else dict(mask=m[:, lo:hi], mask_mode=mode)
                got = rt.gae(r[:, lo:hi], v[:, lo:hi], kl=part, backend=backend, group=group, **mask)
                for a, b in zip(got, whole):
                    torch.testing.assert_close(a, b[:, lo:hi], rtol=1e-12, atol=1e-12,
                                               msg=f"{backend} {mode} {estimator} rank {rank}")


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("world", [2, 3])
def test_sequences_split_across_ranks(world):
    from helpers import spawn_gloo

    spawn_gloo(_sharded_worker, world)


# -- the drop-ins' fused calls ------------------------------------------------------------------
VERL_PENALTIES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3",
                  "k3+": "k3", "k1+": "k1"}


@pytest.mark.parametrize("penalty", sorted(VERL_PENALTIES))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_verl_kl_penalty_then_gae(cpu_backend, penalty, dtype, monkeypatch):
    """verl's apply_kl_penalty (scores - beta * kld * mask) then its whitened GAE: the oracle's
    shaped rewards through the GAE drop-in (checked against verl in tests/test_verl.py)."""
    from rl_triton.integrations import verl as rt_verl

    monkeypatch.setenv("RL_TRITON_BACKEND", cpu_backend)
    r, v, lp, ref, m = _problem(4, 12, dtype, seed=11)
    mf = m.to(dtype)
    shaped = oracle.kl_shaped_rewards(as_f64(r), as_f64(lp), as_f64(ref), 0.2, VERL_PENALTIES[penalty])
    shaped = torch.from_numpy(np.where(m.numpy(), shaped, as_f64(r))).to(dtype)  # verl: kld * mask
    want = rt_verl.compute_gae_advantage_return(shaped, v, mf, 1.0, 0.95)
    got = rt_verl.compute_gae_advantage_return_with_kl(r, v, mf, lp, ref, 0.2, penalty, 1.0, 0.95)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=TOL[dtype], atol=TOL[dtype] * 10)


def test_verl_unknown_kl_penalty():
    from rl_triton.integrations import verl as rt_verl

    r, v, lp, ref, m = _problem(3, 5, torch.float32, seed=12)
    for bad in ("full", "k4", None):
        with pytest.raises(ValueError, match="kl_penalty") as info:
            rt_verl.compute_gae_advantage_return_with_kl(r, v, m, lp, ref, 0.1, bad)
        assert isinstance(info.value, NotImplementedError)  # verl raises that


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("values_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_openrlhf_compute_reward_then_gae(cpu_backend, estimator, values_dtype, monkeypatch):
    """OpenRLHF's compute_reward (the score at each row's last action token, minus
    max(kl_coef, 0) * kl with every estimate clamped to [-10, 10], in float32) then its GAE: the
    oracle's shaped rewards through the GAE drop-in (checked against OpenRLHF in
    tests/test_openrlhf.py)."""
    from rl_triton.integrations import openrlhf as rt_openrlhf

    monkeypatch.setenv("RL_TRITON_BACKEND", cpu_backend)
    R, T = 4, 10
    r, v, lp, ref, m = _problem(R, T, torch.float64, seed=13)
    m[3] = False
    m[3, 2] = True
    m[0, -3:] = False
    scores = torch.linspace(-1.0, 2.0, R, dtype=torch.float64)
    tokens = np.zeros((R, T))
    for i in range(R):
        valid = np.flatnonzero(m[i].numpy())
        tokens[i, valid[-1] if valid.size else T - 1] = float(scores[i].float())
    lp32, ref32 = lp.float(), ref.float()
    shaped = oracle.kl_shaped_rewards(tokens, as_f64(lp32), as_f64(ref32), 0.05, estimator, clamp=10.0)
    v = v.to(values_dtype)
    want = rt_openrlhf.get_advantages_and_returns(v, torch.from_numpy(shaped).float(), m, 1.0, 0.95)
    got = rt_openrlhf.compute_reward_advantages_and_returns(scores, 0.05, lp32, ref32, v, m, 1.0, 0.95,
                                                            kl_estimator=estimator)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # a coefficient <= 0 is no penalty; the clip range clamps the scores
    plain = rt_openrlhf.compute_reward_advantages_and_returns(scores, -1.0, lp32, ref32, v, m, 1.0, 0.95,
                                                              reward_clip_range=(-0.5, 0.5))
    tokens_clipped = np.clip(tokens, -0.5, 0.5)
    want = rt_openrlhf.get_advantages_and_returns(v, torch.from_numpy(tokens_clipped).float(), m, 1.0, 0.95)
    for a, b in zip(plain, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_openrlhf_argument_errors():
    from rl_triton.integrations import openrlhf as rt_openrlhf

    r, v, lp, ref, m = _problem(3, 5, torch.float32, seed=14)
    s = torch.zeros(3)
    with pytest.raises(ValueError, match="kl_estimator"):
        rt_openrlhf.compute_reward_advantages_and_returns(s, 0.1, lp, ref, v, m, 1.0, 0.95, kl_estimator="abs")
    with pytest.raises(ValueError, match="r must be"):
        rt_openrlhf.compute_reward_advantages_and_returns(s[:2], 0.1, lp, ref, v, m, 1.0, 0.95)
    with pytest.raises(TypeError, match="action_mask"):
        rt_openrlhf.compute_reward_advantages_and_returns(s, 0.1, lp, ref, v, None, 1.0, 0.95)
    with pytest.raises(TypeError, match="kl_coef"):
        rt_openrlhf.compute_reward_advantages_and_returns(s, "0.1", lp, ref, v, m, 1.0, 0.95)
