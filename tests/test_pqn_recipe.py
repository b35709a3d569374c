"""PQN's lambda-returns over max-Q (Peng's Q(lambda) with greedy bootstraps) as
``td_lambda_return(rewards, next_values=max_a Q(s_{t+1}, a), done=dones)``: against a float64
transcription of PQN's target computation on every backend (docs/semantics.md, section 12.1),
and the one step where PQN's feed-forward gymnax / MinAtar scripts differ from it."""

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.core import kernels

BACKENDS = ["cpu", "torch"] + (["triton"] if kernels.AVAILABLE and kernels.INTERPRET else [])
F64 = torch.float64


# -- PQN, transcribed ----------------------------------------------------------------------------
# mttga/purejaxql at commit 0436c80a95e685ccc30c06a4473f9071a42d12aa, purejaxql/pqn_atari.py:
# _compute_targets and its _get_target (the same function in the recurrent scripts), a reverse
# jax.lax.scan over the time-major rollout rewritten as a loop in float64. q_vals[t] are
# Q(s_t, .), last_q is max_a Q(s_T, a) of the observation after the window, done[t] ends the
# episode after step t (every done a termination: no bootstrap).
#
# feed_forward: the same commit's purejaxql/pqn_gymnax.py and purejaxql/pqn_minatar.py (the
# feed-forward scripts that scan over Transition records), whose scan carry starts from
# last_q * (1 - done[T-1]): step T-2 bootstraps from max_a Q(s_T, a) masked by the last step's
# done, where pqn_atari.py takes max_a Q(s_{T-1}, a).
def pqn_targets(last_q, q_vals, reward, done, gamma, lam, feed_forward=False):
    T = reward.shape[0]
    targets = np.empty_like(reward)
    ret = reward[-1] + gamma * (1 - done[-1]) * last_q
    targets[-1] = ret
    next_q = last_q * (1 - done[-1]) if feed_forward else q_vals[-1].max(-1)
    for t in range(T - 2, -1, -1):
        bootstrap = reward[t] + gamma * (1 - done[t]) * next_q
        ret = bootstrap + gamma * lam * (ret - next_q)
        ret = (1 - done[t]) * ret + done[t] * reward[t]
        targets[t] = ret
        next_q = q_vals[t].max(-1)
    return targets


def _rollout(T, N, A=4, p_done=0.2, seed=0):
    g = np.random.default_rng(seed)
    q_vals = g.normal(size=(T, N, A))
    last_q_vals = g.normal(size=(N, A))
    reward = g.normal(size=(T, N))
    done = (g.random((T, N)) < p_done).astype(np.float64)
    done[-1, 0] = 1.0  # the window's last step ends an episode in one row
    return q_vals, last_q_vals, reward, done


def pqn_recipe(q_vals, last_q_vals, reward, done, gamma, lam, backend, dtype=F64):
    """docs/semantics.md 12.1: next_values[t] = max_a Q(s_{t+1}, a), Q(s_T, .) after the window."""
    q = torch.as_tensor(q_vals, dtype=dtype)
    next_values = torch.cat([q[1:], torch.as_tensor(last_q_vals, dtype=dtype)[None]]).amax(-1)
    return rl_triton.td_lambda_return(torch.as_tensor(reward, dtype=dtype), next_values,
                                      done=torch.as_tensor(done, dtype=torch.bool), gamma=gamma, lmbda=lam,
                                      time_dim=0, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T,N", [(1, 3), (2, 5), (16, 8), (64, 3)])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.65), (1.0, 1.0), (0.9, 0.0), (0.0, 0.5)])
def test_recipe_is_pqns_targets(backend, T, N, gamma, lam):
    q_vals, last_q_vals, reward, done = _rollout(T, N, seed=T * 100 + N)
    want = pqn_targets(last_q_vals.max(-1), q_vals, reward, done, gamma, lam)
    got = pqn_recipe(q_vals, last_q_vals, reward, done, gamma, lam, backend)
    assert got.dtype == F64 and got.shape == (T, N)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_and_no_episode_ends(backend):
    q_vals, last_q_vals, reward, done = _rollout(32, 6, p_done=0.0, seed=7)
    done[:] = 0.0
    want = pqn_targets(last_q_vals.max(-1), q_vals, reward, done, 0.99, 0.9)
    got = pqn_recipe(q_vals, last_q_vals, reward, done, 0.99, 0.9, backend, dtype=torch.float32)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_feed_forward_scripts_differ_at_step_t_minus_2_only(backend):
    """pqn_gymnax.py / pqn_minatar.py: the recipe gives their targets with next_values[T-2]
    replaced by (1 - done[T-1]) * max_a Q(s_T, a); with the true next values they differ at steps
    T-2 and before (the error flows back through the trace) wherever the two bootstraps differ."""
    gamma, lam = 0.99, 0.65
    q_vals, last_q_vals, reward, done = _rollout(12, 5, seed=3)
    done[-2:, :] = 0.0  # no episode end at the last two steps: every row sees the difference
    ff = pqn_targets(last_q_vals.max(-1), q_vals, reward, done, gamma, lam, feed_forward=True)
    exact = pqn_recipe(q_vals, last_q_vals, reward, done, gamma, lam, backend).numpy()
    np.testing.assert_allclose(exact[-1], ff[-1], rtol=1e-12, atol=1e-12)
    assert np.all(np.abs(exact[-2] - ff[-2]) > 1e-6)
    q = torch.as_tensor(q_vals)
    next_values = torch.cat([q[1:], torch.as_tensor(last_q_vals)[None]]).amax(-1)
    next_values[-2] = next_values[-1] * (1 - torch.as_tensor(done[-1]))
    flags = torch.as_tensor(done, dtype=torch.bool)
    quirk = rl_triton.td_lambda_return(torch.as_tensor(reward), next_values, done=flags, gamma=gamma, lmbda=lam,
                                       time_dim=0, backend=backend)
    np.testing.assert_allclose(quirk.numpy(), ff, rtol=1e-12, atol=1e-12)
