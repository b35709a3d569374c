"""The numba backend's own mechanics: which build runs, the flag passes it makes, and the
kernels of SB3's and CleanRL's GAE call (checked against the oracle at the sizes that reach
their row blocks). The general kernels are checked against the oracle for every backend in
test_oracle_agreement.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.core import cpu
from rl_triton.testing import reference

pytestmark = pytest.mark.skipif(not cpu.AVAILABLE, reason="needs numba")

_BUILD = textwrap.dedent("""
    import sys
    import numpy as np
    from rl_triton.core import cpu, spec
    kernel = cpu._kernel(cpu.affine_scan, (*spec.AFFINE_SCAN.kinds, "o2", "e"), np.dtype(np.float64),
                         sys.argv[1] == "parallel")
    print(sum(kernel.stats.cache_hits.values()))
""")


def test_serial_and_parallel_builds_have_their_own_cache_entries(tmp_path):
    """numba's disk cache keys a build by function name and signature, not by compile flags:
    without separate names the serial kernel loads the parallel build saved earlier (or the
    reverse), and small calls pay for the thread pool while large ones run on one core."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def cache_hits(variant: str) -> str:
        done = subprocess.run([sys.executable, "-c", _BUILD, variant], env=env, capture_output=True, text=True,
                              check=True)
        return done.stdout.strip()

    assert cache_hits("parallel") == "0"  # compiled and saved
    assert cache_hits("serial") == "0"  # not the parallel build: compiled too
    assert cache_hits("serial") == "1"  # now found in the cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64, torch.int16,
                                   torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.bool])
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "strided"])
def test_flag_bytes_and_binary_check(dtype, layout):
    """Flags of any dtype and layout become 0/1 bytes in place of nonzero; the 0/1 check sees
    every element."""
    mask = torch.rand(6, 40, generator=torch.Generator().manual_seed(1)) < 0.3
    if layout == "strided":
        x = torch.ones(6, 80, dtype=dtype)[:, ::2]
        x.copy_(mask)
    else:
        x = (mask if layout == "contiguous" else mask.t().contiguous().t()).to(dtype)
    assert torch.equal(torch.from_numpy(cpu._flag_bytes(x).copy()), mask.to(torch.uint8))
    assert cpu.all_binary(x)
    if dtype != torch.bool:
        y = x.clone()
        y[5, 39] = 2
        assert not cpu.all_binary(y)
        if dtype.is_floating_point:
            y[5, 39] = 0.5
            assert not cpu.all_binary(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("layout,R,T", [("time-major", cpu.ROW_BLOCK + 45, 37), ("time-major", 8, 1),
                                        ("time-major", 3, 2), ("batch-major", 5, 37), ("batch-major", 1, 9)])
def test_episode_starts_gae_matches_oracle(dtype, layout, R, T, monkeypatch):
    """SB3's and CleanRL's call (episode starts, implied next values, number coefficients) runs
    its own kernels, row blocks in time-major memory (a partial last block here)."""
    taken = []
    original = cpu._episode_starts_call
    monkeypatch.setattr(cpu, "_episode_starts_call", lambda *a: taken.append(original(*a)) or taken[-1])
    monkeypatch.setattr(cpu, "TIME_MAJOR_MIN_ROWS", 1 << 62)  # not gae_time_major (tests/test_time_major_cpu.py)
    g = torch.Generator().manual_seed(R * 100 + T)
    r, v = (torch.randn(R, T, generator=g, dtype=torch.float64) for _ in range(2))
    starts = torch.rand(R, T, generator=g) < 0.2
    starts[0, 0] = True
    last = torch.rand(R, generator=g) < 0.5
    boot = torch.randn(R, generator=g, dtype=torch.float64)
    kw = dict(bootstrap_value=boot.to(dtype), gamma=0.97, lmbda=0.9)
    if layout == "time-major":  # CleanRL's (T, N) tensors with float flags
        args = r.t().contiguous().to(dtype), v.t().contiguous().to(dtype)
        kw.update(episode_starts=starts.t().contiguous().float(), last_done=last.float(), time_dim=0)
    else:
        args = r.to(dtype), v.to(dtype)
        kw.update(episode_starts=starts, last_done=last)
    got = rl_triton.gae(*args, **kw, backend="cpu")
    assert taken == [True]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    for g_, w in zip(got, reference("gae", args, kw)):
        np.testing.assert_allclose(g_.double().numpy(), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtypes", [(torch.bool, torch.bool), (torch.float32, torch.bool), (torch.uint8, torch.int64),
                                    (torch.float16, torch.float16)])
