"""Group-relative advantages for outcome rewards: GRPO, Dr. GRPO, RLOO and REINFORCE++ with baseline.

One score per response, responses grouped by prompt. On the Triton backend the statistics and
advantages of up to ``PAIRS_MAX_B`` responses are one kernel over all pairs of responses
(rl_triton/core/kernels/groups.py); otherwise they are one segmented reduction (``scatter_add_``
into per-group buffers). No Python loop over groups or rows and, for tensors on an accelerator,
no host synchronisation. Semantics: docs/semantics.md.
"""

from __future__ import annotations

import math
from numbers import Real

import numpy as np
import torch

from . import cpu, inputs, launch
from .docstrings import documented

MODES = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline")
_WHITEN_EPS = 1e-8  # the variance floor of the batch whitening (reinforce_plus_plus_baseline)
PAIRS_MAX_B = 16384  # the largest batch the all-pairs kernel takes (O(B^2) pairs); above it the sort path
_NARROW_DTYPES = frozenset((torch.uint8, torch.uint16, torch.int8, torch.int16))  # exact in int32
_INT_DTYPES = _NARROW_DTYPES | {torch.uint32, torch.uint64, torch.int32, torch.int64}


@documented(
    scores=("``[B]``, one outcome score per response: a 1-D float16, bfloat16, float32 or float64 tensor. The "
            "result has its dtype and device."),
    group_ids=("``[B]``, the prompt each response answers; equal ids form one group. An integer tensor (any "
               "integer dtype, on any device), or a numpy array or list of hashable ids (verl's ``uid`` "
               "strings). With ``group``: an integer tensor of global ids in ``[0, num_groups)`` on the scores' "
               "device."),
    mode="``\"grpo\"``, ``\"drgrpo\"``, ``\"rloo\"`` or ``\"reinforce_plus_plus_baseline\"`` (formulas above).",
    mask=("``[B, L]`` response mask on the scores' device: bool, integer or float, nonzero marks a valid token "
          "(not a weight). The result is then ``[B, L]``, ``A_i`` at the valid tokens of row i and 0 elsewhere. "
          "Required by ``\"reinforce_plus_plus_baseline\"``, whose whitening counts the valid tokens. None: "
          "the result is ``[B]``."),
    eps="GRPO's ``eps``, a Python number >= 0 (NaN or negative: ValueError); only ``\"grpo\"`` uses it.",
    out=("a tensor of the result's shape (``[B]``, or the mask's ``[B, L]``), dtype and device that the result "
         "is written to and returned in; it may be ``scores`` itself. None: a new tensor. Not where ``scores`` "
         "requires grad (ValueError)."),
    group=("a ``torch.distributed`` ProcessGroup: the batch's responses are spread over its ranks, each rank "
           "passing its own, and a group of responses may span ranks (then ``group_ids`` are global and "
           "``num_groups`` is required). Each rank gets the advantages of its responses. No autograd."),
    num_groups=("with ``group``: the number of global group ids, an int >= 1 (TypeError without it); not "
                "without ``group`` (ValueError)."),
)
def group_advantages(scores, group_ids, *, mode="grpo", mask=None, eps=1e-6, out=None, group=None,
                     num_groups=None, backend=None) -> torch.Tensor:
    """Advantages of responses relative to the other responses to the same prompt.

    ``scores`` is ``[B]``, one outcome score ``s_i`` per response; ``group_ids`` says which prompt
    each response answers (``[B]``: an integer tensor on any device, or a numpy array / list of
    hashable ids such as verl's ``uid`` strings). Groups may have any size and any order. For the
    group ``g`` of response ``i``, with ``n = |g|``::

        mean_g = sum_{j in g} s_j / n
        std_g  = sqrt(sum_{j in g} (s_j - mean_g)^2 / (n - 1))          (unbiased, as torch.std)

        grpo:    A_i = (s_i - mean_g) / (std_g + eps)       n = 1:  A_i = s_i / (1 + eps)
        drgrpo:  A_i = s_i - mean_g                         n = 1:  A_i = s_i
        rloo:    A_i = n / (n - 1) * (s_i - mean_g)         n = 1:  A_i = s_i
                 (= s_i - the mean of the other n - 1 scores)
        reinforce_plus_plus_baseline:
                 a_i = s_i - mean_g                         n = 1:  a_i = s_i
                 then whitened over the valid tokens of the batch, row i counting m_i = #{t: mask[i, t] != 0}:
                 N = sum_i m_i,  mu = sum_i m_i a_i / N,  var = sum_i m_i (a_i - mu)^2 / (N - 1),
                 A_i = (a_i - mu) / sqrt(var + 1e-8)

    A group of one has mean 0 and std 1 (verl's convention); its GRPO divisor ``1 + eps`` is
    formed in float32, as verl forms it from a float32 ``torch.tensor(1.0)``. ``eps`` is used by
    ``grpo`` only. These reproduce verl's ``compute_grpo_outcome_advantage`` (with
    ``norm_adv_by_std_in_grpo`` True for ``grpo``, False for ``drgrpo``),
    ``compute_rloo_outcome_advantage`` and ``compute_reinforce_plus_plus_baseline_outcome_advantage``.

    ``mask`` (``[B, L]``, any dtype, nonzero = valid token) broadcasts the advantages over tokens:
    the result is ``[B, L]`` with ``A_i`` where ``mask[i, t] != 0`` and 0 elsewhere (for a 0/1 mask,
    ``A[:, None] * mask``); without a mask the result is ``[B]``. ``reinforce_plus_plus_baseline``
    needs the mask; with fewer than two valid tokens its variance is 0/0 and the valid token, if
    any, gets NaN (verl raises there; raising would need a host sync).

    Statistics accumulate in float32 (float64 for float64 scores); the result has the scores'
    dtype and device, or is written to ``out``. A NaN score makes its whole group NaN (and the whole
    batch for ``reinforce_plus_plus_baseline``, whose whitening mixes all groups).

    ``group`` (a ``torch.distributed`` ProcessGroup): the responses of the batch are spread over
    the ranks of the group, each rank passing its own, and a group of responses may span ranks.
    Then ``group_ids`` must be an integer tensor of global ids in ``[0, num_groups)`` on the
    scores' device, the same id for the same prompt on every rank. The statistics of every group
    are one all-gather of each rank's ``(n, mean, M2)`` per group (``num_groups`` rows, whatever B
    is), combined by Chan et al.'s formula; ``reinforce_plus_plus_baseline`` whitens over the
    valid tokens of every rank with one more. No host synchronisation; no autograd.

    ``backend`` as for the estimators (``None`` reads ``RL_TRITON_BACKEND``; "auto": "triton" for
    CUDA tensors). On the Triton backend, without ``group`` and without gradients, a batch of up to
    ``PAIRS_MAX_B`` responses takes one kernel over all pairs of responses: each response counts
    the responses with its id and sums their deviations ``s_j - s_i`` from its own score and the
    squares of those, in a fixed order (deterministic). Integer ids are compared as they are, with
    no sort; numpy arrays and lists are numbered on the host first. Every other call takes torch
    ops: the ids numbered (a stable sort on the device, ``torch.unique`` or a dict on the host)
    and the group sums ``scatter_add_``-ed.
    """
    scores = inputs.check_tensor(scores, "scores")
    if scores.ndim != 1:
        raise ValueError(f"scores must be 1-D [B], one score per response, got shape {tuple(scores.shape)}")
    B, device, dtype = scores.shape[0], scores.device, scores.dtype
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(repr(m) for m in MODES)}; got {mode!r}")
    eps = _check_eps(eps)
    ids = _check_group_ids(group_ids, B)
    if group is not None:
        _check_distributed(ids, num_groups, group, scores)
    elif num_groups is not None:
        raise ValueError("num_groups goes with group= (responses spread over ranks); leave it out otherwise")
    if mask is not None:
        inputs.check_tensor(mask, "mask", dtypes=inputs.FLAG_DTYPES, kind="a bool, integer or float")
        if mask.ndim != 2 or mask.shape[0] != B:
            raise ValueError(f"mask must have shape [B, L] with B = {B} (the scores' length), "
                             f"got {tuple(mask.shape)}")
        if mask.device != device:
            raise ValueError(f"mask is on {mask.device} but scores is on {device}")
    elif mode == "reinforce_plus_plus_baseline":
        raise ValueError("mask is required for mode='reinforce_plus_plus_baseline': "
                         "its whitening runs over the valid tokens")
    shape = (B,) if mask is None else tuple(mask.shape)
    if out is not None:
        inputs.check_tensor(out, "out")
        if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
            raise ValueError(f"out must have shape {shape}, dtype {dtype} and device {device}, "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        if inputs.has_internal_overlap(out):
            raise ValueError("out has elements that share memory (an expanded or stride-0 view); "
                             "pass a tensor whose elements are distinct")
        if out.requires_grad or (torch.is_grad_enabled() and scores.requires_grad):
            raise ValueError("out= is written in place and does not support autograd; "
                             "call without out= when scores require grad")

    backend = launch.resolve_backend(backend, device)

    if B == 0 and group is None:
        return out if out is not None else torch.empty(shape, dtype=dtype, device=device)

    cd = inputs.compute_dtype(dtype)
    if group is None and backend == "triton" and B <= PAIRS_MAX_B and not torch.compiler.is_compiling() \
            and not (torch.is_grad_enabled() and scores.requires_grad):
        adv = _all_pairs(scores, _kernel_ids(ids, device), mode, eps)
    elif group is None:
        code, nbuf = _codes(ids, device)
        adv = _advantages(scores.to(cd), code, nbuf, mode, eps)
    else:
        adv = _spread_advantages(scores.to(cd), ids.to(torch.int64), num_groups, mode, eps, group)
    if mode == "reinforce_plus_plus_baseline":
        adv = _whiten(adv, torch.count_nonzero(mask, 1), group)
    adv = adv.to(dtype)
    if mask is None:
        return adv if out is None else out.copy_(adv)
    spread = cpu.spread_rows(adv, mask, out) if backend == "cpu" else None
    if spread is not None:
        return spread
    valid = mask if mask.dtype == torch.bool else mask != 0
    if out is None:
        return torch.where(valid, adv[:, None], 0.0)
    return torch.where(valid, adv[:, None], adv.new_zeros(()), out=out)


def _advantages(x: torch.Tensor, code: torch.Tensor, nbuf: int, mode: str, eps: float) -> torch.Tensor:
    """Per-response advantages before any whitening, in x's (compute) dtype.

    Two passes over the groups. The first member of each group (lowest response index) shifts
    the scores, so the group sums add small numbers and a group of equal scores has deviations of
    exactly 0; the second pass sums the squared deviations from the group mean.
    """
    B = x.shape[0]
    pos = torch.arange(B, device=x.device)
    count = torch.zeros(nbuf, dtype=torch.int64, device=x.device).scatter_add_(0, code, torch.ones_like(code))
    first = torch.full((nbuf,), B, dtype=torch.int64, device=x.device).scatter_reduce_(0, code, pos, "amin")
    n = count.index_select(0, code).to(x.dtype)
    d = x - x.index_select(0, first.index_select(0, code))
    mean_d = torch.zeros(nbuf, dtype=x.dtype, device=x.device).scatter_add_(0, code, d).index_select(0, code) / n
    dev = _deviations(d, mean_d)
    return _relative(x, dev, n, lambda: torch.zeros(nbuf, dtype=x.dtype, device=x.device).scatter_add_(
        0, code, dev * dev).index_select(0, code), mode, eps)


def _all_pairs(scores: torch.Tensor, ids: torch.Tensor, mode: str, eps: float) -> torch.Tensor:
    """``_advantages`` by the all-pairs kernel of rl_triton/core/kernels/groups.py, one launch;
    ``ids``: an int32 or int64 tensor on the scores' device."""
    import triton.language as tl

    from .kernels import groups as k

    B = scores.shape[0]
    cd = inputs.compute_dtype(scores.dtype)
    adv = torch.empty(B, dtype=cd, device=scores.device)
    k.advantages_kernel[(-(-B // k.BLOCK_I),)](
        scores, ids, adv, B, scores.stride(0), ids.stride(0), eps, _one_plus_eps_f32(eps), MODE=mode,
        ACC=tl.float64 if cd == torch.float64 else tl.float32, BLOCK_I=k.BLOCK_I, BLOCK_J=k.BLOCK_J,
        UNROLL=k.UNROLL, num_warps=k.NUM_WARPS)
    return adv


def _relative(x, dev, n, squares, mode: str, eps: float) -> torch.Tensor:
    """The advantages from each response's deviation from its group's mean ``dev``, its group's
    size ``n`` and, for grpo, ``squares()``: its group's sum of squared deviations. The all-pairs
    kernel's ``_relative`` (rl_triton/core/kernels/groups.py) has the same formulas."""
    single = n == 1
    if mode == "grpo":
        var = squares() / (n - 1).clamp(min=1)
        # sqrt only of positive variances, so that a group of one or of equal scores has finite gradients
        pos = var > 0
        std = torch.where(pos, torch.where(pos, var, 1.0).sqrt(), 0.0)
        return torch.where(single, x / _one_plus_eps_f32(eps), dev / (std + eps))
    if mode == "rloo":
        return torch.where(single, x, dev * (n / (n - 1).clamp(min=1)))
    return torch.where(single, x, dev)  # drgrpo, reinforce_plus_plus_baseline


def _spread_advantages(x, ids, num_groups: int, mode: str, eps: float, group) -> torch.Tensor:
    """``_advantages`` of responses spread over the ranks of ``group``: each group's (n, mean, M2)
    over every rank, from one all-gather of the local ones. Each rank takes its sums relative to
    its first score of the group and the ranks' shifts are gathered with them, so that a group of
    equal scores has deviations of exactly 0 however it is spread."""
    from .whiten import _combine_rows

    B = x.shape[0]
    zeros = torch.zeros(num_groups, dtype=x.dtype, device=x.device)
    n = zeros.scatter_add(0, ids, torch.ones_like(x))
    first = torch.full((num_groups,), B, dtype=torch.int64, device=x.device).scatter_reduce_(
        0, ids, torch.arange(B, device=x.device), "amin")
    shift = torch.where(n > 0, torch.cat((x, x.new_zeros(1))).index_select(0, first), 0.0)
    d = x - shift.index_select(0, ids)
    mean = zeros.scatter_add(0, ids, d) / n
    m2 = zeros.scatter_add(0, ids, (d - mean.index_select(0, ids)).square())
    n, ref, mean, m2 = (s.index_select(0, ids).to(x.dtype) for s in _combine_rows(n, mean, m2, group, shift))
    return _relative(x, _deviations(x - ref, mean), n, lambda: m2, mode, eps)


def _deviations(d: torch.Tensor, mean_d: torch.Tensor) -> torch.Tensor:
    """``d - mean_d``, NaN where the group's mean is not finite: an infinite or NaN score makes
    its whole group NaN, whichever response comes first."""
    return torch.where(mean_d.isfinite(), d - mean_d, torch.nan)


def _whiten(a: torch.Tensor, tokens: torch.Tensor, group=None) -> torch.Tensor:
    """Whitening over the batch's valid tokens (of every rank of ``group``), each response ``a[i]``
    counted ``tokens[i]`` (int64) times. A response without valid tokens contributes nothing, even
    when its advantage is not finite."""
    m = tokens.to(a.dtype)
    has = tokens > 0
    n = tokens.sum().to(a.dtype)
    mu = torch.where(has, m * a, 0.0).sum() / n
    if group is not None:
        from .whiten import _combine_rows

        m2 = torch.where(has, m * (a - mu).square(), 0.0).sum()
        n, mu, m2 = (s[0].to(a.dtype) for s in _combine_rows(n[None], mu[None], m2[None], group))
        c = a - mu
        return c * torch.rsqrt(m2 / (n - 1) + _WHITEN_EPS)
    c = a - mu
    var = torch.where(has, m * c * c, 0.0).sum() / (n - 1)
    return c * torch.rsqrt(var + _WHITEN_EPS)


def _one_plus_eps_f32(eps: float) -> float:
    """``1 + eps`` as verl forms it for a group of one: float32 ``torch.tensor(1.0) + eps``."""
    return float(torch.tensor(1.0, dtype=torch.float32) + eps)


# -- group ids ---------------------------------------------------------------------------------


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a number, got {type(eps).__name__}")
    eps = float(eps)
    if math.isnan(eps) or eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    return eps


def _check_distributed(ids, num_groups, group, scores):
    from .whiten import check_group

    check_group(group, scores, name="scores")
    if not isinstance(ids, torch.Tensor):
        raise TypeError("with group=, group_ids must be an integer tensor of global ids in [0, num_groups), "
                        f"got {type(ids).__name__}")
    if ids.device != scores.device:
        raise ValueError(f"group_ids is on {ids.device} but scores is on {scores.device}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise TypeError(f"group= needs num_groups, the number of global group ids (an int >= 1), got {num_groups!r}")
    if ids.numel() and (ids.device.type == "cpu" or inputs.value_checks_on(ids.device)):
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_groups:
            raise ValueError(f"group_ids must lie in [0, num_groups) = [0, {num_groups}), got ids from {lo} to {hi}")


def _check_group_ids(group_ids, B: int):
    """The ids as an integer tensor or a 1-D numpy array / list, of length B."""
    if isinstance(group_ids, torch.Tensor):
        if group_ids.dtype not in _INT_DTYPES:
            raise TypeError(f"group_ids must be an integer tensor (or a numpy array / list of ids), "
                            f"got dtype {group_ids.dtype}")
        if group_ids.layout != torch.strided:
            raise TypeError(f"group_ids must be a dense (strided) tensor, got layout {group_ids.layout}")
        n = group_ids.shape[0] if group_ids.ndim == 1 else None
    elif isinstance(group_ids, np.ndarray):
        n = group_ids.shape[0] if group_ids.ndim == 1 else None
    elif isinstance(group_ids, (list, tuple)):
        n = len(group_ids)
    else:
        raise TypeError(f"group_ids must be an integer tensor, a numpy array or a list, "
                        f"got {type(group_ids).__name__}")
    if n is None:
        raise ValueError(f"group_ids must be 1-D, one id per response, got shape {tuple(group_ids.shape)}")
    if n != B:
        raise ValueError(f"group_ids has {n} ids but scores has {B} responses")
    return group_ids


def _codes(ids, device: torch.device) -> tuple[torch.Tensor, int]:
    """``(code, nbuf)``: int64 group codes in ``[0, nbuf)`` on ``device``, equal ids sharing a code.

    Ids on the host are factorised there (``nbuf`` = the number of groups) and copied once; a tensor
    on an accelerator is factorised on it by a sort (``nbuf`` = B), with no host synchronisation.
    """
    if isinstance(ids, torch.Tensor):
        if ids.device.type == "cpu":
            return _unique_codes(ids, device)
        return _sorted_codes(ids.to(device))
    codes = _host_codes(ids)
    return _to_device(codes, device), int(codes.max()) + 1 if codes.size else 0


def _kernel_ids(ids, device: torch.device) -> torch.Tensor:
    """The ids as the all-pairs kernel compares them, on ``device``: an int32 or int64 tensor as it
    is (other integer dtypes widened, equal ids staying equal); ids on the host as their int32
    codes."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int32, torch.int64):
            ids = ids.to(torch.int32 if ids.dtype in _NARROW_DTYPES else torch.int64)
        return ids.to(device, non_blocking=True)
    return _to_device(_host_codes(ids).astype(np.int32), device)


def _to_device(codes: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(codes).to(device, non_blocking=True)


def _unique_codes(ids: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    uniq, code = torch.unique(ids.to(torch.int64), return_inverse=True)
    return code.to(device, non_blocking=True), uniq.numel()


def _sorted_codes(ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Codes by a stable sort: a new segment starts where the sorted id changes."""
    ids = ids.to(torch.int64)
    B = ids.shape[0]
    sid, perm = torch.sort(ids, stable=True)
    starts = torch.ones(B, dtype=torch.int64, device=ids.device)
    starts[1:] = sid[1:] != sid[:-1]
    return torch.empty_like(perm).scatter_(0, perm, starts.cumsum(0) - 1), B


def _host_codes(ids) -> np.ndarray:
    """Codes of a numpy array or list: ``np.unique`` for numeric arrays; a dict for objects and
    lists (verl's uid strings: a seventh of ``np.unique``'s time on an object array, and ids that
    are hashable but not mutually orderable, a mix of strings and ints, work too)."""
    if isinstance(ids, np.ndarray) and ids.dtype != object:
        return np.unique(ids, return_inverse=True)[1].reshape(-1).astype(np.int64, copy=False)
    seen: dict = {}
    try:
        codes = [seen.setdefault(i, len(seen)) for i in (ids.tolist() if isinstance(ids, np.ndarray) else ids)]
    except TypeError as e:
        raise TypeError(f"group_ids must hold hashable ids: {e}") from None
    return np.asarray(codes, dtype=np.int64)
