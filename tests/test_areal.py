"""rl_triton.integrations.areal.compute_gae against AReaL's GAE loop.

AReaL 1.0.4 pins torch < 2.11 and brings agent frameworks (openhands, litellm, ...), so it does not
install beside torch 2.13 on the CI machine; the reference is a transcription of the loop inline
in ``PPOActor._compute_advantages`` (rl_triton.testing.frameworks.areal_gae, from the areal 1.0.4
wheel, areal/trainer/ppo/actor.py). Float64 to 1e-12 and float32 to 1e-5, with AReaL's rolled
masks (a prompt prefix, holes, right padding), sequences with and without an EOS, and the float64
oracle; dtypes, errors, untouched inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl_triton.integrations.areal import compute_gae
from rl_triton.testing import oracle
from rl_triton.testing.frameworks import areal_gae

F64, F32 = torch.float64, torch.float32


@pytest.fixture(params=["cpu", "torch"])
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


def batch(dtype, B=6, T=45, seed=0):
    """AReaL's inputs: rewards, values, the rolled float loss mask and seq_no_eos_mask."""
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    v = torch.randn(B, T, generator=g, dtype=F64).to(dtype)
    m = torch.zeros(B, T)
    for i in range(B):
        start = int(torch.randint(1, 8, (1,), generator=g))
        end = T if i % 2 == 0 else T - int(torch.randint(1, 10, (1,), generator=g))
        m[i, start:end] = 1
        m[i, start + 5:start + 8] = 0  # a tool output
    m = torch.roll(m, shifts=-1, dims=-1)  # AReaL rolls the loss mask by one token
    no_eos = torch.tensor([i % 2 == 0 for i in range(B)])
    return r, v, m, no_eos


def close(got, expected, dtype):
    tol = 1e-12 if dtype == F64 else 1e-5
    torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("discount,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.0)])
def test_matches_areal_loop(use_backend, dtype, discount, lam):
    r, v, m, no_eos = batch(dtype)
    adv, ret = compute_gae(r, v, m, no_eos, discount, lam)
    ref_adv, ref_ret = areal_gae(r, v, m, no_eos, discount, lam)
    assert adv.dtype == ref_adv.dtype and ret.dtype == ref_ret.dtype
    close(adv, ref_adv.to(F64), dtype)
    close(ret, ref_ret.to(F64), dtype)
    assert torch.all(adv[:, -1] == 0)


def test_matches_oracle(use_backend):
    r, v, m, no_eos = batch(F64, seed=3)
    adv, ret = compute_gae(r, v, m, no_eos, 0.99, 0.9)
    B, T = r.shape
    boot = (v[:, -1] * no_eos).numpy()
    a, targets = oracle.gae_masked(r[:, :-1], v[:, :-1], m[:, :-1], np.full((B, T - 1), 0.99),
                                   np.full((B, T - 1), 0.9), bootstrap=boot)
    close(adv[:, :-1], a, F64)
    close(ret[:, :-1], targets, F64)
    close(ret[:, -1], v[:, -1], F64)


def test_dtypes_inputs_and_errors():
    r, v, m, no_eos = batch(torch.bfloat16)
    adv, ret = compute_gae(r, v, m, no_eos, 1.0, 0.95)
    assert adv.dtype == ret.dtype == areal_gae(r, v, m, no_eos, 1.0, 0.95)[0].dtype == F32
    r, v, m, no_eos = batch(F64)
    copies = [x.clone() for x in (r, v, m, no_eos)]
    compute_gae(r, v, m, no_eos, 1.0, 0.95)
    assert all(torch.equal(x, c) for x, c in zip((r, v, m, no_eos), copies))
    with pytest.raises(TypeError, match="seq_no_eos_mask"):
        compute_gae(r, v, m, [True] * r.shape[0], 1.0, 0.95)
    with pytest.raises(ValueError, match="seq_no_eos_mask"):
        compute_gae(r, v, m, no_eos[:-1], 1.0, 0.95)
    with pytest.raises(ValueError, match="loss_mask"):
        compute_gae(r, v, m[:, 1:], no_eos, 1.0, 0.95)
    with pytest.raises(ValueError, match="lmbda"):
        compute_gae(r, v, m, no_eos, 1.0, 1.5)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_last_column_is_never_a_step(use_backend, dtype):
    """AReaL's loop stops before the last column whatever the mask holds there (after its roll the
    column is the first token's, normally a prompt token, 0; here it is set)."""
    r, v, m, no_eos = batch(dtype, seed=4)
    m[:, -1] = 1
    adv, ret = compute_gae(r, v, m, no_eos, 0.99, 0.95)
    ref_adv, ref_ret = areal_gae(r, v, m, no_eos, 0.99, 0.95)
    close(adv, ref_adv.to(F64), dtype)
    close(ret, ref_ret.to(F64), dtype)
