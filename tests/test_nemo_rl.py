"""rl_triton.integrations.nemo_rl against NeMo-RL's GAE loop.

NeMo-RL is not installable from the package index (nor on a CPU-only machine), so the reference
is a transcription: rl_triton.testing.frameworks.nemo_rl_compute_gae, NeMo-RL's
``GeneralizedAdvantageEstimator._compute_gae`` from NVIDIA-NeMo/RL at commit
7ea279abfbeb698b092856d0dab61e7cf39bc909, nemo_rl/algorithms/advantage_estimator.py. The tests:

- compute_gae against the transcription and the float64 oracle (masks with holes as in
  multi-turn responses, an all-masked row, a per-sample lambda as VAPO's length-adaptive one),
  float64 to 1e-12 and float32; dtypes, detached outputs, errors;
- patch()/unpatch()/patched()/is_patched() on a stand-in ``nemo_rl.algorithms.advantage_estimator``
  whose GeneralizedAdvantageEstimator calls the transcription through ``self._compute_gae``, as
  NeMo-RL's ``compute_advantage`` does (decoupled value and policy lambdas included).
"""

from __future__ import annotations

import importlib
import os
import sys
import types

import numpy as np
import pytest
import torch

import rl_triton.integrations.nemo_rl as rt_nemo
from rl_triton.integrations._patching import FrameworkNotInstalled
from rl_triton.testing import oracle
from rl_triton.testing.frameworks import nemo_rl_compute_gae

from helpers import ROOT, concurrent_patch_use, nested_blocks_across_threads

F64, F32 = torch.float64, torch.float32
MODULE = "nemo_rl.algorithms.advantage_estimator"


@pytest.fixture(params=["cpu", "torch"])
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


def batch(dtype, B=6, T=41, seed=0, mask_dtype=None):
    """Rewards, values and a response mask: a prompt prefix, two assistant turns split by a tool
    output, right padding, one row with no response token."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    v = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    m = torch.zeros(B, T)
    for i in range(B):
        start, end = int(torch.randint(0, 6, (1,), generator=g)), T - int(torch.randint(0, 8, (1,), generator=g))
        m[i, start:end] = 1
        hole = int(torch.randint(start, max(start + 1, end - 4), (1,), generator=g))
        m[i, hole:hole + 3] = 0
    m[3] = 0
    return r, v, m.to(mask_dtype or dtype)


def length_adaptive(mask, alpha=0.05):
    """VAPO's per-sample lambda, 1 - 1 / (alpha * length), as NeMo-RL forms it: a float32 [B] tensor."""
    lengths = mask.sum(dim=1).float()
    return (1.0 - 1.0 / (alpha * lengths).clamp(min=1.0)).clamp(min=0.0, max=1.0)


def close(got, expected, dtype):
    tol = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0), (1.0, "adaptive")])
def test_matches_nemo_rl_loop(use_backend, dtype, gamma, lam):
    r, v, m = batch(dtype)
    if lam == "adaptive":
        lam = length_adaptive(m)
    adv, ret = rt_nemo.compute_gae(r, v, m, gamma, lam)
    ref_adv, ref_ret = nemo_rl_compute_gae(r, v, m, gamma, lam)
    assert adv.dtype == ref_adv.dtype and ret.dtype == ref_ret.dtype
    close(adv, ref_adv.to(F64), dtype)
    close(ret, ref_ret.to(F64), dtype)
    assert not adv.requires_grad and not ret.requires_grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_oracle_with_per_sample_lambda(use_backend, seed):
    r, v, m = batch(F64, seed=seed)
    lam = length_adaptive(m, alpha=0.1)
    adv, ret = rt_nemo.compute_gae(r, v, m, 0.99, lam)
    B, T = r.shape
    a, targets = oracle.gae_masked(r, v, m, np.full((B, T), 0.99), np.repeat(lam.double().numpy()[:, None], T, 1))
    close(adv, a, F64)
    close(ret, targets, F64)


def test_integer_mask_and_mixed_dtypes():
    r, v, m = batch(F32, mask_dtype=torch.int64)
    adv, ret = rt_nemo.compute_gae(r, v, m, 1.0, 0.95)
    ref_adv, ref_ret = nemo_rl_compute_gae(r, v, m, 1.0, 0.95)
    assert adv.dtype == ref_adv.dtype == F32
    close(adv, ref_adv.double(), F32)
    r, v, m = batch(F32, mask_dtype=F64)
    adv, _ = rt_nemo.compute_gae(r, v, m, 1.0, 0.95)
    assert adv.dtype == nemo_rl_compute_gae(r, v, m, 1.0, 0.95)[0].dtype == F64


def test_inputs_untouched():
    r, v, m = batch(F64)
    copies = [x.clone() for x in (r, v, m)]
    rt_nemo.compute_gae(r, v, m, 1.0, length_adaptive(m))
    assert all(torch.equal(x, c) for x, c in zip((r, v, m), copies))


