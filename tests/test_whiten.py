"""masked_whiten / masked_moments (rl_triton/core/whiten.py): agreement with verl's and OpenRLHF's
advantage normalisation (transcribed below), an independent numpy check of the statistics, the
degenerate selections (NaN, never an exception), NaN placement, out=, autograd, bad inputs, and
the distributed statistics over gloo ranks (one collective per call)."""

from __future__ import annotations

import math
import socket

import numpy as np
import pytest
import torch

from conftest import TRITON_INTERPRET_AT_STARTUP, require_backend
from helpers import leave_rank_process
from rl_triton.core.whiten import EPS_MODES, masked_moments, masked_whiten
from rl_triton.testing import oracle

F64, F32 = torch.float64, torch.float32
SHAPES = [(50,), (1, 40), (8, 33), (4, 5, 7)]


# -- the reference implementations, transcribed ---------------------------------------------------
# verl: verl-project/verl (formerly volcengine/verl) at commit 0db13434d04637f539356a9c43209387ed3894a4,
# verl/utils/torch_functional.py: masked_sum, masked_mean, masked_var, masked_whiten. `count_guard` is
# the 1e-8 that this version adds to mask.sum() in masked_mean; it is a parameter here only so that a
# test can remove it (1e-8 / n relative, it would hide a float64 comparison at 1e-12); default = verl's.
def verl_masked_sum(values, mask, axis=None):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum(axis=axis)


def verl_masked_mean(values, mask, axis=None, count_guard=1e-8):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis=axis) + count_guard)


def verl_masked_var(values, mask, unbiased=True, count_guard=1e-8):
    mean = verl_masked_mean(values, mask, count_guard=count_guard)
    variance = verl_masked_mean((values - mean) ** 2, mask, count_guard=count_guard)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("mask sums to 0")
        if mask_sum == 1:
            raise ValueError("mask sums to 1")
        variance = variance * (mask_sum / (mask_sum - 1))
    return variance


def verl_masked_whiten(values, mask, shift_mean=True, count_guard=1e-8):
    mean = verl_masked_mean(values, mask, count_guard=count_guard)
    var = verl_masked_var(values, mask, count_guard=count_guard)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


# Earlier verl (volcengine/verl at commit 03c8cca18c827405ad726f7f90b2e0c3823b7830, same file):
# masked_mean multiplied by the mask, with no where and no count guard.
def verl_old_masked_mean(values, mask):
    return (values * mask).sum() / mask.sum()


# OpenRLHF: OpenRLHF/OpenRLHF at commit 89308a0b768dec168dff240ae746710fc967a49b,
# openrlhf/trainer/ppo_utils/experience_maker.py, the advantage normalisation across all
# experiences (gae / reinforce / reinforce_baseline), `no_advantage_std_norm` switching off the
# std. Upstream casts the concatenated advantages with .float(); `stat_dtype` keeps that float32
# by default and lets a float64 test keep float64 statistics.
def openrlhf_normalize(advantages, action_masks, no_advantage_std_norm=False, stat_dtype=F32):
    adv = torch.cat([a.flatten() for a in advantages], dim=0).to(stat_dtype)
    masks = torch.cat([m.flatten() for m in action_masks], dim=0)
    num_actions = masks.sum()
    mean = (adv * masks).sum() / num_actions
    if not no_advantage_std_norm:
        var = ((adv - mean).pow(2) * masks).sum() / num_actions
        rstd = var.clamp(min=1e-8).rsqrt()
    else:
        rstd = 1
    return [(a - mean) * rstd for a in advantages]


# -- data ---------------------------------------------------------------------------------------
def _x(shape, seed=0, dtype=F64, loc=0.7, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=F64) * scale + loc).to(dtype)


def _mask(shape, kind, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "ones":
        return torch.ones(shape, dtype=torch.bool)
    if kind == "holes":
        m = torch.rand(shape, generator=g) < 0.7
        m.view(-1)[0] = True
        m.view(-1)[1] = True
        return m
    if kind == "response":  # each row a valid prefix of random length, LLM-response style
        rows = shape[:-1]
        lengths = torch.randint(1, shape[-1] + 1, rows, generator=g)
        return torch.arange(shape[-1]) < lengths.unsqueeze(-1)
    raise AssertionError(kind)


def _close(actual, expected, tol):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol, equal_nan=True)


MASKS = ["holes", "ones", "response"]


