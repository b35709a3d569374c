"""n-step returns on Triton (``spec.NSTEP_RETURN``; docs/semantics.md, section 6.10): not a
scan, so not the engine's. Each output reads its own window of later steps::

    R[t] = sum_{k<m} G(t, k) r[t+k] + G(t, m) (1 - term[t+m-1]) nv[t+m-1]

Program (p, q) owns a tile of ``BLOCK_R`` rows x ``BLOCK_T`` steps t and walks k = 0, 1, ... <
min(n, T) over the windows that start there: step s = t + k is a masked shifted load of each
input, ``discount`` the running product G(t, k) and ``open`` marks the windows still taking
steps (closed after a termination, after a done, a window's n-th reward or the rollout's last
step, which bootstrap from their ``next_values``). The loop stops once no window of the tile is
open, so a tile costs O(min(n, its longest window)) steps. float16/bfloat16 inputs accumulate
in float32, float64 in float64; the output has the rewards' dtype.

Absent inputs are passed as the rewards' pointer with a constexpr flag saying they are absent
(no ``is None`` test of a tuple argument: Triton 3.6 cannot compile one that holds a None), and
``gamma`` as a tensor or, when a number, ``gamma_value`` (float64, cast to the accumulation
dtype). :class:`Launch` is what rl_triton/core/launch.py's ``prepare`` returns for the algorithm.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import spec
from . import _cdiv, _pow2, _scalar, current_stream, direct_launch_ok, launch_compiled, launchable

# a tile of about TILE elements: along the rows' contiguous axis, up to 128 of it
TILE = 1024
NUM_WARPS = 4


@triton.jit
def _flag(x, sr, st, rows, s, live):
    """A flag tensor's value at steps ``s``, true where nonzero (False where not ``live``)."""
    return tl.load(x + rows * sr + s * st, mask=live, other=0) != 0