def test_bad_inputs():
    r, v, m = batch(F64)
    with pytest.raises(TypeError, match="token_level_rewards"):
        rt_nemo.compute_gae(r.numpy(), v, m, 1.0, 0.95)
    with pytest.raises(TypeError, match="mask"):
        rt_nemo.compute_gae(r, v, None, 1.0, 0.95)
    with pytest.raises(ValueError, match="same shape|one shape"):
        rt_nemo.compute_gae(r, v[:, :-1], m, 1.0, 0.95)
    with pytest.raises(ValueError, match="lam"):
        rt_nemo.compute_gae(r, v, m, 1.0, torch.full((r.shape[0] + 1,), 0.9))
    with pytest.raises(ValueError, match="lmbda"):
        rt_nemo.compute_gae(r, v, m, 1.0, torch.full((r.shape[0],), 1.5))


# -- patch() on a stand-in NeMo-RL ----------------------------------------------------------------

class StandInEstimator:
    """The part of NeMo-RL's GeneralizedAdvantageEstimator around ``_compute_gae``: the lambda
    choice (decoupled value/policy lambdas) and the calls through ``self``."""

    def __init__(self, gamma, lam, lam_policy=None):
        self.gae_gamma, self.gae_lambda, self.gae_lambda_policy = gamma, lam, lam_policy

    def compute_advantage(self, rewards, mask, values):
        if self.gae_lambda_policy is None:
            return self._compute_gae(rewards, values, mask)
        _, returns = self._compute_gae(rewards, values, mask, gae_lambda=self.gae_lambda)
        advantages, _ = self._compute_gae(rewards, values, mask, gae_lambda=self.gae_lambda_policy)
        return advantages, returns

    def _compute_gae(self, token_level_rewards, values, mask, gae_lambda=None):
        lam = gae_lambda if gae_lambda is not None else self.gae_lambda
        return nemo_rl_compute_gae(token_level_rewards, values, mask, self.gae_gamma, lam)


@pytest.fixture
def stand_in(monkeypatch):
    cls = type("GeneralizedAdvantageEstimator", (StandInEstimator,), {})
    cls._compute_gae = StandInEstimator.__dict__["_compute_gae"]
    module = types.ModuleType(MODULE)
    module.GeneralizedAdvantageEstimator = cls
    for name in ("nemo_rl", "nemo_rl.algorithms"):
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setitem(sys.modules, MODULE, module)
    yield cls
    rt_nemo.unpatch()
    assert not rt_nemo.is_patched()


@pytest.mark.parametrize("lam_policy", [None, 0.9, "adaptive"])
def test_patched_estimator_matches_unpatched(stand_in, lam_policy):
    r, v, m = batch(F64, seed=5)
    est = stand_in(1.0, 0.95, length_adaptive(m) if lam_policy == "adaptive" else lam_policy)
    theirs = est.compute_advantage(r, m, v)
    original = stand_in.__dict__["_compute_gae"]
    rt_nemo.patch()
    rt_nemo.patch()
    assert rt_nemo.is_patched() and stand_in.__dict__["_compute_gae"] is not original
    ours = est.compute_advantage(r, m, v)
    rt_nemo.unpatch()
    assert stand_in.__dict__["_compute_gae"] is original
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(o, t, rtol=1e-12, atol=1e-12)


def test_patched_blocks_nest_cross_threads_and_keep_others(stand_in):
    original = stand_in.__dict__["_compute_gae"]

    def routes_ours():
        return stand_in.__dict__["_compute_gae"] is not original

    with rt_nemo.patched():
        with rt_nemo.patched():
            assert routes_ours()
        assert routes_ours()
    assert not routes_ours()
    assert nested_blocks_across_threads(rt_nemo.patched, routes_ours) == [True]
    assert concurrent_patch_use(rt_nemo.patched, rt_nemo.patch, rt_nemo.unpatch, routes_ours) == []
    rt_nemo.unpatch()
    rt_nemo.patch()

    def someone_elses(self, *args, **kwargs):
        return None

    stand_in._compute_gae = someone_elses
    rt_nemo.unpatch()
    assert stand_in.__dict__["_compute_gae"] is someone_elses


def test_without_nemo_rl(monkeypatch):
    monkeypatch.setitem(sys.modules, "nemo_rl", None)
    with pytest.raises(FrameworkNotInstalled, match="NVIDIA-NeMo/RL"):
        rt_nemo.patch()
    assert not rt_nemo.is_patched()


def test_benchmark_checks_and_times():
    """benchmarks/llm_loops_cpu.py on a tiny batch: each case agrees with the loop and is timed."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        bench = importlib.import_module("llm_loops_cpu")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    rows = bench.run([(8, 96)], rounds=2)
    assert {r["case"] for r in rows} == {"NeMo-RL GAE", "NeMo-RL GAE, per-sample lambda", "slime chunked_gae", "AReaL GAE"}
    for row in rows:
        assert row["agree"], row
        assert len(row["times"]["loop"]) == len(row["times"]["rl_triton"]) == 2
