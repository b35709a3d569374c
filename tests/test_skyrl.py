"""rl_triton.integrations.skyrl against the float64 oracle and against SkyRL 0.3.0's own estimators.

- each drop-in against rl_triton.testing.oracle (and a plain loop for REINFORCE++'s return) on
  random batches with masks, all-masked rows and groups of one, float64 to 1e-12 and float32;
  dtypes, detached outputs, untouched inputs, errors;
- patch()/unpatch()/patched()/is_patched() on a fake ``ppo_utils`` module whose registry refuses a
  name it holds already, as SkyRL's does (idempotent, nested, across threads, the very same
  objects restored, another object put in place meanwhile kept);
- the real SkyRL, where it is importable (tests marked ``framework``: .ci/run's llm stage installs
  skyrl 0.3.0 for them): each drop-in against SkyRL's function on the same inputs, float64 (float64
  mask) to 1e-12 and float32, SkyRL's errors, and ``compute_advantages_and_returns`` through the
  patched registry against the unpatched one.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import rl_triton.integrations.skyrl as rt_skyrl
from rl_triton.integrations._patching import FrameworkNotInstalled
from rl_triton.testing import frameworks, oracle

from helpers import ROOT, concurrent_patch_use, nested_blocks_across_threads, python_block

F64, F32 = torch.float64, torch.float32
BACKENDS = ["cpu", "torch"]  # numba and torch ops: the backends of CPU tensors
PPO_UTILS = frameworks.SKYRL_PPO_UTILS
UIDS = np.array(["p0", "p0", "p1", "p1", "p1", "p2", "p3", "p3"], dtype=object)  # p2: a group of one
B = len(UIDS)


@pytest.fixture(params=BACKENDS)
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


def batch(dtype, T=29, seed=0, mask_dtype=None):
    """Rewards, values and a response mask with holes, one all-masked row and one with a single
    valid token."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    v = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    m = torch.rand(B, T, generator=g) < 0.8
    m[:, 0] = True
    m[2] = False
    m[4] = False
    m[4, 3] = True
    m[1, -5:] = False  # right padding
    return r, v, m.to(mask_dtype or dtype)


def close(got, expected, dtype):
    expected = torch.as_tensor(expected, dtype=F64)
    if dtype == F64:
        torch.testing.assert_close(got.to(F64), expected, rtol=1e-12, atol=1e-12)
    else:
        torch.testing.assert_close(got.to(F64), expected, rtol=1e-5, atol=1e-5)


def oracle_reinforce_pp_return(r, m, gamma):
    """G[t] = r[t] + gamma * m[t+1] * G[t+1], 0 past the last token, float64, row by row."""
    r, m = np.asarray(r, np.float64), np.asarray(m) != 0
    G = np.zeros_like(r)
    for i in range(r.shape[0]):
        running = 0.0
        for t in reversed(range(r.shape[1])):
            G[i, t] = r[i, t] + gamma * running
            running = G[i, t] if m[i, t] else 0.0
    return G


# -- the drop-ins against the oracle --------------------------------------------------------------

