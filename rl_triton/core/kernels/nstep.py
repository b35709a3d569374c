"""n-step returns on Triton (``spec.NSTEP_RETURN``; docs/semantics.md, section 6.10): not a
scan, so not the engine's. Each output reads its own window of later steps::

    R[t] = sum_{k<m} G(t, k) r[t+k] + G(t, m) (1 - term[t+m-1]) nv[t+m-1]

Written with the step maps f_s(y) = r'[s] + gamma[s] y, where r'[s] = r[s] plus, where step s
ends an episode or the rollout and does not terminate, gamma[s] nv[s] (the bootstrap), a window
is the composition of its steps' maps applied to the value after its last step, R[t] =
f_t(f_{t+1}(... f_{t+K-1}(nv[t+K-1]))), K = min(n, T), cut after a step that stops it (an
episode's or the rollout's end): nothing after that step is read.

:func:`nstep_blocks_kernel` (windows of up to ``MAX_BLOCK`` steps): program (p, q) loads a tile
of ``BLOCK_R`` rows x ``BLOCK_T`` steps from ``t0 = q * STEP`` once and writes the returns of its
first ``STEP`` steps (``BLOCK_T - STEP >= K - 1``: neighbouring tiles overlap). The tile is cut
into blocks of K steps; a window from t in block j ends at t + K - 1 in block j + 1 (or at the
end of block j when t starts it), so it is its part in block j, a suffix (A[t] = its maps
composed up to the block's end applied to 0, C[t] their discounts' product, and whether no step
stops it there: a reverse scan), followed by its part in block j + 1, a prefix (X[u] = the
block's maps from its start composed up to u and applied to nv[u]: a forward scan restarting at
each block), read at u = t + K - 1 by a gather: R[t] = A[t] + C[t] X[t+K-1]. As in numba's
blocks form, only the window's own terms are added: no running sum is differenced. A stop is a
flag in the scans, not a zero discount, so a zero gamma inside a window multiplies what follows
(0 * NaN is NaN), as in the oracle and the other backends.

:func:`nstep_walk_kernel` (longer windows): each program walks k = 0, 1, ... < K over the
windows that start in its tile with shifted loads, stopping once none is open: O(min(n, its
longest window)) steps per output.

float16/bfloat16 inputs accumulate in float32, float64 in float64; the output has the rewards'
dtype. Absent inputs are passed as the rewards' pointer with a constexpr flag saying they are
absent (no ``is None`` test of a tuple argument: Triton 3.6 cannot compile one that holds a
None), and ``gamma`` as a tensor or, when a number, ``gamma_value`` (float64, cast to the
accumulation dtype). :class:`Launch` is what rl_triton/core/launch.py's ``prepare`` returns for
the algorithm.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from .. import spec
from . import _cdiv, _pow2, _scalar, current_stream, direct_launch_ok, launch_compiled, launchable

# the walk: a tile of about TILE elements, up to 128 along the rows' contiguous axis
TILE = 1024
NUM_WARPS = 4
# the blocks kernel: windows of up to MAX_BLOCK steps, tiles of BLOCKS_TILE elements and up to
# BLOCK_STEPS steps (or 2K - 1)
MAX_BLOCK = 512
BLOCK_STEPS = 256
BLOCKS_TILE = 1024


@triton.jit
def _flag(x, sr, st, rows, s, live):
    """A flag tensor's value at steps ``s``, true where nonzero (False where not ``live``)."""
    return tl.load(x + rows * sr + s * st, mask=live, other=0) != 0


