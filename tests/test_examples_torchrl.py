"""The TorchRL examples run end to end on a tiny budget, TorchRL's estimator and rl_triton's, and
write their outputs."""

import os

import pytest
from test_examples import import_example, assert_outputs, run_example


@pytest.mark.parametrize("script", ["torchrl_ppo_mujoco.py", "torchrl_impala_vtrace.py"])
def test_torchrl_example_runs(script, tmp_path):
    for module in ("torchrl", "tensordict", "mujoco", "gymnasium"):
        pytest.importorskip(module)
    out = tmp_path / "out"
    args = ["--compare", "--out", str(out), "--frames", "1024", "--n-envs", "2", "--steps", "256"]
    stdout = run_example(os.path.join("examples", script), args, tmp_path)
    assert "| TorchRL | rl_triton |" in stdout
    assert "rl_triton patch active: True" in stdout
    assert "rl_triton patch active: False" in stdout
    assert_outputs(script, out)


def test_torchrl_plot_shows_episodes_and_their_mean(tmp_path, monkeypatch):
    """The TorchRL examples' returns.png comes from rl_triton/_scripts.returns_plot (dots, and a
    line through each frame count's mean), not from lines joining one batch's episodes."""
    module = import_example("torchrl_ppo_mujoco")
    drawn = []
    monkeypatch.setattr(module, "returns_plot", lambda path, runs, title, xlabel: drawn.append((runs, xlabel)))
    episodes = [("TorchRL", 512, 1.0), ("TorchRL", 512, 3.0), ("TorchRL", 1024, 2.0)]
    module.report({"TorchRL": ({"advantage": [1e-3], "update": [0.1]}, episodes)}, str(tmp_path), "t")
    assert drawn == [({"TorchRL": [(512, 1.0), (512, 3.0), (1024, 2.0)]}, "frames")]
