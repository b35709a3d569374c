"""Group-relative advantages by all pairs of responses, in one launch with no sort: the Triton
path of ``rl_triton/core/groups.py`` (its only caller).

Program p owns BLOCK_I responses i and sweeps every response j, BLOCK_J at a time (UNROLL tiles
a loop iteration). A pair is in one group when its ids are equal (compared as they are: no
factorisation). For response i, with the deviations from its own score ``d_j = s_j - s_i``::

    n   = #{j : id_j = id_i}
    S1  = sum_{id_j = id_i} d_j   = -n * dev            dev = s_i - mean_g
    S2  = sum_{id_j = id_i} d_j^2 = M2 + n * dev^2

so ``dev = -S1 / n`` and the group's sum of squared deviations ``M2 = S2 - (S1 / n) * S1``. As
``s_i`` is a score of the group, ``n * dev^2 <= n * M2`` and the difference loses at most
``log2(n + 1)`` bits. Where ``S2`` overflows (``s_i`` far out in a group of huge scores) the
program takes two sweeps instead (``_two_pass``: ``n`` and ``S1``, then ``sum (d_j - S1 / n)^2``),
so that ``M2`` overflows exactly where the torch path's does. A group of equal scores has
``d = 0`` for every pair, hence ``dev = 0`` exactly, and the sums add small numbers. A
non-finite ``S1`` (an infinite or NaN score in the group) makes ``dev`` NaN. A pair of two
groups leaves the sums as they are (``tl.where``, never a product with a 0/1 mask), so a
non-finite score reaches its own group alone. Each (i, j slot) of the tile keeps
its own sums over the sweep; they are added up once at the end, in a fixed order: deterministic,
no atomics. O(B^2) pairs, about six instructions each.
"""

import triton
import triton.language as tl

BLOCK_I = 16  # responses a program owns
BLOCK_J = 128  # responses they are compared with at a time
UNROLL = 2  # tiles of BLOCK_J a loop iteration
NUM_WARPS = 4


@triton.jit
def _responses(scores, ids, j, B, s_stride, id_stride, id_i, ACC: tl.constexpr):
    """The scores of responses j (some past B) and which pairs (i, j) share a group."""
    s_j = tl.load(scores + j * s_stride, mask=j < B, other=0.0).to(ACC)
    same = (tl.load(ids + j * id_stride, mask=j < B, other=0)[None, :] == id_i[:, None]) & (j < B)[None, :]
    return s_j, same


@triton.jit
def _pairs(scores, ids, j, B, s_stride, id_stride, s_i, id_i, n, s1, s2, ACC: tl.constexpr, TAIL: tl.constexpr):
    """(n, S1, S2) plus the pairs of responses i with responses j (some past B where TAIL)."""
    if TAIL:
        s_j, same = _responses(scores, ids, j, B, s_stride, id_stride, id_i, ACC)
    else:
        s_j = tl.load(scores + j * s_stride).to(ACC)
        same = tl.load(ids + j * id_stride)[None, :] == id_i[:, None]
    d = s_j[None, :] - s_i[:, None]
    return tl.where(same, n + 1.0, n), tl.where(same, s1 + d, s1), tl.where(same, s2 + d * d, s2)


