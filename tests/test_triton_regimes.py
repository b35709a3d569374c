"""The Triton engine's launch regimes, forced small so the interpreter reaches each of them:
one chunk per row, several rows per program, chunked carry along long rows, and the time
axis split across programs (reduce-then-scan), for every algorithm, against the oracle."""

import numpy as np
import pytest
import torch

import oracle
import rl_triton as rt

kernels = pytest.importorskip("rl_triton.core.kernels")
pytestmark = pytest.mark.skipif(
    not (kernels.AVAILABLE and (kernels.INTERPRET or torch.cuda.is_available())),
    reason="Triton needs a GPU or TRITON_INTERPRET=1 set before import",
)

DEVICE = "cuda" if torch.cuda.is_available() and not kernels.INTERPRET else "cpu"
R, T = 3, 13
PLANS = {
    "one chunk, rows per program": dict(block_t=16, block_r=2),
    "chunked carry": dict(block_t=4, block_r=1),
    "split time, 2 chunks per segment": dict(block_t=2, block_r=2, n_seg=3),
    "split time, 1 chunk per segment": dict(block_t=4, block_r=4, n_seg=4),
}
G, L = 0.9, 0.8  # exact in float64, the dtype used here


def _case(seed, T=T):
    g = torch.Generator().manual_seed(seed)
    x = {k: torch.randn(R, T, generator=g, dtype=torch.float64) for k in ("r", "v", "nv", "lp", "lm")}
    x["lp"], x["lm"] = 0.4 * x["lp"], 0.4 * x["lm"]
    x["term"] = torch.rand(R, T, generator=g) < 0.15
    x["trunc"] = (torch.rand(R, T, generator=g) < 0.15) & ~x["term"]
    x["term"][0, -1] = True
    x["trunc"][1, 0] = True
    x["boot"] = torch.randn(R, generator=g, dtype=torch.float64)
    x["pi"] = torch.softmax(torch.randn(R, T, 3, generator=g, dtype=torch.float64), -1)
    x["nq"] = torch.randn(R, T, 3, generator=g, dtype=torch.float64)
    x["beta"] = torch.rand(R, T, generator=g, dtype=torch.float64)
    return {k: v.to(DEVICE) for k, v in x.items()}


def _np(t):
    return t.detach().cpu().numpy()


