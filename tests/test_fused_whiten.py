"""The whitening in the same pass on the Triton backend (rl_triton/core/whiten.py,
rl_triton/core/kernels/moments.py, the engine's ``moments``): ``masked_whiten`` and
``gae(whiten=...)`` in two launches, masked and unmasked, in every eps convention, against the
float64 oracle (rl_triton/testing/oracle.py); the launches counted in Triton's interpreter."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from conftest import TRITON_INTERPRET_AT_STARTUP, require_backend
from test_graphs import replays  # noqa: F401 (a fixture)

import rl_triton as rt
from rl_triton.core import whiten as whitening
from rl_triton.testing import oracle

pytest.importorskip("triton")
from rl_triton.core.kernels import forced_plan  # noqa: E402
from rl_triton.core.kernels import moments as kmoments  # noqa: E402

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16
_CUDA = torch.cuda.is_available() and not TRITON_INTERPRET_AT_STARTUP
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not _CUDA,
                                                                reason="needs CUDA without the interpreter"))]
# masked_whiten's conventions (verl's defaults, rsl_rl's std, OpenRLHF's clamp and no_std_norm,
# the shift back, and a large eps added to the biased variance)
CONVENTIONS = [{}, dict(eps_mode="std"), dict(unbiased=False, eps_mode="clamp"), dict(scale=False),
               dict(shift_mean=False), dict(unbiased=False, eps=0.3)]
MASKS = [None, "skip", "pad"]
# the rounding the comparisons allow: float64 sums in another order, and the output rounded once
TOL = {F64: 1e-12, F32: 2.4e-7, BF16: 2.0 ** -7}


@pytest.fixture
def device(request):
    return request.param


def _device(device):
    if device == "cpu":
        require_backend("triton")
    return device


@contextlib.contextmanager
def _counted():
    """The names of the Triton kernels launched meanwhile, in order (Triton's interpreter)."""
    from triton.runtime import interpreter

    names = []
    call = interpreter.GridExecutor.__call__

    def counting(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return call(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = counting
    try:
        yield names
    finally:
        interpreter.GridExecutor.__call__ = call


def _rollout(R, T, dtype, device, seed=0, mask=True, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(R, T, generator=g, dtype=F64) * scale + 0.4 * scale
    v = torch.randn(R, T, generator=g, dtype=F64) * scale
    boot = torch.randn(R, generator=g, dtype=F64) * scale
    m = torch.rand(R, T, generator=g) < 0.7
    m[:, 0] = True
    if not mask:
        m = None
    return tuple(None if x is None else x.to(dtype=dtype, device=device) for x in (r, v, boot)) + (
        None if m is None else m.to(device),)


def _oracle_advantages(r, v, boot, mask, mode, gamma=0.99, lmbda=0.95):
    """The oracle's advantages in float64 ``[R, T]``."""
    rows = lambda x: x.double().cpu().numpy()  # noqa: E731
    R, T = r.shape
    full = lambda x: np.full((R, T), x)  # noqa: E731
    if mode is None:
        nv = np.concatenate([rows(v)[:, 1:], rows(boot)[:, None]], 1)
        zeros = np.zeros((R, T), bool)
        return oracle.gae(rows(r), rows(v), nv, zeros, zeros, full(gamma), full(lmbda))[0]
    return oracle.gae_masked(rows(r), rows(v), mask.cpu().numpy(), full(gamma), full(lmbda), mode=mode,
                             bootstrap=rows(boot))[0]


def _oracle_whitened(adv, mask, options, dtype):
    """The oracle's whitening of ``adv`` (float64 numpy or a tensor), rounded to ``dtype`` as
    torch rounds float64."""
    adv = adv.double().cpu().numpy() if isinstance(adv, torch.Tensor) else adv
    y = oracle.masked_whiten(adv, None if mask is None else mask.cpu().numpy(), **options)
    return torch.from_numpy(y).to(dtype)


def _gae(r, v, boot, mask, mode, options, **kw):
    extra = {} if mode is None else dict(mask=mask, mask_mode=mode)
    return rt.gae(r, v, bootstrap_value=boot, whiten=dict(options) if options else True, backend="triton", **extra,
                  **kw)


def _check(adv, r, v, boot, mask, mode, options, dtype, tdim_view=lambda x: x, time_major=False):
    """``adv`` against the oracle: the whitening of the kernel's own unwhitened advantages to the
    output's rounding, and the whole of it (GAE and whitening) to the accumulation's.
    ``time_major``: ``adv`` came from the transposed rollout, so the unwhitened advantages do too."""
    extra = {} if mode is None else dict(mask=mask, mask_mode=mode)
    if time_major:
        extra = {k: x.t().contiguous() if isinstance(x, torch.Tensor) else x for k, x in extra.items()}
        plain = rt.gae(r.t().contiguous(), v.t().contiguous(), bootstrap_value=boot, backend="triton", time_dim=0,
                       **extra)[0].t()
    else:
        plain = rt.gae(r, v, bootstrap_value=boot, backend="triton", **extra)[0]
    stat_mask = None if mode is None else mask
    torch.testing.assert_close(tdim_view(adv).cpu(), _oracle_whitened(tdim_view(plain), stat_mask, options, dtype),
                               rtol=TOL[dtype], atol=TOL[dtype], equal_nan=True)
    raw = _oracle_advantages(tdim_view(r), tdim_view(v), boot, stat_mask, mode)
    loose = {F64: 1e-10, F32: 2e-5, BF16: 0.05}[dtype]
    torch.testing.assert_close(tdim_view(adv).cpu().double(), _oracle_whitened(raw, stat_mask, options, F64),
                               rtol=loose, atol=loose, equal_nan=True)


# -- launches ------------------------------------------------------------------------------------
needs_interpreter = pytest.mark.skipif(not TRITON_INTERPRET_AT_STARTUP, reason="counts launches in the interpreter")


@needs_interpreter
@pytest.mark.parametrize("mode", MASKS)
@pytest.mark.parametrize("options", CONVENTIONS)
def test_gae_whiten_is_two_launches(mode, options):
    """The scan (which reduces its advantages into partials) and the fold with the normalisation,
    on a signature's first call and on its plan's (new tensors, the same signature)."""
    require_backend("triton")
    for seed in range(2):  # the signature's first call, then its plan's
        r, v, boot, mask = _rollout(5, 9, F64, "cpu", seed=seed + 10 * len(options))
        with _counted() as names:
            adv, ret = _gae(r, v, boot, mask, mode, options)
        assert names == ["scan_kernel", "whiten_kernel"]
        _check(adv, r, v, boot, mask, mode, options, F64)


@needs_interpreter
@pytest.mark.parametrize("mask_dtype", [None, torch.bool, F32])
@pytest.mark.parametrize("options", CONVENTIONS)
def test_masked_whiten_is_two_launches(mask_dtype, options):
    require_backend("triton")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, 11, generator=g, dtype=F64) * 3 + 1
    mask = None if mask_dtype is None else (torch.rand(37, 11, generator=g) < 0.6).to(mask_dtype)
    with _counted() as names:
        y = rt.masked_whiten(x, mask, backend="triton", **options)
    assert names == ["moments_kernel", "whiten_kernel"]
    torch.testing.assert_close(y, _oracle_whitened(x, mask, options, F64), rtol=1e-12, atol=1e-12)


# -- the oracle ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("dtype", [F32, F64, BF16])
@pytest.mark.parametrize("mode", MASKS)
def test_gae_whiten_layouts_and_dtypes(device, dtype, mode):
    """time_dim 1 and 0 (a transposed rollout), new outputs and out=; two conventions a dtype,
    each convention with one dtype (test_gae_whiten_is_two_launches has each in float64)."""
    device = _device(device)
    R, T = 6, 13
    first = [F32, F64, BF16].index(dtype)
    for k, options in enumerate(CONVENTIONS[first::3]):
        r, v, boot, mask = _rollout(R, T, dtype, device, seed=k)
        adv, ret = _gae(r, v, boot, mask, mode, options)
        _check(adv, r, v, boot, mask, mode, options, dtype)
        # time-major: [T, R] tensors, time_dim=0
        rt_, vt, mt = r.t().contiguous(), v.t().contiguous(), None if mask is None else mask.t().contiguous()
        adv_t, _ = _gae(rt_, vt, boot, mt, mode, options, time_dim=0)
        # the layouts reduce the moments in different orders: each against the oracle, not each other
        _check(adv_t.t(), r, v, boot, mask, mode, options, dtype, time_major=True)
        out = (torch.full_like(r, 7.0), torch.full_like(r, 7.0))
        got = _gae(r, v, boot, mask, mode, options, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        torch.testing.assert_close(out[0], adv, rtol=0, atol=0)
        torch.testing.assert_close(out[1], ret, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("mode", MASKS)
@pytest.mark.parametrize("plan", [dict(block_t=4, block_r=2), dict(block_t=4, block_r=1, n_seg=3)])
def test_gae_whiten_over_many_tiles_and_segments(device, mode, plan, monkeypatch):
    """Partial tiles in both dims, several chunks a row, and (unmasked and pad) the time split
    into segments: one partial per row block and chunk (24 or 42), folded 32 at a time."""
    device = _device(device)
    monkeypatch.setattr(kmoments, "FOLD_BLOCK", 32)
    r, v, boot, mask = _rollout(7, 23, F32, device, seed=11)
    with forced_plan(**plan):  # the unwhitened advantages of _check's under the same plan
        adv, _ = _gae(r, v, boot, mask, mode, dict(eps_mode="std"))
        _check(adv, r, v, boot, mask, mode, dict(eps_mode="std"), F32)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("mode", MASKS)
@pytest.mark.parametrize("options", [dict(eps_mode="std"), {}, dict(unbiased=False, eps_mode="clamp")])
def test_gae_whiten_extreme_magnitudes(device, mode, options):
    """float32 advantages of order 1e20, whose squared deviations pass the float32 range: the
    statistics in float64 give the oracle's answer of order 1."""
    device = _device(device)
    r, v, boot, mask = _rollout(4, 9, F32, device, seed=2, scale=1e20)
    adv, _ = _gae(r, v, boot, mask, mode, options)
    assert torch.isfinite(adv).all() and adv.abs().max() > 0.5
    _check(adv, r, v, boot, mask, mode, options, F32)


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("mode", MASKS)
def test_gae_whiten_where_the_scan_cannot_reduce(device, mode, monkeypatch):
    """Too many tiles for the fold, an ``out=`` with gaps and one that is an input: the plain
    scan, then masked_whiten (three launches: the scan, the partials, their fold and the
    normalisation), with the same result."""
    from rl_triton.core import plans

    device = _device(device)
    r, v, boot, mask = _rollout(5, 8, F64, device, seed=4)
    options = dict(eps_mode="std")
    want = _gae(r, v, boot, mask, mode, options)[0]
    _check(want, r, v, boot, mask, mode, options, F64)
    plain = ["scan_kernel", "moments_kernel", "whiten_kernel"]
    monkeypatch.setattr(whitening, "MAX_SCAN_PARTS", 0)
    plans.clear()  # the signature's plan accepted the scan under the old limit
    with _counted_where_interpreted() as names:
        got = _gae(r, v, boot, mask, mode, options)[0]
    assert names in (None, plain)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    monkeypatch.undo()
    gaps = torch.zeros(5, 16, dtype=F64, device=device)[:, ::2]
    r2 = r.clone()
    # advantages with gaps whiten as torch ops (masked_whiten's Triton path takes contiguous ones)
    for out, launches in (((gaps, torch.empty_like(r)), ["scan_kernel"]), ((r2, torch.empty_like(r)), plain)):
        with _counted_where_interpreted() as names:
            _gae(r2, v, boot, mask, mode, options, out=out)
        assert names in (None, launches)
        torch.testing.assert_close(out[0], want, rtol=1e-12, atol=1e-12)


@contextlib.contextmanager
def _counted_where_interpreted():
    """:func:`_counted` in Triton's interpreter; elsewhere nothing is counted (None)."""
    if not TRITON_INTERPRET_AT_STARTUP:
        yield None
        return
    with _counted() as names:
        yield names


@pytest.mark.parametrize("device", DEVICES, indirect=True)
@pytest.mark.parametrize("options", CONVENTIONS)
def test_masked_whiten_many_blocks_a_program(device, options, monkeypatch):
    """Fewer partials and programs than blocks: each program combines its blocks (Chan et al.)
    and normalises several; a NaN outside the mask stays out, an infinity inside reaches
    everything as in the oracle."""
    device = _device(device)
    monkeypatch.setattr(kmoments, "MAX_PARTS", 2)
    monkeypatch.setattr(kmoments, "MAX_PROGRAMS", 2)
    n = 5 * kmoments.BLOCK + 17
    g = torch.Generator().manual_seed(9)
    x = torch.randn(n, generator=g, dtype=F64) * 2 + 1e6
    mask = torch.rand(n, generator=g) < 0.5
    x[~mask] = float("nan")
    x, mask = x.to(device), mask.to(device)
    for m in (mask, mask.to(F32)):
        y = rt.masked_whiten(x, m, backend="triton", **options)
        torch.testing.assert_close(y.cpu(), _oracle_whitened(x, mask, options, F64), rtol=1e-9, atol=1e-9,
                                   equal_nan=True)
    x32 = torch.where(mask, x, 0.0).to(F32)
    torch.testing.assert_close(rt.masked_whiten(x32, backend="triton", **options).cpu(),
                               _oracle_whitened(x32, None, options, F32), rtol=2.4e-7, atol=0.0)
    x[3] = float("inf")
    mask[3] = True
    y = rt.masked_whiten(x, mask, backend="triton", **options)
    torch.testing.assert_close(y.cpu(), _oracle_whitened(x, mask, options, F64), equal_nan=True)


# -- repeated calls (the replays fixture: graph replays with tests/test_graphs.py's stand-in capture)


@pytest.mark.parametrize("mode", MASKS)
def test_repeated_whitened_calls_replay_and_read_new_values(replays, mode):
    """rsl_rl's repeated call (the same tensors, new values, ``out=``): the first call builds the
    plan, the second runs its hit path, the third is captured and replayed, later ones replay;
    each result the oracle's."""
    require_backend("triton")
    r, v, boot, mask = _rollout(5, 9, F64, "cpu", seed=1)
    out = (torch.empty_like(r), torch.empty_like(r))
    options = dict(eps_mode="std")
    for i in range(5):
        fresh = _rollout(5, 9, F64, "cpu", seed=20 + i)
        r.copy_(fresh[0])
        if mask is not None:
            mask.copy_(fresh[3])
        got = _gae(r, v, boot, mask, mode, options, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        _check(out[0], r, v, boot, mask, mode, options, F64)
    assert replays == ["capture", "replay", "replay", "replay"]


@pytest.mark.skipif(not _CUDA, reason="needs CUDA without the interpreter")
@pytest.mark.parametrize("mode", MASKS)
@pytest.mark.parametrize("shape", [(4096, 24), (4, 20000)])  # rsl_rl's rows; a time split (a workspace)
def test_a_real_graph_of_a_whitened_call_on_a_gpu(monkeypatch, mode, shape):
    """On a GPU: the graph captured on a whitened call's second occurrence (scan with partials,
    their fold and the normalisation, the partials' buffer in the graph's memory) recomputes the
    call from the tensors' current values on every replay."""
    from rl_triton.core import graphs, plans

    monkeypatch.setenv("RL_TRITON_GRAPHS", "1")
    captured = []
    capture = graphs.capture
    monkeypatch.setattr(graphs, "capture", lambda launch, device: captured.append(1) or capture(launch, device))
    plans.clear()
    r, v, boot, mask = _rollout(*shape, F32, "cuda", seed=3)
    out = (torch.empty_like(r), torch.empty_like(r))
    for i in range(5):
        fresh = _rollout(*shape, F32, "cuda", seed=50 + i)
        r.copy_(fresh[0])
        _gae(r, v, boot, mask, mode, dict(eps_mode="std"), out=out)
        torch.cuda.synchronize()
        _check(out[0], r, v, boot, mask, mode, dict(eps_mode="std"), F32)
    assert captured == [1]
    plans.clear()
