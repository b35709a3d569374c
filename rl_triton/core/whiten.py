"""Masked whitening: the advantage normalisation of LLM RL trainers (verl, OpenRLHF), over the
valid elements of one tensor or of every rank of a ``torch.distributed`` process group.

Every path forms the statistics ``(n, mean, M2)`` in float64 and the output ``(x - mean) * rstd``
in float64, then rounded to ``x``'s dtype (float32 only on MPS, which has no float64), so the
backends and layouts differ only in the order of float64 sums. Torch ops on any device (two
reductions for the statistics, one elementwise pass for the output, and with a group one
collective in between); on the Triton backend two launches (partials, then their fold and the
output in one; rl_triton/core/kernels/moments.py), the first of them a scan's own launch where
``gae(whiten=...)`` reduces its advantages as it writes them (:func:`scan_whitened`); on the
numba backend the statistics are one kernel
(rl_triton/core/cpu.py, ``masked_moments``) and the output another (``whiten_apply``), or
both one (``whiten_all``) without a mask. No host synchronisation anywhere (no
``.item()``, no branch on a tensor value), so an empty or one-element selection gives NaN
instead of an exception. Semantics: docs/semantics.md.
"""

from __future__ import annotations

import functools
import math
from numbers import Real

import numpy as np
import torch

from . import cpu, inputs, launch
from .docstrings import documented

EPS_MODES = ("add", "clamp", "std")


_X = "a float16, bfloat16, float32 or float64 tensor of any shape."
_MASK = ("``x``'s shape exactly (no broadcasting) and device: bool, integer or float, nonzero marks a valid "
         "element (not a weight). None: every element is valid.")
_GROUP = ("a ``torch.distributed`` ProcessGroup (e.g. ``dist.group.WORLD``): each rank passes its own shard and "
          "every rank gets the statistics of the valid elements of all ranks, from one all-gather. None: this "
          "process alone. No autograd.")


@documented(x=_X, mask=_MASK, group=_GROUP)
def masked_moments(x, mask=None, *, group=None):
    """The statistics that :func:`masked_whiten` normalises with: ``(count, mean, m2)``.

    Over the valid elements of ``x`` (``mask`` nonzero; every element when ``mask`` is None),
    on this process or, with ``group``, on every rank of that process group:

        count = n = number of valid elements
        mean      = sum(x[valid]) / n
        m2        = sum((x[valid] - mean)**2)

    Three 0-d tensors on ``x``'s device: ``count`` int64, ``mean`` and ``m2`` float64 whatever
    ``x``'s dtype (float32 on MPS, which has no float64): the sums run in float64, so float32
    data of order 1e20, whose squared deviations overflow float32, keep a finite ``m2``.
    ``n = 0`` gives ``mean = NaN`` (0/0) and ``m2 = 0``; nothing raises. Values at positions
    outside the mask are never read into the sums, NaN included.
    ``group`` is a ``torch.distributed`` ProcessGroup (e.g. ``dist.group.WORLD``) or None for
    this process alone; each rank passes its own shard, and all ranks get the same statistics
    from one collective (an all-gather of each rank's ``(n, mean, m2)``, combined by Chan et
    al.'s parallel formula in float64).
    """
    x, mask, group = _check_x_mask_group(x, mask, group)
    n, mean, m2 = _local_moments(x, mask)
    if group is None:
        return n, mean, m2
    n, mean, m2 = _combine(n, mean, m2, group)
    return n.to(torch.int64), mean, m2


# masked_whiten's options beside x, mask, out and backend (``gae(whiten=dict(...))`` takes them)
WHITEN_OPTIONS = ("unbiased", "shift_mean", "scale", "eps", "eps_mode", "group")


