"""Time the estimators: on a GPU every algorithm on the shape grid against its peers and the
floors; on a CPU-only machine GAE on the CPU backends against SB3's and TorchRL's loops.

    python benchmarks/run.py [--algos gae,vtrace] [--shapes 4096x128,1x131072] [--peers-dir DIR] [--md FILE]
    python benchmarks/run.py --cpu [--shapes 2048x8,128x8] [--rounds 9] [--md FILE]

``--algos`` takes the public estimators' names and ``retrace:TRACE`` for Retrace's other traces
(importance, tree_backup, q_lambda, peng: the catalog's variants of rl_triton.testing).

GPU, first the host path: every public function at 4096x128 beside an empty Triton launch,
the full call (as below) and the launch throughput (calls issued back to back, one synchronize
at the end, per call), the implementations taking turns, ratios taken within a round.

GPU, then the grid: full call = CUDA events around one call with a synchronize before and after (what a
training loop sees), the implementations of a cell taking turns for 5 rounds (median over the
rounds; "full / ours" is the median of the ratios within a round); device time = median CUDA-graph replay of 20 calls, per
call ("-" where an implementation cannot be captured, e.g. it synchronises, or is too slow to
capture). Floors, measured in the same process: device-to-device copy bandwidth (torch's copy
and a Triton copy kernel, the faster) applied to the minimum bytes (each input read once, each
output written once), and the full call and replay of an empty Triton kernel. Peers are in
benchmarks/peers.py; every implementation is checked against the float64 oracle on the first
rows before it is timed (a failed or wrong one is marked, not timed; where rl_triton fails or is
wrong in any cell, the run ends with exit status 1 after the tables). Ratios are peer time /
rl_triton time from the same run. Each implementation's floor counts the outputs it writes (the
seed's GAE writes advantages only), and "share of own floor" compares rl_triton's floor /
device with the peer's. After the per-cell closest peers, one row per peer gives the range of
its ratios over the cells and how many cells rl_triton is behind. The torch.compile peers cost two compilations per cell (about 8 s on
the H200 host; all seven algorithms with them take about 14 minutes, over the device's
10-minute command limit), so by default they run for GAE on the whole grid and for the other
algorithms at the four shapes where they come closest to GAE (``--compiled-peers``,
``--compiled-others-at``; ``--compiled-peers all`` for every cell). With --img, PNG plots (GAE
time vs T, fraction of the floor) go there.

CPU (--cpu, the default without CUDA; --shapes are then T x N): first the host path, ``gae``
at 8x16 against ``torch.add`` of the same tensors; then GAE on time-major (T, N)
rollouts, SB3's layout, gamma 0.99, lambda 0.95, 2% dones. Implementations: rl_triton's numba
and torch backends, SB3's own ``RolloutBuffer.compute_returns_and_advantage`` (and the same
method patched by rl_triton.integrations.sb3) and TorchRL's ``generalized_advantage_estimate``
and ``vec_generalized_advantage_estimate`` when installed, each first checked against the
float64 oracle of rl_triton.testing (a wrong result is reported, not timed). They take turns in
--rounds rounds (benchmarks/common.py: each round times a batch of calls of every
implementation, the order rotating), and the table gives the median over the rounds and the
lowest-highest round, of the time per call and of each speed-up (taken within a round).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import numpy as np
import torch

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..")]
import rl_triton as rt  # noqa: E402
from common import alternate, machine, one_call_us, parser, ratios, spread  # noqa: E402
from peers import Problem, load_external_peers, max_error, testing  # noqa: E402

GRID = ["4096x128", "64x512", "1024x1024", "16384x512", "128x4096", "32768x8", "4096x32", "16384x16",
        "64x8192", "8x32768", "1x131072", "16384x4096", "4096x4096"]
# the cells where the compiled peers come closest to GAE (docs/benchmarks.md): the other algorithms get them here
SPOT_SHAPES = ["4096x128", "32768x8", "1024x1024", "128x4096"]
ALGOS = ["gae", "td_lambda_return", "discounted_return", "vtrace", "retrace", "eligibility_trace",
         "episodic_cumsum", "nstep_return"]
# Retrace's other traces (``--algos retrace:importance,...``; not in the default run)
TRACE_ALGOS = ["retrace:importance", "retrace:tree_backup", "retrace:q_lambda", "retrace:peng"]


try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install (no [gpu] extra): the CPU benchmark still runs
    triton = None

if triton is not None:
    @triton.jit
    def _empty_kernel(x):
        pass

    @triton.jit
    def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)
else:
    _empty_kernel = _copy_kernel = None


def full_call_us(fn, n=200, budget_s=0.5):
    """Median full call; fewer calls (at least 5) for slow implementations."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return _full_call_round(fn, max(5, min(n, int(budget_s / max(time.perf_counter() - start, 1e-6)))))


