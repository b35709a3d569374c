"""Aliasing, unsafe outputs, empty windows with autograd, argument forms and concurrent CPU
calls: each case once failed (docs/semantics.md, "Non-finite values and aliasing" and section 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import rl_triton as rt

N, T = 3, 9


def _data(seed, *shape, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*(shape or (N, T)), generator=g, dtype=torch.float64).to(dtype)


def _done(seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(N, T, generator=g) < 0.25


# name -> (number of positional float inputs, number of outputs)
CALLS = {
    "gae": (2, 2),
    "td_lambda_return": (2, 1),
    "discounted_return": (1, 1),
    "vtrace": (4, 2),
    "retrace": (4, 1),
    "eligibility_trace": (1, 1),
    "episodic_cumsum": (1, 1),
}


def _inputs(name):
    args = [_data(i) for i in range(CALLS[name][0])]
    kwargs = {"done": _done()}
    if name in ("vtrace", "retrace"):
        args[2], args[3] = 0.3 * args[2], 0.3 * args[3]
    if name == "retrace":
        kwargs["next_expected_q"] = _data(9)
    return args, kwargs


@pytest.mark.parametrize("name", list(CALLS))
def test_out_aliasing_an_input_gives_the_unaliased_result(name, backend):
    """out= may be any input's memory: the result equals the call without out=, on every backend."""
    args, kwargs = _inputs(name)
    n_out = CALLS[name][1]
    want = getattr(rt, name)(*args, **kwargs, backend=backend)
    want = want if isinstance(want, tuple) else (want,)
    floats = [a for a in args] + [v for v in kwargs.values() if v.is_floating_point()]
    for victim in range(len(floats)):
        a2 = [a.clone() for a in args]
        k2 = {k: v.clone() for k, v in kwargs.items()}
        inputs_now = a2 + [v for v in k2.values() if v.is_floating_point()]
        out = [inputs_now[victim]] + [torch.empty_like(a2[0]) for _ in range(n_out - 1)]
        got = getattr(rt, name)(*a2, **k2, backend=backend, out=tuple(out) if n_out > 1 else out[0])
        got = got if isinstance(got, tuple) else (got,)
        for g_, w in zip(got, want):
            torch.testing.assert_close(g_, w, rtol=1e-12, atol=1e-12)


def test_outputs_sharing_memory_are_rejected(cpu_backend):
    r, v = _data(0), _data(1)
    both = torch.empty_like(r)
    with pytest.raises(ValueError, match="share memory"):
        rt.gae(r, v, out=(both, both[:]), backend=cpu_backend)


@pytest.mark.parametrize("kind", ["expanded", "requires_grad"])
def test_unsafe_out_is_rejected(kind, backend):
    r, v = _data(0), _data(1)
    if kind == "expanded":
        out = torch.empty(T, dtype=r.dtype).expand(N, T)
        match = "share memory"
    else:
        out = torch.zeros(N, T, dtype=r.dtype, requires_grad=True)
        match = "requires grad"
    with pytest.raises(ValueError, match=match):
        rt.td_lambda_return(r, v, out=out, backend=backend)
    with pytest.raises(ValueError, match=match):
        rt.affine_scan(r, v, out=out, backend=backend)


def test_done_must_cover_the_time_dim():
    with pytest.raises(ValueError, match="done must cover"):
        rt.episodic_cumsum(torch.ones(2, 5, 2), done=torch.tensor([True, False]), time_dim=1)


@pytest.mark.parametrize("name", list(CALLS) + ["affine_scan"])
def test_empty_window_keeps_the_graph(name, cpu_backend):
    """T = 0 with inputs that require grad: outputs have a grad_fn and backward() runs."""
    n_pos = CALLS[name][0] if name in CALLS else 2
    args = [torch.zeros(2, 0, dtype=torch.float64, requires_grad=(i == n_pos - 1)) for i in range(n_pos)]
    kwargs = {"next_expected_q": torch.zeros(2, 0, dtype=torch.float64)} if name == "retrace" else {}
    out = getattr(rt, name)(*args, **kwargs, backend=cpu_backend)
    out = out if isinstance(out, tuple) else (out,)
    assert all(o.shape == (2, 0) and o.grad_fn is not None for o in out)
    sum(o.sum() for o in out).backward()
    assert args[-1].grad is not None and args[-1].grad.shape == (2, 0)


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64])
def test_unsigned_flags(dtype, backend):
    r, v, done = _data(0), _data(1), _done()
    want = rt.gae(r, v, done=done, backend=backend)
    got = rt.gae(r, v, done=done.to(dtype), backend=backend)
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, rtol=0, atol=0)


def test_numpy_integer_time_dim():
    r, v = _data(0), _data(1)
    for td in (np.int64(0), np.int32(-2)):
        got = rt.gae(r.t(), v.t(), time_dim=td)[0]
        torch.testing.assert_close(got.t(), rt.gae(r, v)[0])


def test_backend_of_the_wrong_type():
    r, v = _data(0), _data(1)
    with pytest.raises(TypeError, match="backend must be a string"):
        rt.gae(r, v, backend=["cpu"])


@pytest.mark.parametrize("which", ["rewards", "values", "done", "out"])
def test_sparse_tensors_are_rejected(which):
    r, v, done = _data(0), _data(1), _done()
    kw = {"rewards": r, "values": v, "done": done}
    if which == "out":
        kw["out"] = (torch.zeros(N, T, dtype=r.dtype).to_sparse(), torch.empty_like(r))
    else:
        kw[which] = kw[which].to_sparse()
    with pytest.raises(TypeError, match="dense"):
        rt.gae(kw.pop("rewards"), kw.pop("values"), **kw)


