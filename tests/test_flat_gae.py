"""The CPU backend's GAE over one flat buffer cut at its end flags (``cpu.gae_flat_run``: the
lanes of one thread and the threads) and its flag pass (``cpu.flat_flags_run``), against the
float64 oracle and numpy's indexing."""

from __future__ import annotations

import numpy as np
import pytest

from rl_triton.core import cpu
from rl_triton.testing import oracle

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")


def _flat(n, p_end, seed, dtypes=(np.float64, np.float32, np.float32)):
    rng = np.random.default_rng(seed)
    r, v, nv = (rng.standard_normal(n).astype(d) for d in dtypes)
    ends = rng.random(n) < p_end
    mask = rng.random(n) < 0.7
    return r, v, nv, mask, ends


def _oracle(r, v, nv, mask, ends, gamma, lmbda):
    """The oracle's GAE with Tianshou's conventions: next values times the mask, every end a cut
    that keeps its bootstrap (a truncation)."""
    n = r.shape[0]
    nvm = nv.astype(np.float64) * (np.ones(n) if mask is None else mask)
    adv, tgt = oracle.gae(r[None], v[None], nvm[None], np.zeros((1, n), bool), ends[None], np.full((1, n), gamma),
                          np.full((1, n), lmbda))
    return adv[0], tgt[0]


@pytest.mark.parametrize("dtypes", [(np.float64,) * 3, (np.float32,) * 3, (np.float64, np.float32, np.float32)])
@pytest.mark.parametrize("n,p_end", [(1, 0.0), (2, 1.0), (7, 0.3), (1000, 0.0), (1000, 0.01), (5003, 0.002),
                                     (20011, 0.05), (20011, 0.9)])
@pytest.mark.parametrize("threads", [1, 3])
def test_flat_gae_matches_the_oracle(dtypes, n, p_end, threads):
    r, v, nv, mask, ends = _flat(n, p_end, n + threads, dtypes)
    adv, tgt = cpu.gae_flat_run(r, v, nv, mask, ends, 0.97, 0.9, threads=threads)
    want_adv, want_tgt = _oracle(r, v, nv, mask, ends, 0.97, 0.9)
    assert adv.dtype == tgt.dtype == np.float64
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tgt, want_tgt, rtol=1e-12, atol=1e-12)
    alone, none = cpu.gae_flat_run(r, v, nv, None, ends, 0.97, 0.9, threads=threads, targets=False)
    assert none is None
    np.testing.assert_allclose(alone, _oracle(r, v, nv, None, ends, 0.97, 0.9)[0], rtol=1e-12, atol=1e-12)


def test_stride_zero_inputs_and_coefficient_edges():
    r, v, nv, mask, ends = _flat(3000, 0.01, 4)
    zeros = np.broadcast_to(np.float64(0.0), (3000,))
    for gamma, lmbda in ((0.99, 0.95), (0.0, 0.5), (0.9, 0.0), (1.0, 1.0)):
        adv, tgt = cpu.gae_flat_run(r, zeros, zeros, None, ends, gamma, lmbda)
        want = _oracle(r, zeros, zeros, None, ends, gamma, lmbda)
        np.testing.assert_allclose(adv, want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(tgt, want[1], rtol=1e-12, atol=1e-12)


def test_bounds_cut_only_after_ends():
    rng = np.random.default_rng(0)
    bound = cpu._flat_kernels(False)[0]
    for n, p_end, pieces in ((1, 0.5, 4), (10, 0.0, 4), (1000, 0.003, 4), (1000, 0.5, 12), (37, 1.0, 8)):
        ends = (rng.random(n) < p_end).view(np.uint8)
        b = np.empty(pieces + 1, np.int64)
        bound(ends, pieces, b)
        assert b[0] == 0 and b[-1] == n and np.all(np.diff(b) >= 0)
        inner = b[1:-1][(b[1:-1] > 0) & (b[1:-1] < n)]
        assert np.all(ends[inner - 1] != 0)  # every stretch but the last ends at an end flag


def test_a_non_finite_episode_stays_out_of_the_others():
    r, v, nv, mask, ends = _flat(4000, 0.0, 5)
    ends[[999, 1999, 2999]] = True
    r[2500], v[1500] = np.nan, np.inf
    adv, tgt = cpu.gae_flat_run(r, v, nv, mask, ends, 0.99, 0.95, threads=2)
    want_adv, want_tgt = _oracle(r, v, nv, mask, ends, 0.99, 0.95)
    np.testing.assert_array_equal(np.isfinite(adv), np.isfinite(want_adv))
    assert np.isfinite(adv[:1000]).all() and np.isfinite(adv[3000:]).all()
    np.testing.assert_allclose(adv, want_adv, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(tgt, want_tgt, rtol=1e-12, atol=1e-12)


def test_bad_arguments_name_themselves():
    r, v, nv, mask, ends = _flat(10, 0.1, 0)
    with pytest.raises(ValueError, match="values"):
        cpu.gae_flat_run(r, v[:5], nv, mask, ends, 0.99, 0.95)
    with pytest.raises(TypeError, match="next_values"):
        cpu.gae_flat_run(r, v, nv.astype(np.float16), mask, ends, 0.99, 0.95)
    with pytest.raises(TypeError, match="ends"):
        cpu.gae_flat_run(r, v, nv, mask, ends.astype(np.int64), 0.99, 0.95)
    with pytest.raises(TypeError, match="slot_end"):
        cpu.flat_flags_run(np.arange(10), ends, ends, ends, ends.astype(np.int8))
    with pytest.raises(TypeError, match="indices"):
        cpu.flat_flags_run(np.arange(10, dtype=np.uint64), ends, ends, ends, ends)


@pytest.mark.parametrize("shift", [0, -4])
def test_flat_flags_match_numpy_indexing(shift):
    rng = np.random.default_rng(3)
    size, n = 50, 200
    indices = rng.integers(0, size, n) + shift
    terminated, truncated = rng.random(n) < 0.1, rng.random(n) < 0.1
    slot_off, slot_end = rng.random(size) < 0.3, rng.random(size) < 0.2
    ends, keep = cpu.flat_flags_run(indices, terminated, truncated, slot_off, slot_end)
    np.testing.assert_array_equal(keep, ~slot_off[indices])
    np.testing.assert_array_equal(ends, terminated | truncated | np.isin(indices, np.flatnonzero(slot_end)))
    assert cpu.flat_flags_run(np.array([0, size]), terminated[:2], truncated[:2], slot_off, slot_end) is None
    assert cpu.flat_flags_run(np.array([-size - 1]), terminated[:1], truncated[:1], slot_off, slot_end) is None
