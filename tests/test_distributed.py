"""Sequences split along time across gloo ranks on this machine (``group=``,
rl_triton/core/sharded.py): every estimator and ``affine_scan`` in both directions, every
flag form of the catalog, masks of both semantics, packed sequences crossing chunks, on uneven
chunks (fixed ones with empty chunks first, inside and last, and seeded random ones) with flags
exactly on the chunk boundaries, against the single-process call (float64 to 1e-12) and the
float64 oracle; group advantages over ranks; and the bytes each rank hands to the collectives,
which do not grow with T."""

import os
import socket

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.core import launch
from rl_triton.testing import catalog, oracle
from rl_triton.testing.frameworks import verl_compute_gae_advantage_return

from helpers import spawn_gloo

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

F32, F64 = torch.float32, torch.float64
ROWS = 3
# chunk lengths per world: uneven, with empty chunks first, inside and last, and drawn at random
CHUNKS = {2: (5, 8), 3: (0, 6, 7), 4: (4, 0, 9, 0)}


def _random_chunks(world, seed):
    """Random chunk lengths (0 to 9 steps, one chunk at least 3), the same on every rank."""
    lengths = np.random.default_rng(seed).integers(0, 10, world)
    lengths[seed % world] = max(3, lengths[seed % world])
    return [0, *np.cumsum(lengths).tolist()]
BYTES_PER_ROW = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_spawn = spawn_gloo  # worker(rank, world, group, *args) on world gloo ranks


def _bounds(world, steps=None):
    lengths = CHUNKS[world]
    if steps is not None:  # the same proportions over ``steps``
        cuts = np.round(np.cumsum(lengths) / sum(lengths) * steps).astype(int)
        return [0, *cuts.tolist()]
    return [0, *np.cumsum(lengths).tolist()]


def _chunk_call(fn, args, kwargs, lo, hi, group, **extra):
    """``fn`` on steps [lo, hi) of batch-major [R, T] tensors (per-row inputs whole)."""
    def cut(x):
        return x[:, lo:hi] if isinstance(x, torch.Tensor) and x.ndim == 2 else x
    return getattr(rl_triton, fn)(*map(cut, args), **{k: cut(v) for k, v in kwargs.items()}, group=group, **extra)


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _close(got, expected, tol, what):
    got, expected = got.double(), torch.as_tensor(np.asarray(expected), dtype=F64)
    assert got.shape == expected.shape, (what, got.shape, expected.shape)
    if got.numel():
        err = ((got - expected).abs() / (1 + expected.abs())).max().item()
        assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def _backends():
    names = ["cpu", "torch"] if launch.resolve_backend(None, torch.device("cpu")) == "cpu" else ["torch"]
    if os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")
    return names


def _catalog_worker(rank, world, group):
    for bounds, backends in ((_bounds(world), _backends()),
                             (_random_chunks(world, 100 + world), _backends()[:1])):
        _catalog_case(rank, group, bounds, [(bounds[rank], bounds[rank + 1])], backends)


def _catalog_case(rank, group, bounds, ranges, backends):
    """Every catalog variant with ``group=group`` on this rank's steps ``ranges`` (concatenated
    along time) of a window whose chunk boundaries lie at ``bounds``, against the unsharded call
    and the oracle on the same steps."""
    for backend in backends:
        for fn, variants in catalog.VARIANTS.items():
            if not catalog.takes(fn, "group"):
                continue
            for variant in variants:
                for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
                    for time_dim in ((-1, 0) if variant == next(iter(variants)) else (-1,)):
                        shape = (ROWS, bounds[-1]) if time_dim == -1 else (bounds[-1], ROWS)
                        p = catalog.make(fn, shape, variant, dtype=dtype, time_dim=time_dim, seed=len(bounds) - 1,
                                         p_term=0.15, p_trunc=0.1).flagged_at(bounds[1:-1])
                        whole = p.call(backend)
                        got = p.pieces(ranges).call(backend, group=group)
                        what = f"{fn} {variant} {dtype} time_dim={time_dim} on {backend}, rank {rank}"
                        for g, w, e in zip(got, whole, _tuple(p.expected())):
                            assert g.dtype == w.dtype and g.device == w.device, what
                            _close(g, _steps_of(w, time_dim % 2, ranges), tol, what + " vs one process")
                            _close(g, _steps_of(torch.as_tensor(np.asarray(e)), time_dim % 2, ranges),
                                   1e-10 if dtype == F64 else 1e-4, what + " vs the oracle")


def _steps_of(x, dim, ranges):
    return torch.cat([x.narrow(dim, lo, hi - lo) for lo, hi in ranges], dim)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_estimator_matches_the_unsharded_call(world):
    _spawn(_catalog_worker, world)


def _masks(shape, seed, bounds):
    g = np.random.default_rng(seed)
    m = g.random(shape) < 0.6
    m[0, :] = True  # a row without holes
    m[1, bounds[1]:bounds[2]] = False  # a chunk of row 1 entirely masked
    m[2, :bounds[1]] = False
    return torch.from_numpy(m)