@triton.jit
def _ends(terminated, k_sr, k_st, done, d_sr, d_st, truncated, u_sr, u_st, last_done, l_sr, r_idx, R, rows, s, live,
          T, HAS_TERM: tl.constexpr, HAS_TRUNC: tl.constexpr, DONE_MODE: tl.constexpr):
    """``(term, ended)`` at steps ``s``: whether the step terminates, whether it ends its episode
    (``DONE_MODE`` spec.py's: DONE_ARRAY 0, DONE_TERM_OR_TRUNC 1, DONE_OBS_ALIGNED 2, where
    ``done`` holds the episode starts, read one step on, and ``last_done`` each row's last done)."""
    if DONE_MODE == 2:  # every done a termination
        after = (tl.load(last_done + r_idx.to(tl.int64) * l_sr, mask=r_idx < R, other=0) != 0)[:, None]
        ended = tl.where(s == T - 1, after, _flag(done, d_sr, d_st, rows, s + 1, live & (s < T - 1)))
        term = ended
    else:
        if HAS_TERM:
            term = _flag(terminated, k_sr, k_st, rows, s, live)
        else:
            term = tl.zeros(s.shape, tl.int1) | tl.zeros(rows.shape, tl.int1)
        if DONE_MODE == 0:
            ended = _flag(done, d_sr, d_st, rows, s, live)
        elif HAS_TRUNC:
            ended = term | _flag(truncated, u_sr, u_st, rows, s, live)
        else:
            ended = term
    return term, ended


@triton.jit
def _flags_folded(p1, p2, cut):
    # the packed flags of two folded ranges: bit 0 a segment bound within either, bit 1 no stop in
    # either; where the nearer range holds the bound (cut), the other's stops are not read
    return tl.where(cut, p2 | (p1 & 1), ((p1 | p2) & 1) | (p1 & p2 & 2))


@triton.jit
def _suffix(p1, a1, c1, p2, a2, c2):
    # reverse scan: (p1, a1, c1) the later steps already folded, (p2, a2, c2) the nearer ones; a: their
    # maps composed and applied to 0, c: their discounts' product, p: flags (bit 0: a segment, up to a
    # stop or a block's last step, ends within, beyond which nothing is read; bit 1: no step stops)
    cut = (p2 & 1) != 0
    return _flags_folded(p1, p2, cut), tl.where(cut, a2, a2 + c2 * a1), tl.where(cut, c2, c2 * c1)


@triton.jit
def _prefix(p1, a1, c1, p2, a2, c2):
    # forward scan: (p1, a1, c1) the earlier steps, (p2, a2, c2) the later ones, as in _suffix but the
    # earlier maps outside; restarted where a block begins (bit 0), nothing read after a stop (bit 1 of p1)
    start = (p2 & 1) != 0
    a = tl.where(start, a2, tl.where((p1 & 2) != 0, a1 + c1 * a2, a1))
    return _flags_folded(p1, p2, start), a, tl.where(start, c2, c1 * c2)


