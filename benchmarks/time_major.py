"""Time-major rollouts (``[T, N]``, environments contiguous, ``time_dim=0``) beside the same data
batch-major (``[N, T]`` contiguous), per algorithm and shape, with the floor (issue 39).

    python benchmarks/time_major.py [--algos gae,vtrace|all] [--shapes 512x4096,2048x8] [--md FILE]
    python benchmarks/time_major.py --force walk=0,block_r=128,block_t=8 [--algos gae]
    python benchmarks/time_major.py --sweep [--candidates "walk=1,block_r=64;walk=0,block_t=4"] [--algos gae]
    TRITON_INTERPRET=1 python benchmarks/time_major.py --device cpu --shapes 9x5   # the checks alone

Shapes are T x N. By default every shape of the issue's table, and for V-trace besides RLlib's
``[50, 256-4096]``; algorithms by default GAE, V-trace, masked GAE and the forward affine scan
(``--algos all`` for every one; the sweep GAE alone). Each cell draws one problem (catalog
variant ``done`` where the function has one: done flags, implied next values; float32 unless
``--dtype``), calls it time-major and on the same data batch-major, and checks both against the
float64 oracle (rl_triton.testing) on a spread of rows (the first and last, and the edges of 32, 64, 128 and 256-row blocks); a cell
that fails or disagrees is reported, not timed, and the run ends with exit status 1. Device time
is benchmarks/run.py's ``device_us`` (median CUDA-graph replay of 20 calls); the floor is the
bytes each input is read and each output written once, at the copy bandwidth measured in the
run (``copy_bandwidth_tbs``). Ratios: time-major / batch-major (the median of ``--rounds``
rounds, each timing both) and time-major / floor. The targets (issue 39): time-major at most
1.15x batch-major, and at most 1.3x the floor where the floor passes 10 us; a cell that misses
one is marked ``MISS`` (the exit status stays 0 for misses).

``--force KEY=VAL,...`` times the time-major call under ``kernels.forced_plan`` (keys:
block_r, block_t, n_seg, num_warps, walk, vec, warps, prev_mem, time_major); the batch-major call keeps
its plan. ``--sweep`` times each of ``--candidates`` (``;``-separated forced plans; by default
the regime off and eight WALK and scan-tile plans) on the time-major call of every cell, each
checked first, and prints the best per cell beside the default plan.

On the CPU (``--device cpu``, with ``TRITON_INTERPRET=1`` set before the run) the cells are
checked and nothing is timed.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys

import numpy as np
import torch

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_here, os.path.join(_here, "..")]
import rl_triton  # noqa: E402
from common import parser  # noqa: E402
from rl_triton.core import kernels, plans  # noqa: E402
from rl_triton.testing import make, oracle  # noqa: E402

SHAPES = ["24x4096", "32x65536", "128x1024", "256x256", "2048x8", "2048x64", "128x65536", "512x4096", "4096x1024",
          "32768x256"]
VTRACE_SHAPES = ["50x256", "50x1024", "50x4096"]  # RLlib's V-trace
GAMMA, LMBDA = 0.99, 0.95
# name -> (function, catalog variant, keyword arguments); masked_gae is GAE with a response mask
ALGOS = {
    "gae": ("gae", "done", dict(gamma=GAMMA, lmbda=LMBDA)),
    "td_lambda_return": ("td_lambda_return", "done", dict(gamma=GAMMA, lmbda=LMBDA)),
    "discounted_return": ("discounted_return", "done", dict(gamma=GAMMA)),
    "vtrace": ("vtrace", "done", dict(gamma=GAMMA)),
    "retrace": ("retrace", "done", dict(gamma=GAMMA)),
    "eligibility_trace": ("eligibility_trace", "done", dict(gamma=GAMMA, lmbda=0.9)),
    "episodic_cumsum": ("episodic_cumsum", "done", {}),
    "affine_scan": ("affine_scan", "reverse", {}),
    "affine_scan_forward": ("affine_scan", "forward", {}),
    "arrival_gae": ("arrival_gae", "ratio+done", dict(gamma=GAMMA, lmbda=LMBDA)),
    "masked_gae": ("gae", None, dict(gamma=GAMMA, lmbda=LMBDA)),
}
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-10}
TARGET_BATCH, TARGET_FLOOR, FLOOR_FROM_US = 1.15, 1.3, 10.0
# the sweep's forced plans (besides the default, WALK 3 of 32 rows and 8 steps): the regime off
# (the plan of every layout), WALK 2 with chunks of 8 steps, WALK 3 with chunks of 16, of 256 rows
# and 16 steps, and splitting time for 1056 and 2112 warps (eight and sixteen per multiprocessor
# on the H200), WALK 4 (a chunk ahead) with chunks of 8 (16 takes triton 3.6 about 24 s a kernel
# to compile), and the scan across the lanes of tiles, of one warp and of 32 rows x 64 steps in
# four warps
CANDIDATES = ("time_major=0;walk=2,block_t=8;walk=3,block_t=16;walk=3,block_r=256,block_t=16;walk=3,warps=1056;"
              "walk=3,warps=2112;walk=4,block_t=8;walk=0;walk=0,block_r=32,block_t=64,num_warps=4")
DEFAULT_ALGOS = "gae,vtrace,masked_gae,affine_scan_forward"  # reverse, y one step back, two-state, forward
SWEEP_ALGOS = "gae"


def parse_plan(text: str) -> dict:
    """``KEY=VAL,...`` as forced_plan's keyword arguments (integers)."""
    plan = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"a forced plan is KEY=VAL,...; got {item!r}")
        plan[key.strip()] = int(value)
    return plan