@triton.jit(noinline=True)
def _two_pass(scores, ids, adv, B, s_stride, id_stride, eps, one_eps, MODE: tl.constexpr, ACC: tl.constexpr,
              BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr):
    """The advantages of this program's responses from two sweeps, for a program where a
    response's one-pass ``S2`` overflowed: ``(n, S1)``, then the squared deviations from the mean,
    ``sum (d_j - S1 / n)^2``, which overflow exactly where the group's own M2 does. A function of
    its own (not inlined), so that the one-pass loop compiles as it would without it."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    s_i = tl.load(scores + i * s_stride, mask=i < B, other=0.0).to(ACC)
    id_i = tl.load(ids + i * id_stride, mask=i < B, other=0)
    j = tl.arange(0, BLOCK_J)
    n = tl.zeros((BLOCK_I, BLOCK_J), ACC)
    s1 = tl.zeros((BLOCK_I, BLOCK_J), ACC)
    for start in range(0, B, BLOCK_J):  # the one-pass sums (its S2, which overflowed, unused)
        n, s1, _ = _pairs(scores, ids, start + j, B, s_stride, id_stride, s_i, id_i, n, s1, s1, ACC, True)
    n = tl.maximum(tl.sum(n, 1), 1.0)
    S1 = tl.sum(s1, 1)
    mean_d = _divide(S1, n, ACC)
    sq = tl.zeros((BLOCK_I, BLOCK_J), ACC)
    for start in range(0, B, BLOCK_J):
        s_j, same = _responses(scores, ids, start + j, B, s_stride, id_stride, id_i, ACC)
        c = (s_j[None, :] - s_i[:, None]) - mean_d[:, None]
        sq = tl.where(same, sq + c * c, sq)
    dev = tl.where(tl.abs(S1) < float("inf"), 0.0 - mean_d, float("nan"))
    a = _relative(s_i, dev, n, tl.sum(sq, 1), tl.full((), eps, ACC), tl.full((), one_eps, ACC), MODE, ACC)
    tl.store(adv + i, a, mask=i < B)


@triton.jit
def _divide(a, b, ACC: tl.constexpr):
    """a / b rounded to nearest, as torch divides."""
    if ACC == tl.float32:
        return tl.div_rn(a, b)
    return a / b


@triton.jit
def _relative(s, dev, n, m2, eps, one_eps, MODE: tl.constexpr, ACC: tl.constexpr):
    """The advantages from each response's score ``s``, its deviation from its group's mean
    ``dev``, its group's size ``n`` and sum of squared deviations ``m2``: the formulas of
    ``rl_triton.core.groups._relative`` (the torch path), rule for rule."""
    single = n == 1.0
    if MODE == "grpo":
        var = _divide(m2, tl.maximum(n - 1.0, 1.0), ACC)
        pos = var > 0  # sqrt only of positive variances, as the torch path
        if ACC == tl.float32:
            std = tl.where(pos, tl.sqrt_rn(tl.where(pos, var, 1.0)), 0.0)
        else:
            std = tl.where(pos, tl.sqrt(tl.where(pos, var, 1.0)), 0.0)
        return tl.where(single, _divide(s, one_eps, ACC), _divide(dev, std + eps, ACC))
    if MODE == "rloo":
        return tl.where(single, s, dev * _divide(n, tl.maximum(n - 1.0, 1.0), ACC))
    return tl.where(single, s, dev)  # drgrpo, reinforce_plus_plus_baseline


@triton.jit
def advantages_kernel(scores, ids, adv, B, s_stride, id_stride, eps: tl.float64, one_eps: tl.float64,
                      MODE: tl.constexpr, ACC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr,
                      UNROLL: tl.constexpr):
    """adv[i] (in ACC) of responses i = p * BLOCK_I .. (p + 1) * BLOCK_I, before any whitening;
    ``MODE`` is group_advantages' mode, ``one_eps`` the float32 ``1 + eps`` of a group of one."""
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    s_i = tl.load(scores + i * s_stride, mask=i < B, other=0.0).to(ACC)
    id_i = tl.load(ids + i * id_stride, mask=i < B, other=0)
    n = tl.zeros((BLOCK_I, BLOCK_J), ACC)
    s1 = tl.zeros((BLOCK_I, BLOCK_J), ACC)
    s2 = tl.zeros((BLOCK_I, BLOCK_J), ACC)
    j = tl.arange(0, BLOCK_J)
    full = B // (UNROLL * BLOCK_J) * (UNROLL * BLOCK_J)
    for start in range(0, full, UNROLL * BLOCK_J):
        for u in tl.static_range(UNROLL):
            n, s1, s2 = _pairs(scores, ids, start + u * BLOCK_J + j, B, s_stride, id_stride, s_i, id_i, n, s1, s2,
                               ACC, False)
    for start in range(full, B, BLOCK_J):
        n, s1, s2 = _pairs(scores, ids, start + j, B, s_stride, id_stride, s_i, id_i, n, s1, s2, ACC, True)
    n = tl.maximum(tl.sum(n, 1), 1.0)  # >= 1 but for rows past B
    S1 = tl.sum(s1, 1)
    S2 = tl.sum(s2, 1)
    finite = tl.abs(S1) < float("inf")  # False for NaN too: a non-finite score makes its group NaN
    mean_d = _divide(S1, n, ACC)
    dev = tl.where(finite, 0.0 - mean_d, float("nan"))  # 0 - S1/n: a group of equal scores gives +0
    m2 = S2 - mean_d * S1  # S1^2 / n without forming S1^2, which may overflow where S2 does not
    # S2 overflows where s_i lies far from its group even when the group's own M2 does not: a
    # program with such a response takes the two sweeps instead (rare)
    if tl.sum((finite & (S2 == float("inf")) & (i < B)).to(tl.int32), 0) > 0:
        _two_pass(scores, ids, adv, B, s_stride, id_stride, eps, one_eps, MODE, ACC, BLOCK_I, BLOCK_J)
    else:
        a = _relative(s_i, dev, n, m2, tl.full((), eps, ACC), tl.full((), one_eps, ACC), MODE, ACC)
        tl.store(adv + i, a, mask=i < B)
