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


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_the_benchmark_runs_on_gloo_ranks(layout):
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "distributed.py"), "--world", "2",
                             "--shapes", "4x64,2x256", "--rounds", "2", "--batch-s", "0.001", "--max-calls", "2",
                             "--layout", layout],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{layout} layout" in result.stdout, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith("| 4x64 |") or line.startswith("| 2x256 |")]
    assert len(lines) == 2, result.stdout
    for line, (B, T) in zip(lines, ((4, 64), (2, 256))):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 14, line
        assert float(cells[-2]) <= bench.TOLERANCE["float32"] and float(cells[-1]) <= bench.TOLERANCE["float32"], line
        # the all-gather hands on the rank's rewards and values (float32) and done flags (bool)
        assert int(cells[-3]) == T // 2 * B * (4 + 4 + 1), line


def test_the_zigzag_pieces_and_the_oracle_check():
    """The layout the benchmark gives each rank is Megatron's; its oracle check takes the rank's
    pieces of the whole rollout (a rank's own outputs from the unsharded call agree, another
    rank's do not)."""
    assert bench.held("zigzag", 3) == [[0, 5], [1, 4], [2, 3]]
    assert bench.held("contiguous", 3) == [[0], [1], [2]]
    import rl_triton

    pieces, B, T = bench.held("zigzag", 2), 3, 16
    r, v, d = (torch.cat(xs) for xs in zip(*(bench._piece(B, T // 4, i, torch.float64, 0) for i in range(4))))
    boot = bench._chunk(B, T, pieces, 0, torch.float64, torch.device("cpu"))[3]
    whole = rl_triton.gae(r, v, done=d, bootstrap_value=boot, time_dim=0)
    for rank in (0, 1):
        mine = torch.tensor(pieces[rank])
        got = [x.view(4, T // 4, B)[mine].reshape(-1, B) for x in whole]
        assert torch.equal(bench._chunk(B, T, pieces, rank, torch.float64, torch.device("cpu"))[0],
                           r.view(4, T // 4, B)[mine].reshape(-1, B))
        assert bench.oracle_error(got, B, T, pieces, rank, torch.float64) <= 1e-12
        assert bench.oracle_error(got, B, T, pieces, 1 - rank, torch.float64) > 1e-3


def test_a_sharded_result_off_the_baseline_fails_the_run():
    got = (torch.tensor([1.0, 2.0]), torch.tensor([0.0]))
    want = (torch.tensor([1.0, 2.5]), torch.tensor([0.0]))
    assert bench.relative_error(got, want) == pytest.approx(0.5 / 3.5)
    rows = [("4x64", {}, 0, 0, 1e-3, {}, None, None), ("2x256", {}, 0, 0, 1e-6, {}, None, None),
            ("8x64", {}, 0, 0, float("nan"), {}, None, None), ("8x128", {}, 0, 0, 1e-6, {}, None, 1e-3)]
    assert bench.failures(rows, "float32") == ["4x64", "8x64", "8x128"]
    assert bench.failures(rows, "float64") == ["4x64", "2x256", "8x64", "8x128"]


def slime_table(title, *extra):
    """``--layout slime`` on 2 gloo ranks at 4x64 and 2x301 (prompts of 7 tokens), its table
    titled ``title`` checked: per shape, ``(B, T, cells)`` of a row within tolerance of slime's
    result and of the oracle."""
    env = {**os.environ, "NUMBA_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "distributed.py"), "--world", "2",
                             "--shapes", "4x64,2x301", "--prompt", "7", "--rounds", "2", "--batch-s", "0.001",
                             "--max-calls", "2", "--layout", "slime", *extra],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"slime's context-parallel {title} over 2 rank(s)" in result.stdout, result.stdout
    lines = [line for line in result.stdout.splitlines() if line.startswith(("| 4x64 |", "| 2x301 |"))]
    assert len(lines) == 2, result.stdout
    rows = []
    for line, (B, T) in zip(lines, ((4, 64), (2, 301))):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 9, line
        assert float(cells[-2]) <= bench.TOLERANCE["float32"] and float(cells[-1]) <= bench.TOLERANCE["float32"], line
        rows.append((B, T, cells))
    return rows


def test_the_slime_layout_runs_on_gloo_ranks():
    """``--layout slime``: the drop-in's sharded call against slime's all-gather path (transcribed)
    on slime's pieces of each response; the table's bytes are the drop-in's maps (7 numbers a row
    and a flag, per piece) against slime's all-reduce of every response's values and rewards."""
    for B, T, cells in slime_table("GAE"):
        assert int(cells[-4]) == 2 * (B * 7 * 4 + 4), cells
        assert int(cells[-3]) == 2 * B * T * 4, cells


def test_the_slime_layout_times_reinforce_plus_plus_returns():
    """``--layout slime --estimator reinforce++``: the sharded REINFORCE++ returns against slime's
    all-gather path (transcribed); the bytes are the zig-zag exchange of a discounted return (3
    numbers a row and a flag, per piece) against slime's all-reduce of every response's KL."""
    for B, T, cells in slime_table("REINFORCE++ returns", "--estimator", "reinforce++"):
        assert int(cells[-4]) == 2 * (B * 3 * 4 + 4), cells
        assert int(cells[-3]) == B * T * 4, cells