def _mask_worker(rank, world, group):
    bounds = _bounds(world)
    lo, hi = bounds[rank], bounds[rank + 1]
    shape = (ROWS, bounds[-1])
    for backend in _backends():
        for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
            g = torch.Generator().manual_seed(world)
            r, v = torch.randn(shape, generator=g, dtype=dtype), torch.randn(shape, generator=g, dtype=dtype)
            boot = torch.randn(ROWS, generator=g, dtype=dtype)
            mask = _masks(shape, world, bounds)
            for mode in ("skip", "pad"):
                for kw in (dict(), dict(bootstrap_value=boot), dict(gamma=0.9, lmbda=0.8)):
                    what = f"gae mask_mode={mode} {kw.keys()} {dtype} on {backend}, rank {rank}"
                    whole = rl_triton.gae(r, v, mask=mask, mask_mode=mode, backend=backend, **kw)
                    got = _chunk_call("gae", (r, v), dict(mask=mask, mask_mode=mode, **kw), lo, hi, group,
                                      backend=backend)
                    for gt, w in zip(got, whole):
                        _close(gt, w[:, lo:hi], tol, what)
                    boot_kw = kw.get("bootstrap_value")
                    adv, _ = oracle.gae_masked(r.double().numpy(), v.double().numpy(), mask.numpy(),
                                               np.full(shape, kw.get("gamma", 0.99)),
                                               np.full(shape, kw.get("lmbda", 0.95)), mode,
                                               None if boot_kw is None else boot_kw.double().numpy())
                    _close(got[0], adv[:, lo:hi], 1e-10 if dtype == F64 else 1e-4,
                           what + " vs the oracle")
            # whitening over every rank's tokens
            whole = rl_triton.gae(r, v, mask=mask, whiten=True, backend=backend)
            got = _chunk_call("gae", (r, v), dict(mask=mask, whiten=True), lo, hi, group, backend=backend)
            _close(got[0], whole[0][:, lo:hi], 1e-10 if dtype == F64 else 1e-4, f"whiten {dtype} on {backend}")
            # data parallel: each rank whole rows, the whitening's statistics over every rank's tokens
            # (on numba, the scan's own moments of each row, then one collective)
            rows = slice(rank * ROWS // world, (rank + 1) * ROWS // world)
            mine = rl_triton.gae(r[rows], v[rows], mask=mask[rows], whiten=dict(group=group), backend=backend)
            want = verl_compute_gae_advantage_return(r.double(), v.double(), mask.double(), 0.99, 0.95)
            _close(mine[0], want[0][rows], 1e-10 if dtype == F64 else 1e-4,
                   f"data-parallel whiten {dtype} on {backend}")
            # without a mask (rsl_rl's normalisation), over every element of every rank
            std = dict(eps_mode="std")
            whole = rl_triton.gae(r, v, whiten=std, backend=backend)
            got = _chunk_call("gae", (r, v), dict(whiten=std), lo, hi, group, backend=backend)
            _close(got[0], whole[0][:, lo:hi], 1e-10 if dtype == F64 else 1e-4, f"unmasked whiten {dtype} on {backend}")
            mine = rl_triton.gae(r[rows], v[rows], whiten=dict(std, group=group), backend=backend)
            _close(mine[0], whole[0][rows], 1e-10 if dtype == F64 else 1e-4,
                   f"data-parallel unmasked whiten {dtype} on {backend}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_masked_gae_matches_the_unsharded_call(world):
    _spawn(_mask_worker, world)


def _regime_worker(rank, world, group):
    """The Triton edge map over a split time axis (several segments folded) and over chunks."""
    from rl_triton.core import kernels

    bounds = _bounds(world, 40)
    lo, hi = bounds[rank], bounds[rank + 1]
    for fn, variant in (("gae", "done+bootstrap"), ("vtrace", "gym"), ("affine_scan", "forward"),
                        ("eligibility_trace", "done+initial"), ("retrace", "expected")):
        p = catalog.make(fn, (ROWS, bounds[-1]), variant, dtype=F64, seed=1, p_term=0.1).flagged_at(bounds[1:-1])
        whole = p.call("triton")
        for plan in (dict(block_t=4, n_seg=3), dict(block_t=8, block_r=2)):
            with kernels.forced_plan(**plan):
                got = p.steps(lo, hi).call("triton", group=group)
            for g, w in zip(got, whole):
                _close(g, w[:, lo:hi], 1e-12, f"{fn} {plan}")
    g = torch.Generator().manual_seed(3)
    r, v = torch.randn(ROWS, bounds[-1], generator=g, dtype=F64), torch.randn(ROWS, bounds[-1], generator=g,
                                                                               dtype=F64)
    mask = _masks((ROWS, bounds[-1]), 3, bounds)
    whole = rl_triton.gae(r, v, mask=mask, backend="triton")
    with kernels.forced_plan(block_t=4):
        got = _chunk_call("gae", (r, v), dict(mask=mask), lo, hi, group, backend="triton")
    _close(got[0], whole[0][:, lo:hi], 1e-12, "masked gae, chunks of 4")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run in the interpreter")
@pytest.mark.parametrize("world", [2, 3])
def test_triton_edge_maps_over_split_time(world):
    _spawn(_regime_worker, world)


PLANNED = (("gae", "done+bootstrap"), ("gae", "terminated+bootstrap"), ("gae", "gym"), ("gae", "plain"),
           ("td_lambda_return", "torchrl"), ("discounted_return", "done"), ("discounted_return", "gym"),
           ("eligibility_trace", "done+initial"), ("episodic_cumsum", "done"), ("affine_scan", "forward"),
           ("affine_scan", "reverse"))


def _sharded():
    from rl_triton.core import sharded

    return sharded


def _count_chunk_plan_calls():
    """``sharded.ChunkPlan.execute`` wrapped so that each call it sees appends whether the plan
    served it to the returned list; with the original, to put back."""
    sharded = _sharded()
    served, execute = [], sharded.ChunkPlan.execute

    def counted(self, *args):
        result = execute(self, *args)
        served.append(result is not None)
        return result
    sharded.ChunkPlan.execute = counted
    return served, execute


def _plan_worker(rank, world, group):
    """Repeated sharded calls of one signature on Triton run through the chunk plan
    (sharded.ChunkPlan: phase 1, the handed map, one all-gather, phase 2 folding every rank's
    maps), their values changing between calls, with and without ``out=``; a rank without steps
    takes the general path in the same collective."""
    served, execute = _count_chunk_plan_calls()
    bounds = _bounds(world, 26)
    lo, hi = bounds[rank], bounds[rank + 1]
    for fn, variant in PLANNED:
        for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
            for call in range(3):
                p = catalog.make(fn, (ROWS, bounds[-1]), variant, dtype=dtype, seed=call, p_term=0.15, gamma=0.9,
                                 lmbda=0.8).flagged_at(bounds[1:-1])
                whole = p.call("triton")
                served.clear()
                got = p.steps(lo, hi).call("triton", group=group)
                what = f"{fn} {variant} {dtype} call {call}, rank {rank}"
                assert served == ([True] if hi > lo else []), (what, served)
                for g, w in zip(_tuple(got), _tuple(whole)):
                    _close(g, w[:, lo:hi], tol, what)
    # GAE skipping masked steps: the two-state maps (7 numbers a row), whitened over every rank
    g = torch.Generator().manual_seed(11)
    for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
        for call in range(3):
            r, v = (torch.randn(ROWS, bounds[-1], generator=g, dtype=F64).to(dtype) for _ in range(2))
            mask = _masks((ROWS, bounds[-1]), call, bounds)
            boot = torch.randn(ROWS, generator=g, dtype=F64).to(dtype)
            for kw in (dict(mask=mask), dict(mask=mask, bootstrap_value=boot, whiten=True)):
                whole = rl_triton.gae(r, v, backend="triton", **kw)
                served.clear()
                got = _chunk_call("gae", (r, v), kw, lo, hi, group, backend="triton")
                what = f"masked gae {sorted(kw)} {dtype} call {call}, rank {rank}"
                assert served == ([True] if hi > lo else []), (what, served)
                for a, b in zip(got, whole):
                    _close(a, b[:, lo:hi], tol, what)
    # out= (the caller's tensors written), and a repeated call of the first signature again
    g = torch.Generator().manual_seed(7)
    r, v = torch.randn(ROWS, bounds[-1], generator=g, dtype=F64), torch.randn(ROWS, bounds[-1], generator=g,
                                                                               dtype=F64)
    d, boot = torch.rand(ROWS, bounds[-1], generator=g) < 0.2, torch.randn(ROWS, generator=g, dtype=F64)
    whole = rl_triton.gae(r, v, done=d, bootstrap_value=boot, gamma=0.9, lmbda=0.8, backend="triton")
    for _ in range(2):
        out = (torch.full((ROWS, hi - lo), torch.nan, dtype=F64), torch.full((ROWS, hi - lo), torch.nan, dtype=F64))
        served.clear()
        got = _chunk_call("gae", (r, v), dict(done=d, bootstrap_value=boot, gamma=0.9, lmbda=0.8), lo, hi, group,
                          backend="triton", out=out)
        assert served == ([True] if hi > lo else []) and got[0] is out[0] and got[1] is out[1]
        for o, w in zip(out, whole):
            _close(o, w[:, lo:hi], 1e-12, f"gae out= rank {rank}")
    _sharded().ChunkPlan.execute = execute


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run in the interpreter")
@pytest.mark.parametrize("world", [2, 3, 4])
def test_repeated_calls_run_the_chunk_plan(world):
    _spawn(_plan_worker, world)


def _pieces_plan_worker(rank, world, group):
    """Repeated calls on shards of several pieces a rank run through the chunk plan too (each
    piece's phase 1 and handed map, one all-gather, the maps put in time order, each piece's
    phase 2): Megatron's zig-zag and an uneven layout (ranks with 1 to 3 pieces), new values
    every call, with and without ``out=``, against the unsharded call."""
    served, execute = _count_chunk_plan_calls()
    uneven = [[0, 3], [5, 1, 2], [4]] if world == 3 else [[3, 0], [1, 2]]
    for layout, length in ((rl_triton.Shards.zigzag(group), 5), (rl_triton.Shards(group, uneven), 4)):
        n = layout.n
        bounds = [i * length for i in range(n + 1)]
        ranges = [(bounds[i], bounds[i + 1]) for i in layout.pieces[rank]]
        for fn, variant in PLANNED:
            for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
                for call in range(3):
                    p = catalog.make(fn, (ROWS, bounds[-1]), variant, dtype=dtype, seed=call, p_term=0.15,
                                     gamma=0.9, lmbda=0.8).flagged_at(bounds[1:-1])
                    whole = p.call("triton")
                    served.clear()
                    got = p.pieces(ranges).call("triton", group=layout)
                    what = f"{layout} {fn} {variant} {dtype} call {call}, rank {rank}"
                    assert served == [True], (what, served)
                    for g, w in zip(_tuple(got), _tuple(whole)):
                        _close(g, _steps_of(w, 1, ranges), tol, what)
        g = torch.Generator().manual_seed(3)
        r, v = (torch.randn(ROWS, bounds[-1], generator=g, dtype=F64) for _ in range(2))
        d, boot = torch.rand(ROWS, bounds[-1], generator=g) < 0.2, torch.randn(ROWS, generator=g, dtype=F64)
        whole = rl_triton.gae(r, v, done=d, bootstrap_value=boot, gamma=0.9, lmbda=0.8, backend="triton")
        mine = [_steps_of(x, 1, ranges) for x in (r, v, d)]
        for _ in range(2):
            out = tuple(torch.full_like(mine[0], torch.nan) for _ in range(2))
            served.clear()
            got = rl_triton.gae(mine[0], mine[1], done=mine[2], bootstrap_value=boot, gamma=0.9, lmbda=0.8,
                                backend="triton", group=layout, out=out)
            assert served == [True] and got[0] is out[0] and got[1] is out[1], (layout, served)
            for o, w in zip(out, whole):
                _close(o, _steps_of(w, 1, ranges), 1e-12, f"{layout} gae out= rank {rank}")
    _sharded().ChunkPlan.execute = execute


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton kernels run in the interpreter")
@pytest.mark.parametrize("world", [2, 3])
def test_repeated_calls_on_several_pieces_a_rank_run_the_chunk_plan(world):
    _spawn(_pieces_plan_worker, world)


def _tail_worker(rank, world, group):
    """The CPU's second pass reruns only the tail of the chunk that the carry reaches, where a
    zero coefficient lies in it or the coefficients' product falls below the smallest normal
    float64 (also where a subnormal times the coefficient rounds back to itself), and the whole chunk
    where neither (no done, gamma = lambda = 1), in both scan directions and for the two-state
    scan: against the unsharded call."""
    from rl_triton.core import sharded

    steps = 3 * sharded.TAIL_STEPS
    lo, hi = rank * steps, (rank + 1) * steps
    lengths = []
    one_call = sharded._one_call

    def recorded(fn, kw, chunk):
        if not chunk.check:  # the passes that run (not the argument check before the collectives)
            lengths.append(next(x for x in kw.values() if isinstance(x, torch.Tensor)).shape[-1])
        return one_call(fn, kw, chunk)
    sharded._one_call = recorded
    g = torch.Generator().manual_seed(5)
    r, v = torch.randn(ROWS, world * steps, generator=g, dtype=F64), torch.randn(ROWS, world * steps, generator=g,
                                                                                  dtype=F64)
    done = torch.rand(ROWS, world * steps, generator=g) < 0.01
    boot = torch.randn(ROWS, generator=g, dtype=F64)
    mask = torch.rand(ROWS, world * steps, generator=g) < 0.9
    cases = (("gae", (r, v), dict(done=done, bootstrap_value=boot), True),
             ("gae", (r, v), dict(bootstrap_value=boot, gamma=1.0, lmbda=1.0), False),
             ("gae", (r, v), dict(mask=mask, gamma=0.3, lmbda=0.9), True),  # 0.27**900 underflows to 0
             # 0.5005**1024 is below the smallest normal; a subnormal times 0.5005 rounds to itself
             ("gae", (r, v), dict(bootstrap_value=boot, gamma=0.5005, lmbda=1.0), True),
             ("eligibility_trace", (r,), dict(done=done, initial=boot), True),
             ("eligibility_trace", (r,), dict(initial=boot, gamma=1.0, lmbda=1.0), False))
    for backend in _backends()[:2]:
        for fn, args, kwargs, cut in cases:
            whole = _tuple(getattr(rl_triton, fn)(*args, **kwargs, backend=backend))
            lengths.clear()
            got = _tuple(_chunk_call(fn, args, kwargs, lo, hi, group, backend=backend))
            what = f"{fn} {sorted(kwargs)} on {backend}, rank {rank}"
            assert lengths == ([steps, sharded.TAIL_STEPS] if cut else [steps, sharded.TAIL_STEPS, steps]), \
                (what, lengths)
            for a, b in zip(got, whole):
                _close(a, b[:, lo:hi], 1e-12, what)
    # a done 500 steps before the end of each chunk: the tail of 256 steps misses it, the next
    # (TAIL_GROWTH times longer) holds it
    short, sharded.TAIL_STEPS = sharded.TAIL_STEPS, 256
    late = torch.zeros_like(done)
    late[:, steps - 500::steps] = True
    for backend in _backends()[:2]:
        whole = rl_triton.gae(r, v, done=late, bootstrap_value=boot, backend=backend)
        lengths.clear()
        got = _chunk_call("gae", (r, v), dict(done=late, bootstrap_value=boot), lo, hi, group, backend=backend)
        assert lengths == [steps, 256, 256 * sharded.TAIL_GROWTH], (backend, lengths)
        for a, b in zip(got, whole):
            _close(a, b[:, lo:hi], 1e-12, f"gae, a done 500 steps before the chunk's end, on {backend}")
    sharded.TAIL_STEPS = short
    sharded._one_call = one_call


@pytest.mark.parametrize("world", [2, 3])
def test_the_cpu_second_pass_reruns_the_tail_the_carry_reaches(world):
    _spawn(_tail_worker, world)


def _aliasing_worker(rank, world, group):
    """``out=`` the chunk's own input tensors (cloned slices of the window): the unsharded call's
    slice, as without aliasing (sections 11 and 17), for calls handing on V + lambda*A, calls
    with explicit next values, boundary inputs and forward scans, and on the CPU for the chunk
    whose second pass reruns only its tail."""
    g = torch.Generator().manual_seed(9)
    for steps, backends in ((3, _backends()), (3 * _tail_steps(), _backends()[:2])):
        lo, hi = rank * steps, (rank + 1) * steps
        r, v, lp, lm = (torch.randn(ROWS, world * steps, generator=g, dtype=F64) for _ in range(4))
        d = torch.rand(ROWS, world * steps, generator=g) < (0.3 if steps == 3 else 0.01)
        boot = torch.randn(ROWS, generator=g, dtype=F64)
        cases = (("gae", (r, v), dict(done=d, bootstrap_value=boot)),
                 ("gae", (r, v), dict(next_values=torch.roll(v, -1, 1), done=d)),
                 ("gae", (r, v), dict(gamma=0.9, lmbda=0.0)),  # the boundary exchange of V(s_t1)
                 ("vtrace", (r, v, lp, lm), dict(done=d, bootstrap_value=boot)),
                 ("discounted_return", (r,), dict(done=d, bootstrap_value=boot)),
                 ("eligibility_trace", (r,), dict(done=d, initial=boot)))
        for backend in backends:
            for fn, args, kwargs in cases:
                whole = _tuple(getattr(rl_triton, fn)(*args, **kwargs, backend=backend))
                mine = [x[:, lo:hi].clone() for x in args]
                out = tuple(mine[:len(whole)])
                chunk = {k: x[:, lo:hi] if isinstance(x, torch.Tensor) and x.ndim == 2 else x
                         for k, x in kwargs.items()}
                got = _tuple(getattr(rl_triton, fn)(*mine, **chunk, backend=backend, group=group,
                                                    out=out if len(out) > 1 else out[0]))
                what = f"{fn} {sorted(kwargs)} out= its inputs, {steps} steps on {backend}, rank {rank}"
                assert all(a is b for a, b in zip(got, out)), what
                for a, b in zip(got, whole):
                    _close(a, b[:, lo:hi], 1e-12, what)


def _tail_steps():
    from rl_triton.core import sharded

    return sharded.TAIL_STEPS


def test_out_aliasing_the_inputs_matches_the_unsharded_call():
    _spawn(_aliasing_worker, 2)


def _short_timeout_group():
    """A gloo group of every rank whose collectives give up after 30 s: a rank left waiting
    fails the test instead of hanging it."""
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=30))


