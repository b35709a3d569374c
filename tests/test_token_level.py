"""Token-level credit assignment: GAE over response masks (skip and pad semantics) and packed
sequences (``cu_seqlens``) on every estimator, against the float64 oracle and against loops
transcribed from the LLM frameworks (docs/semantics.md, sections 9 and 10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import rl_triton as rt
from rl_triton.testing import oracle
from rl_triton.testing.frameworks import openrlhf_gae, verl_compute_gae_advantage_return, verl_gae, verl_masked_whiten

TOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def _batch(R, T, dtype, seed, p_valid=0.8):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(R, T, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(R, T, generator=g, dtype=torch.float64).to(dtype)
    m = torch.rand(R, T, generator=g) < p_valid
    if R > 1:
        m[1] = False  # an all-masked row
    if R > 2 and T > 4:
        m[2, 1:3] = False  # a hole
        m[2, -2:] = False  # masked tail
    return r, v, m


def _close(got, want, dtype):
    want = torch.as_tensor(np.asarray(want), dtype=torch.float64)
    scale = max(1.0, want.abs().max().item())
    assert (got.double() - want).abs().max().item() <= TOL[dtype] * scale


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape", [(6, 23), (3, 1), (1, 70)])
def test_skip_mask_matches_verl_and_the_oracle(backend, dtype, shape):
    r, v, m = _batch(*shape, dtype, seed=shape[1])
    adv, ret = rt.gae(r, v, mask=m, gamma=0.97, lmbda=0.9, backend=backend)
    want_adv, want_ret = verl_gae(r.double(), v.double(), m.double(), 0.97, 0.9)
    _close(adv, want_adv, dtype)
    _close(ret, want_ret, dtype)
    R, T = shape
    o_adv, o_ret = oracle.gae_masked(r.double().numpy(), v.double().numpy(), m.numpy(), np.full((R, T), 0.97),
                                     np.full((R, T), 0.9), "skip")
    _close(adv, o_adv, dtype)
    _close(ret, o_ret, dtype)
    assert adv.dtype == dtype and adv.shape == r.shape


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pad_mask_matches_openrlhf_and_the_oracle(backend, dtype):
    r, v, m = _batch(5, 31, dtype, seed=3)
    adv, ret = rt.gae(r, v, mask=m, mask_mode="pad", gamma=0.99, lmbda=0.95, backend=backend)
    want_adv, want_ret = openrlhf_gae(v.double(), r.double(), m.double(), 0.99, 0.95)
    _close(adv, want_adv, dtype)
    _close(ret, want_ret, dtype)
    o_adv, _ = oracle.gae_masked(r.double().numpy(), v.double().numpy(), m.numpy(), np.full((5, 31), 0.99),
                                 np.full((5, 31), 0.95), "pad")
    _close(adv, o_adv, dtype)


@pytest.mark.parametrize("mode", ["skip", "pad"])
def test_mask_with_bootstrap_tensor_coefficients_and_time_major(backend, mode):
    r, v, m = _batch(4, 17, torch.float64, seed=5)
    boot = torch.randn(4, dtype=torch.float64)
    gamma = torch.rand(4, 17, dtype=torch.float64)
    lmbda = torch.rand(4, 17, dtype=torch.float64)
    adv, ret = rt.gae(r.T.contiguous(), v.T.contiguous(), mask=m.T.contiguous(), mask_mode=mode,
                      bootstrap_value=boot, gamma=gamma.T.contiguous(), lmbda=lmbda.T.contiguous(), time_dim=0,
                      backend=backend)
    o_adv, o_ret = oracle.gae_masked(r.numpy(), v.numpy(), m.numpy(), gamma.numpy(), lmbda.numpy(), mode,
                                     boot.numpy())
    _close(adv.T, o_adv, torch.float64)
    _close(ret.T, o_ret, torch.float64)


REGIMES = [dict(block_t=16, block_r=2), dict(block_t=4, block_r=1), dict(block_t=2, block_r=2, n_seg=3),
           dict(block_t=32, block_r=4), dict(block_t=8, block_r=1)]


@pytest.mark.parametrize("plan", REGIMES, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.parametrize("mode", ["skip", "pad"])
def test_triton_launch_regimes(plan, mode):
    """The Triton engine forced into each regime (chunks of a few steps carried along the row,
    several rows per program, mirrored and natural lanes; the two-state scan of the skip mask
    splits no time), against the oracle."""
    kernels = pytest.importorskip("rl_triton.core.kernels")
    if not (kernels.AVAILABLE and (kernels.INTERPRET or torch.cuda.is_available())):
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1 set before import")
    device = "cuda" if torch.cuda.is_available() and not kernels.INTERPRET else "cpu"
    r, v, m = _batch(5, 37, torch.float64, seed=23)
    boot = torch.randn(5, dtype=torch.float64)
    with kernels.forced_plan(**plan):
        adv, ret = rt.gae(r.to(device), v.to(device), mask=m.to(device), mask_mode=mode,
                          bootstrap_value=boot.to(device), gamma=0.9, lmbda=0.8, backend="triton")
    o_adv, o_ret = oracle.gae_masked(r.numpy(), v.numpy(), m.numpy(), np.full((5, 37), 0.9), np.full((5, 37), 0.8),
                                     mode, boot.numpy())
    _close(adv.cpu(), o_adv, torch.float64)
    _close(ret.cpu(), o_ret, torch.float64)


def test_skip_reads_nothing_at_masked_steps(backend):
    """A masked step's reward and value never reach another step (selected, not multiplied by 0):
    an inf or NaN there stays there. verl multiplies, so its loop spreads it."""
    r, v, m = _batch(3, 12, torch.float64, seed=7)
    m[0, 5] = False
    r2, v2 = r.clone(), v.clone()
    r2[0, 5], v2[0, 5] = float("nan"), float("inf")
    adv, ret = rt.gae(r, v, mask=m, backend=backend)
    adv2, ret2 = rt.gae(r2, v2, mask=m, backend=backend)
    assert torch.equal(adv, adv2)
    keep = torch.ones_like(m)
    keep[0, 5] = False
    assert torch.equal(ret[keep], ret2[keep])


def test_skip_mask_gradients(cpu_backend):
    """Differentiable in rewards and values (the composed path); float64 gradcheck."""
    r, v, m = _batch(2, 9, torch.float64, seed=11)
    r.requires_grad_(True)
    v.requires_grad_(True)
    for mode in ("skip", "pad"):
        torch.autograd.gradcheck(lambda r, v: rt.gae(r, v, mask=m, mask_mode=mode, backend=cpu_backend), (r, v))


def test_repeated_masked_calls_are_bit_for_bit(backend):
    r, v, m = _batch(4, 19, torch.float32, seed=13)
    first = rt.gae(r, v, mask=m, backend=backend)
    for _ in range(3):
        again = rt.gae(r, v, mask=m, backend=backend)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    r2 = torch.randn_like(r)
    got = rt.gae(r2, v, mask=m, backend=backend)
    want = verl_gae(r2.double(), v.double(), m.double(), 0.99, 0.95)
    _close(got[0], want[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_whiten_matches_verls_whole_step(backend, dtype):
    r, v, m = _batch(6, 29, dtype, seed=17)
    adv, ret = rt.gae(r, v, mask=m, gamma=1.0, lmbda=0.95, whiten=True, backend=backend)
    want_adv, want_ret = verl_compute_gae_advantage_return(r.double(), v.double(), m.double(), 1.0, 0.95)
    _close(adv, want_adv, dtype)
    _close(ret, want_ret, dtype)
    out = (torch.empty_like(r), torch.empty_like(r))
    got = rt.gae(r, v, mask=m, gamma=1.0, lmbda=0.95, whiten=True, backend=backend, out=out)
    assert got[0] is out[0] and torch.equal(out[0], adv)


def _whitened(raw, m, unbiased=True, shift_mean=True, scale=True, eps=1e-8, eps_mode="add"):
    """The whitening formulas of docs/semantics.md, section 15, two-pass in float64."""
    valid = m.double()
    n = valid.sum()
    mean = (raw * valid).sum() / n
    m2 = ((raw - mean) ** 2 * valid).sum()
    var = m2 / (n - 1) if unbiased else m2 / n
    rstd = 1.0 if not scale else (var + eps).rsqrt() if eps_mode == "add" else var.clamp(min=eps).rsqrt()
    y = (raw - mean) * rstd
    return y if shift_mean else y + mean


@pytest.mark.parametrize("options", [dict(), dict(unbiased=False, eps_mode="clamp"), dict(shift_mean=False),
                                     dict(scale=False, unbiased=False)])
@pytest.mark.parametrize("mode", ["skip", "pad"])
@pytest.mark.parametrize("shape", [(7, 5000), (8, 4096), (1, 40000)])
def test_whiten_of_many_rows(cpu_backend, options, mode, shape):
    """Shapes whose numba kernels are the parallel builds (the scan's, and the whitening
    statistics' row kernel), in batch-major and time-major memory."""
    r, v, m = _batch(*shape, torch.float64, seed=shape[0])
    adv, ret = rt.gae(r, v, mask=m, mask_mode=mode, gamma=0.99, lmbda=0.9, whiten=options or True,
                      backend=cpu_backend)
    raw, want_ret = oracle.gae_masked(r.numpy(), v.numpy(), m.numpy(), np.full(shape, 0.99), np.full(shape, 0.9),
                                      mode)
    _close(ret, want_ret, torch.float64)
    _close(adv, _whitened(torch.from_numpy(raw), m, **options), torch.float64)
    # the same in time-major memory
    adv_t, _ = rt.gae(r.T.contiguous(), v.T.contiguous(), mask=m.T.contiguous(), mask_mode=mode, gamma=0.99,
                      lmbda=0.9, whiten=options or True, time_dim=0, backend=cpu_backend)
    _close(adv_t.T, _whitened(torch.from_numpy(raw), m, **options), torch.float64)


def test_whiten_statistics_far_from_zero(cpu_backend):
    """Advantages around 1e4 with a spread of 1: the statistics keep their precision."""
    r, v, m = _batch(6, 6000, torch.float64, seed=5)
    r = r * 1e-3
    r[:, -1] += 1e4
    adv, _ = rt.gae(r, v, mask=m, gamma=1.0, lmbda=1.0, whiten=True, backend=cpu_backend)
    want_adv, _ = verl_compute_gae_advantage_return(r, v, m.double(), 1.0, 1.0)
    assert (adv - want_adv).abs().max().item() < 1e-8


def test_whiten_non_finite(backend):
    """NaN at an unmasked step reaches every output through the statistics; NaN or inf at a
    masked step stays out of them (skip: a masked step's reward and value are not read)."""
    r, v, m = _batch(5, 40, torch.float64, seed=8)
    clean = rt.gae(r, v, mask=m, whiten=True, backend=backend)[0]
    masked_step = (~m).nonzero()[0].tolist()
    r2, v2 = r.clone(), v.clone()
    r2[masked_step[0], masked_step[1]] = float("nan")
    v2[masked_step[0], masked_step[1]] = float("inf")
    got = rt.gae(r2, v2, mask=m, whiten=True, backend=backend)[0]
    _close(got, clean, torch.float64)
    valid_step = m.nonzero()[0].tolist()
    r2 = r.clone()
    r2[valid_step[0], valid_step[1]] = float("nan")
    assert torch.isnan(rt.gae(r2, v, mask=m, whiten=True, backend=backend)[0]).all()


def test_whiten_with_openrlhfs_convention(backend):
    r, v, m = _batch(4, 21, torch.float64, seed=19)
    adv, _ = rt.gae(r, v, mask=m, mask_mode="pad", whiten=dict(unbiased=False, eps_mode="clamp"), backend=backend)
    raw, _ = openrlhf_gae(v, r, m.double(), 0.99, 0.95)
    _close(adv, _whitened(raw, m, unbiased=False, eps_mode="clamp"), torch.float64)
    _close(verl_masked_whiten(raw, m.double()), rt.masked_whiten(raw, m), torch.float64)


@pytest.mark.parametrize("bad,match", [
    (dict(whiten="yes"), "whiten must be"),
    (dict(whiten=dict(unbias=False)), "whiten takes the keywords"),
    (dict(whiten=dict(eps=-1.0)), "eps must be a number >= 0"),
    (dict(whiten=dict(eps_mode="max")), "eps_mode must be one of"),
    (dict(mask=None, whiten=True, cu_seqlens=torch.tensor([0, 2])), "whiten with cu_seqlens needs a mask"),
    (dict(mask_mode="zero"), "mask_mode must be one of"),
    (dict(mask=None, mask_mode="pad"), "needs a mask"),
    (dict(mask=torch.ones(3, 4, dtype=torch.bool)), "mask"),
    (dict(done=torch.zeros(2, 5, dtype=torch.bool)), "does not combine with done"),
    (dict(next_values=torch.zeros(2, 5)), "does not combine with next_values"),
    (dict(mask=torch.full((2, 5), 2.0)), "mask must hold only 0 and 1"),
])
def test_bad_mask_arguments(bad, match):
    kwargs = dict(mask=torch.ones(2, 5, dtype=torch.bool))
    kwargs.update(bad)
    with pytest.raises((ValueError, TypeError), match=match):
        rt.gae(torch.zeros(2, 5), torch.zeros(2, 5), **kwargs)


# -- packed sequences --------------------------------------------------------------------------

def _packed_case(lengths, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    x = {name: torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for name in ("r", "v", "lp", "lm")}
    x["d"] = torch.rand(n, generator=g) < 0.15
    x["m"] = torch.rand(n, generator=g) < 0.8
    x["boot"] = torch.randn(len(lengths), generator=g, dtype=torch.float64).to(dtype)
    return cu, x


def _per_sequence(fn, cu, packed_args, row_args, **kwargs):
    """``fn`` called on each sequence alone, its outputs concatenated."""
    outs = []
    for i in range(cu.numel() - 1):
        lo, hi = int(cu[i]), int(cu[i + 1])
        if hi == lo:
            continue
        args = {k: x[lo:hi] for k, x in packed_args.items()}
        args.update({k: x[i] for k, x in row_args.items()})
        y = fn(**args, **kwargs)
        outs.append(y if isinstance(y, tuple) else (y,))
    return [torch.cat(parts) for parts in zip(*outs)]


CALLS = {
    "gae": (rt.gae, lambda x: dict(rewards=x["r"], values=x["v"], done=x["d"]),
            lambda x: dict(bootstrap_value=x["boot"])),
    "gae_skip": (rt.gae, lambda x: dict(rewards=x["r"], values=x["v"], mask=x["m"]), lambda x: {}),
    "gae_pad": (rt.gae, lambda x: dict(rewards=x["r"], values=x["v"], mask=x["m"]), lambda x: {}),
    "td_lambda_return": (rt.td_lambda_return, lambda x: dict(rewards=x["r"], next_values=x["v"], done=x["d"]),
                         lambda x: {}),
    "discounted_return": (rt.discounted_return, lambda x: dict(rewards=x["r"], terminated=x["d"]),
                          lambda x: dict(bootstrap_value=x["boot"])),
    "vtrace": (rt.vtrace, lambda x: dict(rewards=x["r"], values=x["v"], log_pi=x["lp"], log_mu=x["lm"], done=x["d"]),
               lambda x: dict(bootstrap_value=x["boot"])),
    "retrace": (rt.retrace, lambda x: dict(rewards=x["r"], q_values=x["v"], log_pi=x["lp"], log_mu=x["lm"],
                                           next_expected_q=x["v"].roll(-1), done=x["d"]), lambda x: {}),
    "eligibility_trace": (rt.eligibility_trace, lambda x: dict(x=x["r"], done=x["d"]),
                          lambda x: dict(initial=x["boot"])),
    "episodic_cumsum": (rt.episodic_cumsum, lambda x: dict(x=x["r"], done=x["d"]), lambda x: dict(initial=x["boot"])),
    "affine_forward": (rt.affine_scan, lambda x: dict(alpha=x["r"], beta=x["v"].sigmoid()),
                       lambda x: dict(initial=x["boot"])),
    "affine_reverse": (rt.affine_scan, lambda x: dict(alpha=x["r"], beta=x["v"].sigmoid()),
                       lambda x: dict(initial=x["boot"])),
}
EXTRA = {"gae_pad": dict(mask_mode="pad"), "affine_forward": dict(reverse=False), "affine_reverse": dict(reverse=True)}


@pytest.mark.parametrize("name", list(CALLS))
def test_packed_equals_each_sequence_alone(backend, name):
    fn, per_step, per_row = CALLS[name]
    cu, x = _packed_case([5, 0, 1, 9, 3, 0], seed=len(name))
    packed_args, row_args = per_step(x), per_row(x)
    got = fn(**packed_args, **row_args, **EXTRA.get(name, {}), cu_seqlens=cu, backend=backend)
    got = got if isinstance(got, tuple) else (got,)
    want = _per_sequence(fn, cu, packed_args, row_args, **EXTRA.get(name, {}), backend=backend)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_packed_retrace_with_action_distributions(backend):
    cu, x = _packed_case([4, 7, 2], seed=1)
    n, A = int(cu[-1]), 3
    pi = torch.softmax(torch.randn(n, A, dtype=torch.float64), -1)
    q = torch.randn(n, A, dtype=torch.float64)
    args = dict(rewards=x["r"], q_values=x["v"], log_pi=x["lp"], log_mu=x["lm"], next_pi=pi, next_q=q)
    got = rt.retrace(**args, cu_seqlens=cu, max_seqlen=7, backend=backend)
    want = _per_sequence(rt.retrace, cu, args, {}, backend=backend)[0]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=6), seed=st.integers(0, 2**16),
       mode=st.sampled_from(["skip", "pad"]))
