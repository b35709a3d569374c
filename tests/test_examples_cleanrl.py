"""The CleanRL-style examples run end to end on a tiny budget with both GAE switches, and the
synthetic benchmark runs on one small shape; all write their outputs."""

import os
import subprocess
import sys

import pytest
from test_examples import assert_clean_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(path, args, cwd):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, os.path.join(ROOT, path), *args], capture_output=True, text=True,
                            env=env, timeout=300, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert_clean_log(result.stderr, cwd)
    return result.stdout


@pytest.mark.parametrize("fast", [True, False], ids=["fast-gae", "no-fast-gae"])
@pytest.mark.parametrize(
    "script,args,modules",
    [
        ("cleanrl_ppo_continuous.py", ["--num-steps", "128", "--total-timesteps", "512", "--num-minibatches", "4",
                                       "--update-epochs", "2"], ("mujoco",)),
        ("cleanrl_ppo_atari.py", ["--num-steps", "64", "--total-timesteps", "256", "--num-minibatches", "2",
                                  "--update-epochs", "1"], ("ale_py", "cv2")),
    ],
)
def test_example_runs(script, args, modules, fast, tmp_path):
    for m in ("gymnasium", "matplotlib", *modules):
        pytest.importorskip(m)
    out = _run(os.path.join("examples", script),
               ["--num-envs", "2", "--no-cuda", "--fast-gae" if fast else "--no-fast-gae",
                "--out", str(tmp_path), *args], tmp_path)
    assert ("| compute_gae |" if fast else "| inline loop |") in out
    for name in ("timings.csv", "episodes.csv", "returns.png"):
        assert (tmp_path / name).stat().st_size > 0
    with open(tmp_path / "timings.csv") as f:
        assert len(f.read().splitlines()) == 1 + 2  # header + two iterations


def test_synthetic_benchmark_runs(tmp_path):
    md = tmp_path / "cleanrl.md"
    out = _run(os.path.join("benchmarks", "cleanrl_synthetic.py"),
               ["--device", "cpu", "--shapes", "64x32", "--epochs", "1", "--repeats", "2", "--md", str(md)], tmp_path)
    assert "| 64 x 32 |" in out
    text = md.read_text()
    assert "| 64 x 32 |" in text and "speed-up" in text