# -- verl ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_matches_verl_float64(shape, kind, shift_mean):
    x, m = _x(shape), _mask(shape, kind)
    # a float64 mask keeps verl's Bessel factor in float64; count_guard=0 removes its 1e-8 (see above)
    expected = verl_masked_whiten(x, m.to(F64), shift_mean=shift_mean, count_guard=0.0)
    _close(masked_whiten(x, m, shift_mean=shift_mean), expected, 1e-12)
    _close(masked_whiten(x, m.to(torch.int32), shift_mean=shift_mean), expected, 1e-12)
    if kind == "ones":
        _close(masked_whiten(x, shift_mean=shift_mean), expected, 1e-12)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("shift_mean", [True, False])
def test_matches_verl_float32(shape, kind, shift_mean):
    x, m = _x(shape, dtype=F32), _mask(shape, kind)
    expected = verl_masked_whiten(x, m, shift_mean=shift_mean)  # verbatim semantics, bool mask
    y = masked_whiten(x, m, shift_mean=shift_mean)
    assert y.dtype == F32
    _close(y, expected, 1e-6)


@pytest.mark.parametrize("mask_dtype", [torch.bool, F64])
def test_verl_differs_from_the_formula_only_by_its_rounding_guards(mask_dtype):
    """Verbatim verl in float64 is off the exact formula by its count guard (sum / (n + 1e-8),
    float64 masks) or by a Bessel factor n / (n - 1) rounded to float32 (integer masks: int64 /
    int64 is a float32 division): a relative 1e-7 at most, and nothing more."""
    x, m = _x((8, 33), loc=3.0), _mask((8, 33), "holes").to(mask_dtype)
    exact = masked_whiten(x, m)
    assert not torch.equal(verl_masked_whiten(x, m), exact)
    _close(verl_masked_whiten(x, m), exact, 1e-7)


def test_verl_nan_outside_the_mask():
    """Current verl reads values through where(mask, values, 0), as masked_whiten does: a NaN
    outside the mask leaves the statistics alone. The earlier verl multiplied (NaN * 0 = NaN)."""
    x, m = _x((8, 33)), _mask((8, 33), "holes")
    hole = (~m).nonzero()[0].tolist()
    x[tuple(hole)] = float("nan")
    y = masked_whiten(x, m)
    expected = verl_masked_whiten(x, m.to(F64), count_guard=0.0)
    _close(y, expected, 1e-12)
    assert torch.isnan(y[tuple(hole)]) and torch.isfinite(y[m]).all()
    assert torch.isnan(verl_old_masked_mean(x, m))


# -- OpenRLHF -----------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("no_std", [False, True])
def test_matches_openrlhf(shape, kind, no_std):
    m = _mask(shape, kind)
    for dtype, stat_dtype, tol in ((F64, F64, 1e-12), (F32, F32, 1e-6)):
        x = _x(shape, dtype=dtype)
        (expected,) = openrlhf_normalize([x], [m], no_advantage_std_norm=no_std, stat_dtype=stat_dtype)
        y = masked_whiten(x, m, unbiased=False, eps_mode="clamp", scale=not no_std)
        assert y.dtype == dtype
        _close(y, expected, tol)


def test_openrlhf_across_experiences():
    """OpenRLHF normalises over all experiences of a step at once: the same as masked_whiten on
    their concatenation."""
    xs = [_x((n, 9), seed=n) for n in (3, 1, 5)]
    ms = [_mask((n, 9), "response", seed=n + 10) for n in (3, 1, 5)]
    for no_std in (False, True):
        expected = torch.cat(openrlhf_normalize(xs, ms, no_advantage_std_norm=no_std, stat_dtype=F64))
        y = masked_whiten(torch.cat(xs), torch.cat(ms), unbiased=False, eps_mode="clamp", scale=not no_std)
        _close(y, expected, 1e-12)


def test_clamp_floors_the_variance():
    x = torch.full((6,), 2.5, dtype=F64)
    x[0] = 2.5 + 1e-6  # variance ~1.4e-13 < eps
    for eps in (1e-8, 0.25):
        y = masked_whiten(x, unbiased=False, eps_mode="clamp", eps=eps)
        (expected,) = openrlhf_normalize([x], [torch.ones(6)], stat_dtype=F64) if eps == 1e-8 else \
            [(x - x.mean()) / math.sqrt(eps)]
        _close(y, expected, 1e-12)