def check_rows(N: int) -> list:
    """The rows checked against the oracle: the first and last, and both sides of the edges of
    blocks of 32 to 256 rows."""
    picks = {0, 1, N // 2, N - 1}
    for edge in (32, 64, 128, 256):
        picks.update((edge - 1, edge))
    return sorted(r for r in picks if 0 <= r < N)


class Cell:
    """One algorithm on ``[T, N]`` data: the time-major call, the same data batch-major, the
    oracle on :func:`check_rows`, the bytes moved once."""

    def __init__(self, algo: str, T: int, N: int, device, dtype=torch.float32, seed: int = 0):
        self.algo, self.T, self.N = algo, T, N
        fn, variant, kw = ALGOS[algo]
        self.rows = check_rows(N)
        if algo == "masked_gae":
            g = torch.Generator().manual_seed(seed)
            r, v = (torch.randn(T, N, generator=g, dtype=torch.float64).to(dtype) for _ in range(2))
            mask = torch.rand(T, N, generator=g) < 0.8
            boot = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)
            self.args = tuple(x.to(device) for x in (r, v))
            self.kwargs = dict(mask=mask.to(device), bootstrap_value=boot.to(device), **kw)
            pick = (slice(None), self.rows)
            want = oracle.gae_masked(r[pick].t().double().numpy(), v[pick].t().double().numpy(), mask[pick].t().numpy(),
                                     np.full((len(self.rows), T), GAMMA), np.full((len(self.rows), T), LMBDA),
                                     bootstrap=boot[self.rows].double().numpy())
            self.expected = tuple(w.T for w in want)  # time-major, the rows checked
        else:
            problem = make(fn, (T, N), variant, time_dim=0, dtype=dtype, device=device, seed=seed, p_trunc=0.0,
                           **{k: v for k, v in kw.items() if k in ("gamma", "lmbda")})
            self.args, self.kwargs = problem.args, {k: v for k, v in problem.kwargs.items() if k != "time_dim"}
            self.expected = problem.rows(self.rows).expected()
        self.fn = getattr(rl_triton, fn)
        self.batch_args = tuple(self._batch_major(x) for x in self.args)
        self.batch_kwargs = {k: self._batch_major(x) for k, x in self.kwargs.items()}
        n_out = 2 if fn in ("gae", "vtrace") else 1
        tensors = [x for x in (*self.args, *self.kwargs.values()) if isinstance(x, torch.Tensor)]
        self.nbytes = sum(x.numel() * x.element_size() for x in tensors) + n_out * T * N * self.args[0].element_size()

    def _batch_major(self, x):
        """A per-step ``[T, N, ...]`` tensor as contiguous ``[N, T, ...]``; others as they are."""
        if isinstance(x, torch.Tensor) and x.dim() >= 2 and tuple(x.shape[:2]) == (self.T, self.N):
            return x.transpose(0, 1).contiguous()
        return x

    def time_major(self):
        return _tuple(self.fn(*self.args, **self.kwargs, time_dim=0, backend="triton"))

    def batch_major(self):
        return _tuple(self.fn(*self.batch_args, **self.batch_kwargs, backend="triton"))

    def error(self, outputs, batch_major: bool = False) -> float:
        """max |y - ref| / (1 + |ref|) over the rows checked (NaN where any output is NaN there)."""
        worst = 0.0
        for y, ref in zip(outputs, self.expected):
            y = (y[self.rows].t() if batch_major else y[:, self.rows]).double().cpu().numpy()
            err = float(np.max(np.abs(y - ref) / (1.0 + np.abs(ref))))
            if np.isnan(err):
                return err
            worst = max(worst, err)
        return worst


