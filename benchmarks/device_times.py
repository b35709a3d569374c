"""Device time (CUDA-graph replay) and full call of rl_triton alone on a few cells: the quick A/B
of engine changes. ``--root`` imports rl_triton from another checkout (say an older commit
unpacked with ``git archive``), so two versions can be timed in alternating processes of one
run and compared as ratios. The problems and the oracle are this checkout's whichever rl_triton is
timed (peers.py loads rl_triton/testing by its file path for another checkout's rl_triton, which
may predate it), so both versions run the same calls.

    python benchmarks/device_times.py --algos gae,vtrace --shapes 16384x4096,32768x8 [--root DIR] [--json F]
    python benchmarks/device_times.py --compare OLD.json NEW.json [MORE.json ...]   # ratios
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
    args = p.parse_args()
    if args.compare:
        return compare(args.compare)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.join(here, "..")]
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
