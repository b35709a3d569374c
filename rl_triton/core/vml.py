"""A guard against a oneMKL race that makes torch's CPU unary ops return low-accuracy results.

torch computes contiguous float32 and float64 unary ops on the CPU (``exp``, ``log``, ``sqrt``,
``tanh``, ...) with oneMKL's vector math library (VML), each intra-op thread on its chunk.
oneMKL 2024.2, which torch's CPU wheels bundle, picks each VML function's kernel on that
function's first call in the process; where that first call runs on several threads at once,
one thread can run a low-accuracy kernel on its chunk of that one call (pytorch/pytorch#188792;
on this project's machine: half of an 8192-element ``torch.exp`` off by up to 6e-5 relative, in
about 1 fresh process in 100). Later calls are right, so the error shows as a transient.

:func:`warm` calls each such op once on one element, in float32 and float64, on the calling
thread: oneMKL then has every kernel chosen before any concurrent call. ``import rl_triton``
runs it, before the library computes anything (its composed paths use ``exp``, ``log`` and
``sqrt``). It cannot repair a call that ran concurrently before the import.
"""

from __future__ import annotations

import torch

# the unary ops torch hands to VML (ATen's cpu/vml.h), each called once per dtype
OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2", "sin", "sqrt", "tan",
       "tanh", "trunc")


def warm() -> None:
    """Resolve oneMKL's kernel choice of every VML op for float32 and float64 (no-op without
    MKL)."""
    if not torch.backends.mkl.is_available():
        return
    with torch.no_grad():
        for dtype in (torch.float32, torch.float64):
            one = torch.full((1,), 0.5, dtype=dtype)
            for op in OPS:
                getattr(torch, op)(one)
