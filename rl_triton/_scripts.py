"""Support for the repository's example and benchmark scripts (not part of rl_triton's API).

- :func:`parser`: an ``argparse`` parser whose ``--help`` shows the script's whole docstring as
  written and the default of every option;
- :func:`require`: exit with the install line when an optional package is missing, instead of
  a traceback (call it after parsing, so ``--help`` works without the package);
- :func:`progress`: a tqdm bar that redraws in place on a terminal and writes plain lines at a
  slow pace into a log file;
- :func:`quiet_mujoco`: MuJoCo's warnings without the log file it writes into the working
  directory and without the deprecation notices of the environments' bundled model files.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

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
    "tensorboard": "also write TensorBoard logs under OUT/tb",
    "out": "folder for the CSV and PNG outputs",
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


def two_panels(path: str, curves, left: dict, right: dict) -> None:
    """A PNG of two plots side by side: ``curves`` yields ``(label, (x, y), (x, y))``, a run's
    points on the left and on the right plot; ``left``/``right`` are each axis' ``set`` keywords
    (xlabel, ylabel, title, yscale, ...). matplotlib with the Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    # a wide solid line under narrower dashed ones: runs that coincide (same seed) stay visible
    styles = (dict(linestyle="-", linewidth=4, alpha=0.5), dict(linestyle="--", linewidth=1.5),
              dict(linestyle=":", linewidth=1.5), dict(linestyle="-.", linewidth=1))
    for i, (label, *points) in enumerate(curves):
        for ax, (x, y) in zip(axes, points):
            ax.plot(x, y, marker=".", label=label, **styles[i % len(styles)])
    for ax, settings in zip(axes, (left, right)):
        ax.set(**settings)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
