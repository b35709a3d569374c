"""The TorchRL examples run end to end on a tiny budget, TorchRL's estimator and rl_triton's, and
write their outputs."""

import os

import pytest
from test_examples import run_example


@pytest.mark.parametrize("script", ["torchrl_ppo_mujoco.py", "torchrl_impala_vtrace.py"])
def test_torchrl_example_runs(script, tmp_path):
    for module in ("torchrl", "tensordict", "mujoco", "gymnasium"):
        pytest.importorskip(module)
    args = ["--compare", "--out", str(tmp_path), "--frames", "1024", "--n-envs", "2", "--steps", "256"]
    stdout = run_example(os.path.join("examples", script), args, tmp_path)
    assert "| TorchRL | rl_triton |" in stdout
    assert "rl_triton patch active: True" in stdout
    assert "rl_triton patch active: False" in stdout
    for name in ("timings.csv", "episodes.csv", "returns.png"):
        assert (tmp_path / name).stat().st_size > 0
