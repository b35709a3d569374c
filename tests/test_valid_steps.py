"""valid_gae and valid_discounted_return (docs/semantics.md, section 6.11: Sample Factory's valid
steps) against the float64 oracle on every backend: mixes of valid and invalid steps (none, some,
all invalid), dones, both layouts, per-step coefficients, the Triton engine's launch regimes,
non-finite values on invalid steps, gradients and validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import TRITON_INTERPRET_AT_STARTUP
from rl_triton.core.valid import valid_discounted_return, valid_gae
from rl_triton.testing import oracle

BACKENDS = ["torch", "cpu"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])


def _close(got, want, dtype):
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    np.testing.assert_allclose(got.double().numpy(), want, rtol=tol, atol=tol)


def _draw(R, T, dtype, seed, p_invalid, p_done=0.15):
    """Sample Factory's batch: rewards [R, T], values and valids [R, T+1], dones [R, T]."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(R, T, generator=g, dtype=dtype)
    values = torch.randn(R, T + 1, generator=g, dtype=dtype)
    valids = torch.rand(R, T + 1, generator=g) >= p_invalid
    dones = (torch.rand(R, T, generator=g) < p_done).to(dtype)
    return rewards, values, valids, dones


def _rows(x):
    return x.double().numpy()


def _gae_expected(rewards, values, valids, dones, gamma, trace):
    R, T = rewards.shape
    full = np.ones((R, T))
    return oracle.valid_gae(_rows(rewards), _rows(values[:, :-1]), _rows(values[:, 1:]), valids[:, :-1].numpy(),
                            valids[:, 1:].numpy(), dones.numpy(), full * gamma, full * trace)


def _t(x, time_major):
    return x.t() if time_major else x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p_invalid", [0.0, 0.3, 1.0])