def _argument_worker(rank, world, group):
    """Traces with a ``done`` of fewer dims than ``x`` (leading dims, time included) against the
    unsharded call; and bad arguments on every rank, one rank holding no steps: every rank raises
    the unsharded call's ValueError before its first collective, none is left waiting."""
    group = _short_timeout_group()
    bounds = [0, 3, 3, 7]
    lo, hi = bounds[rank], bounds[rank + 1]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, 3, generator=g, dtype=F64)
    done = torch.rand(2, 7, generator=g) < 0.3
    done[:, 2] = True  # on the chunk boundary
    init = torch.randn(2, 3, generator=g, dtype=F64)
    for backend in _backends():
        for fn, kw in (("eligibility_trace", dict(gamma=0.9, lmbda=0.8, initial=init)),
                       ("episodic_cumsum", dict(initial=init))):
            call = getattr(rl_triton, fn)
            whole = call(x, done=done, time_dim=1, backend=backend, **kw)
            for _ in range(2):  # the first call of the signature and a repeated one
                got = call(x[:, lo:hi], done=done[:, lo:hi], time_dim=1, backend=backend, group=group, **kw)
                _close(got, whole[:, lo:hi], 1e-12, f"{fn} done {tuple(done.shape)} on {backend}, rank {rank}")
    r = x[..., 0]
    bad = (("eligibility_trace", (x[:, lo:hi],), dict(done=done[0, lo:hi], time_dim=1), "done must cover"),
           ("gae", (r[:, lo:hi], r[:, lo:hi]), dict(gamma=1.5), "gamma"),
           ("gae", (r[:, lo:hi], r[:, lo:hi]), dict(episode_starts=done[:, lo:hi]), "last_done"),
           ("vtrace", (r[:, lo:hi],) * 4, dict(bootstrap_value=torch.zeros(3, dtype=F64)), "bootstrap_value"),
           ("discounted_return", (r[:, lo:hi],), dict(done=done[:, lo:hi], backend="tpu"), "backend"))
    for fn, args, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            getattr(rl_triton, fn)(*args, **{"backend": _backends()[0], **kw}, group=group)
    torch.distributed.barrier(group)  # every rank got here: none waits in a collective


