"""``nstep_return`` (docs/semantics.md, section 6.10) against the float64 oracle's window sums
(rl_triton/testing/oracle.py) on every backend (numba, torch, and Triton in its interpreter):
every n from 1 past the window, every flag form, number and tensor discounts, dtypes, layouts,
``out=``, packed sequences, plans, autograd, non-finite values inside and outside a window, and
the argument errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.testing import oracle

from conftest import TRITON_INTERPRET_AT_STARTUP

BACKENDS = ["cpu", "torch"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])
FUSED = [b for b in BACKENDS if b != "torch"]
T = 23
# the flag forms nstep_return takes, each with its flags' dtype (every form a different one)
FLAG_FORMS = {
    "done": dict(done=torch.bool),
    "done+terminated": dict(done=torch.uint8, terminated=torch.uint8),
    "terminated+truncated": dict(terminated=torch.bool, truncated=torch.float32),
    "terminated": dict(terminated=torch.int32),
    "truncated": dict(truncated=torch.bool),
    "none": dict(),
    "episode_starts": dict(episode_starts=torch.float32, last_done=torch.bool),
}


def _problem(seed, dtype=torch.float64, R=3, steps=T):
    g = torch.Generator().manual_seed(seed)
    return dict(rewards=torch.randn(R, steps, generator=g, dtype=torch.float64).to(dtype),
                next_values=torch.randn(R, steps, generator=g, dtype=torch.float64).to(dtype),
                terminated=torch.rand(R, steps, generator=g) < 0.08,
                truncated=torch.rand(R, steps, generator=g) < 0.08,
                gamma=(0.5 + 0.5 * torch.rand(R, steps, generator=g, dtype=torch.float64)).to(dtype))


def _flags(p, form):
    """The keyword flags of ``form`` (FLAG_FORMS) drawn from the problem's terminations and
    truncations, and the oracle's (term, done) for them."""
    term, trunc = p["terminated"], p["truncated"]
    done = term | trunc
    none = torch.zeros_like(term)
    given = {"done": done, "terminated": term, "truncated": trunc}
    if form == "episode_starts":
        starts = torch.cat([torch.zeros_like(done[:, :1]), done[:, :-1]], 1)
        kw = dict(episode_starts=starts.float(), last_done=done[:, -1])
        return kw, done, done
    kw = {name: given[name].to(dtype) for name, dtype in FLAG_FORMS[form].items()}
    if "done" in kw:
        return kw, term if "terminated" in kw else done, done
    t = term if "terminated" in kw else none
    return kw, t, t | (trunc if "truncated" in kw else none)


def _expected(p, n, term, done, gamma, dtype=torch.float64):
    """The oracle's returns, a number ``gamma`` applied as the kernels apply it (float32 but
    for float64 data)."""
    if not isinstance(gamma, torch.Tensor):
        gamma = gamma if dtype == torch.float64 else float(np.float32(gamma))
    g = np.broadcast_to(gamma.double().numpy() if isinstance(gamma, torch.Tensor) else gamma, p["rewards"].shape)
    return oracle.nstep_return(p["rewards"].double().numpy(), p["next_values"].double().numpy(), term.numpy(),
                               done.numpy(), g, n)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("flags", [("done",), ("terminated", "truncated")])
