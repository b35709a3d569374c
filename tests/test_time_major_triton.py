"""The Triton engine on time-major data (``[T, N]`` with ``time_dim=0``, and any layout whose time
stride is not the smallest): the launch plan's choice (:func:`kernels.time_major_plan`), and each
regime forced small so the interpreter reaches it (the WALK regime one step at a time, in two
passes a chunk, one, one from registers, or that a chunk ahead: one chunk, chunked carry, split
time; the scan across the lanes of natural-lane tiles), for every algorithm, forward and
reverse, against the float64 oracle; strided views; masked GAE (the two-state scan); a sequence
split across ranks whose chunks are time-major."""

import contextlib
import dataclasses

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.testing import make, oracle
from test_triton_regimes import ALGOS, DEVICE, G, L, kernels, pytestmark  # noqa: F401 (pytestmark applies here)

T, N = 7, 5
PLANS = {
    "planned": {},
    "walk, chunked carry, split time": dict(block_t=2, block_r=2, n_seg=2),
    "walk from registers, chunked carry, split time": dict(walk=3, block_t=2, block_r=2, n_seg=2),
    "walk a chunk ahead, chunked carry, split time": dict(walk=4, block_t=2, block_r=2, n_seg=2),
    "lanes, split time": dict(walk=0, block_t=4, block_r=4, n_seg=2),
}


def _problem(algo, seed, dtype=torch.float64, shape=(T, N), time_dim=0):
    fn, variant, kw = ALGOS[algo]
    return make(fn, shape, variant, time_dim=time_dim, dtype=dtype, device=DEVICE, seed=seed, p_term=0.15,
                p_trunc=0.15, gamma=G, lmbda=L, **kw)


def _check(problem, plan, tol=1e-10):
    with kernels.forced_plan(**plan) if plan else _planned():
        got = problem.call("triton")
    for g_, w in zip(got, problem.expected()):
        np.testing.assert_allclose(g_.double().cpu().numpy(), w, rtol=tol, atol=tol)


def _planned():
    return contextlib.nullcontext()


@pytest.fixture(autouse=True)
def _regime_on(monkeypatch):
    """The time-major regime taken at the tests' small shapes (kernels.time_major_regime_wins
    keeps it for large ones), with no plan kept from before."""
    monkeypatch.setattr(kernels, "time_major_regime_wins", lambda R, T: True)
    monkeypatch.setattr(kernels, "_launches", {})
    rl_triton.core.plans.clear()
    yield
    rl_triton.core.plans.clear()


def _plans_seen(monkeypatch, problem) -> list:
    """The ``(R, T)`` of every time-major plan made while ``problem`` runs on the planned path."""
    seen = []
    real = kernels.time_major_plan
    monkeypatch.setattr(kernels, "time_major_plan", lambda *a: seen.append(a[:2]) or real(*a))
    _check(problem, None)
    return seen


def test_the_switch_off_keeps_the_lane_plan(monkeypatch):
    """With kernels.TIME_MAJOR_REGIME off, time-major data keeps the plan of every layout."""
    monkeypatch.setattr(kernels, "TIME_MAJOR_REGIME", False)
    assert _plans_seen(monkeypatch, _problem("gae", seed=3)) == []


def test_the_regime_where_it_wins(monkeypatch):
    """The default rule: the regime from 16 environments and 512 steps, or 16384 environments;
    the plan of every layout below (the measured table in kernels.time_major_regime_wins)."""
    monkeypatch.undo()
    wins = kernels.time_major_regime_wins
    taken = {(N, T): wins(N, T) for T, N in ((24, 4096), (128, 1024), (256, 256), (2048, 8), (2048, 64),
                                             (512, 4096), (32, 65536), (128, 65536), (32768, 256), (512, 15))}
    assert [k for k, v in taken.items() if v] == [(64, 2048), (4096, 512), (65536, 32), (65536, 128), (256, 32768)]
    monkeypatch.setattr(kernels, "_launches", {})
    assert _plans_seen(monkeypatch, _problem("gae", seed=3)) == []  # 5 environments of 7 steps
    monkeypatch.setattr(kernels, "time_major_regime_wins", lambda R, T: R == N)
    monkeypatch.setattr(kernels, "_launches", {})
    rl_triton.core.plans.clear()
    assert _plans_seen(monkeypatch, _problem("gae", seed=3)) == [(N, T)]


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_time_major_regime_matches_oracle(algo, plan):
    _check(_problem(algo, seed=len(algo) * 11 + len(plan)), PLANS[plan])


