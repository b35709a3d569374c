"""The Triton engine's launch regimes, forced small so the interpreter reaches each of them:
one chunk per row, several rows per program, chunked carry along long rows, and the time
axis split across programs (reduce-then-scan), for every algorithm, against the oracle."""

import numpy as np
import pytest
import torch

from rl_triton.testing import make

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
G, L = 0.9, 0.8
# name -> (function, catalog variant, other keyword arguments)
ALGOS = {
    "gae": ("gae", "terminated+bootstrap", {}),
    "gae_truncated": ("gae", "gym", {}),
    "td_lambda": ("td_lambda_return", "torchrl", {}),
    "discounted": ("discounted_return", "gym", {}),
    "vtrace": ("vtrace", "gym", dict(rho_bar=1.2, c_bar=0.9)),
    "vtrace_implied": ("vtrace", "done+bootstrap", {}),
    "retrace": ("retrace", "pairs", dict(c_bar=0.9)),
    "eligibility_trace": ("eligibility_trace", "done+initial", {}),
    "episodic_cumsum": ("episodic_cumsum", "done+initial", {}),
    "affine_scan_reverse": ("affine_scan", "reverse", {}),
    "affine_scan_forward": ("affine_scan", "forward", {}),
    "arrival_gae": ("arrival_gae", "ratio+done", dict(rho_bar=0.9, c_bar=1.2)),
}


def _problem(algo, seed, dtype=torch.float64, T=T):
    """15% of the steps terminate and 15% truncate, besides the catalog's edge flags."""
    fn, variant, kw = ALGOS[algo]
    return make(fn, (R, T), variant, dtype=dtype, device=DEVICE, seed=seed, p_term=0.15, p_trunc=0.15, gamma=G,
                lmbda=L, **kw)


@pytest.mark.parametrize("plan", list(PLANS), ids=list(PLANS))
@pytest.mark.parametrize("algo", list(ALGOS))
def test_regime_matches_oracle(algo, plan):
    _assert_matches_oracle(algo, plan, seed=len(algo) * 7 + len(plan))


def _assert_matches_oracle(algo, plan, seed, dtype=torch.float64, T=T):
    problem = _problem(algo, seed, dtype, T)
    with kernels.forced_plan(**(PLANS[plan] if isinstance(plan, str) else plan)):
        got = problem.call("triton")
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for g_, w in zip(got, problem.expected()):
        np.testing.assert_allclose(g_.double().cpu().numpy(), w, rtol=tol, atol=tol)


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
    # two-state scans of many rows (GAE skipping masked tokens): rows of 512 steps, 4 warps; 2 with
    # four or more streams (the KL-shaped rewards' log-probs)
    assert kernels.plan(1024, 8192, False, cpu, pair=True)[:2] == (1, 512)
    assert kernels.plan(1024, 8192, False, cpu, pair=True)[4] == 4
    assert kernels.plan(1024, 8192, False, cpu, pair=True, streams=4)[4] == 2


@pytest.mark.parametrize("algo", list(ALGOS))
def test_int64_indices_match_oracle(algo, monkeypatch):
    """The 64-bit index path (taken when some offset passes 2**31) computes the same results."""
    monkeypatch.setattr(kernels, "_INT32_LIMIT", 0)
    _assert_matches_oracle(algo, "split time, 2 chunks per segment", seed=len(algo) * 3)


def test_index_width_follows_the_offsets():
    """int32 indices unless an offset of the padded tiles reaches 2**31."""
    def wide(x):
        return kernels._arg_template("f2", x, 4, 8, False, x.device, 4, 9)[2] >= kernels._INT32_LIMIT

    assert not wide(torch.empty(4, 8))
    assert wide(torch.empty_strided((4, 8), (2**29, 1), device="meta"))  # 8 GiB apart: no storage needed
    rows_apart = torch.empty_strided((4, 8), (2**28, 1), device="meta")  # 3 * 2**28 < 2**31 <= 8 * 2**28
    assert wide(rows_apart)  # padded to 8 rows


def test_input_streams_reach_the_plan(monkeypatch):
    """The plan sees how many float tensors a call streams in per step."""
    seen = []
    real = kernels.plan
    monkeypatch.setattr(kernels, "plan", lambda *a: seen.append(a[6]) or real(*a))  # streams
    monkeypatch.setattr(kernels, "_launches", {})
    _problem("retrace", seed=1).call("triton")
    _problem("gae", seed=1).call("triton")
    assert seen == [6, 2]  # rewards, q, two log-probabilities, next_pi, next_q; rewards, values