# -- the statistics ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", MASKS)
def test_moments_against_numpy(shape, kind):
    x, m = _x(shape, loc=1e3), _mask(shape, kind)  # a large mean: a one-pass formula would lose digits
    valid = x.numpy()[m.numpy()]
    n, mean, m2 = masked_moments(x, m)
    assert n.dtype == torch.int64 and n.ndim == 0 and int(n) == valid.size
    assert mean.dtype == F64 and m2.dtype == F64 and mean.ndim == 0 and m2.ndim == 0
    np_mean = math.fsum(valid.tolist()) / valid.size
    np_m2 = math.fsum(((valid - np_mean) ** 2).tolist())
    assert float(mean) == pytest.approx(np_mean, rel=1e-14)
    assert float(m2) == pytest.approx(np_m2, rel=1e-12)
    assert float(m2) == pytest.approx(float(np.var(valid)) * valid.size, rel=1e-12)

    n32, mean32, m232 = masked_moments(x.to(F32), m)
    v32 = x.to(F32).to(F64).numpy()[m.numpy()]
    assert mean32.dtype == F64 and m232.dtype == F64 and int(n32) == valid.size  # float64 statistics
    v32_mean = math.fsum(v32.tolist()) / v32.size
    assert float(mean32) == pytest.approx(v32_mean, rel=1e-14)
    assert float(m232) == pytest.approx(math.fsum(((v32 - v32_mean) ** 2).tolist()), rel=1e-12)


def test_moments_are_what_whiten_uses():
    x, m = _x((8, 33)), _mask((8, 33), "holes")
    n, mean, m2 = masked_moments(x, m)
    _close(masked_whiten(x, m), (x - mean) / torch.sqrt(m2 / (n - 1) + 1e-8), 1e-12)
    _close(masked_whiten(x, m, unbiased=False, eps_mode="clamp"), (x - mean) / torch.sqrt(m2 / n), 1e-12)
    _close(masked_whiten(x, m, scale=False), x - mean, 0.0)