def check_whiten_options(unbiased=True, shift_mean=True, scale=True, eps=1e-8, eps_mode="add",
                         group=None) -> float:
    """Raise ``TypeError``/``ValueError`` for a bad option of :func:`masked_whiten` (its group's
    membership and gradients are checked against ``x`` there); ``eps`` as a float."""
    if group is not None:
        _check_group_type(group)
    for name, flag in (("unbiased", unbiased), ("shift_mean", shift_mean), ("scale", scale)):
        if type(flag) is not bool:
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    eps = float(eps)
    if math.isnan(eps) or eps < 0:
        raise ValueError(f"eps must be a number >= 0, got {eps}")
    if not isinstance(eps_mode, str) or eps_mode not in EPS_MODES:
        raise ValueError(f"eps_mode must be one of {EPS_MODES}, got {eps_mode!r}")
    return eps


@documented(
    x=_X + " The result has its shape and dtype.",
    mask=_MASK,
    unbiased="a bool: the variance divides ``M2`` by ``n - 1`` (True) or by ``n``.",
    shift_mean="a bool: False adds the mean back to the whitened values.",
    scale="a bool: False leaves the scale alone (``rstd = 1``): centring only.",
    eps="a Python number >= 0, applied to the variance or the standard deviation as ``eps_mode`` says.",
    eps_mode="``\"add\"``, ``\"clamp\"`` or ``\"std\"`` (formulas above).",
    group=_GROUP,
    out=("a tensor of ``x``'s shape, dtype and device that the result is written to and returned in; it may be "
         "``x`` itself. None: a new tensor. Not where ``x`` requires grad (ValueError)."),
)
def masked_whiten(x, mask=None, *, unbiased=True, shift_mean=True, scale=True, eps=1e-8, eps_mode="add",
                  group=None, out=None, backend=None) -> torch.Tensor:
    """Whiten ``x`` with the mean and variance of its valid elements.

    Statistics over the valid elements (``mask`` nonzero; all elements when ``mask`` is None) of the
    whole tensor, any shape, and with ``group`` over the valid elements of every rank (see
    :func:`masked_moments`):

        n = count, mean = sum(x[valid]) / n, M2 = sum((x[valid] - mean)**2)
        var  = M2 / (n - 1)                       if unbiased (default) else M2 / n
        rstd = 1 / sqrt(var + eps)                eps_mode="add"   (verl's masked_whiten)
             = 1 / sqrt(max(var, eps))            eps_mode="clamp" (OpenRLHF's normalisation)
             = 1 / (sqrt(var) + eps)              eps_mode="std"   (x.std() + eps: rsl_rl, skrl, rl_games)
             = 1                                  scale=False      (OpenRLHF's no_std_norm)
        y = (x - mean) * rstd,  then y + mean     if not shift_mean

    ``y`` covers every position, the masked ones included (same ``mean`` and ``rstd``), and has
    ``x``'s shape and dtype. On every backend and layout the statistics accumulate in float64
    (mean first, then the sum of squared deviations) and ``y`` is formed in float64, then
    rounded to ``x``'s dtype as torch rounds float64 (float32 throughout on MPS, which has no
    float64). verl: the defaults. OpenRLHF: ``unbiased=False, eps_mode="clamp"``, plus
    ``scale=False`` for ``--algo.advantage.no_std_norm``. rsl_rl, skrl and rl_games
    (``(x - x.mean()) / (x.std() + 1e-8)`` over the whole batch): ``mask=None, eps_mode="std"``.

    No host synchronisation, hence no error for a degenerate selection: ``n = 0`` makes every
    output NaN (mean = 0/0), and so does ``n = 1`` with ``unbiased=True`` (var = 0/0). A NaN at
    a valid position makes every output NaN; one outside the mask does not touch the statistics.
    ``mask``: bool, integer or float, ``x``'s shape and device; nonzero marks a valid element
    (weights are not applied). ``out``: ``x``'s shape, dtype and device; may be ``x`` itself.
    Differentiable without ``out`` and ``group``. ``backend`` as for the estimators: on the Triton
    backend, without a group or gradients, contiguous tensors take two launches (partials
    ``(n, mean, M2)`` of blocks of elements, then the fold of all partials by every program and
    the normalisation of its blocks); on the numba backend (CPU, no
    gradients) the statistics are one kernel (each row's ``(n, mean, M2)``, folded by Chan et
    al.'s formula) and the normalisation another, and without a mask (``x`` and ``out`` dense in
    one memory order, no group) statistics and output are one kernel; elsewhere torch ops.
    """
    x, mask, group = _check_x_mask_group(x, mask, group)
    eps = check_whiten_options(unbiased, shift_mean, scale, eps, eps_mode)
    grad = torch.is_grad_enabled() and x.requires_grad
    if out is not None:
        _check_out(out, x)
        if grad:
            raise ValueError("out= does not support autograd; call without out= to get gradients")

    backend = launch.resolve_backend(backend, x.device)
    if backend == "triton" and group is None and not grad and not torch.compiler.is_compiling() \
            and x.is_contiguous() and (mask is None or mask.is_contiguous()) and (out is None or out.is_contiguous()):
        y = out if out is not None else torch.empty_like(x)
        _fused(x, mask, y, unbiased, shift_mean, scale, eps, eps_mode)
        return y
    numba = backend == "cpu" and not grad and x.numel()
    y = None
    if numba:
        y = out if out is not None else torch.empty_like(x)
        if not cpu.same_dense_layout(x, y):
            y = None
    if y is not None and mask is None and group is None:
        cpu.whiten_flat(x, y, unbiased, shift_mean, scale, eps, EPS_MODES.index(eps_mode))  # one kernel
        return y
    if numba:
        n, mean, m2 = _row_moments(x, mask)
    else:
        n, mean, m2 = _local_moments(x, mask)
    if group is not None:
        n, mean, m2 = _combine(n, mean, m2, group)
    if y is not None and mean.dtype == torch.float64:
        rstd = _rstd(n, m2, unbiased, scale, eps, eps_mode)
        # the output pass in one kernel; 0-d CPU tensors read as numbers without a synchronisation
        cpu.whiten_apply(x, y, float(mean), 1.0 if rstd is None else float(rstd), shift_mean)
        return y
    return _normalized(x, n, mean, m2, out, grad, unbiased, shift_mean, scale, eps, eps_mode)


