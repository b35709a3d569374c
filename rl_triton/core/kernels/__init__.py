"""Triton backend: the launch plan and argument packing for the scan engine.

``run(algo, args, outs)`` launches the engine for one algorithm of ``rl_triton/core/spec.py`` on
``[R, T]`` views. The plan (:func:`plan`) is a small function of (rows, T, dtype, direction)
that picks the tile (``BLOCK_R`` rows x ``BLOCK_T`` steps), the warps, and whether the time axis
is split into segments (reduce-then-scan) when the rows alone cannot fill the GPU. Its rules and
the H200 sweeps behind them are in docs/benchmarks.md; re-tune with
``python benchmarks/sweep_plan.py``.

A :class:`Launch` holds what one call signature fixes (plan, engine arguments but for the data
pointers). The first launch of each argument specialisation (dtypes, alignment, strides, sizes)
goes through Triton's dispatch, which compiles or finds the kernel; the compiled kernel is kept
under that key and later launches call its launcher directly with data pointers.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
from typing import NamedTuple

import torch

from .. import spec

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
try:
    import triton
    import triton.language as tl

    from triton.runtime import driver

    from .builders import PARTS, PREV_FROM_OUTPUTS
    from .engine import edge_kernel, hand_kernel, scan_kernel

    try:
        from triton import knobs
    except ImportError:  # triton < 3.4 has no knobs module
        knobs = None

    AVAILABLE = True
except ImportError:  # CPU-only installs without triton still work on the other backends
    AVAILABLE = False

TILE = 512
# the engine's ``moments`` of a launch that reduces no output: a tuple throughout, since Triton
# 3.6 cannot compile ``is not None`` of a tuple argument holding a None (the unmasked reduction's flag)
NO_MOMENTS = (None, None, None)
MAX_SEGMENTS = 1024
# The time-major regime (:func:`time_major_plan`) for launches whose rows lie closer together
# than their steps, where :func:`time_major_regime_wins` says it beats the plan of every layout.
# ``forced_plan(time_major=1)`` turns it on for one block whatever the shape; this switch off
# keeps the plan of every layout for every launch planned after it is set (call plans keep
# theirs: ``plans.clear()``).
TIME_MAJOR_REGIME = True
_forced: dict = {}


@contextlib.contextmanager
def forced_plan(**plan):
    """Force launch parameters (block_t, block_r, n_seg, num_warps; prev_mem: whether an epilogue
    that reads y one step back reads it from its outputs, in one segment only; time_major: plan
    with :func:`time_major_plan` whatever the strides; walk: the engine's WALK regime, 1 or 2
    passes a chunk, 0 for none; vec: the lanes of one mirrored run, 0 for natural lanes; warps:
    the warps the time-major plan splits time to reach) so tests reach every regime at small
    sizes and sweeps time each; meanwhile every call takes the full path
    (``launch.plan_forced``: no call plan, which would keep its own launch)."""
    _forced.update(plan)
    try:
        yield
    finally:
        _forced.clear()


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def plan(R: int, T: int, float64: bool, device: torch.device, reverse: bool = True, need_prev: bool = False,
         streams: int = 2, pair: bool = False, prev_from_outputs: bool = False):
    """(BLOCK_R, BLOCK_T, n_seg, chunks per segment, num_warps, SEG_BLOCK) for R rows of T steps;
    ``need_prev``: the epilogue reads y one step back, by a lane gather unless
    ``prev_from_outputs`` (read back from its outputs: the engine's PREV_MEM, one segment only);
    ``streams``: float tensors read per step; ``pair``: the two-state scan."""
    gather = need_prev and not prev_from_outputs
    block_t = min(_pow2(T), 512 if float64 else 1024)
    max_warps = 8  # one warp per 128 elements, up to 8
    target = 2 * _multiprocessors(device)
    tile = TILE
    if _many_rows(R, device):
        if reverse and not gather and block_t >= 256:
            # one row per program, of one warp; two where four or more inputs stream in (sweeps)
            block_t, max_warps, tile = 256, 2 if streams >= 4 else 1, 256
        elif reverse or T < 4096:  # forward scans of long rows keep long chunks (sweeps)
            block_t = min(block_t, 128)  # rows enough to fill the GPU: short chunks, more programs in flight
    elif not float64 and not gather and 1024 < T <= (4096 if reverse and not need_prev else 8192) and R < target:
        # few rows of up to 4096 steps (8192 for forward scans and epilogues reading y back from
        # their outputs): one pass over whole rows beats chunks and time splits (not where the
        # epilogue reads y one step back by a lane gather: over 16 warps it costs more)
        block_t = _pow2(T)
        max_warps = block_t // 256 if reverse else (4 if block_t <= 4096 else 16)
    if not reverse and R >= target:
        max_warps = 4  # forward scans whose rows fill the GPU: 4 warps beat 8 (sweeps)
    if pair and R >= 2 * target:
        # two-state scans of many rows: a row of 4 warps, chunks of 512 (H200: 57 against 76 us at
        # 1024x8192 float32 for 1024 steps and 8 warps; fewer rows keep the long chunks); 2 warps
        # where four or more inputs stream in (GAE with KL shaping, H100: 110 against 129 us at 1024x8192)
        block_t, max_warps, tile = min(_pow2(T), 512), 2 if streams >= 4 else 4, 512
    block_t = _forced.get("block_t") or block_t
    block_r = _forced.get("block_r") or min(_pow2(R), max(1, tile // block_t))
    num_warps = _forced.get("num_warps") or max(1, min(max_warps, block_r * block_t // 128))
    # the scan lowering needs a tile of at least one element per thread
    block_t = max(block_t, 32 * num_warps // block_r)
    row_programs = _cdiv(R, block_r)
    n_seg = _forced.get("n_seg") or 1
    if "n_seg" not in _forced and row_programs < target and T >= 4 * block_t:
        n_seg = min(_cdiv(target, row_programs), _cdiv(T, block_t), MAX_SEGMENTS)
    seg_chunks = _cdiv(_cdiv(T, block_t), n_seg)
    n_seg = _cdiv(_cdiv(T, block_t), seg_chunks)
    seg_block = max(_pow2(n_seg), 32 * num_warps // block_r)
    return block_r, block_t, n_seg, seg_chunks, num_warps, seg_block


def time_major_regime_wins(R: int, T: int) -> bool:
    """Whether time-major data of R rows (environments) and T steps takes the time-major regime:
    16 rows or more, and 512 steps or more or 16384 rows or more. Elsewhere the plan of every
    layout, reading the rows with their strides, is faster (H200, GAE with done flags, float32,
    device time: regime off 5.97 against 7.49 us at 2048x8, 2.31 against 2.82 at 24x4096, 3.46
    against 6.09 at 128x1024, 3.94 against 5.84 at 256x256; the regime 9.00 against 11.37 at
    2048x64, 21.3 against 119 at 512x4096, 8.72 against 11.10 at 32x65536, T x N)."""
    return R >= 16 and (T >= 512 or R >= 16384)


def time_major_plan(R: int, T: int, float64: bool, device: torch.device):
    """(BLOCK_R, BLOCK_T, n_seg, chunks per segment, num_warps, SEG_BLOCK, WALK) for R rows of T
    steps whose rows are contiguous (time-major data, ``[T, N]`` with N = R): the rows across the
    lanes, so that each step reads ``BLOCK_R`` neighbouring values.

    By default the engine's WALK regime (``_walk``) with a chunk's loads gathered into registers
    before its stores (``WALK = 3``; forced ``walk=2``: two passes a chunk, ``1``: one pass,
    ``4``: the next chunk's loads ahead): one step at a time, chunks of 8 steps, 32 rows (one
    warp) a program; forced ``block_r`` takes more rows a program, in a warp per 32 rows up to 8.
    The time axis splits into segments where the rows' warps are fewer than four times the
    multiprocessors. Forced ``walk=0``: the engine's scan across the lanes of tiles of one warp,
    a 16-byte load for each of 32 threads along the rows (128 rows in float32, 64 in float64),
    chunks of 8 steps (Triton lays the rows out fastest across the threads and scans each row's
    steps within a thread and across the few threads that share the row); time splits where the
    warps are fewer than twice the multiprocessors. Forced ``warps`` sets that target. The
    two-state scan splits too (the batch-major plan keeps its rows whole), and no split leaves
    more than 64 maps a thread to fold in phase 2."""
    walk = int(_forced.get("walk", 3))
    sms = _multiprocessors(device)
    target = _forced.get("warps") or (4 if walk else 2) * sms
    if walk:
        # H200, GAE: 32 rows of 8-step chunks the fastest WALK plan at every shape of issue 39
        # (docs/benchmarks.md, Time-major rollouts); 256 rows or 16 steps 1.3-1.8x slower
        block_t = _forced.get("block_t") or min(_pow2(T), 8)
        block_r = _forced.get("block_r") or min(_pow2(R), 32)
        num_warps = _forced.get("num_warps") or max(1, min(8, block_r // 32))
    else:
        rows_per_warp = 32 * (2 if float64 else 4)  # a 16-byte load per thread
        block_t = _forced.get("block_t") or min(_pow2(T), 8)
        block_r = _forced.get("block_r") or min(_pow2(R), rows_per_warp)
        # one warp: more would lie along time where flags load 16 rows a thread (scans across warps)
        num_warps = _forced.get("num_warps") or 1
        block_t = max(block_t, 32 * num_warps // block_r)  # the scan lowering: an element per thread at least
    warps = _cdiv(R, block_r) * num_warps
    n_seg = _forced.get("n_seg") or 1
    if "n_seg" not in _forced and warps < target and T >= 4 * block_t:
        # phase 2 folds the segments' maps in a [BLOCK_R, SEG_BLOCK] tile: 64 numbers a thread at most
        n_seg = min(_cdiv(target, warps), _cdiv(T, block_t), 64 * 32 * num_warps // block_r)
    seg_chunks = _cdiv(_cdiv(T, block_t), n_seg)
    n_seg = _cdiv(_cdiv(T, block_t), seg_chunks)
    seg_block = max(_pow2(n_seg), 32 * num_warps // block_r)
    return block_r, block_t, n_seg, seg_chunks, num_warps, seg_block, walk


def is_time_major(x: torch.Tensor) -> bool:
    """Whether an ``[R, T]`` view holds its rows closer together than its steps (time-major
    data: ``[T, N]`` read with ``time_dim=0``, or any layout whose time stride is not the
    smallest), for more than one row and step."""
    R, T = x.shape[:2]
    return R > 1 and T > 1 and abs(x.stride(1)) > abs(x.stride(0))


def _many_rows(R: int, device: torch.device) -> bool:
    """Rows enough for four programs of 4 rows per multiprocessor: the plan's short-chunk regime."""
    return _cdiv(R, TILE // 128) >= 4 * _multiprocessors(device)


def _prev_from_outputs(algo: spec.Algorithm, R: int, T: int, device: torch.device, exact_outputs: bool) -> bool:
    """Whether an epilogue that reads y one step back reads it from its outputs (PREV_MEM): where
    its STORE can and the outputs hold the accumulation dtype, except for many rows of more than
    32 steps, whose 128-step chunks of one warp per row gather within the warp (H200, V-trace:
    3.62 against 3.49 us at 4096x128 and 55.4 against 54.1 at 16384x512 read back; 5.9 against
    11.3 at 1024x1024, 2.6 against 2.8 at 16384x16)."""
    return algo.need_prev and exact_outputs and algo.name in PREV_FROM_OUTPUTS and not (
        _many_rows(R, device) and T > 32)


_launches: dict = {}


class _Config(NamedTuple):
    """One launch shape: grid, block sizes, segment arguments, the engine's constexpr arguments in
    its order (BUILD ... PAIR; IDX is added per call) per phase, num_warps, and the part of the
    kernel cache key it fixes."""

    grid: tuple
    block_r: int
    block_t: int
    seg_chunks: int
    n_seg: int
    constexprs: dict
    num_warps: int
    key: tuple


def _launch_config(algo: spec.Algorithm, R: int, T: int, acc64: bool, reverse: bool, streams: int,
                   device: torch.device, exact_outputs: bool = True, time_major: bool = False) -> _Config:
    """The launch of ``algo`` on R rows of T steps, cached per shape class; ``exact_outputs``:
    the outputs hold the accumulation dtype (an epilogue may then read y back from them);
    ``time_major``: the rows lie closer together than the steps (:func:`time_major_plan`)."""
    time_major = time_major and TIME_MAJOR_REGIME and time_major_regime_wins(R, T)
    key = (algo.name, R, T, acc64, reverse, streams, device, exact_outputs, time_major)
    config = None if _forced else _launches.get(key)
    if config is None:
        build, init, store = PARTS[algo.name]
        need_prev = algo.need_prev
        time_major = bool(_forced.get("time_major", time_major))
        if time_major:
            *planned, walk = time_major_plan(R, T, acc64, device)
            # WALK hands y one step back over; otherwise the lane gather or, in one segment, the outputs
            prev_mem = not walk and planned[2] == 1 and bool(
                _forced.get("prev_mem", need_prev and exact_outputs and algo.name in PREV_FROM_OUTPUTS))
            vec = 0  # natural lanes: a chunk's steps lie far apart
        else:
            walk = int(_forced.get("walk", 0))
            # y one step back read from the outputs (PREV_MEM) where the epilogue can, in one segment
            prev_mem = bool(_forced.get("prev_mem", _prev_from_outputs(algo, R, T, device, exact_outputs)))
            planned = plan(R, T, acc64, device, reverse, need_prev, streams, algo.pair, prev_mem)
            if prev_mem and planned[2] > 1:
                prev_mem = False
                if "prev_mem" not in _forced:  # split time: the lane gather's plan
                    planned = plan(R, T, acc64, device, reverse, need_prev, streams, algo.pair)
            vec = None
        block_r, block_t, n_seg, seg_chunks, num_warps, seg_block = planned
        if algo.pair and not time_major:  # the batch-major plan walks whole rows of the two-state scan
            n_seg, seg_chunks = 1, _cdiv(T, block_t)
        acc = tl.float64 if acc64 else tl.float32
        even = (R % block_r == 0, T % block_t == 0)
        # reverse scans mirror runs of one vector load (16 bytes of the accumulation dtype);
        # chunks of up to 8 steps keep natural lanes (engine docstring)
        if vec is None:
            vec = min(block_t, 2 if acc64 else 4) if reverse and block_t > 8 else 0
        vec = 0 if walk else _forced.get("vec", vec)
        prev_mem = prev_mem and not walk
        one_chunk = n_seg == 1 and block_t >= T
        constexprs = {phase: (build, init, store, reverse, need_prev, phase, acc, block_r, block_t, vec, seg_block,
                              *even, one_chunk, algo.pair, walk, need_prev and prev_mem)
                      for phase in (0, 1, 2)}
        config = _Config((_cdiv(R, block_r), n_seg), block_r, block_t, seg_chunks, n_seg, constexprs, num_warps,
                         (algo.name, acc64, reverse, block_r, block_t, seg_block, num_warps, need_prev and prev_mem,
                          walk, vec, device))
        if not _forced:
            _launches[key] = config
    return config


_FLOAT32_TINY = 1.1754943508222875e-38


def _scalar(x) -> float:
    """A number as the kernels apply it (float32): float32 denormals become 0, as the GPU
    flushes them (the interpreter would otherwise produce garbage from them)."""
    x = float(x)
    return 0.0 if -_FLOAT32_TINY < x < _FLOAT32_TINY else x


_INT32_LIMIT = 2**31


def _arg_template(kind, x, R: int, T: int, acc64: bool, device, pad_r: int, pad_t: int):
    """One argument in the engine's form, as far as it is fixed by the call's signature: for a
    tensor its strides (the data pointer is filled in per launch) and the offset its padded tiles
    reach; numbers (coefficients and ``s`` thresholds alike) as ``(None, value)``, or in a float64
    launch as a float64 broadcast tensor (a Python float would reach a compiled kernel as float32);
    absent inputs and modes as None. Returns (template, key part, reach)."""
    if x is None or kind == "i" or kind == "b":  # direction is a constexpr
        return None, None, 0
    if isinstance(x, torch.Tensor):
        strides = x.stride()
        if kind == "f3":
            reach = (R + pad_r) * strides[0] + (T + pad_t) * strides[1] + x.shape[2] * strides[2]
            return (*strides, x.shape[2]), (x.dtype, strides), reach
        return strides, (x.dtype, strides), (R + pad_r) * strides[0] + (
            (T + pad_t) * strides[1] if len(strides) > 1 else 0)
    if acc64:  # a float64 number stays exact: read it from a broadcast tensor
        c = torch.full((), float(x), dtype=torch.float64, device=device).expand(R, T)
        return c, (torch.float64, (0, 0)), 0
    return (None, _scalar(x)), 0, 0


_compiled: dict = {}


class Launch:
    """The launch of one algorithm on ``[R, T]`` views of one signature (shapes, strides, dtypes,
    which inputs are present, the numbers), decided once: the plan, the engine's arguments with
    the data pointers left open, and the kernel's cache key but for the pointers' alignment.

    ``launch(args, outs)`` runs it on views (going through Triton's dispatch the first time a
    specialisation is met); ``launch_direct(ptrs)`` on the data pointers of the tensor arguments
    in order (``tensor_slots``) and then the outputs', calling the compiled kernel's launcher
    directly, or returns False when no kernel is compiled yet for their alignment.

    ``moments=(k, flag)``: the launch also reduces output ``k`` tile by tile into partial
    moments (the engine's ``moments``), counting the steps where the flag argument named
    ``flag`` is nonzero (None: every step); ``tiles`` partials, written to the contiguous
    float64 ``[tiles, 3]`` tensor (16-byte aligned, as torch allocates) that ``launch`` and
    ``launch_direct`` then take as ``parts``."""

    def __init__(self, algo: spec.Algorithm, args, outs, moments=None):
        ref = args[0]
        R, T = ref.shape[:2]
        acc64 = ref.dtype == torch.float64
        device = self.device = ref.device
        reverse = algo.reverse if algo.reverse is not None else bool(args.reverse)
        streams = sum(isinstance(args[i], torch.Tensor) for i in algo.streams)
        exact = all(o.dtype == (torch.float64 if acc64 else torch.float32) for o in outs)
        # the WALK regime reduces no moments: a launch that does keeps the lane regime's plan
        config = self.config = _launch_config(algo, R, T, acc64, reverse, streams, device, exact,
                                              is_time_major(ref) and moments is None)
        if algo.has_flags and args.terminated is not None and args.terminated is args.done:
            args = args._replace(terminated=None)  # done alone: every done a termination
        kinds = algo.kinds + ("f2",) * len(outs)
        templates, keys, reach = [], [], 0
        for kind, x in zip(kinds, (*args, *outs)):
            template, key, r = _arg_template(kind, x, R, T, acc64, device, config.block_r, config.block_t + 1)
            templates.append(template)
            keys.append(key)
            reach = max(reach, r)
        self.n_args = len(args)
        # positions of the tensor arguments (inputs then outputs): their pointers come per launch;
        # float64 constants are tensors made here (kept alive by the template)
        self.constants = {i: t for i, t in enumerate(templates) if isinstance(t, torch.Tensor)}
        self.tensor_slots = tuple(i for i, x in enumerate((*args, *outs))
                                  if isinstance(x, torch.Tensor) or i in self.constants)
        self.templates = templates
        self.keys = tuple(keys)
        self.wide = reach >= _INT32_LIMIT
        self.idx = tl.int64 if self.wide else tl.int32
        self.runtime = (R, T, config.seg_chunks, config.n_seg)
        self.ws_size = R * config.n_seg * (5 if algo.pair else 2) if config.n_seg > 1 else 0
        self.ws_dtype = torch.float64 if acc64 else torch.float32
        self.kernels: dict = {}  # alignment bits -> [compiled kernel per phase]
        self.phases = (1, 2) if config.n_seg > 1 else (0,)
        self.all_aligned = (True,) * len(self.tensor_slots)
        # per tensor position: what follows its data pointer in the engine's argument
        self.tails = tuple((slot, (0, 0) if slot in self.constants else templates[slot]) for slot in self.tensor_slots)
        self.device_index = device.index if device.type == "cuda" else None
        self.pair = algo.pair
        self.moments = None if moments is None else (moments[0], None if moments[1] is None else
                                                     algo.names.index(moments[1]))
        self.tiles = config.grid[0] * _cdiv(T, config.block_t)

    def _key(self, aligned):
        keys = list(self.keys)
        for slot, a in zip(self.tensor_slots, aligned):
            if slot not in self.constants:
                keys[slot] = (*keys[slot], a)
        return (self.config.key, tuple(keys), self.runtime, self.wide, self.moments)

    def launch(self, args, outs, parts=None) -> None:
        """Launch on views of this signature (``args``: the algorithm's arguments, ``outs``:
        output views; ``parts``: see the class); the tensors are handed to Triton's dispatch
        where no kernel is compiled."""
        tensors = self._tensors(args, outs)
        ptrs = [t.data_ptr() for t in tensors]
        if self.launch_direct(ptrs, None if parts is None else parts.data_ptr()):
            return
        engine_args = self._with_tensors(tensors)
        moments = self._moments(*engine_args, parts)
        ws = self._workspace(tensors[0])
        with self._on_device():
            compiled = [_dispatch(self.config, engine_args, ws, self.runtime, phase, self.idx, moments=moments)
                        for phase in self.phases]
        if all(_launchable(k) for k in compiled):
            aligned = tuple(p % 16 == 0 for p in ptrs)
            _compiled[self._key(aligned)] = self.kernels[aligned] = compiled

    def launch_direct(self, ptrs, parts=None) -> bool:
        """Launch on the data pointers of ``tensor_slots`` (constants' included; ``parts``: the
        partials' pointer, see the class); False when no kernel is compiled for their alignment
        (or launch hooks are set), nothing launched."""
        aligned = self.last_aligned = self.alignment(ptrs)
        kernels = self.kernels.get(aligned)
        if kernels is None:
            # compiled for another Launch of the same specialisation (the full path builds one per call)
            kernels = _compiled.get(self._key(aligned))
            if kernels is None:
                return False
            self.kernels[aligned] = kernels
        if _hooks_active():
            return False
        with self._on_device():
            ws_ptr = ptrs[0] if not self.ws_size else self._workspace(None).data_ptr()
            self._run_compiled(ptrs, zip(self.phases, kernels), ws_ptr, parts=parts)
        return True

    def alignment(self, ptrs) -> tuple:
        """Which of these data pointers are 16-byte aligned (the compiled kernels' key part)."""
        # one OR tells the common case, every pointer 16-byte aligned
        return self.all_aligned if not functools.reduce(operator.or_, ptrs) & 15 else \
            tuple(p % 16 == 0 for p in ptrs)

    def _tensors(self, args, outs) -> list:
        """The tensors of ``tensor_slots`` among the arguments and outputs (constants' included)."""
        values = (*args, *outs)
        return [self.constants.get(i, values[i]) for i in self.tensor_slots]

    def _with_tensors(self, tensors) -> tuple:
        """The engine's ``(ins, outs)`` with these tensors in their slots (Triton's dispatch)."""
        packed = list(self.templates)
        for slot, t in zip(self.tensor_slots, tensors):
            packed[slot] = (t, 0, 0) if slot in self.constants else (t, *packed[slot])
        return tuple(packed[:self.n_args]), tuple(packed[self.n_args:])

    def _moments(self, ins, outs, parts):
        """The engine's ``moments`` from its packed ``ins`` and ``outs`` and the partials
        ``parts`` (a tensor or a data pointer); ``NO_MOMENTS`` where the launch reduces no output."""
        if self.moments is None:
            return NO_MOMENTS
        k, flag = self.moments
        return parts, outs[k], None if flag is None else ins[flag]

    def _run_compiled(self, ptrs, phased_kernels, ws_ptr, fold=None, parts=None) -> None:
        """Compiled kernels ``(phase, kernel)`` launched on the data pointers of ``tensor_slots``
        (``fold``: the engine's, ``parts``: the partials' pointer, from data pointers)."""
        direct = self.templates.copy()
        for (slot, tail), ptr in zip(self.tails, ptrs):
            direct[slot] = (ptr, *tail)
        ins, outs = tuple(direct[:self.n_args]), tuple(direct[self.n_args:])
        moments = self._moments(ins, outs, parts)
        grid, constexprs = self.config.grid, self.config.constexprs
        stream = _stream_getter()(self.device_index)
        for phase, kernel in phased_kernels:
            launch_compiled(kernel, grid[0], grid[1], stream, ins, outs, ws_ptr, fold, moments, *self.runtime,
                            *constexprs[phase], self.idx)

    def direct_source(self, pointers, namespace: dict, aligned):
        """Python source lines launching the kernel compiled for the alignment ``aligned`` (which
        pointers are 16-byte aligned) with the data pointers held in the variables ``pointers``
        (one per ``tensor_slots`` entry), the engine's arguments spelled out; the objects they
        name go into ``namespace``. None where no such kernel is compiled. The lines return None
        (nothing launched) where a pointer the kernel takes as aligned is not, launch hooks are
        set or another CUDA device is current: the caller then takes the general path. (A kernel
        compiled for a misaligned pointer serves an aligned one as well.)"""
        kernels = self.kernels.get(aligned) or _compiled.get(self._key(aligned))
        if kernels is None:
            return None
        ptr_of = dict(zip(self.tensor_slots, pointers))
        items = []
        for slot, template in enumerate(self.templates):
            if slot in ptr_of:
                tail = (0, 0) if slot in self.constants else template
                names = [f"_a{slot}_{i}" for i in range(len(tail))]
                namespace.update(zip(names, tail))
                items.append(f"({', '.join([ptr_of[slot], *names])})")
            else:
                namespace[f"_a{slot}"] = template
                items.append(f"_a{slot}")
        n = self.n_args
        runtime = [f"_r{i}" for i in range(len(self.runtime))]
        namespace.update(zip(runtime, self.runtime))
        namespace.update(_hooks_active=_hooks_active, _empty=torch.empty, _stream=_stream_getter(),
                         _device=self.device, _index=self.device_index, _idx=self.idx, _g0=self.config.grid[0],
                         _g1=self.config.grid[1], _ws_size=self.ws_size, _ws_dtype=self.ws_dtype)
        if self.device_index is not None:  # a CUDA device (tests stand CPU tensors in for one)
            namespace["_get_device"] = torch.cuda.current_device
        assumed = [p for p, a in zip(pointers, aligned) if a]
        lines = [
            f"if ({' | '.join(assumed) or '0'}) & 15 or _hooks_active()"
            + (" or _get_device() != _index:" if self.device_index is not None else ":"),
            "    return None",
            "_s = _stream(_index)",
            f"_ws = {pointers[0]}" if not self.ws_size else
            "_ws = _empty(_ws_size, dtype=_ws_dtype, device=_device).data_ptr()",
        ]
        for phase, kernel in zip(self.phases, kernels):
            constexprs = self.config.constexprs[phase]
            names = [f"_c{phase}_{i}" for i in range(len(constexprs))]
            namespace.update(zip(names, constexprs))
            namespace.update({f"_k{phase}": kernel, "_launch": launch_compiled})
            lines.append(f"_launch(_k{phase}, _g0, _g1, _s, "
                         f"({', '.join(items[:n])},), ({', '.join(items[n:])},), _ws, None, (None, None, None), "
                         f"{', '.join(runtime)}, {', '.join(names)}, _idx)")
        return lines

    def edge_map(self, args, outs, edge: torch.Tensor) -> None:
        """Write each row's edge map into ``edge`` (contiguous ``[R, 2]``, or ``[R, 5]`` for a
        two-state scan; rl_triton/core/spec.py) without writing the outputs: the engine's reduce
        phase per segment, then ``edge_kernel`` (the segments' maps folded, the carries applied)."""
        tensors = self._tensors(args, outs)
        config = self.config
        width = edge.shape[1]
        ws = torch.empty(edge.shape[0] * config.n_seg * width, dtype=self.ws_dtype, device=self.device)
        ptrs = [t.data_ptr() for t in tensors]
        key = ("edge map", *self._key(tuple(p % 16 == 0 for p in ptrs)))
        kernel = _compiled.get(key)
        with self._on_device():
            if kernel is not None and not _hooks_active():  # the compiled reduce, from data pointers
                self._run_compiled(ptrs, [(1, kernel)], ws.data_ptr())
            else:
                kernel = _dispatch(config, self._with_tensors(tensors), ws, self.runtime, 1, self.idx)
                if _launchable(kernel):
                    _compiled[key] = kernel
        R = edge.shape[0]
        carry = None if args.carry is None else args.carry.contiguous()
        boot = None if width == 2 or args.bootstrap_value is None else args.bootstrap_value.contiguous()
        with self._on_device():
            edge_kernel[(_cdiv(R, 32),)](ws, edge, carry, boot, R, config.n_seg, PAIR=width == 5, BLOCK_R=32,
                                         SEG_BLOCK=_pow2(config.n_seg), num_warps=1)

    def _workspace(self, first):
        """The segment scan's workspace; a single pass reads none (the first input stands in)."""
        if not self.ws_size:
            return first
        return torch.empty(self.ws_size, dtype=self.ws_dtype, device=self.device)

    def _on_device(self):
        other = self.device_index is not None and self.device_index != torch.cuda.current_device()
        return torch.cuda.device(self.device) if other else contextlib.nullcontext()


def chunk_map_size(launch: Launch) -> int:
    """The numbers one chunk of ``launch``'s rows sends (sharded.py): 3 a row (7 for a two-state
    scan), then whether the chunk holds steps."""
    return (7 if launch.pair else 3) * launch.runtime[0] + 1


class ChunkLaunch:
    """One rank's chunk of a sequence split across ranks (rl_triton/core/sharded.py) on the
    Triton backend, for one call signature: the engine's phase 1 writes the segments' maps,
    ``hand_kernel`` folds them into the map the rank sends (``send``, ``3R + 1`` numbers, ``7R + 1``
    for a two-state scan), and
    after the all-gather into ``gathered`` the engine's phase 2 folds every rank's maps into its
    carry (``fold``) and scans the chunk (``world`` and ``rank`` count chunks: ranks, or the
    pieces of a layout with several a rank). Built on the chunk's :class:`Launch` (its plan, its
    arguments with the chunk's own carry in the carry slot); ``hand``: kernel argument
    positions of the per-row views the handed map reads (``own``: the carry, ``own_x``: a
    two-state scan's first-state carry, ``offset``: an input at the chunk's first step, ``cut``: a
    flag at its last step) and ``scale`` (a one-element
    tensor, or None); ``divisor``: the same for the received carry (None: 1).

    The first launches of a pointer alignment go through Triton's dispatch with tensors
    (``reduce``/``scan`` with ``tensors``); later ones call the compiled kernels from data
    pointers (``tensors`` None). ``ready(ptrs)`` says which a call takes."""

    def __init__(self, launch: Launch, world: int, rank: int, compute: torch.dtype, hand: dict,
                 scale: torch.Tensor | None, divisor: torch.Tensor | None, send: torch.Tensor | None = None,
                 gathered: torch.Tensor | None = None):
        self.launch = launch
        config = launch.config
        R, T = launch.runtime[:2]
        self.R, self.T = R, T
        device = launch.device
        self.ws = torch.empty(max(1, R * config.n_seg * (5 if launch.pair else 2)), dtype=launch.ws_dtype,
                              device=device)
        # ``send``/``gathered`` given: a piece's part of a rank's several maps, and every piece's
        # maps in time order (``world`` of them, this chunk's at ``rank``)
        m = chunk_map_size(launch)
        self.send = torch.empty(m, dtype=compute, device=device) if send is None else send
        self.gathered = torch.empty(world * m, dtype=compute, device=device) if gathered is None else gathered
        if divisor is None:
            divisor = torch.ones(1, dtype=launch.ws_dtype, device=device)
        self.scale = scale
        self.fold = (self.gathered, world, rank, divisor)  # keeps the divisor alive for fold_direct
        self.fold_direct = (self.gathered.data_ptr(), world, rank, divisor.data_ptr())
        slot_of = {pos: i for i, pos in enumerate(launch.tensor_slots)}
        # per view of the handed map: (index into the pointers, byte offset, row stride)
        self.views = {}
        for name, pos in hand.items():
            strides = launch.templates[pos]
            size = launch.keys[pos][0].itemsize
            step = 0 if name != "cut" else (T - 1) * strides[1] * size
            self.views[name] = (slot_of[pos], step, strides[0])
        self.hand_grid = (_cdiv(R, 32),)
        self.hand_constexprs = (launch.pair, 32, _pow2(config.n_seg))
        self.compiled: dict = {}  # pointer alignment -> (phase 1, hand, phase 2)
        self.last_aligned = None

    def ready(self, ptrs) -> bool:
        """Whether the compiled kernels serve these data pointers (and may launch now)."""
        self.last_aligned = self.launch.alignment(ptrs)
        return self.last_aligned in self.compiled and direct_launch_ok(self.launch.device)

    def _hand_views(self, values, tensors):
        out = {}
        for name in ("own", "own_x", "offset", "cut"):
            if name not in self.views:
                out[name] = None
                continue
            i, step, stride = self.views[name]
            if tensors is None:
                out[name] = (values[i] + step, stride)
            else:
                x = tensors[i]
                out[name] = (x if x.ndim == 1 else x[:, self.T - 1 if name == "cut" else 0], stride)
        return out

    def reduce(self, ptrs, tensors=None) -> None:
        """Phase 1 and the handed map into ``send`` (the views' tensors where not ``ready``)."""
        launch, config = self.launch, self.launch.config
        if tensors is None:
            k1, kh, _ = self.compiled[self.last_aligned]
            views = self._hand_views(ptrs, None)
            launch._run_compiled(ptrs, [(1, k1)], self.ws.data_ptr())
            launch_compiled(kh, self.hand_grid[0], 1, _stream_getter()(launch.device_index), self.ws.data_ptr(),
                            self.send.data_ptr(), views["own"], views["own_x"], views["offset"], views["cut"],
                            None if self.scale is None else self.scale.data_ptr(), self.R, config.n_seg,
                            *self.hand_constexprs)
            return
        with launch._on_device():
            k1 = _dispatch(config, launch._with_tensors(tensors), self.ws, launch.runtime, 1, launch.idx)
            views = self._hand_views(None, tensors)
            kh = hand_kernel[self.hand_grid](self.ws, self.send, views["own"], views["own_x"], views["offset"],
                                             views["cut"], self.scale, self.R, config.n_seg,
                                             PAIR=self.hand_constexprs[0], BLOCK_R=self.hand_constexprs[1],
                                             SEG_BLOCK=self.hand_constexprs[2], num_warps=1)
        self._pending = (k1, kh)

    def scan(self, ptrs, tensors=None) -> None:
        """Phase 2 from the carry the gathered maps give (the tensors where not ``ready``)."""
        launch, config = self.launch, self.launch.config
        if tensors is None:
            launch._run_compiled(ptrs, [(2, self.compiled[self.last_aligned][2])], self.ws.data_ptr(),
                                 self.fold_direct)
            return
        with launch._on_device():
            k2 = _dispatch(config, launch._with_tensors(tensors), self.ws, launch.runtime, 2, launch.idx, self.fold)
        compiled = (*self._pending, k2)
        if all(_launchable(k) for k in compiled):
            self.compiled[launch.alignment([t.data_ptr() for t in tensors])] = compiled


def _launchable(kernel) -> bool:
    """Whether Triton's dispatch returned a compiled kernel whose launcher can be called directly
    (not under the interpreter)."""
    return not INTERPRET and hasattr(kernel, "packed_metadata") and hasattr(kernel, "function")


def _dispatch(config: _Config, args, ws, runtime, phase, idx, fold=None, moments=NO_MOMENTS):
    """Launch one phase of the engine through Triton's dispatch (compiling if needed); returns
    the compiled kernel. ``fold``, ``moments``: the engine's (phases 0 and 2)."""
    try:
        return scan_kernel[config.grid](*args, ws, fold, moments, *runtime, *config.constexprs[phase], idx,
                                        num_warps=config.num_warps)
    except Exception as e:
        if "outside of the scope of a kernel" in str(e):  # jit functions built before TRITON_INTERPRET=1 was set
            raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported in this process; set it "
                               "before the first import of rl_triton, torch and triton (for example in the "
                               "shell: TRITON_INTERPRET=1 python ...)") from e
        raise


@functools.lru_cache(maxsize=None)
def launchable(kernel) -> bool:
    """Whether a kernel Triton's dispatch returned can be launched from data pointers later
    (``launch_compiled``), as the whitening passes are (rl_triton/core/whiten.py)."""
    return _launchable(kernel)


def direct_launch_ok(device: torch.device) -> bool:
    """Whether a launch from data pointers may run now for tensors on ``device``: no launch hooks
    set and ``device`` the current CUDA device."""
    return not _hooks_active() and (device.index is None or device.index == torch.cuda.current_device())


def current_stream(device: torch.device):
    """Triton's current stream of ``device``, for ``launch_compiled``."""
    return _stream_getter()(device.index if device.index is not None else torch.cuda.current_device())


def _stream_getter():
    """Triton's current-stream function (looked up once: the driver is a lazy proxy)."""
    return driver.active.get_current_stream


_RUNTIME_KNOBS = getattr(knobs, "runtime", None) if AVAILABLE else None


def _hooks_active() -> bool:
    """Whether Triton launch hooks are set (profilers); then every launch takes Triton's path.
    A hook is a callable or None (older triton) or a chain with a ``calls`` list (newer)."""
    if _RUNTIME_KNOBS is None:
        return False
    enter, exit_ = _RUNTIME_KNOBS.launch_enter_hook, _RUNTIME_KNOBS.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(exit_, "calls", exit_))


