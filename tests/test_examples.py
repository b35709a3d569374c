"""The examples run end to end on a tiny budget, with both GAE variants, and write their outputs."""

import csv
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


def assert_outputs(script: str, out, *runs: str) -> None:
    """``out`` holds exactly the files docs/index.md says ``script`` writes (see
    :func:`documented_outputs`) in one invocation per folder name of ``runs``, none of them empty."""
    written = {os.path.relpath(os.path.join(d, f), out).replace(os.sep, "/") for d, _, files in os.walk(out)
               for f in files}
    expected = set().union(*(documented_outputs(script, run) for run in runs or [""]))
    assert written == expected, f"{script} wrote {sorted(written)}"
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
    """Both runs, each timing SB3's loop and rl_triton's on every rollout's buffer (no ratio of
    the update, which does the same work with either), and the files docs/index.md lists."""
    _needs(*modules)
    out = tmp_path / "out"
    stdout = run_example(os.path.join("examples", script), ["--compare", "--out", str(out), *args], tmp_path,
                         timeout=900)
    assert "| SB3 loop |" in stdout and "| rl_triton |" in stdout
    assert "GAE + update" not in stdout
    assert_outputs(script, out)
    with open(out / "timings.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["gae"] for r in rows] == ["SB3 loop", "rl_triton"]
    for r in rows:
        assert int(r["rollouts"]) >= 2
        assert float(r["sb3_loop_ms_per_call"]) > 0 and float(r["rl_triton_ms_per_call"]) > 0


def import_example(name):
    """examples/``name``.py as a module (examples/ on the path for its sibling imports)."""
    import importlib.util

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "examples", name + ".py"))
    module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(os.path.join(ROOT, "examples"))
        del sys.modules[name]
    return module


