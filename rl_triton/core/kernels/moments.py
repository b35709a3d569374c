"""Masked moments and whitening over a flat tensor: one pass that reduces blocks of elements to
``(n, mean, M2)`` partials, one small program that folds the partials (Chan et al.'s parallel
formula) into the mean and the scale, and one elementwise pass that applies them. Everything in
float64 whatever the data's dtype (float32 data of order 1e20 has squared deviations past the
float32 range), the output rounded once to its dtype. Not a scan: ``rl_triton/core/whiten.py``
is its only caller."""

import triton
import triton.language as tl

BLOCK = 4096  # elements a program reduces or normalises
FOLD_BLOCK = 1024  # partials the folding program reads at a time


@triton.jit
def moments_kernel(x, m, parts, N, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """parts[p] = (n, mean, M2) of the valid elements of block p (mean 0 where n = 0), float64;
    the sum of squared deviations about the block's own mean, from registers."""
    p = tl.program_id(0)
    offs = p.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    v = tl.load(x + offs, mask=inside, other=0.0).to(tl.float64)
    if HAS_MASK:
        valid = inside & (tl.load(m + offs, mask=inside, other=0) != 0)
    else:
        valid = inside
    n = tl.sum(valid.to(tl.float64), 0)
    mean = tl.sum(tl.where(valid, v, 0.0), 0) / tl.maximum(n, 1.0)
    d = tl.where(valid, v - mean, 0.0)
    tl.store(parts + 3 * p, n)
    tl.store(parts + 3 * p + 1, mean)
    tl.store(parts + 3 * p + 2, tl.sum(d * d, 0))


@triton.jit
def _partials(parts, start, P, FOLD_BLOCK: tl.constexpr):
    """(n, mean, M2) of partials start .. start + FOLD_BLOCK (0 past P), in float64."""
    i = start + tl.arange(0, FOLD_BLOCK)
    at = parts + 3 * i
    n = tl.load(at, mask=i < P, other=0.0).to(tl.float64)
    return n, tl.load(at + 1, mask=i < P, other=0.0).to(tl.float64), tl.load(at + 2, mask=i < P, other=0.0).to(
        tl.float64)


@triton.jit
def fold_kernel(parts, stats, P, eps_hi, eps_lo, UNBIASED: tl.constexpr, SCALE: tl.constexpr, CLAMP: tl.constexpr,
                STD: tl.constexpr, FOLD_BLOCK: tl.constexpr):
    """stats = (mean, rstd) from P partials, in float64: N = sum n, mean = sum n*mean_p / N,
    M2 = sum M2_p + n_p*(mean_p - mean)^2; var = M2/(N-1) or M2/N; rstd = 1/sqrt(var + eps), or
    1/sqrt(max(var, eps)) (CLAMP), or 1/(sqrt(var) + eps) (STD), or 1 (not SCALE). eps = eps_hi +
    eps_lo in float64: Triton passes a Python float as a float32, so eps comes as two of them (its
    float32 rounding and the rest), which carry eps to 48 bits (for eps of 1e-30 or more)."""
    eps = tl.cast(eps_hi, tl.float64) + tl.cast(eps_lo, tl.float64)
    total = tl.zeros((FOLD_BLOCK,), tl.float64)
    weighted = tl.zeros((FOLD_BLOCK,), tl.float64)
    for start in range(0, P, FOLD_BLOCK):
        n, mu, _ = _partials(parts, start, P, FOLD_BLOCK)
        total += n
        weighted += tl.where(n > 0, n * mu, 0.0)
    N = tl.sum(total, 0)
    mean = tl.sum(weighted, 0) / N
    spread = tl.zeros((FOLD_BLOCK,), tl.float64)
    for start in range(0, P, FOLD_BLOCK):
        n, mu, m2 = _partials(parts, start, P, FOLD_BLOCK)
        spread += tl.where(n > 0, m2 + n * (mu - mean) * (mu - mean), 0.0)
    M2 = tl.sum(spread, 0)
    if SCALE:
        if UNBIASED:
            var = M2 / (N - 1.0)
        else:
            var = M2 / N
        if STD:
            rstd = 1.0 / (tl.sqrt(var) + eps)
        else:
            if CLAMP:
                var = tl.maximum(var, eps, propagate_nan=tl.PropagateNan.ALL)
            else:
                var = var + eps
            rstd = 1.0 / tl.sqrt(var)
    else:
        rstd = N * 0.0 + 1.0  # 1 whatever the data: an infinite x makes M2 NaN, N stays a count
    tl.store(stats, mean)
    tl.store(stats + 1, rstd)


@triton.jit
def normalize_kernel(x, y, stats, N, SHIFT_BACK: tl.constexpr, BLOCK: tl.constexpr):
    """y = (x - mean) * rstd, plus mean again where SHIFT_BACK: in float64, then rounded to y's
    dtype as torch rounds float64 (through float32 for float16/bfloat16)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < N
    mean = tl.load(stats).to(tl.float64)
    rstd = tl.load(stats + 1).to(tl.float64)
    out = (tl.load(x + offs, mask=inside, other=0.0).to(tl.float64) - mean) * rstd
    if SHIFT_BACK:
        out = out + mean
    if y.dtype.element_ty == tl.float64:
        tl.store(y + offs, out, mask=inside)
    else:
        tl.store(y + offs, out.to(tl.float32).to(y.dtype.element_ty), mask=inside)