ALGOS = {
    "gae": (
        lambda x: rt.gae(x["r"], x["v"], bootstrap_value=x["boot"], terminated=x["term"], gamma=G, lmbda=L,
                         backend="triton"),
        lambda x, g, l: oracle.gae(_np(x["r"]), _np(x["v"]), oracle.implied_next_values(_np(x["v"]), _np(x["boot"])),
                                   _np(x["term"]), _np(x["term"]), g, l),
    ),
    "gae_truncated": (
        lambda x: rt.gae(x["r"], x["v"], next_values=x["nv"], terminated=x["term"], truncated=x["trunc"], gamma=G,
                         lmbda=L, backend="triton"),
        lambda x, g, l: oracle.gae(_np(x["r"]), _np(x["v"]), _np(x["nv"]), _np(x["term"]),
                                   _np(x["term"] | x["trunc"]), g, l),
    ),
    "td_lambda": (
        lambda x: rt.td_lambda_return(x["r"], x["nv"], done=x["term"] | x["trunc"], terminated=x["term"], gamma=G,
                                      lmbda=L, backend="triton"),
        lambda x, g, l: (oracle.td_lambda_return(_np(x["r"]), _np(x["nv"]), _np(x["term"]),
                                                 _np(x["term"] | x["trunc"]), g, l),),
    ),
    "discounted": (
        lambda x: rt.discounted_return(x["r"], terminated=x["term"], truncated=x["trunc"], next_values=x["nv"],
                                       gamma=G, backend="triton"),
        lambda x, g, l: (oracle.discounted_return(_np(x["r"]), _np(x["term"]), _np(x["term"] | x["trunc"]), g,
                                                  next_values=_np(x["nv"]), carry=_np(x["nv"])[:, -1]),),
    ),
    "vtrace": (
        lambda x: rt.vtrace(x["r"], x["v"], x["lp"], x["lm"], next_values=x["nv"], terminated=x["term"],
                            truncated=x["trunc"], gamma=G, lmbda=L, rho_bar=1.2, c_bar=0.9, backend="triton"),
        lambda x, g, l: oracle.vtrace(_np(x["r"]), _np(x["v"]), _np(x["nv"]), _np(x["lp"]), _np(x["lm"]),
                                      _np(x["term"]), _np(x["term"] | x["trunc"]), g, l, 1.2, 0.9, 1.2),
    ),
    "vtrace_implied": (
        lambda x: rt.vtrace(x["r"], x["v"], x["lp"], x["lm"], bootstrap_value=x["boot"], done=x["term"], gamma=G,
                            lmbda=L, backend="triton"),
        lambda x, g, l: oracle.vtrace(_np(x["r"]), _np(x["v"]), oracle.implied_next_values(_np(x["v"]), _np(x["boot"])),
                                      _np(x["lp"]), _np(x["lm"]), _np(x["term"]), _np(x["term"]), g, l, 1.0, 1.0, 1.0),
    ),
    "retrace": (
        lambda x: rt.retrace(x["r"], x["v"], x["lp"], x["lm"], next_pi=x["pi"], next_q=x["nq"], terminated=x["term"],
                             truncated=x["trunc"], gamma=G, lmbda=L, c_bar=0.9, backend="triton"),
        lambda x, g, l: (oracle.retrace(_np(x["r"]), _np(x["v"]), _np(x["lp"]), _np(x["lm"]), _np(x["term"]),
                                        _np(x["term"] | x["trunc"]), g, l, 0.9, next_pi=_np(x["pi"]),
                                        next_q=_np(x["nq"])),),
    ),
    "eligibility_trace": (
        lambda x: rt.eligibility_trace(x["r"], done=x["term"], gamma=G, lmbda=L, initial=x["boot"], backend="triton"),
        lambda x, g, l: (oracle.eligibility_trace(_np(x["r"]), _np(x["term"]), g, l, initial=_np(x["boot"])),),
    ),
    "episodic_cumsum": (
        lambda x: rt.episodic_cumsum(x["r"], done=x["term"], initial=x["boot"], backend="triton"),
        lambda x, g, l: (oracle.episodic_cumsum(_np(x["r"]), _np(x["term"]), initial=_np(x["boot"])),),
    ),
    "affine_scan_reverse": (
        lambda x: rt.affine_scan(x["r"], x["beta"], initial=x["boot"], backend="triton"),
        lambda x, g, l: (oracle.affine_scan(_np(x["r"]), _np(x["beta"]), reverse=True, initial=_np(x["boot"])),),
    ),
    "affine_scan_forward": (
        lambda x: rt.affine_scan(x["r"], x["beta"], reverse=False, initial=x["boot"], backend="triton"),
        lambda x, g, l: (oracle.affine_scan(_np(x["r"]), _np(x["beta"]), reverse=False, initial=_np(x["boot"])),),
    ),
}


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_regime_matches_oracle(algo, plan):
    _assert_matches_oracle(algo, plan, seed=len(algo) * 7 + len(plan))