def test_traces_take_a_done_of_fewer_dims_and_every_rank_raises_for_bad_arguments():
    _spawn(_argument_worker, 3)


def _zero_rows_worker(rank, world, group):
    """Zero rows on every rank (one rank without steps): the unsharded call's empty slices."""
    bounds = [0, 4, 4, 6][:world + 1] if world == 3 else [0, 4, 6]
    lo, hi = bounds[rank], bounds[rank + 1]
    for dtype in (F64, F32):
        z = torch.zeros(0, bounds[-1], dtype=dtype)
        none = torch.zeros(0, dtype=dtype)
        for backend in _backends():
            for fn, n, kw in (("gae", 2, {}), ("gae", 2, dict(bootstrap_value=none)),
                              ("gae", 2, dict(next_values=z)), ("gae", 2, dict(mask=z > 0)),
                              ("vtrace", 4, dict(bootstrap_value=none)), ("td_lambda_return", 2, {}),
                              ("discounted_return", 1, {}), ("retrace", 4, dict(next_expected_q=z)),
                              ("eligibility_trace", 1, {}), ("episodic_cumsum", 1, {}), ("affine_scan", 2, {})):
                call = getattr(rl_triton, fn)
                whole = _tuple(call(*[z] * n, **kw, backend=backend))
                got = _tuple(_chunk_call(fn, [z] * n, kw, lo, hi, group, backend=backend))
                what = f"{fn} {sorted(kw)} {dtype} on {backend}, rank {rank}"
                assert len(got) == len(whole), what
                for a, b in zip(got, whole):
                    assert a.shape == b[:, lo:hi].shape and a.dtype == b.dtype, (what, a.shape, a.dtype)


