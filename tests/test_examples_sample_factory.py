"""examples/sample_factory_appo.py runs end to end on a tiny budget, Sample Factory's GAE and
rl_triton's from the same seed, and writes its outputs (.ci/run's classic stage, where Sample
Factory is installed)."""

import csv
import os

import pytest
from test_examples import assert_outputs, run_example

pytestmark = pytest.mark.framework


def test_sample_factory_example_runs(tmp_path):
    for module in ("sample_factory", "gymnasium", "matplotlib"):
        pytest.importorskip(module)
    out = tmp_path / "out"
    args = ["--compare", "--out", str(out), "--env-steps", "1024", "--batch-size", "256", "--num-envs", "8"]
    stdout = run_example(os.path.join("examples", "sample_factory_appo.py"), args, tmp_path)
    assert "| | sample_factory | rl_triton |" in stdout
    assert "rl_triton: GAE rl_triton.integrations.sample_factory.gae_advantages" in stdout
    assert "sample_factory: GAE torch.jit.ScriptFunction" in stdout
    assert_outputs("sample_factory_appo.py", out)
    with open(out / "batches.csv") as f:
        rows = list(csv.DictReader(f))
    runs = {r["run"] for r in rows}
    assert runs == {"sample_factory", "rl_triton"}
    assert all(float(r["gae_ms"]) > 0 for r in rows)
    assert (out / "returns.png").stat().st_size > 0
