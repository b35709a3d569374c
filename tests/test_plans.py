"""Call plans (rl_triton/core/plans.py): a repeated call of one signature runs the plan its first
call left, and gives what the full path gives, against the float64 oracle; whatever the key
does not hold is still checked on every call."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import rl_triton
from rl_triton.core import kernels, plans
from rl_triton.testing import make
from rl_triton.testing.catalog import VARIANTS

from conftest import TRITON_INTERPRET_AT_STARTUP

BACKENDS = ["cpu"] + (["triton"] if TRITON_INTERPRET_AT_STARTUP else [])
CASES = [(fn, variant) for fn, variants in VARIANTS.items() if fn != "affine_scan" for variant in variants]


def _plans():
    return [p for p in plans._plans.values() if p is not plans._NO_PLAN]


def _check(problem, got, tol=1e-5):
    for g, w in zip(got, problem.expected()):
        np.testing.assert_allclose(g.double().numpy(), w, rtol=tol, atol=tol)


@pytest.fixture
def executions(monkeypatch):
    """How calls ran through a plan: "execute" (the first call of a signature included) or "hit"
    (the generated function)."""
    runs = []
    execute, generate = plans.Plan.execute, plans.Plan._generate

    def counted_generate(self):
        hit = generate(self)
        return None if hit is None else (lambda args, kwargs: runs.append("hit") or hit(args, kwargs))

    monkeypatch.setattr(plans.Plan, "execute", lambda self, values: runs.append("execute") or execute(self, values))
    monkeypatch.setattr(plans.Plan, "_generate", counted_generate)
    return runs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn,variant", CASES)
def test_repeated_calls_run_the_plan(fn, variant, backend, executions):
    """Calls of one signature with new values: the first leaves a plan, the next run it; every
    result matches the oracle."""
    shape = (5, 12) if backend == "triton" else (7, 33)
    for seed in range(3):
        p = make(fn, shape, variant, seed=seed)
        _check(p, p.call(backend))
    # numba: the generated function from the second call on; the interpreter runs execute
    assert len(_plans()) == 1
    assert executions == (["execute", "hit", "hit"] if backend == "cpu" else ["execute"] * 3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fn", ["gae", "vtrace", "discounted_return", "eligibility_trace"])
def test_repeated_calls_with_out(fn, backend, executions):
    for seed in range(3):
        p = make(fn, (4, 9), seed=seed)
        outs = tuple(torch.full(p.shape, float("nan")) for _ in range(p.n_out))
        got = p.call(backend, out=outs if p.n_out == 2 else outs[0])
        assert all(g is o for g, o in zip(got, outs))
        _check(p, got)
    assert executions == (["execute", "hit", "hit"] if backend == "cpu" else ["execute"] * 3)


@pytest.mark.parametrize("layout", ["time-major", "transposed", "strided"])
def test_layouts(layout, executions):
    """Time-major rollouts (CleanRL's, SB3's), transposed views and strided slices: the plan's
    views are offsets and strides into the caller's tensors."""
    for seed in range(3):
        if layout == "time-major":
            p = make("gae", (9, 4), "episode_starts", time_dim=0, seed=seed)
        else:
            p = make("gae", (4, 9), "done", seed=seed)
            if layout == "transposed":
                args = tuple(x.t().contiguous().t() for x in p.args)
            else:
                args = tuple(torch.cat([x, x], 1)[:, 1::2] for x in p.args)
            p = type(p)(p.fn, args, p.kwargs)
        _check(p, p.call("cpu"))
    assert len(_plans()) == 1 and executions == ["execute", "hit", "hit"]


def test_a_new_signature_gets_a_new_plan():
    calls = [make("gae", (4, 9), seed=0), make("gae", (4, 10), seed=1), make("gae", (4, 9), dtype=torch.float64),
             make("gae", (4, 9), "done", seed=2), make("gae", (4, 9), seed=3, gamma=0.5)]
    for p in calls + calls:
        _check(p, p.call("cpu"))
    assert len(_plans()) == len(calls)


