"""The numba kernel for wide, short time-major rollouts (``cpu.gae_time_major``: time in the outer
loop, blocks of adjacent rows in the inner one): which calls take it, agreement with the float64
oracle, and bit-for-bit agreement with the row-walking kernel it replaces for those calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rl_triton as rt
from rl_triton.testing import oracle

cpu = pytest.importorskip("rl_triton.core.cpu")
if not cpu.AVAILABLE:
    pytest.skip("needs numba", allow_module_level=True)

F64, F32 = torch.float64, torch.float32


@pytest.fixture
def chosen(monkeypatch):
    """The GAE kernel each CPU launch of the test builds, by name."""
    names = []
    original = cpu._kernel

    def record(fn, *args, **kwargs):
        names.append(fn.__name__)
        return original(fn, *args, **kwargs)

    monkeypatch.setattr(cpu, "_kernel", record)
    return names


def _rollout(T, N, K, dtype, seed, flag_dtype=torch.uint8):
    """[T, N, K] rollouts (rsl_rl [T, N, 1], rl_games [T, N, K]) with dones and terminations."""
    g = torch.Generator().manual_seed(seed)
    r, v = (torch.randn(T, N, K, generator=g, dtype=F64).to(dtype) for _ in range(2))
    boot = torch.randn(N, K, generator=g, dtype=F64).to(dtype)
    done = torch.rand(T, N, K, generator=g) < 0.1
    term = done & (torch.rand(T, N, K, generator=g) < 0.5)
    return r, v, boot, done.to(flag_dtype), term.to(flag_dtype)


def _rows(x):
    """[T, N, K] -> the oracle's [N*K, T] rows, float64 numpy."""
    return x.double().reshape(x.shape[0], -1).T.numpy()


def _check(got, want, dtype):
    tol = 1e-12 if dtype == F64 else 2e-6
    for g, w in zip(got, want):
        np.testing.assert_allclose(_rows(g), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F64, F32])
@pytest.mark.parametrize("shape", [(24, 700, 1), (3, 130, 2), (2, 1025, 1)])
@pytest.mark.parametrize("flag_dtype", [torch.uint8, torch.bool, torch.float32])
def test_done_form_matches_the_oracle(chosen, dtype, shape, flag_dtype):
    """rsl_rl's and skrl's call: dones (or terminations: with implied next values every done is
    one), a bootstrap value, several blocks with a partial last one."""
    T, N, K = shape
    r, v, boot, done, term = _rollout(T, N, K, dtype, seed=N + T, flag_dtype=flag_dtype)
    R = N * K
    nv = np.concatenate([_rows(v)[:, 1:], boot.double().reshape(R, 1).numpy()], 1)
    g, lam = np.full((R, T), 0.97), np.full((R, T), 0.9)
    got = rt.gae(r, v, bootstrap_value=boot, done=done, time_dim=0, gamma=0.97, lmbda=0.9, backend="cpu")
    _check(got, oracle.gae(_rows(r), _rows(v), nv, _rows(done), _rows(done), g, lam), dtype)
    got = rt.gae(r, v, bootstrap_value=boot, terminated=term, time_dim=0, gamma=0.97, lmbda=0.9, backend="cpu")
    _check(got, oracle.gae(_rows(r), _rows(v), nv, _rows(term), _rows(term), g, lam), dtype)
    assert chosen.count("gae_time_major") == 2  # both signatures


