"""Repeated calls replayed as CUDA graphs.

Training loops call the estimators with the same rollout buffers every iteration. A call whose
signature has a plan (rl_triton/core/plans.py) launching Triton kernels from data pointers, and
whose outputs all go to ``out=``, is a fixed sequence of kernel launches on fixed memory once
its tensors' data pointers are fixed too. Such a call is counted per (signature, data
pointers): the first occurrence launches as usual, the second is captured into a CUDA graph
(and the graph replayed once, which computes it), later ones replay the graph: one launch from
the host instead of the plan's Python and Triton's launcher per kernel.

A replay runs what the plan's own hit path checks first: the one-element CPU tensors read as
numbers must hold the captured values and the plan's value checks run (they exist on CUDA only
with ``RL_TRITON_CHECK_VALUES=1``); a call where one fails, or where Triton launch hooks are set
or another device is current, takes the plan's path instead. Nothing is captured while the
caller's stream is capturing (the call then launches plainly into the caller's graph), under
autograd (such calls have no plan) or inside a ``torch.compile`` trace (nor there). At most
``MAX_GRAPHS`` graphs are kept, the least recently replayed evicted first; ``clear()`` drops them.
Replays are on by default; ``RL_TRITON_GRAPHS=0`` leaves every call on the plan's path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

MAX_GRAPHS = 64
_graphs: OrderedDict = OrderedDict()  # (plan, its tensors' data pointers): _Entry
_lock = threading.Lock()
_SKIP = object()  # an entry whose capture failed: its calls stay on the plan's path


class _Entry:
    __slots__ = ("seen", "replay")

    def __init__(self):
        self.seen = 1
        self.replay = None


def enabled(setting: str | None) -> bool:
    """Whether replays are on, ``setting`` being the value of ``RL_TRITON_GRAPHS`` (None where
    unset; a call's ``inputs.env_state()`` holds it): on unless it says ``0``, ``false``,
    ``off`` or ``no``."""
    return setting is None or setting.strip().lower() not in ("0", "false", "off", "no")


def clear() -> None:
    """Forget every graph (their memory goes back to torch's caching allocator)."""
    with _lock:
        _graphs.clear()


def eligible(plan) -> bool:
    """Whether ``plan``'s calls can be replayed: Triton launches from data pointers on a CUDA
    device, every output given by ``out=``."""
    return plan.pointers and plan.device.type == "cuda" and outputs_given(plan)


def outputs_given(plan) -> bool:
    """Whether every output of ``plan``'s calls is a tensor the caller passes in ``out=``."""
    return all(make is None for make, *_ in plan.outputs)


def replay(plan, addresses: tuple, args, kwargs) -> bool:
    """Serve a call of ``plan`` (its tensors at the data pointers ``addresses``, the arguments
    ``args``/``kwargs``) from a graph where the same tensors come again: True where a graph ran
    the call; False where the plan's path serves it (the first occurrence, a failed capture or
    precondition). The caller (the plan's generated ``replayer``) has checked the call's
    numbers and run its value checks."""
    if not launch_ok(plan.device) or capturing():
        return False
    gkey = (plan, addresses)
    with _lock:
        entry = _graphs.get(gkey)
        if entry is None:
            if len(_graphs) >= MAX_GRAPHS:
                _graphs.popitem(last=False)  # the least recently replayed
            _graphs[gkey] = _Entry()
            return False
        _graphs.move_to_end(gkey)
        entry.seen += 1
    if entry.replay is _SKIP:
        return False
    if entry.replay is None:
        entry.replay = capture(lambda: plan.hit(args, kwargs), plan.device) or _SKIP
        if entry.replay is _SKIP:
            return False
    entry.replay()
    return True


def capturing() -> bool:
    """Whether the current stream (of the current device) is capturing a graph: the caller's."""
    return torch.cuda.is_current_stream_capturing()


def launch_ok(device: torch.device) -> bool:
    """Whether a replay may run now: no Triton launch hooks set, ``device`` current."""
    from . import kernels

    return kernels.direct_launch_ok(device)


def capture(launch, device: torch.device):
    """A function replaying the CUDA graph of ``launch()`` (which returns None where it launched
    nothing) on the current stream; None where the capture fails or captured nothing.

    The capture runs on a side stream that waits for the current one, between the graph's own
    ``capture_begin`` and ``capture_end``: unlike the ``torch.cuda.graph`` context it does not
    synchronise the device, collect garbage or empty torch's cache, which in a training
    process would cost far more than the capture."""
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    try:
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launched = launch()
            finally:
                graph.capture_end()
    except RuntimeError:
        return None
    torch.cuda.current_stream(device).wait_stream(side)
    return None if launched is None else graph.replay