def test_data_checks_run_on_every_call():
    """Float flags are checked for 0/1 on CPU on every call, not only on the plan's first."""
    p = make("gae", (4, 9), "gym", seed=0)
    flags = {name: p.kwargs[name].float() for name in ("terminated", "truncated")}
    p = p.updated(**flags)
    _check(p, p.call("cpu"))
    bad = flags["terminated"].clone()
    bad[1, 2] = 2.0
    with pytest.raises(ValueError, match="terminated must hold only 0 and 1"):
        p.updated(terminated=bad).call("cpu")
    done = make("td_lambda_return", (4, 9), "torchrl", seed=1)
    done.call("cpu")
    term = done.kwargs["terminated"].clone()
    term[0, 0], term[0, 1] = True, True
    with pytest.raises(ValueError, match="terminated is set at a step where done is not"):
        done.updated(terminated=term, done=torch.zeros_like(done.kwargs["done"])).call("cpu")


def test_coefficient_tensors_are_read_on_every_call():
    """A one-element gamma tensor (TorchRL keeps one as a buffer) is read per call: updating it
    in place changes the next result."""
    gamma = torch.tensor(0.99)
    p = make("gae", (4, 9), seed=0).updated(gamma=gamma)
    _check(p, p.call("cpu"))
    gamma.fill_(0.5)
    _check(p.updated(gamma=0.5), p.call("cpu"))
    wide = torch.full((4, 9), 0.9)
    q = make("gae", (4, 9), seed=1).updated(gamma=wide)
    q.call("cpu")
    wide[2, 3] = 1.5
    with pytest.raises(ValueError, match="gamma must lie in"):
        q.call("cpu")


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_aliasing_an_input_on_a_repeated_call(backend):
    """The key cannot see aliasing: a repeated call whose out= overlaps an input takes the full
    path, which computes into fresh memory first."""
    p = make("gae", (4, 9), "done", seed=0)
    p.call(backend, out=(torch.empty(p.shape), torch.empty(p.shape)))
    q = make("gae", (4, 9), "done", seed=1)
    want = q.expected()
    values = q.args[1].clone()
    q = type(q)(q.fn, (q.args[0], values), q.kwargs)
    got = q.call(backend, out=(values, torch.empty(q.shape)))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.double().numpy(), w, rtol=1e-5, atol=1e-5)
    both = torch.empty(q.shape)
    with pytest.raises(ValueError, match="share memory"):
        q.call(backend, out=(both, both))


def test_the_hit_paths_overlap_expression_is_the_plans_overlap_check():
    """The plan checks out= against the inputs with one expression of the data pointers
    (``Plan._overlap_condition``, inlined by the generated hit path and evaluated by
    ``Plan._overlap``); for every placement of the tensors, meeting or not, at the boundaries
    included, it says what comparing each output's byte range with each other tensor's says."""
    plans.clear()
    p = make("gae", (4, 9), "done", seed=0)
    p.call("cpu", out=(torch.empty(p.shape), torch.empty(p.shape)))
    plan = _plans()[0]
    assert plan.out_sources
    condition = compile(plan._overlap_condition(), "<condition>", "eval")

    class At:
        def __init__(self, ptr):
            self.ptr = ptr

        def data_ptr(self):
            return self.ptr

    rng = np.random.default_rng(0)
    longest = max(hi - lo for lo, hi in plan.spans)
    met = 0
    for _ in range(3000):
        ptrs = [int(x) for x in rng.integers(0, 3 * longest, len(plan.sources))]
        want = any(ptrs[k] + plan.spans[k][0] < ptrs[j] + plan.spans[j][1]
                   and ptrs[j] + plan.spans[j][0] < ptrs[k] + plan.spans[k][1]
                   for j, others in plan.out_sources for k in others)
        met += want
        assert eval(condition, {f"d{k}": x for k, x in enumerate(ptrs)}) == want
        assert plan._overlap([At(x) for x in ptrs]) == want
    assert 0 < met < 3000


def test_grad_mode_is_part_of_the_signature():
    r = torch.randn(4, 9, requires_grad=True)
    v = torch.randn(4, 9)
    adv = rl_triton.gae(r, v, backend="cpu")[0]
    assert adv.requires_grad
    with torch.no_grad():
        for _ in range(2):
            adv_ng = rl_triton.gae(r, v, backend="cpu")[0]
            assert not adv_ng.requires_grad
            torch.testing.assert_close(adv_ng, adv.detach())
    assert rl_triton.gae(r, v, backend="cpu")[0].requires_grad