def test_stable_for_a_large_offset():
    """float32 data with a mean far from 0: the two-pass variance keeps the spread."""
    base = _x((4096,), loc=0.0, scale=1.0)
    x = (base + 1e4).to(F32)
    _, _, m2 = masked_moments(x)
    x64 = x.to(F64)
    assert float(m2) == pytest.approx(float(((x64 - x64.mean()) ** 2).sum()), rel=1e-3)
    y = masked_whiten(x)
    _close(y.to(F64), (x64 - x64.mean()) / x64.std(), 1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    x, m = _x((8, 33), dtype=dtype), _mask((8, 33), "holes")
    y = masked_whiten(x, m)
    assert y.dtype == dtype
    _, mean, m2 = masked_moments(x, m)
    assert mean.dtype == F64 and m2.dtype == F64
    expected = verl_masked_whiten(x.to(F64), m.to(F64), count_guard=0.0)  # on the rounded data
    _close(y.to(F64), expected, 1e-2)


# -- degenerate selections and NaN -------------------------------------------------------------------
CONVENTIONS = [{}, {"unbiased": False, "eps_mode": "clamp"}, {"scale": False}, {"shift_mean": False}]


@pytest.mark.parametrize("kw", CONVENTIONS)
def test_empty_selection_gives_nan(kw):
    x = _x((3, 4))
    y = masked_whiten(x, torch.zeros(3, 4, dtype=torch.bool), **kw)
    assert y.shape == x.shape and torch.isnan(y).all()
    n, mean, m2 = masked_moments(x, torch.zeros(3, 4))
    assert int(n) == 0 and math.isnan(float(mean)) and float(m2) == 0.0
    with pytest.raises(ValueError):
        verl_masked_whiten(x, torch.zeros(3, 4))  # verl raises; masked_whiten cannot without a sync


def test_one_valid_element():
    x = _x((3, 4))
    m = torch.zeros(3, 4, dtype=torch.bool)
    m[1, 2] = True
    assert torch.isnan(masked_whiten(x, m)).all()  # unbiased: var = 0 / 0
    with pytest.raises(ValueError):
        verl_masked_whiten(x, m.to(F64))
    y = masked_whiten(x, m, unbiased=False, eps_mode="clamp")  # biased: var = 0, floored at eps
    (expected,) = openrlhf_normalize([x], [m], stat_dtype=F64)
    _close(y, expected, 1e-12)
    assert y[1, 2] == 0
    _close(masked_whiten(x, m, scale=False), x - x[1, 2], 0.0)


def test_empty_tensor():
    x = torch.empty(0, 5, dtype=F64)
    assert masked_whiten(x).shape == (0, 5)
    assert masked_whiten(x, torch.ones(0, 5, dtype=torch.bool)).shape == (0, 5)
    n, mean, _ = masked_moments(x)
    assert int(n) == 0 and math.isnan(float(mean))


@pytest.mark.parametrize("kw", CONVENTIONS)
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_at_a_valid_position_reaches_everything(kw, value, backend):
    x, m = _x((8, 33)), _mask((8, 33), "holes")
    x[0, 0] = value  # valid by construction
    assert m[0, 0]
    y = masked_whiten(x, m, **kw, backend=backend)
    if math.isnan(value) or kw.get("scale", True):  # the mean is NaN or inf, M2 = (inf - inf)**2 = NaN
        assert torch.isnan(y).all()
    else:  # scale=False: x - inf
        assert torch.isnan(y[0, 0]) and (y.view(-1)[1:] == -math.inf).all()


@pytest.mark.parametrize("kw", CONVENTIONS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_outside_the_mask_is_ignored(kw, value):
    x, m = _x((8, 33)), _mask((8, 33), "holes")
    holes = ~m
    clean = masked_whiten(x, m, **kw)
    x[holes] = value
    y = masked_whiten(x, m, **kw)
    _close(y[m], clean[m], 0.0)
    assert not torch.isfinite(y[holes]).any()  # those positions are whitened like the rest
    _, mean, m2 = masked_moments(x, m)
    assert torch.isfinite(mean) and torch.isfinite(m2)


def test_masked_positions_are_whitened_too():
    x, m = _x((8, 33)), _mask((8, 33), "response")
    n, mean, m2 = masked_moments(x, m)
    y = masked_whiten(x, m)
    _close(y[~m], ((x - mean) * torch.rsqrt(m2 / (n - 1) + 1e-8))[~m], 1e-12)
    assert (y[~m] != 0).all()


def test_mask_values_are_flags_not_weights():
    x, m = _x((8, 33)), _mask((8, 33), "holes")
    _close(masked_whiten(x, m.to(F32) * 0.25), masked_whiten(x, m), 0.0)
    _close(masked_whiten(x, m.to(torch.uint8) * 7), masked_whiten(x, m), 0.0)


# -- out= and autograd ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F64, F32, torch.bfloat16])
def test_out(dtype):
    x, m = _x((8, 33), dtype=dtype), _mask((8, 33), "holes")
    expected = masked_whiten(x, m, shift_mean=False)
    out = torch.empty_like(x)
    assert masked_whiten(x, m, shift_mean=False, out=out) is out
    _close(out, expected, 0.0)
    strided = torch.empty(33, 8, dtype=dtype).t()  # a non-contiguous out: the torch ops, not the kernels
    masked_whiten(x, m, shift_mean=False, out=strided)
    _close(strided, expected, {F64: 1e-12, F32: 1e-6}.get(dtype, 2e-2))
    x0 = x.clone()
    assert masked_whiten(x, m, shift_mean=False, out=x) is x  # in place
    _close(x, expected, 0.0)
    assert not torch.equal(x, x0)


def test_does_not_write_x():
    x, m = _x((8, 33)), _mask((8, 33), "holes")
    x0, m0 = x.clone(), m.clone()
    for kw in CONVENTIONS:
        masked_whiten(x, m, **kw)
    assert torch.equal(x, x0) and torch.equal(m, m0)


def test_autograd_matches_verl():
    x, m = _x((4, 9)), _mask((4, 9), "holes")
    w = _x((4, 9), seed=5)
    for shift_mean in (True, False):
        a = x.clone().requires_grad_()
        b = x.clone().requires_grad_()
        (masked_whiten(a, m, shift_mean=shift_mean) * w).sum().backward()
        (verl_masked_whiten(b, m.to(F64), shift_mean=shift_mean, count_guard=0.0) * w).sum().backward()
        _close(a.grad, b.grad, 1e-10)
    a = x.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: masked_whiten(t, m, unbiased=False, eps_mode="clamp"), (a,))


# -- bad inputs ------------------------------------------------------------------------------------------
def _bad_cases():
    x = _x((3, 4))
    m = torch.ones(3, 4, dtype=torch.bool)
    return [
        (TypeError, "x", {"x": x.numpy()}),
        (TypeError, "x", {"x": torch.ones(3, 4, dtype=torch.int64)}),
        (TypeError, "x", {"x": x.to_sparse()}),
        (TypeError, "mask", {"x": x, "mask": m.numpy()}),
        (TypeError, "mask", {"x": x, "mask": torch.ones(3, 4, dtype=torch.complex64)}),
        (ValueError, "mask", {"x": x, "mask": torch.ones(4, dtype=torch.bool)}),
        (ValueError, "mask", {"x": x, "mask": torch.ones(1, 3, 4, dtype=torch.bool)}),
        (ValueError, "mask", {"x": x, "mask": torch.ones(3, 4, dtype=torch.bool, device="meta")}),
        (TypeError, "eps", {"x": x, "eps": "1e-8"}),
        (TypeError, "eps", {"x": x, "eps": True}),
        (TypeError, "eps", {"x": x, "eps": torch.tensor(1e-8)}),
        (ValueError, "eps", {"x": x, "eps": -1e-8}),
        (ValueError, "eps", {"x": x, "eps": float("nan")}),
        (ValueError, "eps_mode", {"x": x, "eps_mode": "max"}),
        (ValueError, "eps_mode", {"x": x, "eps_mode": None}),
        (TypeError, "unbiased", {"x": x, "unbiased": 1}),
        (TypeError, "shift_mean", {"x": x, "shift_mean": None}),
        (TypeError, "scale", {"x": x, "scale": "yes"}),
        (TypeError, "group", {"x": x, "group": "world"}),
        (TypeError, "group", {"x": x, "group": True}),
        (TypeError, "out", {"x": x, "out": x.numpy()}),
        (ValueError, "out", {"x": x, "out": torch.empty(4, 3, dtype=F64)}),
        (ValueError, "out", {"x": x, "out": torch.empty(3, 4, dtype=F32)}),
        (ValueError, "out", {"x": x, "out": torch.empty(3, 4, dtype=F64, device="meta")}),
        (ValueError, "out", {"x": x, "out": torch.empty(4, dtype=F64).expand(3, 4)}),
        (ValueError, "out", {"x": x, "out": torch.empty(3, 4, dtype=F64, requires_grad=True)}),
        (ValueError, "out", {"x": x.clone().requires_grad_(), "out": torch.empty(3, 4, dtype=F64)}),
    ]


@pytest.mark.parametrize("error, name, kwargs", _bad_cases(),
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(_bad_cases())])
def test_bad_inputs(error, name, kwargs):
    out = kwargs.get("out")
    snapshot = out.detach().clone() if isinstance(out, torch.Tensor) and out.device.type == "cpu" else None
    with pytest.raises(error, match=name):
        masked_whiten(**kwargs)
    if snapshot is not None:
        assert torch.equal(out, snapshot) or torch.isnan(snapshot).any()
    if set(kwargs) <= {"x", "mask", "group"}:
        with pytest.raises(error, match=name):
            masked_moments(**kwargs)


