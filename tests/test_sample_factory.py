"""Sample Factory integration against the real sample-factory 2.1.1 (.ci/run's classic stage
installs it): the same advantages as its scripted ``gae_advantages`` and the same sums as
``calculate_discounted_sum_torch`` (all steps valid, some and none, float32 and float64, on
every backend), no host read per call, the same V-trace targets and advantages as the block inside the real
``Learner._calculate_losses`` (run on a stand-in learner), the float64 oracle, the patch
contract on every name ``patch()`` sets, and the learner's GAE step through the patch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.framework

pytest.importorskip("sample_factory")
from sample_factory.algo.learning import learner as sf_learner  # noqa: E402
from sample_factory.algo.utils import rl_utils  # noqa: E402

import rl_triton.integrations.sample_factory as rt_sf  # noqa: E402
from conftest import TRITON_INTERPRET_AT_STARTUP  # noqa: E402
from rl_triton.testing import oracle  # noqa: E402

ORIGINALS = {(m, a): vars(__import__(m, fromlist=[a]))[a] for m, a in rt_sf.TARGETS}
SF_GAE = ORIGINALS["sample_factory.algo.utils.rl_utils", "gae_advantages"]
SF_SUM = ORIGINALS["sample_factory.algo.utils.rl_utils", "calculate_discounted_sum_torch"]
TOL = {torch.float32: dict(rtol=2e-5, atol=2e-5), torch.float64: dict(rtol=1e-12, atol=1e-12)}
BACKENDS = ["torch", "cpu"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])


@pytest.fixture(autouse=True)
def _restore():
    yield
    rt_sf.unpatch()
    for (m, a), fn in ORIGINALS.items():
        assert vars(__import__(m, fromlist=[a]))[a] is fn


def _batch(E, T, dtype, seed, p_done=0.1, p_invalid=0.0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(E, T, generator=g, dtype=dtype)
    dones = (torch.rand(E, T, generator=g) < p_done).to(dtype)
    values = torch.randn(E, T + 1, generator=g, dtype=dtype)
    valids = torch.rand(E, T + 1, generator=g) >= p_invalid
    return rewards, dones, values, valids


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p_invalid", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("E,T", [(1, 1), (3, 7), (16, 32), (64, 128)])
def test_gae_matches_sample_factory(dtype, p_invalid, E, T):
    rewards, dones, values, valids = _batch(E, T, dtype, E * 100 + T, p_invalid=p_invalid)
    theirs = SF_GAE(rewards, dones, values, valids, 0.99, 0.95)
    ours = rt_sf.gae_advantages(rewards, dones, values, valids, 0.99, 0.95)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p_invalid", [0.0, 0.3, 1.0])
def test_every_backend_matches_sample_factory(backend, dtype, p_invalid, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", backend)
    rewards, dones, values, valids = _batch(5, 17, dtype, 11, p_invalid=p_invalid)
    torch.testing.assert_close(rt_sf.gae_advantages(rewards, dones, values, valids, 0.99, 0.95),
                               SF_GAE(rewards, dones, values, valids, 0.99, 0.95), **TOL[dtype])
    x, mask = rewards.t().contiguous(), valids[:, :-1].t().to(dtype)
    torch.testing.assert_close(rt_sf.calculate_discounted_sum_torch(x, dones.t(), mask, 0.97, values[:, 0]),
                               SF_SUM(x, dones.t(), mask, 0.97, values[:, 0]), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p_invalid", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("last", [False, True])
@pytest.mark.parametrize("mask_dtype", [None, torch.float32])
def test_discounted_sum_matches_sample_factory(dtype, p_invalid, last, mask_dtype):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 6, generator=g, dtype=dtype)
    dones = (torch.rand(40, 6, generator=g) < 0.1).to(dtype)
    valids = (torch.rand(40, 6, generator=g) >= p_invalid).to(mask_dtype or dtype)
    x_last = torch.randn(6, generator=g, dtype=dtype) if last else None
    theirs = SF_SUM(x, dones, valids, 0.97, x_last)
    torch.testing.assert_close(rt_sf.calculate_discounted_sum_torch(x, dones, valids, 0.97, x_last), theirs,
                               **TOL[dtype])


def test_no_host_read_per_call(monkeypatch):
    # a warm call (numba compiled, the call's plan and the rounded numbers formed), then every way
    # a tensor's value reaches Python counted: none on a repeated call, whatever the mask holds
    rewards, dones, values, valids = _batch(8, 16, torch.float32, 4, p_invalid=0.3)
    x, mask = rewards.t(), valids[:, :-1].t().float()
    rt_sf.gae_advantages(rewards, dones, values, valids, 0.99, 0.95)
    rt_sf.calculate_discounted_sum_torch(x, dones.t(), mask, 0.97)
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original):
            reads.append(_name)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for p_invalid in (0.0, 0.3, 1.0):
        valids = torch.rand(8, 17, generator=torch.Generator().manual_seed(1)) >= p_invalid
        rt_sf.gae_advantages(rewards, dones, values, valids, 0.99, 0.95)
        rt_sf.calculate_discounted_sum_torch(x, dones.t(), valids[:, :-1].t().float(), 0.97)
    assert reads == []


@pytest.mark.parametrize("p_invalid", [0.0, 0.3, 1.0])
def test_gae_matches_the_valid_step_oracle(p_invalid):
    rewards, dones, values, valids = _batch(4, 50, torch.float64, 9, p_invalid=p_invalid)
    full = np.ones((4, 50))
    # Sample Factory's loop discounts the trace by gamma * lambda rounded to float32
    adv = oracle.valid_gae(rewards.numpy(), values[:, :-1].numpy(), values[:, 1:].numpy(), valids[:, :-1].numpy(),
                           valids[:, 1:].numpy(), dones.numpy(), full * 0.98, full * float(np.float32(0.98 * 0.9)))
    torch.testing.assert_close(rt_sf.gae_advantages(rewards, dones, values, valids, 0.98, 0.9),
                               torch.from_numpy(adv), rtol=1e-12, atol=1e-12)


def test_gae_matches_the_oracle():
    rewards, dones, values, valids = _batch(4, 50, torch.float64, 9)
    d = dones.numpy() != 0
    # Sample Factory's loop discounts the trace by gamma * lambda rounded to float32
    lmbda = float(np.float32(0.98 * 0.9)) / 0.98
    adv, _ = oracle.gae(rewards.numpy(), values[:, :-1].numpy(), np.concatenate([values[:, 1:-1], values[:, -1:]], 1),
                        d, d, np.full((4, 50), 0.98), np.full((4, 50), lmbda))
    torch.testing.assert_close(rt_sf.gae_advantages(rewards, dones, values, valids, 0.98, 0.9),
                               torch.from_numpy(adv), rtol=1e-12, atol=1e-12)


@pytest.fixture
def bench(monkeypatch):
    """benchmarks/sample_factory_step.py: its stand-in learner runs the real method."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "benchmarks"))
    import sample_factory_step

    return sample_factory_step