@pytest.mark.parametrize("layout", ["same", "transposed", "strided", "different"])
def test_implies(dtypes, layout):
    """``implies(a, b)``: b set wherever a is (terminated only where done), on any layout pair."""
    g = torch.Generator().manual_seed(2)
    b = torch.rand(5, 33, generator=g) < 0.4
    a = b & (torch.rand(5, 33, generator=g) < 0.5)
    views = {"same": lambda x: x, "transposed": lambda x: x.t().contiguous().t(),
             "strided": lambda x: torch.zeros(5, 66, dtype=x.dtype)[:, ::2].copy_(x)}
    if layout == "different":  # a time-major, b batch-major: the torch fallback
        a_, b_ = views["transposed"](a.to(dtypes[0])), b.to(dtypes[1])
    else:
        a_, b_ = views[layout](a.to(dtypes[0])), views[layout](b.to(dtypes[1]))
    assert cpu.implies(a_, b_)
    assert cpu.implies(torch.zeros_like(a_), b_)
    bad = a_.clone()
    bad[4, 32] = 1
    assert cpu.implies(bad, b_) == bool(b[4, 32])
    bad[0, 0] = 1
    b_[0, 0] = 0
    assert not cpu.implies(bad, b_)


def _every_estimator(x, starts, done, term, lp):
    """One call of each estimator (and both GAE kernels) on CPU tensors [R, T]."""
    boot, nv = x[:, 0].clone(), x.roll(1, 1)
    return [
        *rl_triton.gae(x, nv, bootstrap_value=boot, episode_starts=starts, last_done=done[:, -1], backend="cpu"),
        *rl_triton.gae(x.t().contiguous(), nv.t().contiguous(), bootstrap_value=boot,
                       episode_starts=starts.t().contiguous(), last_done=done[:, -1], time_dim=0, backend="cpu"),
        *rl_triton.gae(x, nv, next_values=nv * 0.5, done=done, terminated=term, backend="cpu"),
        rl_triton.td_lambda_return(x, nv, done=done, terminated=term, backend="cpu"),
        rl_triton.discounted_return(x, terminated=term, bootstrap_value=boot, backend="cpu"),
        *rl_triton.vtrace(x, nv, lp, lp * 0.5, bootstrap_value=boot, terminated=term, backend="cpu"),
        rl_triton.retrace(x, nv, lp, lp * 0.5, next_expected_q=nv * 0.3, done=done, terminated=term, backend="cpu"),
        rl_triton.eligibility_trace(x, done=done, backend="cpu"),
        rl_triton.episodic_cumsum(x, done=done, backend="cpu"),
        rl_triton.affine_scan(x, torch.sigmoid(nv), backend="cpu"),
    ]


def test_parallel_builds_match_serial_ones(monkeypatch):
    """Rows are independent, so the parallel builds give the serial results bit for bit."""
    g = torch.Generator().manual_seed(4)
    R, T = cpu.ROW_BLOCK + 45, 23
    x = torch.randn(R, T, generator=g)
    done = torch.rand(R, T, generator=g) < 0.1
    term = done & (torch.rand(R, T, generator=g) < 0.5)
    starts = torch.rand(R, T, generator=g) < 0.1
    lp = 0.3 * torch.randn(R, T, generator=g)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 1 << 62)
    serial = _every_estimator(x, starts, done, term, lp)
    monkeypatch.setattr(cpu, "PARALLEL_MIN_ELEMENTS", 0)
    parallel = _every_estimator(x, starts, done, term, lp)
    assert len(serial) == len(parallel) == 14
    for s, p in zip(serial, parallel):
        assert torch.equal(s, p)
