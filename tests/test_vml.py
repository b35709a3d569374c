"""rl_triton/core/vml.py: ``import rl_triton`` calls every op torch hands to oneMKL's VML once,
in float32 and float64, so that oneMKL's first-call race (pytorch/pytorch#188792) cannot reach a
later call; and benchmarks/vml_race.py's logic (it counts the race across fresh processes)."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RECORD_IMPORT = """
import torch
from torch.overrides import TorchFunctionMode

seen = set()


class Record(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args and isinstance(args[0], torch.Tensor):
            seen.add((getattr(func, "__name__", ""), str(args[0].dtype), args[0].numel()))
        return func(*args, **(kwargs or {}))


with Record():
    import rl_triton  # noqa: F401
from rl_triton.core import vml

print(sorted((op, dtype) for op in vml.OPS for dtype in ("torch.float32", "torch.float64")
             if (op, dtype, 1) not in seen))
"""


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL has no VML")
def test_the_import_calls_every_vml_op_once_in_both_precisions():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]))
    out = subprocess.run([sys.executable, "-c", RECORD_IMPORT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", f"not called at import: {out.stdout}"


def test_the_ops_the_library_computes_with_are_warmed():
    from rl_triton.core import vml

    assert {"exp", "log", "sqrt", "tanh"} <= set(vml.OPS)
    for op in vml.OPS:
        assert callable(getattr(torch, op))


def test_the_race_benchmark_counts_and_fails_on_a_warmed_process(monkeypatch):
    sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
    bench = importlib.import_module("vml_race")
    lines = []
    assert bench.run(1, out=lines.append)  # one real pair of fresh processes
    assert lines[0].split()[0] == "plain" and lines[1].split()[:2] == ["warmed", "0"]  # plain: 0, rarely 1
    monkeypatch.setattr(bench, "probe", lambda kind: (4096, 5.8e-5) if kind == "warmed" else (0, 0.0))
    lines = []
    assert not bench.run(2, out=lines.append)
    assert lines[1].startswith("warmed  2 of 2 first calls differed") and "4096 of 8192" in lines[1]