def _full_call_round(fn, n=25) -> float:
    """Median full call (CUDA events around one call after a synchronize) of ``n`` calls."""
    return statistics.median([one_call_us(fn, "cuda") for _ in range(n)])


class NotCaptured(Exception):
    """The replayed graph does not compute what the call computes (the call's work ran outside
    the capture, on another stream)."""


def device_us(fn, calls=20, reps=9):
    """Device time per call: median replay of a CUDA graph of ``calls`` calls, divided by
    ``calls``. Where ``fn`` returns tensors, the graph's outputs are first set to NaN, replayed,
    and compared with an eager call's: a graph that does not recompute them raises NotCaptured
    (work launched on a stream other than the capturing one is not in the graph)."""
    eager = fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    # the outer context restores the current stream even where the capture fails (a call that
    # synchronises): torch.cuda.graph's own exit skips that when capture_end raises, and the rest
    # of the run would then run on the capture stream, unordered with work on the legacy default
    # stream (PufferLib's kernel)
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            outs = fn()
    outs = [o for o in (outs if isinstance(outs, (tuple, list)) else (outs,)) if isinstance(o, torch.Tensor)]
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = eager if isinstance(eager, (tuple, list)) else (eager,)
    for o, e in zip(outs, eager):
        if not torch.allclose(o, e, rtol=1e-5, atol=1e-5, equal_nan=True):
            raise NotCaptured
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def copy_bandwidth_tbs():
    src = torch.randn(1 << 28, device="cuda")
    dst = torch.empty_like(src)
    n = src.numel()
    torch_copy = device_us(lambda: dst.copy_(src), calls=3, reps=5)
    tri_copy = device_us(lambda: _copy_kernel[(triton.cdiv(n, 4096),)](src, dst, n, BLOCK=4096, num_warps=8),
                         calls=3, reps=5)
    return 2 * n * 4 / min(torch_copy, tri_copy) / 1e6


# max |y - ref| / (1 + |ref|) against the float64 oracle on inputs rounded to the dtype
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

CPU_SHAPES = "2048x8,2048x1,128x8,2048x64"


def cpu_peers(T, N, r, v, ep_start, last_v, last_done, gamma, lam):
    """name -> callable returning time-major advantages, for the installed peers."""
    peers = {}
    try:
        import gymnasium as gym
        from stable_baselines3.common.buffers import RolloutBuffer

        buf = RolloutBuffer(T, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", gae_lambda=lam,
                            gamma=gamma, n_envs=N)
        buf.rewards[:], buf.values[:], buf.episode_starts[:] = r, v, ep_start

        import rl_triton.integrations.sb3 as rt_sb3

        def sb3(method):
            method(buf, torch.as_tensor(last_v), last_done)
            return buf.advantages

        peers["SB3 RolloutBuffer"] = lambda: sb3(RolloutBuffer.compute_returns_and_advantage)
        peers["SB3 RolloutBuffer, rl_triton patch"] = lambda: sb3(rt_sb3.compute_returns_and_advantage)
    except ImportError:
        pass
    try:
        from torchrl.objectives.value import functional as F

        done = torch.as_tensor(np.concatenate([ep_start[1:], last_done[None]], 0) != 0).T[..., None]
        vt = torch.as_tensor(v).T[..., None]
        nvt = torch.cat([vt[:, 1:], torch.as_tensor(last_v)[:, None, None]], 1)
        rt_ = torch.as_tensor(r).T[..., None]
        peers["TorchRL loop"] = lambda: F.generalized_advantage_estimate(gamma, lam, vt, nvt, rt_, done)[0][..., 0].T
        peers["TorchRL vec"] = lambda: F.vec_generalized_advantage_estimate(gamma, lam, vt, nvt, rt_, done)[0][..., 0].T
    except ImportError:
        pass
    return peers


