"""rl_triton.integrations.slime against slime's scans.

slime is not installable from the package index, so the reference is a transcription:
rl_triton.testing.frameworks.slime_vanilla_gae, slime_chunked_discounted_returns and
slime_chunked_gae, from THUDM/slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515,
slime/utils/ppo_utils.py (vanilla_gae, chunked_discounted_returns, chunked_gae). The tests:

- each drop-in against the transcription and the float64 oracle (lengths below, at and past
  slime's chunk of 128, zero-padded rows as slime pads them), float64 to 1e-12 and float32;
- patch()/unpatch()/patched()/is_patched() on a stand-in ``slime.utils.ppo_utils`` whose batch
  function looks ``chunked_gae`` up as a module global at each call, as slime's
  ``get_advantages_and_returns_batch`` does.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import rl_triton.integrations.slime as rt_slime
from rl_triton.integrations._patching import FrameworkNotInstalled
from rl_triton.testing import frameworks, oracle

from helpers import concurrent_patch_use, nested_blocks_across_threads

F64, F32 = torch.float64, torch.float32
MODULE = "slime.utils.ppo_utils"


@pytest.fixture(params=["cpu", "torch"])
def use_backend(request, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", request.param)
    return request.param


def padded(dtype, lengths=(1, 127, 128, 300, 129), seed=0):
    """slime's padded batch: rows of response tokens, zeros past each response's length."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    r, v = (torch.randn(len(lengths), T, generator=g, dtype=F64) for _ in range(2))
    keep = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return (r * keep).to(dtype), (v * keep).to(dtype)


def close(got, expected, dtype):
    if dtype == F64:
        torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), rtol=1e-12, atol=1e-12)
    else:  # slime's chunked matmul rounds differently from a sequential scan
        torch.testing.assert_close(got.to(F64), torch.as_tensor(expected, dtype=F64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("gamma,lambd", [(1.0, 0.95), (0.99, 1.0), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_slime(use_backend, dtype, gamma, lambd):
    r, v = padded(dtype)
    adv, ret = rt_slime.chunked_gae(r, v, gamma, lambd)
    assert adv.dtype == ret.dtype == dtype
    for reference in (frameworks.slime_chunked_gae(r, v, gamma, lambd),
                      frameworks.slime_vanilla_gae(r, v, gamma, lambd)):
        close(adv, reference[0].to(F64), dtype)
        close(ret, reference[1].to(F64), dtype)
    for a, b in zip(rt_slime.vanilla_gae(r, v, gamma, lambd), (adv, ret)):
        assert torch.equal(a, b)
    B, T = r.shape
    zeros = np.zeros((B, T))
    a, targets = oracle.gae(r, v, oracle.implied_next_values(v), zeros, zeros, np.full((B, T), gamma),
                            np.full((B, T), lambd))
    close(adv, a, dtype)
    close(ret, targets, dtype)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("discount", [1.0, 0.97, 0.0])
def test_discounted_returns_match_slime(use_backend, dtype, discount):
    r, _ = padded(dtype, seed=1)
    got = rt_slime.chunked_discounted_returns(r, discount)
    close(got, frameworks.slime_chunked_discounted_returns(r, discount).to(F64), dtype)
    B, T = r.shape
    zeros = np.zeros((B, T))
    close(got, oracle.discounted_return(r, zeros, zeros, np.full((B, T), discount)), dtype)


def test_bad_inputs_and_chunk_size_ignored():
    r, v = padded(F64)
    with pytest.raises(TypeError, match="rewards"):
        rt_slime.chunked_gae(r.numpy(), v, 1.0, 0.95)
    with pytest.raises(ValueError, match="rewards"):
        rt_slime.chunked_gae(r[0], v[0], 1.0, 0.95)
    with pytest.raises(ValueError, match="values"):
        rt_slime.vanilla_gae(r, v[:, 1:], 1.0, 0.95)
    with pytest.raises(ValueError, match="gamma"):
        rt_slime.chunked_discounted_returns(r, 1.5)
    for a, b in zip(rt_slime.chunked_gae(r, v, 1.0, 0.95, chunk_size=7), rt_slime.chunked_gae(r, v, 1.0, 0.95)):
        assert torch.equal(a, b)


# -- patch() on a stand-in slime ------------------------------------------------------------------

def stand_in_batch(rewards, values, gamma, lambd):
    """slime's get_advantages_and_returns_batch without context parallelism, on a padded batch:
    it looks chunked_gae up in its module at each call."""
    return sys.modules[MODULE].chunked_gae(rewards=rewards, values=values, gamma=gamma, lambd=lambd)


@pytest.fixture
def stand_in(monkeypatch):
    module = types.ModuleType(MODULE)
    module.chunked_gae = frameworks.slime_chunked_gae
    module.vanilla_gae = frameworks.slime_vanilla_gae
    module.chunked_discounted_returns = frameworks.slime_chunked_discounted_returns
    for name in ("slime", "slime.utils"):
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    monkeypatch.setitem(sys.modules, MODULE, module)
    yield module
    rt_slime.unpatch()
    assert not rt_slime.is_patched()


def test_patch_routes_and_restores(stand_in):
    originals = {name: getattr(stand_in, name) for name in rt_slime.FUNCTIONS}
    r, v = padded(F64, seed=2)
    theirs = stand_in_batch(r, v, 1.0, 0.95)
    rt_slime.patch()
    rt_slime.patch()
    assert all(getattr(stand_in, n) is getattr(rt_slime, n) for n in rt_slime.FUNCTIONS)
    ours = stand_in_batch(r, v, 1.0, 0.95)
    rt_slime.unpatch()
    assert all(getattr(stand_in, n) is f for n, f in originals.items())
    for t, o in zip(theirs, ours):
        torch.testing.assert_close(o, t, rtol=1e-12, atol=1e-12)


def test_patched_blocks_and_errors(stand_in):
    def routes_ours():
        return stand_in.chunked_gae is rt_slime.chunked_gae

    with rt_slime.patched():
        with rt_slime.patched():
            assert routes_ours()
        assert routes_ours()
        with pytest.raises(AssertionError):  # slime's own error (its assert) on slime's arguments
            rt_slime.chunked_gae(torch.zeros(3), torch.zeros(3), 1.0, 0.95)
    assert not routes_ours()
    assert nested_blocks_across_threads(rt_slime.patched, routes_ours) == [True]
    assert concurrent_patch_use(rt_slime.patched, rt_slime.patch, rt_slime.unpatch, routes_ours) == []
    rt_slime.unpatch()
    rt_slime.patch()

    def someone_elses(*args, **kwargs):
        return None

    stand_in.chunked_gae = someone_elses
    rt_slime.unpatch()
    assert stand_in.chunked_gae is someone_elses
    assert stand_in.vanilla_gae is frameworks.slime_vanilla_gae


def test_without_slime(monkeypatch):
    monkeypatch.setitem(sys.modules, "slime", None)
    with pytest.raises(FrameworkNotInstalled, match="THUDM/slime"):
        rt_slime.patch()
    assert not rt_slime.is_patched()
