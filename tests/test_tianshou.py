"""Tianshou integration against the real Tianshou 2.0.1 (.ci/run's classic stage installs it):
the same advantages as Tianshou's numba ``_gae`` (float32 and float64 inputs, its end flags,
element for element, also on several threads wherever the ends fall), the same returns and
advantages as ``Algorithm.compute_episodic_return`` on a real ``VectorReplayBuffer`` with
unfinished episodes (GAE, next values only, and the Monte Carlo path; negative indices, integer
flags and a replaced ``value_mask``), the float64 oracle, the patch contract, an A2C update
through the patch, the tensor route of CUDA values on CPU tensors, and the benchmark's logic at
a tiny size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.framework

tianshou = pytest.importorskip("tianshou")
from tianshou.algorithm import algorithm_base  # noqa: E402
from tianshou.data import Batch, VectorReplayBuffer  # noqa: E402

import rl_triton.integrations.tianshou as rt_ts  # noqa: E402
from rl_triton.testing import oracle  # noqa: E402

ORIGINAL_GAE = algorithm_base.__dict__["_gae"]
ORIGINAL_CER = algorithm_base.Algorithm.__dict__["compute_episodic_return"]


@pytest.fixture(autouse=True)
def _restore():
    yield
    rt_ts.unpatch()
    assert algorithm_base._gae is ORIGINAL_GAE
    assert algorithm_base.Algorithm.__dict__["compute_episodic_return"] is ORIGINAL_CER


def _flat(n, dtype, seed, p_end=0.02):
    rng = np.random.default_rng(seed)
    v_s, v_s_, rew = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    end = rng.random(n) < p_end
    return v_s, v_s_, rew, end


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 7, 1000, 200_003])
def test_gae_matches_tianshou_bit_for_bit(dtype, n):
    v_s, v_s_, rew, end = _flat(n, dtype, n)
    theirs = ORIGINAL_GAE(v_s, v_s_, rew, end, 0.99, 0.95)
    ours = rt_ts.gae_advantages(v_s, v_s_, rew, end, 0.99, 0.95)
    assert ours.dtype == theirs.dtype == np.float64 and ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, theirs)


@pytest.mark.parametrize("p_end", [0.0, 1e-5, 0.02, 1.0])
def test_threads_are_exact_wherever_the_ends_fall(monkeypatch, p_end):
    # the host path on three threads (the threshold lowered): stretches cut at end flags, also
    # where there are none (one stretch) or one at every step
    monkeypatch.setattr(rt_ts, "SPLIT_MIN_STEPS", 1)
    monkeypatch.setattr(rt_ts, "_numba_threads", lambda: 3)
    v_s, v_s_, rew, end = _flat(100_000, np.float32, 3, p_end)
    np.testing.assert_array_equal(rt_ts.gae_advantages(v_s, v_s_, rew, end, 0.97, 0.9),
                                  ORIGINAL_GAE(v_s, v_s_, rew, end, 0.97, 0.9))
    buf, batch, indices = _buffer(8, 500, 9)
    v_s_, v_s = (np.random.default_rng(1).standard_normal((2, len(indices))).astype(np.float32))
    _both(batch, buf, indices, v_s_, v_s, gamma=0.97, gae_lambda=0.9)


def test_gae_matches_the_oracle():
    v_s, v_s_, rew, end = _flat(500, np.float64, 11, p_end=0.05)
    # Tianshou's end flag cuts the trace and keeps the bootstrap: a truncation in the oracle's terms
    adv, _ = oracle.gae(rew[None], v_s[None], v_s_[None], np.zeros((1, 500), bool), end[None],
                        np.full((1, 500), 0.98), np.full((1, 500), 0.9))
    np.testing.assert_allclose(rt_ts.gae_advantages(v_s, v_s_, rew, end, 0.98, 0.9), adv[0], rtol=1e-12,
                               atol=1e-12)


def test_torch_path_keeps_tensors_on_their_device():
    # the route CUDA values take, run here on CPU tensors: tensors in, a tensor on that device out
    v_s, v_s_, rew, end = _flat(300, np.float32, 5)
    ours = rt_ts.gae_advantages(*(torch.from_numpy(x) for x in (v_s, v_s_, rew, end)), 0.99, 0.95)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float64 and ours.device.type == "cpu"
    np.testing.assert_array_equal(ours.numpy(), ORIGINAL_GAE(v_s, v_s_, rew, end, 0.99, 0.95))


def test_tensor_route_without_numba(monkeypatch):
    # the route of values on a CUDA device (rl_triton.gae on their tensors), which a host without
    # numba takes too: run here on CPU tensors with the numba backend reported missing
    monkeypatch.setattr(rt_ts._cpu, "available", lambda: False)
    v_s, v_s_, rew, end = _flat(300, np.float32, 6)
    ours = rt_ts.gae_advantages(*(torch.from_numpy(x) for x in (v_s, v_s_, rew, end)), 0.99, 0.95)
    assert isinstance(ours, torch.Tensor) and ours.dtype == torch.float64
    np.testing.assert_array_equal(ours.numpy(), ORIGINAL_GAE(v_s, v_s_, rew, end, 0.99, 0.95))
    buf, batch, indices = _buffer(3, 50, 8)
    v_s_, v_s = np.random.default_rng(5).standard_normal((2, len(indices))).astype(np.float32)
    _both(batch, buf, indices, torch.from_numpy(v_s_), torch.from_numpy(v_s), gamma=0.97, gae_lambda=0.9)
    _both(batch, buf, indices, v_s_, None, gamma=0.97, gae_lambda=0.9)
    _both(batch, buf, indices, gamma=0.95, gae_lambda=1.0)


def _buffer(n_envs, steps, seed, p_term=0.03, p_trunc=0.02):
    """A real VectorReplayBuffer filled by ``add`` as a collector fills it, some episodes of each
    env still unfinished at the end; returns (buffer, batch, indices)."""
    rng = np.random.default_rng(seed)
    buf = VectorReplayBuffer(n_envs * steps, n_envs)
    for _ in range(steps):
        terminated = rng.random(n_envs) < p_term
        truncated = ~terminated & (rng.random(n_envs) < p_trunc)
        buf.add(Batch(obs=rng.standard_normal((n_envs, 2)), act=rng.integers(0, 2, n_envs),
                      rew=rng.standard_normal(n_envs), terminated=terminated, truncated=truncated,
                      obs_next=rng.standard_normal((n_envs, 2)), info=[{}] * n_envs))
    indices = buf.sample_indices(0)
    return buf, buf[indices], indices


def _both(*args, **kwargs):
    theirs = ORIGINAL_CER.__func__(*args, **kwargs)
    ours = rt_ts.compute_episodic_return(*args, **kwargs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    return ours


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_compute_episodic_return_matches_tianshou(dtype):
    buf, batch, indices = _buffer(4, 60, 1)
    assert buf.unfinished_index().size  # the flags of unfinished episodes are in play
    rng = np.random.default_rng(2)
    v_s_ = rng.standard_normal(len(indices)).astype(dtype)
    v_s = rng.standard_normal(len(indices)).astype(dtype)
    _both(batch, buf, indices, v_s_, v_s, gamma=0.97, gae_lambda=0.9)
    _both(batch, buf, indices, v_s_, None, gamma=0.97, gae_lambda=0.9)  # v_s from v_s_ rolled
    _both(batch, buf, indices, torch.from_numpy(v_s_), torch.from_numpy(v_s), gamma=0.97, gae_lambda=0.9)
    _both(batch, buf, indices, v_s_=np.full(len(indices), 0.5, dtype), gamma=0.9, gae_lambda=1.0)  # REINFORCE's


def test_flags_of_negative_indices_and_other_flag_dtypes():
    # Tianshou indexes the buffer with numpy's wraparound (value_mask) and searches the unfinished
    # slots with np.isin (no wraparound): both kept on the fused flag pass; integer flags take
    # the numpy route
    buf, batch, indices = _buffer(3, 40, 12)
    rng = np.random.default_rng(3)
    neg = indices - len(buf)  # the same slots, as negative indices
    v_s_, v_s = rng.standard_normal((2, len(indices)))
    _both(buf[neg], buf, neg, v_s_, v_s, gamma=0.97, gae_lambda=0.9)
    ints = buf[indices]
    ints.terminated = ints.terminated.astype(np.int64)
    _both(ints, buf, indices, v_s_, v_s, gamma=0.97, gae_lambda=0.9)


def test_a_replaced_value_mask_is_called(monkeypatch):
    # the fused flag pass stands for Tianshou's own value_mask only: a replaced one is called,
    # as Tianshou calls it
    buf, batch, indices = _buffer(3, 40, 13)
    v_s_, v_s = np.random.default_rng(4).standard_normal((2, len(indices)))
    stock = _both(batch, buf, indices, v_s_, v_s, gamma=0.97, gae_lambda=0.9)
    monkeypatch.setattr(algorithm_base.Algorithm, "value_mask",
                        staticmethod(lambda buffer, idx: np.ones(len(idx), dtype=bool)))
    replaced = _both(batch, buf, indices, v_s_, v_s, gamma=0.97, gae_lambda=0.9)
    assert not np.array_equal(stock[1], replaced[1])


def test_monte_carlo_path_is_the_discounted_return():
    buf, batch, indices = _buffer(3, 50, 4)
    returns, adv = _both(batch, buf, indices, gamma=0.95, gae_lambda=1.0)
    ends = np.logical_or(batch.terminated, batch.truncated)
    ends[np.isin(indices, buf.unfinished_index())] = True
    expected = oracle.discounted_return(batch.rew[None], ends[None], ends[None], np.full((1, len(ends)), 0.95))[0]
    np.testing.assert_allclose(returns, expected, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="gae_lambda"):
        rt_ts.compute_episodic_return(batch, buf, indices, gamma=0.95, gae_lambda=0.9)


def test_bad_arguments_name_themselves():
    v_s, v_s_, rew, end = _flat(10, np.float64, 0)
    with pytest.raises(ValueError, match="one length"):
        rt_ts.gae_advantages(v_s[:5], v_s_, rew, end, 0.99, 0.95)
    with pytest.raises(TypeError, match="v_s_"):
        rt_ts.gae_advantages(v_s, list(v_s_), rew, end, 0.99, 0.95)
    with pytest.raises(ValueError, match="gamma"):
        rt_ts.gae_advantages(v_s, v_s_, rew, end, 1.5, 0.95)


def test_patch_contract():
    assert not rt_ts.is_patched()
    rt_ts.patch()
    rt_ts.patch()
    assert rt_ts.is_patched()
    assert algorithm_base._gae is rt_ts.gae_advantages
    assert algorithm_base.Algorithm.compute_episodic_return is rt_ts.compute_episodic_return
    with rt_ts.patched():
        pass
    assert rt_ts.is_patched()  # a block inside patch() leaves it in effect
    rt_ts.unpatch()
    rt_ts.unpatch()
    assert not rt_ts.is_patched()
    assert algorithm_base._gae is ORIGINAL_GAE
    assert algorithm_base.Algorithm.__dict__["compute_episodic_return"] is ORIGINAL_CER
    with rt_ts.patched():
        with rt_ts.patched():
            assert algorithm_base._gae is rt_ts.gae_advantages
        assert rt_ts.is_patched()
    assert algorithm_base._gae is ORIGINAL_GAE


def test_a2c_update_through_the_patch():
    # an A2C's own advantage step (ActorCriticOnPolicyAlgorithm._add_returns_and_advantages) runs
    # through the patch and gives Tianshou's numbers
    import gymnasium as gym
    from tianshou.algorithm import A2C
    from tianshou.algorithm.modelfree.reinforce import DiscreteActorPolicy
    from tianshou.algorithm.optim import AdamOptimizerFactory
    from tianshou.utils.net.common import Net
    from tianshou.utils.net.discrete import DiscreteActor, DiscreteCritic

    torch.manual_seed(0)
    space = gym.spaces.Discrete(2)
    actor = DiscreteActor(preprocess_net=Net(state_shape=2, hidden_sizes=[8]), action_shape=2)
    critic = DiscreteCritic(preprocess_net=Net(state_shape=2, hidden_sizes=[8]))
    policy = DiscreteActorPolicy(actor=actor, action_space=space)
    algo = A2C(policy=policy, critic=critic, optim=AdamOptimizerFactory(lr=1e-3), gamma=0.97, gae_lambda=0.9)
    buf, batch, indices = _buffer(2, 40, 7)
    theirs = algo._add_returns_and_advantages(batch, buf, indices)
    theirs = (theirs.returns.clone(), theirs.adv.clone())
    buf, batch, indices = _buffer(2, 40, 7)
    with rt_ts.patched():
        ours = algo._add_returns_and_advantages(batch, buf, indices)
    torch.testing.assert_close(ours.returns, theirs[0], rtol=0, atol=0)
    torch.testing.assert_close(ours.adv, theirs[1], rtol=0, atol=0)


def test_benchmark_logic_at_a_tiny_size(monkeypatch):
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                             "benchmarks"))
    import tianshou_cpu as bench

    # "cpu:0" takes the route of --device cuda (the values as tensors on that device) on the CPU
    for device in ("cpu", "cpu:0"):
        rows = bench.run(sizes=[2000], rounds=2, n_envs=4, device=device)
        assert [r["steps"] for r in rows] == [2000] and all(r["agree"] for r in rows)
        assert all(r["tianshou_ms"] > 0 and r["rl_triton_ms"] > 0 for r in rows)