@triton.jit
def nstep_blocks_kernel(rewards, r_sr, r_st, next_values, v_sr, v_st, terminated, k_sr, k_st, done, d_sr, d_st,
                        truncated, u_sr, u_st, last_done, l_sr, gamma, g_sr, g_st, gamma_value: tl.float64, out, o_sr,
                        o_st, R, T, K, STEP, HAS_TERM: tl.constexpr, HAS_TRUNC: tl.constexpr,
                        DONE_MODE: tl.constexpr, GAMMA_TENSOR: tl.constexpr, ACC: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr):
    """``out[i, t]`` (the rewards' dtype) for the tile's rows i and its first ``STEP`` steps t
    (``K`` = min(n, T) <= ``BLOCK_T - STEP + 1``), by blocks of K steps (module docstring)."""
    r_idx = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r_idx.to(tl.int64)[:, None]
    j = tl.arange(0, BLOCK_T)
    # steps in int64: a step times the time stride of a wide time-major rollout passes 2**31
    s = tl.program_id(1).to(tl.int64) * STEP + j.to(tl.int64)[None, :]
    inside = (r_idx[:, None] < R) & (s < T)
    term, ended = _ends(terminated, k_sr, k_st, done, d_sr, d_st, truncated, u_sr, u_st, last_done, l_sr, r_idx, R,
                        rows, s, inside, T, HAS_TERM, HAS_TRUNC, DONE_MODE)
    r = tl.load(rewards + rows * r_sr + s * r_st, mask=inside, other=0.0).to(ACC)
    nv = tl.load(next_values + rows * v_sr + s * v_st, mask=inside, other=0.0).to(ACC)
    if GAMMA_TENSOR:
        g = tl.load(gamma + rows * g_sr + s * g_st, mask=inside, other=0.0).to(ACC)
    else:
        g = tl.full((BLOCK_R, BLOCK_T), gamma_value, ACC)
    # where a window stops: a termination, an episode's end, the rollout's end (and past it); the
    # bootstrap at such an end that is no termination folded into that step's reward (at a
    # termination neither nv nor gamma is read)
    rollout_end = s == T - 1
    stop = ~inside | term | ended | rollout_end
    rp = tl.where(inside & ~term & (ended | rollout_end), r + g * nv, r)
    c = tl.where(stop, 0.0, g)
    goes_on = (~stop).to(tl.int32) * 2
    offset = j % K
    last = (offset == K - 1)[None, :]
    # each step's part in its block: A = its maps to the block's end (or a stop) applied to 0, C the
    # discounts' product and whether no step stops (a zero discount is no stop: 0 * NaN stays NaN)
    p_suf, a_suf, c_suf = tl.associative_scan(((stop | last).to(tl.int32) | goes_on, rp, c), 1, _suffix,
                                              reverse=True)
    # each step's part from its block's start, applied to its nv where nothing stops; at a block's last
    # step nv alone (the window that starts that block ends there)
    starts = (offset == 0)[None, :].to(tl.int32)
    p_pre, a_pre, c_pre = tl.associative_scan((starts | goes_on, rp, c), 1, _prefix)
    tail = tl.where(last, nv, tl.where((p_pre & 2) != 0, a_pre + c_pre * nv, a_pre))
    ends_at = tl.broadcast_to(tl.minimum(j + (K - 1), BLOCK_T - 1)[None, :], (BLOCK_R, BLOCK_T))
    total = tl.where((p_suf & 2) != 0, a_suf + c_suf * tl.gather(tail, ends_at, 1), a_suf)
    tl.store(out + rows * o_sr + s * o_st, total.to(out.dtype.element_ty), mask=inside & (j < STEP)[None, :])


@triton.jit
def nstep_walk_kernel(rewards, r_sr, r_st, next_values, v_sr, v_st, terminated, k_sr, k_st, done, d_sr, d_st,
                      truncated, u_sr, u_st, last_done, l_sr, gamma, g_sr, g_st, gamma_value: tl.float64, out, o_sr,
                      o_st, R, T, K, STEP, HAS_TERM: tl.constexpr, HAS_TRUNC: tl.constexpr,
                      DONE_MODE: tl.constexpr, GAMMA_TENSOR: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_T: tl.constexpr):
    """``out[i, t]`` (the rewards' dtype) for the tile's rows i and steps t (``STEP`` =
    ``BLOCK_T``), walking k < ``K`` = min(n, T): step s = t + k is a masked shifted load of each
    input, ``discount`` the running product G(t, k) and ``is_open`` marks the windows still taking
    steps (closed after a termination, after a done, a window's n-th reward or the rollout's last
    step, which bootstrap from their ``next_values``)."""
    r_idx = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = r_idx.to(tl.int64)[:, None]
    t = (tl.program_id(1) * STEP + tl.arange(0, BLOCK_T)).to(tl.int64)[None, :]
    inside = (r_idx[:, None] < R) & (t < T)
    total = tl.zeros((BLOCK_R, BLOCK_T), ACC)
    discount = tl.full((BLOCK_R, BLOCK_T), 1.0, ACC)
    is_open = inside
    if not GAMMA_TENSOR:
        g_number = tl.full((), gamma_value, ACC)
    k = 0
    alive = 1
    while (k < K) & (alive > 0):
        s = t + k
        live = is_open
        r = tl.load(rewards + rows * r_sr + s * r_st, mask=live, other=0.0).to(ACC)
        total = tl.where(live, total + discount * r, total)
        term, ended = _ends(terminated, k_sr, k_st, done, d_sr, d_st, truncated, u_sr, u_st, last_done, l_sr, r_idx,
                            R, rows, s, live, T, HAS_TERM, HAS_TRUNC, DONE_MODE)
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


