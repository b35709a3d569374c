"""The one launch path: backend choice, output buffers, and dispatch of an algorithm of
``rl_triton/core/spec.py`` to Triton, numba or (for the affine scan) a torch loop.

Inside a ``torch.compile`` trace the launches go through torch custom ops, so
``torch.compile(fullgraph=True)`` traces the estimators without graph breaks (the kernels are
opaque to the compiler, described to it by fake implementations); eager calls launch directly.
"""

from __future__ import annotations

import math
import sys
from typing import List, Optional

import torch

from . import coefficients as C
from . import cpu, inputs, spec

BACKENDS = ("auto", "triton", "cpu", "torch")


def _kernels():
    """The Triton backend, imported on first use (importing triton takes a while)."""
    from . import kernels

    return kernels


def triton_usable(device: torch.device) -> bool:
    """Triton runs CUDA tensors, or CPU tensors under the interpreter (TRITON_INTERPRET=1)."""
    kernels = _kernels()
    if not kernels.AVAILABLE:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and kernels.INTERPRET


_resolved: dict = {}


def resolve_backend(backend, device: torch.device) -> str:
    """The backend for tensors on ``device``; ``None`` reads ``RL_TRITON_BACKEND``."""
    if backend is None:
        backend = inputs.env("RL_TRITON_BACKEND") or "auto"
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    key = (backend, device.type)
    if key not in _resolved:
        _resolved[key] = _resolve(backend, device)
    return _resolved[key]


def _resolve(backend: str, device: torch.device) -> str:
    name = backend.strip().lower()
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if name == "auto":
        if device.type == "cuda":
            if not _kernels().AVAILABLE:
                raise ValueError("CUDA tensors run on the Triton backend, which needs triton: "
                                 "pip install -e '.[gpu]' (or pass backend='torch')")
            return "triton"
        if device.type == "cpu" and cpu.AVAILABLE:
            return "cpu"
        return "torch"
    if name == "cpu":
        if not cpu.AVAILABLE:
            raise ValueError("backend='cpu' needs numba: pip install -e '.[cpu]'")
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' runs CPU tensors, got tensors on {device}")
    if name == "triton" and not triton_usable(device):
        if not _kernels().AVAILABLE:
            raise ValueError("backend='triton' needs triton (pip install -e '.[gpu]') and CUDA tensors, or "
                             f"TRITON_INTERPRET=1 to run CPU tensors in Triton's interpreter; got tensors on {device}")
        raise ValueError(
            f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}"
        )
    return name


def prepare(algo: spec.Algorithm, backend: str, compute: torch.dtype, args, outs, edge: bool = False,
            moments=None):
    """The backend's launch of ``algo`` for the signature of these ``[R, T]`` views (``args``:
    ``algo.Args``; ``outs``: output views), with ``launch(args, outs)``; ``edge``: a launch that
    reports edge maps (spec.py); ``moments``: a Triton launch that also reduces an output into
    partial moments (``kernels.Launch``'s)."""
    if backend == "cpu":
        return cpu.Launch(algo, compute, args, outs, edge)
    if algo.window:  # not a scan: its own kernel, not the engine's
        from .kernels import nstep

        return nstep.Launch(algo, args, outs)
    return _kernels().Launch(algo, args, outs, moments=moments)


def plan_forced() -> bool:
    """Whether ``kernels.forced_plan`` is in effect (tests and plan sweeps); then calls take the
    full path. Not imported yet, the Triton backend forces nothing."""
    kernels = sys.modules.get(f"{__package__}.kernels")
    return kernels is not None and bool(kernels._forced)


def pointer_launches(backend: str) -> bool:
    """Whether ``backend`` launches from data pointers (compiled Triton kernels; the interpreter
    needs tensors)."""
    return backend == "triton" and not _kernels().INTERPRET


def output_dtype(backend: str, compute: torch.dtype, dtype: torch.dtype) -> torch.dtype:
    """The dtype the kernels write: numba the compute dtype, Triton the caller's."""
    return compute if backend == "cpu" else dtype


def _dispatch(algo: spec.Algorithm, backend: str, compute: torch.dtype, args, outs, edge=None) -> None:
    """Run ``algo`` on ``[R, T]`` views (``args``: ``algo.Args``) into the output views ``outs``;
    with ``edge`` (float64 ``[R, k]``), write the rows' edge maps there instead (Triton) or as
    well (numba)."""
    runner = prepare(algo, backend, compute, args, outs, edge is not None)
    if edge is None:
        runner.launch(args, outs)
    elif backend == "cpu":
        runner.launch(args, outs, edge.numpy())
    else:
        runner.edge_map(args, outs, edge)


