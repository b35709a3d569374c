"""The engine's PREV_MEM regime: an epilogue that reads y one step back (V-trace's vs[t+1])
reads it from its own outputs after a barrier instead of a lane gather. Forced on and off over
one chunk, chunked carries, several rows per program and mirrored runs, with and without a
carry from a chunk of a longer sequence, against the float64 oracle and the gather regime; and
the plan takes it only where it can (one segment, outputs in the accumulation dtype)."""

import numpy as np
import pytest
import torch

from rl_triton.core import plans, spec
from rl_triton.testing import make

kernels = pytest.importorskip("rl_triton.core.kernels")
pytestmark = pytest.mark.skipif(
    not (kernels.AVAILABLE and (kernels.INTERPRET or torch.cuda.is_available())),
    reason="Triton needs a GPU or TRITON_INTERPRET=1 set before import",
)

DEVICE = "cuda" if torch.cuda.is_available() and not kernels.INTERPRET else "cpu"
PLANS = {
    "one chunk": dict(block_t=64, block_r=1),
    "one chunk, rows per program": dict(block_t=64, block_r=2),
    "chunked carry, natural lanes": dict(block_t=4, block_r=1),
    "chunked carry, mirrored runs": dict(block_t=16, block_r=2),
}


def _problem(variant, dtype, seed, T=45):
    return make("vtrace", (3, T), variant, dtype=dtype, device=DEVICE, seed=seed, p_term=0.15, p_trunc=0.15,
                gamma=0.9, lmbda=0.8, rho_bar=1.2, c_bar=0.9)


CASES = [(plan, variant, torch.float32) for plan in PLANS for variant in ("gym", "done+bootstrap")] + [
    ("one chunk", "episode_starts", torch.float64), ("chunked carry, mirrored runs", "gym", torch.float64)]


@pytest.mark.parametrize("plan,variant,dtype", CASES, ids=[f"{p}-{v}-{str(d)[6:]}" for p, v, d in CASES])
def test_read_back_matches_oracle_and_gather(plan, variant, dtype):
    problem = _problem(variant, dtype, seed=len(plan) + len(variant))
    got = {}
    for prev_mem in (True, False):
        with kernels.forced_plan(**PLANS[plan], prev_mem=prev_mem):
            got[prev_mem] = problem.call("triton")
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    for mem, gather, want in zip(got[True], got[False], problem.expected()):
        np.testing.assert_allclose(mem.double().cpu().numpy(), want, rtol=tol, atol=tol)
        torch.testing.assert_close(mem, gather, rtol=1e-6 if dtype == torch.float32 else 1e-13, atol=0)


@pytest.mark.parametrize("variant", ["gym", "done+bootstrap"])
@pytest.mark.parametrize("plan", ["one chunk", "chunked carry, mirrored runs"])
def test_read_back_with_a_chunk_carry(plan, variant):
    """A chunk's carry ((vs - v)[T] from the steps after it) enters vs[T] at the window end."""
    problem = _problem(variant, torch.float64, seed=7)
    for name in ("done", "terminated", "truncated"):  # the window end continues: vs[T] reads the carry
        if name in problem.kwargs:
            problem.kwargs[name][:, -1] = 0
    carry = torch.linspace(-1.0, 2.0, 3, dtype=torch.float64, device=DEVICE)
    chunk = plans.Chunk(carry=carry, edge=None)  # what the sharded route passes a chunk's call
    want = problem.call("torch", _chunk=chunk)
    with kernels.forced_plan(**PLANS[plan], prev_mem=True):
        got = problem.call("triton", _chunk=chunk)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(got[1], problem.call("triton")[1])  # the carry reached the advantages


def test_plan_takes_the_read_back_where_it_can(monkeypatch):
    monkeypatch.setattr(kernels, "_multiprocessors", lambda device: 132)  # the H200's
    monkeypatch.setattr(kernels, "_launches", {})
    cpu = torch.device("cpu")

    def read_back(algo, R, T, **kw):
        config = kernels._launch_config(algo, R, T, False, True, 4, cpu, **kw)
        return config.constexprs[2 if config.n_seg > 1 else 0][-1]

    assert read_back(spec.VTRACE, 1024, 1024)  # one segment, float32 outputs
    assert kernels._launch_config(spec.VTRACE, 128, 4096, False, True, 4, cpu).block_t == 4096  # whole rows
    assert not read_back(spec.VTRACE, 1024, 1024, exact_outputs=False)  # bfloat16 outputs: the gather
    assert not read_back(spec.VTRACE, 1, 1 << 16)  # split time: the gather
    assert not read_back(spec.VTRACE, 4096, 128) and read_back(spec.VTRACE, 16384, 16)  # many rows: short ones only
    assert not read_back(spec.GAE, 1024, 1024)