def _tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _forced(plan: dict):
    return kernels.forced_plan(**plan) if plan else contextlib.nullcontext()


def planned_config(cell: Cell, plan: dict) -> str:
    """The time-major launch the plan picks for ``cell`` (under ``plan``), in words."""
    seen = []
    real = kernels._launch_config

    def record(*args, **kwargs):
        config = real(*args, **kwargs)
        seen.append(config)
        return config

    kernels._launch_config = record
    try:
        with _forced(plan):
            cell.time_major()
    finally:
        kernels._launch_config = real
    if not seen:
        return "-"
    c = seen[-1]
    walk, vec = c.constexprs[0][-2], c.constexprs[0][9]
    return (f"{f'walk{walk}' if walk else f'lanes vec={vec}'} r{c.block_r} t{c.block_t} seg{c.n_seg} "
            f"w{c.num_warps}")


def measure(cell: Cell, timer, plan: dict, rounds: int, tol: float, batch_us: float | None = None) -> dict:
    """Check both layouts against the oracle, then time them (``timer(fn)``: device us per call,
    or None for no timing); ``plan`` forces the time-major call's plan; ``batch_us``: the
    batch-major call's time, measured before (then timed no more)."""

    def tm():
        with _forced(plan):
            return cell.time_major()

    out = dict(algo=cell.algo, shape=f"{cell.T}x{cell.N}", plan=planned_config(cell, plan))
    try:
        errs = (cell.error(tm()), cell.error(cell.batch_major(), batch_major=True))
    except Exception as e:  # a failing cell is reported; the others still run
        return dict(out, status=f"FAILED: {type(e).__name__}: {str(e)[:300]}")
    out["err"] = max(errs)
    if not all(err <= tol for err in errs):  # NaN fails too
        return dict(out, status=f"WRONG: error {errs[0]:.2e} time-major, {errs[1]:.2e} batch-major > {tol:g}")
    out["status"] = "ok"
    if timer is None:
        return out
    times = [(timer(tm), batch_us or timer(cell.batch_major)) for _ in range(rounds)]
    out["tm_us"] = statistics.median(t for t, _ in times)
    out["bm_us"] = statistics.median(b for _, b in times)
    out["ratio"] = statistics.median(t / b for t, b in times)
    return out