@pytest.mark.parametrize("recurrence,n_traj", [(2, 3), (32, 16)])
def test_vtrace_matches_the_learners_block(recurrence, n_traj, bench):
    g = torch.Generator().manual_seed(recurrence)
    B = recurrence * n_traj
    # the ratio as the learner forms it: exp of the log-prob difference, clamped to [0.05, 20]
    ratio = torch.exp(torch.randn(B, generator=g) * 0.7).clamp(0.05, 20.0)
    values, rewards = torch.randn(B, generator=g), torch.randn(B, generator=g)
    dones = (torch.rand(B, generator=g) < 0.1).float()
    kw = dict(recurrence=recurrence, gamma=0.97, rho=1.0, c=0.9)
    # the block of the real Learner._calculate_losses, run on a stand-in learner
    theirs_targets, theirs_adv = bench.StandIn(ratio, values, rewards, dones, **kw).run()
    targets, adv = rt_sf.vtrace_targets(ratio, values, rewards, dones, **kw)
    torch.testing.assert_close(targets, theirs_targets, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(adv, theirs_adv, rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_themselves():
    rewards, dones, values, valids = _batch(2, 5, torch.float32, 0)
    with pytest.raises(ValueError, match="values"):
        rt_sf.gae_advantages(rewards, dones, values[:, :-1], valids, 0.99, 0.95)
    with pytest.raises(TypeError, match="rewards"):
        rt_sf.gae_advantages(rewards.numpy(), dones, values, valids, 0.99, 0.95)
    with pytest.raises(ValueError, match="multiple of recurrence"):
        rt_sf.vtrace_targets(torch.ones(5), torch.ones(5), torch.ones(5), torch.zeros(5), 2, 0.99, 1.0, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        rt_sf.vtrace_targets(torch.ones(4), torch.ones(4), torch.ones(4), torch.zeros(4), 2, 0.0, 1.0, 1.0)


def test_patch_contract():
    assert not rt_sf.is_patched()
    rt_sf.patch()
    rt_sf.patch()
    assert rt_sf.is_patched()
    assert rl_utils.gae_advantages is sf_learner.gae_advantages is rt_sf.gae_advantages
    assert rl_utils.calculate_discounted_sum_torch is rt_sf.calculate_discounted_sum_torch
    with rt_sf.patched():
        pass
    assert rt_sf.is_patched()  # a block inside patch() leaves it in effect
    rt_sf.unpatch()
    rt_sf.unpatch()
    assert not rt_sf.is_patched()
    assert sf_learner.gae_advantages is SF_GAE and rl_utils.calculate_discounted_sum_torch is SF_SUM
    with rt_sf.patched():
        with rt_sf.patched():
            assert sf_learner.gae_advantages is rt_sf.gae_advantages
        assert rt_sf.is_patched()
    assert sf_learner.gae_advantages is SF_GAE


def test_the_learners_gae_step_goes_through_the_patch(monkeypatch):
    # the learner calls the name it imported: counted while patched, Sample Factory's loop after
    calls = []
    ours = rt_sf.gae_advantages

    def counted(*args):
        calls.append(1)
        return ours(*args)

    monkeypatch.setattr(rt_sf, "_OURS", {**rt_sf._OURS, "gae_advantages": counted})
    rewards, dones, values, valids = _batch(4, 8, torch.float32, 3)
    with rt_sf.patched():
        got = sf_learner.gae_advantages(rewards, dones, values, valids, 0.99, 0.95)
    assert calls == [1]
    torch.testing.assert_close(got, SF_GAE(rewards, dones, values, valids, 0.99, 0.95), **TOL[torch.float32])


def test_benchmark_logic_at_a_tiny_size(bench):
    rows = bench.run([4], recurrence=8, rounds=2)
    assert [r["trajectories"] for r in rows] == [4] and all(r["agree"] for r in rows)
    assert set(rows[0]["times"]) == {"sf gae", "rt gae", "sf gae mixed", "rt gae mixed", "sf vtrace", "rt vtrace"}
