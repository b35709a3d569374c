"""examples/skyrl_token_ppo.py on a tiny budget against the real SkyRL (.ci/run's frameworks stage):
SkyRL's own estimators and rl_triton's drop-ins in its registry, side by side, for GAE and GRPO;
the same seed gives the same scores (the advantages agree), and the files docs/index.md lists are
written."""

from __future__ import annotations

import csv
import os

import pytest

from test_examples import assert_outputs, run_example


@pytest.mark.framework
@pytest.mark.parametrize("estimator", ["gae", "grpo"])  # RLOO and REINFORCE++: tests/test_skyrl.py
def test_skyrl_token_ppo_compare(estimator, tmp_path):
    pytest.importorskip("skyrl")
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    stdout = run_example(os.path.join("examples", "skyrl_token_ppo.py"),
                         ["--compare", "--estimator", estimator, "--iterations", "3", "--prompts", "3",
                          "--group-size", "2", "--max-new", "24", "--out", str(out)], tmp_path)
    assert "| SkyRL loop |" in stdout and "| rl_triton |" in stdout
    assert_outputs("skyrl_token_ppo.py", out)
    with open(out / "iterations.csv") as f:
        rows = list(csv.DictReader(f))
    scores = {v: [float(r["score"]) for r in rows if r["variant"] == v] for v in ("SkyRL loop", "rl_triton")}
    assert len(scores["rl_triton"]) == 3
    assert scores["rl_triton"] == pytest.approx(scores["SkyRL loop"], rel=1e-4)