@pytest.mark.parametrize("world", [2, 3])
def test_zero_rows_give_the_unsharded_calls_empty_slices(world):
    _spawn(_zero_rows_worker, world)


def _limit_worker(rank, world, group):
    """GAE handing on c = V + lambda*A runs the chunk before from c/lambda (section 17): the
    unsharded call's values while |c|/lambda is finite, here values at 0.99 of lambda times the
    dtype's largest value; beyond (1.01), the carry overflows and the chunk before the boundary
    gets +-inf where the unsharded call is finite, which explicit next values avoid."""
    lam, steps = 1e-3, 4
    lo, hi = rank * steps, (rank + 1) * steps
    for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
        for backend in _backends():
            for k in (0.99, 1.01):
                v = torch.full((2, world * steps), k * lam * torch.finfo(dtype).max, dtype=dtype)
                v[1] *= -1
                r = torch.ones_like(v)
                kw = dict(gamma=0.9, lmbda=lam, backend=backend)
                whole = rl_triton.gae(r, v, **kw)
                assert all(torch.isfinite(w).all() for w in whole)
                for _ in range(2):  # the first call of the signature and a repeated one (Triton's plan)
                    got = _chunk_call("gae", (r, v), {}, lo, hi, group, **kw)
                what = f"{dtype} at {k} of the limit on {backend}, rank {rank}"
                if k < 1 or rank == world - 1:
                    for a, b in zip(got, whole):
                        _close(a, b[:, lo:hi], tol, what)
                else:
                    assert torch.isinf(got[0][:, -1]).all(), what
                nv = torch.cat([v[:, 1:], torch.zeros_like(v[:, :1])], 1)
                got = _chunk_call("gae", (r, v), dict(next_values=nv), lo, hi, group, **kw)
                for a, b in zip(got, whole):
                    _close(a, b[:, lo:hi], tol, what + ", explicit next values")


def test_handed_value_agrees_up_to_its_stated_limit():
    _spawn(_limit_worker, 2)


