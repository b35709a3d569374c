"""Property tests: every public function against the float64 oracle on every CPU backend.

Random shapes (0-2 batch dims, T in 0..40), time_dim variants (-1, 0, -2 with TorchRL's
trailing singleton, a middle dim, positive and negative spellings), memory layouts (contiguous,
permuted views such as a [T, N] tensor seen through .t(), strided slices, storage offsets),
dtypes (float64, float32, bfloat16, float16), gamma/lambda forms (float, 0-d tensor, per-row
tensor, per-step tensor), flag patterns, conventions and dtypes, and both next-value forms.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ALL_CASES, assert_layout, assert_matches, check_case, make_tensor, n_examples
from rl_triton.testing import make, oracle, reference
from rl_triton.testing.catalog import from_rows, to_rows

# examples per (function, backend); ~2 backends x 8 functions x ~200 = thousands per run
EXAMPLES = {
    "gae": 250,
    "td_lambda_return": 200,
    "discounted_return": 200,
    "vtrace": 250,
    "retrace": 250,
    "eligibility_trace": 200,
    "episodic_cumsum": 150,
    "affine_scan": 200,
}
TRITON_EXAMPLES = 80  # the interpreter is slower


def _run(strategy, n, body):
    @settings(max_examples=n)
    @given(case=strategy)
    def inner(case):
        body(case)

    inner()


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_matches_oracle(name, backend, rt):
    n = TRITON_EXAMPLES if backend == "triton" else EXAMPLES[name]
    _run(ALL_CASES[name](), n_examples(n), lambda case: check_case(case, backend))


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_matches_oracle_float64_exact(name, cpu_backend, rt):
    """float64 only, so that every example exercises the tight 1e-9 tolerance."""
    _run(ALL_CASES[name](dtypes=[torch.float64]), n_examples(40),
         lambda case: check_case(case, cpu_backend))


@pytest.mark.parametrize("name", list(ALL_CASES))
def test_default_backend_matches_oracle(name, rt, monkeypatch):
    """backend=None / 'auto' (and the RL_TRITON_BACKEND variable) pick a working CPU path."""
    monkeypatch.delenv("RL_TRITON_BACKEND", raising=False)
    _run(ALL_CASES[name](), n_examples(15), lambda case: check_case(case, None))
    _run(ALL_CASES[name](), n_examples(10), lambda case: check_case(case, "auto"))


@pytest.mark.parametrize("env_backend", ["torch", "cpu", "auto"])
def test_env_var_backend(env_backend, rt, monkeypatch):
    monkeypatch.setenv("RL_TRITON_BACKEND", env_backend)
    _run(ALL_CASES["gae"](), n_examples(10), lambda case: check_case(case, None))


# --------------------------------------------------------------------------------------
# deterministic layout cases (the ones the design names explicitly)
# --------------------------------------------------------------------------------------


def _rand(shape, seed):
    return np.random.default_rng(seed).uniform(-1, 1, size=shape)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_time_major_transposed_views(dtype, backend, rt):
    """[N, T] batch-major seen as a .t() view of a contiguous [T, N] buffer, and the reverse."""
    N, T = 3, 7
    gamma, lmbda = 0.9, 0.8
    rng = np.random.default_rng(1)
    done = rng.random((N, T)) < 0.3
    r_np, v_np = _rand((N, T), 2), _rand((N, T), 3)
    boot = _rand((N,), 4)
    adv_ref, tgt_ref = oracle.gae(
        r_np, v_np, oracle.implied_next_values(v_np, boot), done, done,
        np.full((N, T), gamma), np.full((N, T), lmbda),
    )
    # (a) time_dim=-1 on a non-contiguous [N, T] view of time-major memory
    r = torch.tensor(r_np.T.copy(), dtype=dtype).t()
    v = torch.tensor(v_np.T.copy(), dtype=dtype).t()
    d = torch.tensor(done.T.copy()).t()
    b = torch.tensor(boot, dtype=dtype)
    assert not r.is_contiguous()
    adv, tgt = rt.gae(r, v, bootstrap_value=b, done=d, gamma=gamma, lmbda=lmbda, backend=backend)
    assert_layout(adv, r, (N, T), dtype)
    assert_layout(tgt, r, (N, T), dtype)
    assert adv.stride() == r.stride()
    assert_matches(adv, adv_ref, dtype)
    assert_matches(tgt, tgt_ref, dtype)
    # (b) time_dim=0 on contiguous [T, N] memory and on a .t() view of [N, T] memory
    for rr, vv, dd in [
        (torch.tensor(r_np.T.copy(), dtype=dtype), torch.tensor(v_np.T.copy(), dtype=dtype),
         torch.tensor(done.T.copy())),
        (torch.tensor(r_np, dtype=dtype).t(), torch.tensor(v_np, dtype=dtype).t(),
         torch.tensor(done).t()),
    ]:
        adv, tgt = rt.gae(rr, vv, bootstrap_value=b, done=dd, gamma=gamma, lmbda=lmbda,
                          time_dim=0, backend=backend)
        assert_layout(adv, rr, (T, N), dtype)
        assert adv.stride() == rr.stride()
        assert_matches(adv, adv_ref.T, dtype)
        assert_matches(tgt, tgt_ref.T, dtype)


def test_torchrl_layout_and_movedim(backend, rt):
    """TorchRL [*B, T, 1] with time_dim=-2, and a movedim view of a time-major buffer."""
    B0, B1, T = 2, 3, 6
    dtype = torch.float64
    rng = np.random.default_rng(7)
    r_np = rng.uniform(-1, 1, (B0, B1, T))
    nv_np = rng.uniform(-1, 1, (B0, B1, T))
    done = rng.random((B0, B1, T)) < 0.3
    term = done & (rng.random((B0, B1, T)) < 0.5)
    R = B0 * B1
    ref = oracle.td_lambda_return(
        r_np.reshape(R, T), nv_np.reshape(R, T), term.reshape(R, T), done.reshape(R, T),
        np.full((R, T), 0.97), np.full((R, T), 0.7),
    ).reshape(B0, B1, T)
    r = torch.tensor(r_np[..., None])
    nv = torch.tensor(nv_np[..., None])
    out = rt.td_lambda_return(r, nv, done=torch.tensor(done[..., None]),
                              terminated=torch.tensor(term[..., None]), gamma=0.97, lmbda=0.7,
                              time_dim=-2, backend=backend)
    assert_layout(out, r, (B0, B1, T, 1), dtype)
    assert_matches(out, ref[..., None], dtype)
    # time-major buffer [T, B0, B1] viewed as [B0, B1, T] via movedim
    r2 = torch.tensor(np.moveaxis(r_np, -1, 0).copy()).movedim(0, -1)
    nv2 = torch.tensor(np.moveaxis(nv_np, -1, 0).copy()).movedim(0, -1)
    d2 = torch.tensor(np.moveaxis(done, -1, 0).copy()).movedim(0, -1)
    t2 = torch.tensor(np.moveaxis(term, -1, 0).copy()).movedim(0, -1)
    out2 = rt.td_lambda_return(r2, nv2, done=d2, terminated=t2, gamma=0.97, lmbda=0.7,
                               backend=backend)
    assert_layout(out2, r2, (B0, B1, T), dtype)
    assert out2.stride() == r2.stride()
    assert_matches(out2, ref, dtype)


@pytest.mark.parametrize("T", [97, 300, 1000])
def test_longer_rows(T, backend, rt):
    """Rows longer than typical blocks (chunk carries), float64 and float32."""
    if backend == "triton" and T > 300:
        pytest.skip("interpreter: keep shapes small")
    rng = np.random.default_rng(T)
    N = 3
    a_np = rng.uniform(-1, 1, (N, T))
    b_np = rng.uniform(0.5, 1.0, (N, T))
    init = rng.uniform(-1, 1, (N,))
    for dtype in (torch.float64, torch.float32):
        a = torch.tensor(a_np, dtype=dtype)
        b = torch.tensor(b_np, dtype=dtype)
        i = torch.tensor(init, dtype=dtype)
        for reverse in (True, False):
            kw = dict(reverse=reverse, initial=i)
            y = rt.affine_scan(a, b, **kw, backend=backend)
            (ref,) = reference("affine_scan", (a, b), kw)
            assert_matches(y, ref, dtype, what=f"affine_scan T={T} reverse={reverse}")
        kw = dict(done=torch.tensor(rng.random((N, T)) < 0.02), gamma=0.99, lmbda=0.95)
        adv, _ = rt.gae(a, b, **kw, backend=backend)
        assert_matches(adv, reference("gae", (a, b), kw)[0], dtype, what=f"gae T={T}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_many_short_rows(dtype, backend, rt):
    N, T = 2048 if backend != "triton" else 64, 8
    rng = np.random.default_rng(11)
    x = make_tensor(rng.uniform(-1, 1, (N, T)), dtype)
    done = torch.tensor(rng.random((N, T)) < 0.2)
    out = rt.episodic_cumsum(x, done=done, backend=backend)
    assert_matches(out, reference("episodic_cumsum", (x,), dict(done=done))[0], dtype)


def test_eligibility_feature_dims_broadcast_done(backend, rt):
    """x [B, T, F1, F2] with time_dim=1; done [B, T] aligned with x's leading dims."""
    B, T, F1, F2 = 2, 5, 3, 2
    rng = np.random.default_rng(5)
    x_np = rng.uniform(-1, 1, (B, T, F1, F2))
    done = rng.random((B, T)) < 0.4
    init_np = rng.uniform(-1, 1, (B, F1, F2))
    x = torch.tensor(x_np)
    out = rt.eligibility_trace(x, done=torch.tensor(done), gamma=0.9, lmbda=0.5,
                               initial=torch.tensor(init_np), time_dim=1, backend=backend)
    S = (B, T, F1, F2)
    dfull = np.broadcast_to(done[:, :, None, None], S)
    ref = oracle.eligibility_trace(to_rows(x_np, S, 1), to_rows(dfull, S, 1),
                                   np.full((B * F1 * F2, T), 0.9), np.full((B * F1 * F2, T), 0.5),
                                   init_np.reshape(-1))
    assert_layout(out, x, S, torch.float64)
    assert_matches(out, from_rows(ref, S, 1), torch.float64)


