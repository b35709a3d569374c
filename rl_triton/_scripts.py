"""Support for the repository's example and benchmark scripts (not part of rl_triton's API).

- :func:`parser`: an ``argparse`` parser whose ``--help`` shows the script's whole docstring as
  written and the default of every option;
- :func:`require`: exit with the install line when an optional package is missing, instead of
  a traceback (call it after parsing, so ``--help`` works without the package);
- :func:`progress`: a tqdm bar that redraws in place on a terminal and writes plain lines at a
  slow pace into a log file;
- :func:`quiet_mujoco`: MuJoCo's warnings without the log file it writes into the working
  directory and without the deprecation notices of the environments' bundled model files;
- :func:`two_panels` and :func:`returns_plot`: the examples' PNGs (two plots per run side by
  side; episode returns as dots with a line through their mean);
- :func:`cleanrl_main` and :func:`cleanrl_train`: the command line and the PPO loop of the
  CleanRL-style examples, each invocation's files in its own folder (:func:`run_folder`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

EXAMPLES_INSTALL = "pip install -e '.[examples]'"
# import name -> the name pip installs it by, where they differ
PIP_NAMES = {
    "ale_py": "ale-py",
    "cv2": "opencv-python-headless",
    "rsl_rl": "rsl-rl-lib",
    "sample_factory": "sample-factory",
    "sb3_contrib": "sb3-contrib",
    "stable_baselines3": "stable-baselines3",
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description with its line breaks, and "(default: ...)" after each option's help."""


def parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """A parser whose ``--help`` prints ``doc`` (the script's ``__doc__``) in full and every
    option's default (options need a help string for their default to show)."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter, **kwargs)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(*modules: str, install: str = EXAMPLES_INSTALL) -> None:
    """Exit (status 1) with a message naming the missing packages and ``install``, the command
    that installs them, when any of ``modules`` cannot be imported."""
    missing = [PIP_NAMES.get(m, m) for m in modules if not _importable(m)]
    if missing:
        script = os.path.basename(sys.argv[0]) or "this script"
        raise SystemExit(f"{script} needs {', '.join(missing)}, not installed here: install with "
                         f"{install} (from the repository root)")


class _LineWriter:
    """A file for tqdm that turns each redraw (``\\r`` + status) into one plain line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.replace("\r", "").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def progress(total: int, desc: str, unit: str = "step", log_every_s: float = 30.0):
    """A tqdm bar over ``total`` units on stderr, or None when tqdm is not installed.

    On a terminal it redraws in place, at most twice a second. Otherwise (stderr piped or
    redirected to a file) it writes one plain line at the start, at most one every
    ``log_every_s`` seconds, and one at the end. Set the postfix with ``refresh=False`` so
    that it waits for the next redraw."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    if sys.stderr.isatty():
        return tqdm(total=total, desc=desc, unit=unit, mininterval=0.5)
    return tqdm(total=total, desc=desc, unit=unit, file=_LineWriter(sys.stderr), mininterval=log_every_s,
                ascii=True, ncols=100)


def quiet_mujoco() -> None:
    """Send MuJoCo's warnings to stderr, each distinct one once, and drop its deprecation
    notices (they concern the model files bundled with the environments, nothing a user can
    change). MuJoCo then writes no MUJOCO_LOG.TXT. No-op without mujoco."""
    try:
        import mujoco
    except ImportError:
        return
    seen = set()

    def warn(message: str) -> None:
        message = message.strip()
        if "deprecated" in message or message in seen:
            return
        seen.add(message)
        print(f"MuJoCo warning: {message}", file=sys.stderr)

    mujoco.set_mju_user_warning(warn)


# help of the hyperparameters of the CleanRL-style examples (their Args dataclasses)
CLEANRL_HELP = {
    "env_id": "Gymnasium environment id",
    "total_timesteps": "environment steps in all (all envs)",
    "num_envs": "vectorised environments",
    "num_steps": "steps per env per rollout",
    "learning_rate": "Adam learning rate",
    "anneal_lr": "anneal the learning rate linearly to 0",
    "gamma": "discount",
    "gae_lambda": "GAE lambda",
    "num_minibatches": "minibatches per epoch",
    "update_epochs": "PPO epochs per rollout",
    "norm_adv": "normalise the advantages per minibatch",
    "clip_coef": "PPO clip range (policy, and value with --clip-vloss)",
    "clip_vloss": "clip the value loss",
    "ent_coef": "entropy bonus coefficient",
    "vf_coef": "value loss coefficient",
    "max_grad_norm": "gradient norm clip",
    "target_kl": "stop the epochs early above this approximate KL (None: never)",
    "fast_gae": "rl_triton's compute_gae, or CleanRL's inline loop with --no-fast-gae",
    "seed": "seed of the environments, torch and numpy",
    "torch_deterministic": "torch.backends.cudnn.deterministic",
    "cuda": "run on CUDA (None: when a GPU is present)",
    "compare": "run both, the inline loop first, into one CSV and PNG",
    "tensorboard": "also write TensorBoard logs (tb/ beside the CSV files)",
    "out": "folder for the outputs: one subfolder per invocation, named after its run or 'compare'",
}


def dataclass_args(doc: str, cls, derived=("batch_size", "minibatch_size", "num_iterations")):
    """Parse the command line into an instance of the dataclass ``cls``: one option per field
    (``--field-name``; ``--x/--no-x`` for bools) except the ``derived`` ones, with the help
    of :data:`CLEANRL_HELP` and the field's default."""
    import dataclasses

    p = parser(doc)
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(cls):
        if f.name in derived:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = str(getattr(f.type, "__name__", f.type)).replace(" | None", "")
        help_text = CLEANRL_HELP.get(f.name, f.name.replace("_", " "))
        if kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
        else:
            p.add_argument(flag, type=types[kind], default=f.default, help=help_text)
    return cls(**vars(p.parse_args()))


