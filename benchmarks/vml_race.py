"""oneMKL's first-call race in torch's CPU unary ops, counted: fresh processes, each computing
``torch.exp`` of the same 8192 float32 numbers twice on the default intra-op threads, report
whether the first call differs from the second (rl_triton/core/vml.py; pytorch/pytorch#188792).
Half of the processes import rl_triton first (whose import resolves the kernels on one thread),
half do not; the two kinds alternate, so a busy phase of the machine meets both alike. A first
call of a process that imported rl_triton differing from its second fails the run (exit 1).

    python benchmarks/vml_race.py --processes 400      # pairs of processes; ~1% of plain ones differ here
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine, parser  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# one process: exp twice, the first result against the second, element by element
PROBE = """
import sys
import torch
if sys.argv[1] == "warmed":
    import rl_triton  # noqa: F401
x = torch.randn(8192, generator=torch.Generator().manual_seed(0)) * 0.5
first, second = torch.exp(x), torch.exp(x)
wrong = first != second
worst = ((first - second).abs() / second.abs()).max().item()
print(int(wrong.sum()), worst)
"""


def probe(kind: str) -> tuple[int, float]:
    """(elements whose first call differed, largest relative difference) of one fresh process."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", PROBE, kind], capture_output=True, text=True, env=env, check=True)
    wrong, worst = out.stdout.split()
    return int(wrong), float(worst)


def run(processes: int, out=print) -> bool:
    """Run ``processes`` pairs; print the counts; True where no warmed process differed."""
    bad = {"plain": [], "warmed": []}
    for i in range(processes):
        for kind in bad:
            wrong, worst = probe(kind)
            if wrong:
                bad[kind].append((i, wrong, worst))
    for kind, hits in bad.items():
        detail = "; ".join(f"process {i}: {w} of 8192 elements, up to {r:.1e} relative" for i, w, r in hits[:5])
        out(f"{kind:7s} {len(hits)} of {processes} first calls differed from the second" + (f" ({detail})" if hits
                                                                                             else ""))
    return not bad["warmed"]


def main(argv=None) -> int:
    p = parser(__doc__)
    p.add_argument("--processes", type=int, default=200, help="pairs of fresh processes (plain, warmed)")
    a = p.parse_args(argv)
    import torch

    print(f"{machine()}; torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, MKL "
          f"{torch.backends.mkl.is_available()}")
    ok = run(a.processes)
    if not ok:
        print("FAILED: a process that imported rl_triton got a first call unlike its second")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