def _stats_dtype(device: torch.device) -> torch.dtype:
    """The dtype of the statistics and of the output pass: float64 (float32 on MPS, which has none)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _rstd(n, m2, unbiased, scale, eps, eps_mode):
    """``rstd`` (a 0-d tensor in ``m2``'s dtype) from the statistics; None where not ``scale``."""
    if not scale:
        return None
    var = m2 / (n - 1) if unbiased else m2 / n
    if eps_mode == "std":
        return 1.0 / (var.sqrt() + eps)
    return torch.rsqrt(var + eps if eps_mode == "add" else var.clamp(min=eps))


def _normalized(x, n, mean, m2, out, grad, unbiased, shift_mean, scale, eps, eps_mode):
    """``(x - mean) * rstd`` (and ``+ mean`` where not ``shift_mean``) from the statistics, in
    the statistics' dtype (float64; float32 on MPS), then rounded to ``x``'s dtype, into
    ``out`` (None: fresh memory; may be ``x``)."""
    sd = mean.dtype
    rstd = _rstd(n, m2, unbiased, scale, eps, eps_mode)

    if out is x and x.dtype == sd:
        y = out.sub_(mean)  # whitening in place: the statistics are complete, each element is read once
    else:
        y = x.to(sd) - mean  # fresh memory: the in-place steps below never write to x
    if rstd is not None:
        y = y * rstd if grad else y.mul_(rstd)
    if not shift_mean:
        y = y + mean if grad else y.add_(mean)
    if out is None:
        return y if y.dtype == x.dtype else y.to(x.dtype)
    return y if y is out else out.copy_(y)  # y is complete before out (possibly x) is written


# -- statistics ------------------------------------------------------------------------------
def _row_moments(x: torch.Tensor, mask: torch.Tensor | None):
    """``_local_moments`` by the numba kernel: the elements of ``x`` in row-major order, in rows of
    ``cpu.WHITEN_ROW`` (a shorter last one; in cache for both passes), each row reduced to its
    ``(n, mean, M2)`` in float64, the rows folded by Chan et al.'s formula (n int64, the rest
    float64)."""
    cd = inputs.compute_dtype(x.dtype)  # float16/bfloat16 read as float32 (exact), numba reads no others
    flat = (x if x.dtype == cd else x.to(cd)).reshape(-1)
    valid = None if mask is None else mask.reshape(-1)
    width = min(flat.numel(), cpu.WHITEN_ROW)
    whole = flat.numel() // width * width
    parts = [cpu.row_moments(flat[:whole].view(-1, width), None if valid is None else valid[:whole].view(-1, width))]
    if whole < flat.numel():
        parts.append(cpu.row_moments(flat[whole:].view(1, -1), None if valid is None else valid[whole:].view(1, -1)))
    n, mean, m2 = _chan(*torch.cat(parts).unbind(1))
    return n.to(torch.int64), mean, m2


def _local_moments(x: torch.Tensor, mask: torch.Tensor | None):
    """(n int64, mean, m2) of this process's valid elements, mean and m2 in float64 (float32 on
    MPS); two passes over x."""
    cd = _stats_dtype(x.device)
    xf = x if x.dtype == cd else x.to(cd)
    if mask is None:
        n = torch.full((), x.numel(), dtype=torch.int64, device=x.device)
        mean = xf.sum() / n
        dev = xf - mean
    else:
        valid = mask if mask.dtype == torch.bool else mask != 0
        n = valid.sum()
        zero = torch.zeros((), dtype=cd, device=x.device)
        mean = torch.where(valid, xf, zero).sum() / n  # where, not x * mask: NaN outside the mask stays out
        dev = torch.where(valid, xf - mean, zero)
    return n, mean, (dev * dev).sum()


# the two compiled kernels of a whitening specialisation (dtypes, options, Triton's
# specialisation of pointers and sizes), launched from data pointers after the first call
_WHITEN_KERNELS: dict = {}


def _fused(x, mask, y, unbiased, shift_mean, scale, eps, eps_mode):
    """Whiten contiguous ``x`` into ``y`` (which may be ``x``) with the Triton kernels of
    rl_triton/core/kernels/moments.py: the partials ``(n, mean, M2)``, then their fold and the
    normalisation in one launch. The first call of a specialisation goes through Triton's
    dispatch; later ones call the compiled kernels' launchers with data pointers (Triton's
    dispatch costs tens of microseconds a launch)."""
    from .kernels import moments as k

    flat = x.view(-1)
    valid = None if mask is None else mask.view(-1)
    n = flat.numel()
    P = max(1, min(-(-n // k.BLOCK), k.MAX_PARTS))
    parts = torch.empty(P, 3, dtype=torch.float64, device=x.device)
    m = flat if valid is None else valid
    ptrs = [t.data_ptr() for t in (flat, m, parts)]
    # what Triton specialises the kernel on: dtypes, pointers' 16-byte alignment, sizes divisible
    # by 16, equal to 1 or past int32
    key = ("moments", x.dtype, None if valid is None else valid.dtype, tuple(p % 16 == 0 for p in ptrs), n % 16 == 0,
           n == 1, n >= 1 << 31, x.device)
    _launch(key, k.moments_kernel, (P,), (flat, m, parts, n), (valid is not None, k.BLOCK))
    normalize(x, y, parts, unbiased, shift_mean, scale, eps, eps_mode)


def normalize(x, y, parts, unbiased, shift_mean, scale, eps, eps_mode):
    """``y = (x - mean) * rstd`` (plus ``mean`` where not ``shift_mean``) for contiguous ``x``
    and ``y`` (which may be ``x``), the statistics folded from ``parts`` (a contiguous float64
    ``[P, 3]`` of partials ``(n, mean, M2)``, rl_triton/core/kernels/moments.py) by every
    program of one Triton launch (:func:`masked_whiten`'s options)."""
    from .kernels import moments as k

    flat, out = x.view(-1), y.view(-1)
    n, P = flat.numel(), parts.shape[0]
    G = max(1, min(-(-n // k.BLOCK), k.MAX_PROGRAMS))
    # the partials a program reads at a time: a power of two from 32 (fewer registers for few)
    fold_block = min(k.FOLD_BLOCK, 1 << max(5, (P - 1).bit_length()))
    ptrs = [t.data_ptr() for t in (flat, out, parts)]
    key = ("whiten", x.dtype, unbiased, scale, eps_mode, shift_mean, tuple(p % 16 == 0 for p in ptrs), n % 16 == 0,
           n == 1, n >= 1 << 31, P % 16 == 0, P == 1, fold_block, x.device)
    _launch(key, k.whiten_kernel, (G,), (flat, out, parts, n, P, *_float32_pair(eps)),
            (unbiased, scale, eps_mode == "clamp", eps_mode == "std", not shift_mean, fold_block, k.BLOCK))


def _launch(key, kernel, grid, args, constexprs):
    """``kernel[grid](*args, *constexprs)``: from data pointers through the compiled kernel kept
    under ``key`` where there is one, else through Triton's dispatch (which compiles or finds
    it), keeping what it returns."""
    from . import kernels

    device = args[0].device
    compiled = _WHITEN_KERNELS.get(key)
    if compiled is not None and kernels.direct_launch_ok(device):
        args = [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args]
        kernels.launch_compiled(compiled, grid[0], 1, kernels.current_stream(device), *args, *constexprs)
        return
    compiled = kernel[grid](*args, *constexprs)
    if kernels.launchable(compiled):
        _WHITEN_KERNELS[key] = compiled


# partials a scan may leave for whiten_kernel's fold (each of its programs reads them all);
# a scan of more tiles launches plainly and masked_whiten follows
MAX_SCAN_PARTS = 2048


def scan_whitened(algo, args, rows, given, output: int, flag: str | None, options: dict):
    """The Triton launch of ``algo`` (a spec.py algorithm) on its ``[R, T]`` arguments ``args``,
    writing the outputs in the caller's layout (``given``: the caller's tensors or None, as
    ``rows.output`` takes them), then output ``output`` whitened in place as :func:`masked_whiten`
    with ``options`` (its keywords, no group) whitens it over the steps where the argument
    ``flag`` is nonzero (None: every step): two launches, the scan reducing that output tile by
    tile into partials ``(n, mean, M2)`` as it writes it, then :func:`normalize`. None, nothing
    launched, where the outputs have no ``[R, T]`` view or :func:`scan_accepts` does not accept
    the launch: the caller then launches plainly. A call plan does the same from data pointers
    (rl_triton/core/plans.py, ``Reduce``)."""
    from . import kernels

    outs = [rows.output(o) for o in given]
    if any(view is None for _, view in outs):
        return None
    tensors, views = [out for out, _ in outs], [view for _, view in outs]
    launch = kernels.Launch(algo, args, views, moments=(output, flag))
    if not scan_accepts(output, launch, tensors):
        return None
    parts = torch.empty(launch.tiles, 3, dtype=torch.float64, device=tensors[0].device)
    launch.launch(args, views, parts)
    whitener(output, options)(tensors, parts)
    return tuple(tensors)


def scan_accepts(output: int, launch, outputs) -> bool:
    """Whether the scan ``launch`` (``kernels.Launch`` with ``moments``) and its outputs in the
    caller's layout take :func:`scan_whitened`'s path: at most ``MAX_SCAN_PARTS`` tiles, and
    the whitened output dense (its elements filling its memory, in any order of its dims)."""
    return launch.tiles <= MAX_SCAN_PARTS and _dense_flat(outputs[output]) is not None


def whitener(output: int, options: dict):
    """``finish(outputs, parts)``: output ``output`` (dense) whitened in place with the
    statistics of the partials ``parts`` (:func:`normalize`), ``options`` being
    :func:`masked_whiten`'s keywords (no group)."""
    return functools.partial(_whiten_output, output=output, **_settings(options))


def _settings(options: dict) -> dict:
    """:func:`masked_whiten`'s keywords ``options`` (no group), checked, with their defaults
    filled in: ``unbiased``, ``shift_mean``, ``scale``, ``eps`` and ``eps_mode``."""
    eps = check_whiten_options(**options)
    return dict(unbiased=options.get("unbiased", True), shift_mean=options.get("shift_mean", True),
                scale=options.get("scale", True), eps=eps, eps_mode=options.get("eps_mode", "add"))


def _whiten_output(outputs, parts, output, unbiased, shift_mean, scale, eps, eps_mode):
    flat = _dense_flat(outputs[output])
    normalize(flat, flat, parts, unbiased, shift_mean, scale, eps, eps_mode)


def flat_accepts(output: int, launch, outputs) -> bool:
    """Whether a numba scan's call plan whitens output ``output`` with :func:`flat_whitener`:
    where that output is dense (``cpu.same_dense_layout``)."""
    x = outputs[output]
    return cpu.same_dense_layout(x, x)


def flat_whitener(output: int, options: dict):
    """``finish(outputs, parts)`` of a numba scan's call plan (``parts`` unused): output
    ``output`` (:func:`flat_accepts`) whitened in place as :func:`masked_whiten` with
    ``options`` (its keywords, no group, no mask) whitens it, in one kernel."""
    settings = _settings(options)
    settings["eps_mode"] = EPS_MODES.index(settings["eps_mode"])  # the numba kernel's mode number
    return functools.partial(_whiten_flat, output=output, **settings)


def _whiten_flat(outputs, parts, output, unbiased, shift_mean, scale, eps, eps_mode):
    x = outputs[output]
    if x.numel():
        cpu.whiten_flat(x, x, unbiased, shift_mean, scale, eps, eps_mode)


def _dense_flat(x: torch.Tensor) -> torch.Tensor | None:
    """A 1-D view of the memory of ``x`` where its elements fill it without gaps (contiguous in
    some order of its dims), else None."""
    if x.is_contiguous():
        return x.view(-1)
    order = sorted(range(x.ndim), key=lambda d: x.stride(d), reverse=True)
    permuted = x.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


@functools.lru_cache(maxsize=64)  # a training loop passes one eps
def _float32_pair(value: float) -> tuple[float, float]:
    """``(hi, lo)``: ``value`` rounded to float32 and the rest rounded to float32, whose float64
    sum is ``value`` to 48 bits for values of 1e-30 or more (a kernel argument reaches Triton as
    a float32)."""
    with np.errstate(over="ignore"):
        hi = float(np.float32(value))
    if not math.isfinite(hi):  # past the float32 range (or inf): the kernel sees inf either way
        return value, 0.0
    return hi, float(np.float32(value - hi))


def _combine(n: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, group):
    n, mean, m2 = _combine_rows(n.reshape(1), mean.reshape(1), m2.reshape(1), group)
    return n[0], mean[0], m2[0]


def gather_ranks(local: torch.Tensor, group) -> torch.Tensor:
    """``[world, n]``: the 1-D ``local`` of every rank of ``group`` (of one length on every rank),
    one all-gather."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=local.device)
    all_gather_into(gathered, local.contiguous(), group)
    return gathered.view(world, local.numel())


def all_gather_into(out: torch.Tensor, local: torch.Tensor, group) -> None:
    """Every rank's contiguous ``local`` into ``out`` in rank order: one all-gather."""
    import torch.distributed as dist

    # all_gather_single is all_gather_into_tensor's newer name (torch >= 2.13 deprecates the old one)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local, group=group)


def _combine_rows(n: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, group, shift: torch.Tensor | None = None):
    """The statistics of every rank's valid elements, per entry of the ``[k]`` tensors: one
    all-gather of each rank's (n, mean, m2) in float64 (24 bytes a rank and entry), then Chan et
    al.'s parallel formula,

        N = sum n_i,  mean = sum n_i mean_i / N,  M2 = sum (M2_i + n_i (mean_i - mean)**2),

    over the ranks with n_i > 0 (an empty rank's mean is NaN and must not enter the sums).
    Returns float64 tensors (float32 where the device has no float64).

    With ``shift`` (one value per entry, each rank's own), each rank's ``mean`` is that of
    ``x - shift``; the shifts are gathered too (32 bytes), and the result is ``(N, ref, mean, M2)``
    with ``mean`` that of ``x - ref``, where ``ref`` is the shift of the first rank with
    ``n_i > 0``. Where every element equals one value the shifts are that value and the means 0,
    so ``mean`` and ``M2`` come out exactly 0."""
    xd = _stats_dtype(mean.device)
    parts = (n, mean, m2) if shift is None else (n, mean, m2, shift)
    local = torch.stack([p.to(xd) for p in parts])
    gathered = gather_ranks(local.reshape(-1), group).view(-1, len(parts), n.numel()).unbind(1)
    if shift is None:
        return _chan(*gathered)
    n_i, mean_i, m2_i, shift_i = gathered
    first = (n_i > 0).to(torch.int8).argmax(0, keepdim=True)
    ref = shift_i.gather(0, first)
    total, mean, m2 = _chan(n_i, mean_i + (shift_i - ref), m2_i)
    return total, ref[0], mean, m2


def _chan(n_i, mean_i, m2_i):
    """Chan et al.'s parallel formula along dim 0, over the parts with n_i > 0 (an empty part's
    mean must not enter the sums):

        N = sum n_i,  mean = sum n_i mean_i / N,  M2 = sum (M2_i + n_i (mean_i - mean)**2)."""
    some = n_i > 0
    zero = torch.zeros((), dtype=n_i.dtype, device=n_i.device)
    total = n_i.sum(0)
    mean = torch.where(some, n_i * mean_i, zero).sum(0) / total
    m2 = torch.where(some, m2_i + n_i * (mean_i - mean).square(), zero).sum(0)
    return total, mean, m2


# -- validation ------------------------------------------------------------------------------
def _check_x_mask_group(x, mask, group):
    inputs.check_tensor(x, "x")
    if mask is not None:
        inputs.check_tensor(mask, "mask", dtypes=inputs.FLAG_DTYPES, kind="a bool, integer or float")
        if mask.device != x.device:
            raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
        if mask.shape != x.shape:
            raise ValueError(f"mask must have x's shape {tuple(x.shape)}, got {tuple(mask.shape)}")
    if group is not None:
        check_group(group, x)
    return x, mask, group


def _check_group_type(group):
    import torch.distributed as dist

    if not dist.is_available() or not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup (e.g. dist.group.WORLD) or None, "
                        f"got {type(group).__name__}")


def check_group(group, *tensors, what="the statistics of other ranks", name="x"):
    """Raise for a bad ``group``, one this process is not in, or ``tensors`` that need gradients
    (``what`` of other ranks carry none; ``name`` says what to detach)."""
    import torch.distributed as dist

    _check_group_type(group)
    if dist.get_rank(group) < 0:
        raise ValueError("group: this process is not a member of the process group")
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors):
        raise ValueError(f"group= does not support autograd ({what} carry no gradient); "
                         f"call under torch.no_grad() or detach {name}")


def _check_out(out, x: torch.Tensor):
    inputs.check_tensor(out, "out")
    if out.device != x.device:
        raise ValueError(f"out is on {out.device} but x is on {x.device}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"got {tuple(out.shape)} {out.dtype}")
    if out.requires_grad:
        raise ValueError("out requires grad: out= is written in place; pass a tensor that does not")
    if inputs.has_internal_overlap(out):
        raise ValueError("out has elements that share memory (an expanded or stride-0 view); "
                         "pass a tensor whose elements are distinct")
