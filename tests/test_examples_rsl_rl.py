"""examples/rsl_rl_ppo.py runs end to end on a tiny budget, rsl_rl's PPO and rl_triton's
subclass from the same seed, and writes its outputs."""

import csv
import math
import os

import pytest
from test_examples import assert_outputs, run_example


def test_rsl_rl_example_runs(tmp_path):
    for module in ("rsl_rl", "gymnasium", "tensordict", "matplotlib"):
        pytest.importorskip(module)
    args = ["--compare", "--out", str(tmp_path / "out"), "--iterations", "3", "--num-envs", "32", "--steps", "8"]
    stdout = run_example(os.path.join("examples", "rsl_rl_ppo.py"), args, tmp_path)
    assert "| | rsl_rl | rl_triton |" in stdout
    assert "algorithm rl_triton.integrations.rsl_rl.PPO" in stdout
    assert "algorithm rsl_rl.algorithms.ppo.PPO" in stdout
    with open(tmp_path / "out" / "iterations.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    # the same seed and the same GAE up to rounding: the same episodes in the first iterations
    ours = [float(r["mean_episode_return"]) for r in rows if r["run"] == "rl_triton"]
    theirs = [float(r["mean_episode_return"]) for r in rows if r["run"] == "rsl_rl"]
    assert all(math.isclose(a, b, rel_tol=1e-3) or (math.isnan(a) and math.isnan(b)) for a, b in zip(ours, theirs))
    assert_outputs("rsl_rl_ppo.py", tmp_path / "out")
