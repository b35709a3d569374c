"""One public call's arguments: validation, the ``[R, T]`` views, the backend choice, and the
fused launch through the call's plan (rl_triton/core/plans.py). The estimators and
``affine_scan`` build on it.

Flags come transition-aligned (``terminated``/``truncated``, or ``done`` with optional
``terminated``), or observation-aligned as SB3 and CleanRL keep them: ``episode_starts[t]``
marks obs t as an episode's first, with ``last_done`` for the step after the window; then
done[t] = episode_starts[t+1], done[T-1] = last_done, read in place, all terminations.
"""

from __future__ import annotations

import torch

from . import cpu, inputs, launch, plans, spec

TRUNCATION_HELP = (
    "truncated steps bootstrap from the value of the final observation, which values[t+1] does "
    "not hold: pass next_values (V(s_{t+1}) of the true successor at every step), or fold the "
    "truncation bootstrap into the rewards and pass only terminated/done"
)


def _binary(**flags):
    for name, f in flags.items():
        if f.dtype != torch.bool and not cpu.all_binary(f):
            raise ValueError(f"{name} must hold only 0 and 1")


def _terminations_are_dones(terminated, done):
    if not cpu.implies(terminated, done):
        raise ValueError("terminated is set at a step where done is not; done must include terminations")


def _in_unit_interval(**coefficient):
    (name, x), = coefficient.items()
    inputs.check_unit_interval(x, name)


