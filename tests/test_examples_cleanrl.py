"""The CleanRL-style examples run end to end on a tiny budget with both GAE switches (one run
each, and --compare), each invocation into its own folder, and the synthetic benchmark runs on
one small shape; all write their outputs."""

import csv
import os

import pytest
from test_examples import assert_outputs, run_example

SCRIPTS = [
    ("cleanrl_ppo_continuous.py", ["--num-steps", "128", "--total-timesteps", "512", "--num-minibatches", "4",
                                   "--update-epochs", "2"], ("mujoco",)),
    ("cleanrl_ppo_atari.py", ["--num-steps", "64", "--total-timesteps", "256", "--num-minibatches", "2",
                              "--update-epochs", "1"], ("ale_py", "cv2")),
]


def _timings(folder):
    with open(folder / "timings.csv") as f:
        return [(r["gae"], int(r["iteration"])) for r in csv.DictReader(f)]


@pytest.mark.parametrize("script,args,modules", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_example_runs(script, args, modules, tmp_path):
    """--compare: the inline loop, then compute_gae, both in one table and in the same files (the
    folder `compare`, as docs/index.md lists)."""
    for m in ("gymnasium", "matplotlib", *modules):
        pytest.importorskip(m)
    out = tmp_path / "out"
    stdout = run_example(os.path.join("examples", script), ["--num-envs", "2", "--no-cuda", "--compare",
                                                            "--out", str(out), *args], tmp_path, timeout=600)
    assert "| inline loop |" in stdout and "| compute_gae |" in stdout
    assert_outputs(script, out, "compare")
    assert _timings(out / "compare") == [(gae, i) for gae in ("inline loop", "compute_gae") for i in (1, 2)]


def test_runs_keep_their_own_files(tmp_path):
    """A run with --no-fast-gae after one with --fast-gae (the same --out) leaves the first one's
    files as they were: each run writes into the folder named after it."""
    script, args, modules = SCRIPTS[0]
    for m in ("gymnasium", "matplotlib", *modules):
        pytest.importorskip(m)
    out = tmp_path / "out"
    runs = {"--fast-gae": ("compute_gae", "compute_gae"), "--no-fast-gae": ("inline loop", "inline_loop")}
    for switch, (label, folder) in runs.items():
        stdout = run_example(os.path.join("examples", script), ["--num-envs", "2", "--no-cuda", switch,
                                                                "--out", str(out), *args], tmp_path, timeout=300)
        assert f"| {label} |" in stdout
        if switch == "--fast-gae":
            first = {p.name: p.read_bytes() for p in (out / folder).iterdir()}
    assert {p.name: p.read_bytes() for p in (out / "compute_gae").iterdir()} == first
    assert_outputs(script, out, *(folder for _, folder in runs.values()))
    for label, folder in runs.values():
        assert _timings(out / folder) == [(label, i) for i in (1, 2)]


def test_synthetic_benchmark_runs(tmp_path):
    md = tmp_path / "cleanrl.md"
    out = run_example(os.path.join("benchmarks", "cleanrl_synthetic.py"),
                      ["--device", "cpu", "--shapes", "64x32", "--epochs", "1", "--repeats", "2", "--md", str(md)],
                      tmp_path, timeout=300)
    assert "| 64 x 32 |" in out
    text = md.read_text()
    assert "| 64 x 32 |" in text and "speed-up" in text