# -- distributed: gloo ranks on this machine -------------------------------------------------------------
_ROWS = {2: (6, 3), 3: (4, 0, 7)}  # world 2: rank 1's mask is all zero; world 3: rank 1 holds nothing
_WIDTH = 9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _global_data(world, dtype=F64):
    rows = _ROWS[world]
    x = _x((sum(rows), _WIDTH), seed=world, dtype=dtype)
    m = _mask((sum(rows), _WIDTH), "holes", seed=world + 1)
    if world == 2:
        m[rows[0]:] = False
    return x, m, rows


def _dist_worker(rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        calls = {}

        def counting(name):
            fn = getattr(dist, name)

            def wrapped(*args, **kwargs):
                calls[name] = calls.get(name, 0) + 1
                return fn(*args, **kwargs)
            return wrapped

        for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
                     "reduce_scatter_tensor", "all_to_all_single", "barrier"):
            if hasattr(dist, name):
                setattr(dist, name, counting(name))

        def one_collective(fn, *args, **kwargs):
            calls.clear()
            result = fn(*args, **kwargs)
            assert sum(calls.values()) == 1, calls
            assert set(calls) <= {"all_gather_single", "all_gather_into_tensor"}, calls
            return result

        for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
            x, m, rows = _global_data(world, dtype)
            lo = sum(rows[:rank])
            shard = slice(lo, lo + rows[rank])
            xs, ms = x[shard].clone(), m[shard].clone()
            for kw in CONVENTIONS + [{"unbiased": False, "eps_mode": "clamp", "scale": False}]:
                expected = masked_whiten(x, m, **kw)[shard]
                y = one_collective(masked_whiten, xs, ms, group=group, **kw)
                _close(y, expected, tol)
            _close(one_collective(masked_whiten, xs, group=group), masked_whiten(x)[shard], tol)
            out = xs.clone()
            one_collective(masked_whiten, out, ms, group=group, out=out)
            _close(out, masked_whiten(x, m)[shard], tol)

            n, mean, m2 = one_collective(masked_moments, xs, ms, group=group)
            n_ref, mean_ref, m2_ref = masked_moments(x, m)
            assert n.dtype == torch.int64 and int(n) == int(n_ref)
            assert mean.dtype == mean_ref.dtype and m2.dtype == m2_ref.dtype
            _close(mean, mean_ref, tol)
            _close(m2, m2_ref, tol)

        # nothing valid on any rank: NaN everywhere, no exception
        x, _, rows = _global_data(world)
        xs = x[:rows[rank]]
        y = one_collective(masked_whiten, xs, torch.zeros_like(xs, dtype=torch.bool), group=group)
        assert torch.isnan(y).all()
        # grad through another rank's statistics is not supported
        try:
            masked_whiten(xs.clone().requires_grad_(), group=group)
        except ValueError as e:
            assert "group" in str(e)
        else:
            raise AssertionError("group= with requires_grad did not raise")
    finally:
        dist.destroy_process_group()
    leave_rank_process()


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("world", [2, 3])
def test_distributed_statistics_match_the_concatenated_data(world):
    import torch.multiprocessing as mp

    mp.spawn(_dist_worker, args=(world, _free_port()), nprocs=world, join=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 5000, 40000])