def _bytes_worker(rank, world, group, sent):
    import torch.distributed as dist

    counted = []
    for name in ("all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce", "broadcast",
                 "send", "recv", "isend", "irecv", "all_to_all_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            original = getattr(dist, name)

            def wrapped(*args, _name=name, _fn=original, **kwargs):
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                local = tensors[-1] if _name.startswith("all_gather") and len(tensors) > 1 else tensors[0]
                counted.append(local.numel() * local.element_size())
                return _fn(*args, **kwargs)
            setattr(dist, name, wrapped)
    for steps in (16, 4096):
        bounds = _bounds(world, steps)
        lo, hi = bounds[rank], bounds[rank + 1]
        for fn, variant, dtype in (("gae", "episode_starts", F32), ("gae", "episode_starts", F64),
                                   ("vtrace", "gym", F32), ("retrace", "expected", F32),
                                   ("eligibility_trace", "done+initial", F32)):
            p = catalog.make(fn, (ROWS, steps), variant, dtype=dtype, seed=0)
            counted.clear()
            p.steps(lo, hi).call(group=group)
            sent[f"{fn} {variant} {dtype} {steps} {rank}"] = sum(counted)
        r = torch.randn(ROWS, steps)
        counted.clear()
        _chunk_call("gae", (r, r), dict(mask=r > 0), lo, hi, group)
        sent[f"gae skip mask {steps} {rank}"] = sum(counted)


def test_bytes_per_rank_do_not_grow_with_time():
    import torch.multiprocessing as mp

    world = 2
    with mp.Manager() as manager:
        sent = manager.dict()
        spawn_gloo(_bytes_worker, world, sent)
        sent = dict(sent)
    for key, n in sent.items():
        assert 0 < n <= BYTES_PER_ROW * ROWS, (key, n)
        assert n == sent[key.replace(" 16 ", " 4096 ") if " 16 " in key else key.replace(" 4096 ", " 16 ")], key


def _validation_worker(rank, world, group):
    r = torch.randn(ROWS, 5)
    with pytest.raises(TypeError, match="group"):
        rl_triton.gae(r, r, group="world")
    with pytest.raises(ValueError, match="autograd"):
        rl_triton.gae(r.clone().requires_grad_(), r, group=group)
    with pytest.raises(ValueError, match="cu_seqlens"):  # the offsets must end at every rank's tokens
        rl_triton.gae(r[0], r[0], cu_seqlens=torch.tensor([0, 5]), group=group)


def test_bad_groups_and_unsupported_combinations_raise():
    _spawn(_validation_worker, 2)


def _groups_worker(rank, world, group):
    """group_advantages over responses spread across ranks, groups spanning ranks (a rank may hold
    none), against the call on the whole batch."""
    import torch.distributed as dist

    counts = {2: (5, 7), 3: (6, 0, 9)}[world]
    B, G = sum(counts), 5
    lo = sum(counts[:rank])
    calls = []
    original = dist.all_gather_into_tensor if not hasattr(dist, "all_gather_single") else dist.all_gather_single
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    setattr(dist, name, counting)
    for dtype, tol in ((F64, 1e-12), (F32, 1e-5)):
        g = torch.Generator().manual_seed(world)
        scores = torch.randn(B, generator=g, dtype=dtype)
        ids = torch.randint(0, G - 1, (B,), generator=g)  # id G-1 unused; groups of one and more
        ids[0], ids[-1] = 0, 3
        mask = torch.rand(B, 4, generator=g) < 0.7
        mine = slice(lo, lo + counts[rank])
        for mode in ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline"):
            whole = rl_triton.group_advantages(scores, ids, mode=mode, mask=mask)
            calls.clear()
            got = rl_triton.group_advantages(scores[mine], ids[mine], mode=mode, mask=mask[mine], group=group,
                                             num_groups=G)
            assert len(calls) == (2 if mode == "reinforce_plus_plus_baseline" else 1), (mode, calls)
            _close(got, whole[mine], tol, f"group_advantages {mode} {dtype} rank {rank}")
    # equal scores spread unevenly over the ranks: deviations of exactly 0 (and 0/0 with eps=0),
    # as in the unsplit call (sections 16.3, 16.5)
    for dtype in (F64, F32):
        equal = torch.full((B,), 0.1, dtype=dtype)
        same = torch.zeros(B, dtype=torch.int64)
        for mode in ("grpo", "drgrpo", "rloo"):
            got = rl_triton.group_advantages(equal[mine], same[mine], mode=mode, group=group, num_groups=G)
            assert torch.equal(got, torch.zeros_like(got)), (mode, dtype, got)
        got = rl_triton.group_advantages(equal[mine], same[mine], eps=0.0, group=group, num_groups=G)
        assert torch.isnan(got).all() and torch.isnan(rl_triton.group_advantages(equal, same, eps=0.0)).all()
    with pytest.raises(TypeError, match="num_groups"):
        rl_triton.group_advantages(scores[mine], ids[mine], group=group)
    with pytest.raises(TypeError, match="group_ids"):
        rl_triton.group_advantages(scores[mine], ids[mine].tolist(), group=group, num_groups=G)
    with pytest.raises(ValueError, match="num_groups"):
        rl_triton.group_advantages(scores, ids, num_groups=G)


@pytest.mark.parametrize("world", [2, 3])
def test_group_advantages_over_ranks_match_the_whole_batch(world):
    _spawn(_groups_worker, world)


def _extreme_whiten_worker(rank, world, group):
    """float32 data of order 1e20 over the ranks (squared deviations past the float32 range):
    every rank's statistics in float64 before the collective, the whitening against the float64
    oracle over the concatenated data, on every backend, contiguous and transposed shards."""
    g = torch.Generator().manual_seed(world)
    x = ((torch.rand(4 * world, 5, generator=g, dtype=F64) - 0.3) * 4e20).to(F32)
    m = torch.rand(4 * world, 5, generator=g) < 0.7
    m[0] = True
    m[1::4] = False  # a row of no valid element on every rank
    rows = slice(4 * rank, 4 * rank + 4)
    for kw in (dict(eps_mode="std"), {}, dict(unbiased=False, eps_mode="clamp"), dict(shift_mean=False)):
        want = torch.from_numpy(oracle.masked_whiten(x.double().numpy(), m.numpy(), **kw)).to(F32)[rows]
        for backend in _backends():
            # the shard contiguous, and the same values in transposed memory
            for xs, ms in ((x[rows].clone(), m[rows].clone()),
                           (x[rows].t().contiguous().t(), m[rows].t().contiguous().t())):
                got = rl_triton.masked_whiten(xs, ms, group=group, backend=backend, **kw)
                torch.testing.assert_close(got, want, rtol=2.4e-7, atol=0.0,
                                           msg=lambda text: f"{kw} on {backend}, rank {rank}: {text}")
    n, mean, m2 = rl_triton.masked_moments(x[rows], m[rows], group=group)
    n_ref, mean_ref, m2_ref = oracle.masked_moments(x.double().numpy(), m.numpy())
    assert mean.dtype == F64 and m2.dtype == F64 and int(n) == n_ref
    assert float(mean) == pytest.approx(mean_ref, rel=1e-14) and float(m2) == pytest.approx(m2_ref, rel=1e-14)
    assert float(m2) > torch.finfo(F32).max


@pytest.mark.parametrize("world", [2, 3])
def test_extreme_magnitudes_whitened_over_ranks_match_the_oracle(world):
    _spawn(_extreme_whiten_worker, world)


def _packed_worker(rank, world, group):
    """Packed sequences (global cu_seqlens) whose token stream is split across ranks, sequences
    crossing one and several chunk boundaries, empty sequences and an empty chunk: every
    estimator against the single-process packed call."""
    from test_token_level import CALLS, EXTRA, _packed_case

    lengths = [5, 0, 1, 9, 3, 0, 14, 2]
    cuts = {2: [0, 12, 34], 3: [0, 7, 7, 34], 4: [0, 3, 16, 16, 34]}[world]  # token offsets of the chunks
    lo, hi = cuts[rank], cuts[rank + 1]
    for backend in _backends():
        for name, (fn, per_step, per_row) in CALLS.items():
            cu, x = _packed_case(lengths, seed=world)
            packed_args, row_args = per_step(x), per_row(x)
            extra = {**EXTRA.get(name, {}), "backend": backend}
            whole = _tuple(fn(**packed_args, **row_args, **extra, cu_seqlens=cu))
            got = _tuple(fn(**{k: v[lo:hi] for k, v in packed_args.items()}, **row_args, **extra, cu_seqlens=cu,
                            group=group))
            for g, w in zip(got, whole):
                _close(g, w[lo:hi], 1e-12, f"packed {name} on {backend}, rank {rank}")
        cu, x = _packed_case(lengths, seed=5)
        whole = rl_triton.gae(x["r"], x["v"], mask=x["m"], whiten=True, cu_seqlens=cu, backend=backend)
        got = rl_triton.gae(x["r"][lo:hi], x["v"][lo:hi], mask=x["m"][lo:hi], whiten=True, cu_seqlens=cu,
                            backend=backend, group=group)
        _close(got[0], whole[0][lo:hi], 1e-12, f"packed whitened gae on {backend}, rank {rank}")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_sequences_across_ranks_match_the_unsharded_call(world):
    _spawn(_packed_worker, world)


def _nccl_rank(rank, world, port, worker):
    import torch.distributed as dist

    torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        worker(rank, world, dist.group.WORLD)
    finally:
        dist.destroy_process_group()


def _cuda_plan_worker(rank, world, group):
    """On CUDA with NCCL: a repeated sharded GAE call is four device operations (phase 1, the
    handed map, the all-gather, phase 2), and it replays from a CUDA graph, its collective
    included, with new values in its input tensors; GAE skipping masked tokens too is four
    (in a world of one, against the unsharded call)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    B, T = 64, 1 << 15
    g = torch.Generator(device="cuda").manual_seed(0)
    steps = T // world
    r, v = (torch.randn(steps, B, device="cuda", generator=g) for _ in range(2))
    d = torch.rand(steps, B, device="cuda", generator=g) < 0.01
    boot = torch.randn(B, device="cuda", generator=g)

    def sharded():
        return rl_triton.gae(r, v, done=d, bootstrap_value=boot, time_dim=0, group=group)

    def whole():
        parts = [torch.empty(world * steps, B, dtype=x.dtype, device="cuda") for x in (r, v, d)]
        for part, x in zip(parts, (r, v, d)):
            torch.distributed.all_gather_into_tensor(part, x, group=group)
        adv, ret = rl_triton.gae(*parts[:2], done=parts[2], bootstrap_value=boot, time_dim=0)
        return adv[rank * steps:(rank + 1) * steps], ret[rank * steps:(rank + 1) * steps]

    for _ in range(2):
        for got, want in zip(sharded(), whole()):
            _close(got.cpu(), want.cpu(), 1e-4, "sharded gae on CUDA")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        sharded()
        torch.cuda.synchronize()
    ops = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert len(ops) <= 4, ops
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sharded()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sharded()
    for seed in (1, 2):
        g.manual_seed(seed)
        r.copy_(torch.randn(steps, B, device="cuda", generator=g))
        d.copy_(torch.rand(steps, B, device="cuda", generator=g) < 0.05)
        graph.replay()
        for got, want in zip(captured, whole()):
            _close(got.cpu(), want.cpu(), 1e-4, f"graph replay {seed}")
    if world > 1:
        return
    # the other plans (a world of one: the chunk is the window), forward scans included
    x = r.t().contiguous()
    dd = d.t().contiguous()
    for fn, kw in (("eligibility_trace", dict(done=dd, initial=boot)), ("td_lambda_return", dict(done=dd)),
                   ("affine_scan", dict(reverse=False)), ("discounted_return", dict(done=dd, bootstrap_value=boot))):
        args = {"td_lambda_return": (x, x), "affine_scan": (x, torch.sigmoid(x))}.get(fn, (x,))
        for _ in range(2):
            got = getattr(rl_triton, fn)(*args, **kw, group=group)
        _close(got.cpu(), getattr(rl_triton, fn)(*args, **kw).cpu(), 1e-4, f"sharded {fn} on CUDA")
    # GAE skipping masked tokens (the two-state maps): batch-major [B, T] responses
    m = torch.rand(B, steps, device="cuda", generator=g) < 0.8
    rb, vb = r.t().contiguous(), v.t().contiguous()
    for _ in range(2):
        got = rl_triton.gae(rb, vb, mask=m, bootstrap_value=boot, group=group)
    want = rl_triton.gae(rb, vb, mask=m, bootstrap_value=boot)  # a world of one: the chunk is the window
    for a, b in zip(got, want):
        _close(a.cpu(), b.cpu(), 1e-4, "sharded masked gae on CUDA")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rl_triton.gae(rb, vb, mask=m, bootstrap_value=boot, group=group)
        torch.cuda.synchronize()
    ops = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert len(ops) <= 4, ops
    # Megatron's zig-zag (a world of one: pieces 0 and 1, the window in order): two pieces' phase
    # 1 and handed maps, the all-gather, the maps put in time order, two pieces' phase 2 (writing
    # views of whole fresh outputs)
    zig = rl_triton.Shards.zigzag(group)
    for _ in range(2):
        got = rl_triton.gae(r, v, done=d, bootstrap_value=boot, time_dim=0, group=zig)
    for a, b in zip(got, rl_triton.gae(r, v, done=d, bootstrap_value=boot, time_dim=0)):
        _close(a.cpu(), b.cpu(), 1e-4, "zig-zag gae on CUDA")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        rl_triton.gae(r, v, done=d, bootstrap_value=boot, time_dim=0, group=zig)
        torch.cuda.synchronize()
    ops = [e.name for e in prof.events() if e.device_type == DeviceType.CUDA]
    assert len(ops) <= 8, ops


@pytest.mark.skipif(not torch.cuda.is_available() or not torch.distributed.is_nccl_available(),
                    reason="needs CUDA and NCCL")
def test_a_sharded_call_on_cuda_is_four_launches_and_replays_from_a_cuda_graph():
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if torch.cuda.device_count() > 1 else 1
    mp.spawn(_nccl_rank, args=(world, _free_port(), _cuda_plan_worker), nprocs=world, join=True)


def _layouts(world, group):
    """Megatron's zig-zag (pieces of 3 steps), then a seeded random permutation of 2W + 1 pieces
    dealt unevenly to the ranks, each rank's pieces of its own random length (with a world of 4,
    one rank's pieces empty): ``(layout, piece bounds in time order, this rank's step ranges)``."""
    rank = torch.distributed.get_rank(group)
    rng = np.random.default_rng(world)
    order = rng.permutation(2 * world + 1)
    cuts = sorted(rng.choice(np.arange(1, 2 * world + 1), world - 1, replace=False).tolist())
    lengths = rng.integers(1, 5, world)
    if world == 4:
        lengths[2] = 0
    for layout, per_rank in ((rl_triton.Shards.zigzag(group), [3] * world),
                             (rl_triton.Shards(group, [p.tolist() for p in np.split(order, cuts)]), lengths)):
        holder = {i: k for k, row in enumerate(layout.pieces) for i in row}
        bounds = [0, *np.cumsum([per_rank[holder[i]] for i in range(len(holder))]).tolist()]
        yield layout, bounds, [(bounds[i], bounds[i + 1]) for i in layout.pieces[rank]]


def _pieces_worker(rank, world, group):
    """Every estimator and affine_scan on shards in any order: each rank's pieces of a window
    against the unsharded call's steps of those pieces and the oracle; the zig-zag layout as
    Megatron-LM's get_batch_on_this_cp_rank cuts it (a view into 2W pieces, index_select of k
    and 2W-1-k); masked GAE with whitening; ``out=`` the rank's inputs."""
    for i, (layout, bounds, ranges) in enumerate(_layouts(world, group)):
        _catalog_case(rank, layout, bounds, ranges, _backends() if i == 0 else _backends()[:1])
    zig = rl_triton.Shards.zigzag(group)
    x = torch.arange(2 * 4 * world * 2, dtype=F64).view(2, -1)
    megatron = x.view(2, 2 * world, -1).index_select(1, torch.tensor([rank, 2 * world - 1 - rank])).reshape(2, -1)
    assert torch.equal(zig.local(x), megatron)
    assert torch.equal(zig.local(x.t().contiguous(), time_dim=0), megatron.t())
    steps = 4 * world
    g = torch.Generator().manual_seed(world)
    r, v = (torch.randn(ROWS, steps, generator=g, dtype=F64) for _ in range(2))
    boot = torch.randn(ROWS, generator=g, dtype=F64)
    mask = _masks((ROWS, steps), world, [0, 2, 4])
    for backend in _backends():
        for mode in ("skip", "pad"):
            for kw in (dict(bootstrap_value=boot), dict(whiten=True), dict(gamma=0.9, lmbda=0.8)):
                what = f"zig-zag gae mask_mode={mode} {sorted(kw)} on {backend}, rank {rank}"
                whole = rl_triton.gae(r, v, mask=mask, mask_mode=mode, backend=backend, **kw)
                got = rl_triton.gae(zig.local(r), zig.local(v), mask=zig.local(mask), mask_mode=mode,
                                    backend=backend, group=zig, **kw)
                for gt, w in zip(got, whole):
                    _close(gt, zig.local(w), 1e-12, what)
                if "whiten" not in kw:
                    adv, _ = oracle.gae_masked(r.numpy(), v.numpy(), mask.numpy(), np.full(r.shape, kw.get("gamma", 0.99)),
                                               np.full(r.shape, kw.get("lmbda", 0.95)), mode,
                                               None if "bootstrap_value" not in kw else boot.numpy())
                    _close(got[0], zig.local(torch.from_numpy(adv)), 1e-10, what + " vs the oracle")
        done = torch.rand(ROWS, steps, generator=g) < 0.3
        for fn, args, kwargs in (("gae", (r, v), dict(done=done, bootstrap_value=boot)),
                                 ("gae", (r, v), dict(gamma=0.9, lmbda=0.0)),
                                 ("eligibility_trace", (r,), dict(done=done, initial=boot))):
            whole = _tuple(getattr(rl_triton, fn)(*args, **kwargs, backend=backend))
            mine = [zig.local(a) for a in args]
            out = tuple(mine[:len(whole)])
            local = {k: zig.local(x) if isinstance(x, torch.Tensor) and x.ndim == 2 else x for k, x in kwargs.items()}
            got = _tuple(getattr(rl_triton, fn)(*mine, **local, backend=backend, group=zig,
                                                out=out if len(out) > 1 else out[0]))
            what = f"zig-zag {fn} {sorted(kwargs)} out= its inputs on {backend}, rank {rank}"
            assert all(a is b for a, b in zip(got, out)), what
            for a, b in zip(got, whole):
                _close(a, zig.local(b), 1e-12, what)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_in_any_order_match_the_unsharded_call(world):
    _spawn(_pieces_worker, world)


