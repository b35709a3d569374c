"""Count what the scan lowering emits, without a GPU: compile a reduced chunk loop (two float32
loads, the engine's affine ``combine`` scan, one store) to PTX for sm_90 and count vector loads,
warp shuffles and shared-memory stores, for the three ways a reverse scan can order its lanes:

- ``reverse``: natural lanes and ``associative_scan(reverse=True)`` (the lowering flips every
  element across the warp before and after the scan);
- ``mirrored runs``: the engine's layout (loads at ``engine._mirrored_steps``, each run reversed in
  registers by ``engine._mirror``);
- ``descending``: lane i holds step BLOCK_T-1-i (no vector loads).

This module imports triton, so ``rl_triton.testing`` does not import it. It loads the engine
module (rl_triton/core/kernels/engine.py, which needs triton only) by its file path and imports
nothing else of rl_triton, so loaded by its own file path it runs without torch:

    spec = importlib.util.spec_from_file_location("lowering", "rl_triton/testing/lowering.py")

benchmarks/scan_ptx.py prints these counts as a table.
"""

import importlib.util
import os
import re

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "core", "kernels", "engine.py")
_spec = importlib.util.spec_from_file_location("engine", _path)
engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine)
_mirror, _mirrored_steps, _pick, combine = engine._mirror, engine._mirrored_steps, engine._pick, engine.combine

MODES = {0: "reverse", 1: "mirrored runs", 2: "descending"}


@triton.jit
def _chunks(a_ptr, b_ptr, y_ptr, T, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, MODE: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    lanes = tl.arange(0, BLOCK_T)
    if MODE == 1:
        steps = _mirrored_steps(lanes, 4)
    elif MODE == 2:
        steps = BLOCK_T - 1 - lanes
    else:
        steps = lanes
    carry = tl.zeros((BLOCK_R,), tl.float32)
    n = tl.cdiv(T, BLOCK_T)
    for k in range(n):
        offsets = rows[:, None] * T + ((n - 1 - k) * BLOCK_T + steps)[None, :]
        a = tl.load(a_ptr + offsets)
        b = tl.load(b_ptr + offsets)
        if MODE == 1:
            a = _mirror(a, 4)
            b = _mirror(b, 4)
        A, B = tl.associative_scan((a, b), 1, combine, reverse=MODE == 0)
        y = A + B * carry[:, None]
        carry = _pick(y, lanes, 0 if MODE == 0 else BLOCK_T - 1)
        if MODE == 1:
            y = _mirror(y, 4)
        tl.store(y_ptr + offsets, y)


def counts(block_r, block_t, warps, mode):
    """(16-byte vector loads, loads, warp shuffles, shared-memory stores) in the PTX of one tile
    (``BLOCK_R x BLOCK_T``, ``warps`` warps) in lane order ``MODES[mode]``."""
    aligned = [["tt.divisibility", 16]]
    src = ASTSource(fn=_chunks, signature={"a_ptr": "*fp32", "b_ptr": "*fp32", "y_ptr": "*fp32", "T": "i32",
                                           "BLOCK_R": "constexpr", "BLOCK_T": "constexpr", "MODE": "constexpr"},
                    constexprs={"BLOCK_R": block_r, "BLOCK_T": block_t, "MODE": mode},
                    attrs={(i,): aligned for i in range(4)})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
    n = lambda pattern: len(re.findall(pattern, ptx))  # noqa: E731
    return n(r"ld\.global\.v4"), n(r"ld\.global"), n(r"shfl\.sync"), n(r"st\.shared")