def _assert_matches_oracle(algo, plan, seed, dtype=torch.float64, T=T):
    run, ref = ALGOS[algo]
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in _case(seed, T).items()}
    with kernels.forced_plan(**(PLANS[plan] if isinstance(plan, str) else plan)):
        got = run(x)
    got = got if isinstance(got, tuple) else (got,)
    want = ref({k: v.double() if v.is_floating_point() else v for k, v in x.items()},
               np.full((R, T), G), np.full((R, T), L))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for g_, w in zip(got, want):
        np.testing.assert_allclose(_np(g_.double()), w, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("plan", [dict(block_t=16, block_r=2), dict(block_t=16, block_r=1, n_seg=2)],
                         ids=["chunked carry", "split time"])
@pytest.mark.parametrize("algo", list(ALGOS))
def test_mirrored_runs_match_oracle(algo, plan, dtype):
    """Reverse scans over 16-step chunks mirror runs of 4 lanes in float32 and of 2 in float64
    (chunks of up to 8 steps, used above, keep natural lanes): a partial last chunk, carries
    between chunks, segments."""
    _assert_matches_oracle(algo, plan, seed=len(algo) * 5, dtype=dtype, T=45)


def test_plan_regimes_are_reached():
    """The default plan uses several rows per program for short rows and splits few long rows."""
    cpu = torch.device("cpu")
    block_r, block_t, n_seg, *_ = kernels.plan(4096, 8, False, cpu)
    assert block_r > 1 and n_seg == 1
    block_r, block_t, n_seg, seg_chunks, *_ = kernels.plan(1, 1 << 20, False, cpu)
    assert n_seg > 1 and block_t < (1 << 20) and seg_chunks * block_t * n_seg >= 1 << 20
    block_r, block_t, n_seg, seg_chunks, num_warps, _ = kernels.plan(16384, 4096, False, cpu)
    assert (block_r, block_t, n_seg, num_warps) == (1, 256, 1, 1)  # reverse scans, many rows: 256-step rows
    assert kernels.plan(16384, 4096, False, cpu, need_prev=True)[:2] == (4, 128)  # V-trace: 128-step chunks
    assert kernels.plan(16384, 4096, False, cpu, streams=5)[4] == 2  # many inputs (Retrace): 2 warps
    block_r, block_t, n_seg, seg_chunks, num_warps, _ = kernels.plan(16384, 4096, False, cpu, reverse=False)
    assert n_seg == 1 and block_t == 1024 and num_warps <= 4  # forward scans: long chunks, few warps
    assert kernels.plan(16384, 512, False, cpu, reverse=False)[1] == 128  # ... of long rows only
    block_r, block_t, n_seg, seg_chunks, num_warps, _ = kernels.plan(2, 3000, False, cpu)
    assert (block_r, block_t, n_seg, num_warps) == (1, 4096, 1, 16)  # few rows of <= 4096 steps: whole rows
    assert kernels.plan(2, 3000, True, cpu)[1] <= 512  # float64 keeps its chunk limit
    assert kernels.plan(2, 3000, False, cpu, need_prev=True)[1] == 1024  # V-trace keeps chunks


@pytest.mark.parametrize("algo", list(ALGOS))
def test_int64_indices_match_oracle(algo, monkeypatch):
    """The 64-bit index path (taken when some offset passes 2**31) computes the same results."""
    monkeypatch.setattr(kernels, "_INT32_LIMIT", 0)
    _assert_matches_oracle(algo, "split time, 2 chunks per segment", seed=len(algo) * 3)


def test_index_width_follows_the_offsets():
    """int32 indices unless an offset of the padded tiles reaches 2**31."""
    small = torch.empty(4, 8)
    assert not kernels._pack(["f2"], [small], 4, 8, False, small.device, 4, 9)[3]
    wide = torch.empty_strided((4, 8), (2**29, 1), device="meta")  # 8 GiB apart: no storage needed
    assert kernels._pack(["f2"], [wide], 4, 8, False, wide.device, 4, 9)[3]
    rows_apart = torch.empty_strided((4, 8), (2**28, 1), device="meta")  # 3 * 2**28 < 2**31 <= 8 * 2**28
    assert kernels._pack(["f2"], [rows_apart], 4, 8, False, rows_apart.device, 4, 9)[3]  # padded to 8 rows


def test_input_streams_reach_the_plan(monkeypatch):
    """The plan sees how many float tensors a call streams in per step."""
    seen = []
    real = kernels.plan
    monkeypatch.setattr(kernels, "plan", lambda *a: seen.append(a[-1]) or real(*a))
    monkeypatch.setattr(kernels, "_launches", {})
    x = _case(seed=1)
    ALGOS["retrace"][0](x)
    ALGOS["gae"][0](x)
    assert seen == [6, 2]  # rewards, q, two log-probabilities, next_pi, next_q; rewards, values