def cpu_main(shapes: str, rounds: int, md):
    gamma, lam = 0.99, 0.95
    host = cpu_host_path(rounds)
    print("\n".join(host) + "\n", flush=True)
    lines = [f"CPU: {machine()}; torch {torch.__version__}; GAE, time-major (T, N); {rounds} rounds, "
             "implementations alternating; median over the rounds (lowest-highest round)", "",
             "| T x N | implementation | time us | speed-up of rl_triton (cpu) | max error vs oracle |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for shape in shapes.split(","):
        T, N = map(int, shape.lower().split("x"))
        rng = np.random.default_rng(T * 31 + N)
        r, v = rng.standard_normal((2, T, N)).astype(np.float32)
        ep_start = (rng.random((T, N)) < 0.02).astype(np.float32)
        last_v, last_done = rng.standard_normal(N).astype(np.float32), (rng.random(N) < 0.02).astype(np.float32)
        done = np.concatenate([ep_start[1:], last_done[None]], 0)
        tr, tv, td, tb = map(torch.as_tensor, (r, v, done != 0, last_v))
        problem = testing.Problem("gae", (tr, tv), dict(bootstrap_value=tb, done=td, gamma=gamma, lmbda=lam,
                                                        time_dim=0))
        ref = problem.expected()[0]
        impls = {f"rl_triton ({b})": (lambda b=b: problem.call(b)[0])
                 for b in ("cpu", "torch") if b != "cpu" or rt.core.cpu.AVAILABLE}
        impls.update(cpu_peers(T, N, r, v, ep_start, last_v, last_done, gamma, lam))
        errors = {name: float(np.max(np.abs(np.asarray(fn(), dtype=np.float64) - ref) / (1 + np.abs(ref))))
                  for name, fn in impls.items()}
        times = alternate({name: fn for name, fn in impls.items() if errors[name] < 1e-4}, rounds=rounds)
        ours = times.get("rl_triton (cpu)")
        for name, err in errors.items():
            if name not in times:
                line = f"| {T}x{N} | {name} | WRONG, not timed | | {err:.1e} |"
            else:
                speed = spread(ratios(times[name], ours), unit="x") if ours else "-"
                us = spread([1e6 * t for t in times[name]], "{:.0f}")
                line = f"| {T}x{N} | {name} | {us} | {speed} | {err:.1e} |"
            lines.append(line)
            print(line, flush=True)
    if md:
        with open(md, "w") as f:
            f.write("\n".join(host + [""] + lines) + "\n")


def cpu_host_path(rounds: int) -> list:
    """The CPU host path: ``gae`` at 8x16 in its common call forms against ``torch.add`` of the
    same tensors, alternating (target: at most 9x)."""
    g = torch.Generator().manual_seed(0)
    r, v = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
    done = torch.rand(8, 16, generator=g) < 0.05
    boot = torch.randn(8, generator=g)
    impls = {"torch.add(rewards, values)": lambda: torch.add(r, v),
             "gae(rewards, values)": lambda: rt.gae(r, v),
             "gae(rewards, values, done=)": lambda: rt.gae(r, v, done=done),
             "gae(rewards, values, done=, bootstrap_value=)": lambda: rt.gae(r, v, done=done, bootstrap_value=boot)}
    times = alternate(impls, rounds=rounds)
    base = times["torch.add(rewards, values)"]
    lines = [f"CPU host path, 8x16 float32, {rounds} rounds alternating: time per call and its ratio to "
             "torch.add of the same tensors (target: gae <= 9x)", "", "| call | us | / torch.add |", "|---|---|---|"]
    for name, t in times.items():
        lines.append(f"| {name} | {spread([1e6 * x for x in t], '{:.2f}')} | "
                     f"{spread(ratios(t, base), '{:.1f}', 'x')} |")
    return lines


def main():
    p = parser(__doc__)
    p.add_argument("--algos", default=",".join(ALGOS), help="GPU: algorithms to time")
    p.add_argument("--shapes", default=None,
                   help=f"GPU: ROWSxT list (None: {','.join(GRID)}); CPU: TxN list (None: {CPU_SHAPES})")
    p.add_argument("--cpu", action="store_true", help="CPU benchmark (the default without CUDA)")
    p.add_argument("--rounds", type=int, default=9, help="CPU: rounds of alternating timed batches")
    p.add_argument("--md", help="also write the table to this markdown file")
    p.add_argument("--img", help="GPU: folder for the PNG plots")
    p.add_argument("--no-peers", action="store_true", help="GPU: time rl_triton only")
    p.add_argument("--no-host-path", action="store_true",
                   help=f"GPU: leave out the host-path table (every public function at {HOST_SHAPE} against an empty "
                        "Triton launch)")
    p.add_argument("--peers-dir", metavar="DIR",
                   help="GPU: a folder holding rl_triton_seed/ and pufferlib_ext/, the MIT-licensed seed library "
                        "and PufferLib's advantage kernel, timed as peers (the GPU machine gets them as a copied, "
                        "carried folder); without it they are left out")
    p.add_argument("--replot", metavar="MD", help="redraw the --img plots from a table written by --md")
    p.add_argument("--dtypes", default="float32,bfloat16",
                   help="GPU: input dtypes; peers are timed in float32 only (bfloat16 rows: rl_triton alone)")
    p.add_argument("--compiled-peers", default="gae",
                   help="GPU: algorithms that get the torch.compile peers at every shape (two compilations "
                        "per cell, about 8 s on the H200 host); 'all' for every algorithm (about 14 minutes)")
    p.add_argument("--compiled-others-at", default=",".join(SPOT_SHAPES),
                   help="GPU: shapes where the other algorithms get the torch.compile peers too")
    p.add_argument("--loop-max-t", type=int, default=4096,
                   help="GPU: the per-step loops (rl_triton's torch backend, TorchRL's loops) at T up to this only")
    p.add_argument("--warm-only", action="store_true",
                   help="GPU: call every implementation of every cell once and time nothing: compiles into Triton's "
                        "and inductor's caches, so that processes run beside each other beforehand (--shard) shorten "
                        "the timed run's compilations")
    p.add_argument("--shard", default="0/1", help="GPU, --warm-only: K/N, the K-th of N interleaved parts of the cells")
    args = p.parse_args()
    if args.replot:
        return plots(results_from_md(args.replot), args.img or "docs/img")
    if args.cpu or not torch.cuda.is_available():
        return cpu_main(args.shapes or CPU_SHAPES, args.rounds, args.md)
    args.shapes = args.shapes or ",".join(GRID)
    gpu_main(args)


HOST_SHAPE = "4096x128"
PUBLIC = ALGOS + ["affine_scan"]


def _host_call(algo: str, R: int, T: int):
    """rl_triton's call of ``algo`` on an R x T problem of the catalog (the benchmark's problems)."""
    if algo == "affine_scan":
        return _direct_call(testing.make("affine_scan", (R, T), "reverse", device="cuda", seed=1))
    return _direct_call(Problem(algo, R, T).problem)


def _direct_call(problem):
    """A problem's rl_triton call as a user makes it: the function with the problem's arguments."""
    fn, args, kwargs = getattr(rt, problem.fn), problem.args, problem.kwargs
    return lambda: fn(*args, **kwargs)


def _full_calls_alternating(impls: dict, rounds: int = 5, budget_s: float = 0.1) -> dict:
    """Per implementation, the median full call of each of ``rounds`` rounds in which the
    implementations take turns (the order rotating), each timing about ``budget_s`` seconds of
    calls (at least 3): a slow phase of the host hits them alike, and ratios are taken within a
    round."""
    names = list(impls)
    calls = {}
    for name, fn in impls.items():
        calls[name] = max(3, min(25, int(budget_s / max(_full_call_round(fn, 1) * 1e-6, 1e-6))))
    full = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            full[name].append(_full_call_round(impls[name], calls[name]))
    return full


def _throughput_round(fn, n=200) -> float:
    """Per call of ``n`` calls issued back to back, one synchronize at the end."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6


def host_path(rounds: int = 15) -> list:
    """Every public function at HOST_SHAPE beside an empty Triton launch, on the host's terms:
    full call and launch throughput, the implementations taking turns in every round; ratios to
    the empty launch are taken within a round (median, lowest-highest)."""
    R, T = map(int, HOST_SHAPE.split("x"))
    x = torch.empty(1, device="cuda")
    impls = {"empty Triton kernel": lambda: _empty_kernel[(1,)](x)}
    impls.update({algo: _host_call(algo, R, T) for algo in PUBLIC})
    for fn in impls.values():  # compile, leave each call's plan
        for _ in range(3):
            fn()
    full = {name: [] for name in impls}
    thru = {name: [] for name in impls}
    names = list(impls)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            full[name].append(_full_call_round(impls[name]))
            thru[name].append(_throughput_round(impls[name]))
    lines = [f"Host path at {HOST_SHAPE} (float32, done flags): {rounds} rounds, implementations taking turns; "
             "median (lowest-highest round); ratios to the empty Triton kernel within each round. Targets: full "
             "call <= 1.3x, throughput <= 1.2x the empty kernel's", "",
             "| function | full call us | full / empty | throughput us per call | throughput / empty |",
             "|---|---|---|---|---|"]
    for name in names:
        cells = [spread(full[name]), spread(thru[name])]
        if name != names[0]:
            cells.insert(1, spread(ratios(full[name], full[names[0]]), "{:.2f}", "x"))
            cells.insert(3, spread(ratios(thru[name], thru[names[0]]), "{:.2f}", "x"))
        else:
            cells[1:1] = ["1x"]
            cells.append("1x")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _device_or_none(fn, full_us):
    """Device time, or None when the implementation is slow (launch-bound) or cannot be captured."""
    if full_us > 5000:
        return None
    try:
        return device_us(fn)
    except Exception:  # a host synchronisation inside the call breaks graph capture
        torch.cuda.synchronize()
        return None


def gpu_main(args):
    if triton is None:
        raise SystemExit("the GPU benchmark needs triton: pip install -e '.[gpu]'")
    external = None if args.no_peers else load_external_peers(
        args.peers_dir, pufferlib="gae" in args.algos.split(",") and not args.warm_only)
    cells = [(a, d, s) for a in args.algos.split(",") for d in args.dtypes.split(",") for s in args.shapes.split(",")]
    if args.warm_only:
        k, n = map(int, args.shard.split("/"))
        return warm(cells[k::n], args, external)
    if not args.no_host_path:
        host = host_path()
        print("\n".join(host) + "\n", flush=True)
    bw = copy_bandwidth_tbs()
    x = torch.empty(1, device="cuda")
    empty_full = full_call_us(lambda: _empty_kernel[(1,)](x))
    empty_dev = device_us(lambda: _empty_kernel[(1,)](x))
    lines = [f"Device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}",
             f"Copy bandwidth (read + write): {bw:.2f} TB/s; empty Triton kernel: full call {empty_full:.1f} us, "
             f"replay {empty_dev:.2f} us", "",
             "| algorithm | dtype | rows x T | implementation | full call us | device us | full / ours "
             "| device / ours | own floor / device | max error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    results = []
    bar = _progress(len(cells))
    for algo, dtype_name, shape in cells:
        R, T = map(int, shape.split("x"))
        problem, impls = _cell_impls(algo, dtype_name, R, T, args, external)
        expected = problem.expected(rows=4)
        dtype = getattr(torch, dtype_name)
        cell_lines, cell_results = time_cell((algo, dtype_name, R, T), impls, expected, TOLERANCE[dtype],
                                             problem.nbytes_with, bw)
        lines += cell_lines
        results += cell_results
        del problem, impls
        torch.cuda.empty_cache()
        bar()
    tail = summary(results, empty_full) + peer_ranges(results)
    failed = failures(results)
    if failed:
        tail += ["", f"rl_triton FAILED or WRONG in {len(failed)} cell(s): " + "; ".join(failed)]
    lines += tail
    if not args.no_host_path:
        lines[:0] = host + [""]
    print("\n".join(tail), flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    if args.img:
        plots([r for r in results if r["status"] == "ok"], args.img)
    if failed:
        raise SystemExit(1)


def _cell_impls(algo, dtype_name, R, T, args, external):
    """A cell's problem and its implementations (rl_triton's first), with a fresh compile cache."""
    dtype = getattr(torch, dtype_name)
    torch._dynamo.reset()  # compiled peers: no cache reuse across shapes
    problem = Problem(algo, R, T, dtype=dtype)
    with_peers = not args.no_peers and dtype == torch.float32
    compiled = args.compiled_peers == "all" or algo in args.compiled_peers.split(",") \
        or f"{R}x{T}" in args.compiled_others_at.split(",")
    peers = problem.peers(compiled=compiled, loop_max_T=args.loop_max_t, external=external) if with_peers else {}
    return problem, {"rl_triton": _direct_call(problem.problem), **peers}


def warm(cells, args, external):
    """Call every implementation of ``cells`` once (compiling into the on-disk caches), untimed."""
    for algo, dtype_name, shape in cells:
        R, T = map(int, shape.split("x"))
        problem, impls = _cell_impls(algo, dtype_name, R, T, args, external)
        for name, fn in impls.items():
            try:
                fn()
            except Exception as e:  # the timed run reports it
                print(f"{algo} {shape} {name}: {type(e).__name__}", flush=True)
        del problem, impls
        torch.cuda.empty_cache()


def time_cell(key, impls: dict, expected, tolerance: float, nbytes, bandwidth_tbs: float,
              full_calls=None, device=None):
    """Check and time the implementations of one cell ``key = (algo, dtype, R, T)``; ``impls``
    maps names to calls, rl_triton's first under the name "rl_triton".

    Every implementation is first checked against the oracle's ``expected`` outputs (the first
    rows); one that raises is marked failed and one whose error is over ``tolerance`` (or NaN)
    wrong, and neither is timed. The others take turns (``full_calls``: name -> calls ->
    {name: [per-round full call us]}, default :func:`_full_calls_alternating`) and get a device
    time (``device(fn, full_us)``: us or None, default :func:`_device_or_none`). Ratios are peer /
    rl_triton, full calls within each round; without a checked rl_triton there are none. Each
    implementation's floor is ``nbytes(number of outputs it returns)`` at ``bandwidth_tbs``.

    Returns the table lines (printed as they come) and one result dict per implementation,
    with ``status`` "ok", "failed: ERROR" or "wrong"."""
    full_calls = full_calls or _full_calls_alternating
    device = device or _device_or_none
    algo, dtype, R, T = key
    cell = f"| {algo} | {dtype} | {R}x{T} |"
    lines, results, checked, n_out = [], [], {}, {}

    def emit(line):
        lines.append(line)
        print(line, flush=True)

    def record(name, status, **timed):
        row = dict(algo=algo, dtype=dtype, R=R, T=T, impl=name, status=status, full=None, dev=None, floor=None,
                   full_ratio=None, err=None)
        row.update(timed)
        results.append(row)

    for name, fn in impls.items():
        try:
            out = fn()
            err = max_error(out, expected)
        except Exception as e:  # a peer that fails on this shape is reported, not timed
            emit(f"{cell} {name} | failed: {type(e).__name__}: {str(e).strip()[:80]} | | | | | |")
            record(name, f"failed: {type(e).__name__}")
            continue
        if not err <= tolerance:  # NaN too
            emit(f"{cell} {name} | WRONG, not timed | | | | | {err:.1e} |")
            record(name, "wrong", err=err)
            continue
        checked[name] = err
        n_out[name] = 1 if isinstance(out, torch.Tensor) else len(out)
    full = full_calls({name: impls[name] for name in checked}) if checked else {}
    ours = None
    if "rl_triton" in checked:
        ours_dev = device(impls["rl_triton"], statistics.median(full["rl_triton"]))
        ours = (full["rl_triton"], ours_dev)
    for name, err in checked.items():
        median = statistics.median(full[name])
        dev = ours[1] if name == "rl_triton" else device(impls[name], median)
        floor = nbytes(n_out[name]) / (bandwidth_tbs * 1e6)
        full_ratio = statistics.median(ratios(full[name], ours[0])) if ours else None
        ratio_dev = f"{dev / ours[1]:.2f}x" if ours and dev is not None and ours[1] else "-"
        emit(f"{cell} {name} | {median:.1f} | {'-' if dev is None else f'{dev:.2f}'} | "
             f"{'-' if full_ratio is None else f'{full_ratio:.2f}x'} | {ratio_dev} | "
             f"{'-' if dev is None else f'{floor / dev:.0%}'} | {err:.1e} |")
        record(name, "ok", full=median, dev=dev, floor=floor, full_ratio=full_ratio, err=err)
    return lines, results


def failures(results) -> list:
    """The cells where rl_triton failed or was wrong, as "algo dtype RxT: status" strings."""
    return [f"{r['algo']} {r['dtype']} {r['R']}x{r['T']}: {r['status']}" for r in results
            if r["impl"] == "rl_triton" and r["status"] != "ok"]


def _cells(results) -> dict:
    """(algo, dtype, R, T) -> the cell's result rows, in the order the cells ran."""
    cells: dict = {}
    for r in results:
        cells.setdefault((r["algo"], r["dtype"], r["R"], r["T"]), []).append(r)
    return cells