# The Triton releases whose compiled kernels' launcher this module calls directly, in the positional
# form run(grid0, grid1, grid2, stream, function, packed_metadata, launch_metadata, enter_hook,
# exit_hook, *args): run with 3.6 on an H200; the same form stands in the source of 3.2 and of 3.9
# (CompiledKernel.__getitem__ in triton/compiler/compiler.py). Other releases take the compiled
# kernel's own ``kernel[grid](*args, stream=stream)``, which also forms the launch metadata.
DIRECT_LAUNCH_TRITON = ((3, 2), (3, 9))


def direct_release(version: str) -> bool:
    """Whether Triton ``version`` is one whose compiled kernels this module launches directly."""
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    return DIRECT_LAUNCH_TRITON[0] <= release <= DIRECT_LAUNCH_TRITON[1]


def _launch_direct(kernel, grid0: int, grid1: int, stream, *args) -> None:
    kernel.run(grid0, grid1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)


def _launch_own(kernel, grid0: int, grid1: int, stream, *args) -> None:
    kernel[(grid0, grid1, 1)](*args, stream=stream)


# launch_compiled(kernel, grid0, grid1, stream, *args): a compiled kernel (Triton's dispatch
# returned it) launched on a (grid0, grid1) grid from ``args`` as its launcher takes them (data
# pointers, sizes, compile-time values), without launch hooks (callers check _hooks_active first)
launch_compiled = _launch_direct if AVAILABLE and direct_release(triton.__version__) else _launch_own


def run(algo: spec.Algorithm, args, outs) -> None:
    """Launch ``algo`` on ``[R, T]`` views: ``args`` is ``algo.Args``, ``outs`` the output views."""
    Launch(algo, args, outs).launch(args, outs)
