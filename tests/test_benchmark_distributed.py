"""benchmarks/distributed.py on two gloo ranks of this machine (tiny shapes, few calls): its
table, and its check of the sharded result against all-gather-then-scan, which fails the run
when they differ."""

import importlib
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "benchmarks")]
bench = importlib.import_module("distributed")

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


def test_the_benchmark_runs_on_gloo_ranks():
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "distributed.py"), "--world", "2",
                             "--shapes", "4x64,2x256", "--rounds", "2", "--batch-s", "0.001", "--max-calls", "2"],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("| 4x64 |") or line.startswith("| 2x256 |")]
    assert len(lines) == 2, result.stdout
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 13 and float(cells[-1]) <= bench.TOLERANCE["float32"], line


def test_a_sharded_result_off_the_baseline_fails_the_run():
    got = (torch.tensor([1.0, 2.0]), torch.tensor([0.0]))
    want = (torch.tensor([1.0, 2.5]), torch.tensor([0.0]))
    assert bench.relative_error(got, want) == pytest.approx(0.5 / 3.5)
    rows = [("4x64", {}, 0, 0, 1e-3, {}, None), ("2x256", {}, 0, 0, 1e-6, {}, None),
            ("8x64", {}, 0, 0, float("nan"), {}, None)]
    assert bench.failures(rows, "float32") == ["4x64", "8x64"]
    assert bench.failures(rows, "float64") == ["4x64", "2x256", "8x64"]
