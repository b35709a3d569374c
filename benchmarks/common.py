"""Shared by the benchmark scripts: their command-line parser and side-by-side CPU timing.

Side-by-side timing: the implementations take turns in one process; every round times a batch
of calls of each, in an order that rotates from round to round, so that a slow phase of a
shared machine hits all of them alike. Ratios are taken within a round; the scripts report the
median over the rounds and the spread (lowest to highest round).

This module imports neither torch nor rl_triton at import time, so scripts that load another
checkout's rl_triton (``--root``) or run without torch can use it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Sequence


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description with its line breaks, and "(default: ...)" after each option's help."""


def parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose ``--help`` prints ``doc`` (the script's ``__doc__``) in full and every
    option's default (options need a help string for their default to show)."""
    return argparse.ArgumentParser(description=doc, formatter_class=HelpFormatter)


def alternate(impls: Dict[str, Callable[[], object]], rounds: int = 9, batch_s: float = 0.05) -> Dict[str, List[float]]:
    """Seconds per call of each implementation in each of ``rounds`` rounds.

    Each implementation is called once untimed (compilation, caches) and once more to size its
    batch: enough back-to-back calls for about ``batch_s`` seconds (at least one). A round then
    times one batch of each implementation in turn."""
    names = list(impls)
    batch = {}
    for name, fn in impls.items():
        fn()
        start = time.perf_counter()
        fn()
        batch[name] = max(1, int(batch_s / max(time.perf_counter() - start, 1e-7)))
    times: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            fn, n = impls[name], batch[name]
            start = time.perf_counter()
            for _ in range(n):
                fn()
            times[name].append((time.perf_counter() - start) / n)
    return times


def ratios(slow: Sequence[float], fast: Sequence[float]) -> List[float]:
    """``slow[i] / fast[i]`` per round: how many times faster ``fast`` ran in each round."""
    return [s / f for s, f in zip(slow, fast)]


def spread(values: Sequence[float], fmt: str = "{:.1f}", unit: str = "") -> str:
    """``median (lowest-highest)`` of ``values``, each written with ``fmt`` and ``unit``."""
    med = statistics.median(values)
    return f"{fmt.format(med)}{unit} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def pair_cells(times: Dict[str, List[float]], slow: str, fast: str) -> str:
    """Three table cells from :func:`alternate`'s seconds: ``times[slow]`` and ``times[fast]`` in ms
    and the per-round speed-up of ``fast``, each as :func:`spread` writes it."""
    ms = [spread([1e3 * t for t in times[k]], "{:.3f}") for k in (slow, fast)]
    return f"{ms[0]} | {ms[1]} | {spread(ratios(times[slow], times[fast]), unit='x')}"


def set_threads(threads) -> None:
    """torch's and numba's (where installed) CPU threads; nothing where ``threads`` is None or 0."""
    if not threads:
        return
    import torch

    torch.set_num_threads(threads)
    try:
        import numba
    except ImportError:
        return
    numba.set_num_threads(threads)


def machine() -> str:
    """The CPU model, core count and torch's thread count, for table headers."""
    import torch

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{name}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def synced(fn: Callable[[], object], device: str) -> Callable[[], object]:
    """``fn`` followed by a CUDA synchronisation where ``device`` is a CUDA device (so that a
    timed call includes its kernels), ``fn`` itself otherwise."""
    if not str(device).startswith("cuda"):
        return fn
    import torch

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out

    return call


def one_call_us(fn: Callable[[], object], device: str) -> float:
    """Microseconds of one call of ``fn``: CUDA events around it after a synchronize where
    ``device`` is a CUDA device, the wall clock otherwise."""
    if str(device).startswith("cuda"):
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3
    start = time.perf_counter()
    fn()
    return 1e6 * (time.perf_counter() - start)


def first_calls(fn: Callable[[], object], rounds: int, device: str) -> Dict[str, List[float]]:
    """Per round, microseconds of the first and the second call of ``fn`` after rl_triton's call
    plans (and their graphs) are cleared: the first call of a signature (validation, the plan's
    making, its first launch) and the second (the plan's hit function written; with
    ``RL_TRITON_GRAPHS=1`` the call that captures where the same tensors come again)."""
    from rl_triton.core import plans

    times: Dict[str, List[float]] = {"first": [], "second": []}
    for _ in range(rounds):
        plans.clear()
        times["first"].append(one_call_us(fn, device))
        times["second"].append(one_call_us(fn, device))
    return times