@pytest.mark.parametrize("plan", [{}, dict(walk=1), dict(walk=3), dict(walk=4, block_t=8), dict(walk=0)],
                         ids=["planned", "walk in one pass", "walk from registers", "walk a chunk ahead", "lanes"])
@pytest.mark.parametrize("algo", ["gae", "vtrace", "affine_scan_forward"])
def test_time_major_float32(algo, plan):
    """float32 accumulation, chunks with a partial last one."""
    _check(_problem(algo, seed=5, dtype=torch.float32, shape=(21, 6)), plan, tol=1e-5)


@pytest.mark.parametrize("algo", ["gae", "vtrace_implied"])
def test_int64_indices_time_major(algo, monkeypatch):
    """The 64-bit index path of the WALK regime, over chunks and segments."""
    monkeypatch.setattr(kernels, "_INT32_LIMIT", 0)
    _check(_problem(algo, seed=9), PLANS["walk, chunked carry, split time"])


@pytest.mark.parametrize("algo, layout", [("gae", "channel slice"), ("vtrace_implied", "rows apart"),
                                          ("eligibility_trace", "transposed")])
def test_strided_views_match_oracle(algo, layout):
    """Views that are not contiguous ``[T, N]``: a channel of ``[T, N, 2]`` (rows 2 apart),
    the transpose of contiguous ``[N, T]`` (batch-major data read with ``time_dim=0``: the time
    stride is the smallest, the batch-major plan), and rows 3 apart with time stride 3N+1."""
    p = _problem(algo, seed=len(layout))

    def relaid(x):
        if not isinstance(x, torch.Tensor) or x.ndim != 2:
            return x
        if layout == "channel slice":
            return torch.stack([x, torch.zeros_like(x)], -1)[..., 0]
        if layout == "transposed":
            return x.t().contiguous().t()
        wide = torch.zeros(x.shape[0], 3 * x.shape[1] + 1, dtype=x.dtype, device=x.device)
        wide[:, :3 * x.shape[1]:3] = x
        return wide[:, :3 * x.shape[1]:3]

    p = dataclasses.replace(p, args=tuple(relaid(a) for a in p.args),
                            kwargs={k: relaid(v) for k, v in p.kwargs.items()})
    assert kernels.is_time_major(p.args[0].t()) == (layout != "transposed")
    _check(p, dict(walk=1, block_t=4, block_r=2, n_seg=2))


@pytest.mark.parametrize("mode", ["skip", "pad"])
@pytest.mark.parametrize("plan", [{}, dict(block_t=2, block_r=2, n_seg=2), dict(walk=1, block_t=2, block_r=4),
                                  dict(walk=0, block_t=4, block_r=4, n_seg=2)],
                         ids=["planned", "walk, split time", "walk in one pass, chunked carry", "lanes, split time"])