@pytest.mark.parametrize("keep", ["SB3 loop", "rl_triton"])
def test_sb3_side_by_side_times_both_and_keeps_the_run_gae(keep):
    """examples/sb3_common.side_by_side: every rollout runs both GAEs (which goes first alternates)
    and the buffer ends with the advantages and returns of the run's own, which is called through
    the buffer's class (SB3's method, or rl_triton's under patch())."""
    _needs("stable_baselines3", "gymnasium")
    import gymnasium as gym
    import numpy as np
    import torch
    from stable_baselines3.common.buffers import RolloutBuffer

    import rl_triton.integrations.sb3 as rt_sb3

    common = import_example("sb3_common")
    ways = common.gae_ways()
    assert ways["SB3 loop"] is RolloutBuffer.compute_returns_and_advantage
    calls = []
    counted = {label: (lambda fn, label: lambda *a: (calls.append(label), fn(*a))[1])(fn, label)
               for label, fn in ways.items()}
    rng = np.random.default_rng(0)
    buf = RolloutBuffer(16, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", n_envs=3)
    reference = RolloutBuffer(16, gym.spaces.Box(-1, 1, (1,)), gym.spaces.Discrete(2), "cpu", n_envs=3)
    timings = {"SB3 loop": [], "rl_triton": []}
    (rt_sb3.patch if keep == "rl_triton" else rt_sb3.unpatch)()
    try:
        common.side_by_side(buf, counted, keep, timings)
        for _ in range(2):
            buf.rewards[:], buf.values[:] = rng.standard_normal((2, 16, 3))
            buf.episode_starts[:] = rng.random((16, 3)) < 0.2
            for name in ("rewards", "values", "episode_starts"):
                getattr(reference, name)[:] = getattr(buf, name)
            last_values, dones = torch.tensor(rng.standard_normal(3)), (rng.random(3) < 0.5).astype(float)
            buf.compute_returns_and_advantage(last_values, dones)
            ways[keep](reference, last_values, dones)
            np.testing.assert_array_equal(buf.advantages, reference.advantages)
            np.testing.assert_array_equal(buf.returns, reference.returns)
    finally:
        rt_sb3.unpatch()
    other = ({"SB3 loop", "rl_triton"} - {keep}).pop()
    assert calls == [other, other]  # the run's own goes through the class, not through ``ways``
    assert [len(t) for t in timings.values()] == [2, 2] and all(x > 0 for t in timings.values() for x in t)


@pytest.mark.parametrize("script", ["sb3_ppo_atari", "cleanrl_ppo_atari"])
def test_atari_default_budget_finishes_episodes(script):
    """With the default budget, every env finishes a game of Pong while the policy acts at random
    (as the untrained policy does): returns.png has episodes to show."""
    _needs("gymnasium", "ale_py", "cv2", "stable_baselines3")
    import argparse

    import numpy as np

    module = import_example(script)
    if script == "sb3_ppo_atari":
        n_envs, steps = module.N_ENVS, module.TIMESTEPS // module.N_ENVS
        envs = module.make_env(argparse.Namespace(n_envs=n_envs, seed=0))
        envs.reset()
        envs.action_space.seed(0)
        ended = np.zeros(n_envs, int)
        for _ in range(steps):
            _, _, _, infos = envs.step(np.array([envs.action_space.sample() for _ in range(n_envs)]))
            ended += ["episode" in info for info in infos]
    else:
        import gymnasium as gym

        from rl_triton._scripts import episode_returns

        args = module.Args()
        n_envs, steps = args.num_envs, (args.total_timesteps // (args.num_envs * args.num_steps)) * args.num_steps
        envs = gym.vector.SyncVectorEnv([module.make_env(args.env_id, args.gamma) for _ in range(n_envs)],
                                        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
        envs.reset(seed=args.seed)
        envs.action_space.seed(args.seed)
        ended = np.zeros(n_envs, int)
        for _ in range(steps):
            _, _, terminated, truncated, infos = envs.step(envs.action_space.sample())
            ended += terminated | truncated
            assert len(episode_returns(infos)) == (terminated | truncated).sum()
    envs.close()
    assert (ended >= 1).all(), ended


def test_returns_plot_shows_episodes_and_their_mean(tmp_path):
    """rl_triton/_scripts.returns_plot (SB3, TorchRL and CleanRL examples): each run's episodes as
    dots, and one line through the mean of the episodes that ended at the same x (no vertical
    bars joining one batch's episodes); runs in different line styles; the 'no episode' note."""
    pytest.importorskip("matplotlib")
    from rl_triton._scripts import NO_EPISODE, returns_plot

    runs = {"a": [(100, 1.0), (100, 3.0), (200, 5.0)], "b": [(100, 1.0), (100, 3.0), (200, 5.0)]}
    fig = returns_plot(str(tmp_path / "returns.png"), runs, "t", "frames")
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert [line.get_label() for line in lines] == ["a (mean)", "b (mean)"]
    for line in lines:
        assert list(line.get_xdata()) == [100, 200] and list(line.get_ydata()) == [2.0, 5.0]
    assert lines[0].get_linestyle() != lines[1].get_linestyle()
    dots = [c.get_offsets().tolist() for c in ax.collections]
    assert dots == [[[100, 1.0], [100, 3.0], [200, 5.0]]] * 2
    assert (tmp_path / "returns.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    empty = returns_plot(str(tmp_path / "empty.png"), {"a": []}, "t", "frames")
    assert [t.get_text() for t in empty.axes[0].texts] == [NO_EPISODE]


def test_every_example_documents_its_outputs():
    """docs/index.md's table of outputs has a row naming files for every script in examples/."""
    scripts = [name for name in os.listdir(os.path.join(ROOT, "examples"))
               if 'if __name__ == "__main__":' in open(os.path.join(ROOT, "examples", name)).read()]
    assert scripts and all(documented_outputs(name) for name in scripts)


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_llm_token_ppo_runs(estimator, tmp_path):
    _needs("transformers")
    out = tmp_path / "out"
    stdout = run_example(os.path.join("examples", "llm_token_ppo.py"),
                         ["--compare", "--estimator", estimator, "--iterations", "2", "--prompts", "2", "--group-size",
                          "3", "--max-new", "12", "--out", str(out)], tmp_path)
    assert "| verl loop |" in stdout and "| rl_triton |" in stdout
    assert_outputs("llm_token_ppo.py", out)


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
                             "--backend", "gloo", "--steps", "20000", "--iterations", "2",
                             "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    # torchrun's own notice (OMP_NUM_THREADS) is a few lines; the helper's bound leaves room for it
    assert_clean_log(result.stderr, tmp_path)
    assert "| sharded |" in result.stdout and "| all-gather |" in result.stdout, result.stdout[-2000:]
    pytest.importorskip("matplotlib")  # the PNG comes with matplotlib
    assert_outputs("distributed_gae.py", tmp_path / "out")
    with open(tmp_path / "out" / "timings.csv") as f:
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
    so runs with the same seed and the same returns both show; an axis of iterations (whole
    numbers, here 1 and 2) has whole-number ticks, not 1.0, 1.2, ..."""
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
    fig = two_panels(str(path), [("a", ([200, 400], [1.0, 2.0]), (range(1, 3), [3.0, 4.0]))], {}, {})
    iterations = fig.axes[1]
    shown = [t for t in iterations.get_xticks() if iterations.get_xlim()[0] <= t <= iterations.get_xlim()[1]]
    assert len(shown) >= 2 and all(float(t).is_integer() for t in shown), shown
