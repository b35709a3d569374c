"""Call plans: what a call's signature decides, decided once.

A training loop calls an estimator with tensors of the same shapes, strides, dtypes and devices,
the same flags and numbers, every iteration. The first call of such a signature runs the full
path (validation, layout views, backend and launch choices) and leaves a :class:`Plan`: where
each kernel argument lies in the caller's tensors (a byte offset and strides), how the outputs
are allocated, the prepared backend launch, and the checks that read data. A repeated call
computes its signature key, finds the plan, runs those checks, and launches: on the GPU with
data pointers alone, no view is built.

The key holds, per argument, a tensor's dtype, shape, strides, device and ``requires_grad``,
or a number's type and value, plus the grad mode and the environment variables the library
reads. What it cannot hold is checked on every call: the data checks a plan carries (flags
holding only 0 and 1 on CPU, ``terminated`` implying ``done``, coefficient tensors in [0, 1]),
one-element CPU tensors read as numbers (TorchRL keeps gamma in one; a new value sends the call
down the full path), overlap of ``out=`` with the inputs (by address ranges; an overlapping call
takes the full path, which handles it), and on the GPU the data pointers' alignment, which
selects the compiled kernel. Calls that need
autograd, a ``torch.compile`` trace, tensor subclasses and unusual argument types always take
the full path. The cache is bounded and shared by all threads.
"""

from __future__ import annotations

import functools
import inspect
import threading

import torch

from . import cpu, inputs, launch

MAX_PLANS = 256
_plans: dict = {}
_lock = threading.Lock()
_local = threading.local()
_NO_PLAN = object()  # a signature whose calls take the full path (the composed path, say)
_bypass = 0  # > 0: every call takes the full path (kernels.forced_plan sets it for tests)


def clear() -> None:
    """Forget every plan."""
    with _lock:
        _plans.clear()


def bypass(on: bool) -> None:
    """Send every call through the full path while on (nests)."""
    global _bypass
    with _lock:
        _bypass += 1 if on else -1
        _plans.clear()


class _Unkeyable(Exception):
    pass


def _fingerprint(x):
    """What the signature key holds of one argument (``cached`` inlines the tensor case; a tensor
    without strides raises RuntimeError)."""
    t = type(x)
    if t is torch.Tensor:
        return x.dtype, x.shape, x.stride(), x.device, x.requires_grad
    if t is float or t is int or t is bool or t is str or x is None:
        return t, x
    if t is tuple or t is list:
        return t, tuple([_fingerprint(y) for y in x])
    raise _Unkeyable


def cached(fn):
    """``fn`` (a public estimator) with its calls' plans kept by signature."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if _bypass or torch.compiler.is_compiling() or len(args) > len(names):
            return fn(*args, **kwargs)
        key = [call, torch.is_grad_enabled(), inputs.env_state()]
        try:
            for x in args:
                key.append((x.dtype, x.shape, x.stride(), x.device, x.requires_grad) if type(x) is torch.Tensor
                           else _fingerprint(x))
            for name, x in kwargs.items():
                key.append(name)
                key.append((x.dtype, x.shape, x.stride(), x.device, x.requires_grad) if type(x) is torch.Tensor
                           else _fingerprint(x))
        except (_Unkeyable, RuntimeError):  # RuntimeError: a tensor without strides (sparse, say)
            return fn(*args, **kwargs)
        key = tuple(key)
        values = dict(zip(names, args))
        values.update(kwargs)
        plan = _plans.get(key)
        if plan is _NO_PLAN:
            return fn(*args, **kwargs)
        if plan is not None:
            result = plan.execute(values)
            if result is not None:
                return result
            return fn(*args, **kwargs)  # a per-call condition (overlapping out=) the full path handles
        outer = recorder()
        _local.recorder = record = _Recorder(values)
        try:
            result = fn(*args, **kwargs)
        finally:
            _local.recorder = outer
        if record.plan is not None or record.final:
            with _lock:
                if len(_plans) >= MAX_PLANS:
                    del _plans[next(iter(_plans))]  # the oldest
                _plans[key] = record.plan or _NO_PLAN
        return result

    return call


def recorder():
    """The recorder of the full call running on this thread, or None."""
    return getattr(_local, "recorder", None)


class _Recorder:
    """Collects a full call's plan (``plan``), or whether its signature has none (``final``)."""

    def __init__(self, values: dict):
        self.values = values
        self.plan = None
        self.final = True  # no fused launch reached (composed path, empty call): never one

    def build(self, algo, backend, compute, args, rows, given, checks, numbers):
        """The plan of this fused call, or None (also kept: ``final``) where it has none."""
        self.plan = Plan.build(self.values, algo, backend, compute, args, rows, given, checks, numbers)
        self.final = self.plan is not None
        return self.plan