def _run(algo: spec.Algorithm, backend: str, compute: torch.dtype, args, rows: inputs.Rows, given, edge=None):
    """Outputs in the caller's layout (``given``: caller tensors or None each). The kernels write
    the outputs in place where they have an ``[R, T]`` view in the kernel's dtype (numba writes
    the compute dtype, Triton the caller's), else into a buffer copied out afterwards."""
    dtype = output_dtype(backend, compute, rows.dtype)
    outs = []
    for out in given:
        out, view = rows.output(out) if dtype == rows.dtype else (out, None)
        buffer = torch.empty(rows.R, rows.T, dtype=dtype, device=rows.device) if view is None else None
        outs.append((out, view if buffer is None else buffer, buffer))
    _dispatch(algo, backend, compute, args, [view for _, view, _ in outs], edge)
    return tuple(out if buffer is None else rows.deliver(buffer, out) for out, _, buffer in outs)


def run(algo: spec.Algorithm, backend: str, compute: torch.dtype, args, rows: inputs.Rows, given, edge=None):
    """Run the fused kernel of ``algo`` (``args``: ``algo.Args`` of ``[R, T]`` views) on
    ``backend``, accumulating in ``compute``; a tuple of outputs in the caller's layout, written
    into ``given`` where those are tensors. ``edge``: see :func:`_dispatch`."""
    if edge is not None:
        return _run(algo, backend, compute, args, rows, given, edge)
    if torch.compiler.is_compiling():
        tensors, numbers = _encode(args)
        results = fused(algo.name, backend, compute, tensors, numbers, rows.ref, rows.tdim)
        return tuple(r if o is None else o.copy_(r) for r, o in zip(results, given))
    return _run(algo, backend, compute, args, rows, given)


def _encode(args) -> tuple[list, list]:
    """Kernel arguments as an op schema can carry them: a tensor list and a number list
    (NaN marks an absent input)."""
    tensors, numbers = [], []
    for x in args:
        is_tensor = isinstance(x, torch.Tensor)
        tensors.append(x if is_tensor else None)
        numbers.append(0.0 if is_tensor else math.nan if x is None else float(x))
    return tensors, numbers


def _decode(algo: spec.Algorithm, tensors, numbers):
    args = []
    for kind, x, n in zip(algo.kinds, tensors, numbers):
        if x is not None:
            args.append(x)
        elif math.isnan(n):
            args.append(None)
        else:
            args.append(int(n) if kind in ("i", "n") else bool(n) if kind == "b" else n)
    return algo.Args(*args)


# The custom ops' list types are spelt with typing.List/Optional: torch before 2.7 infers the op
# schema only from those (it rejects list[torch.Tensor | None]).
@torch.library.custom_op("rl_triton::fused", mutates_args=())
def fused(name: str, backend: str, compute: torch.dtype, tensors: List[Optional[torch.Tensor]], numbers: List[float],
          like: torch.Tensor, time_dim: int) -> List[torch.Tensor]:
    """Run fused kernel ``name``; outputs are laid out like ``like`` (time at ``time_dim``)."""
    algo = spec.ALGORITHMS.get(name) or spec.WINDOWED[name]
    rows = inputs.Rows(like, "like", time_dim, like.dtype)
    return list(_run(algo, backend, compute, _decode(algo, tensors, numbers), rows, [None] * len(algo.outputs)))


@fused.register_fake
def _(name, backend, compute, tensors, numbers, like, time_dim):
    return [torch.empty_like(like) for _ in (spec.ALGORITHMS.get(name) or spec.WINDOWED[name]).outputs]


def _scan_torch(alpha, beta, carry, reverse):
    y = torch.empty_like(alpha)
    acc = carry
    steps = range(alpha.shape[1] - 1, -1, -1) if reverse else range(alpha.shape[1])
    for t in steps:
        acc = C.step(alpha[:, t], beta[:, t], acc)
        y[:, t] = acc
    return y


def _scan_rows(alpha, beta, carry, reverse: bool, backend: str):
    if backend == "torch":
        return _scan_torch(alpha, beta, carry, reverse)
    y = torch.empty(alpha.shape, dtype=alpha.dtype, device=alpha.device)
    _dispatch(spec.AFFINE_SCAN, backend, alpha.dtype, spec.AFFINE_SCAN.bind(alpha=alpha, beta=beta, carry=carry,
                                                                              reverse=bool(reverse)), [y])
    return y


@torch.library.custom_op("rl_triton::affine_scan_rows", mutates_args=())
def affine_scan_rows(alpha: torch.Tensor, beta: torch.Tensor, carry: torch.Tensor, reverse: bool,
                     backend: str) -> torch.Tensor:
    """The affine scan of ``[R, T]`` rows inside a torch.compile trace."""
    return _scan_rows(alpha, beta, carry, reverse, backend)


@affine_scan_rows.register_fake
def _(alpha, beta, carry, reverse, backend):
    return torch.empty(alpha.shape, dtype=alpha.dtype, device=alpha.device)


def scan_rows(alpha, beta, carry, reverse: bool, backend: str):
    """y of the affine scan of ``[R, T]`` float tensors ``alpha``, ``beta`` from ``carry`` ``[R]``
    (no autograd; rl_triton/core/scan.py adds it)."""
    if torch.compiler.is_compiling():
        return affine_scan_rows(alpha, beta, carry, reverse, backend)
    return _scan_rows(alpha, beta, carry, reverse, backend)