@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.99, 1.0), (0.9, 0.0)])
def test_gae_matches_oracle(use_backend, dtype, gamma, lam):
    r, v, m = batch(dtype)
    adv, ret = rt_skyrl.compute_gae_advantage_return(r, v, m, gamma=gamma, lambd=lam)
    T = r.shape[1]
    zeros = np.zeros((B, T))
    a, targets = oracle.gae(r, v, oracle.implied_next_values(v), zeros, zeros, np.full((B, T), gamma),
                            np.full((B, T), lam))
    close(ret, targets, dtype)
    close(adv, oracle.masked_whiten(a, m), dtype)
    assert adv.dtype == ret.dtype == dtype and not adv.requires_grad


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_oracle(use_backend, dtype, norm):
    r, _, m = batch(dtype)
    adv, same = rt_skyrl.compute_grpo_outcome_advantage(r, m, UIDS, epsilon=1e-6, grpo_norm_by_std=norm)
    assert same is adv
    mode = "grpo" if norm else "drgrpo"
    close(adv, oracle.group_advantages(r.sum(-1), list(UIDS), mode=mode, mask=m), dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_rloo_matches_oracle_and_zeroes_lone_responses(use_backend, dtype):
    r, _, m = batch(dtype)
    adv, _ = rt_skyrl.compute_rloo_outcome_advantage(r, m, UIDS)
    expected = oracle.group_advantages(r.sum(-1), list(UIDS), mode="rloo", mask=m)
    expected[5] = 0.0  # p2 answers alone: SkyRL sets its advantage to 0
    close(adv, expected, dtype)
    assert torch.all(adv[5] == 0) and torch.any(adv[0] != 0)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("gamma", [1.0, 0.97])
def test_reinforce_plus_plus_matches_oracle(use_backend, dtype, gamma):
    r, _, m = batch(dtype)
    adv, ret = rt_skyrl.compute_reinforce_plus_plus_outcome_advantage(r, m, gamma=gamma)
    G = oracle_reinforce_pp_return(r, m, gamma)
    close(ret, G, dtype)
    close(adv, np.where(m.numpy() != 0, oracle.masked_whiten(G, m), 0.0), dtype)


def test_keyword_call_as_skyrl_dispatches():
    """SkyRL's compute_advantages_and_returns passes every estimator all of its arguments."""
    r, v, m = batch(F64)
    common = dict(token_level_rewards=r, response_mask=m, index=UIDS, values=v, grpo_norm_by_std=True, gamma=1.0,
                  lambd=0.95, config=None)
    for name in rt_skyrl.ESTIMATORS.values():
        adv, ret = getattr(rt_skyrl, name)(**common)
        assert adv.shape == ret.shape == r.shape


def test_dtypes_follow_skyrl_promotion():
    r, v, m = batch(F32, mask_dtype=F64)
    adv, ret = rt_skyrl.compute_gae_advantage_return(r, v, m, 1.0, 0.95)
    assert adv.dtype == ret.dtype == F32  # the mask enters only the 0-d statistics
    adv, _ = rt_skyrl.compute_grpo_outcome_advantage(r, m, UIDS)
    assert adv.dtype == F64  # scores[:, None] * response_mask
    adv, ret = rt_skyrl.compute_reinforce_plus_plus_outcome_advantage(r, m, 1.0)
    assert adv.dtype == F64 and ret.dtype == F32
    adv, _ = rt_skyrl.compute_rloo_outcome_advantage(r, m.bool(), UIDS)
    assert adv.dtype == F32


def test_inputs_untouched_and_tensor_index():
    r, v, m = batch(F64)
    copies = [x.clone() for x in (r, v, m)]
    for name in rt_skyrl.ESTIMATORS.values():
        getattr(rt_skyrl, name)(token_level_rewards=r, values=v, response_mask=m, index=UIDS, gamma=1.0, lambd=0.9)
    for x, c in zip((r, v, m), copies):
        assert torch.equal(x, c)
    ids = torch.tensor([0, 0, 1, 1, 1, 2, 3, 3])
    a, _ = rt_skyrl.compute_grpo_outcome_advantage(r, m, ids)
    b, _ = rt_skyrl.compute_grpo_outcome_advantage(r, m, UIDS)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_inputs():
    r, v, m = batch(F64)
    with pytest.raises(TypeError, match="token_level_rewards"):
        rt_skyrl.compute_gae_advantage_return(r.numpy(), v, m, 1.0, 0.95)
    with pytest.raises(TypeError, match="values"):
        rt_skyrl.compute_gae_advantage_return(r, None, m, 1.0, 0.95)
    with pytest.raises(TypeError, match="response_mask"):
        rt_skyrl.compute_grpo_outcome_advantage(r, m.tolist(), UIDS)
    with pytest.raises(ValueError, match="response_mask"):
        rt_skyrl.compute_reinforce_plus_plus_outcome_advantage(r, m[:, :-1], 1.0)
    with pytest.raises(ValueError, match="token_level_rewards"):
        rt_skyrl.compute_rloo_outcome_advantage(r[0], m[0], UIDS)
    one = torch.zeros_like(m)
    one[0, 0] = 1
    for mask in (one, torch.zeros_like(m)):
        with pytest.raises(ValueError, match="at least 2"):
            rt_skyrl.compute_gae_advantage_return(r, v, mask, 1.0, 0.95)
        with pytest.raises(ValueError, match="at least 2"):
            rt_skyrl.compute_reinforce_plus_plus_outcome_advantage(r, mask, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        rt_skyrl.compute_gae_advantage_return(r, v, m, 1.5, 0.95)


# -- patch() on a fake SkyRL ------------------------------------------------------------------------

class FakeRegistry:
    """The part of SkyRL's BaseFunctionRegistry that patch() uses (Ray not initialised):
    ``register`` refuses a name it holds, ``unregister`` refuses one it does not."""

    _functions: dict

    @classmethod
    def register(cls, name, func):
        if name in cls._functions:
            raise ValueError(f"advantage estimator '{name}' already registered")
        cls._functions[name] = func

    @classmethod
    def unregister(cls, name):
        if name not in cls._functions:
            raise ValueError(f"advantage estimator '{name}' not registered")
        del cls._functions[name]

    @classmethod
    def get(cls, name):
        return cls._functions[name]


@pytest.fixture
def fake_skyrl(monkeypatch):
    """A ``skyrl`` package whose ``ppo_utils`` holds one sentinel function per estimator (and
    ``maxrl``), registered under SkyRL's names."""
    names = dict(rt_skyrl.ESTIMATORS, maxrl="compute_maxrl_advantage")
    module = types.ModuleType(PPO_UTILS)
    registry = type("AdvantageEstimatorRegistry", (FakeRegistry,), {"_functions": {}})
    module.AdvantageEstimatorRegistry = registry
    for key, attr in names.items():
        def theirs(*args, _key=key, **kwargs):
            return ("skyrl", _key)
        theirs.__name__ = attr
        setattr(module, attr, theirs)
        registry.register(key, theirs)
    parts = PPO_UTILS.split(".")
    for i in range(1, len(parts)):
        package = types.ModuleType(".".join(parts[:i]))
        package.__path__ = []
        monkeypatch.setitem(sys.modules, package.__name__, package)
    monkeypatch.setitem(sys.modules, PPO_UTILS, module)
    yield module
    rt_skyrl.unpatch()
    assert not rt_skyrl.is_patched()


def originals(module):
    return {k: module.AdvantageEstimatorRegistry._functions[k] for k in module.AdvantageEstimatorRegistry._functions}


def test_patch_routes_the_registry_and_the_module(fake_skyrl):
    before = originals(fake_skyrl)
    attrs = {name: getattr(fake_skyrl, name) for name in rt_skyrl.ESTIMATORS.values()}
    rt_skyrl.patch()
    rt_skyrl.patch()  # idempotent
    assert rt_skyrl.is_patched()
    reg = fake_skyrl.AdvantageEstimatorRegistry
    for key, name in rt_skyrl.ESTIMATORS.items():
        assert reg.get(key) is getattr(rt_skyrl, name) is getattr(fake_skyrl, name)
    assert reg.get("maxrl") is before["maxrl"]
    r, v, m = batch(F64)
    adv, _ = reg.get("gae")(token_level_rewards=r, values=v, response_mask=m, gamma=1.0, lambd=0.95, index=UIDS)
    assert isinstance(adv, torch.Tensor)
    rt_skyrl.unpatch()
    rt_skyrl.unpatch()
    assert not rt_skyrl.is_patched()
    after = originals(fake_skyrl)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert all(getattr(fake_skyrl, n) is f for n, f in attrs.items())


def test_unpatch_keeps_what_someone_else_put_in_place(fake_skyrl):
    reg = fake_skyrl.AdvantageEstimatorRegistry
    rt_skyrl.patch()

    def custom(**kwargs):
        return None

    reg.unregister("grpo")
    reg.register("grpo", custom)
    fake_skyrl.compute_gae_advantage_return = custom
    rt_skyrl.unpatch()
    assert reg.get("grpo") is custom and fake_skyrl.compute_gae_advantage_return is custom
    assert reg.get("gae")() == ("skyrl", "gae")  # SkyRL's own, back


def test_patched_blocks_nest_and_cross_threads(fake_skyrl):
    reg = fake_skyrl.AdvantageEstimatorRegistry
    theirs = reg.get("gae")

    def routes_ours():
        return reg.get("gae") is rt_skyrl.compute_gae_advantage_return

    with rt_skyrl.patched():
        with rt_skyrl.patched():
            assert routes_ours()
        assert routes_ours()
    assert reg.get("gae") is theirs
    assert nested_blocks_across_threads(rt_skyrl.patched, routes_ours) == [True]
    assert concurrent_patch_use(rt_skyrl.patched, rt_skyrl.patch, rt_skyrl.unpatch, routes_ours) == []
    rt_skyrl.unpatch()
    assert reg.get("gae") is theirs


def test_errors_are_skyrls_where_it_is_imported(fake_skyrl):
    def theirs(*args, **kwargs):
        raise RuntimeError("SkyRL's own message")

    fake_skyrl.compute_gae_advantage_return = theirs
    r, v, m = batch(F64)
    with pytest.raises(RuntimeError, match="SkyRL's own message"):
        rt_skyrl.compute_gae_advantage_return(r, v, torch.zeros_like(m), 1.0, 0.95)
    assert rt_skyrl.compute_gae_advantage_return(r, v, m, 1.0, 0.95)[0].shape == r.shape  # theirs not run


def test_without_skyrl(monkeypatch):
    monkeypatch.setitem(sys.modules, "skyrl", None)
    with pytest.raises(FrameworkNotInstalled, match=r"\.\[skyrl\]"):
        rt_skyrl.patch()
    with pytest.raises(FrameworkNotInstalled):
        rt_skyrl.patched()
    assert not rt_skyrl.is_patched()
    r, v, m = batch(F64)
    assert rt_skyrl.compute_gae_advantage_return(r, v, m, 1.0, 0.95)[0].shape == r.shape


# -- the real SkyRL (.ci/run's llm stage) ------------------------------------------------------------

@pytest.fixture(scope="module")
def ppo_utils():
    pytest.importorskip("skyrl")
    return frameworks.skyrl_ppo_utils()


def theirs_and_ours(ppo_utils, name, **kwargs):
    fresh = {k: x.clone() if isinstance(x, torch.Tensor) else x for k, x in kwargs.items()}
    return getattr(ppo_utils, name)(**fresh), getattr(rt_skyrl, name)(**kwargs)


def real_cases(dtype, mask_dtype, seed):
    r, v, m = batch(dtype, T=53, seed=seed, mask_dtype=mask_dtype)
    yield "compute_gae_advantage_return", dict(token_level_rewards=r, values=v, response_mask=m, gamma=0.99,
                                               lambd=0.95)
    yield "compute_gae_advantage_return", dict(token_level_rewards=r, values=v, response_mask=m, gamma=1.0, lambd=1.0)
    for norm in (True, False):
        yield "compute_grpo_outcome_advantage", dict(token_level_rewards=r, response_mask=m, index=UIDS,
                                                     grpo_norm_by_std=norm)
    yield "compute_rloo_outcome_advantage", dict(token_level_rewards=r, response_mask=m, index=UIDS)
    for gamma in (1.0, 0.95):
        yield "compute_reinforce_plus_plus_outcome_advantage", dict(token_level_rewards=r, response_mask=m,
                                                                    gamma=gamma)


@pytest.mark.framework
@pytest.mark.parametrize("dtype,mask_dtype,tol", [(F64, F64, 1e-12), (F32, F32, 1e-5), (F32, torch.bool, 1e-5),
                                                  (F64, torch.bool, 1e-6), (F64, torch.int64, 1e-6)])
@pytest.mark.parametrize("seed", [0, 1])
def test_real_skyrl(use_backend, ppo_utils, dtype, mask_dtype, tol, seed):
    """float64 with a float64 mask to 1e-12; with a bool or integer mask SkyRL forms its Bessel
    factor n / (n - 1) in float32 (int64 / int64), a relative 1e-7."""
    for name, kwargs in real_cases(dtype, mask_dtype, seed):
        theirs, ours = theirs_and_ours(ppo_utils, name, **kwargs)
        for t, o in zip(theirs, ours):
            assert o.dtype == t.dtype and o.shape == t.shape, name
            torch.testing.assert_close(o, t, rtol=tol, atol=tol, msg=name)


@pytest.mark.framework
def test_real_skyrl_errors(ppo_utils):
    r, v, m = batch(F64)
    one = torch.zeros_like(m)
    one[3, 2] = 1
    for mask in (one, torch.zeros_like(m)):
        for name, kwargs in [("compute_gae_advantage_return", dict(values=v, lambd=0.9, gamma=1.0)),
                             ("compute_reinforce_plus_plus_outcome_advantage", dict(gamma=1.0))]:
            with pytest.raises(ValueError) as theirs:
                getattr(ppo_utils, name)(token_level_rewards=r.clone(), response_mask=mask, **kwargs)
            with pytest.raises(ValueError) as ours:
                getattr(rt_skyrl, name)(token_level_rewards=r, response_mask=mask, **kwargs)
            assert str(ours.value) == str(theirs.value)


@pytest.mark.framework
@pytest.mark.parametrize("estimator", list(rt_skyrl.ESTIMATORS))
def test_real_skyrl_registry_patched(use_backend, ppo_utils, estimator):
    reg = ppo_utils.AdvantageEstimatorRegistry
    before = {k: reg.get(k) for k in reg.list_available()}
    r, v, m = batch(F64, T=41, seed=3)

    def run():
        return ppo_utils.compute_advantages_and_returns(
            token_level_rewards=r.clone(), response_mask=m, index=UIDS, adv_estimator=estimator, config=None,
            values=v, gamma=0.99, lambd=0.95)

    theirs = run()
    with rt_skyrl.patched():
        assert reg.get(estimator) is getattr(rt_skyrl, rt_skyrl.ESTIMATORS[estimator])
        assert reg.get("maxrl") is before["maxrl"]
        ours = run()
    after = {k: reg.get(k) for k in reg.list_available()}
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(o, t, rtol=1e-12, atol=1e-12)


@pytest.mark.framework
def test_benchmark_checks_and_times(ppo_utils):
    """benchmarks/skyrl_cpu.py on a tiny batch: every estimator agrees with SkyRL's and is timed."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        bench = importlib.import_module("skyrl_cpu")
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    rows = bench.run([(16, 64)], list(bench.ESTIMATORS), rounds=2)
    assert [r["estimator"] for r in rows] == list(bench.ESTIMATORS)
    for row in rows:
        assert row["agree"], row
        assert len(row["times"]["skyrl"]) == len(row["times"]["rl_triton"]) == 2


@pytest.mark.framework
def test_framework_page_first_snippet_runs(ppo_utils, tmp_path):
    """docs/skyrl.md's first block (patch, unpatch, a patched block) runs as written in a fresh
    process, after SkyRL's ppo_utils is imported as rl_triton.testing.frameworks.skyrl_ppo_utils
    imports it (on Python < 3.12 SkyRL's own package import fails: docs/skyrl.md, Install)."""
    code = "from rl_triton.testing.frameworks import skyrl_ppo_utils\nskyrl_ppo_utils()\n" + python_block(
        "docs/skyrl.md")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