# line styles of the runs in one plot: a wide solid line under narrower dashed ones, so that
# runs that coincide (same seed, same returns) all stay visible
STYLES = (dict(linestyle="-", linewidth=4, alpha=0.5), dict(linestyle="--", linewidth=1.5),
          dict(linestyle=":", linewidth=1.5), dict(linestyle="-.", linewidth=1))
NO_EPISODE = "no episode finished within the budget"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _integer_ticks(ax, x) -> None:
    """Whole-number ticks on the x axis of ``ax`` when every x value is a whole number (an
    iteration count: no 1.0, 1.2, ... ticks)."""
    from matplotlib.ticker import MaxNLocator

    if len(x) and all(float(v).is_integer() for v in x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def two_panels(path: str, curves, left: dict, right: dict) -> None:
    """A PNG of two plots side by side: ``curves`` yields ``(label, (x, y), (x, y))``, a run's
    points on the left and on the right plot; ``left``/``right`` are each axis' ``set`` keywords
    (xlabel, ylabel, title, yscale, ...). Each run in its own line style (:data:`STYLES`); an
    axis whose x values are all whole numbers gets whole-number ticks. matplotlib with the Agg
    backend (no display). Returns the figure, closed after saving."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for i, (label, *points) in enumerate(curves):
        for ax, (x, y) in zip(axes, points):
            x = list(x)
            ax.plot(x, y, marker=".", label=label, **STYLES[i % len(STYLES)])
            _integer_ticks(ax, x)
    for ax, settings in zip(axes, (left, right)):
        ax.set(**settings)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return fig


def returns_plot(path: str, runs: dict, title: str, xlabel: str):
    """A PNG of episode returns over training. ``runs`` maps each run's label to its finished
    episodes as ``(x, episode_return)`` pairs, x the step (or frame) count at which the episode
    ended. Each run: its episodes as dots, and a line through the mean return of the episodes
    that ended at the same x (one batch's episodes in a vertical cloud around it), in the run's
    line style (:data:`STYLES`) and colour. Without any episode the plot says so
    (:data:`NO_EPISODE`). Returns the matplotlib figure, closed after saving."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, episodes) in enumerate(runs.items()):
        if not episodes:
            continue
        by_x = {}
        for x, ret in episodes:
            by_x.setdefault(x, []).append(ret)
        xs = sorted(by_x)
        line, = ax.plot(xs, [sum(by_x[x]) / len(by_x[x]) for x in xs], marker=".", label=f"{label} (mean)",
                        **STYLES[i % len(STYLES)])
        ax.scatter(*zip(*episodes), s=8, alpha=0.4, color=line.get_color(), label=f"{label} (episodes)")
    ax.set(xlabel=xlabel, ylabel="episode return", title=title)
    if any(runs.values()):
        ax.legend()
    else:
        ax.text(0.5, 0.5, NO_EPISODE, ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return fig


# -- the CleanRL-style examples ------------------------------------------------------------------
CLEANRL_RUNS = {True: "compute_gae", False: "inline loop"}  # args.fast_gae -> the run's label


def episode_returns(infos) -> list:
    """Returns of the episodes that ended this step of a gymnasium vector env. With SAME_STEP
    autoreset (as CleanRL's gymnasium 0.29 scripts expect) RecordEpisodeStatistics' dict sits in
    infos["final_info"]["episode"]; with NEXT_STEP (gymnasium 1.x's default) in infos["episode"]."""
    import numpy as np

    for src in (infos.get("final_info", {}), infos):
        if "episode" in src:
            mask = src.get("_episode", np.ones(len(src["episode"]["r"]), bool))
            return [float(r) for r, m in zip(src["episode"]["r"], mask) if m]
    return []


def cleanrl_train(args, make_env, make_agent, tb_dir: str | None = None) -> dict:
    """One run of CleanRL's PPO (its ``ppo_atari.py`` / ``ppo_continuous_action.py`` loop), the GAE
    by ``compute_gae`` (``args.fast_gae``) or by CleanRL's inline loop
    (``rl_triton.testing.frameworks.cleanrl_gae``).

    ``args``: the script's Args (env_id, total_timesteps, num_envs, num_steps, the PPO
    hyperparameters, seed, torch_deterministic, cuda); ``make_env(env_id, gamma)``: a thunk
    that makes one environment with RecordEpisodeStatistics; ``make_agent(envs)``: the agent
    module (``get_value(obs)`` and ``get_action_and_value(obs, action=None)``); ``tb_dir``:
    the folder of TensorBoard logs, or None for none. Times, per iteration, the advantage phase
    (the GAE alone) and the update phase (everything after the rollout: bootstrap value, GAE,
    flattening and the PPO epochs), with ``torch.cuda.synchronize`` on CUDA.

    Returns a dict: label, device, episodes (``(global_step, return)`` pairs), timings
    (``(iteration, advantage_ms, update_ms)``) and run_s (the run's seconds)."""
    import random

    import gymnasium as gym
    import numpy as np
    import torch
    from torch import nn, optim

    from rl_triton.integrations.cleanrl import compute_gae
    from rl_triton.testing.frameworks import cleanrl_gae as inline_gae

    label = CLEANRL_RUNS[args.fast_gae]
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    use_cuda = torch.cuda.is_available() if args.cuda is None else args.cuda
    device = torch.device("cuda" if use_cuda else "cpu")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    writer = None
    if tb_dir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(tb_dir)
        writer.add_text("hyperparameters", "\n".join(f"|{k}|{v}|" for k, v in vars(args).items()))

    envs = gym.vector.SyncVectorEnv([make_env(args.env_id, args.gamma) for _ in range(args.num_envs)],
                                    autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    obs_shape = envs.single_observation_space.shape
    act_shape = envs.single_action_space.shape
    discrete = isinstance(envs.single_action_space, gym.spaces.Discrete)
    agent = make_agent(envs).to(device)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

    obs = torch.zeros((args.num_steps, args.num_envs) + obs_shape, device=device)
    actions = torch.zeros((args.num_steps, args.num_envs) + act_shape, device=device)
    logprobs = torch.zeros((args.num_steps, args.num_envs), device=device)
    rewards = torch.zeros((args.num_steps, args.num_envs), device=device)
    dones = torch.zeros((args.num_steps, args.num_envs), device=device)
    values = torch.zeros((args.num_steps, args.num_envs), device=device)

    # one call of compute_gae before timing anything (numba / Triton compile or load their cache)
    compute_gae(rewards, values, dones, values[0], dones[0], args.gamma, args.gae_lambda)

    global_step = 0
    episodes, timings = [], []
    next_obs, _ = envs.reset(seed=args.seed)
    next_obs = torch.tensor(next_obs, dtype=torch.float32, device=device)
    next_done = torch.zeros(args.num_envs, device=device)
    bar = progress(args.num_iterations * args.batch_size, label)
    start_time = time.perf_counter()

    for iteration in range(1, args.num_iterations + 1):
        if args.anneal_lr:
            optimizer.param_groups[0]["lr"] = (1.0 - (iteration - 1.0) / args.num_iterations) * args.learning_rate

        for step in range(args.num_steps):
            global_step += args.num_envs
            obs[step] = next_obs
            dones[step] = next_done
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
            # as CleanRL: a time-limit truncation counts as a termination (no bootstrap)
            next_done = np.logical_or(terminations, truncations)
            rewards[step] = torch.tensor(reward, dtype=torch.float32, device=device)
            next_obs = torch.tensor(next_obs, dtype=torch.float32, device=device)
            next_done = torch.tensor(next_done, dtype=torch.float32, device=device)
            for ret in episode_returns(infos):
                episodes.append((global_step, ret))
                if writer:
                    writer.add_scalar("charts/episodic_return", ret, global_step)
        if bar:
            if episodes:
                bar.set_postfix(last_return=f"{episodes[-1][1]:.1f}", refresh=False)
            bar.update(args.batch_size)

        sync()
        t_update = time.perf_counter()
        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            sync()
            t_adv = time.perf_counter()
            gae = compute_gae if args.fast_gae else inline_gae
            advantages, returns = gae(rewards, values, dones, next_value, next_done, args.gamma, args.gae_lambda)
            sync()
            adv_ms = 1e3 * (time.perf_counter() - t_adv)

        b_obs = obs.reshape((-1,) + obs_shape)
        b_logprobs = logprobs.reshape(-1)
        b_actions = actions.reshape((-1,) + act_shape)
        if discrete:
            b_actions = b_actions.long()
        b_advantages = advantages.reshape(-1)
        b_returns = returns.reshape(-1)
        b_values = values.reshape(-1)

        b_inds = np.arange(args.batch_size)
        clipfracs = []
        for epoch in range(args.update_epochs):
            np.random.shuffle(b_inds)
            for start in range(0, args.batch_size, args.minibatch_size):
                mb_inds = b_inds[start:start + args.minibatch_size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb_inds], b_actions[mb_inds])
                logratio = newlogprob - b_logprobs[mb_inds]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())
                mb_adv = b_advantages[mb_inds]
                if args.norm_adv:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef)).mean()
                newvalue = newvalue.view(-1)
                if args.clip_vloss:
                    v_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                    v_clipped = b_values[mb_inds] + torch.clamp(newvalue - b_values[mb_inds],
                                                                -args.clip_coef, args.clip_coef)
                    v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb_inds]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()
            if args.target_kl is not None and approx_kl > args.target_kl:
                break
        sync()
        update_ms = 1e3 * (time.perf_counter() - t_update)
        timings.append((iteration, adv_ms, update_ms))
        if writer:
            writer.add_scalar("timing/advantage_ms", adv_ms, global_step)
            writer.add_scalar("timing/update_ms", update_ms, global_step)
            writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
            writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
            writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
            writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)

    if bar:
        bar.close()
    envs.close()
    if writer:
        writer.close()
    return {"label": label, "device": device, "episodes": episodes, "timings": timings,
            "run_s": time.perf_counter() - start_time}