@triton.jit
def nstep_kernel(rewards, r_sr, r_st, next_values, v_sr, v_st, terminated, k_sr, k_st, done, d_sr, d_st,
                 truncated, u_sr, u_st, last_done, l_sr, gamma, g_sr, g_st, gamma_value: tl.float64, out, o_sr, o_st,
                 R, T, K, HAS_TERM: tl.constexpr, HAS_TRUNC: tl.constexpr,
                 DONE_MODE: tl.constexpr, GAMMA_TENSOR: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_T: tl.constexpr):
    """``out[i, t]`` (the rewards' dtype) for the tile's rows i and steps t; ``K`` = min(n, T),
    ``DONE_MODE`` spec.py's (DONE_ARRAY 0, DONE_TERM_OR_TRUNC 1, DONE_OBS_ALIGNED 2: ``done``
    then holds the episode starts, read one step on, and ``last_done`` the step after the
    window)."""
    r_idx = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r_idx.to(tl.int64)[:, None]
    # steps in int64: a step times the time stride of a wide time-major rollout passes 2**31
    t = (tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[None, :]
    inside = (r_idx[:, None] < R) & (t < T)
    total = tl.zeros((BLOCK_R, BLOCK_T), ACC)
    discount = tl.full((BLOCK_R, BLOCK_T), 1.0, ACC)
    is_open = inside
    if DONE_MODE == 2:
        after = (tl.load(last_done + r_idx.to(tl.int64) * l_sr, mask=r_idx < R, other=0) != 0)[:, None]
    if not GAMMA_TENSOR:
        g_number = tl.full((), gamma_value, ACC)
    k = 0
    alive = 1
    while (k < K) & (alive > 0):
        s = t + k
        live = is_open
        r = tl.load(rewards + rows * r_sr + s * r_st, mask=live, other=0.0).to(ACC)
        total = tl.where(live, total + discount * r, total)
        if DONE_MODE == 2:  # every done a termination
            ended = tl.where(s == T - 1, after, _flag(done, d_sr, d_st, rows, s + 1, live & (s < T - 1)))
            term = ended
        else:
            if HAS_TERM:
                term = _flag(terminated, k_sr, k_st, rows, s, live)
            else:
                term = tl.zeros((BLOCK_R, BLOCK_T), tl.int1)
            if DONE_MODE == 0:
                ended = _flag(done, d_sr, d_st, rows, s, live)
            elif HAS_TRUNC:
                ended = term | _flag(truncated, u_sr, u_st, rows, s, live)
            else:
                ended = term
        if GAMMA_TENSOR:
            g = tl.load(gamma + rows * g_sr + s * g_st, mask=live, other=0.0).to(ACC)
        else:
            g = g_number
        # the window's last step, unless it terminates: the bootstrap from its own next value (k = K - 1
        # spelt as a comparison of tensors: the interpreter widens a scalar's to int32)
        boot = live & ~term & (ended | (s == t + (K - 1)) | (s == T - 1))
        nv = tl.load(next_values + rows * v_sr + s * v_st, mask=boot, other=0.0).to(ACC)
        total = tl.where(boot, total + discount * g * nv, total)
        discount = tl.where(live, discount * g, discount)
        is_open = live & ~term & ~boot
        alive = tl.max(tl.max(is_open.to(tl.int32), 1), 0)
        k += 1
    tl.store(out + rows * o_sr + t * o_st, total.to(out.dtype.element_ty), mask=inside)


# the kernel's tensor inputs in its order, each followed by its strides (last_done: one)
_TENSORS = ("rewards", "next_values", "terminated", "done", "truncated", "last_done", "gamma")
_CONSTEXPRS = ("HAS_TERM", "HAS_TRUNC", "DONE_MODE", "GAMMA_TENSOR", "ACC", "BLOCK_R", "BLOCK_T")


class Launch:
    """The n-step launch for one call signature (rl_triton/core/launch.py's ``prepare``). The
    tile runs along the axis the rows hold contiguous: time in batch-major memory, the rows in
    time-major memory.

    ``launch(args, outs)`` runs on ``[R, T]`` views (``args``: ``spec.NSTEP_RETURN.Args`` or a
    call plan's list of them): through Triton's dispatch the first time an alignment of the data
    pointers is met, which compiles or finds the kernel, then from the compiled kernel.
    ``launch_direct(ptrs)``, for a call plan: the same from the data pointers of
    ``tensor_slots`` (the present inputs in the kernel's order, then the output), or False where
    no kernel is compiled for their alignment, launch hooks are set or another device is
    current (nothing launched)."""

    tiles = 0
    constants: dict = {}

    def __init__(self, algo: spec.Algorithm, args, outs):
        if algo is not spec.NSTEP_RETURN:
            raise ValueError(f"{algo.name} is no windowed algorithm of this module")
        ref = args.rewards
        R, T = ref.shape
        acc64 = ref.dtype == torch.float64
        if R > 1 and T > 1 and abs(ref.stride(1)) > abs(ref.stride(0)):  # time-major: rows adjacent
            block_r = min(_pow2(R), 128)
            block_t = min(_pow2(T), max(1, TILE // block_r))
        else:
            block_t = min(_pow2(T), 128)
            block_r = min(_pow2(R), max(1, TILE // block_t))
        self.device = ref.device
        self.grid = (_cdiv(R, block_r), _cdiv(T, block_t))
        gamma = args.gamma
        self.constexprs = dict(HAS_TERM=args.terminated is not None, HAS_TRUNC=args.truncated is not None,
                               DONE_MODE=args.done_mode, GAMMA_TENSOR=isinstance(gamma, torch.Tensor),
                               ACC=tl.float64 if acc64 else tl.float32, BLOCK_R=block_r, BLOCK_T=block_t)
        # the kernel's arguments after the tensors' (gamma's value, the output's strides, the
        # sizes), and the constexprs in its order (a compiled kernel's launcher takes them too)
        number = 0.0 if isinstance(gamma, torch.Tensor) else float(gamma) if acc64 else _scalar(gamma)
        self.tail = (number, (R, T, min(args.n, T)), tuple(self.constexprs[name] for name in _CONSTEXPRS))
        # the inputs' positions in the arguments (a call plan passes a list of them)
        self.positions = tuple((name, algo.names.index(name)) for name in _TENSORS)
        present = [isinstance(args[pos], torch.Tensor) for _, pos in self.positions]
        self.tensor_slots = tuple(pos for (_, pos), p in zip(self.positions, present) if p) + (len(algo.names),)
        # per input in the kernel's order: its index among tensor_slots (absent: the rewards'
        # pointer stands in), its strides
        self.strides = []
        index = 0
        for (name, pos), p in zip(self.positions, present):
            x = args[pos]
            self.strides.append((index if p else 0, (x.stride(0),) if name == "last_done" and p else
                                 x.stride() if p else (0,) if name == "last_done" else (0, 0)))
            index += p
        self.out_strides = tuple(outs[0].stride())
        self.kernels: dict = {}  # the pointers' alignment -> the compiled kernel
        self.last_aligned = None

    def _arguments(self, inputs: list, out) -> list:
        """The kernel's arguments up to its constexprs, from the present inputs (tensors or data
        pointers, in the kernel's order) and the output."""
        packed = []
        for index, strides in self.strides:
            packed += [inputs[index], *strides]
        number, sizes, _ = self.tail
        return packed + [number, out, *self.out_strides, *sizes]

    def launch(self, args, outs, parts=None) -> None:
        tensors = [args[pos] for pos in self.tensor_slots[:-1]] + [outs[0]]
        if self.launch_direct([t.data_ptr() for t in tensors]):
            return
        with _on_device(self.device):
            kernel = nstep_kernel[self.grid](*self._arguments(tensors[:-1], tensors[-1]), **self.constexprs,
                                             num_warps=NUM_WARPS)
        if launchable(kernel):
            self.kernels[self.last_aligned] = kernel

    def launch_direct(self, ptrs, parts=None) -> bool:
        aligned = self.last_aligned = tuple(p % 16 == 0 for p in ptrs)
        kernel = self.kernels.get(aligned)
        if kernel is None or not direct_launch_ok(self.device):
            return False
        launch_compiled(kernel, self.grid[0], self.grid[1], current_stream(self.device),
                        *self._arguments(ptrs[:-1], ptrs[-1]), *self.tail[2])
        return True

    def direct_source(self, pointers, namespace, aligned):
        """No generated launch lines: a call plan launches through ``launch_direct``."""
        return None


def _on_device(device: torch.device):
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