def test_gamma_forms_equivalent(backend, rt):
    """float gamma == 0-d tensor gamma == per-row tensor == per-step tensor of that value."""
    rng = np.random.default_rng(3)
    N, T = 3, 9
    r = torch.tensor(rng.uniform(-1, 1, (N, T)))
    v = torch.tensor(rng.uniform(-1, 1, (N, T)))
    done = torch.tensor(rng.random((N, T)) < 0.25)
    outs = []
    f64 = torch.float64
    for g in (0.9, torch.tensor(0.9, dtype=f64), torch.full((N, 1), 0.9, dtype=f64),
              torch.full((N, T), 0.9, dtype=f64), torch.full((T,), 0.9, dtype=f64)):
        outs.append(rt.gae(r, v, done=done, gamma=g, lmbda=0.8, backend=backend)[0])
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["gae", "td_lambda_return", "vtrace", "retrace", "eligibility_trace"])
@pytest.mark.parametrize("data_dtype,coef_dtype", [(torch.float32, torch.bfloat16),
                                                   (torch.float64, torch.float32),
                                                   (torch.float32, torch.float16)])
@pytest.mark.parametrize("which", ["gamma", "lmbda"])
def test_low_precision_coefficient_tensor_keeps_float_precision(name, data_dtype, coef_dtype,
                                                                which, backend, rt):
    """A gamma/lmbda tensor may have any float dtype (docs/semantics.md section 1).  A lmbda
    (gamma) tensor holding exactly 1.0 in a lower precision must not drag the python-float gamma
    (lambda) down to that precision: the result equals the all-python-float call (accumulation
    in float32, float64 for float64)."""
    problem = make(name, (2, 40), "plain", dtype=data_dtype, seed=17)
    other = "lmbda" if which == "gamma" else "gamma"
    ref = problem.call(backend, **{which: 1.0, other: 0.99})
    out = problem.call(backend, **{which: torch.tensor(1.0, dtype=coef_dtype), other: 0.99})
    tol = 1e-12 if data_dtype == torch.float64 else 1e-6
    for o, e in zip(out, ref):
        torch.testing.assert_close(o, e, rtol=tol, atol=tol * max(1.0, float(e.abs().max())))