@pytest.mark.parametrize("kw", [{}, dict(unbiased=False, eps_mode="clamp"), dict(scale=False), dict(shift_mean=False)])
def test_every_backend_matches_the_torch_ops(backend, dtype, n, kw):
    """The kernel passes (block partials, their fold, the normalisation) against the torch ops,
    across several blocks (numba's 16384, Triton's 4096 elements)."""
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(n, generator=g, dtype=torch.float64) * 3 + 5).to(dtype)
    mask = torch.rand(n, generator=g) < 0.7
    mask[0] = True
    for m in (mask, None, mask.to(torch.float32)):
        got = masked_whiten(x, m, backend=backend, **kw)
        want = masked_whiten(x, m, backend="torch", **kw)
        torch.testing.assert_close(got, want, rtol=1e-12 if dtype == torch.float64 else 2e-6,
                                   atol=1e-12 if dtype == torch.float64 else 2e-6, equal_nan=True)
    out = x.clone()
    assert masked_whiten(out, mask, backend=backend, out=out, **kw) is out
    torch.testing.assert_close(out, masked_whiten(x, mask, backend="torch", **kw), equal_nan=True,
                               rtol=1e-12 if dtype == torch.float64 else 2e-6,
                               atol=1e-12 if dtype == torch.float64 else 2e-6)


# -- one statistics precision on every backend and layout (docs/semantics.md 9 and 15.1) -------------
# float32 data of order 1e20: squared deviations of order 1e40 pass the float32 range, so a path that
# formed M2 in float32 would get an infinite variance and whiten everything to 0
EXTREME = [1e20, 0.0, -1e20, 3e19, 2e20, -5e19]  # issue 37's example; its mean is 3e19
_CUDA = torch.cuda.is_available() and not TRITON_INTERPRET_AT_STARTUP
BACKEND_DEVICES = [("cpu", "cpu"), ("torch", "cpu"), ("triton", "cpu")] + [
    pytest.param(name, "cuda", marks=pytest.mark.skipif(not _CUDA, reason="needs CUDA without the interpreter"))
    for name in ("torch", "triton")]


def _extreme(dtype, device="cpu"):
    """[3, 4]: the example and six more values of order 1e20, in ``dtype`` (rounded)."""
    x = torch.tensor(EXTREME + [7e19, -2.5e20, 1.5e20, 4e19, -8e19, 2.2e20], dtype=F64)
    return x.view(3, 4).to(device=device, dtype=dtype)