def test_gae_matches_oracle(backend, dtype, p_invalid):
    shapes = [(3, 1), (5, 17)] if backend == "triton" else [(3, 1), (4, 2), (6, 40), (2, 129)]
    for seed, (R, T) in enumerate(shapes):
        rewards, values, valids, dones = _draw(R, T, dtype, seed, p_invalid)
        want = _gae_expected(rewards, values, valids, dones, 0.97, 0.9)
        for time_major in (False, True):
            got = valid_gae(*(_t(x, time_major) for x in (rewards, values[:, :-1], values[:, 1:], valids[:, :-1],
                                                          valids[:, 1:], dones)),
                            gamma=0.97, trace=0.9, time_dim=0 if time_major else -1, backend=backend)
            assert got.dtype == dtype
            _close(_t(got, time_major), want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("p_invalid", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("initial", [False, True])
def test_discounted_return_matches_oracle(backend, dtype, p_invalid, initial):
    shapes = [(3, 1), (5, 17)] if backend == "triton" else [(3, 1), (6, 40), (2, 129)]
    for seed, (R, T) in enumerate(shapes):
        x, values, valids, dones = _draw(R, T, dtype, seed + 10, p_invalid)
        last = values[:, 0] if initial else None
        want = oracle.valid_discounted_return(_rows(x), valids[:, :-1].numpy(), dones.numpy(), np.full((R, T), 0.95),
                                              None if last is None else _rows(last))
        for time_major in (False, True):
            got = valid_discounted_return(_t(x, time_major), _t(valids[:, :-1], time_major), _t(dones, time_major),
                                          gamma=0.95, initial=last, time_dim=0 if time_major else -1, backend=backend)
            _close(_t(got, time_major), want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_per_step_coefficients_and_flag_dtypes(backend):
    rewards, values, valids, dones = _draw(4, 11, torch.float64, 3, 0.4)
    g = torch.Generator().manual_seed(4)
    gamma, trace = torch.rand(4, 11, generator=g, dtype=torch.float64), torch.rand(4, 1, generator=g,
                                                                                  dtype=torch.float64)
    valid, next_valid = valids[:, :-1].to(torch.uint8), valids[:, 1:].to(torch.float32)
    got = valid_gae(rewards, values[:, :-1], values[:, 1:], valid, next_valid, dones.bool(), gamma=gamma,
                    trace=trace, backend=backend)
    want = oracle.valid_gae(_rows(rewards), _rows(values[:, :-1]), _rows(values[:, 1:]), valid.numpy(),
                            next_valid.numpy(), dones.numpy(), gamma.numpy(), np.broadcast_to(trace.numpy(), (4, 11)))
    _close(got, want, torch.float64)
    got = valid_discounted_return(rewards, valid, dones.bool(), gamma=gamma, backend=backend)
    _close(got, oracle.valid_discounted_return(_rows(rewards), valid.numpy(), dones.numpy(), gamma.numpy()),
           torch.float64)


def test_hand_computed_values():
    # T = 3, one row: step 1 invalid, no dones; gamma 0.5, trace 0.25; V = [1, 2, 3, 4], r = [1, 1, 1]
    r = torch.tensor([[1.0, 1.0, 1.0]], dtype=torch.float64)
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    valid = torch.tensor([[True, False, True, True]])
    none = torch.zeros(1, 3)
    # delta[2] = (1 - 3) + 0.5*4 = 0;  A[2] = 0
    # delta[1] = 0 + 0.5*3 = 1.5;      A[1] = 1.5 + 1*A[2] = 1.5   (invalid: factor 1)
    # delta[0] = (1 - 1) + 0.5*0 = 0;  A[0] = 0 + 0.25*1.5 = 0.375 (next state invalid: no bootstrap)
    for backend in BACKENDS:
        got = valid_gae(r, v[:, :-1], v[:, 1:], valid[:, :-1], valid[:, 1:], none, gamma=0.5, trace=0.25,
                        backend=backend)
        assert got.tolist() == [[0.375, 1.5, 0.0]], backend
        # S[2] = 1 + 0.5*2 = 2;  S[1] = 1 + 1*2 = 3;  S[0] = 1 + 0.5*3 = 2.5
        got = valid_discounted_return(r, valid[:, :-1], none, gamma=0.5, initial=torch.tensor([2.0],
                                                                                             dtype=torch.float64),
                                      backend=backend)
        assert got.tolist() == [[2.5, 3.0, 2.0]], backend


kernels = pytest.importorskip("rl_triton.core.kernels")
REGIMES = {
    "one chunk, rows per program": dict(block_t=16, block_r=2),
    "chunked carry": dict(block_t=4, block_r=1),
    "split time, 2 chunks per segment": dict(block_t=2, block_r=2, n_seg=3),
    "split time, 1 chunk per segment": dict(block_t=4, block_r=4, n_seg=4),
}


@pytest.mark.skipif(not TRITON_INTERPRET_AT_STARTUP, reason="the Triton interpreter (TRITON_INTERPRET=1)")
@pytest.mark.parametrize("plan", list(REGIMES), ids=list(REGIMES))
def test_triton_regimes(plan):
    rewards, values, valids, dones = _draw(3, 13, torch.float64, len(plan), 0.3)
    with kernels.forced_plan(**REGIMES[plan]):
        got = valid_gae(rewards, values[:, :-1], values[:, 1:], valids[:, :-1], valids[:, 1:], dones, gamma=0.9,
                        trace=0.8, backend="triton")
        sums = valid_discounted_return(rewards, valids[:, :-1], dones, gamma=0.9, initial=values[:, 0],
                                       backend="triton")
    _close(got, _gae_expected(rewards, values, valids, dones, 0.9, 0.8), torch.float64)
    _close(sums, oracle.valid_discounted_return(_rows(rewards), valids[:, :-1].numpy(), dones.numpy(),
                                                np.full((3, 13), 0.9), _rows(values[:, 0])), torch.float64)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_finite_values_of_invalid_steps_stay_out(backend):
    rewards, values, valids, dones = _draw(3, 9, torch.float64, 5, 0.0, p_done=0.0)
    valids[0, 4] = False  # step 4 of row 0 invalid: its reward and value are not read
    rewards[0, 4], values[0, 4] = math.nan, math.inf
    valids[1, 6] = False  # row 1: s_6 invalid, so step 5 reads no V(s_6)
    values[1, 6] = math.nan
    dones[2, 3] = 1.0  # row 2: a done at step 3 cuts V(s_4)
    values[2, 4] = math.inf
    valids[2, 4] = False
    got = valid_gae(rewards, values[:, :-1], values[:, 1:], valids[:, :-1], valids[:, 1:], dones, gamma=0.9,
                    trace=0.8, backend=backend)
    want = _gae_expected(rewards, values, valids, dones, 0.9, 0.8)
    assert np.isfinite(want).all()
    _close(got, want, torch.float64)


def test_gradients_through_the_composed_path():
    rewards, values, valids, dones = _draw(2, 6, torch.float64, 6, 0.3)
    rewards.requires_grad_(True)
    v = values.clone().requires_grad_(True)
    torch.autograd.gradcheck(lambda r, v: valid_gae(r, v[:, :-1], v[:, 1:], valids[:, :-1], valids[:, 1:], dones,
                                                    gamma=0.9, trace=0.8), (rewards, v))
    torch.autograd.gradcheck(lambda r: valid_discounted_return(r, valids[:, :-1], dones, gamma=0.9), (rewards,))


def test_bad_arguments_name_themselves():
    rewards, values, valids, dones = _draw(2, 5, torch.float32, 0, 0.3)
    args = [rewards, values[:, :-1], values[:, 1:], valids[:, :-1], valids[:, 1:], dones]
    for i, name in enumerate(["values", "next_values", "valid", "next_valid", "done"]):
        bad = list(args)
        bad[i + 1] = args[i + 1][:, :3]
        with pytest.raises(ValueError, match=name):
            valid_gae(*bad, gamma=0.9, trace=0.8)
    half = valids[:, :-1].float() * 0.5
    with pytest.raises(ValueError, match="valid"):
        valid_gae(rewards, values[:, :-1], values[:, 1:], half, valids[:, 1:], dones, gamma=0.9, trace=0.8)
    with pytest.raises(ValueError, match="trace"):
        valid_gae(*args, gamma=0.9, trace=1.5)
    with pytest.raises(TypeError, match="gamma"):
        valid_discounted_return(rewards, valids[:, :-1], dones, gamma="0.9")
    with pytest.raises(ValueError, match="initial"):
        valid_discounted_return(rewards, valids[:, :-1], dones, gamma=0.9, initial=torch.zeros(3))
    with pytest.raises(TypeError, match="rewards"):
        valid_discounted_return(rewards.numpy(), valids[:, :-1], dones, gamma=0.9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_calls_take_the_plan_with_new_data(backend):
    # the second call of a signature runs from the plan the first one left: new data, new results
    for seed in range(3):
        rewards, values, valids, dones = _draw(4, 9, torch.float32, 20 + seed, 0.3)
        got = valid_gae(rewards, values[:, :-1], values[:, 1:], valids[:, :-1], valids[:, 1:], dones, gamma=0.9,
                        trace=0.8, backend=backend)
        _close(got, _gae_expected(rewards, values, valids, dones, 0.9, 0.8), torch.float32)
        sums = valid_discounted_return(rewards.t(), valids[:, :-1].t().float(), dones.t(), gamma=0.9,
                                       initial=values[:, 0], time_dim=0, backend=backend)
        _close(sums.t(), oracle.valid_discounted_return(_rows(rewards), valids[:, :-1].numpy(), dones.numpy(),
                                                        np.full((4, 9), 0.9), _rows(values[:, 0])), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out(backend):
    rewards, values, valids, dones = _draw(3, 7, torch.float64, 30, 0.3)
    out = torch.full((3, 7), math.nan, dtype=torch.float64)
    got = valid_gae(rewards, values[:, :-1], values[:, 1:], valids[:, :-1], valids[:, 1:], dones, gamma=0.9,
                    trace=0.8, backend=backend, out=out)
    assert got is out
    _close(out, _gae_expected(rewards, values, valids, dones, 0.9, 0.8), torch.float64)
    out = torch.full((3, 7), math.nan, dtype=torch.float64)
    assert valid_discounted_return(rewards, valids[:, :-1], dones, gamma=0.9, backend=backend, out=out) is out
    _close(out, oracle.valid_discounted_return(_rows(rewards), valids[:, :-1].numpy(), dones.numpy(),
                                               np.full((3, 7), 0.9)), torch.float64)
