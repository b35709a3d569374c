"""Sequences split along time across the ranks of a ``torch.distributed`` process group
(context parallelism): ``group=`` on every estimator and on ``affine_scan``.

Rank k of the group holds a contiguous chunk of the time axis of every per-step input (the
ranks in rank order make up the whole window; a chunk may be empty) and gets its slice of the
result that the unsharded call gives. A scan's chunk reduces to one affine map per row, so the
ranks exchange maps, never steps (docs/distributed.md):

1. **Boundary inputs** that a chunk's last step reads from the next one (reverse scans): V(s_t1)
   of the implied next-value form, the next episode start of observation-aligned flags, the
   padded mask's next value. Where a call has any, one all-gather of them per row; each chunk
   runs with them as its window-end inputs (``bootstrap_value``, ``last_done``). GAE with implied
   next values hands on ``V + lambda*A`` instead, which needs none (:func:`_handed_lambda`).
2. **The chunk's map.** The local call with carry 0 reports, per row, the value it hands to the
   chunk before it and how that moves with its carry (rl_triton/core/spec.py, edge maps; Triton
   computes only the map, the numba and torch paths the outputs too). The chunk at the end of
   the window runs with its own window end and hands on a fixed value.
3. **One all-gather of the maps** (2 numbers per row, 5 for GAE skipping masked steps), folded
   from the window's end to each chunk: its carry.
4. **The local call again**, from that carry: this rank's outputs.

Forward scans (eligibility traces, running sums, forward ``affine_scan``) mirror this from the
window's start and need no boundary inputs. Every collective moves O(rows) numbers, whatever T
is, and none synchronises with the host. Packed sequences (``cu_seqlens``, global offsets)
exchange one row per rank, the sequence crossing its chunk boundary (:func:`_run_packed`),
after reading the offsets and every rank's token count on the host.

A repeated call without boundary inputs on Triton runs as a :class:`ChunkPlan`: four device
operations, the same exchange.

A :class:`Shards` layout (``group=Shards(pg, pieces)``; Megatron-LM's zig-zag among them) gives a
rank several pieces of the window in any order: each piece is a chunk of its own in steps 1 to 4,
the pieces' numbers go in the same all-gathers (in global piece order once gathered) and each
piece folds the maps beyond it. Such layouts take this general path, not the plan.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import inputs, launch, plans
from .packed import PER_SEQUENCE
from .plans import Chunk
from .whiten import _check_group_type, all_gather_into, check_group, gather_ranks, masked_whiten


class Rule(NamedTuple):
    """How one public function runs sharded: ``reverse`` (None: its ``reverse`` argument);
    ``boundary(kw, first)`` the window-end inputs a chunk takes from the next chunk's first step
    (``first(name)``: that input at the chunk's first step, per row), by argument name;
    ``hands(kw, first, last, a, b)``: the value handed on, where not the scan value at the edge;
    ``own(kw, last)``: the window end's own value of a boundary input that goes to the kernel;
    ``aligned``: flag arguments with fewer dims than the reference that cover its leading dims
    (time included) and broadcast over the trailing ones, as the unsharded call aligns them;
    ``unsplit``: where not None, why the function takes no ``group`` (``NotImplementedError``)."""
    reverse: bool | None
    boundary: object = None
    hands: object = None
    own: object = None
    aligned: tuple = ()  # flags that cover the leading dims, time included (traces' done)
    # where not None, why the function cannot run split across ranks: a call with group= raises
    # NotImplementedError saying so (the rule then serves the packed route alone)
    unsplit: str | None = None


def _gae_boundary(kw, first):
    """GAE and V-trace: V(s_t1) of the implied form (padded mask: 0 where masked), the next
    episode start of observation-aligned flags; GAE skipping masked steps carries V(s_t1) in
    its two-state map instead."""
    out = {}
    mask = kw.get("mask")
    if mask is not None:
        if kw.get("mask_mode", "skip") == "pad":
            out["bootstrap_value"] = torch.where(first("mask") != 0, first("values"), 0.0)
        return out
    if kw.get("next_values") is None:
        out["bootstrap_value"] = first("values")
    return {**out, **_starts_boundary(kw, first)}


def _vtrace_boundary(kw, first):
    """GAE's, and with explicit next values V(s_t1) all the same: vs[t1] = values[t1] + carry
    (a kernel argument, spec.NV_EXPLICIT_EDGE; at the window's end next_values[T-1])."""
    out = _gae_boundary(kw, first)
    if kw.get("next_values") is not None:
        out[KERNEL + "bootstrap_value"] = first("values")
    return out


def _vtrace_own(kw, last):
    return {KERNEL + "bootstrap_value": last("next_values")} if kw.get("next_values") is not None else {}


KERNEL = "kernel:"  # a boundary input that goes to the kernel (plans.Chunk.args), not to the call


def _starts_boundary(kw, first):
    return {"last_done": first("episode_starts")} if kw.get("episode_starts") is not None else {}


def _retrace_hands(kw, first, last, a, b):
    """Retrace's carry is c[t]*(Q_ret[t] - q[t]) at the chunk's first step."""
    ratio = torch.exp(first("log_pi") - first("log_mu")).clamp(max=kw.get("c_bar", 1.0))
    lmbda = kw.get("lmbda", 1.0)
    c = (first("lmbda") if isinstance(lmbda, torch.Tensor) else lmbda) * ratio
    c, q = c.reshape(-1).to(a.dtype), first("q_values").reshape(-1).to(a.dtype)
    return torch.where(c == 0, 0.0, c * (a - q)), torch.where(c == 0, 0.0, c * b)


def _trace_hands(kw, first, last, a, b):
    """A trace hands on (1 - done[T-1]) * e[T-1]: nothing past a done."""
    if kw.get("done") is None:
        return a, b
    cut = last("done").reshape(-1) != 0
    return torch.where(cut, 0.0, a), torch.where(cut, 0.0, b)


# each public function's rule, named in its declaration (rl_triton/core/routes.py)
GAE = Rule(True, _gae_boundary)
VTRACE = Rule(True, _vtrace_boundary, own=_vtrace_own)
TD_LAMBDA_RETURN = Rule(True, _starts_boundary)
DISCOUNTED_RETURN = Rule(True, _starts_boundary)
RETRACE = Rule(True, _starts_boundary, _retrace_hands)
ELIGIBILITY_TRACE = Rule(False, None, _trace_hands, aligned=("done",))
EPISODIC_CUMSUM = Rule(False, None, _trace_hands, aligned=("done",))
AFFINE_SCAN = Rule(None)
# n-step returns: not a scan; the rule serves the packed route, which aligns each sequence to the end
# of its row so that no window reads padding
NSTEP_RETURN = Rule(True, unsplit="a window reads up to n - 1 steps past its chunk's end, which the sharded "
                    "route does not exchange (docs/distributed.md); gather the sequence's steps on one rank and "
                    "call it there")


def run(fn, kw: dict, rule: Rule):
    """``fn`` (a public function, sharded by ``rule``) on this rank's chunk: ``kw`` its
    arguments by name, with ``group`` (a ProcessGroup, or a :class:`Shards` layout)."""
    kw = dict(kw)
    group = kw.pop("group")
    layout = None
    if isinstance(group, Shards):
        layout, group = (None if group.contiguous else group), group.group
    packed = kw.get("cu_seqlens") is not None or kw.get("max_seqlen") is not None
    if packed and layout is not None:
        raise ValueError("group: a Shards layout of several pieces per rank does not take cu_seqlens; pass one "
                         "contiguous slice of the packed stream per rank (a plain ProcessGroup)")
    key = None if packed else _plan_key(fn, kw, group, layout)
    plan = _PLANS.get(key) if key is not None and not launch.plan_forced() else None
    if plan is not None and plan is not _NO_PLAN:
        # the signature's first call checked the group and the inputs (no gradients wanted)
        result = plan.execute(kw, group)
        if result is not None:
            return _whitened(result, kw, kw.get("whiten", False), group)
    check_group(group, *kw.values(), what="the carries of other ranks", name="the inputs")
    whiten = kw.get("whiten", False)
    if packed:
        return _run_packed(fn, kw, rule, group)
    if whiten is not False:
        kw["whiten"] = False
    out = kw.pop("out", None)
    ref = kw[next(iter(kw))]
    tdim = kw.get("time_dim", -1)
    if not isinstance(ref, torch.Tensor) or ref.ndim == 0 or isinstance(tdim, bool) or not isinstance(tdim, int) \
            or not -ref.ndim <= tdim < ref.ndim:
        return fn(**kw, out=out)  # the function's own checks name the problem
    tdim %= ref.ndim
    reverse = rule.reverse if rule.reverse is not None else kw.get("reverse", True)
    steps = ref.shape[tdim]
    rows_shape = ref.shape[:tdim] + ref.shape[tdim + 1:]
    n_rows = rows_shape.numel()
    cd = torch.float64 if ref.dtype == torch.float64 else torch.float32
    device = ref.device
    two_state = rule is GAE and kw.get("mask") is not None and kw.get("mask_mode", "skip") == "skip"
    at = _stepper(kw, rule, ref, tdim, cd)

    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine_pieces = layout.pieces[rank] if layout is not None else (rank,)
    if steps % len(mine_pieces):
        raise ValueError(f"group: this rank holds {len(mine_pieces)} pieces of equal length, but its chunk has "
                         f"{steps} steps along time_dim, not a multiple of {len(mine_pieces)}")
    lam = _handed_lambda(rule, kw)
    # every argument is checked before the first collective, on every rank, so that a rank
    # that raises leaves none waiting: a chunk without steps by its own empty call, one that
    # exchanges boundary inputs by a checking pass (the others' first pass checks them)
    if not steps or not n_rows:
        empty = fn(**kw, out=out)
        if not n_rows:  # no rows on any rank (every rank holds the same rows): nothing to exchange
            return _whitened(empty, kw, whiten, group)
    elif rule.boundary is not None and reverse and lam is None:
        try:
            _one_call(fn, {**kw, "out": out}, Chunk(None, None, check=True))
        except plans.Checked:
            pass
    if key is not None and steps and (plan is None or launch.plan_forced()):
        plan = ChunkPlan.build(fn, kw, out, rule, reverse, lam, two_state, at, group, world, rank, device, layout,
                               tdim)
        if not launch.plan_forced():
            while len(_PLANS) >= MAX_PLANS:
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan
        if plan is not _NO_PLAN:
            result = plan.execute({**kw, "out": out}, group)
            if result is not None:
                return _whitened(result, kw, whiten, group)
    # each piece of this rank is a chunk of its own (one piece: the rank's chunk as it stands)
    length = steps // len(mine_pieces)
    if len(mine_pieces) == 1:
        pieces = [_Piece(kw, ref, at, out)]
    else:
        pieces = []
        for i in range(len(mine_pieces)):
            part = _narrowed(kw, rule, ref, tdim, i * length, length)
            piece_ref = part[next(iter(part))]
            pieces.append(_Piece(part, piece_ref, _stepper(part, rule, piece_ref, tdim, cd),
                                 None if out is None else _narrowed_out(out, tdim, i * length, length)))
    exchange = _Exchange(group, layout, world)
    for p in pieces:
        p.local_kw = dict(p.kw)
        if lam is not None:  # GAE hands on V + lambda*A (_handed_lambda): no boundary inputs
            p.local_kw["bootstrap_value"] = None
    # 1. boundary inputs: every piece's first step, and whether it has one
    firsts = [rule.boundary(p.kw, p.at(0)) for p in pieces] if rule.boundary is not None and reverse \
        and lam is None else [{}]
    if firsts[0]:
        names = list(firsts[0])
        gathered = exchange.gather([_flagged(torch.stack([f[n].to(cd).reshape(-1) for n in names]), cd, length > 0)
                                    for f in firsts])
        for p, index in zip(pieces, mine_pieces):
            own = {**p.kw, **(rule.own(p.kw, p.at(-1)) if rule.own is not None else {})}
            p.local_kw.update(_boundary_for(gathered, index, names, rows_shape, own))
    # 2. each piece's map from carry 0, and the carry of the window's own end (the map's columns,
    # then that carry; two-state: then the window end's own first state, the bootstrap value)
    width = 5 if two_state else 2
    for p in pieces:
        p.kernel_args = {name[len(KERNEL):]: p.local_kw.pop(name).reshape(-1) for name in list(p.local_kw)
                         if name.startswith(KERNEL)}
        p.edge = edge = torch.zeros(n_rows, width + 1 + two_state, dtype=torch.float64, device=device)
        p.result = None
        if length:
            zero = torch.zeros(n_rows, dtype=cd, device=device)
            first_kw = {**p.local_kw, "bootstrap_value": zero.reshape(rows_shape)} if two_state else p.local_kw
            p.result = _one_call(fn, first_kw, Chunk(zero, edge[:, :width + 1], p.kernel_args))
            if rule.hands is not None:
                edge[:, 0], edge[:, 1] = rule.hands(p.kw, p.at(0), p.at(-1), edge[:, 0], edge[:, 1])
            if lam is not None:
                edge[:, 0] = p.at(0)("values").reshape(-1).to(edge.dtype) + lam * edge[:, 0]
        if lam is not None:
            edge[:, 2] = _own(kw.get("bootstrap_value"), rows_shape, edge[None, :, 2])
        if two_state and kw.get("bootstrap_value") is not None:
            edge[:, -1] = kw["bootstrap_value"].expand(rows_shape).reshape(-1)
    # 3. one all-gather of the maps (with whether each chunk has steps), folded to each piece;
    # the last nonempty chunk in scan order starts from the window's own carry
    gathered = exchange.gather([_flagged(p.edge, cd, length > 0) for p in pieces])
    present = gathered[:, -1] != 0
    maps = gathered[:, :-1].view(gathered.shape[0], n_rows, width + 1 + two_state)
    count = present.long()
    later = (count.flip(0).cumsum(0).flip(0) if reverse else count.cumsum(0)) - count > 0
    backend = launch.resolve_backend(kw.get("backend"), device)
    if not steps:
        return _whitened(empty, kw, whiten, group)  # the function's own empty outputs
    # 4. each piece's outputs from its carry
    for p, index in zip(pieces, mine_pieces):
        carry = _fold(maps, present, present & ~later, index, reverse, backend)
        if two_state:
            p.local_kw["bootstrap_value"] = carry[0].reshape(rows_shape).to(ref.dtype)
            carry = carry[1]
        if lam is not None:
            carry = carry / lam
        p.result = _second_pass(fn, p.local_kw, p.result, p.out, Chunk(carry, None, p.kernel_args), tdim, reverse,
                                two_state, p.ref, backend)
    if len(pieces) == 1:
        result = pieces[0].result
    elif out is not None:
        result = out if isinstance(out, torch.Tensor) else tuple(out)
    else:
        parts = [p.result if isinstance(p.result, tuple) else (p.result,) for p in pieces]
        result = tuple(torch.cat(each, tdim) for each in zip(*parts))
        result = result if len(result) > 1 else result[0]
    return _whitened(result, kw, whiten, group)


class Shards:
    """How a window's time axis is laid out over the ranks of ``group``: the window is cut into
    ``n`` pieces of equal length, numbered 0 to n-1 in time order, and rank k holds the pieces
    ``pieces[k]`` (global piece indices), concatenated along time in that order. Pass it as
    ``group=`` to any estimator or ``affine_scan``: each rank passes its pieces and gets the same
    steps of the result of the call on the whole window (docs/semantics.md, section 17).

    ``Shards(group, [[0], [1], ..., [W-1]])`` is the plain ``group=group`` (one contiguous chunk
    per rank in rank order; those chunks may have any lengths). :meth:`zigzag` is Megatron-LM's
    context-parallel layout. Every rank must pass the same layout.

    Args:
        group: a ``torch.distributed`` ProcessGroup of W ranks (``TypeError`` otherwise).
        pieces: W sequences of ints, ``pieces[k]`` the pieces rank k holds in its local order
            (one at least); together they hold each of ``0..n-1`` exactly once (``ValueError``).
            A rank's chunk length along ``time_dim`` must be a multiple of its number of pieces
            (``ValueError`` on that rank before any collective); the pieces of a rank have equal
            lengths, and ranks may differ.
    """

    def __init__(self, group, pieces):
        import torch.distributed as dist

        _check_group_type(group)
        world = dist.get_world_size(group)
        if isinstance(pieces, (str, bytes, torch.Tensor)) or not hasattr(pieces, "__len__"):
            raise TypeError(f"pieces must be a list of {world} lists of piece indices, got {type(pieces).__name__}")
        if len(pieces) != world:
            raise ValueError(f"pieces must list the pieces of each of the group's {world} ranks, got {len(pieces)}")
        rows = []
        for k, held in enumerate(pieces):
            if isinstance(held, (str, bytes, torch.Tensor)) or not hasattr(held, "__iter__") \
                    or any(isinstance(i, bool) or not isinstance(i, int) for i in held):
                raise TypeError(f"pieces[{k}] must be a list of int piece indices, got {held!r}")
            if not len(held):
                raise ValueError(f"pieces[{k}] is empty: every rank holds one piece at least")
            rows.append(tuple(held))
        held = sorted(i for row in rows for i in row)
        if held != list(range(len(held))):
            raise ValueError(f"pieces must hold each piece index 0..{len(held) - 1} exactly once, got {rows}")
        self.group, self.pieces, self.n = group, tuple(rows), len(held)
        self.width = max(len(row) for row in rows)
        slot = {i: k * self.width + j for k, row in enumerate(rows) for j, i in enumerate(row)}
        # where each piece lies in the all-gather of every rank's width pieces (ranks with fewer pad)
        self.slots = [slot[i] for i in range(len(held))] + sorted(set(range(world * self.width)) - set(slot.values()))
        self._slots_on = {}

    @classmethod
    def zigzag(cls, group) -> "Shards":
        """Megatron-LM's context-parallel layout (``get_batch_on_this_cp_rank``): the window cut into
        ``2W`` pieces, rank k holding pieces ``k`` and ``2W - 1 - k`` in that order, so that causal
        attention's work is balanced."""
        import torch.distributed as dist

        _check_group_type(group)
        world = dist.get_world_size(group)
        return cls(group, [(k, 2 * world - 1 - k) for k in range(world)])

    def slots_on(self, device) -> torch.Tensor:
        """``slots`` as an index tensor on ``device``, made once per device."""
        index = self._slots_on.get(device)
        if index is None:
            index = self._slots_on[device] = torch.tensor(self.slots, device=device)
        return index

    @property
    def contiguous(self) -> bool:
        """Whether this is the plain layout: rank k holds piece k alone."""
        return all(row == (k,) for k, row in enumerate(self.pieces))

    def local(self, x: torch.Tensor, rank: int | None = None, time_dim: int = -1) -> torch.Tensor:
        """Rank ``rank``'s pieces (this process's rank by default) of the whole-window tensor ``x``,
        concatenated along ``time_dim`` in the rank's order. ``x``'s length along ``time_dim`` must
        be a multiple of the number of pieces (``ValueError``)."""
        import torch.distributed as dist

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if rank is None:
            rank = dist.get_rank(self.group)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < len(self.pieces):
            raise ValueError(f"rank must be an int in [0, {len(self.pieces)}), got {rank!r}")
        steps = x.shape[time_dim]
        if steps % self.n:
            raise ValueError(f"x has {steps} steps along time_dim, not a multiple of the {self.n} pieces")
        size = steps // self.n
        return torch.cat([x.narrow(time_dim, i * size, size) for i in self.pieces[rank]], time_dim)

    def __repr__(self):
        return f"Shards({self.group!r}, {[list(row) for row in self.pieces]})"


class _Piece:
    """One chunk of this rank's steps: its arguments, reference input, step reader and ``out``."""

    def __init__(self, kw, ref, at, out):
        self.kw, self.ref, self.at, self.out = kw, ref, at, out


class _Exchange:
    """One all-gather of a few numbers per piece, returned in global piece order."""

    def __init__(self, group, layout, world):
        self.group, self.layout = group, layout
        self.width = layout.width if layout is not None else 1
        self.slots = None if layout is None else layout.slots

    def gather(self, parts):
        """``[n_slots, m]``: each piece's ``[m]`` part, the global pieces first in order (then the
        padding of ranks with fewer pieces, flagged absent)."""
        m = parts[0].numel()
        local = torch.cat(parts + [parts[0].new_zeros(m)] * (self.width - len(parts)))
        gathered = gather_ranks(local, self.group).view(-1, m)
        if self.slots is None:
            return gathered
        return gathered.index_select(0, self.layout.slots_on(gathered.device))


def _stepper(kw, rule, ref, tdim, cd):
    """``at(t)(name)``: the argument ``name`` of ``kw`` at step ``t`` of ``ref``'s time axis, per row
    (a Python number as a row of it; zeros where ``ref`` has no steps)."""
    steps = ref.shape[tdim]
    rows_shape = ref.shape[:tdim] + ref.shape[tdim + 1:]

    def at(t):
        def step(name):
            x = kw[name]
            if not isinstance(x, torch.Tensor):
                return torch.full(rows_shape, float(x), dtype=cd, device=ref.device)
            if name in rule.aligned:
                x = inputs.align_leading(x, ref.ndim, tdim)
            return x.expand(ref.shape).select(tdim, t) if steps else torch.zeros(rows_shape, dtype=x.dtype,
                                                                                  device=ref.device)
        return step
    return at


def _narrowed(kw, rule, ref, tdim, start, length):
    """The arguments of steps ``[start, start + length)`` along ``ref``'s time axis: every per-step
    tensor cut there (one that broadcasts along time, a per-row or window-end input as it is).
    Tensors with fewer dims than ``ref`` broadcast from the right as the call aligns them (a
    trace's ``done`` covering the leading dims first padded on the right); more dims (Retrace's
    action dim) trail."""
    steps = ref.shape[tdim]
    cut = {}
    for name, x in kw.items():
        if isinstance(x, torch.Tensor) and name not in PER_SEQUENCE:
            if name in rule.aligned:
                x = inputs.align_leading(x, ref.ndim, tdim)
            dim = tdim - max(0, ref.ndim - x.ndim)
            if dim >= 0 and x.shape[dim] == steps:
                x = x.narrow(dim, start, length)
        cut[name] = x
    return cut


def _narrowed_out(out, tdim, start, length):
    """``out`` (a tensor or a sequence of them, the reference's shape) cut to the same steps."""
    if isinstance(out, torch.Tensor):
        return out.narrow(tdim, start, length)
    return type(out)(o.narrow(tdim, start, length) for o in out)


_PLANS: dict = {}
MAX_PLANS = 64
_NO_PLAN = object()


def _plan_key(fn, kw, group, layout=None):
    """A sharded call's signature (plans.cached's, with the group: a group's world and ranks are
    fixed, and its plan holds it, so that its id stays its own; and a layout's pieces), or None.
    ``whiten`` is applied after the plan's launches and is no part of it."""
    try:
        return (fn, id(group), None if layout is None else layout.pieces, torch.is_grad_enabled(), inputs.env_state(),
                *[(name, plans.fingerprint(x)) for name, x in kw.items() if name != "whiten"])
    except (plans.Unkeyable, RuntimeError):
        return None


class _Recorded(Exception):
    """Raised by a recording chunk call once its plan is taken (nothing launched)."""


class _Record:
    """``Chunk.record``: takes the fused call's plan and stops the call."""

    def __init__(self, values):
        self.values = values
        self.algo = self.args = self.plan = None

    def __call__(self, algo, args, plan):
        self.algo, self.args = algo, args
        self.plan = plan if isinstance(plan, plans.Plan) else None
        raise _Recorded


class ChunkPlan:
    """A repeated sharded call of one signature on Triton: per piece of this rank (one, or a
    layout's several) the engine's phase 1 over the piece and ``hand_kernel`` into the map it
    sends (kernels.ChunkLaunch), one ``all_gather_into_tensor`` of every rank's maps (put in time
    order by one ``index_select`` where a layout gives a rank several pieces), and per piece
    phase 2 folding the maps of the pieces beyond it into its carry and scanning it (the
    protocol of :func:`run`: ``3R + 1`` numbers a piece, ``7R + 1`` for two-state maps). No host
    synchronisation; each piece's tensors are found and checked as by its one-GPU plan
    (plans.Plan), the outputs made fresh (for several pieces, whole outputs whose views the
    pieces write) or the caller's ``out``."""

    @classmethod
    def build(cls, fn, kw, out, rule, reverse, lam, two_state, at, group, world, rank, device, layout=None,
              tdim=-1):
        """The plan of this call's signature, or _NO_PLAN where the call has none: another backend
        than Triton, boundary inputs to exchange, Retrace's handed value, or views the one-GPU
        plan cannot locate. ``layout``: a :class:`Shards` of several pieces a rank (None: one
        contiguous chunk a rank); ``tdim``: the time dim of ``kw``'s first tensor."""
        if launch.resolve_backend(kw.get("backend"), device) != "triton" or rule.hands not in (None, _trace_hands):
            return _NO_PLAN
        if lam is None and rule.boundary is not None and reverse and rule.boundary(kw, at(0)):
            return _NO_PLAN
        own = None
        if lam is not None and not isinstance(kw.get("bootstrap_value"), (torch.Tensor, type(None))):
            return _NO_PLAN
        if lam is not None and kw.get("bootstrap_value") is not None:
            own = kw["bootstrap_value"].reshape(-1)  # the window's V(s_T): the own carry c[T]
        self = cls()
        self.rule, self.tdim = rule, tdim
        self.count = 1 if layout is None else len(layout.pieces[rank])
        self.slots = None if layout is None else layout.slots_on(device)
        self.fresh = None  # several pieces without out=: the dtypes of the whole outputs made per call

        def record(pieces):
            recorded = []
            for values in pieces:
                rec = _Record(values)
                try:
                    _one_call(fn, {**values, "bootstrap_value": None} if lam is not None else values,
                              Chunk(own, None, None, rec))
                except _Recorded:
                    pass
                if rec.plan is None:
                    return None
                recorded.append(rec)
            return recorded

        pieces = self._pieces({**kw, "out": out})
        recorded = record(pieces[:1] if self.count > 1 and out is None else pieces)
        if recorded is None:
            return _NO_PLAN
        if self.count > 1 and out is None:
            # the pieces write into views of whole outputs made as the plan would make them, so
            # that no concatenation follows
            makes = [make for make, *_ in recorded[0].plan.outputs]
            if any(make is None or make.func is not plans._new_output for make in makes):
                return _NO_PLAN
            self.fresh = (recorded[0].plan.single, [make.args[2] for make in makes])
            recorded = record(self._pieces({**kw, "out": self._outputs(kw)}))
            if recorded is None:
                return _NO_PLAN
        algo, args = recorded[0].algo, recorded[0].args
        hand = {}
        if isinstance(args.carry, torch.Tensor):
            hand["own"] = algo.names.index("carry")
        if two_state and isinstance(args.bootstrap_value, torch.Tensor):
            hand["own_x"] = algo.names.index("bootstrap_value")  # the first state's own carry
        scale = divisor = None
        if lam is not None:
            hand["offset"] = algo.names.index("values")
            scale = torch.tensor([lam], dtype=torch.float64, device=device)
            divisor = torch.tensor([lam], dtype=recorded[0].plan.launch.ws_dtype, device=device)
        if rule.hands is _trace_hands and isinstance(args.done, torch.Tensor):
            hand["cut"] = algo.names.index("done")
        if any(not isinstance(r.args[pos], torch.Tensor) for r in recorded for pos in hand.values()):
            return _NO_PLAN
        from . import kernels

        self.group = group  # kept alive: the key holds its id
        self.plans = [r.plan for r in recorded]
        compute = torch.float64 if self.plans[0].launch.ws_dtype == torch.float64 else torch.float32
        if layout is None:
            self.chunks = [kernels.ChunkLaunch(self.plans[0].launch, world, rank, compute, hand, scale, divisor)]
            self.send, self.gathered = self.chunks[0].send, self.chunks[0].gathered
            return self
        m = kernels.chunk_map_size(self.plans[0].launch)  # numbers a piece sends
        # every rank sends layout.width maps (a rank with fewer pads with zeros: absent pieces)
        self.send = torch.zeros(layout.width * m, dtype=compute, device=device)
        self.gathered = torch.empty(world * layout.width * m, dtype=compute, device=device)
        self.ordered = torch.empty(len(layout.slots) * m, dtype=compute, device=device)
        self.chunks = [kernels.ChunkLaunch(plan.launch, len(layout.slots), index, compute, hand, scale, divisor,
                                           send=self.send[j * m:(j + 1) * m], gathered=self.ordered)
                       for j, (plan, index) in enumerate(zip(self.plans, layout.pieces[rank]))]
        return self

    def _pieces(self, values):
        """The arguments by name (``out`` among them) of each of this rank's pieces of a call
        whose arguments are ``values`` (one piece: ``values`` itself)."""
        if self.count == 1:
            return [values]
        kw = {name: x for name, x in values.items() if name != "out"}
        out, ref = values["out"], kw[next(iter(kw))]
        length = ref.shape[self.tdim] // self.count
        return [{**_narrowed(kw, self.rule, ref, self.tdim, i * length, length),
                 "out": None if out is None else _narrowed_out(out, self.tdim, i * length, length)}
                for i in range(self.count)]

    def _outputs(self, values):
        """The whole outputs of a call of several pieces without ``out=`` (``self.fresh``): the
        reference input's layout (``values``' first argument), the plan's dtypes."""
        single, dtypes = self.fresh
        ref = values[next(iter(values))]
        made = [torch.empty_like(ref, dtype=dtype) for dtype in dtypes]
        return made[0] if single else tuple(made)

    def execute(self, values, group):
        """This call's outputs (``values``: its arguments by name, ``out`` among them), or None
        where it needs the general path."""
        if values.get("out") is None and self.fresh is not None:
            values = {**values, "out": self._outputs(values)}
        prepared = []
        for plan, piece in zip(self.plans, self._pieces(values)):
            ready = plan.prepare(piece)
            if ready is None:
                return None
            prepared.append(ready)
        launches = []
        for plan, chunk, (sources, outs, views) in zip(self.plans, self.chunks, prepared):
            ptrs = plan.data_pointers(sources, outs) if plan.pointers else None
            tensors = None
            if ptrs is None or not chunk.ready(ptrs):
                args, out_views = plan.kernel_views(sources, outs, views)
                tensors = plan.launch._tensors(args, out_views)
            chunk.reduce(ptrs, tensors)
            launches.append((ptrs, tensors))
        all_gather_into(self.gathered, self.send, group)
        if self.slots is not None:  # the pieces' maps in time order
            torch.index_select(self.gathered.view(len(self.slots), -1), 0, self.slots,
                               out=self.ordered.view(len(self.slots), -1))
        for chunk, (ptrs, tensors) in zip(self.chunks, launches):
            chunk.scan(ptrs, tensors)
        if len(prepared) == 1:
            outs = prepared[0][1]
            return outs[0] if len(outs) == 1 else tuple(outs)
        out = values["out"]
        return out if isinstance(out, torch.Tensor) else tuple(out)


TAIL_STEPS = 1024  # the CPU's second pass first tries max(TAIL_STEPS, T/TAIL_FRACTION) steps
TAIL_FRACTION = 16
TAIL_GROWTH = 4  # then tails this many times longer, while shorter than the chunk
# a tail's gain below the smallest normal float64 counts as 0: a subnormal product of betas above
# 1/2 rounds back to itself and never reaches 0, and the carry's share it leaves out is below
# 2.3e-308 times the carry
SMALLEST_GAIN = float(torch.finfo(torch.float64).tiny)


def _second_pass(fn, kw, first, out, chunk, tdim, reverse, two_state, ref, backend):
    """The chunk's outputs from its carry (``chunk``), into ``out`` or the first pass's outputs
    ``first`` (fresh memory). Where the first pass wrote its outputs (numba and torch, CPU
    tensors), only the steps that the carry reaches are run again: the tail that ends where the
    scan starts (its last ``L`` steps for reverse scans, first for forward), when its map's gain
    from the carry is 0 on every row (a zero coefficient, a done, lies in it, or the product of
    coefficients falls below the smallest normal float64, ``SMALLEST_GAIN``); then the outputs
    before it are the first pass's as they stand.
    ``L`` is ``max(TAIL_STEPS, T/TAIL_FRACTION)``, then ``TAIL_GROWTH`` times longer while the
    gain is not 0 and ``L`` is shorter than the chunk (at most 1.33 chunks run in tails).
    Otherwise, and on Triton (whose first pass computes the map alone), the whole chunk again.
    The tail runs into ``first`` and is copied into ``out`` after it: ``out`` may alias the
    inputs, which the tail still reads (the whole chunk's call handles aliasing itself)."""
    steps = ref.shape[tdim]
    tail = max(TAIL_STEPS, steps // TAIL_FRACTION)
    fresh = first if isinstance(first, tuple) else (first,)
    cuttable = backend != "triton" and ref.device.type == "cpu" and all(
        not isinstance(x, torch.Tensor) or name in PER_SEQUENCE or x.ndim == ref.ndim for name, x in kw.items())
    while cuttable and tail < steps:
        lo = steps - tail if reverse else 0

        def cut(name, x):
            if isinstance(x, torch.Tensor) and name not in PER_SEQUENCE and x.shape[tdim] == steps:
                return x.narrow(tdim, lo, tail)
            return x
        width = 5 if two_state else 2
        edge = torch.zeros(fresh[0].numel() // steps, width + 1, dtype=torch.float64)
        views = tuple(o.narrow(tdim, lo, tail) for o in fresh)
        _one_call(fn, {**{k: cut(k, x) for k, x in kw.items()}, "out": views if len(views) > 1 else views[0]},
                  chunk._replace(edge=edge))
        gains = edge[:, [1, 3, 4]] if two_state else edge[:, 1]
        if not (~(gains.abs() < SMALLEST_GAIN)).any():  # a NaN gain counts as one
            if out is None:
                return first
            given = out if isinstance(out, (tuple, list)) else (out,)
            outs = tuple(o.copy_(f) for o, f in zip(given, fresh))
            return outs if len(outs) > 1 else outs[0]
        tail *= TAIL_GROWTH
    return _one_call(fn, {**kw, "out": first if out is None else out}, chunk)


def _handed_lambda(rule, kw):
    """GAE with implied next values and a number lambda != 0 hands on ``V + lambda*A`` of its
    first step (c[t] = V[t] + lambda*A[t] follows c[t] = (1-lambda)*V[t] + lambda*r[t] +
    lambda*gamma*(1-done[t])*c[t+1] and reads no V(s_t1): A[T-1] = r - V + gamma*(1-done)*c[T],
    so a chunk runs with no bootstrap value and carry c/lambda, and needs no boundary input).
    Returns that lambda, or None where the call exchanges boundary inputs instead."""
    lmbda = kw.get("lmbda", 0.95)
    if rule is not GAE or kw.get("mask") is not None or kw.get("mask_mode", "skip") != "skip" \
            or kw.get("next_values") is not None or kw.get("episode_starts") is not None \
            or type(lmbda) not in (float, int) or not math.isfinite(lmbda) or abs(lmbda) < MIN_HANDED_LAMBDA:
        return None
    return float(lmbda)


MIN_HANDED_LAMBDA = 2.0 ** -20  # c/lambda stays far from overflow for |c| < 1e32 in float32


def _flagged(x, cd, *flags):
    """One rank's part of an all-gather: ``x`` flattened, then each flag as 0 or 1."""
    return torch.cat([x.to(cd).reshape(-1), *(torch.full((1,), float(f), dtype=cd, device=x.device) for f in flags)])


def _whitened(result, kw, whiten, group):
    """``result`` with its advantages whitened over the mask's tokens (every element without a
    mask) of every rank, where the call asks for ``whiten`` (whose statistics span ``group``
    unless it names another)."""
    if whiten is not False:
        options = {} if whiten is True else dict(whiten)
        options.setdefault("group", group)
        mask = kw.get("mask")
        masked_whiten(result[0], None if mask is None else mask.expand(result[0].shape), out=result[0], **options)
    return result


def _one_call(fn, kw, chunk):
    """``fn(**kw)`` run as the chunk ``chunk`` (plans.Chunk), passed to its body as ``_chunk``."""
    return fn(**kw, _chunk=chunk)


def _run_packed(fn, kw, rule, group):
    """Packed sequences split across ranks: rank k holds tokens ``[o_k, o_k + N_k)`` of the
    stream that the global ``cu_seqlens`` (the same on every rank) cut into sequences. A
    sequence that crosses from one rank to the next is the only thing the ranks exchange for:
    each rank hands on the map of its piece at the side where scans end (the first piece, for
    reverse scans, when its sequence began on an earlier rank), folded as in :func:`run`, and
    runs its piece at the other side from the carry received. Its sequences' pieces run as one
    packed call; the two crossing pieces again alone, for their maps and their carried outputs.
    Reads ``cu_seqlens`` and every rank's token count on the host (one synchronisation on CUDA)."""
    import torch.distributed as dist

    cu, out = kw.pop("cu_seqlens"), kw.pop("out", None)
    kw.pop("max_seqlen")  # each call below sizes its own padding
    whiten = kw.get("whiten", False)
    if whiten is not False:
        kw["whiten"] = False
    ref_name = next(iter(kw))
    ref = kw[ref_name]
    if not isinstance(ref, torch.Tensor) or ref.ndim != 1 or kw.get("time_dim", -1) not in (-1, 0):
        raise ValueError(f"with group= and cu_seqlens, {ref_name} must be a 1-D packed stream of this rank's tokens "
                         "(time_dim left at -1)")
    reverse = rule.reverse if rule.reverse is not None else kw.get("reverse", True)
    device, n_local = ref.device, ref.shape[0]
    cd = torch.float64 if ref.dtype == torch.float64 else torch.float32
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    sizes = gather_ranks(torch.tensor([n_local], dtype=torch.int64, device=device), group).view(-1).tolist()
    start, total = sum(sizes[:rank]), sum(sizes)
    offsets = cu.tolist() if isinstance(cu, torch.Tensor) else list(cu)
    if not offsets or offsets[0] != 0 or offsets[-1] != total or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to the tokens of every rank ({total}) without falling")
    pieces = [(b, max(s, start) - start, min(e, start + n_local) - start)
              for b, (s, e) in enumerate(zip(offsets, offsets[1:])) if min(e, start + n_local) > max(s, start)]
    continues_left = bool(pieces) and offsets[pieces[0][0]] < start
    continues_right = bool(pieces) and offsets[pieces[-1][0] + 1] > start + n_local
    exit_, entry = (0 if continues_left else None, len(pieces) - 1 if continues_right else None) if reverse else \
        (len(pieces) - 1 if continues_right else None, 0 if continues_left else None)
    per_step = {k for k, x in kw.items() if isinstance(x, torch.Tensor) and x.ndim >= 1 and x.shape[0] == n_local
                and k not in PER_SEQUENCE}

    def piece(i, **inputs):
        """The arguments of piece i alone, one packed sequence."""
        b, lo, hi = pieces[i]
        one = {k: (x[lo:hi] if k in per_step else x[b:b + 1] if k in PER_SEQUENCE and isinstance(x, torch.Tensor)
                   else x) for k, x in kw.items()}
        one.update(inputs)
        return {**one, "cu_seqlens": torch.tensor([0, hi - lo], dtype=torch.int64, device=device),
                "max_seqlen": hi - lo}

    def first(name):
        x = kw[name]
        return x[0] if isinstance(x, torch.Tensor) and n_local else torch.zeros((), dtype=cd, device=device)

    # 1. the entry piece's window-end inputs: the next nonempty rank's first token
    boundary, kernel_args = {}, {}
    mine = rule.boundary(kw, first) if rule.boundary is not None and reverse else {}
    if mine:
        names = list(mine)
        local = _flagged(torch.stack([mine[n].to(cd).reshape(-1) for n in names]), cd, n_local > 0)
        found = _boundary_for(gather_ranks(local, group), rank, names, (), {**kw, **{n: None for n in names}})
        boundary = {n: v.reshape(1) for n, v in found.items() if not n.startswith(KERNEL)}
        kernel_args = {n[len(KERNEL):]: v.reshape(1) for n, v in found.items() if n.startswith(KERNEL)}
    two_state = rule is GAE and kw.get("mask") is not None and kw.get("mask_mode", "skip") == "skip"
    width = 5 if two_state else 2
    # 2. the map this rank hands on: its exit piece's, from carry 0, laid out as in run(); where
    # that piece's sequence ends here, the fold applies it to its own window end's carries
    edge = torch.zeros(1, width + 1 + two_state, dtype=torch.float64, device=device)
    crosses = exit_ is not None and exit_ == entry
    if exit_ is not None:
        inputs = boundary if crosses else {}
        zero = torch.zeros(1, dtype=cd, device=device)
        if two_state:
            inputs = {**inputs, "bootstrap_value": zero}
        _one_call(fn, piece(exit_, **inputs), Chunk(zero, edge[:, :width + 1], kernel_args if crosses else None))
        if rule.hands is not None:
            b, lo, hi = pieces[exit_]
            edge[:, 0], edge[:, 1] = rule.hands(kw, lambda n: kw[n][lo:lo + 1] if isinstance(kw[n], torch.Tensor)
                                                else kw[n], lambda n: kw[n][hi - 1:hi], edge[:, 0], edge[:, 1])
        boot = kw.get("bootstrap_value")
        if two_state and not crosses and boot is not None:
            edge[:, -1] = boot[pieces[exit_][0]].to(edge.dtype)
    # 3. one all-gather of the maps (with whether a rank hands one on, and whether its sequence
    # ends there), folded to the entry piece
    gathered = gather_ranks(_flagged(edge, cd, exit_ is not None, exit_ is not None and not crosses), group)
    present, ends = gathered[:, -2] != 0, gathered[:, -1] != 0
    carry = _fold(gathered[:, :-2].view(world, 1, edge.shape[1]), present, ends, rank, reverse,
                  launch.resolve_backend(kw.get("backend"), device))
    # 4. the pieces' outputs: one packed call, and the entry piece again from its carry
    if pieces:
        ids = torch.tensor([p[0] for p in pieces], device=device)
        result = fn(**{k: (x[ids] if k in PER_SEQUENCE and isinstance(x, torch.Tensor) else x)
                       for k, x in kw.items()},
                    cu_seqlens=torch.tensor([0] + [p[2] for p in pieces], dtype=torch.int64, device=device),
                    max_seqlen=max(p[2] - p[1] for p in pieces), out=out)
    else:  # no token here: the function's own empty outputs
        result = fn(**{k: x for k, x in kw.items() if k not in PER_SEQUENCE}, out=out)
    if entry is not None:
        b, lo, hi = pieces[entry]
        inputs = dict(boundary)
        if two_state:
            inputs["bootstrap_value"] = carry[0].to(ref.dtype)
            carry = carry[1]
        outs = result if isinstance(result, tuple) else (result,)
        one = _one_call(fn, piece(entry, **inputs), Chunk(carry, None, kernel_args))
        for o, y in zip(outs, one if isinstance(one, tuple) else (one,)):
            o[lo:hi] = y
    return _whitened(result, kw, whiten, group)


def _step(a, b, c):
    return torch.where(b == 0, a, a + b * c)


def _fold(maps, present, ends, rank: int, reverse: bool, backend: str):
    """This chunk's carry from every chunk's map (``[world, R, k + 1]``: the map, then the carry
    of the window's own end; two-state maps then the window end's own first state): the maps of
    the chunks beyond this one in scan order, folded from 0. A chunk where ``ends`` starts from
    its own window end's carry (its map becomes a constant); one not ``present`` passes the carry
    on. Where no present chunk lies beyond, this chunk's own window end's carry. Two-state maps
    give (bootstrap, carry)."""
    world = maps.shape[0]
    order = torch.arange(world, device=maps.device)
    beyond = (order > rank) if reverse else (order < rank)
    fed = (present & beyond).any()
    ends, keep = ends[:, None], present[:, None]
    if maps.shape[-1] == 3:
        a, b, own = maps.unbind(-1)
        a = torch.where(keep, torch.where(ends, _step(a, b, own), a), 0.0)
        b = torch.where(keep, torch.where(ends, 0.0, b), 1.0)
        return torch.where(fed, _received(a, b, reverse, backend)[rank], own[rank])
    a1, b1, a2, b2, c, own_y, own_x = maps.unbind(-1)
    cross = torch.where(c == 0, 0.0, c * own_x)
    a1 = torch.where(keep, torch.where(ends, _step(a1, b1, own_x), a1), 0.0)
    a2 = torch.where(keep, torch.where(ends, _step(a2, b2, own_y) + cross, a2), 0.0)
    b1 = torch.where(keep, torch.where(ends, 0.0, b1), 1.0)
    b2 = torch.where(keep, torch.where(ends, 0.0, b2), 1.0)
    c = torch.where(keep & ~ends, c, 0.0)
    x = _received(a1, b1, reverse, backend)  # the first state each chunk receives
    y = _received(a2 + torch.where(c == 0, 0.0, c * x), b2, reverse, backend)[rank]
    return torch.where(fed, x[rank], own_x[rank]), torch.where(fed, y, own_y[rank])


def _received(a, b, reverse: bool, backend: str):
    """``[world, R]``: the carry each chunk receives, the maps beyond it folded from 0."""
    zero = torch.zeros(a.shape[1], dtype=a.dtype, device=a.device)
    y = launch.scan_rows(a.t(), b.t(), zero, reverse, backend)
    return (torch.cat([y[:, 1:], zero[:, None]], 1) if reverse else torch.cat([zero[:, None], y[:, :-1]], 1)).t()


def _boundary_for(gathered, rank, names, rows_shape, kw):
    """The window-end inputs of this rank's chunk: the first step of the nearest nonempty chunk
    after it, or the caller's own where none follows (found without reading a flag on the host)."""
    world = gathered.shape[0]
    order = torch.arange(world, device=gathered.device)
    after = (gathered[:, -1] != 0) & (order > rank)
    nearest = torch.where(after, order, world).min()
    theirs = gathered[:, :-1].index_select(0, nearest.clamp(max=world - 1).view(1)).view(len(names), -1)
    own = torch.stack([_own(kw.get(name), rows_shape, theirs) for name in names])
    value = torch.where(nearest < world, theirs, own)
    out = {}
    for i, name in enumerate(names):
        source = name[len(KERNEL):] if name.startswith(KERNEL) else name
        like = kw.get(name) if isinstance(kw.get(name), torch.Tensor) else kw[_source(source)]
        v = value[i].view(rows_shape)
        out[name] = v.to(like.dtype) if like.dtype.is_floating_point else v != 0
    return out


def _own(x, rows_shape, like):
    """A caller's window-end input as a flat row of ``like``'s dtype (None: 0)."""
    if x is None:
        return torch.zeros_like(like[0])
    if not isinstance(x, torch.Tensor):
        return torch.full_like(like[0], float(x))
    return x.expand(rows_shape).reshape(-1).to(like.dtype)


def _source(name: str) -> str:
    return {"bootstrap_value": "values", "last_done": "episode_starts"}[name]