def _share_ratio(ours, peer):
    """rl_triton's share of its own floor over the peer's share of its own (floor / device each):
    above 1, rl_triton is nearer its floor; the device-time ratio where both write the same
    outputs."""
    if ours["dev"] is None or peer["dev"] is None:
        return None
    return (ours["floor"] / ours["dev"]) / (peer["floor"] / peer["dev"])


def summary(results, empty_full):
    """Per cell, the closest peer (smallest peer / rl_triton ratio), for full call, device time
    and share of the own floor; a row for every cell, including those where rl_triton failed."""
    out = ["", "| algorithm | dtype | rows x T | closest peer, full call | closest peer, device | "
           "closest peer, share of own floor | rl_triton full call / empty kernel |", "|---|---|---|---|---|---|---|"]
    for (algo, dtype, R, T), rows in _cells(results).items():
        ours = next((r for r in rows if r["impl"] == "rl_triton"), None)
        head = f"| {algo} | {dtype} | {R}x{T} |"
        if ours is None or ours["status"] != "ok":
            out.append(f"{head} rl_triton {'absent' if ours is None else ours['status'].upper()} | - | - | - |")
            continue
        peers = [r for r in rows if r is not ours and r["status"] == "ok"]

        def closest(values):
            values = [(v, name) for v, name in values if v is not None]
            return f"{min(values)[0]:.2f}x ({min(values)[1]})" if values else "-"

        full = closest((r["full_ratio"], r["impl"]) for r in peers)
        dev = closest((r["dev"] / ours["dev"] if r["dev"] is not None and ours["dev"] else None, r["impl"])
                      for r in peers)
        share = closest((_share_ratio(ours, r), r["impl"]) for r in peers)
        out.append(f"{head} {full} | {dev} | {share} | {ours['full'] / empty_full:.2f}x |")
    return out