_CONCURRENT = textwrap.dedent("""
    import threading, torch, rl_triton as rt
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(16, 4096, generator=g), torch.randn(16, 4096, generator=g)
    d = torch.rand(16, 4096, generator=g) < 0.01
    want = rt.gae(r, v, done=d, backend="cpu")
    bad = []
    def work():
        for _ in range(20):
            got = rt.gae(r, v, done=d, backend="cpu")
            bad.extend(i for i in range(2) if not torch.equal(got[i], want[i]))
    threads = [threading.Thread(target=work) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    print("mismatches", len(bad))
""")


@pytest.mark.parametrize("layer", ["workqueue", "default"])
def test_concurrent_cpu_calls(layer):
    """8 Python threads calling the numba backend at once (parallel kernels): no abort, and the
    serial results bit for bit, under numba's workqueue threading layer too."""
    pytest.importorskip("numba")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if layer != "default":
        env["NUMBA_THREADING_LAYER"] = layer
    done = subprocess.run([sys.executable, "-c", _CONCURRENT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("mismatches 0"), done.stdout


def test_cuda_tensors_without_triton_name_the_install(monkeypatch):
    """Where triton is missing, CUDA tensors get an error naming what to install, not a silent
    fall-back to the per-step loop."""
    pytest.importorskip("triton")
    from rl_triton.core import kernels, launch

    monkeypatch.setattr(kernels, "AVAILABLE", False)
    for backend in ("auto", "triton"):
        with pytest.raises(ValueError, match=r"\.\[gpu\]"):
            launch._resolve(backend, torch.device("cuda"))
    assert launch._resolve("torch", torch.device("cuda")) == "torch"


def test_affine_scan_takes_a_number_beta(backend):
    alpha = _data(0)
    want = rt.affine_scan(alpha, torch.full_like(alpha, 0.5), backend=backend)
    for beta in (0.5, torch.tensor(0.5, dtype=alpha.dtype)):
        torch.testing.assert_close(rt.affine_scan(alpha, beta, backend=backend), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="beta must be a number or a torch.Tensor"):
        rt.affine_scan(alpha, "0.5", backend=backend)


def test_interpreter_switched_on_after_import_is_explained():
    """TRITON_INTERPRET=1 set after triton was imported: a message that says to set it first.
    (``import rl_triton`` alone does not import triton: setting it after that works.)"""
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import os, torch, triton, rl_triton as rt
        os.environ["TRITON_INTERPRET"] = "1"
        x = torch.zeros(2, 3)
        try:
            rt.gae(x, x, backend="triton")
        except Exception as e:
            print(type(e).__name__, e)
    """)
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "before the first import" in done.stdout, done.stdout + done.stderr


def test_cpu_tensors_on_triton_without_triton_say_what_runs_them(monkeypatch):
    from rl_triton.core import kernels, launch

    monkeypatch.setattr(kernels, "AVAILABLE", False)
    with pytest.raises(ValueError, match=r"\.\[gpu\]'\) and CUDA tensors, or TRITON_INTERPRET=1.*got tensors on cpu"):
        launch._resolve("triton", torch.device("cpu"))


@pytest.mark.parametrize("flags", [dict(done=True), dict(terminated=True), dict(done=True, last_done=True)])
def test_mixed_flag_conventions_are_reported_first(flags):
    """episode_starts with done= (and without last_done): the mix of the two conventions is the
    mistake, not the missing last_done."""
    x = _data(0)
    args = {k: (_done() if k != "last_done" else torch.zeros(N, dtype=torch.bool)) for k in flags}
    with pytest.raises(ValueError, match="not both; got .*episode_starts"):
        rt.gae(x, x, episode_starts=_done(), **args)


_IMPORT = textwrap.dedent("""
    import sys, torch
    before = set(sys.modules)
    import rl_triton
    heavy = sorted(m for m in set(sys.modules) - before
                   if m.split(".")[0] in ("numba", "triton", "sympy") or m.startswith("torch._dynamo"))
    print("heavy", heavy)
    from rl_triton.core import cpu
    x = torch.randn(3, 5, dtype=torch.float64)
    rl_triton.gae(x, x, backend="cpu")  # the first CPU launch imports numba
    print("numba loaded", "numba" in sys.modules, cpu.AVAILABLE)
""")


def test_import_leaves_dynamo_numba_and_triton_alone():
    """``import rl_triton`` adds little to ``import torch`` (benchmarks/import_time.py measures
    it): torch._dynamo, numba and triton are imported where first needed, not with the package."""
    pytest.importorskip("numba")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _IMPORT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "heavy []" in done.stdout, done.stdout
    assert "numba loaded True True" in done.stdout, done.stdout


def test_environment_switches_reach_plans_and_compiled_code(monkeypatch):
    """RL_TRITON_BACKEND / RL_TRITON_CHECK_VALUES are read on every call (a call plan's key) and
    traced by torch.compile(fullgraph=True) without a graph break, masked GAE included."""
    monkeypatch.setenv("RL_TRITON_CHECK_VALUES", "0")
    r, v = _data(1), _data(2)
    m = _done(3)

    def step(r, v, m):
        a, t = rt.gae(r, v, mask=m, gamma=1.0, lmbda=0.95)
        b, u = rt.gae(r, v, gamma=0.99, lmbda=0.95)
        return a, t, b, u

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    want = step(r, v, m)
    for x, y in zip(compiled(r, v, m), want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("RL_TRITON_BACKEND", "torch")
    for x, y in zip(compiled(r, v, m), want):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("RL_TRITON_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="backend must be one of"):
        rt.gae(r, v)