def _sources(values: dict):
    """The caller's tensors by location: (name, index in an ``out`` tuple or None)."""
    found = []
    for name, x in values.items():
        if isinstance(x, torch.Tensor):
            found.append(((name, None), x))
        elif name == "out" and isinstance(x, (tuple, list)):
            found.extend(((name, i), y) for i, y in enumerate(x) if isinstance(y, torch.Tensor))
    return found


def _byte_span(x: torch.Tensor) -> tuple[int, int]:
    """(lowest, one past the highest) byte offset from ``x.data_ptr()`` that ``x`` reaches."""
    lo = sum(st * (sz - 1) for st, sz in zip(x.stride(), x.shape) if st < 0 and sz > 0)
    hi = sum(st * (sz - 1) for st, sz in zip(x.stride(), x.shape) if st > 0 and sz > 0)
    return lo * x.element_size(), (hi + 1) * x.element_size()


def _locate(view: torch.Tensor, name: str, sources):
    """(source position, byte offset) of a kernel view in the caller's tensors: the one tensor
    whose memory holds it (by name where several do), or None."""
    lo, hi = _byte_span(view)
    lo, hi = view.data_ptr() + lo, view.data_ptr() + hi
    found = []
    for k, ((src_name, _), x) in enumerate(sources):
        if x.device != view.device or x.dtype != view.dtype:
            continue
        x_lo, x_hi = _byte_span(x)
        if x.data_ptr() + x_lo <= lo and hi <= x.data_ptr() + x_hi and (
                x.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()):
            found.append((k, src_name))
    if len(found) > 1:
        found = [f for f in found if f[1] == name]
    if len(found) != 1:
        return None
    k = found[0][0]
    return k, view.data_ptr() - sources[k][1].data_ptr()