class Call:
    """One estimator call: validated inputs in ``[R, T]`` form and the chosen backend."""

    def __init__(self, ref, ref_name: str, time_dim, chunk: plans.Chunk | None = None):
        inputs.check_tensor(ref, ref_name)
        self.rows = inputs.Rows(ref, ref_name, time_dim, ref.dtype)
        # the chunk of a split sequence this call runs as (rl_triton/core/sharded.py), or None
        self.chunk = chunk
        self.compute_dtype = inputs.compute_dtype(ref.dtype)
        self.grad_inputs = [ref]
        self.term = self.done = self.trunc = self.last_done = None
        self.checks = []  # (check, argument names): checks that read data, rerun by the call's plan
        self.numbers = []  # (name, value): one-element tensors read as numbers, which a plan must find again
        self.plannable = True  # False: the call's signature does not fix what the kernels receive

    # -- validation ----------------------------------------------------------------------
    def value(self, x, name, *, optional=False, shape=None):
        if x is None and optional:
            return None
        self.rows.value(x, name, shape=shape)
        self.grad_inputs.append(x)
        return x

    def per_row(self, x, name):
        return self.value(x, name, optional=True, shape=self.rows.row_shape)

    def coefficient(self, x, name):
        given = x
        x = self.rows.coefficient(x, name)
        if isinstance(x, torch.Tensor):
            if x.numel() == 1 and x.device.type == "cpu" and not x.requires_grad \
                    and not torch.compiler.is_compiling():
                # the number it holds, read without a sync: backends then take their constant path
                # (the call's plan reads it again on every call)
                value = float(x)
                if x is given:
                    self.numbers.append((name, value))
                else:
                    self.plannable = False
                return value
            if inputs.value_checks_on(x.device) and x is given:
                self.checks.append((_in_unit_interval, (name,)))
            self.grad_inputs.append(x)
        return x

    def flags(self, terminated, truncated, done, *, episode_starts=None, last_done=None, align=False):
        """Canonical flags: term_eff = terminated or done; done_eff = done or term | trunc; or the
        observation-aligned pair (episode_starts, last_done), read shifted by one step in place."""
        if episode_starts is not None or last_done is not None:
            return self._observation_aligned(terminated, truncated, done, episode_starts, last_done)
        if align:
            if isinstance(done, torch.Tensor) and done.ndim <= self.rows.tdim:
                raise ValueError(f"done must cover {self.rows.ref_name}'s dims up to the time dim "
                                 f"({self.rows.tdim + 1} or more dims), got shape {tuple(done.shape)}")
            terminated, truncated, done = (
                inputs.align_leading(f, self.rows.ref.ndim, self.rows.tdim) for f in (terminated, truncated, done)
            )
        terminated = self.rows.flag(terminated, "terminated")
        truncated = self.rows.flag(truncated, "truncated")
        done = self.rows.flag(done, "done")
        if truncated is not None and done is not None:
            raise ValueError(
                "pass either truncated (gymnasium style, with terminated) or done (TorchRL style, "
                "with optional terminated), not truncated together with done"
            )
        if self._check_binary(terminated=terminated, truncated=truncated, done=done):
            if terminated is not None and done is not None:
                self._data_check(_terminations_are_dones, terminated=terminated, done=done)
        self.maybe_truncated = truncated is not None or (done is not None and terminated is not None)
        if done is not None:
            self.done = done
            self.term = terminated if terminated is not None else done
        else:
            self.term, self.trunc = terminated, truncated

    def mask(self, x, name: str = "mask"):
        """A token mask: a flag tensor of the rewards' shape (broadcastable), 0/1 where values
        are checked."""
        x = self.rows.flag(x, name)
        self._check_binary(**{name: x})
        return x

    def _check_binary(self, **flags) -> bool:
        """Data check that flags hold only 0 and 1; returns whether value checks are on."""
        if not inputs.value_checks_on(self.rows.device):
            return False
        flags = {name: f for name, f in flags.items() if f is not None and f.dtype != torch.bool}
        if flags:
            self._data_check(_binary, **flags)
        return True

    def _data_check(self, check, **tensors):
        """Run a check that reads the tensors' values, and keep it for the call's plan."""
        check(**tensors)
        self.checks.append((check, tuple(tensors)))

    def _observation_aligned(self, terminated, truncated, done, episode_starts, last_done):
        if terminated is not None or truncated is not None or done is not None:
            given = [n for n, x in (("terminated", terminated), ("truncated", truncated), ("done", done),
                                    ("episode_starts", episode_starts), ("last_done", last_done)) if x is not None]
            raise ValueError("pass either episode_starts with last_done (observation-aligned) or "
                             f"terminated/truncated/done (transition-aligned), not both; got {', '.join(given)}")
        if episode_starts is None or last_done is None:
            raise ValueError("episode_starts and last_done go together (done[t] = episode_starts[t+1], "
                             "done[T-1] = last_done)")
        self.done = self.rows.flag(episode_starts, "episode_starts")
        self.last_done = self.rows.flag(last_done, "last_done", shape=self.rows.row_shape)
        self._check_binary(episode_starts=self.done, last_done=self.last_done)
        self.maybe_truncated = False

    def next_value_form(self, next_values, bootstrap_value):
        """Explicit next values, or the implied form values[t+1] with an optional bootstrap value."""
        if next_values is not None:
            if bootstrap_value is not None:
                raise ValueError(
                    "pass either next_values (explicit V(s_{t+1})) or bootstrap_value (V(s_T) for the "
                    "implied form), not both"
                )
            self.value(next_values, "next_values")
            return
        self.per_row(bootstrap_value, "bootstrap_value")
        if self.maybe_truncated:
            raise ValueError(f"next_values is required when steps can be truncated: {TRUNCATION_HELP}")

    # -- execution -----------------------------------------------------------------------
    def start(self, backend, out, n_out: int) -> bool:
        """Check ``out``, choose the backend; True when the fused path runs (no autograd needed)."""
        if out is None:
            self.out = [None] * n_out
        elif n_out == 1:
            self.out = [self.rows.check_out(out, "out")]
        else:
            if not isinstance(out, (tuple, list)) or len(out) != n_out:
                raise TypeError(f"out must be a tuple of {n_out} tensors")
            self.out = [self.rows.check_out(o, f"out[{i}]") for i, o in enumerate(out)]
            if inputs.shares_memory(self.out[0], self.out[1]):
                raise ValueError("out[0] and out[1] share memory; pass two separate tensors")
        self.backend = launch.resolve_backend(backend, self.rows.device)
        self.needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in self.grad_inputs)
        if self.needs_grad and out is not None:
            raise ValueError("out= does not support autograd; call without out= to get gradients")
        self.empty = self.rows.R == 0 or self.rows.T == 0
        self.aliased = [False] * n_out if out is None else self._aliased()
        if self.chunk is not None and self.chunk.check:
            raise plans.Checked  # every argument checked (sharded calls, before their collectives)
        return self.backend != "torch" and not self.needs_grad

    def _aliased(self) -> list:
        """Which outputs overlap an input: those are computed into fresh memory and copied."""
        tensors = [t for t in (*self.grad_inputs, self.term, self.done, self.trunc, self.last_done)
                   if isinstance(t, torch.Tensor)]
        return [any(inputs.shares_memory(o, t) for t in tensors) for o in self.out]

    def results(self, ys):
        """Outputs in the caller's layout from ``[R, T]`` results (None: nothing computed, T = 0)."""
        outs = tuple(
            self.rows.output(o)[0] if y is None else self.rows.deliver(y, o) for y, o in zip(ys, self.out)
        )
        return outs if len(outs) > 1 else outs[0]

    def empty_outputs(self):
        """The outputs of an empty call; where gradients are needed, still part of the graph."""
        outs = self.results([None] * len(self.out))
        if not self.needs_grad:
            return outs
        link = sum(t.reshape(-1)[:0].sum() for t in self.grad_inputs if t.requires_grad)
        outs = tuple(o + link for o in (outs if isinstance(outs, tuple) else (outs,)))
        return outs if len(outs) > 1 else outs[0]

    def bind(self, algo: spec.Algorithm, **args) -> plans.Bound:
        """This call's fused kernel ``algo`` on the named arguments (``[R, T]`` views, ``[R]``
        views, numbers or None), bound and not launched: the public function returns it and its
        route launches it (:func:`launch_bound`)."""
        return plans.Bound(self, algo, args)

    def _launch(self, algo: spec.Algorithm, args, edge=None) -> tuple:
        """The fused launch into the caller's outputs; those that overlap an input are computed
        into fresh memory and copied after the kernel has read every input."""
        given = [None if a else o for o, a in zip(self.out, self.aliased)]
        results = launch.run(algo, self.backend, self.compute_dtype, args, self.rows, given, edge=edge)
        return tuple(o.copy_(r) if a else r for r, o, a in zip(results, self.out, self.aliased))

    # -- the [R, T] views the kernels and the composed path read ---------------------------
    def view(self, x):
        """Raw ``[R, T]`` view (fused kernels convert on load); None and numbers pass through."""
        return self.rows.rows(x) if isinstance(x, torch.Tensor) else x

    def row_view(self, x):
        return None if x is None else self.rows.per_row(x)

    def float_rows(self, x):
        """``[R, T]`` in the compute dtype for the composed path; numbers pass through."""
        return self.rows.rows(x).to(self.compute_dtype) if isinstance(x, torch.Tensor) else x

    def carry(self, default):
        """The composed path's carry: the chunk's where one is given, else ``default`` ([R])."""
        chunk = self.chunk
        if chunk is None or chunk.carry is None:
            return default
        if chunk.edge is not None:
            chunk.edge[:, -1] = default
        return chunk.carry.to(self.compute_dtype)

    def chunk_arg(self, name: str):
        """A kernel argument the chunk sets (``[R]``, compute dtype), or None."""
        chunk = self.chunk
        x = None if chunk is None or chunk.args is None else chunk.args.get(name)
        return None if x is None else x.to(self.compute_dtype)

    def edge_map(self, y, beta, reverse: bool) -> None:
        """The composed path's edge map (spec.py) from its scan ``y`` and ``beta``, where the
        chunk asks for one: the value at the ending edge and its gain, the scan of ``beta`` alone
        from 1."""
        chunk = self.chunk
        if chunk is None or chunk.edge is None:
            return
        end = 0 if reverse else -1
        ones = torch.ones(self.rows.R, dtype=self.compute_dtype, device=self.rows.device)
        chunk.edge[:, 0] = y[:, end]
        chunk.edge[:, 1] = launch.scan_rows(torch.zeros_like(y), beta, ones, reverse, self.backend)[:, end]

    def float_row(self, x):
        if x is None:
            return torch.zeros(self.rows.R, dtype=self.compute_dtype, device=self.rows.device)
        return self.rows.per_row(x).to(self.compute_dtype)

    def fused_flags(self) -> dict:
        """The kernels' flag group (spec.FLAGS): terminated, done, truncated ([R, T]) and last_done ([R])."""
        return dict(terminated=self.view(self.term), done=self.view(self.done), truncated=self.view(self.trunc),
                    last_done=self.row_view(self.last_done))

    def composed_flags(self):
        """(1 - terminated, 1 - done) as float ``[R, T]`` tensors."""
        if self.last_done is not None:
            done = torch.cat([self.view(self.done)[:, 1:] != 0, self.row_view(self.last_done)[:, None] != 0], 1)
            nd = 1.0 - done.to(self.compute_dtype)
            return nd, nd
        zeros = torch.zeros((), dtype=torch.bool, device=self.rows.device).expand(self.rows.R, self.rows.T)
        term = self.view(self.term) != 0 if self.term is not None else zeros
        if self.done is not None:
            done = self.view(self.done) != 0
        else:
            done = term | (self.view(self.trunc) != 0) if self.trunc is not None else term
        return 1.0 - term.to(self.compute_dtype), 1.0 - done.to(self.compute_dtype)

    def composed_next_values(self, values, next_values, bootstrap_value):
        if next_values is not None:
            return self.float_rows(next_values)
        return torch.cat([self.float_rows(values)[:, 1:], self.float_row(bootstrap_value)[:, None]], 1)