def verdict(result: dict, floor_us: float | None) -> str:
    """Whether a timed cell meets the issue's targets: ``ok`` or ``MISS (...)``."""
    if "ratio" not in result:
        return "-"
    misses = []
    if result["ratio"] > TARGET_BATCH:
        misses.append(f"> {TARGET_BATCH}x batch-major")
    if floor_us is not None and floor_us > FLOOR_FROM_US and result["tm_us"] > TARGET_FLOOR * floor_us:
        misses.append(f"> {TARGET_FLOOR}x floor")
    return "ok" if not misses else "MISS (" + ", ".join(misses) + ")"


def row(result: dict, floor_us: float | None) -> str:
    if result["status"] != "ok":
        return f"| {result['algo']} | {result['shape']} | {result['plan']} | {result['status']} |||||"
    if "ratio" not in result:
        return f"| {result['algo']} | {result['shape']} | {result['plan']} | checked ({result['err']:.1e}) |||||"
    floor = f"{floor_us:.1f}" if floor_us is not None else "-"
    to_floor = f"{result['tm_us'] / floor_us:.2f}x" if floor_us else "-"
    return (f"| {result['algo']} | {result['shape']} | {result['plan']} | {floor} | {result['tm_us']:.2f} | "
            f"{result['bm_us']:.2f} | {result['ratio']:.2f}x | {to_floor} | {verdict(result, floor_us)} |")


HEADER = ["| algorithm | T x N | time-major plan | floor us | time-major us | batch-major us | time / batch "
          "| time / floor | targets |", "|---|---|---|---|---|---|---|---|---|"]


def cells_of(args) -> list:
    algos = args.algos.split(",")
    unknown = [a for a in algos if a not in ALGOS]
    if unknown:
        raise SystemExit(f"unknown --algos {unknown}; known: {','.join(ALGOS)}")
    out = []
    for algo in algos:
        shapes = args.shapes.split(",") if args.shapes else SHAPES + (VTRACE_SHAPES if algo == "vtrace" else [])
        out += [(algo, *map(int, s.split("x"))) for s in shapes]
    return out


def sweep(cell: Cell, timer, candidates: list, tol: float, floor_us) -> list:
    """The default plan and every candidate on the time-major call of ``cell``, each checked, then
    timed; lines of a table, the best candidate marked."""
    timed = [({}, measure(cell, timer, {}, 1, tol))]
    for plan in candidates:  # the batch-major call timed once, with the default plan
        timed.append((plan, measure(cell, timer, plan, 1, tol, timed[0][1].get("bm_us"))))
    ok = [(p, r) for p, r in timed if r["status"] == "ok" and "tm_us" in r]
    best = min(ok[1:], key=lambda pr: pr[1]["tm_us"], default=None)
    lines = []
    for plan, r in timed:
        name = "default" if not plan else ",".join(f"{k}={v}" for k, v in plan.items())
        mark = " (best)" if best is not None and plan is best[0] else ""
        if r["status"] != "ok":
            lines.append(f"| {cell.algo} | {cell.T}x{cell.N} | {name}{mark} | {r['status']} ||")
        elif "tm_us" in r:
            lines.append(f"| {cell.algo} | {cell.T}x{cell.N} | {name}{mark} | {r['plan']} | {r['tm_us']:.2f} | "
                         f"{r['bm_us']:.2f} | {r['ratio']:.2f}x |")
        else:
            lines.append(f"| {cell.algo} | {cell.T}x{cell.N} | {name} | {r['plan']} | checked ||")
    if best is not None:
        lines.append(f"best for {cell.algo} {cell.T}x{cell.N}: {','.join(f'{k}={v}' for k, v in best[0].items())} "
                     f"{best[1]['tm_us']:.2f} us against default {timed[0][1].get('tm_us', float('nan')):.2f} us, "
                     f"batch-major {best[1]['bm_us']:.2f} us")
    return lines, [r for _, r in timed]


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--algos", help=f"algorithms, keys of ALGOS or all (default: {DEFAULT_ALGOS}; with --sweep "
                                   f"{SWEEP_ALGOS})")
    p.add_argument("--shapes", default="", help="T x N list (default: the issue's table, V-trace's besides)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="data dtype")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda (timed) or cpu (checked only, in the Triton interpreter)")
    p.add_argument("--rounds", type=int, default=3, help="rounds timing both layouts, per cell")
    p.add_argument("--force", default="", help="KEY=VAL,... forced on the time-major call")
    p.add_argument("--sweep", action="store_true", help="time --candidates on the time-major call of each cell")
    p.add_argument("--candidates", default=CANDIDATES, help="--sweep: forced plans, ';'-separated")
    p.add_argument("--md", help="write the table here")
    p.add_argument("--regime", choices=["default", "on", "off"],
                   help="the time-major regime for this run: default, the library's rule "
                        "(kernels.time_major_regime_wins); on, at every shape; off, the plan of every layout "
                        "(kernels.TIME_MAJOR_REGIME off). Default: on with --sweep, else default")
    args = p.parse_args(argv)
    args.regime = args.regime or ("on" if args.sweep else "default")
    previous = kernels.TIME_MAJOR_REGIME, kernels.time_major_regime_wins
    kernels.TIME_MAJOR_REGIME = args.regime != "off"
    if args.regime == "on":
        kernels.time_major_regime_wins = _always
    plans.clear()  # no call plan made under the other setting
    try:
        return _run(args)
    finally:
        kernels.TIME_MAJOR_REGIME, kernels.time_major_regime_wins = previous
        plans.clear()