class Plan:
    """A fused call of one signature: where the kernel's arguments and outputs lie in the
    caller's tensors, how fresh outputs are made, and the prepared backend launch."""

    @classmethod
    def build(cls, values, algo, backend, compute, args, rows, given, checks, numbers):
        sources = _sources(values)
        # per kernel tensor argument: (position, source position, byte offset, shape, strides,
        # how it is seen: SAME (the source itself), TRANSPOSED (a 2-D source's transpose) or VIEW)
        slots = []
        for pos, x in enumerate(args):
            if isinstance(x, torch.Tensor):
                where = _locate(x, algo.names[pos], sources)
                if where is None:
                    return None
                k, offset = where
                slots.append((pos, k, offset, tuple(x.shape), x.stride(), _seen(sources[k][1], offset, x)))
        out_dtype = launch.output_dtype(backend, compute, rows.dtype)
        outputs, views = [], []
        for i, out in enumerate(given):
            fresh = out is None
            if fresh:
                out = torch.empty_like(rows.ref)
            view = rows.output(out)[1]
            if view is None or view.dtype != out_dtype:
                return None  # written through a buffer: the full path
            offset, shape, strides = view.data_ptr() - out.data_ptr(), tuple(view.shape), view.stride()
            seen = _seen(out, offset, view)
            if not fresh:
                make = None
            elif backend == "cpu" and seen != VIEW and out.is_contiguous():
                # numba's outputs are made as numpy arrays, handed to the caller as tensors sharing
                # their memory (the kernel reads them without a conversion)
                make = functools.partial(cpu.new_output, tuple(out.shape), out.dtype, seen == TRANSPOSED)
            else:
                make = functools.partial(_new_output, functools.partial(
                    torch.empty_strided, tuple(out.shape), out.stride(), dtype=out.dtype, device=out.device),
                    offset, shape, strides, seen)
            outputs.append((make, i, offset, shape, strides, seen))
            views.append(view)
        plan = cls()
        plan.sources = [loc for loc, _ in sources]
        plan.spans = [_byte_span(x) for _, x in sources]
        # each output given by the caller, with the other tensors of the call it must not meet
        plan.out_sources = [(j, [k for k in range(len(sources)) if k != j])
                            for j, ((name, _), _) in enumerate(sources) if name == "out"]
        plan.args = list(args)
        plan.slots = slots
        plan.outputs = outputs
        plan.checks = checks
        plan.numbers = numbers
        plan.launch = launch.prepare(algo, backend, compute, args, views)
        plan.pointers = backend == "triton" and rows.device.type == "cuda"
        # numba reads numpy arrays: the sources its arguments come from are converted once each
        # (numpy has no bfloat16; tensors that require grad stay tensors, detached by the backend)
        plan.arrays = [k for k in sorted({slot[1] for slot in slots}) if sources[k][1].dtype != torch.bfloat16
                       and not sources[k][1].requires_grad] if backend == "cpu" else None
        plan.single = len(outputs) == 1
        # the launch's tensor positions, each from a caller tensor, an output or a constant
        if plan.pointers:
            n = len(args)
            by_pos = {pos: (k, offset) for pos, k, offset, *_ in slots}
            plan.pointer_slots = [
                ("const", plan.launch.constants[pos].data_ptr()) if pos in plan.launch.constants else
                ("in", *by_pos[pos]) if pos < n else ("out", pos - n, outputs[pos - n][2])
                for pos in plan.launch.tensor_slots
            ]
        return plan

    def execute(self, values: dict):
        """Run the plan on one call's arguments; None where this call needs the full path."""
        for name, value in self.numbers:
            if float(values[name]) != value:
                return None  # a one-element tensor read as a number holds another one now
        sources = [values[name] if i is None else values[name][i] for name, i in self.sources]
        for check, names in self.checks:
            check(**{name: values[name] for name in names})
        arrays = self.arrays is not None
        outs, out_views = [], []
        for make, i, offset, shape, strides, seen in self.outputs:
            if make is not None:
                out, view = make()
            else:
                out = values["out"]
                out = out if self.single else out[i]
                view = _seen_as(out.numpy() if arrays and seen != VIEW else out, out, offset, shape, strides, seen)
            outs.append(out)
            out_views.append(view)
        if self.out_sources and self._overlap(sources):
            return None
        if not (self.pointers and self._launch_direct(sources, outs)):
            args = self.args.copy()
            seen_as = sources.copy()
            if arrays:
                for k in self.arrays:
                    seen_as[k] = sources[k].numpy()
            for pos, k, offset, shape, strides, seen in self.slots:
                a = seen_as[k]
                args[pos] = a if seen == SAME else a.T if seen == TRANSPOSED else _seen_as(
                    a, sources[k], offset, shape, strides, seen)
            self.launch.launch(args, out_views)
        return outs[0] if self.single else tuple(outs)

    def _launch_direct(self, sources, outs) -> bool:
        ptrs = []
        for slot in self.pointer_slots:
            if slot[0] == "in":
                ptrs.append(sources[slot[1]].data_ptr() + slot[2])
            elif slot[0] == "out":
                ptrs.append(outs[slot[1]].data_ptr() + slot[2])
            else:
                ptrs.append(slot[1])
        return self.launch.launch_direct(ptrs)

    def _overlap(self, sources) -> bool:
        """Whether a caller's output meets another of the call's tensors in memory."""
        ptrs = [x.data_ptr() for x in sources]
        for j, others in self.out_sources:
            lo, hi = self.spans[j]
            lo, hi = ptrs[j] + lo, ptrs[j] + hi
            for k in others:
                a, b = self.spans[k]
                if ptrs[k] + a < hi and lo < ptrs[k] + b:
                    return True
        return False


SAME, TRANSPOSED, VIEW = 0, 1, 2


def _seen(x: torch.Tensor, offset: int, view: torch.Tensor) -> int:
    """How ``view`` (``offset`` bytes into ``x``) is made from ``x``."""
    if offset == 0 and view.shape == x.shape and view.stride() == x.stride():
        return SAME
    if offset == 0 and x.ndim == 2 and view.shape == x.t().shape and view.stride() == x.t().stride():
        return TRANSPOSED
    return VIEW


def _seen_as(a, x: torch.Tensor, offset: int, shape, strides, seen: int):
    """The view of ``x`` (``offset`` bytes into it, ``shape``, ``strides``), made from ``a``
    (``x`` or its numpy array) where it is ``x`` or its transpose."""
    if seen == SAME:
        return a
    if seen == TRANSPOSED:
        return a.T
    return x.as_strided(shape, strides, x.storage_offset() + offset // x.element_size())


def _new_output(alloc, offset: int, shape, strides, seen: int):
    out = alloc()
    return out, _seen_as(out, out, offset, shape, strides, seen)
