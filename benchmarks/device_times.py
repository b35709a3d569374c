"""Device time (CUDA-graph replay) and full call of rl_triton alone on a few cells: the quick A/B
of engine changes. ``--root`` imports rl_triton from another checkout (say an older commit
unpacked with ``git archive``), so two versions can be timed in alternating processes of one
run and compared as ratios. The problems and the oracle are this checkout's whichever rl_triton is
timed (peers.py loads rl_triton/testing by its file path for another checkout's rl_triton, which
may predate it), so both versions run the same calls.

    python benchmarks/device_times.py --algos gae,vtrace --shapes 16384x4096,32768x8 [--root DIR] [--json F]
    python benchmarks/device_times.py --compare OLD.json NEW.json [MORE.json ...]   # ratios
    python benchmarks/device_times.py --against DIR [--rounds 3] [--json F]          # A/B in one process

``--against DIR`` times this checkout's rl_triton and the one in ``DIR/rl_triton`` (loaded under the
name ``rl_triton_base``, its torch op namespace renamed to match) in one process: per cell both are
checked against the oracle, then their device times alternate for ``--rounds`` rounds; the ratio
base / new is taken within each round (median, lowest-highest; above 1: this checkout is faster).
Cells more than 2% slower are listed at the end; the exit status is 1 if either version fails or
is wrong in a cell.
"""

from __future__ import annotations

import json
import os
import sys

from common import parser


def main():
    p = parser(__doc__)
    p.add_argument("--algos", default="gae,td_lambda_return,discounted_return,vtrace,retrace,eligibility_trace",
                   help="estimators to time")
    p.add_argument("--shapes", default="16384x4096,4096x4096,16384x512,4096x128,32768x8,8x32768,1x131072",
                   help="ROWSxT list")
    p.add_argument("--root", help="directory holding the rl_triton package to time")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--label", default="", help="name of this run in the --json file")
    p.add_argument("--compare", nargs="+", help="print old/new ratios of result files (first is the base)")
    p.add_argument("--against", metavar="DIR", help="A/B against the rl_triton in DIR, alternating in this process")
    p.add_argument("--rounds", type=int, default=3, help="--against: alternating rounds per cell")
    p.add_argument("--warm-only", action="store_true",
                   help="--against: call each version once per cell (compiling into Triton's cache), no timing")
    p.add_argument("--shard", default="0/1", help="--against: K/N, the K-th of N interleaved parts of the cells")
    args = p.parse_args()
    if args.compare:
        return compare(args.compare)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(here, "..")]
    if args.against:
        return against(args)
    if args.root:
        sys.path.insert(0, os.path.abspath(args.root))
    import torch

    import rl_triton
    from peers import Problem, max_error
    from run import copy_bandwidth_tbs, device_us, full_call_us

    bandwidth = copy_bandwidth_tbs()
    print(f"{args.label or rl_triton.__file__}: copy {bandwidth:.2f} TB/s", flush=True)
    results = []
    for algo in args.algos.split(","):
        for shape in args.shapes.split(","):
            R, T = map(int, shape.split("x"))
            prob = Problem(algo, R, T)
            try:
                err = max_error(prob.call(), prob.expected(8))
                dev = device_us(prob.call)
                full = full_call_us(prob.call)
            except Exception as e:  # a failing cell is reported; the others still run
                print(f"  {algo:18s} {shape:>11s} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
                continue
            floor = prob.nbytes / bandwidth / 1e6
            results.append(dict(algo=algo, shape=shape, device_us=dev, full_us=full, floor_frac=floor / dev, err=err))
            print(f"  {algo:18s} {shape:>11s} device {dev:8.2f} us  full {full:7.1f} us  floor {floor / dev:5.0%}"
                  f"  err {err:.1e}", flush=True)
            del prob
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(label=args.label, bandwidth=bandwidth, results=results), f)


def load_base(folder):
    """``folder/rl_triton`` imported as ``rl_triton_base`` from a copy whose torch op namespace
    ``rl_triton::`` is renamed (two packages cannot register the same custom ops)."""
    import importlib
    import shutil
    import tempfile

    root = tempfile.mkdtemp()
    dst = os.path.join(root, "rl_triton_base")
    shutil.copytree(os.path.join(folder, "rl_triton"), dst, ignore=shutil.ignore_patterns("__pycache__"))
    for dirpath, _, files in os.walk(dst):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path) as f:
                    text = f.read()
                with open(path, "w") as f:
                    f.write(text.replace('"rl_triton::', '"rl_triton_base::'))
    sys.path.insert(0, root)
    return importlib.import_module("rl_triton_base")