def test_environment_is_part_of_the_signature(monkeypatch):
    p = make("gae", (4, 9), seed=0)
    p.call()
    monkeypatch.setenv("RL_TRITON_BACKEND", "torch")
    p.call()
    monkeypatch.setenv("RL_TRITON_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="backend must be one of"):
        p.call()


def test_threads_share_plans():
    """Threads calling one signature concurrently get the serial results bit for bit."""
    problems = [make("gae", (16, 64), "done", seed=s) for s in range(8)]
    serial = [p.call("cpu") for p in problems]
    plans.clear()
    results, errors = {}, []

    def work(k):
        try:
            for _ in range(20):
                results[k] = problems[k].call("cpu")
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for k, want in enumerate(serial):
        assert all(torch.equal(a, b) for a, b in zip(results[k], want))


def test_the_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(plans, "MAX_PLANS", 4)
    for T in range(1, 10):
        rl_triton.discounted_return(torch.ones(2, T), backend="cpu")
    assert len(plans._plans) == 4


def test_calls_that_cannot_be_keyed_take_the_full_path(executions):
    r = torch.randn(3, 5)
    rl_triton.gae(r, r, time_dim=np.int64(1), backend="cpu")
    rl_triton.gae(torch.nn.Parameter(r), r, backend="cpu")
    assert not executions and not plans._plans


@pytest.fixture
def fake_triton(monkeypatch):
    """Compiled Triton kernels without a GPU: dispatch records its arguments and returns a
    stand-in compiled kernel whose launches record theirs; CPU tensors pass for CUDA ones.
    Yields the two records (dispatch: arguments, workspace, fold, moments, runtime sizes,
    constexprs, index type; launches: the arguments after the launcher's nine leading ones)."""
    pytest.importorskip("triton")
    from rl_triton.core import kernels, launch

    dispatched, launched = [], []

    class Compiled:
        function = packed_metadata = object()

        def run(self, *args):
            launched.append(args[9:])

    def dispatch(config, args, ws, runtime, phase, idx, fold=None, moments=kernels.NO_MOMENTS):
        dispatched.append((args, ws, fold, moments, runtime, config.constexprs[phase], idx))
        return Compiled()

    monkeypatch.setattr(kernels, "_dispatch", dispatch)
    monkeypatch.setattr(kernels, "INTERPRET", False)
    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_stream_getter", lambda: lambda index: 0)
    monkeypatch.setattr(launch, "triton_usable", lambda device: True)
    monkeypatch.setattr(launch, "_resolved", {})
    yield dispatched, launched


@pytest.mark.parametrize("moments", [None, (1, None), (0, "terminated")])
def test_direct_launch_passes_what_dispatch_passes(fake_triton, moments):
    """The GPU launch from data pointers (Launch.launch_direct) gives the compiled kernel the
    arguments Triton's dispatch got, each tensor replaced by its data pointer, with and without
    an output reduced into partial moments (the whitening's). Checked without a GPU: a stand-in
    compiled kernel records both."""
    from rl_triton.core import kernels, spec

    dispatched, launched = fake_triton
    r, v, term, trunc, nv = torch.randn(5, 3, 40).unbind(1)[0], torch.randn(5, 40), torch.rand(5, 40) < 0.1, \
        torch.rand(5, 40) < 0.1, torch.randn(40, 5).t()
    args = spec.GAE.bind(rewards=r, values=v, next_values=nv, terminated=term, truncated=trunc, gamma=0.9, lmbda=0.8)
    outs = [torch.empty(5, 40), torch.empty(5, 40)]
    launch = kernels.Launch(spec.GAE, args, outs, moments=moments)
    parts = None if moments is None else torch.empty(launch.tiles, 3, dtype=torch.float64)
    launch.launch(args, outs, parts)
    assert len(dispatched) == 1 and not launched
    values = (*args, *outs)
    ptrs = [values[i].data_ptr() for i in launch.tensor_slots]
    assert launch.launch_direct(ptrs, None if parts is None else parts.data_ptr())

    def as_pointers(x):
        if isinstance(x, tuple):
            return tuple(as_pointers(y) for y in x)
        return x.data_ptr() if isinstance(x, torch.Tensor) else x

    (ins, outs_), ws, fold, reduced, runtime, constexprs, idx = dispatched[0]
    assert fold is None
    if moments is None:
        assert reduced == kernels.NO_MOMENTS
    else:
        k, flag = moments
        assert reduced == (parts, outs_[k], None if flag is None else ins[spec.GAE.names.index(flag)])
    assert launched[0] == (as_pointers(ins), as_pointers(outs_), ws.data_ptr(), None, as_pointers(reduced), *runtime,
                           *constexprs, idx)


def test_compiled_kernels_launch_alike_directly_and_through_their_own_launcher():
    """Both launch forms of a compiled kernel hand its launcher the same grid, stream and
    arguments: the direct call of Triton releases in DIRECT_LAUNCH_TRITON and the compiled
    kernel's own ``kernel[grid](*args, stream=...)`` (its form in Triton's compiler.py) for others."""
    pytest.importorskip("triton")
    from rl_triton.core import kernels

    calls = []

    class Compiled:
        function, packed_metadata = object(), object()

        def run(self, *args):
            calls.append(args)

        def __getitem__(self, grid):  # Triton's CompiledKernel.__getitem__: metadata from the arguments
            def runner(*args, stream=None):
                self.run(*grid, stream, self.function, self.packed_metadata, ("metadata",), None, None, *args)
            return runner

    kernel = Compiled()
    kernels._launch_direct(kernel, 7, 3, 11, 1, None, (2, 3))
    kernels._launch_own(kernel, 7, 3, 11, 1, None, (2, 3))
    direct, own = calls
    assert direct[:6] == own[:6] == (7, 3, 1, 11, kernel.function, kernel.packed_metadata)
    assert direct[9:] == own[9:] == (1, None, (2, 3))
    assert [kernels.direct_release(v) for v in ("3.1.0", "3.2.0", "3.6.0", "3.9.1+git", "3.10.0", "4.0")] == \
        [False, True, True, True, False, False]


def test_a_chunk_launch_from_pointers_passes_what_dispatch_passes(fake_triton, monkeypatch):
    """A sharded call's chunk from data pointers (kernels.ChunkLaunch: phase 1, hand_kernel, then
    phase 2 with the engine's fold of every rank's maps) gives the compiled kernels the arguments
    Triton's dispatch got, each tensor replaced by its data pointer, in the same order. Checked
    without a GPU: stand-in compiled kernels record both."""
    from rl_triton.core import kernels, spec

    dispatched, launched = fake_triton
    handed = []

    class Compiled:
        function = packed_metadata = object()

        def run(self, *args):
            launched.append(args[9:])

    class Hand:
        def __getitem__(self, grid):
            def launch(*args, **constexprs):
                handed.append((args, tuple(v for k, v in constexprs.items() if k != "num_warps")))
                return Compiled()
            return launch
    monkeypatch.setattr(kernels, "hand_kernel", Hand())
    R, T = 3, 20000  # two segments or more
    g = torch.Generator().manual_seed(0)
    r, v, boot = torch.randn(R, T, generator=g), torch.randn(T, R, generator=g).t(), torch.randn(R, generator=g)
    d = torch.rand(R, T, generator=g) < 0.1
    args = spec.GAE.bind(rewards=r, values=v, carry=boot, done=d, gamma=0.9, lmbda=0.8)
    outs = [torch.empty(R, T), torch.empty(R, T)]
    launch = kernels.Launch(spec.GAE, args, outs)
    assert launch.config.n_seg > 1
    scale, divisor = torch.tensor([0.8], dtype=torch.float64), torch.tensor([0.8])
    hand = {"own": spec.GAE.names.index("carry"), "offset": spec.GAE.names.index("values")}
    chunk = kernels.ChunkLaunch(launch, 3, 1, torch.float32, hand, scale, divisor)
    tensors = launch._tensors(args, outs)
    ptrs = [t.data_ptr() for t in tensors]
    assert not chunk.ready(ptrs)
    chunk.reduce(ptrs, tensors)
    chunk.scan(ptrs, tensors)
    assert len(dispatched) == 2 and len(handed) == 1 and not launched
    assert chunk.ready(ptrs)
    chunk.reduce(ptrs)
    chunk.scan(ptrs)

    def as_pointers(x):
        if isinstance(x, tuple):
            return tuple(as_pointers(y) for y in x)
        return x.data_ptr() if isinstance(x, torch.Tensor) else x

    for got, ((ins, outs_), ws, fold, _, runtime, constexprs, idx) in zip((launched[0], launched[2]), dispatched):
        assert got == (as_pointers(ins), as_pointers(outs_), ws.data_ptr(), as_pointers(fold), kernels.NO_MOMENTS,
                       *runtime, *constexprs, idx)
    assert dispatched[0][2] is None and dispatched[1][2] == (chunk.gathered, 3, 1, divisor)
    hand_args, hand_constexprs = handed[0]
    assert launched[1] == (*as_pointers(hand_args), *hand_constexprs)
    assert hand_args[2][0] is boot and hand_args[2][1] == 1  # own: the carry slot's view
    assert hand_args[3] is None  # own_x: a two-state scan's
    assert hand_args[4][0].data_ptr() == v.data_ptr() and hand_args[4][1] == 1  # offset: values at the first step


@pytest.mark.parametrize("shape", [(5, 40), (2, 20000)])  # one pass; a time split (two phases, a workspace)
def test_generated_hit_passes_what_dispatch_passes(shape, fake_triton):
    """A plan's generated hit path (Plan._generate) launches the compiled kernel with the
    arguments Triton's dispatch got, each tensor replaced by its data pointer; a misaligned
    pointer sends the call back to dispatch. Checked without a GPU: stand-in compiled kernels."""
    dispatched, launched = fake_triton
    R, T = shape
    r, v, bv = torch.randn(R, T), torch.randn(T, R).t(), torch.randn(R)
    d = torch.rand(R, T) < 0.1

    def call(rewards=r):
        return rl_triton.gae(rewards, v, done=d, bootstrap_value=bv, gamma=0.9, backend="triton")

    def as_pointers(x):
        if isinstance(x, tuple):
            return tuple(as_pointers(y) for y in x)
        return x.data_ptr() if isinstance(x, torch.Tensor) else x

    call()  # the full path: Triton's dispatch
    phases = len(dispatched)
    (ins, outs_), _, _, _, runtime, _, idx = dispatched[0]
    plan = _plans()[0]
    for path in ("direct", "generated"):
        assert (plan.hit is not None) == (path == "generated")
        adv, tgt = call()
        assert len(launched) == phases * (1 if path == "direct" else 2)
        for got, (_, _, _, _, _, constexprs, _) in zip(launched[-phases:], dispatched):
            assert got[0] == as_pointers(ins)
            assert got[1] == tuple((o.data_ptr(), *t[1:]) for o, t in zip((adv, tgt), outs_))
            assert got[2] == r.data_ptr() if phases == 1 else got[2] != r.data_ptr()  # a workspace of its own
            assert got[3] is None and got[4] == kernels.NO_MOMENTS and got[5:] == (*runtime, *constexprs, idx)
    assert len(dispatched) == phases
    offset = torch.randn(R * T + 1)[1:].view(R, T)  # 4 bytes past an aligned address
    call(offset)
    assert len(dispatched) == 2 * phases  # dispatched again, for the misaligned specialisation


def test_forced_launch_parameters_bypass_the_plans(executions):
    """Under ``kernels.forced_plan`` (tests, plan sweeps) calls take the full path, whose launch
    reads the forced parameters; a plan kept from before would not."""
    pytest.importorskip("triton")
    from rl_triton.core import kernels

    p = make("gae", (4, 40), "done")
    p.call("cpu")
    p.call("cpu")
    runs = len(executions)
    with kernels.forced_plan(block_t=8):
        _check(p, p.call("cpu"))
    assert len(executions) == runs
    p.call("cpu")
    assert len(executions) == runs + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_plans_hold_no_tensor_of_their_calls(backend):
    """A kept plan must not keep its first call's tensors (or outputs) alive."""
    import gc
    import weakref

    p = make("vtrace", (4, 9), "done+bootstrap", seed=0)
    outs = p.call(backend)
    refs = [weakref.ref(t) for t in (*p.args, *p.kwargs.values(), *outs) if isinstance(t, torch.Tensor)]
    del p, outs
    gc.collect()
    assert _plans() and all(r() is None for r in refs)


def test_numbers_of_other_types_are_other_signatures():
    """1.0, 1 and True are equal in Python; as arguments they are not the same call."""
    r, v = torch.randn(2, 5), torch.randn(2, 5)
    rl_triton.gae(r, v, gamma=1.0, backend="cpu")
    rl_triton.gae(r, v, gamma=1, backend="cpu")
    with pytest.raises(TypeError, match="gamma must be a float or a tensor"):
        rl_triton.gae(r, v, gamma=True, backend="cpu")
    with pytest.raises(TypeError, match="time_dim must be an int"):
        rl_triton.gae(r, v, time_dim=1.0, backend="cpu")


def test_calls_without_a_plan():
    """A signature whose kernel views are not the caller's memory (bfloat16 on numba goes
    through float32 buffers) keeps no plan and is not recorded again; one whose views could lie
    in several caller tensors (two views of one buffer) keeps none for that call alone."""
    p = make("gae", (4, 9), "done", dtype=torch.bfloat16)
    for _ in range(2):
        _check(p, p.call("cpu"), tol=2e-2)
    assert list(plans._plans.values()) == [plans._NO_PLAN]
    plans.clear()
    q = make("td_lambda_return", (4, 9), "done", seed=1)
    shared = q.args[1].clone()
    both = type(q)(q.fn, (shared, shared.view(4, 9)), q.kwargs)  # the carry lies in both
    for _ in range(2):
        _check(both, both.call("cpu"))
    assert not plans._plans
    _check(q, q.call("cpu"))
    assert len(_plans()) == 1


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace",
                                  "eligibility_trace", "episodic_cumsum", "affine_scan"])
