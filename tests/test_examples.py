"""The examples run end to end on a tiny budget, with both GAE variants, and write their outputs."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_clean_log(stderr, cwd):
    """Piped output stays a readable log: progress as a few plain lines (no carriage-return
    redraws), and no MUJOCO_LOG.TXT left in the working directory."""
    assert "\r" not in stderr, stderr[-2000:]
    assert len(stderr.splitlines()) <= 20, stderr[-3000:]
    assert not (cwd / "MUJOCO_LOG.TXT").exists()


def run_example(path, args, cwd, timeout=600) -> str:
    """Run ``path`` (relative to the repository root) with ``args`` in ``cwd``, this checkout first
    on the path and matplotlib without a display; assert it succeeded with a clean log (above) and
    return its standard output."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), MPLBACKEND="Agg")
    result = subprocess.run([sys.executable, os.path.join(ROOT, path), *args], capture_output=True, text=True,
                            env=env, timeout=timeout, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert_clean_log(result.stderr, cwd)
    return result.stdout


def documented_outputs(script: str, run: str = "") -> set:
    """The files that docs/index.md's table of outputs says ``script`` (a file name in examples/)
    writes under --out, its folder ``RUN`` spelt ``run``."""
    text = open(os.path.join(ROOT, "docs", "index.md")).read()
    table = text[text.index("| script | files written under `--out` |"):].split("\n\n")[0]
    (cell,) = re.findall(rf"^\| `examples/{re.escape(script)}` \| (.*) \|$", table, re.M)
    return {name.replace("RUN", run) for name in re.findall(r"`([\w/]+\.(?:csv|png))`", cell)}


def assert_outputs(script: str, out, run: str = "") -> None:
    """``out`` holds exactly the files docs/index.md says ``script`` writes (see
    :func:`documented_outputs`), none of them empty."""
    written = {os.path.relpath(os.path.join(d, f), out).replace(os.sep, "/") for d, _, files in os.walk(out)
               for f in files}
    assert written == documented_outputs(script, run), f"{script} wrote {sorted(written)}"
    assert all(os.path.getsize(os.path.join(out, name)) > 0 for name in written)


def _needs(*modules):
    for m in modules:
        pytest.importorskip(m)


@pytest.mark.parametrize(
    "script,args,modules",
    [
        ("sb3_ppo_mujoco.py", ["--timesteps", "2048", "--n-envs", "2"], ("stable_baselines3", "mujoco")),
        ("sb3_ppo_atari.py", ["--timesteps", "512", "--n-envs", "2"], ("stable_baselines3", "ale_py", "cv2")),
    ],
)
def test_example_runs(script, args, modules, tmp_path):
    _needs(*modules)
    stdout = run_example(os.path.join("examples", script), ["--compare", "--out", str(tmp_path), *args], tmp_path,
                         timeout=900)
    assert "| SB3 loop |" in stdout and "| rl_triton |" in stdout
    for name in ("timings.csv", "episodes.csv", "returns.png"):
        assert (tmp_path / name).stat().st_size > 0


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_llm_token_ppo_runs(estimator, tmp_path):
    _needs("transformers")
    stdout = run_example(os.path.join("examples", "llm_token_ppo.py"),
                         ["--compare", "--estimator", estimator, "--iterations", "2", "--prompts", "2", "--group-size",
                          "3", "--max-new", "12", "--out", str(tmp_path)], tmp_path)
    assert "| verl loop |" in stdout and "| rl_triton |" in stdout
    for name in ("iterations.csv", "scores.png"):
        assert (tmp_path / name).stat().st_size > 0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_distributed_gae_runs_under_torchrun(tmp_path):
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs torch.distributed with gloo")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, *sys.path]), MPLBACKEND="Agg")
    # gloo on CPU whatever the machine (nccl would need a GPU per rank)
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(_free_port()), os.path.join(ROOT, "examples", "distributed_gae.py"),
                             "--backend", "gloo", "--steps", "20000", "--iterations", "2", "--out", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # torchrun's own notice (OMP_NUM_THREADS) is a few lines; the helper's bound leaves room for it
    assert_clean_log(result.stderr, tmp_path)
    assert "| sharded |" in result.stdout and "| all-gather |" in result.stdout, result.stdout[-2000:]
    assert (tmp_path / "timings.csv").stat().st_size > 0
    with open(tmp_path / "timings.csv") as f:
        assert len(f.read().splitlines()) == 1 + 2 * 2  # header, then 2 iterations x 2 ways


def test_llm_token_ppo_plot_shows_coinciding_curves(tmp_path):
    """Both variants' curves stay visible where their scores are the same (another line style,
    width and marker), and the iteration axis has integer ticks."""
    pytest.importorskip("matplotlib")
    import importlib.util

    spec = importlib.util.spec_from_file_location("llm_token_ppo", os.path.join(ROOT, "examples", "llm_token_ppo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = [{"iteration": i, "score": 0.5 + 0.01 * (i % 2)} for i in range(3)]
    fig = module.plot_scores({False: (rows, 1.0, 2.0), True: (list(rows), 0.1, 2.0)}, "gae")
    (ax,) = fig.axes
    loop, ours = ax.get_lines()
    assert [loop.get_label(), ours.get_label()] == ["verl loop", "rl_triton"]
    assert list(loop.get_ydata()) == list(ours.get_ydata())
    assert loop.get_linestyle() != ours.get_linestyle() and loop.get_marker() != ours.get_marker()
    assert loop.get_linewidth() > ours.get_linewidth()  # the one drawn first is wider
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
    fig.savefig(tmp_path / "scores.png")
    assert (tmp_path / "scores.png").stat().st_size > 0


def test_two_panels_keeps_coinciding_runs_visible(tmp_path, monkeypatch):
    """The examples' two-plot PNG (rl_triton/_scripts.two_panels): each run in its own line style,
    so runs with the same seed and the same returns both show."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    from rl_triton._scripts import two_panels

    drawn = []
    plot = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: (drawn.append(k), plot(ax, *a, **k))[1])
    path = tmp_path / "returns.png"
    same = ([1, 2, 3], [10.0, 20.0, 30.0])
    two_panels(str(path), [("a", same, same), ("b", same, ([1, 2, 3], [1.0, 2.0, 2.0]))],
               dict(xlabel="env steps"), dict(xlabel="iteration", yscale="log"))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    styles = {(k["linestyle"], k["linewidth"]) for k in drawn}
    assert len(drawn) == 4 and len(styles) == 2