def test_packed_and_padded_batches_agree(lengths, seed, mode):
    """The packed form of a batch and its padded form (each response left-aligned, a mask over the
    padding) give the same advantages on their tokens."""
    cu, x = _packed_case(lengths, seed)
    B, L = len(lengths), max(lengths)
    r, v, m = (torch.zeros(B, L, dtype=x["r"].dtype) for _ in range(3))
    mask = torch.zeros(B, L, dtype=torch.bool)
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        r[i, :hi - lo], v[i, :hi - lo], mask[i, :hi - lo] = x["r"][lo:hi], x["v"][lo:hi], x["m"][lo:hi]
    adv, _ = rt.gae(x["r"], x["v"], mask=x["m"], mask_mode=mode, cu_seqlens=cu, backend="cpu")
    padded, _ = rt.gae(r, v, mask=mask, mask_mode=mode, backend="cpu")
    want = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    if mode == "skip":
        torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    else:  # pad: the padded batch has zeros after each response, which is what pad reads past it
        torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)


def test_packed_out_and_empty():
    cu, x = _packed_case([3, 4], seed=2)
    out = (torch.empty_like(x["r"]), torch.empty_like(x["r"]))
    got = rt.gae(x["r"], x["v"], cu_seqlens=cu, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    torch.testing.assert_close(out[0], rt.gae(x["r"], x["v"], cu_seqlens=cu)[0])
    empty = rt.gae(torch.zeros(0), torch.zeros(0), cu_seqlens=torch.tensor([0, 0], dtype=torch.int32))
    assert empty[0].shape == (0,)


def test_max_seqlen_needs_cu_seqlens():
    with pytest.raises(ValueError, match="max_seqlen goes with cu_seqlens"):
        rt.gae(torch.zeros(7), torch.zeros(7), max_seqlen=7)


@pytest.mark.parametrize("cu,kwargs,match", [
    ([0, 3, 2, 7], {}, "without falling"),
    ([1, 3, 7], {}, "rise from 0"),
    ([0, 3, 6], {}, "number of tokens"),
    (torch.tensor([0.0, 7.0]), {}, "int32 or int64"),
    ([0, 3, 7], dict(max_seqlen=3), "max_seqlen is 3"),
    ([0, 3, 7], dict(max_seqlen=-1), "max_seqlen must be"),
    ([0, 3, 7], dict(time_dim=1), "time_dim"),
    ([0, 3, 7], dict(bootstrap_value=torch.zeros(3)), "one value per sequence"),
    ([0, 3, 7], dict(values=torch.zeros(6)), "packed like rewards"),
    ([0, 3, 7], dict(out=(torch.zeros(6), torch.zeros(7))), "out"),
])
def test_bad_packed_arguments(cu, kwargs, match):
    args = dict(rewards=torch.zeros(7), values=torch.zeros(7))
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        rt.gae(**args, cu_seqlens=cu if isinstance(cu, torch.Tensor) else torch.tensor(cu))