def median_after_first(xs):
    """Median, leaving out the first value (the process' warm-up) when there are more."""
    import statistics

    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def run_folder(out: str, labels) -> str:
    """The folder of one invocation's outputs under ``out``: named after its run, or ``compare``
    for several runs, so that the runs of one script do not overwrite each other's files."""
    labels = list(labels)
    return os.path.join(out, "compare" if len(labels) > 1 else _slug(labels[0]))


def _slug(label: str) -> str:
    return label.replace(" ", "_")


def cleanrl_main(doc: str, args_cls, make_env, make_agent, needs=()) -> None:
    """The command line of a CleanRL-style example: parse ``args_cls`` (a dataclass of CleanRL's
    Args with ``fast_gae``, ``compare``, ``tensorboard`` and ``out``), exit with the install line
    unless gymnasium, matplotlib and ``needs`` are installed, train once with the GAE that
    ``--fast-gae/--no-fast-gae`` picks, or with both (the inline loop first) under
    ``--compare``, print the medians and write episodes.csv, timings.csv and returns.png
    (both runs in each), and with ``--tensorboard`` the logs under tb/, into
    :func:`run_folder` of ``--out``. ``make_env`` and ``make_agent`` as in :func:`cleanrl_train`."""
    import csv
    import dataclasses

    args = dataclass_args(doc, args_cls)
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = args.batch_size // args.num_minibatches
    args.num_iterations = max(1, args.total_timesteps // args.batch_size)
    require("gymnasium", "matplotlib", *needs)
    variants = [False, True] if args.compare else [args.fast_gae]
    folder = run_folder(args.out, (CLEANRL_RUNS[fast] for fast in variants))
    runs = []
    for fast in variants:
        # TensorBoard: the run's logs in tb/, each run in its own subfolder under --compare
        tb_dir = os.path.join(folder, "tb", *[_slug(CLEANRL_RUNS[fast])] * args.compare)
        run_args = dataclasses.replace(args, fast_gae=fast)
        runs.append(cleanrl_train(run_args, make_env, make_agent, tb_dir if args.tensorboard else None))

    title = f"CleanRL-style PPO, {args.env_id}, {args.num_envs} envs x {args.num_steps} steps"
    print(f"\n{title} ({runs[0]['device']}; medians per iteration, first iteration left out)")
    print("| GAE | iterations | advantage phase ms | update phase ms (incl. GAE) | GAE share of update | run s |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        adv = median_after_first([t[1] for t in run["timings"]])
        upd = median_after_first([t[2] for t in run["timings"]])
        print(f"| {run['label']} | {len(run['timings'])} | {adv:.3f} | {upd:.1f} | {100 * adv / upd:.2f}% | "
              f"{run['run_s']:.1f} |")
    for run in runs:
        returns = [e[1] for e in run["episodes"]]
        print(f"{run['label']}: episodes finished: {len(returns)}" +
              (f", mean return of the last 10: {sum(returns[-10:]) / len(returns[-10:]):.1f}" if returns else ""))
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "episodes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "global_step", "episode_return"])
        w.writerows((run["label"], *e) for run in runs for e in run["episodes"])
    with open(os.path.join(folder, "timings.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["gae", "iteration", "advantage_ms", "update_ms"])
        w.writerows((run["label"], *t) for run in runs for t in run["timings"])
    returns_plot(os.path.join(folder, "returns.png"), {run["label"]: run["episodes"] for run in runs}, title,
                 "global step")
    print(f"wrote {folder}/episodes.csv, timings.csv and returns.png")
