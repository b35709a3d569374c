"""``python -m rl_triton``: run every estimator on a realistic rollout, check it, time it.

For each rollout shape the demo runs the seven estimators and ``affine_scan`` on
``backend="auto"`` (Triton on CUDA, the numba loop on CPU when numba is installed, else the
plain torch loop), checks each result against ``backend="torch"`` (the plain loop over time),
times both (median of several repeats) and prints one table. On CPU it also times GAE against
a numpy re-implementation of Stable-Baselines3's ``RolloutBuffer.compute_returns_and_advantage``
loop, fed with SB3's observation-aligned ``episode_starts`` flags. ``masked_whiten`` (with a
mask of about 80% valid elements), ``arrival_gae`` and ``group_advantages`` are checked against
the float64 oracle (``rl_triton.testing.oracle``) instead of the torch backend; the oracle's time
is shown without a speed-up. A row beyond tolerance fails the demo, and a line after the table
names the element that differs most, the oracle's value there where the row has one, and the
values a second call of each side gives.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

import rl_triton as rt
from rl_triton.core.launch import resolve_backend
from rl_triton.testing import Problem, make, oracle

GAMMA = 0.99
LMBDA = 0.95
DONE_PROB = 1.0 / 200.0  # an episode ends about every 200 steps
TERMINATED_SHARE = 0.7  # the other 30% of episode ends are time-limit truncations
# estimator -> (variant of rl_triton.testing.catalog, hyperparameters): Gymnasium flags and
# explicit next values (final-observation values at truncations) where the estimator bootstraps
ESTIMATORS = {
    "gae": ("gym", dict(gamma=GAMMA, lmbda=LMBDA)),
    "td_lambda_return": ("gym", dict(gamma=GAMMA, lmbda=LMBDA)),
    "discounted_return": ("gym", dict(gamma=GAMMA)),
    "vtrace": ("gym", dict(gamma=GAMMA)),
    "retrace": ("expected", dict(gamma=GAMMA, lmbda=LMBDA)),
    "eligibility_trace": ("done", dict(gamma=GAMMA, lmbda=LMBDA)),
    "episodic_cumsum": ("done", {}),
    "affine_scan": ("reverse", {}),
}


# --------------------------------------------------------------------------------------
# rollout


@dataclass
class Shape:
    dims: Tuple[int, int]
    time_dim: int  # 0: time-major [T, N] (SB3 buffers); -1: batch-major [N, T]

    @property
    def label(self) -> str:
        a, b = self.dims
        return f"{a}x{b} " + ("(T,N)" if self.time_dim == 0 else "(N,T)")


def rollout_problems(shape: Shape, device: torch.device, seed: int = 0) -> List[Tuple[str, Problem]]:
    """(name, problem) for the seven estimators and affine_scan on rollouts of ``shape``: an
    episode ends at a step with probability DONE_PROB, by termination in TERMINATED_SHARE of
    the cases, else by truncation."""
    return [(name, make(name, shape.dims, variant, time_dim=shape.time_dim, device=device, seed=seed + i,
                        p_term=DONE_PROB * TERMINATED_SHARE, p_trunc=DONE_PROB * (1 - TERMINATED_SHARE), **hyper))
            for i, (name, (variant, hyper)) in enumerate(ESTIMATORS.items())]


# --------------------------------------------------------------------------------------
# Stable-Baselines3 reference (CPU, numpy, time-major [T, N])


def sb3_gae_numpy(rewards, values, episode_starts, last_values, dones, gamma, gae_lambda):
    """The loop of SB3's RolloutBuffer.compute_returns_and_advantage, in numpy.

    episode_starts[t] = 1 where observation t starts an episode; dones = whether the last
    step of the window ended an episode; last_values = V(s_T)."""
    buffer_size = rewards.shape[0]
    advantages = np.zeros_like(rewards)
    last_gae_lam = 0
    for step in reversed(range(buffer_size)):
        if step == buffer_size - 1:
            next_non_terminal = 1.0 - dones.astype(np.float32)
            next_values = last_values
        else:
            next_non_terminal = 1.0 - episode_starts[step + 1]
            next_values = values[step + 1]
        delta = rewards[step] + gamma * next_values * next_non_terminal - values[step]
        last_gae_lam = delta + gamma * gae_lambda * next_non_terminal * last_gae_lam
        advantages[step] = last_gae_lam
    return advantages, advantages + values


def sb3_calls(shape: Shape):
    """GAE from SB3's buffers (CPU): rl_triton (flags mapped) vs the SB3 numpy loop."""
    if shape.time_dim != 0:
        raise ValueError("the SB3 reference row needs a time-major rollout")
    # SB3's observation-aligned flags, read in place: done[t] = episode_starts[t+1],
    # done[T-1] = last_done, all terminations (SB3 folds the truncation bootstrap into the rewards)
    problem = make("gae", shape.dims, "episode_starts", time_dim=0, seed=len(ESTIMATORS), p_term=DONE_PROB,
                   p_trunc=0.0, gamma=GAMMA, lmbda=LMBDA)
    rewards, values = (x.numpy() for x in problem.args)
    episode_starts, last_dones, last_values = (problem.kwargs[k].numpy() for k in
                                               ("episode_starts", "last_done", "bootstrap_value"))

    def loop():
        return sb3_gae_numpy(rewards, values, episode_starts, last_values, last_dones,
                             GAMMA, LMBDA)

    return problem.call, loop


