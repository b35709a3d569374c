"""The TorchRL examples run end to end on a tiny budget, TorchRL's estimator and rl_triton's, and
write their outputs."""

import os
import subprocess
import sys

import pytest
from test_examples import assert_clean_log

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("script", ["torchrl_ppo_mujoco.py", "torchrl_impala_vtrace.py"])
def test_torchrl_example_runs(script, tmp_path):
    for module in ("torchrl", "tensordict", "mujoco", "gymnasium"):
        pytest.importorskip(module)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), MPLBACKEND="Agg")
    args = ["--compare", "--out", str(tmp_path), "--frames", "1024", "--n-envs", "2", "--steps", "256"]
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert_clean_log(result.stderr, tmp_path)
    assert "| TorchRL | rl_triton |" in result.stdout
    assert "rl_triton patch active: True" in result.stdout
    assert "rl_triton patch active: False" in result.stdout
    for name in ("timings.csv", "episodes.csv", "returns.png"):
        assert (tmp_path / name).stat().st_size > 0
