"""CleanRL's inline GAE loop (transcribed in rl_triton/testing/frameworks.py, as in CleanRL's
ppo.py) against compute_gae, and the truncation-correct variant against the float64 oracle."""

import numpy as np
import pytest
import torch

from rl_triton.core import kernels
from rl_triton.integrations.cleanrl import compute_gae, compute_gae_truncated
from rl_triton.testing import reference
from rl_triton.testing.frameworks import cleanrl_gae as cleanrl_loop

BACKENDS = ["cpu", "torch"] + (["triton"] if kernels.AVAILABLE and kernels.INTERPRET else [])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_steps,num_envs", [(1, 1), (16, 4), (128, 8)])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (1.0, 1.0), (0.9, 0.0)])
def test_matches_inline_loop(num_steps, num_envs, gamma, lam, backend, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", backend)
    g = torch.Generator().manual_seed(num_steps * 10 + num_envs)
    rewards = torch.randn(num_steps, num_envs, generator=g, dtype=torch.float64)
    values = torch.randn(num_steps, num_envs, generator=g, dtype=torch.float64)
    dones = (torch.rand(num_steps, num_envs, generator=g) < 0.2).double()
    dones[0] = 1.0
    next_done = (torch.rand(num_envs, generator=g) < 0.5).double()
    next_value = torch.randn(1, num_envs, generator=g, dtype=torch.float64)
    want = cleanrl_loop(rewards, values, dones, next_value, next_done, gamma, lam)
    got = compute_gae(rewards, values, dones, next_value, next_done, gamma, lam)
    for w, g_ in zip(want, got):
        torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-12)
    got = compute_gae(rewards, values, dones, next_value.flatten(), next_done, gamma, lam)  # (N,) form
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)


def test_float32_matches_loop_to_rounding():
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(2, 256, 16, generator=g)
    dones = (torch.rand(256, 16, generator=g) < 0.05).float()
    next_value, next_done = torch.randn(1, 16, generator=g), torch.zeros(16)
    want = cleanrl_loop(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    got = compute_gae(rewards, values, dones, next_value, next_done, 0.99, 0.95)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)


def test_truncated_variant_matches_oracle():
    g = torch.Generator().manual_seed(1)
    T, N = 40, 3
    rewards, values, next_values = torch.randn(3, T, N, generator=g, dtype=torch.float64)
    terms = torch.rand(T, N, generator=g) < 0.1
    truncs = (torch.rand(T, N, generator=g) < 0.1) & ~terms
    adv, ret = compute_gae_truncated(rewards, values, next_values, terms, truncs, 0.99, 0.95)
    ref, _ = reference("gae", (rewards, values), dict(next_values=next_values, terminated=terms, truncated=truncs,
                                                      gamma=0.99, lmbda=0.95, time_dim=0))
    np.testing.assert_allclose(adv.numpy(), ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, adv + values)


def test_bad_shapes():
    r = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="next_value"):
        compute_gae(r, r, r, torch.zeros(5), torch.zeros(4), 0.99, 0.95)
    with pytest.raises(ValueError, match="next_done"):
        compute_gae(r, r, r, torch.zeros(4), torch.zeros(3), 0.99, 0.95)
    with pytest.raises(ValueError, match="rewards"):
        compute_gae(torch.zeros(8), r, r, torch.zeros(4), torch.zeros(4), 0.99, 0.95)


def test_numpy_input_is_a_type_error():
    """CleanRL keeps its buffers as torch tensors; numpy arrays are a TypeError naming the type."""
    r = np.zeros((8, 4), dtype=np.float32)
    with pytest.raises(TypeError, match=r"rewards must be a torch.Tensor, got ndarray"):
        compute_gae(r, r, r, np.zeros(4), np.zeros(4), 0.99, 0.95)
    t = torch.zeros(8, 4)
    with pytest.raises(TypeError, match=r"^dones must be a torch.Tensor, got ndarray"):  # CleanRL's name
        compute_gae(t, t, r, torch.zeros(4), torch.zeros(4), 0.99, 0.95)