# --------------------------------------------------------------------------------------
# estimators checked against the float64 oracle (rl_triton.testing.oracle)

ORACLE = "float64 oracle"
GROUP_SIZE = 8  # responses per prompt
RESPONSE_LENGTH = 64  # tokens per response


@dataclass
class Batch:
    """The shape of a token-level batch: responses x tokens."""

    dims: Tuple[int, int]

    @property
    def label(self) -> str:
        return f"{self.dims[0]}x{self.dims[1]} (B,L)"


def oracle_calls(shape: Shape, device: torch.device):
    """(name, shape, fast, oracle) for the estimators the demo checks against the float64
    oracle: ``arrival_gae`` on PufferLib-style rows of ``shape`` (clipped importance ratios, dones
    arriving with the next observation) and ``group_advantages`` (GRPO) on as many tokens, in
    responses of RESPONSE_LENGTH tokens, GROUP_SIZE responses per prompt, a random response mask),
    and ``masked_whiten`` of float32 advantages of ``shape`` over a random mask (about 80% valid)."""
    arrival = make("arrival_gae", shape.dims, "ratio+done", time_dim=shape.time_dim, device=device,
                   seed=len(ESTIMATORS) + 1, p_term=DONE_PROB, p_trunc=0.0, gamma=GAMMA, lmbda=LMBDA)
    B = max(GROUP_SIZE, shape.dims[0] * shape.dims[1] // RESPONSE_LENGTH)
    g = torch.Generator().manual_seed(len(ESTIMATORS) + 2)
    scores = torch.randn(B, generator=g)
    ids = torch.randperm(B, generator=g) // GROUP_SIZE  # prompts in shuffled order
    mask = torch.rand(B, RESPONSE_LENGTH, generator=g) < 0.9
    on_device = [x.to(device) for x in (scores, ids, mask)]
    labels = ids.tolist()

    def grouped():
        return rt.group_advantages(*on_device[:2], mode="grpo", mask=on_device[2])

    x = (torch.randn(shape.dims, generator=g) * 2.0 + 0.5).to(device)
    valid = (torch.rand(shape.dims, generator=g) < 0.8).to(device)

    def whitened():
        return torch.from_numpy(oracle.masked_whiten(x.double().cpu().numpy(), valid.cpu().numpy()))

    return [("arrival_gae", shape, lambda: arrival.call("auto"), arrival.expected),
            ("masked_whiten", shape, lambda: rt.masked_whiten(x, valid), whitened),
            ("group_advantages", Batch((B, RESPONSE_LENGTH)), grouped,
             lambda: oracle.group_advantages(scores.double().numpy(), labels, "grpo", mask.numpy()))]


# --------------------------------------------------------------------------------------
# timing, checking, printing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median seconds per call. CPU: perf_counter; CUDA: events around each call."""
    times = []
    if device.type == "cuda":
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _as_tensors(out) -> List[torch.Tensor]:
    if isinstance(out, (tuple, list)):
        return [torch.as_tensor(o) for o in out]
    return [torch.as_tensor(out)]


def max_error(fast, ref) -> Tuple[float, bool]:
    """Max abs difference over all outputs, and whether it is within float32 tolerance."""
    worst, ok = 0.0, True
    for a, b in zip(_as_tensors(fast), _as_tensors(ref)):
        a = a.detach().to("cpu", torch.float64)
        b = b.detach().to("cpu", torch.float64)
        err = (a - b).abs().max().item() if a.numel() else 0.0
        tol = 1e-4 * (1.0 + b.abs().max().item()) if b.numel() else 0.0
        worst = max(worst, err)
        ok = ok and a.shape == b.shape and err <= tol
    return worst, ok


def worst_element(fast, ref) -> Tuple[int, Tuple[int, ...]]:
    """(output, element index) where ``|fast - ref|`` is largest over all outputs (NaN counts
    as largest): the element a mismatch report names."""
    best, where = -1.0, (0, ())
    for i, (a, b) in enumerate(zip(_as_tensors(fast), _as_tensors(ref))):
        if not a.numel() or a.shape != b.shape:
            continue
        d = (a.detach().to("cpu", torch.float64) - b.detach().to("cpu", torch.float64)).abs()
        d = torch.nan_to_num(d, nan=float("inf"))
        k = int(d.argmax())
        if d.view(-1)[k].item() > best:
            best, where = d.view(-1)[k].item(), (i, tuple(int(j) for j in np.unravel_index(k, tuple(a.shape))))
    return where


def mismatch_detail(out_fast, out_ref, fast, loop, expected=None) -> str:
    """Where a fast result and its reference differ most, with the float64 oracle's value there
    (``expected``: the oracle's outputs, where the row has them), and the values a second fast
    call and a second reference call give at that element: whether a side changes from call to
    call, and which side the oracle agrees with."""
    i, idx = worst_element(out_fast, out_ref)

    def at(out):
        return _as_tensors(out)[i][idx].item()

    text = f"output {i} at {list(idx)}: fast {at(out_fast):.7g}, reference {at(out_ref):.7g}"
    if expected is not None:
        text += f", float64 oracle {at(expected()):.7g}"
    return text + f"; called again: fast {at(fast()):.7g}, reference {at(loop()):.7g}"


def fmt_time(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1.0:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.2f} s"


class _Progress:
    """Progress on stderr. On a terminal (stdout and stderr both): a tqdm bar redrawn in place, or
    a one-line counter without tqdm. Otherwise (piped or written to a file) one plain line per
    run, so that a log holds no carriage-return redraws."""

    def __init__(self, total: int, enabled: bool = True):
        self._bar = None
        self._n, self._total = 0, total
        self._enabled = enabled
        self._terminal = sys.stderr.isatty() and sys.stdout.isatty()
        if not (enabled and self._terminal):
            return
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="run", leave=False, file=sys.stderr)

    def update(self, desc: str) -> None:
        self._n += 1
        if self._bar is not None:
            self._bar.set_description_str(desc, refresh=False)
            self._bar.update(1)
        elif self._enabled and self._terminal:
            sys.stderr.write(f"\r[{self._n}/{self._total}] {desc:<48}")
            sys.stderr.flush()
        elif self._enabled:
            sys.stderr.write(f"[{self._n}/{self._total}] {desc}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._enabled and self._terminal:
            sys.stderr.write("\r" + " " * 60 + "\r")
            sys.stderr.flush()


def auto_backend_name(device: torch.device) -> str:
    """What backend="auto" runs on tensors of this device (docs/semantics.md, Backends)."""
    return resolve_backend("auto", device)


def print_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


# --------------------------------------------------------------------------------------
# main


def _measure(name, shape, fast, loop, loop_name, fast_name, repeats, dev,
             expected=None) -> Tuple[List[str], Optional[str]]:
    """One table row (warm up, check against the reference, time both) and, where the results
    differ beyond tolerance, :func:`mismatch_detail` (``expected``: the float64 oracle's
    outputs, where the row has them)."""
    out_fast = fast()  # warm-up: numba / Triton compile on the first call
    fast()
    _sync(dev)
    t0 = time.perf_counter()
    out_ref = loop()
    _sync(dev)
    loop_once = time.perf_counter() - t0
    err, ok = max_error(out_fast, out_ref)
    detail = None if ok else mismatch_detail(out_fast, out_ref, fast, loop, expected)
    t_fast = median_time(fast, repeats, dev)
    # keep slow reference loops to a few calls so the demo stays short
    loop_repeats = repeats if loop_once * repeats < 2.0 else max(1, min(repeats, 3))
    t_loop = median_time(loop, loop_repeats, dev)
    loop_cell = fmt_time(t_loop) + ("" if loop_name == "torch loop" else f" ({loop_name})")
    speed_up = "-" if loop_name == ORACLE else f"{t_loop / t_fast:.1f}x"  # a Python loop in float64
    return [name, shape.label, fast_name, fmt_time(t_fast), loop_cell,
            speed_up, f"{err:.1e} " + ("ok" if ok else "MISMATCH")], detail


def default_shapes(device: torch.device, quick: bool) -> List[Shape]:
    if device.type == "cuda":
        shapes = [Shape((4096, 128), -1), Shape((512, 1024), 0)]
    else:
        # SB3's default PPO rollout (2048 steps x 8 envs) and a wide one (128 steps x 64 envs),
        # both time-major like SB3's buffers
        shapes = [Shape((2048, 8), 0), Shape((128, 64), 0)]
    if quick:  # the smaller CPU shape, the first GPU shape
        return shapes[-1:] if device.type == "cpu" else shapes[:1]
    return shapes


def pick_device(device: Optional[str]) -> Tuple[Optional[torch.device], str]:
    """The device ``--device`` names, or None and a one-line reason it cannot be used here.

    ``device``: None or "auto" (CUDA when torch sees it, else the CPU), "cpu", "cuda" or
    "cuda:N"; the reason names the device as given."""
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), ""
    choices = "auto, cpu, cuda or cuda:N"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return None, f"--device {device}: not a device name torch knows; use {choices}"
    if dev.type not in ("cpu", "cuda"):
        return None, f"--device {device}: the demo runs on {choices}"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return None, f"--device {device}, but torch.cuda.is_available() is False"
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            return None, f"--device {device}, but torch sees {torch.cuda.device_count()} CUDA device(s)"
    return dev, ""


