"""The CleanRL-style examples run end to end on a tiny budget with both GAE switches, and the
synthetic benchmark runs on one small shape; all write their outputs."""

import os

import pytest
from test_examples import run_example


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
    out = run_example(os.path.join("examples", script),
                      ["--num-envs", "2", "--no-cuda", "--fast-gae" if fast else "--no-fast-gae",
                       "--out", str(tmp_path), *args], tmp_path, timeout=300)
    assert ("| compute_gae |" if fast else "| inline loop |") in out
    for name in ("timings.csv", "episodes.csv", "returns.png"):
        assert (tmp_path / name).stat().st_size > 0
    with open(tmp_path / "timings.csv") as f:
        assert len(f.read().splitlines()) == 1 + 2  # header + two iterations


def test_synthetic_benchmark_runs(tmp_path):
    md = tmp_path / "cleanrl.md"
    out = run_example(os.path.join("benchmarks", "cleanrl_synthetic.py"),
                      ["--device", "cpu", "--shapes", "64x32", "--epochs", "1", "--repeats", "2", "--md", str(md)],
                      tmp_path, timeout=300)
    assert "| 64 x 32 |" in out
    text = md.read_text()
    assert "| 64 x 32 |" in text and "speed-up" in text