def _oracle_whitened(x, mask, **kw):
    """The float64 oracle on ``x``'s values, rounded to ``x``'s dtype as torch rounds float64."""
    y = oracle.masked_whiten(x.double().cpu().numpy(), None if mask is None else mask.cpu().numpy(), **kw)
    return torch.from_numpy(y).to(device=x.device, dtype=x.dtype)


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES)
@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
@pytest.mark.parametrize("kw", [dict(eps_mode="std")] + CONVENTIONS)
def test_extreme_magnitudes_every_backend_and_layout_match_the_oracle(backend, device, dtype, kw):
    """Statistics in float64 and (x - mean) * rstd in float64, rounded once, whatever the backend
    and the layout: contiguous, transposed (dense, not contiguous), masked (huge values outside
    the mask), masked and transposed, and each in place."""
    if device == "cpu":
        require_backend(backend)
    # float32: two float32 ulps (float64 sums in another order may round the last bit otherwise);
    # bfloat16: one bfloat16 ulp (Triton's interpreter rounds float32 to bfloat16 by truncation)
    tol = 2.4e-7 if dtype == F32 else 2.0 ** -7
    # the call itself: 1-D, every element
    x = torch.tensor(EXTREME, device=device).to(dtype)
    got = masked_whiten(x, backend=backend, **kw)
    torch.testing.assert_close(got, _oracle_whitened(x, None, **kw), rtol=tol, atol=0.0)
    base = _extreme(dtype, device)
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool, device=device)
    outside = torch.where(mask, base, torch.full_like(base, 3e38 if dtype == F32 else 1e38))
    layouts = {"contiguous": (base, None), "transposed": (base.t(), None), "masked": (outside, mask),
               "masked transposed": (outside.t(), mask.t())}
    for layout, (x, m) in layouts.items():
        want = _oracle_whitened(x, m, **kw)
        assert torch.isfinite(want).all() and want.abs().max() > 0.5, layout  # an exact answer of order 1
        got = masked_whiten(x, m, backend=backend, **kw)
        assert got.stride() == x.stride() or not x.is_contiguous(), layout
        torch.testing.assert_close(got, want, rtol=tol, atol=0.0, msg=lambda text: f"{layout}: {text}")
        out = x.clone()  # same strides: the transposed layouts stay transposed
        assert masked_whiten(out, m, backend=backend, out=out, **kw) is out
        torch.testing.assert_close(out, want, rtol=tol, atol=0.0, msg=lambda text: f"{layout} in place: {text}")


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16, F64])
def test_extreme_magnitudes_moments_are_float64(dtype):
    """masked_moments returns float64 mean and M2 for every input dtype; for float32 data of
    order 1e20 M2 (~6e40) is past the float32 range and equals the oracle's."""
    x = _extreme(dtype)
    mask = torch.tensor([[1, 1, 0, 1], [1, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.bool)
    for m in (None, mask, mask.to(F32)):
        n, mean, m2 = masked_moments(x.t(), None if m is None else m.t())
        assert n.dtype == torch.int64 and mean.dtype == F64 and m2.dtype == F64
        n_ref, mean_ref, m2_ref = oracle.masked_moments(x.double().t().numpy(), None if m is None else m.t().numpy())
        assert int(n) == n_ref
        assert float(mean) == pytest.approx(mean_ref, rel=1e-15)
        assert float(m2) == pytest.approx(m2_ref, rel=1e-14)
        if dtype == F32:
            assert float(m2) > torch.finfo(F32).max


@pytest.mark.parametrize("backend, device", BACKEND_DEVICES)
@pytest.mark.parametrize("eps_mode", EPS_MODES)
def test_eps_enters_the_statistics_in_float64(backend, device, eps_mode):
    """One valid element, biased variance 0: y = (x - x0) * rstd with rstd formed from eps alone,
    so float64 output shows eps itself to 1e-13 (a compiled Triton kernel receives a Python float
    as a float32, 1e-8 rounded by 6e-17, which would show at 3e-9 relative)."""
    if device == "cpu":
        require_backend(backend)
    x = torch.tensor([1.0, 2.0, -3.0], dtype=F64, device=device)
    m = torch.tensor([True, False, False], device=device)
    for eps in (1e-8, 1e-6, 0.3):
        got = masked_whiten(x, m, unbiased=False, eps=eps, eps_mode=eps_mode, backend=backend)
        want = _oracle_whitened(x, m, unbiased=False, eps=eps, eps_mode=eps_mode)
        torch.testing.assert_close(got, want, rtol=1e-13, atol=0.0)