def _always(R: int, T: int) -> bool:
    """``--regime on``: the time-major regime at every shape."""
    return True


def _run(args) -> int:
    """The run of :func:`main`'s parsed ``args``; the exit status."""
    args.algos = args.algos or (SWEEP_ALGOS if args.sweep else DEFAULT_ALGOS)
    if args.algos == "all":
        args.algos = ",".join(ALGOS)
    dtype = getattr(torch, args.dtype)
    tol = TOLERANCE[dtype]
    device = torch.device(args.device)
    if device.type == "cuda":
        from run import copy_bandwidth_tbs, device_us

        bandwidth = copy_bandwidth_tbs()
        timer = device_us
        lines = [f"Device: {torch.cuda.get_device_name()}, copy bandwidth (read + write) {bandwidth:.2f} TB/s, "
                 f"{args.dtype}"]
    else:
        if not kernels.INTERPRET:
            raise SystemExit("--device cpu runs the Triton interpreter: set TRITON_INTERPRET=1 before the run")
        bandwidth, timer = None, None
        lines = [f"CPU, Triton interpreter: checks only, {args.dtype}"]
    forced = parse_plan(args.force)
    candidates = [parse_plan(c) for c in args.candidates.split(";") if c.strip()]
    lines.append(f"time-major regime: {args.regime}")
    if forced:
        lines.append(f"time-major calls forced: {forced}")
    lines += [""] + (["| algorithm | T x N | candidate | plan | time-major us | batch-major us | time / batch |",
                      "|---|---|---|---|---|---|---|"] if args.sweep else HEADER)
    print("\n".join(lines), flush=True)
    failed = []
    for algo, T, N in cells_of(args):
        cell = Cell(algo, T, N, device, dtype, seed=T * 7 + N)
        floor_us = cell.nbytes / bandwidth / 1e6 if bandwidth else None
        if args.sweep:
            cell_lines, results = sweep(cell, timer, candidates, tol, floor_us)
        else:
            results = [measure(cell, timer, forced, args.rounds, tol)]
            cell_lines = [row(results[0], floor_us)]
        failed += [f"{r['algo']} {r['shape']} {r['plan']}: {r['status']}" for r in results if r["status"] != "ok"]
        lines += cell_lines
        print("\n".join(cell_lines), flush=True)
        del cell
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if failed:
        tail = [f"FAILED or WRONG in {len(failed)} cell(s): " + "; ".join(failed)]
        lines += tail
        print("\n".join(tail), flush=True)
    if args.md:
        with open(args.md, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
