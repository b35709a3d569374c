"""What ``import rl_triton`` adds to ``import torch``, in fresh interpreters.

Each round starts a fresh process that imports torch and then rl_triton and reports the seconds
the second import took (measured inside the process: the interpreter's start-up and torch's own
import are left out). The script prints the median and spread over the rounds, and with ``--importtime`` the slowest
modules that ``python -X importtime`` lists under ``rl_triton``. ``--root`` times another
checkout (it goes first on ``PYTHONPATH``).

    python benchmarks/import_time.py [--rounds 5] [--importtime] [--root ../other-checkout]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import parser  # noqa: E402

_TIMED = ("import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); {extra}; "
          "print(time.perf_counter() - t, time.perf_counter() - t1)")


# the processes start outside any checkout: ``python -c`` puts its working directory first on sys.path
_CWD = tempfile.gettempdir()


def _env(root: str | None) -> dict:
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (os.path.abspath(root), env.get("PYTHONPATH"))))
    return env


def seconds(extra: str, root: str | None = None) -> tuple[float, float]:
    """(the imports' seconds in all, the seconds of ``extra`` after ``import torch``) in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _TIMED.format(extra=extra or "pass")], env=_env(root),
                         cwd=_CWD, check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), float(out[1])


def added_seconds(rounds: int, root: str | None = None) -> list[float]:
    """Per fresh process: the seconds ``import rl_triton`` takes after ``import torch``."""
    return [seconds("import rl_triton", root)[1] for _ in range(rounds)]


def slowest_modules(root: str | None = None, top: int = 10) -> list[tuple[float, str]]:
    """The modules whose cumulative import time under ``import rl_triton`` is largest (seconds, name)."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", "import torch; import rl_triton"],
                         env=_env(root), cwd=_CWD, check=True, capture_output=True, text=True).stderr
    lines = err.splitlines()
    start = max(i for i, line in enumerate(lines) if line.rstrip().endswith("| torch")) + 1
    rows = []
    for line in lines[start:]:
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cumulative, name = line[len("import time:"):].split("|")
        rows.append((int(cumulative) / 1e6, name.rstrip()))
    return sorted(rows, reverse=True)[:top]


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=5, help="fresh process pairs")
    ap.add_argument("--importtime", action="store_true", help="also list the slowest modules")
    ap.add_argument("--root", default=None, help="checkout to time instead of the installed rl_triton")
    args = ap.parse_args(argv)
    added = added_seconds(args.rounds, args.root)
    print(f"import rl_triton after import torch: median {statistics.median(added):.3f} s "
          f"(spread {min(added):.3f}-{max(added):.3f} s, {args.rounds} rounds)")
    if args.importtime:
        for s, name in slowest_modules(args.root):
            print(f"  {s:7.3f} s  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