def peer_family(name: str) -> str:
    """A peer's name without its per-algorithm note in parentheses (the seed's, PufferLib's)."""
    return name.split(" (")[0]


def peer_ranges(results) -> list:
    """Per peer (by :func:`peer_family`), over the cells where it and rl_triton were both timed:
    the range of peer / rl_triton for full call and device time and of the floor-share ratio
    (above 1: rl_triton ahead), and how many cells rl_triton is behind in each."""
    out = ["", "| peer | cells | full call / rl_triton (min-max) | behind, full | device / rl_triton (min-max) | "
           "behind, device | share of own floor, rl_triton / peer (min-max) | behind, share |",
           "|---|---|---|---|---|---|---|---|"]
    per_peer: dict = {}
    for rows in _cells(results).values():
        ours = next((r for r in rows if r["impl"] == "rl_triton" and r["status"] == "ok"), None)
        if ours is None:
            continue
        for r in rows:
            if r is not ours and r["status"] == "ok":
                per_peer.setdefault(peer_family(r["impl"]), []).append((r, ours))

    def span(values):
        values = [v for v in values if v is not None]
        if not values:
            return "-", "-"
        return f"{min(values):.2f}-{max(values):.2f}x", str(sum(v < 1 for v in values))

    for name, pairs in per_peer.items():
        full = span(r["full_ratio"] for r, _ in pairs)
        dev = span(r["dev"] / o["dev"] if r["dev"] is not None and o["dev"] else None for r, o in pairs)
        share = span(_share_ratio(o, r) for r, o in pairs)
        out.append(f"| {name} | {len(pairs)} | {full[0]} | {full[1]} | {dev[0]} | {dev[1]} | {share[0]} | {share[1]} |")
    return out


