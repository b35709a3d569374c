"""The Triton engine on time-major data (``[T, N]`` with ``time_dim=0``, and any layout whose time
stride is not the smallest): the launch plan's choice (:func:`kernels.time_major_plan`), and each
regime forced small so the interpreter reaches it (the scan across the lanes of natural-lane
tiles; the WALK regime one step at a time: one chunk, chunked carry, split time), for every algorithm,
forward and reverse, against the float64 oracle; strided views; masked GAE (the two-state scan);
a sequence split across ranks whose chunks are time-major."""

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
    "walk, chunked carry, split time": dict(walk=1, block_t=2, block_r=2, n_seg=2),
    "walk, one chunk": dict(walk=1),
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


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_time_major_regime_matches_oracle(algo, plan):
    _check(_problem(algo, seed=len(algo) * 11 + len(plan)), PLANS[plan])


@pytest.mark.parametrize("plan", [{}, dict(walk=1)], ids=["planned", "walk"])
@pytest.mark.parametrize("algo", ["gae", "vtrace", "affine_scan_forward"])
def test_time_major_float32(algo, plan):
    """float32 accumulation, chunks with a partial last one."""
    _check(_problem(algo, seed=5, dtype=torch.float32, shape=(21, 6)), plan, tol=1e-5)


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

    p = dataclasses.replace(p, args=tuple(relaid(a) for a in p.args), kwargs={k: relaid(v) for k, v in p.kwargs.items()})
    assert kernels.is_time_major(p.args[0].t()) == (layout != "transposed")
    _check(p, dict(walk=1, block_t=4, block_r=2, n_seg=2))


@pytest.mark.parametrize("mode", ["skip", "pad"])
@pytest.mark.parametrize("plan", [{}, dict(walk=1, block_t=2, block_r=2), dict(walk=0, block_t=4, block_r=4)],
                         ids=["planned", "walk, chunked carry", "lanes"])
def test_masked_gae_time_major(mode, plan):
    """The two-state scan (skip) and padded GAE on ``[T, N]`` with ``time_dim=0``."""
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
    """time_dim=0 on ``[T, N]`` plans with time_major_plan (natural lanes); the same data
    batch-major does not; forcing ``walk`` reaches the WALK regime."""
    seen = []
    real = kernels.time_major_plan
    monkeypatch.setattr(kernels, "time_major_plan", lambda *a: seen.append(a[:2]) or real(*a))
    monkeypatch.setattr(kernels, "_launches", {})
    _problem("gae", seed=1).call("triton")
    assert seen == [(N, T)]
    _problem("gae", seed=1, shape=(N, T), time_dim=-1).call("triton")
    assert seen == [(N, T)]
    config = kernels._launch_config(rl_triton.core.spec.GAE, N, T, False, True, 2, torch.device("cpu"),
                                    time_major=True)
    assert config.constexprs[0][-2] is False and config.constexprs[0][9] == 0  # no WALK, natural lanes
    with kernels.forced_plan(walk=1):
        config = kernels._launch_config(rl_triton.core.spec.GAE, N, T, False, True, 2, torch.device("cpu"),
                                        time_major=True)
    assert config.constexprs[0][-2] is True


def test_time_major_plan_shapes():
    """Natural lanes: one warp of 128 rows (float32; 64 in float64), chunks of 8 steps, time split
    where the rows' programs are too few; never for the two-state scan, whose programs take 32
    rows where 128 leave them too few; WALK: 32 rows a warp, up to 8 warps where the rows fill the
    GPU."""
    cpu = torch.device("cpu")  # 4 multiprocessors stand in (kernels._multiprocessors)
    block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(65536, 128, False, cpu)
    assert not walk and (block_r, block_t, n_seg, num_warps) == (128, 8, 1, 1)
    assert kernels.time_major_plan(65536, 128, True, cpu)[0] == 64
    block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(8, 2048, False, cpu)
    assert block_r == 8 and num_warps == 1 and n_seg == 8 and n_seg * seg_chunks * block_t >= 2048
    assert kernels.time_major_plan(8, 2048, False, cpu, pair=True)[2] == 1
    assert kernels.time_major_plan(512, 2048, False, cpu, pair=True)[:3] == (32, 8, 1)  # rows for programs
    with kernels.forced_plan(walk=1):
        block_r, block_t, n_seg, seg_chunks, num_warps, _, walk = kernels.time_major_plan(65536, 128, False, cpu)
    assert walk and block_r == 256 and num_warps == 8 and n_seg == 1 and block_t == 16


def _sharded_worker(rank, world, group):
    bounds = [0, 7, 16][:world + 1]
    lo, hi = bounds[rank], bounds[rank + 1]
    for algo in ("gae", "vtrace", "affine_scan_forward"):
        p = _problem(algo, seed=2, shape=(bounds[-1], 3)).flagged_at(bounds[1:-1])
        whole = p.call("triton")
        for plan in ({}, dict(walk=1, block_t=2, block_r=2, n_seg=2)):
            with kernels.forced_plan(**plan) if plan else _planned():
                got = p.steps(lo, hi).call("triton", group=group)
            for g_, w in zip(got, whole):
                np.testing.assert_allclose(g_.double().numpy(), w[lo:hi].double().numpy(), rtol=1e-12, atol=1e-12,
                                           err_msg=f"{algo} {plan} rank {rank}")


@pytest.mark.skipif(DEVICE != "cpu", reason="gloo ranks on the CPU, the kernels in the interpreter")
def test_sharded_time_major_chunks():
    """Each rank's chunk of a ``[T, N]`` sequence (``time_dim=0``) is time-major: the planned
    regime and WALK reduce it to the handed map and scan it from the gathered maps, as one call
    would."""
    from helpers import spawn_gloo

    spawn_gloo(_sharded_worker, 2)
