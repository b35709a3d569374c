"""Call plans: what a call's signature decides, decided once.

A training loop calls an estimator with tensors of the same shapes, strides, dtypes and devices,
the same flags and numbers, every iteration. The first call of such a signature runs the full
path (validation, layout views, backend and launch choices) and leaves a :class:`Plan`: where
each kernel argument lies in the caller's tensors (a byte offset and strides), how the outputs
are allocated, the prepared backend launch, and the checks that read data. A repeated call
computes its signature key, finds the plan, and runs the function the plan wrote for its
signature: the checks, the outputs, the launch (on the GPU with data pointers alone; no view is
built).

The key holds, per argument, a tensor's dtype, shape, strides, device and ``requires_grad``,
or a number's type and value, plus the grad mode and the environment variables the library
reads. What it cannot hold is checked on every call: the data checks a plan carries (flags
holding only 0 and 1 on CPU, ``terminated`` implying ``done``, coefficient tensors in [0, 1]),
one-element CPU tensors read as numbers (TorchRL keeps gamma in one; a new value sends the call
down the full path), overlap of ``out=`` with the inputs (by address ranges; an overlapping call
takes the full path, which handles it), and on the GPU the data pointers' alignment, which
selects the compiled kernel. Calls that need autograd, a ``torch.compile`` trace, tensor
subclasses and unusual argument types always take the full path. The cache is bounded and
shared by all threads, and a plan keeps no tensor of its calls alive.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import NamedTuple

import torch

from . import cpu, graphs, inputs, launch

MAX_PLANS = 256
_plans: dict = {}
_lock = threading.Lock()
_NO_PLAN = object()  # a signature whose calls take the full path (the composed path, say)


def clear() -> None:
    """Forget every plan, and the graphs of their calls."""
    with _lock:
        _plans.clear()
    graphs.clear()


class Unkeyable(Exception):
    pass


def fingerprint(x):
    """What the signature key holds of one argument (``cached`` inlines tensors and floats; a
    tensor without strides raises RuntimeError). Other numbers carry their type, so that 1,
    1.0 and True stay apart."""
    t = type(x)
    if t is torch.Tensor:
        return x.dtype, x.shape, x.stride(), x.device, x.requires_grad
    if t is float or t is int or t is bool or t is str or x is None:
        return t, x
    if t is tuple or t is list:
        return t, tuple([fingerprint(y) for y in x])
    if t is dict:  # keyword options (``gae``'s ``whiten``), in their order
        return t, tuple([(k, fingerprint(y)) for k, y in x.items()])
    raise Unkeyable


class Chunk(NamedTuple):
    """How a call runs as one chunk of a sequence split along time (rl_triton/core/sharded.py):
    ``carry`` ([R], the call's row order) replaces the algorithm's own carry (spec.py) where
    not None; ``edge`` (float64 ``[R, k + 1]`` on the call's device), where not None, receives
    each row's edge map (k numbers) and the carry the algorithm would have had (its window end's,
    0 where it has none), and then the outputs may be left unwritten (Triton computes the map
    alone)."""
    carry: torch.Tensor | None
    edge: torch.Tensor | None
    args: dict | None = None  # further kernel arguments by name (spec.py)
    # where not None, the fused call's plan (Plan) goes to record(plan) instead of a launch, and
    # the call ends there (record raises)
    record: object = None
    # True: the call checks its arguments and ends there, raising Checked (nothing launched)
    check: bool = False


class Checked(Exception):
    """Raised by a call running as a checking chunk (``Chunk.check``) once its arguments passed."""


def cached(fn, launch_bound):
    """``fn`` (a public function's body) with its calls' plans kept by signature. The body
    returns its outputs, or a bound fused call (``call.Bound``) that ``launch_bound(bound,
    recorder)`` launches: on a signature's first call with a :class:`_Recorder`, which keeps the
    plan it leaves; otherwise with None."""
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind == inspect.Parameter.POSITIONAL_OR_KEYWORD]

    def full(*args, **kwargs):
        """The call's full path, keeping no plan."""
        result = fn(*args, **kwargs)
        return launch_bound(result, None) if type(result) is Bound else result

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling() or len(args) > len(names) or launch.plan_forced():
            return full(*args, **kwargs)
        env = inputs.env_state()
        key = [call, torch.is_grad_enabled(), env]
        try:  # tensors and floats (the common arguments) inline; a float stands for itself
            for x in args:
                t = type(x)
                key.append((x.dtype, x.shape, x.stride(), x.device, x.requires_grad) if t is torch.Tensor
                           else x if t is float else fingerprint(x))
            for name, x in kwargs.items():
                t = type(x)
                key.append(name)
                key.append((x.dtype, x.shape, x.stride(), x.device, x.requires_grad) if t is torch.Tensor
                           else x if t is float else fingerprint(x))
        except (Unkeyable, RuntimeError):  # RuntimeError: a tensor without strides (sparse, say)
            return full(*args, **kwargs)
        key = tuple(key)
        plan = _plans.get(key)
        if plan is _NO_PLAN:
            return full(*args, **kwargs)
        if plan is not None and plan.hit is not None:
            if plan.graphable and graphs.enabled(env[2]):
                result = plan.replayer(args, kwargs)
                if result is not None:
                    return result
            result = plan.hit(args, kwargs)
            if result is not None:
                return result
        values = dict(zip(names, args))
        values.update(kwargs)
        if plan is not None:
            result = plan.execute(values)
            if result is not None:
                return result
            return full(*args, **kwargs)  # a per-call condition (overlapping out=) the full path handles
        result = fn(*args, **kwargs)
        if type(result) is not Bound:  # the composed path, an empty call: the signature keeps no plan
            record = None
        else:
            record = _Recorder(values, names[:len(args)])
            result = launch_bound(result, record)
        if record is None or record.plan is not None or record.final:
            with _lock:
                if len(_plans) >= MAX_PLANS:
                    del _plans[next(iter(_plans))]  # the oldest
                _plans[key] = _NO_PLAN if record is None else record.plan or _NO_PLAN
        return result

    call.full = full
    return call


class Bound(NamedTuple):
    """A validated fused call, ready to launch: ``call`` (rl_triton/core/call.py's ``Call``: the
    rows, outputs, backend, compute dtype and the checks a plan reruns), the algorithm of
    spec.py, and its kernel arguments by name (``[R, T]`` views, ``[R]`` views, numbers, None);
    ``reduce``: a :class:`Reduce`, or None."""
    call: object
    algo: object
    args: dict
    reduce: object = None


class Reduce(NamedTuple):
    """A Triton launch that also reduces output ``output`` tile by tile into partial moments over
    the steps where the argument named ``flag`` is nonzero (None: every step;
    ``kernels.Launch``'s ``moments``), followed by ``finish(outputs, parts)`` (the whitening of
    rl_triton/core/whiten.py). A plan keeps ``output``, ``flag``, ``accepts`` and ``finish``,
    which hold no tensor of a call: ``accepts(launch, outputs)`` says whether a signature's
    calls take this path (a plan of it is made), ``finish`` runs after each of its launches.
    ``run(args)`` serves a call without a plan (its own tensors; ``args``: ``algo.Args``). On
    the numba backend the launch reduces nothing and ``finish(outputs, None)`` makes its own
    pass over the output."""
    output: int
    flag: str | None
    accepts: object
    finish: object
    run: object


class _Recorder:
    """Collects the plan a signature's first fused call leaves (``plan``), or whether its
    signature has none (``final``)."""

    def __init__(self, values: dict, positional):
        self.values = values
        self.positional = positional
        self.plan = None
        self.final = True  # False: this call's own tensors (aliasing) kept it from a plan

    def build(self, algo, backend, compute, args, rows, given, checks, numbers, reduce=None):
        """The plan of this fused call, or None where it has none: then its signature keeps none
        (``final``), unless it was this call's tensors sharing memory that hid where a view lies."""
        plan = Plan.build(self.values, self.positional, algo, backend, compute, args, rows, given, checks, numbers,
                          reduce)
        self.final = plan is not _AMBIGUOUS
        self.plan = None if plan is _AMBIGUOUS else plan
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


_AMBIGUOUS = object()


def _locate(view: torch.Tensor, name: str, sources):
    """(source position, byte offset) of a kernel view in the caller's tensors: the one tensor
    whose memory holds it (by name where several do); None where none does, _AMBIGUOUS where
    several do."""
    lo, hi = inputs.byte_range(view)
    found = []
    for k, ((src_name, _), x) in enumerate(sources):
        if x.device != view.device or x.dtype != view.dtype:
            continue
        x_lo, x_hi = inputs.byte_range(x)
        if x_lo <= lo and hi <= x_hi and (
                x.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()):
            found.append((k, src_name))
    if len(found) > 1:
        found = [f for f in found if f[1] == name] or found
    if len(found) != 1:
        return None if not found else _AMBIGUOUS
    k = found[0][0]
    return k, view.data_ptr() - sources[k][1].data_ptr()


class Plan:
    """A fused call of one signature: where the kernel's arguments and outputs lie in the
    caller's tensors, how fresh outputs are made, and the prepared backend launch."""

    @classmethod
    def build(cls, values, positional, algo, backend, compute, args, rows, given, checks, numbers, reduce=None):
        """The plan of a fused call (``values``: its arguments by name, the first ``positional``
        of them given by position; the rest as ``call.launch_bound`` has them; ``reduce``: a
        :class:`Reduce` or None); None where a kernel view is no caller tensor's (a copy was
        made), an output goes through a buffer or ``reduce`` does not accept the launch, and
        _AMBIGUOUS where several caller tensors hold a view."""
        sources = _sources(values)
        # per kernel tensor argument: (position, source position, byte offset, shape, strides,
        # how it is seen: SAME (the source itself), TRANSPOSED (a 2-D source's transpose) or VIEW)
        slots = []
        for pos, x in enumerate(args):
            if isinstance(x, torch.Tensor):
                where = _locate(x, algo.names[pos], sources)
                if where is None or where is _AMBIGUOUS:
                    return where
                k, offset = where
                slots.append((pos, k, offset, tuple(x.shape), x.stride(), _seen(sources[k][1], offset, x)))
        out_dtype = launch.output_dtype(backend, compute, rows.dtype)
        outputs, views, made = [], [], []
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
                make = functools.partial(_new_output, tuple(out.shape), out.stride(), out.dtype, out.device)
            outputs.append((make, i, offset, shape, strides, seen))
            views.append(view)
            made.append(out)
        plan = cls()
        plan.positional = positional
        plan.sources = [loc for loc, _ in sources]
        plan.spans = [inputs.byte_span(x) for _, x in sources]
        # each output given by the caller, with the other tensors of the call it must not meet
        plan.out_sources = [(j, [k for k in range(len(sources)) if k != j])
                            for j, ((name, _), _) in enumerate(sources) if name == "out"]
        plan._overlaps = None  # _overlap's compiled condition, made on first use
        # the arguments the signature fixes (numbers, modes, absent inputs); tensors come per
        # call, and a plan keeps none of its first call's alive
        plan.args = [None if isinstance(x, torch.Tensor) else x for x in args]
        plan.slots = slots
        plan.outputs = outputs
        plan.checks = checks
        plan.numbers = numbers
        plan.launch = launch.prepare(algo, backend, compute, args, views,
                                     moments=None if reduce is None else (reduce.output, reduce.flag))
        if reduce is not None and not reduce.accepts(plan.launch, made):
            return None
        plan.reduce = None if reduce is None else (reduce.output, reduce.finish)
        plan.pointers = launch.pointer_launches(backend)
        # the hit path, after a first launch: generated (``_generate``), or for a reducing
        # launch ``_reducing_hit`` (which allocates the partials and finishes)
        plan.hit = None
        plan.can_generate = (plan.pointers or backend == "cpu") and reduce is None
        plan.algo = algo.name
        plan.device = rows.device
        plan.graphable = graphs.eligible(plan)
        # numba reads numpy arrays: the sources its arguments come from are converted once each
        # (numpy has no bfloat16; tensors that require grad stay tensors, detached by the backend)
        plan.arrays = [k for k in sorted({slot[1] for slot in slots}) if sources[k][1].dtype != torch.bfloat16
                       and not sources[k][1].requires_grad] if backend == "cpu" else None
        plan.single = len(outputs) == 1
        plan.replayer = plan._generate_replayer() if plan.graphable else None
        # the launch's tensor positions, each from a caller tensor, an output or a constant
        if plan.pointers:
            # per tensor position of the launch: (index into sources + outputs + constants, offset)
            n, n_src, n_out = len(args), len(sources), len(outputs)
            by_pos = {pos: (k, offset) for pos, k, offset, *_ in slots}
            constants = plan.launch.constants
            plan.constants = [constants[pos] for pos in plan.launch.tensor_slots if pos in constants]
            plan.pointer_slots, c = [], 0
            for pos in plan.launch.tensor_slots:
                if pos in constants:
                    plan.pointer_slots.append((n_src + n_out + c, 0))
                    c += 1
                elif pos < n:
                    plan.pointer_slots.append(by_pos[pos])
                else:
                    plan.pointer_slots.append((n_src + pos - n, outputs[pos - n][2]))
        return plan

    def prepare(self, values: dict):
        """One call's caller tensors, fresh outputs and their kernel views (None: made where
        needed), its checks run; None where this call needs the full path."""
        for name, value in self.numbers:
            if float(values[name]) != value:
                return None  # a one-element tensor read as a number holds another one now
        sources = [values[name] if i is None else values[name][i] for name, i in self.sources]
        for check, names in self.checks:
            check(**{name: values[name] for name in names})
        outs, views = [], []
        for make, i, *_ in self.outputs:
            if make is not None:
                out, view = make()
            else:
                out, view = values["out"], None
                if not self.single:
                    out = out[i]
            outs.append(out)
            views.append(view)
        if self.out_sources and self._overlap(sources):
            return None
        return sources, outs, views

    def data_pointers(self, sources, outs) -> list:
        """The launch's data pointers (``Launch.tensor_slots``) for these tensors (Triton)."""
        tensors = sources + outs + self.constants
        return [tensors[k].data_ptr() + offset for k, offset in self.pointer_slots]

    def execute(self, values: dict):
        """Run the plan on one call's arguments; None where this call needs the full path."""
        prepared = self.prepare(values)
        if prepared is None:
            return None
        sources, outs, views = prepared
        if self.reduce is not None:
            return self._reducing(sources, outs, views)
        if self.pointers:
            if self.launch.launch_direct(self.data_pointers(sources, outs)):
                if self.can_generate and self.hit is None:
                    self.hit = self._generate()
                return outs[0] if self.single else tuple(outs)
        self._launch(sources, outs, views)
        if self.can_generate and self.hit is None and not self.pointers:
            self.hit = self._generate()
        return outs[0] if self.single else tuple(outs)

    def _generate(self):
        """A function ``hit(args, kwargs)`` serving the calls of this plan's signature as
        ``execute`` does, with every value the signature fixes written into its code (as Triton
        binds its own launches): it takes the caller's tensors from where this signature puts
        them, runs the plan's checks, allocates the outputs and launches (Triton: the compiled
        kernel with data pointers; numba: the kernel with numpy views). It returns None, having
        launched nothing, where ``execute`` would, and where a pointer the compiled kernel takes
        as 16-byte aligned is not, launch hooks are set or another device is current; then
        ``execute`` serves the call. None instead of a function where the Triton kernel is not
        compiled yet."""
        namespace = {}
        lines, var = self._argument_lines(namespace)
        for j, (make, i, *_) in enumerate(self.outputs):
            if make is None:
                lines.append(f"o{j} = {var['out', None if self.single else i]}")
            elif make.func is _new_output:  # spelled out: torch.empty_strided with the layout's arguments
                shape, strides, dtype, device = make.args
                namespace.update({f"_shape{j}": shape, f"_strides{j}": strides, f"_dtype{j}": dtype,
                                  f"_device{j}": device, "_empty_strided": torch.empty_strided})
                lines.append(f"o{j} = _empty_strided(_shape{j}, _strides{j}, dtype=_dtype{j}, device=_device{j})")
            else:
                namespace[f"_make{j}"] = make
                lines.append(f"o{j}, w{j} = _make{j}()")
        if self.out_sources:
            lines += [f"d{k} = s{k}.data_ptr()" for k in range(len(self.sources))]
            lines += [f"if {self._overlap_condition()}:", "    return None"]
        launch = self._pointer_lines(namespace) if self.pointers else self._array_lines(namespace)
        if launch is None:
            return None
        results = ", ".join(f"o{j}" for j in range(len(self.outputs)))
        lines += launch + [f"return {results}" + ("" if self.single else ",")]
        return self._compile(lines, namespace)

    def _argument_lines(self, namespace):
        """The lines of a generated hit function that take the caller's tensors from where this
        signature puts them (``s0, s1, ...``), return None where a one-element tensor read as a
        number holds another value now, and run the plan's checks; with the map from (argument
        name, index in ``out``) to each tensor's variable."""
        lines, var = [], {}
        for k, (name, i) in enumerate(self.sources):
            where = f"args[{self.positional.index(name)}]" if name in self.positional else f"kwargs[{name!r}]"
            lines.append(f"s{k} = {where}" + ("" if i is None else f"[{i}]"))
            var[name, i] = f"s{k}"
        for m, (name, value) in enumerate(self.numbers):
            namespace[f"_n{m}"] = value
            lines += [f"if float({var[name, None]}) != _n{m}:", "    return None"]
        for m, (check, names) in enumerate(self.checks):
            namespace[f"_check{m}"] = check
            lines.append(f"_check{m}({', '.join(f'{name}={var[name, None]}' for name in names)})")
        return lines, var

    def _generate_replayer(self):
        """A function ``replayer(args, kwargs)`` serving a call of this plan's signature from a
        CUDA graph (rl_triton/core/graphs.py, ``replay``) keyed by its tensors' data pointers:
        the hit path's arguments and checks, then the replay; the outputs (every one given in
        ``out=``), or None where the call is not replayed (``hit`` then serves it)."""
        namespace = {"_replay": graphs.replay, "_plan": self}
        lines, var = self._argument_lines(namespace)
        addresses = "".join(f"s{k}.data_ptr(), " for k in range(len(self.sources)))
        results = ", ".join(var["out", None if self.single else i] for _, i, *_ in self.outputs)
        lines += [f"if _replay(_plan, ({addresses}), args, kwargs):",
                  f"    return {results}" + ("" if self.single else ","), "return None"]
        return self._compile(lines, namespace)

    def _compile(self, lines, namespace):
        """``def hit(args, kwargs)`` with the body ``lines``, its names from ``namespace``."""
        source = "def hit(args, kwargs):\n" + "".join(f"    {line}\n" for line in lines)
        exec(compile(source, f"<rl_triton plan: {self.algo}>", "exec"), namespace)
        return namespace["hit"]

    def _pointer_lines(self, namespace):
        """The Triton launch from data pointers of the sources ``s*`` and outputs ``o*``."""
        n_src, n_out = len(self.sources), len(self.outputs)
        lines, pointers = [], []
        for m, (k, offset) in enumerate(self.pointer_slots):
            if k < n_src:
                expr = f"d{k}" if self.out_sources else f"s{k}.data_ptr()"
            elif k < n_src + n_out:
                expr = f"o{k - n_src}.data_ptr()"
            else:
                namespace[f"_const{m}"] = self.constants[k - n_src - n_out]
                expr = f"_const{m}.data_ptr()"
            lines.append(f"p{m} = {expr}" + (f" + {offset}" if offset else ""))
            pointers.append(f"p{m}")
        launch = self.launch.direct_source(pointers, namespace, self.launch.last_aligned)
        return None if launch is None else lines + launch

    def _array_lines(self, namespace):
        """The numba launch on numpy views of the sources ``s*`` and outputs ``o*`` (or the
        arrays ``w*`` fresh outputs come with)."""
        lines = [f"a{k} = s{k}.numpy()" for k in self.arrays]
        args = {}
        for pos, k, offset, shape, strides, seen in self.slots:
            base = f"a{k}" if k in self.arrays else f"s{k}"
            if seen == VIEW:
                namespace[f"_view{pos}"] = functools.partial(_seen_as, offset=offset, shape=shape, strides=strides,
                                                             seen=VIEW)
                args[pos] = (f"_view{pos}(None, s{k})", False)
            else:
                args[pos] = (base if seen == SAME else f"{base}.T", k in self.arrays)
        outs = []
        for j, (make, _, offset, shape, strides, seen) in enumerate(self.outputs):
            if make is not None and make.func is cpu.new_output:
                outs.append((f"w{j}", True))
            elif seen == VIEW:
                namespace[f"_oview{j}"] = functools.partial(_seen_as, offset=offset, shape=shape, strides=strides,
                                                            seen=VIEW)
                outs.append((f"_oview{j}(None, o{j})", False))
            else:
                outs.append((f"o{j}.numpy()" if seen == SAME else f"o{j}.numpy().T", True))
        return lines + self.launch.source(args, outs, namespace)

    def _launch(self, sources, outs, views):
        """Launch on views of the caller's tensors (numpy arrays for numba)."""
        self.launch.launch(*self.kernel_views(sources, outs, views))

    def _reducing(self, sources, outs, views, direct_only=False):
        """The launch that reduces an output into partial moments (``Reduce``), then its finish;
        ``direct_only``: None, nothing launched, where the launch from data pointers cannot run."""
        output, finish = self.reduce
        if self.arrays is not None:  # numba: the scan, then the finish's own pass (no partials)
            self._launch(sources, outs, views)
            parts = None
        else:
            parts = torch.empty(self.launch.tiles, 3, dtype=torch.float64, device=self.device)
            if not (self.pointers and self.launch.launch_direct(self.data_pointers(sources, outs), parts.data_ptr())):
                if direct_only:
                    return None
                self.launch.launch(*self.kernel_views(sources, outs, views), parts)
        finish(outs, parts)
        if self.hit is None:
            self.hit = self._reducing_hit
        return outs[0] if self.single else tuple(outs)

    def _reducing_hit(self, args, kwargs):
        """A reducing plan's hit path (``hit(args, kwargs)`` as ``_generate``'s): ``execute``'s
        steps, from data pointers alone where the launch takes them; None where ``execute``
        must serve the call."""
        values = dict(zip(self.positional, args))
        values.update(kwargs)
        prepared = self.prepare(values)
        return None if prepared is None else self._reducing(*prepared, direct_only=self.pointers)

    def kernel_views(self, sources, outs, views):
        """The kernel's arguments and output views on the caller's tensors (numpy arrays for
        numba)."""
        arrays = self.arrays is not None
        for j, (out, (_, _, offset, shape, strides, seen)) in enumerate(zip(outs, self.outputs)):
            if views[j] is None:
                views[j] = _seen_as(out.numpy() if arrays and seen != VIEW else out, out, offset, shape, strides, seen)
        args = self.args.copy()
        seen_as = sources.copy()
        if arrays:
            for k in self.arrays:
                seen_as[k] = sources[k].numpy()
        for pos, k, offset, shape, strides, seen in self.slots:
            args[pos] = _seen_as(seen_as[k], sources[k], offset, shape, strides, seen)
        return args, views

    def _overlap_condition(self) -> str:
        """Whether a caller's output meets another of the call's tensors in memory, as one Python
        expression of the sources' data pointers ``d0, d1, ...``: tensors j and k meet where
        lo_j - hi_k < d_k - d_j < hi_j - lo_k (their spans, the constants of this signature), each
        pair written once. The generated hit path inlines it; ``_overlap`` evaluates it."""
        pairs = sorted({(min(j, k), max(j, k)) for j, others in self.out_sources for k in others})
        terms = []
        for j, k in pairs:
            (lo_j, hi_j), (lo_k, hi_k) = self.spans[j], self.spans[k]
            terms.append(f"{lo_j - hi_k} < d{k} - d{j} < {hi_j - lo_k}")
        return " or ".join(terms)

    def _overlap(self, sources) -> bool:
        """``_overlap_condition`` on these tensors (compiled on first use)."""
        if self._overlaps is None:
            names = ", ".join(f"d{k}" for k in range(len(self.sources)))
            self._overlaps = eval(f"lambda {names}: {self._overlap_condition()}")
        return self._overlaps(*[x.data_ptr() for x in sources])


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


def _new_output(shape, strides, dtype, device):
    """A fresh output, its kernel view left to be made where one is needed."""
    return torch.empty_strided(shape, strides, dtype=dtype, device=device), None