TINY = [1e-40, 5e-324]  # a float32 subnormal and the smallest float64 subnormal


@pytest.mark.parametrize("name", ["gae", "td_lambda_return", "discounted_return", "vtrace",
                                  "retrace", "eligibility_trace"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("which", ["gamma", "lmbda"])
@pytest.mark.parametrize("tiny", TINY)
def test_tiny_python_float_coefficients(name, dtype, which, tiny, backend, rt):
    """gamma / lmbda anywhere in [0, 1], including values below float32's normal range
    (they act as 0 up to rounding)."""
    if which == "lmbda" and name == "discounted_return":
        pytest.skip("no lmbda")
    problem = make(name, (2, 6), "done", dtype=dtype, **{which: tiny})
    for i, (o, e) in enumerate(zip(problem.call(backend), problem.expected())):
        assert_matches(o, e, dtype, what=f"{name} output {i} with {which}={tiny!r}")


def test_flag_dtypes_equivalent(backend, rt):
    rng = np.random.default_rng(9)
    N, T = 4, 11
    r = torch.tensor(rng.uniform(-1, 1, (N, T)))
    nv = torch.tensor(rng.uniform(-1, 1, (N, T)))
    done = rng.random((N, T)) < 0.3
    term = done & (rng.random((N, T)) < 0.5)
    trunc = done & ~term
    base = None
    for dt in (torch.bool, torch.uint8, torch.int8, torch.int32, torch.int64, torch.float32,
               torch.float64):
        kw = dict(terminated=torch.tensor(term).to(dt), truncated=torch.tensor(trunc).to(dt))
        out = rt.td_lambda_return(r, nv, gamma=0.9, lmbda=0.6, backend=backend, **kw)
        if base is None:
            base = out
        torch.testing.assert_close(out, base, rtol=1e-13, atol=1e-13, msg=f"flag dtype {dt}")
    # gymnasium style == TorchRL style
    out = rt.td_lambda_return(r, nv, done=torch.tensor(done), terminated=torch.tensor(term),
                              gamma=0.9, lmbda=0.6, backend=backend)
    torch.testing.assert_close(out, base, rtol=1e-13, atol=1e-13)


def test_backends_agree_float64(rt):
    """torch and cpu backends agree with each other to float64 precision on one case."""
    @settings(max_examples=n_examples(30))
    @given(case=ALL_CASES["vtrace"](dtypes=[torch.float64]))
    def inner(case):
        a = case.call("torch")
        b = case.call("cpu")
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-10)

    inner()


def test_special_lambdas(backend, rt):
    """TD(1) is the discounted return bootstrapped with nv at the window end; TD(0) is
    r + gamma (1-term) nv."""
    rng = np.random.default_rng(21)
    N, T = 3, 8
    r = torch.tensor(rng.uniform(-1, 1, (N, T)))
    nv = torch.tensor(rng.uniform(-1, 1, (N, T)))
    done = torch.tensor(rng.random((N, T)) < 0.3)
    term = done & torch.tensor(rng.random((N, T)) < 0.5)
    td0 = rt.td_lambda_return(r, nv, done=done, terminated=term, gamma=0.9, lmbda=0.0,
                              backend=backend)
    torch.testing.assert_close(td0, r + 0.9 * (~term).double() * nv, rtol=1e-12, atol=1e-12)
    td1 = rt.td_lambda_return(r, nv, done=done, terminated=term, gamma=0.9, lmbda=1.0,
                              backend=backend)
    mc = rt.discounted_return(r, done=done, terminated=term, next_values=nv, gamma=0.9,
                              backend=backend)
    torch.testing.assert_close(td1, mc, rtol=1e-12, atol=1e-12)
    assert math.isfinite(float(td1.sum()))


@given(st.data())
@settings(max_examples=n_examples(60))
def test_oracle_gae_targets_equal_td_lambda(data):
    """Cross-check inside the oracle: GAE targets == TD(lambda) returns (explicit nv)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    R, T = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 12))
    r, v, nv = (rng.uniform(-1, 1, (R, T)) for _ in range(3))
    done = rng.random((R, T)) < 0.3
    term = done & (rng.random((R, T)) < 0.5)
    g = rng.uniform(0, 1, (R, T))
    lam = rng.uniform(0, 1, (R, T))
    # GAE's value targets equal the lambda-return only when v[t+1] == nv[t] inside episodes
    nv_consistent = nv.copy()
    for i in range(R):
        for t in range(T - 1):
            if not done[i, t]:
                nv_consistent[i, t] = v[i, t + 1]
    adv, tgt = oracle.gae(r, v, nv_consistent, term, done, g, lam)
    G = oracle.td_lambda_return(r, nv_consistent, term, done, g, lam)
    np.testing.assert_allclose(tgt, G, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("flags", ["done", "terminated_truncated", "observation_aligned"])
def test_cpu_gae_row_blocks_for_time_major_memory(flags, rt, monkeypatch):
    """Time-major GAE on the CPU backend steps blocks of rows through time together (large
    rollouts); forced here at a small size with a partial last block."""
    from rl_triton.core import cpu

    if not cpu.AVAILABLE:
        pytest.skip("needs numba")
    monkeypatch.setattr(cpu, "ROW_BLOCK_MIN_ELEMENTS", 0)
    T, N = 37, cpu.ROW_BLOCK + 45
    g = torch.Generator().manual_seed(3)
    r, v, nv = (torch.randn(T, N, generator=g, dtype=torch.float64) for _ in range(3))
    term = torch.rand(T, N, generator=g) < 0.05
    trunc = (torch.rand(T, N, generator=g) < 0.05) & ~term
    boot = torch.randn(N, generator=g, dtype=torch.float64)
    if flags == "done":
        kw = dict(bootstrap_value=boot, done=term)
    elif flags == "terminated_truncated":
        kw = dict(next_values=nv, terminated=term, truncated=trunc)
    else:
        starts = torch.cat([torch.zeros(1, N, dtype=torch.bool), term[:-1]], 0)
        kw = dict(bootstrap_value=boot, episode_starts=starts, last_done=term[-1])
    got = rt.gae(r, v, **kw, time_dim=0, backend="cpu")[0]
    want = reference("gae", (r, v), dict(kw, time_dim=0))[0]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12, atol=1e-12)
