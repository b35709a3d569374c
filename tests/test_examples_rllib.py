"""examples/rllib_ppo_appo.py runs end to end on a tiny budget, RLlib's GAE / V-trace and
rl_triton's with the same seed, and writes its outputs."""

import csv
import os

import pytest
from test_examples import assert_outputs, run_example


def test_rllib_example_runs(tmp_path):
    for module in ("ray.rllib", "gymnasium", "matplotlib"):
        pytest.importorskip(module)
    args = ["--compare", "--iterations", "1", "--train-batch-size", "200", "--out", str(tmp_path / "out")]
    stdout = run_example(os.path.join("examples", "rllib_ppo_appo.py"), args, tmp_path)
    for run in ("PPO RLlib", "APPO RLlib"):
        assert f"{run}: 1 iterations, rl_triton fused calls in the Learner: 0" in stdout
    for run in ("PPO rl_triton", "APPO rl_triton"):
        line = next(x for x in stdout.splitlines() if x.startswith(f"{run}: 1 iterations"))
        assert int(line.rsplit(":", 1)[1]) >= 1, line
    with open(tmp_path / "out" / "iterations.csv") as f:
        rows = list(csv.DictReader(f))
    assert {(r["algo"], r["run"]) for r in rows} == {(a, r) for a in ("ppo", "appo") for r in ("RLlib", "rl_triton")}
    assert all(float(r["gae_or_vtrace_s"]) > 0 for r in rows)
    # the same seed: PPO's first iteration samples the same episodes with either GAE
    ppo = {r["run"]: r for r in rows if r["algo"] == "ppo"}
    assert ppo["RLlib"]["episode_return_mean"] == ppo["rl_triton"]["episode_return_mean"]
    assert_outputs("rllib_ppo_appo.py", tmp_path / "out")