def against(args):
    import statistics

    import torch

    import rl_triton
    from common import ratios, spread
    from peers import Problem, max_error
    from run import copy_bandwidth_tbs, device_us

    base = load_base(args.against)
    bandwidth = copy_bandwidth_tbs() if not args.warm_only else float("nan")
    print(f"A/B: {rl_triton.__file__} (new) against {base.__file__} (base); copy {bandwidth:.2f} TB/s; "
          f"{args.rounds} rounds alternating; device us, median (lowest-highest)", flush=True)
    print("| algo | shape | base us | new us | base / new | new floor |\n|---|---|---|---|---|---|", flush=True)
    results, bad = [], []
    k, n = map(int, args.shard.split("/"))
    cells = [(a, s) for a in args.algos.split(",") for s in args.shapes.split(",")][k::n]
    for algo, shape in cells:
        R, T = map(int, shape.split("x"))
        prob = Problem(algo, R, T)
        p = prob.problem
        impls = {"base": lambda p=p: getattr(base, p.fn)(*p.args, **p.kwargs),
                 "new": lambda p=p: getattr(rl_triton, p.fn)(*p.args, **p.kwargs)}
        expected = prob.expected(8)
        errs = {}
        for name, fn in impls.items():
            try:
                errs[name] = max_error(fn(), expected)
            except Exception as e:
                errs[name] = f"{type(e).__name__}: {str(e)[:200]}"
        if args.warm_only:
            continue
        if not all(isinstance(e, float) and e <= 1e-4 for e in errs.values()):
            bad.append(f"{algo} {shape}: {errs}")
            print(f"| {algo} | {shape} | FAILED or WRONG: {errs} | | | |", flush=True)
            continue
        times = {name: [] for name in impls}
        for r in range(args.rounds):
            for name in (("base", "new") if r % 2 == 0 else ("new", "base")):
                times[name].append(device_us(impls[name], reps=5))
        ratio = ratios(times["base"], times["new"])
        floor = prob.nbytes / bandwidth / 1e6
        new_us = statistics.median(times["new"])
        results.append(dict(algo=algo, shape=shape, base_us=times["base"], new_us=times["new"], ratio=ratio,
                            floor_frac=floor / new_us, err=errs["new"]))
        print(f"| {algo} | {shape} | {spread(times['base'], '{:.2f}')} | {spread(times['new'], '{:.2f}')} | "
              f"{spread(ratio, '{:.3f}', 'x')} | {floor / new_us:.0%} |", flush=True)
        del prob, impls
        torch.cuda.empty_cache()
    slower = [f"{r['algo']} {r['shape']} {statistics.median(r['ratio']):.3f}x" for r in results
              if statistics.median(r["ratio"]) < 0.98]
    faster = [f"{r['algo']} {r['shape']} {statistics.median(r['ratio']):.2f}x" for r in results
              if statistics.median(r["ratio"]) > 1.02]
    print(f"\n{len(results)} cells timed; more than 2% slower: {', '.join(slower) or 'none'}; "
          f"more than 2% faster: {', '.join(faster) or 'none'}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(label=args.label, bandwidth=bandwidth, results=results, bad=bad), f)
    if bad:
        print("FAILED or WRONG: " + "; ".join(bad), flush=True)
        raise SystemExit(1)


def compare(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    base = {(r["algo"], r["shape"]): r for r in runs[0]["results"]}
    labels = " | ".join(f"{run['label']} device (x), full (x)" for run in runs[1:])
    print(f"| algo | shape | {runs[0]['label']} device us, full us, floor | {labels} |")
    print("|---|---|---|" + "---|" * (len(runs) - 1))
    for key, b in base.items():
        cells = []
        for run in runs[1:]:
            r = next((x for x in run["results"] if (x["algo"], x["shape"]) == key), None)
            cells.append("-" if r is None else f"{r['device_us']:.2f} ({b['device_us'] / r['device_us']:.2f}x), "
                         f"{r['full_us']:.1f} ({b['full_us'] / r['full_us']:.2f}x), {r['floor_frac']:.0%}")
        print(f"| {key[0]} | {key[1]} | {b['device_us']:.2f}, {b['full_us']:.1f}, {b['floor_frac']:.0%} | "
              + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