def _progress(total):
    try:
        from tqdm import tqdm
    except ImportError:
        return lambda: None
    bar = tqdm(total=total, desc="cells", file=sys.stderr)
    return lambda: bar.update(1)


def results_from_md(path):
    """The timed rows of a table written by --md, as the dicts ``plots`` takes."""
    results, floors = [], {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) != 10 or not cells[4].replace(".", "").isdigit():
                continue
            algo, dtype, shape, impl, full, dev, _, _, frac, _ = cells
            R, T = map(int, shape.split("x"))
            dev = None if dev == "-" else float(dev)
            if impl == "rl_triton":
                floors[(algo, dtype, R, T)] = float(frac.rstrip("%")) / 100 * dev
            results.append(dict(algo=algo, dtype=dtype, R=R, T=T, impl=impl, full=float(full), dev=dev))
    for r in results:
        r["floor"] = floors.get((r["algo"], r["dtype"], r["R"], r["T"]))
    return results


def plots(results, folder):
    """GAE device time per shape (ordered by T) per implementation, and rl_triton's fraction of
    the copy-bandwidth floor per shape and algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(folder, exist_ok=True)
    gae = [r for r in results if r["algo"] == "gae" and r["dtype"] == "float32" and r["dev"] is not None]
    shapes = sorted({(r["T"], r["R"]) for r in gae})
    fig, ax = plt.subplots(figsize=(10, 5))
    for k, impl in enumerate(dict.fromkeys(r["impl"] for r in gae)):
        pts = {(r["T"], r["R"]): r["dev"] for r in gae if r["impl"] == impl}
        xs = [i for i, s in enumerate(shapes) if s in pts]
        ax.plot(xs, [pts[shapes[i]] for i in xs], marker="o", ls=":" if k else "-", lw=2.5 if not k else 1, label=impl)
    ax.set_xticks(range(len(shapes)), [f"{R}x{T}" for T, R in shapes], rotation=45, ha="right")
    ax.set_yscale("log")
    ax.set_xlabel("rows x T, ordered by T")
    ax.set_ylabel("device time per call (us, CUDA-graph replay)")
    ax.set_title("GAE, float32: device time per shape (missing points: not capturable or too slow)")
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "gae_time_vs_T.png"), dpi=120)
    fig, ax = plt.subplots(figsize=(10, 5))
    ours = [r for r in results if r["impl"] == "rl_triton" and r["dtype"] == "float32" and r["dev"]]
    shapes = list(dict.fromkeys(f"{r['R']}x{r['T']}" for r in ours))
    algos = list(dict.fromkeys(r["algo"] for r in ours))
    width = 0.8 / max(len(algos), 1)
    for k, algo in enumerate(algos):
        vals = {f"{r['R']}x{r['T']}": r["floor"] / r["dev"] for r in ours if r["algo"] == algo}
        ax.bar([i + width * (k - (len(algos) - 1) / 2) for i in range(len(shapes))],
               [vals.get(s, 0) for s in shapes], width, label=algo)
    ax.set_xticks(range(len(shapes)), shapes, rotation=45, ha="right")
    ax.axhline(0.8, color="k", lw=0.8, ls="--")
    ax.set_ylabel("floor / device time")
    ax.set_title("rl_triton, float32: fraction of the copy-bandwidth floor (dashed: 80% target)")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "floor_fraction.png"), dpi=120)


if __name__ == "__main__":
    main()