def test_every_drawn_case_repeats_exactly(name, backend):
    """Any case of the property tests (layouts, flag styles and dtypes, coefficient forms,
    time_dim), called three times with fresh plans: the full path, then its plan, then the
    plan's generated function give the same bits, the oracle's values, and leave the inputs."""
    from hypothesis import given, settings

    from helpers import ALL_CASES, check_case, n_examples

    @settings(max_examples=n_examples(40 if backend == "cpu" else 12), deadline=None)
    @given(case=ALL_CASES[name]())
    def repeats(case):
        plans.clear()
        first = case.call(backend)
        for _ in range(2):
            check_case(case, backend)
            again = case.call(backend)
            for a, b in zip(first, again):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    repeats()


@pytest.mark.parametrize("time_dim", [0, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("given", [False, True], ids=["fresh", "out"])
@pytest.mark.parametrize("options", [dict(eps_mode="std"), {}, dict(unbiased=False, eps_mode="clamp"),
                                     dict(scale=False), dict(shift_mean=False, eps=0.3)])
def test_whitened_calls_keep_a_plan_on_numba(options, given, dtype, time_dim, monkeypatch):
    """``gae(whiten=...)`` without a mask on the numba backend (rsl_rl's, skrl's and rl_games'
    normalisation): the first call of a signature leaves a plan, the scan then one whitening
    kernel, which the next calls run with their new values; every result against the float64
    oracle's advantages whitened by the oracle's ``masked_whiten`` (the value targets from the
    advantages before the whitening)."""
    from rl_triton.testing import oracle

    runs = []
    reducing = plans.Plan._reducing
    monkeypatch.setattr(plans.Plan, "_reducing", lambda self, *a, **k: runs.append("plan") or reducing(self, *a, **k))
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    for seed in range(3):
        p = make("gae", (6, 40), "done", seed=seed, dtype=dtype, time_dim=time_dim)
        outs = tuple(torch.full(p.args[0].shape, float("nan"), dtype=dtype) for _ in range(2)) if given else None
        got = p.call("cpu", whiten=options, out=outs)
        if given:
            assert all(g is o for g, o in zip(got, outs))
        adv, targets = p.expected()
        for g, w in zip(got, (oracle.masked_whiten(adv, **options), targets)):
            np.testing.assert_allclose(g.double().numpy(), w, rtol=tol, atol=tol)
    assert len(_plans()) == 1 and runs == ["plan"] * 3
