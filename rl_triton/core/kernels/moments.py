"""Masked moments and whitening over a flat tensor in two launches: ``moments_kernel`` reduces
the elements to at most ``MAX_PARTS`` partials ``(n, mean, M2)`` (each program its blocks,
combined by Chan et al.'s formula), and ``whiten_kernel`` has every program fold all partials
into the mean and the scale (redundantly: a few kilobytes each) and normalise its own blocks.
The partials may also come from elsewhere: a scan that reduces its output tile by tile as it
writes it (``tile_moments``, called by rl_triton/core/kernels/engine.py) leaves them in the
same ``[P, 3]`` layout. Everything in float64 whatever the data's dtype (float32 data of order
1e20 has squared deviations past the float32 range), the output rounded once to its dtype. Not
a scan: ``rl_triton/core/whiten.py`` is its caller."""

import triton
import triton.language as tl

BLOCK = 4096  # elements a program reduces or normalises at a time
FOLD_BLOCK = 1024  # partials a program reads at a time
MAX_PARTS = 512  # partials moments_kernel leaves at most (programs, each reducing every MAX_PARTS-th block)
MAX_PROGRAMS = 1024  # programs of whiten_kernel at most (each normalising every MAX_PROGRAMS-th block)


@triton.jit
def _block_moments(x, m, offs, N, HAS_MASK: tl.constexpr):
    """(n, mean, M2) of the valid elements at ``offs`` (mean 0 where n = 0), float64; the sum of
    squared deviations about the block's own mean, from registers."""
    inside = offs < N
    v = tl.load(x + offs, mask=inside, other=0.0).to(tl.float64)
    if HAS_MASK:
        valid = inside & (tl.load(m + offs, mask=inside, other=0) != 0)
    else:
        valid = inside
    return _moments(v, valid)


@triton.jit
def _moments(v, valid):
    """(n, mean, M2) of the float64 values ``v`` where ``valid`` (a tile of any rank): mean 0
    where n = 0, M2 about the tile's own mean."""
    n = tl.sum(valid.to(tl.float64))
    mean = tl.sum(tl.where(valid, v, 0.0)) / tl.maximum(n, 1.0)
    d = tl.where(valid, v - mean, 0.0)
    return n, mean, tl.sum(d * d)


@triton.jit
def _chan(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Chan et al.'s combination of two (n, mean, M2): n = n_a + n_b, mean = (n_a*mean_a +
    n_b*mean_b)/n (an infinite or NaN mean stays so), M2 = M2_a + M2_b + (mean_b - mean_a)^2 *
    n_a*n_b/n; an empty side leaves the other as it is."""
    n = n_a + n_b
    mean = (n_a * mean_a + n_b * mean_b) / tl.maximum(n, 1.0)
    delta = mean_b - mean_a
    m2 = m2_a + m2_b + delta * delta * (n_a * n_b / tl.maximum(n, 1.0))
    mean = tl.where(n_a > 0, tl.where(n_b > 0, mean, mean_a), mean_b)
    m2 = tl.where(n_a > 0, tl.where(n_b > 0, m2, m2_a), m2_b)
    return n, mean, m2


@triton.jit
def moments_kernel(x, m, parts, N, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    """parts[p] = (n, mean, M2) of the valid elements of blocks p, p + P, p + 2P, ... (P programs),
    float64: each block's from registers, the blocks combined by Chan et al.'s formula."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    n, mean, m2 = _block_moments(x, m, p.to(tl.int64) * BLOCK + lanes, N, HAS_MASK)
    # an int64 loop index: block offsets past int32
    for b in range(p.to(tl.int64) + P, tl.cdiv(N, BLOCK), P):
        n_b, mean_b, m2_b = _block_moments(x, m, b * BLOCK + lanes, N, HAS_MASK)
        n, mean, m2 = _chan(n, mean, m2, n_b, mean_b, m2_b)
    tl.store(parts + 3 * p, n)
    tl.store(parts + 3 * p + 1, mean)
    tl.store(parts + 3 * p + 2, m2)


@triton.jit
def tile_moments(parts, tile, v, valid):
    """parts[tile] = (n, mean, M2) of the float64 tile ``v`` where ``valid``."""
    n, mean, m2 = _moments(v, valid)
    at = parts + 3 * tile.to(tl.int64)
    tl.store(at, n)
    tl.store(at + 1, mean)
    tl.store(at + 2, m2)


@triton.jit
def _partials(parts, start, P, FOLD_BLOCK: tl.constexpr):
    """(n, mean, M2) of partials start .. start + FOLD_BLOCK (0 past P), in float64."""
    i = start + tl.arange(0, FOLD_BLOCK)
    at = parts + 3 * i
    n = tl.load(at, mask=i < P, other=0.0).to(tl.float64)
    return n, tl.load(at + 1, mask=i < P, other=0.0).to(tl.float64), tl.load(at + 2, mask=i < P, other=0.0).to(
        tl.float64)


@triton.jit
def _statistics(parts, P, eps_hi, eps_lo, UNBIASED: tl.constexpr, SCALE: tl.constexpr, CLAMP: tl.constexpr,
                STD: tl.constexpr, FOLD_BLOCK: tl.constexpr):
    """(mean, rstd) from P partials, in float64: N = sum n, mean = sum n*mean_p / N,
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
    return mean, rstd


@triton.jit
def whiten_kernel(x, y, parts, N, P, eps_hi, eps_lo, UNBIASED: tl.constexpr, SCALE: tl.constexpr,
                  CLAMP: tl.constexpr, STD: tl.constexpr, SHIFT_BACK: tl.constexpr, FOLD_BLOCK: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Each program: (mean, rstd) from the P partials (``_statistics``), then for its blocks
    (program g of G: blocks g, g + G, ...) y = (x - mean) * rstd, plus mean again where
    SHIFT_BACK: in float64, then rounded to y's dtype as torch rounds float64 (through float32
    for float16/bfloat16). ``y`` may be ``x``."""
    mean, rstd = _statistics(parts, P, eps_hi, eps_lo, UNBIASED, SCALE, CLAMP, STD, FOLD_BLOCK)
    lanes = tl.arange(0, BLOCK)
    for b in range(tl.program_id(0).to(tl.int64), tl.cdiv(N, BLOCK), tl.num_programs(0)):  # int64 offsets
        offs = b * BLOCK + lanes
        inside = offs < N
        out = (tl.load(x + offs, mask=inside, other=0.0).to(tl.float64) - mean) * rstd
        if SHIFT_BACK:
            out = out + mean
        if y.dtype.element_ty == tl.float64:
            tl.store(y + offs, out, mask=inside)
        else:
            tl.store(y + offs, out.to(tl.float32).to(y.dtype.element_ty), mask=inside)