# the kernels' tensor inputs in their order, each followed by its strides (last_done: one)
_TENSORS = ("rewards", "next_values", "terminated", "done", "truncated", "last_done", "gamma")
_CONSTEXPRS = ("HAS_TERM", "HAS_TRUNC", "DONE_MODE", "GAMMA_TENSOR", "ACC", "BLOCK_R", "BLOCK_T")


def _tiles(R: int, T: int, K: int, time_major: bool):
    """(kernel, BLOCK_R, BLOCK_T, STEP): the blocks kernel where windows are up to MAX_BLOCK steps
    long, else the walk. The blocks kernel's tile spans at least 2K - 1 steps and about a quarter
    of the rollout, up to BLOCK_STEPS (H100 sweep, 2026-12-05: at 4096x128 tiles of 32 steps, at
    16384x512 of 128, from 4096 steps on of 256), in tiles of BLOCKS_TILE elements; time-major
    rollouts take 32 rows a tile (their contiguous axis). The walk's tile runs along the axis the
    rows hold contiguous: time in batch-major memory, the rows in time-major memory."""
    if K <= MAX_BLOCK:
        if time_major:
            block_r = min(_pow2(R), 32)
            block_t = max(_pow2(2 * K - 1), BLOCKS_TILE // block_r)
        else:
            block_t = max(_pow2(2 * K - 1), min(_pow2(T) // 4, BLOCK_STEPS))
            block_r = min(_pow2(R), max(1, BLOCKS_TILE // block_t))
        # tiles overlap by K - 1 steps; where there are several of at least four times that rounded
        # up to 16, by the rounded overlap, so that every tile starts at a multiple of 16 steps
        # (aligned vector loads)
        aligned = _cdiv(K - 1, 16) * 16
        halo = K - 1 if T + K - 1 <= block_t or block_t < 4 * aligned else aligned
        return nstep_blocks_kernel, block_r, block_t, block_t - halo
    if time_major:
        block_r = min(_pow2(R), 128)
        block_t = min(_pow2(T), max(1, TILE // block_r))
    else:
        block_t = min(_pow2(T), 128)
        block_r = min(_pow2(R), max(1, TILE // block_t))
    return nstep_walk_kernel, block_r, block_t, block_t


class Launch:
    """The n-step launch for one call signature (rl_triton/core/launch.py's ``prepare``).

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
        K = min(args.n, T)
        acc64 = ref.dtype == torch.float64
        time_major = R > 1 and T > 1 and abs(ref.stride(1)) > abs(ref.stride(0))
        self.kernel, block_r, block_t, step = _tiles(R, T, K, time_major)
        self.device = ref.device
        self.grid = (_cdiv(R, block_r), _cdiv(T, step))
        gamma = args.gamma
        self.constexprs = dict(HAS_TERM=args.terminated is not None, HAS_TRUNC=args.truncated is not None,
                               DONE_MODE=args.done_mode, GAMMA_TENSOR=isinstance(gamma, torch.Tensor),
                               ACC=tl.float64 if acc64 else tl.float32, BLOCK_R=block_r, BLOCK_T=block_t)
        # the kernel's arguments after the tensors' (gamma's value, the output's strides, the
        # sizes), and the constexprs in its order (a compiled kernel's launcher takes them too)
        number = 0.0 if isinstance(gamma, torch.Tensor) else float(gamma) if acc64 else _scalar(gamma)
        self.tail = (number, (R, T, K, step), tuple(self.constexprs[name] for name in _CONSTEXPRS))
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
            kernel = self.kernel[self.grid](*self._arguments(tensors[:-1], tensors[-1]), **self.constexprs,
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