def run(device: Optional[str] = None, repeats: Optional[int] = None, quick: bool = False,
        progress: bool = True) -> int:
    dev, problem = pick_device(device)
    if dev is None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if repeats is None:
        repeats = 5 if quick else 20
    repeats = max(1, repeats)
    shapes = default_shapes(dev, quick)
    fast_name = auto_backend_name(dev)

    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (
        f"CPU, {torch.get_num_threads()} torch threads")
    print(f"rl_triton {getattr(rt, '__version__', '?')} demo on {dev} ({where}); "
          f"torch {torch.__version__}")
    print(f'backend "auto" runs "{fast_name}" here; reference: backend "torch" (plain loop over '
          f"time); float32, gamma={GAMMA}, lmbda={LMBDA}; median of {repeats} calls after warm-up")
    print("arrival_gae, masked_whiten and group_advantages: checked against the float64 oracle "
          "(rl_triton.testing.oracle, a Python loop; no speed-up)")
    if fast_name == "torch" and dev.type == "cpu":
        print("note: numba is not installed, so on CPU 'auto' is the plain torch loop "
              '(pip install -e ".[cpu]" for the compiled CPU loop)')
    elif fast_name == "torch":
        print("note: the Triton backend is not usable here, so 'auto' is the plain torch loop")
    print()

    plan = []
    for shape in shapes:
        for name, problem in rollout_problems(shape, dev):
            plan.append((name, shape, lambda p=problem: p.call("auto"),
                         lambda p=problem: p.call("torch"), "torch loop", problem.expected))
        if dev.type == "cpu" and shape.time_dim == 0:
            fast, loop = sb3_calls(shape)
            plan.append(("gae vs SB3 numpy loop", shape, lambda fast=fast: fast("auto"), loop,
                         "SB3 numpy", None))
        for name, label, fast, expected in oracle_calls(shape, dev):
            plan.append((name, label, fast, expected, ORACLE, None))

    rows, failures, errors, mismatches = [], 0, [], []
    bar = _Progress(len(plan), enabled=progress)
    try:
        for name, shape, fast, loop, loop_name, expected in plan:
            bar.update(f"{name} {shape.label}")
            try:
                row, detail = _measure(name, shape, fast, loop, loop_name, fast_name, repeats, dev, expected)
                rows.append(row)
                if detail is not None:
                    mismatches.append(f"{name} {shape.label}: {detail}")
            except Exception as e:  # report it and go on with the other estimators
                rows.append([name, shape.label, fast_name, "error", "-", "-", "-"])
                errors.append(f"{name} {shape.label}: {type(e).__name__}: {e}")
            if rows[-1][-1] == "-" or rows[-1][-1].endswith("MISMATCH"):
                failures += 1
    finally:
        bar.close()

    print_table(rows, ["estimator", "shape", "backend", "time fast", "time loop", "speed-up",
                       "max error"])
    print()
    for line in errors:
        print(f"error: {line}")
    for line in mismatches:
        print(f"mismatch: {line}")
    if failures:
        print(f"{failures} of {len(plan)} runs failed or differ from the reference beyond "
              "float32 tolerance.")
        return 1
    print("all results match the reference loop within float32 tolerance "
          "(max abs error <= 1e-4 * (1 + max |reference|)).")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rl_triton",
        description="Run every rl_triton estimator on a realistic rollout, check it against "
                    "the plain loop and time both.")
    p.add_argument("--device", default="auto",
                   help="auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed calls per measurement (median); default 20, 5 with --quick")
    p.add_argument("--quick", action="store_true",
                   help="one shape and 5 repeats")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    return run(device=a.device, repeats=a.repeats, quick=a.quick, progress=not a.no_progress)