@pytest.mark.parametrize("dtype", [F64, F32])
def test_episode_starts_form_matches_the_oracle(chosen, dtype):
    """rl_games's and CleanRL's call: episode starts, the next step's start read as the done."""
    T, N = 16, 300
    r, v, boot, done, _ = _rollout(T, N, 1, dtype, seed=7, flag_dtype=torch.bool)
    r, v, boot, starts = r[..., 0], v[..., 0], boot[:, 0], done[..., 0]
    last = torch.rand(N, generator=torch.Generator().manual_seed(1)) < 0.3
    got = rt.gae(r, v, bootstrap_value=boot, episode_starts=starts, last_done=last, time_dim=0, backend="cpu")
    assert chosen == ["gae_time_major"]
    rows = lambda x: x.double().T.numpy()  # noqa: E731
    d = np.concatenate([rows(starts)[:, 1:], last.double().numpy()[:, None]], 1)
    nv = np.concatenate([rows(v)[:, 1:], boot.double().numpy()[:, None]], 1)
    want = oracle.gae(rows(r), rows(v), nv, d, d, np.full((N, T), 0.99), np.full((N, T), 0.95))
    tol = 1e-12 if dtype == F64 else 2e-6
    for g, w in zip(got, want):
        np.testing.assert_allclose(rows(g), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_bit_for_bit_the_row_kernels(monkeypatch, dtype):
    """The same arithmetic as the kernels that walk each row (``gae``, ``gae_episode_starts``),
    NaN and inf included, serial and parallel."""
    from rl_triton.core import plans

    T, N = 9, 2000
    r, v, boot, done, term = _rollout(T, N, 1, dtype, seed=3)
    r[4, 10, 0], v[2, 20, 0], boot[30, 0] = float("nan"), float("inf"), float("nan")
    starts = done[..., 0].bool()
    calls = [lambda: rt.gae(r, v, bootstrap_value=boot, done=done, time_dim=0, backend="cpu"),
             lambda: rt.gae(r, v, bootstrap_value=boot, terminated=term, time_dim=0, backend="cpu"),
             lambda: rt.gae(r[..., 0], v[..., 0], bootstrap_value=boot[:, 0], episode_starts=starts,
                            last_done=starts[0], time_dim=0, backend="cpu")]
    for parallel in (0, 1 << 62):
        monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", parallel)
        fast = [call() for call in calls]
        monkeypatch.setattr(cpu, "TIME_MAJOR_MIN_ROWS", 1 << 62)
        plans.clear()
        slow = [call() for call in calls]
        monkeypatch.setattr(cpu, "TIME_MAJOR_MIN_ROWS", 64)
        plans.clear()
        for f, s in zip(fast, slow):
            for a, b in zip(f, s):
                assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_other_calls_keep_their_kernels(chosen):
    """Batch-major memory, few rows, explicit next values, tensor coefficients, a carry-in chunk
    or a non-contiguous view take the kernels they took before."""
    T, N = 8, 300
    r, v, boot, done, term = _rollout(T, N, 1, F32, seed=2)
    rt.gae(r[..., 0].T.contiguous(), v[..., 0].T.contiguous(), bootstrap_value=boot[:, 0],
           done=done[..., 0].T.contiguous(), backend="cpu")  # batch-major
    rt.gae(r[:, :32], v[:, :32], bootstrap_value=boot[:32], done=done[:, :32], time_dim=0, backend="cpu")  # few
    rt.gae(r, v, next_values=v, done=done, terminated=term, time_dim=0, backend="cpu")  # explicit next values
    rt.gae(r, v, bootstrap_value=boot, done=done, gamma=torch.full_like(r, 0.9), time_dim=0, backend="cpu")
    rt.gae(r[:, ::2], v[:, ::2], bootstrap_value=boot[::2], done=done[:, ::2], time_dim=0, backend="cpu")  # strided
    rt.gae(r[:1], v[:1], bootstrap_value=boot, done=done[:1], time_dim=0, backend="cpu")  # one step
    assert "gae_time_major" not in chosen and len(chosen) == 6
    rt.gae(r, v, bootstrap_value=boot, done=done, time_dim=0, backend="cpu")
    assert chosen[-1] == "gae_time_major"


def test_whiten_in_rows_of_memory_order(cpu_backend):
    """The numba statistics read [T, N, 1] advantages in rows of memory order (not rows of the
    last dimension, one element each), several rows with a partial last one."""
    x = torch.randn(7, 5000, 1, dtype=F64)
    ref = (x - x.mean()) / (x.std() + 1e-8)
    torch.testing.assert_close(rt.masked_whiten(x, eps_mode="std", backend=cpu_backend), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [F64, F32])
def test_a_chunk_of_a_split_sequence_takes_it_with_its_carry_and_edge_map(chosen, dtype):
    """A sharded call's chunk (rl_triton/core/sharded.py) runs time-major GAE from a carry and
    reports its edge map: the outputs and the map bit for bit those of the row-walking kernel on
    the same chunk in batch-major memory."""
    from rl_triton.core import sharded
    from rl_triton.core.plans import Chunk

    r, v, boot, done, _ = _rollout(40, 600, 1, dtype, seed=3)
    r, v, done = r[..., 0], v[..., 0], done[..., 0]
    carry = torch.randn(600, generator=torch.Generator().manual_seed(4), dtype=dtype)
    results = []
    for layout in (lambda x: x, lambda x: x.t().contiguous()):  # time-major [T, N], then batch-major [N, T]
        edge = torch.zeros(600, 3, dtype=F64)
        tdim = 0 if not results else -1
        out = sharded._one_call(rt.gae, dict(rewards=layout(r), values=layout(v), done=layout(done),
                                             bootstrap_value=boot[:, 0], gamma=0.99, lmbda=0.95, time_dim=tdim,
                                             backend="cpu"), Chunk(carry, edge))
        results.append((*(o if tdim == 0 else o.t() for o in out), edge))
    assert chosen[0] == "gae_time_major" and "gae_time_major" not in chosen[1:]
    for a, b in zip(*results):
        assert torch.equal(a, b)