def _bad_layout_worker(rank, world, group):
    """A bad layout raises the same error on every rank before any collective."""
    group = _short_timeout_group()
    r = torch.randn(ROWS, 6, dtype=F64)
    for pieces, error, match in (([[0, 1], [1, 2], [3]], ValueError, "exactly once"),
                                 ([[0, 1], [2, 3]], ValueError, "each of the group's 3 ranks"),
                                 ([[0, 1], [], [2]], ValueError, "empty"),
                                 ([[0, 1], [2.0], [3]], TypeError, "int"),
                                 ("012", TypeError, "pieces")):
        with pytest.raises(error, match=match):
            rl_triton.Shards(group, pieces)
    with pytest.raises(TypeError, match="ProcessGroup"):
        rl_triton.Shards.zigzag("world")
    zig = rl_triton.Shards.zigzag(group)
    with pytest.raises(ValueError, match="not a multiple of 2"):
        rl_triton.gae(r[:, :5], r[:, :5], group=zig)
    with pytest.raises(ValueError, match="cu_seqlens"):
        rl_triton.gae(r[0], r[0], cu_seqlens=torch.tensor([0, 18]), group=zig)
    with pytest.raises(ValueError, match="not a multiple of the 6 pieces"):
        zig.local(torch.zeros(ROWS, 7))
    torch.distributed.barrier(group)  # every rank got here: none waits in a collective


def test_every_rank_raises_for_a_bad_layout():
    _spawn(_bad_layout_worker, 3)