@pytest.mark.parametrize("n", [1, 2, 5, T, T + 3])
def test_matches_the_oracle(n, flags, dtype, tol, backend):
    p = _problem(n, dtype)
    kw, term, done = _flags(p, "+".join(flags))
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, **kw, gamma=0.9, backend=backend)
    assert got.dtype == dtype
    np.testing.assert_allclose(got.double().numpy(), _expected(p, n, term, done, 0.9, dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", list(FLAG_FORMS))
@pytest.mark.parametrize("n", [1, 5, T + 1])
def test_every_flag_form(form, n, backend):
    p = _problem(100 + n)
    kw, term, done = _flags(p, form)
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, **kw, gamma=0.95, backend=backend)
    np.testing.assert_allclose(got.numpy(), _expected(p, n, term, done, 0.95), rtol=1e-12, atol=1e-12)


@pytest.fixture
def blocks_from(monkeypatch):
    """``blocks_from(m)``: numba's O(T) form (``cpu.nstep_return_blocks``) for every n > m, the
    call plans made before and after forgotten (a plan keeps the kernel its first call chose)."""
    from rl_triton.core import cpu, plans

    def set_threshold(m):
        plans.clear()
        monkeypatch.setattr(cpu, "NSTEP_DIRECT_MAX", m)

    yield set_threshold
    plans.clear()


@pytest.mark.parametrize("form", ["terminated+truncated", "done", "episode_starts", "none"])
@pytest.mark.parametrize("n", [2, 3, 5, 8, 17, 40, 61, 100])
def test_the_blocks_form_matches_the_oracle(n, form, blocks_from):
    """numba's O(T) form, blocks of n steps (a window crossing into the next block, ending at
    a termination, a truncation or its n-th step there, or at the rollout's end), against the
    oracle; per-step gamma, float64 and float32 data."""
    blocks_from(1)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        p = _problem(200 + n, dtype, R=4, steps=61)
        kw, term, done = _flags(p, form)
        got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, **kw, gamma=p["gamma"], backend="cpu")
        np.testing.assert_allclose(got.double().numpy(), _expected(p, n, term, done, p["gamma"], dtype), rtol=tol,
                                   atol=tol)


@pytest.mark.parametrize("blocks", [False, True])
def test_many_rows(blocks, blocks_from):
    """Rows past numba's first block of rows (cpu.NSTEP_ROWS share buffers), in both forms."""
    from rl_triton.core import cpu

    blocks_from(1 if blocks else 1000)
    p = _problem(210, R=2 * cpu.NSTEP_ROWS + 3, steps=9)
    kw, term, done = _flags(p, "terminated+truncated")
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=4, **kw, gamma=p["gamma"], backend="cpu")
    np.testing.assert_allclose(got.numpy(), _expected(p, 4, term, done, p["gamma"]), rtol=1e-12, atol=1e-12)


@pytest.fixture
def triton_tiles(monkeypatch):
    """``triton_tiles(kernel)``: Triton's n-step tiles forced small, so that a rollout of tens of
    steps spans several programs: ``"blocks"`` (tiles of 8 steps, or the least of 2K - 1 steps),
    ``"aligned"`` (tiles of 64 steps overlapping by 16, a rollout of a few hundred) or ``"walk"``
    (the walk for every n); the call plans before and after forgotten."""
    if not TRITON_INTERPRET_AT_STARTUP:
        pytest.skip("the Triton kernels run in the interpreter (TRITON_INTERPRET=1) here")
    from rl_triton.core import plans
    from rl_triton.core.kernels import nstep

    def force(kernel):
        plans.clear()
        monkeypatch.setattr(nstep, "BLOCK_STEPS", 64 if kernel == "aligned" else 8)
        monkeypatch.setattr(nstep, "BLOCKS_TILE", 64 if kernel == "aligned" else 16)
        monkeypatch.setattr(nstep, "TILE", 32)
        monkeypatch.setattr(nstep, "MAX_BLOCK", 0 if kernel == "walk" else nstep.MAX_BLOCK)

    yield force
    plans.clear()


@pytest.mark.parametrize("kernel,n", [(k, n) for k in ("blocks", "walk") for n in (1, 3, 9, 61)]
                         + [("aligned", 3), ("aligned", 17)])