def test_masked_gae_time_major(mode, plan):
    """The two-state scan (skip) and padded GAE on ``[T, N]`` with ``time_dim=0``; the
    time-major plan splits the two-state scan's time too (phase 2 folds the segments' maps)."""
    g = torch.Generator().manual_seed(7)
    r, v = (torch.randn(T, N, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(T, N, generator=g) < 0.7
    boot = torch.randn(N, generator=g, dtype=torch.float64)
    with kernels.forced_plan(**plan) if plan else _planned():
        adv, ret = rl_triton.gae(r.to(DEVICE), v.to(DEVICE), mask=mask.to(DEVICE), mask_mode=mode,
                                 bootstrap_value=boot.to(DEVICE), gamma=G, lmbda=L, time_dim=0, backend="triton")
    want_adv, want_ret = oracle.gae_masked(r.t().numpy(), v.t().numpy(), mask.t().numpy(), np.full((N, T), G),
                                           np.full((N, T), L), mode=mode, bootstrap=boot.numpy())
    np.testing.assert_allclose(adv.cpu().t().numpy(), want_adv, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(ret.cpu().t().numpy(), want_ret, rtol=1e-10, atol=1e-10)


def test_plan_follows_the_strides(monkeypatch):
    """time_dim=0 on ``[T, N]`` plans with time_major_plan (WALK from registers); the same
    data batch-major does not; forced ``walk`` reaches the other regimes."""
    seen = []
    real = kernels.time_major_plan
    monkeypatch.setattr(kernels, "time_major_plan", lambda *a: seen.append(a[:2]) or real(*a))
    monkeypatch.setattr(kernels, "_launches", {})
    _problem("gae", seed=1).call("triton")
    assert seen == [(N, T)]
    _problem("gae", seed=1, shape=(N, T), time_dim=-1).call("triton")
    assert seen == [(N, T)]

    def regime(**forced):
        with kernels.forced_plan(**forced) if forced else _planned():
            c = kernels._launch_config(rl_triton.core.spec.GAE, N, T, False, True, 2, torch.device("cpu"),
                                       time_major=True)
        return c.constexprs[0][-2], c.constexprs[0][9]  # WALK, VEC

    assert regime() == (3, 0) and regime(walk=2) == (2, 0) and regime(walk=0) == (0, 0)  # natural lanes


def test_time_major_plan_shapes():
    """WALK from registers: 32 rows, one warp, a program, chunks of 8 steps, time split where the
    warps are fewer than four times the multiprocessors, into no more segments than leave 64 maps
    a thread. Natural lanes: one warp of 128 rows (float32; 64 in float64), chunks of 8 steps."""
    cpu = torch.device("cpu")  # 4 multiprocessors stand in (kernels._multiprocessors)
    block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(65536, 128, False, cpu)
    assert walk == 3 and (block_r, block_t, n_seg, num_warps) == (32, 8, 1, 1)
    block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(8, 2048, False, cpu)
    assert block_r == 8 and num_warps == 1 and n_seg == 16 and n_seg * seg_chunks * block_t >= 2048
    assert kernels.time_major_plan(256, 1024, True, cpu)[:3] == (32, 8, 2)  # 8 warps of 16: split in 2
    block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(512, 1024, False, cpu)
    assert (block_r, n_seg, num_warps) == (32, 1, 1)  # 16 programs of a warp: no split
    with kernels.forced_plan(warps=4096):
        assert kernels.time_major_plan(32, 1 << 20, False, cpu)[2] == 64  # 64 maps a thread: 32 x 64 in a warp
    with kernels.forced_plan(walk=0):
        block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(65536, 128, False, cpu)
        assert walk == 0 and (block_r, block_t, n_seg, num_warps) == (128, 8, 1, 1)
        assert kernels.time_major_plan(65536, 128, True, cpu)[0] == 64


def _sharded_worker(rank, world, group):
    kernels.time_major_regime_wins = lambda R, T: True  # a spawned process: the fixture's does not reach it
    planned = []
    real = kernels.time_major_plan
    kernels.time_major_plan = lambda *a: planned.append(a) or real(*a)
    bounds = [0, 7, 16][:world + 1]
    lo, hi = bounds[rank], bounds[rank + 1]
    g = torch.Generator().manual_seed(4)
    r, v = (torch.randn(bounds[-1], 3, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(bounds[-1], 3, generator=g) < 0.6

    def masked(lo, hi, **kw):
        return rl_triton.gae(r[lo:hi], v[lo:hi], mask=mask[lo:hi], time_dim=0, backend="triton", **kw)

    cases = [(algo, _problem(algo, seed=2, shape=(bounds[-1], 3)).flagged_at(bounds[1:-1]))
             for algo in ("gae", "vtrace", "affine_scan_forward")]
    for algo, p in cases + [("masked gae", None)]:
        whole = p.call("triton") if p is not None else masked(0, bounds[-1])
        for plan in ({}, dict(block_t=2, block_r=2, n_seg=2)):
            with kernels.forced_plan(**plan) if plan else _planned():
                got = p.steps(lo, hi).call("triton", group=group) if p is not None else masked(lo, hi, group=group)
            for g_, w in zip(got, whole):
                np.testing.assert_allclose(g_.double().numpy(), w[lo:hi].double().numpy(), rtol=1e-12, atol=1e-12,
                                           err_msg=f"{algo} {plan} rank {rank}")
    assert planned, "the chunks took the time-major plan"


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU, the kernels in the interpreter")
def test_sharded_time_major_chunks():
    """Each rank's chunk of a ``[T, N]`` sequence (``time_dim=0``) is time-major: the WALK
    regime, in one chunk and over chunks and segments, reduces it to the handed map and scans it
    from the gathered maps, as one call would."""
    from helpers import spawn_gloo

    spawn_gloo(_sharded_worker, 2)