def launch_bound(bound: plans.Bound, recorder):
    """Launch a bound fused call: as a chunk of a split sequence where one is running
    (rl_triton/core/sharded.py), else through the plan ``recorder`` (``plans._Recorder``, the
    signature's first call) builds, else directly. The outputs, one tensor or a tuple."""
    c, algo, args, reduce = bound
    chunk = c.chunk
    if chunk is not None:
        edge = None
        if chunk.edge is not None:
            own = args.get("carry")
            chunk.edge[:, -1] = 0.0 if own is None else own
            edge = torch.empty(c.rows.R, chunk.edge.shape[1] - 1, dtype=torch.float64, device=c.rows.device)
        if chunk.carry is not None:
            args["carry"] = chunk.carry
        args.update(chunk.args or {})
        if chunk.record is not None:
            kernel_args = algo.bind(**args)
            plan = None if not c.plannable or any(c.aliased) else plans.Plan.build(
                chunk.record.values, (), algo, c.backend, c.compute_dtype, kernel_args, c.rows, c.out, c.checks,
                c.numbers)
            chunk.record(algo, kernel_args, plan)
        results = c._launch(algo, algo.bind(**args), edge)
        if edge is not None:
            chunk.edge[:, :-1] = edge
        return results if len(results) > 1 else results[0]
    args = algo.bind(**args)
    if recorder is not None and c.plannable and not any(c.aliased) and not torch.compiler.is_compiling():
        plan = recorder.build(algo, c.backend, c.compute_dtype, args, c.rows, c.out, c.checks, c.numbers, reduce)
        if plan is not None:
            return plan.execute(recorder.values)
    elif recorder is not None and any(c.aliased):
        recorder.final = False  # aliasing belongs to this call, not to the signature
    if reduce is not None:
        return reduce.run(args)
    results = c._launch(algo, args)
    return results if len(results) > 1 else results[0]