@pytest.mark.parametrize("form", ["terminated+truncated", "done+terminated", "episode_starts", "none"])
def test_triton_tiles_across_programs(n, form, kernel, triton_tiles):
    """Triton's two kernels with tiles forced small (several programs along time and rows, a
    window crossing into the next program's steps): batch-major with per-step gamma and
    time-major with a number, float64 and float32, against the oracle."""
    triton_tiles(kernel)
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        p = _problem(300 + n, dtype, R=2, steps=200) if kernel == "aligned" else _problem(300 + n, dtype, R=5, steps=61)
        kw, term, done = _flags(p, form)
        got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, **kw, gamma=p["gamma"], backend="triton")
        np.testing.assert_allclose(got.double().numpy(), _expected(p, n, term, done, p["gamma"], dtype), rtol=tol,
                                   atol=tol)
        got = rl_triton.nstep_return(p["rewards"].t().contiguous(), p["next_values"].t().contiguous(), n=n,
                                     **{k: v.t().contiguous() for k, v in kw.items()}, gamma=0.9, time_dim=0,
                                     backend="triton")
        np.testing.assert_allclose(got.t().double().numpy(), _expected(p, n, term, done, 0.9, dtype), rtol=tol,
                                   atol=tol)


@pytest.mark.parametrize("kernel", ["blocks", "walk"])
def test_triton_tiles_read_only_their_windows(kernel, triton_tiles, monkeypatch):
    """NaN and inf outside a window stay out of the returns with tiles forced small; a NaN
    inside a window reaches it."""
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    triton_tiles(kernel)
    p = _problem(310, R=2, steps=40)
    term = torch.zeros(2, 40, dtype=torch.bool)
    term[:, 20] = True
    p["rewards"][:, 21] = float("nan")  # after the termination: no window before it reads it
    p["next_values"][:, 20] = float("nan")  # the terminated step's: never read
    p["next_values"][:, 33] = float("inf")  # read by the window ending there (n = 4: from step 30)
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=4, terminated=term, gamma=0.9, backend="triton")
    expected = _expected(p, 4, term, term, 0.9)
    assert np.isfinite(expected[:, :21]).all() and np.isnan(expected[:, 18:22]).sum() == 2
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_the_blocks_form_reads_only_its_windows(blocks_from, monkeypatch):
    """NaN and inf outside a window stay out of the O(T) form's returns too."""
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    blocks_from(1)
    p = _problem(32, steps=40)
    p["rewards"][:, 21] = float("nan")
    p["next_values"][:, 9] = float("inf")
    gamma = torch.full((3, 40), 0.9, dtype=torch.float64)
    term = torch.zeros(3, 40, dtype=torch.bool)
    term[:, 30] = True
    gamma[:, 30] = float("nan")
    for n in (4, 7, 12):
        got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, terminated=term, gamma=gamma, backend="cpu")
        expected = _expected(p, n, term, term, gamma)
        # from step 22 on no window holds step 21 or ends at step 9; those up to 30 end at the
        # termination, whose discount they do not read
        assert np.isfinite(expected[:, 22:]).all() and np.isnan(expected[:, 21]).all()
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("shape", ["step", "row", "0-d"])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_tensor_discounts(n, shape, dtype, tol, backend):
    p = _problem(10 + n, dtype)
    gamma = {"step": p["gamma"], "row": p["gamma"][:, :1], "0-d": p["gamma"][0, 0].clone()}[shape]
    kw, term, done = _flags(p, "terminated+truncated")
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=n, **kw, gamma=gamma, backend=backend)
    expected = _expected(p, n, term, done, gamma if shape != "0-d" else float(gamma), dtype)
    np.testing.assert_allclose(got.double().numpy(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("n", [2, T])
def test_time_major(n, dtype, tol, backend):
    """``[T, N]`` rollouts with ``time_dim=0``: contiguous time-major tensors and per-step gamma."""
    p = _problem(60 + n, dtype, R=5)
    kw, term, done = _flags(p, "done+terminated")
    got = rl_triton.nstep_return(p["rewards"].t().contiguous(), p["next_values"].t().contiguous(), n=n,
                                 **{k: v.t().contiguous() for k, v in kw.items()}, gamma=p["gamma"].t().contiguous(),
                                 time_dim=0, backend=backend)
    assert got.shape == (T, 5)
    np.testing.assert_allclose(got.t().double().numpy(), _expected(p, n, term, done, p["gamma"], dtype), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_dims_strides_and_broadcasts(backend):
    """``[B1, B2, T]`` rewards read through a step-2 view, next values broadcast over the rows
    (``[T]``), transposed-memory flags and a per-row ``[B1, B2, 1]`` gamma."""
    p = _problem(75, R=6)
    wide = torch.zeros(6, 2 * T, dtype=torch.float64)
    wide[:, ::2] = p["rewards"]
    rewards = wide.view(2, 3, 2 * T)[..., ::2]
    nv = p["next_values"][0]
    term = p["terminated"].t().contiguous().t().reshape(2, 3, T)
    gamma = p["gamma"][:, :1].reshape(2, 3, 1)
    got = rl_triton.nstep_return(rewards, nv, n=4, terminated=term, gamma=gamma, backend=backend)
    assert got.shape == (2, 3, T)
    q = dict(p, next_values=nv.expand(6, T))
    np.testing.assert_allclose(got.reshape(6, T).numpy(), _expected(q, 4, p["terminated"], p["terminated"],
                                                                   p["gamma"][:, :1]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, backend):
    """float16/bfloat16 data accumulate in float32 (numba: float64) and come back in their dtype."""
    p = _problem(70, dtype)
    kw, term, done = _flags(p, "terminated+truncated")
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=4, **kw, gamma=0.9, backend=backend)
    assert got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3
    np.testing.assert_allclose(got.double().numpy(), _expected(p, 4, term, done, 0.9, dtype), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_observation_aligned_flags_and_time_major_out(backend):
    p = _problem(20)
    done = p["terminated"]
    starts = torch.cat([torch.zeros(3, 1, dtype=torch.bool), done[:, :-1]], 1)
    out = torch.empty(T, 3, dtype=torch.float64)
    got = rl_triton.nstep_return(p["rewards"].t().contiguous(), p["next_values"].t().contiguous(), n=4,
                                 episode_starts=starts.t().contiguous(), last_done=done[:, -1], gamma=0.95,
                                 time_dim=0, out=out, backend=backend)
    assert got is out
    np.testing.assert_allclose(got.t().numpy(), _expected(p, 4, done, done, 0.95), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("into", ["fresh", "rewards", "next_values", "strided"])
def test_out(into, backend):
    """``out=`` a fresh tensor, an input (the windows still read the inputs as given), or a
    strided view of a float32 buffer's column pairs for float32 data."""
    dtype = torch.float32 if into == "strided" else torch.float64
    p = _problem(80, dtype)
    kw, term, done = _flags(p, "done")
    expected = _expected(p, 6, term, done, 0.9, dtype)
    if into == "strided":
        out = torch.zeros(3, 2 * T, dtype=dtype)[:, ::2]
    else:
        out = torch.empty_like(p["rewards"]) if into == "fresh" else p[into]
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=6, **kw, gamma=0.9, out=out, backend=backend)
    assert got is out
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    np.testing.assert_allclose(out.double().numpy(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_calls_read_their_own_data(backend):
    """A signature's later calls (its plan) compute from their own tensors and numbers."""
    for seed, gamma in ((90, 0.9), (91, 0.9), (92, 0.8)):
        p = _problem(seed, torch.float32)
        kw, term, done = _flags(p, "terminated+truncated")
        got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=3, **kw, gamma=gamma, backend=backend)
        np.testing.assert_allclose(got.double().numpy(), _expected(p, 3, term, done, gamma, torch.float32),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_window_reads_nothing_beyond_itself(backend):
    """A NaN reward or value outside every window of a step leaves that step's return finite;
    inside a window it reaches the return."""
    p = _problem(30)
    p["rewards"][:, 15] = float("nan")
    p["next_values"][:, 15] = float("inf")
    no_done = torch.zeros(3, T, dtype=torch.bool)
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=3, done=no_done, backend=backend)
    assert torch.isfinite(got[:, :13]).all() and torch.isfinite(got[:, 16:]).all()
    assert got[:, 13:16].isnan().all()
    np.testing.assert_allclose(got.numpy(), _expected(p, 3, no_done, no_done, 0.99), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_termination_reads_no_value_or_discount(backend, monkeypatch):
    """A terminated step's next value and discount are not read (NaN there stays out); a NaN
    discount inside a window reaches the return (value checks off: they reject a NaN discount)."""
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    p = _problem(31)
    term = torch.zeros(3, T, dtype=torch.bool)
    term[:, 10] = True
    p["next_values"][:, 10] = float("nan")
    gamma = torch.full((3, T), 0.9, dtype=torch.float64)
    gamma[:, 10] = float("nan")
    gamma[0, 4] = float("nan")
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=5, terminated=term, gamma=gamma, backend=backend)
    expected = _expected(p, 5, term, term, gamma)
    assert np.isfinite(expected[1:]).all() and np.isnan(expected[0, 1:5]).all()
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_zero_discount_does_not_cut_a_window(backend, monkeypatch):
    """gamma = 0 inside a window is a discount, not an episode's end: the terms after it are
    multiplied by 0, so a NaN or inf there still gives NaN, as in the oracle's sums."""
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    p = _problem(32)
    gamma = torch.full((3, T), 0.9, dtype=torch.float64)
    gamma[:, 6] = 0.0
    p["rewards"][:, 8] = float("nan")
    p["next_values"][:, 12] = float("inf")
    no_done = torch.zeros(3, T, dtype=torch.bool)
    got = rl_triton.nstep_return(p["rewards"], p["next_values"], n=4, done=no_done, gamma=gamma, backend=backend)
    expected = _expected(p, 4, no_done, no_done, gamma)
    assert np.isnan(expected[:, 5:9]).all() and np.isfinite(expected[:, 13:]).all()
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", [1, 3, 40])
def test_packed_sequences(n, backend):
    """``cu_seqlens``: each sequence its own row, its last token the rollout's end."""
    lengths = [5, 1, 17, 4]
    p = _problem(40 + n, R=1, steps=sum(lengths))
    tokens = {k: v[0] for k, v in p.items()}
    cu = torch.tensor(np.cumsum([0] + lengths), dtype=torch.int32)
    got = rl_triton.nstep_return(tokens["rewards"], tokens["next_values"], n=n, terminated=tokens["terminated"],
                                 truncated=tokens["truncated"], gamma=tokens["gamma"], cu_seqlens=cu, backend=backend)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        seq = {k: v[None, a:b] for k, v in tokens.items()}
        term, trunc = seq["terminated"], seq["truncated"]
        np.testing.assert_allclose(got[a:b].numpy(), _expected(seq, n, term, term | trunc, seq["gamma"])[0],
                                   rtol=1e-12, atol=1e-12)


def test_group_is_not_supported():
    p = _problem(41)
    with pytest.raises(NotImplementedError, match="group="):
        rl_triton.nstep_return(p["rewards"], p["next_values"], n=3, group=object())


def test_gradients():
    p = _problem(40, R=2)
    r, v = p["rewards"][:, :9].clone().requires_grad_(), p["next_values"][:, :9].clone().requires_grad_()
    done = p["terminated"][:, :9]
    assert torch.autograd.gradcheck(lambda r, v: rl_triton.nstep_return(r, v, n=3, done=done, gamma=0.9), (r, v))


@pytest.mark.parametrize("backend", FUSED)
def test_a_call_needing_gradients_takes_the_composed_path(backend):
    """Gradients come from the torch ops whatever the backend; the values are the fused ones'."""
    p = _problem(42)
    r = p["rewards"].clone().requires_grad_()
    kw, _, _ = _flags(p, "done")
    got = rl_triton.nstep_return(r, p["next_values"], n=4, **kw, gamma=p["gamma"], backend=backend)
    assert got.grad_fn is not None
    fused = rl_triton.nstep_return(p["rewards"], p["next_values"], n=4, **kw, gamma=p["gamma"], backend=backend)
    torch.testing.assert_close(got.detach(), fused, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    assert torch.isfinite(r.grad).all()


def test_torch_compile_fullgraph():
    """Inside a torch.compile trace the fused call runs as the library's custom op."""
    p = _problem(43, torch.float32)
    kw, term, done = _flags(p, "terminated+truncated")

    def f(r, nv, terminated, truncated):
        return rl_triton.nstep_return(r, nv, n=3, terminated=terminated, truncated=truncated, gamma=0.9,
                                      backend="cpu")

    got = torch.compile(f, fullgraph=True)(p["rewards"], p["next_values"], kw["terminated"], kw["truncated"])
    np.testing.assert_allclose(got.double().numpy(), _expected(p, 3, term, done, 0.9, torch.float32), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("n,error,message", [(0, ValueError, "n must be >= 1"), (1.5, TypeError, "n must be an int"),
                                             (True, TypeError, "n must be an int")])
def test_bad_n(n, error, message):
    p = _problem(50)
    with pytest.raises(error, match=message):
        rl_triton.nstep_return(p["rewards"], p["next_values"], n=n)


def test_next_values_must_broadcast_to_the_rewards():
    p = _problem(51)
    with pytest.raises(ValueError, match="next_values has shape"):
        rl_triton.nstep_return(p["rewards"], p["next_values"][:, :5], n=2)


@pytest.mark.parametrize("form", ["episode_starts", "terminated"])
def test_the_direct_launch_passes_the_dispatched_arguments(form, monkeypatch):
    """The Triton launch from data pointers (call plans on the GPU) hands the compiled kernel the
    arguments the first launch gave Triton's dispatch, a tensor's data pointer in its place, then
    the constexprs in the kernel's order; here with stand-ins for Triton's launches (no GPU)."""
    pytest.importorskip("triton")
    from rl_triton.core import spec
    from rl_triton.core.kernels import nstep

    dispatched, direct = [], []

    class Kernel:
        arg_names = nstep.nstep_blocks_kernel.arg_names

        def __getitem__(self, grid):
            return lambda *args, **kwargs: dispatched.append((grid, args, kwargs)) or "compiled"

    assert nstep.nstep_walk_kernel.arg_names == Kernel.arg_names  # one argument list, either kernel
    monkeypatch.setattr(nstep, "nstep_blocks_kernel", Kernel())
    monkeypatch.setattr(nstep, "launchable", lambda kernel: kernel == "compiled")
    monkeypatch.setattr(nstep, "direct_launch_ok", lambda device: True)
    monkeypatch.setattr(nstep, "current_stream", lambda device: "stream")
    monkeypatch.setattr(nstep, "launch_compiled", lambda kernel, g0, g1, stream, *args: direct.append(
        (kernel, (g0, g1), stream, args)))
    p = _problem(44, torch.float32)
    kw, _, _ = _flags(p, form)
    # the kernel's flag group: observation-aligned flags hold the episode starts in the done slot
    args = spec.NSTEP_RETURN.bind(rewards=p["rewards"], next_values=p["next_values"], gamma=p["gamma"], n=4,
                                  terminated=kw.get("terminated"), truncated=kw.get("truncated"),
                                  done=kw.get("episode_starts"), last_done=kw.get("last_done"))
    out = torch.empty_like(p["rewards"])
    launch = nstep.Launch(spec.NSTEP_RETURN, args, [out])
    launch.launch(args, [out])
    launch.launch(args, [out])
    assert len(dispatched) == 1 and len(direct) == 1
    grid, given, constexprs = dispatched[0]
    kernel, direct_grid, stream, passed = direct[0]
    assert (kernel, direct_grid, stream) == ("compiled", grid, "stream")
    names = Kernel.arg_names
    assert len(given) + len(constexprs) - 1 == len(names) and constexprs["num_warps"] == nstep.NUM_WARPS
    assert names[len(given):] == list(nstep._CONSTEXPRS)
    expected = [x.data_ptr() if isinstance(x, torch.Tensor) else x for x in given]
    assert list(passed) == expected + [constexprs[name] for name in names[len(given):]]
