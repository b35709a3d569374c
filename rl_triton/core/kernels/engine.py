"""The one scan engine: tiling, carries, scan direction, time splitting. It knows no RL.

A program owns ``BLOCK_R`` rows and one segment of the time axis, walks it in chunks of
``BLOCK_T`` steps in scan order (descending time for reverse scans) and carries the running value
between chunks. The scan runs forward across the lanes of a chunk. Reverse scans mirror the
lanes in time instead of using ``associative_scan(reverse=True)``, whose lowering moves every
element across the warp with shuffles: lane run g of ``VEC`` lanes (one vector load of one
thread) holds the g-th run from the chunk's end, and ``_mirror`` reverses each run in registers.
``VEC = 0`` keeps natural lanes and ``reverse=True`` (cheaper for chunks of a few steps, whose
flip crosses one or two lanes). An algorithm plugs in three jit functions:

    BUILD(ins, rows, t, mask, T, ACC) -> (alpha, beta, ctx)   coefficients from raw loads
    INIT(ins, rows, rmask, T, ACC)    -> carry [BLOCK_R]       value beyond the window edge
    STORE(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC)   the epilogue

BUILD and STORE see the steps ``t`` in load order (the runs mirrored, each run ascending);
the engine mirrors alpha and beta into scan order and y back. ``y_prev`` is y one step earlier
in scan order (at t+1 for reverse scans); the engine computes it only for algorithms that ask
(``NEED_PREV``): the neighbouring lane, the incoming carry at the chunk's first lane. With
``PREV_MEM`` (one segment per row only) the engine computes no ``y_prev`` and STORE gets None:
it writes the outputs that hold y, waits at a barrier, and reads y one step back from them
(this program wrote every earlier step in scan order, the previous chunks' included), which
spares the lane gather across warps.

Full tiles (``EVEN_R``/``EVEN_T``: R and T multiples of the block) drop the bound masks,
``ONE_CHUNK`` (one chunk per row, one segment) drops the chunk loop and the carry extraction,
and ``IDX`` is the index type (int32 whenever every offset fits).

``ins``/``outs`` hold ``(tensor, row_stride, time_stride)`` views, ``(None, number)`` constants,
plain numbers, or None for absent inputs (compile-time specialised).

Phases: 0 = one pass per row; with the time axis split into segments, 1 = each program
reduces its segment to the affine map y_out = A + B*y_in (written to ``ws``), 2 = each program
folds the maps of the segments before it into its incoming carry and scans for real.

``fold`` (phases 0 and 2; None otherwise) makes the carry the one this chunk receives within a
sequence split across ranks (rl_triton/core/sharded.py): ``(maps, world, rank, divisor)``,
``maps`` every rank's handed map in rank order (``3R + 1`` numbers a rank: per row the value
handed on from carry 0, its gain and the rank's own carry, then whether the rank holds steps;
``7R + 1`` for ``PAIR``, :func:`_fold_pairs`), folded from the ranks beyond this one in scan
order (:func:`_fold_ranks`), then divided by ``divisor`` (a one-element tensor; a tuple argument
holds no None in compiled kernels).

``moments`` (three Nones: off) reduces one output tile by tile for a whitening that follows
(rl_triton/core/whiten.py): ``(parts, out, flag)``, ``out`` the view of the output that STORE
writes and ``flag`` a flag input's view (None: every step counts); after each STORE the
program reads the tile of ``out`` back (what it wrote, rounded to the output's dtype) and
writes the ``(n, mean, M2)`` of its steps where ``flag`` is nonzero, in float64, to
``parts[tile]`` (a ``[P, 3]`` float64 buffer), ``tile = program_id(0) * cdiv(T, BLOCK_T) +
chunk``: one partial per row block and chunk, whatever the segments.

``PAIR`` algorithms scan a state of two values (phase 1 writes each segment's map
``(a1, b1, a2, b2, c)`` to ``ws``; the batch-major plan gives them one segment): a first value
that follows its own recurrence, x[t] = a1 + b1*x[t-1], and y[t] = a2 + c*x[t-1] + b2*y[t-1],
which reads it (GAE skipping masked steps: x the value of the next unmasked step). BUILD returns
``((a1, a2), (b1, b2, c), ctx)``, INIT the pair of carries ``(x, y)``, and STORE sees y.
"""

import triton
import triton.language as tl


@triton.jit
def _step(a, b, y):
    """a + b * y, and a alone where b is 0: a zero coefficient cuts the recurrence, so an inf or
    NaN beyond the cut (another episode) is never read."""
    return tl.where(b == 0, a, a + b * y)


@triton.jit
def combine(a1, b1, a2, b2):
    # (a1, b1) is the part already folded in scan order: y = a2 + b2 * (a1 + b1 * y_in); where b2
    # is 0 nothing before it is read, not even an inf or NaN coefficient
    return _step(a2, b2, a1), tl.where(b2 == 0, 0.0, b1 * b2)


@triton.jit
def combine_pair(a1, b1, a2, b2, c1, e1, f1, e2, f2, g1):
    # the two-state map (a1, b1, a2, b2, c1) is the part already folded in scan order and
    # (e1, f1, e2, f2, g1) follows it: x = e1 + f1*x', y = e2 + g1*x' + f2*y' of x' = a1 + b1*x_in,
    # y' = a2 + c1*x_in + b2*y_in; a zero coefficient reads nothing, as in ``combine``
    y0 = _step(e2, f2, a2) + tl.where(g1 == 0, 0.0, g1 * a1)
    cross = tl.where(g1 == 0, 0.0, g1 * b1) + tl.where(f2 == 0, 0.0, f2 * c1)
    return _step(e1, f1, a1), tl.where(f1 == 0, 0.0, f1 * b1), y0, tl.where(f2 == 0, 0.0, f2 * b2), cross


@triton.jit
def _offsets(x, rows, t):
    return rows[:, None] * x[1] + t[None, :] * x[2]


@triton.jit
def load(x, rows, t, mask, ACC: tl.constexpr):
    """[BLOCK_R, BLOCK_T] values of a per-step input in the accumulation dtype (0 if absent)."""
    if x is None:
        return tl.zeros((rows.shape[0], t.shape[0]), ACC)
    else:
        return tl.load(x[0] + _offsets(x, rows, t), mask=mask, other=0.0).to(ACC)


@triton.jit
def load_flag(x, rows, t, mask):
    """A flag tile as int1 (nonzero is true; false if absent)."""
    if x is None:
        return tl.zeros((rows.shape[0], t.shape[0]), tl.int1)
    else:
        return tl.load(x[0] + _offsets(x, rows, t), mask=mask, other=0) != 0


@triton.jit
def load_row(x, rows, rmask, ACC: tl.constexpr):
    """[BLOCK_R] values of a per-row input ``(tensor, stride)`` (0 if absent)."""
    if x is None:
        return tl.zeros((rows.shape[0],), ACC)
    else:
        return tl.load(x[0] + rows * x[1], mask=rmask, other=0.0).to(ACC)


@triton.jit
def coef(x, rows, t, mask, ACC: tl.constexpr):
    """A coefficient that is either a constant ``(None, value)`` or a per-step tensor."""
    if x[0] is None:
        return x[1]
    else:
        return load(x, rows, t, mask, ACC)


@triton.jit
def store(x, rows, t, mask, value):
    tl.store(x[0] + _offsets(x, rows, t), value.to(x[0].dtype.element_ty), mask=mask)


@triton.jit
def _pick(x, lanes, lane: tl.constexpr):
    return tl.sum(tl.where(lanes[None, :] == lane, x, 0.0), axis=1)


@triton.jit
def _shifted(y, lanes, carry, DOWN: tl.constexpr):
    """y one step earlier in scan order: the neighbouring lane (the next one if the scan runs
    DOWN the lanes), ``carry`` at the chunk's first lane in scan order."""
    n: tl.constexpr = lanes.shape[0]
    if DOWN:
        idx = tl.minimum(lanes + 1, n - 1)
        edge = lanes == n - 1
    else:
        idx = tl.maximum(lanes - 1, 0)
        edge = lanes == 0
    idx = tl.broadcast_to(idx[None, :], y.shape)
    return tl.where(edge[None, :], carry[:, None], tl.gather(y, idx, 1))


@triton.jit
def _swap(x):
    """Lanes 2m and 2m+1 exchanged."""
    lo, hi = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
    return tl.reshape(tl.join(hi, lo), x.shape)


@triton.jit
def _mirrored_steps(lanes, VEC: tl.constexpr):
    """The step each lane loads in a mirrored chunk: run g of VEC lanes holds the g-th run of
    steps from the chunk's end, each run ascending (one vector load)."""
    return (lanes.shape[0] - VEC) - (lanes // VEC) * VEC + lanes % VEC


@triton.jit
def _mirror(x, VEC: tl.constexpr):
    """Each run of VEC (1, 2 or 4) lanes reversed: x[4g + v] -> x[4g + 3 - v] for VEC = 4."""
    if VEC == 4:
        lo, hi = tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))
        x = tl.reshape(tl.join(_swap(hi), _swap(lo)), x.shape)
    elif VEC == 2:
        x = _swap(x)
    return x


@triton.jit
def _segments(ws, rows, rmask, n_seg, upto, ACC: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """The maps phase 1 left in ``ws`` for segments ``[0, upto)`` of each row, folded in scan
    order: ``(A, B)`` per row, in ``ACC``."""
    j = tl.arange(0, SEG_BLOCK)
    m = rmask[:, None] & (j[None, :] < upto)
    w = (rows[:, None].to(tl.int64) * n_seg + j[None, :]) * 2
    a = tl.load(ws + w, mask=m, other=0.0).to(ACC)
    b = tl.load(ws + w + 1, mask=m, other=1.0).to(ACC)
    a, b = tl.associative_scan((a, b), 1, combine)
    return _pick(a, j, SEG_BLOCK - 1), _pick(b, j, SEG_BLOCK - 1)


@triton.jit
def _pair_segments(ws, rows, rmask, n_seg, upto, ACC: tl.constexpr, SEG_BLOCK: tl.constexpr):
    """:func:`_segments` for two-state maps: the maps ``(a1, b1, a2, b2, c)`` phase 1 left in
    ``ws`` (five numbers a segment) for segments ``[0, upto)`` of each row, folded in scan order."""
    j = tl.arange(0, SEG_BLOCK)
    m = rmask[:, None] & (j[None, :] < upto)
    w = (rows[:, None].to(tl.int64) * n_seg + j[None, :]) * 5
    a1 = tl.load(ws + w, mask=m, other=0.0).to(ACC)
    b1 = tl.load(ws + w + 1, mask=m, other=1.0).to(ACC)
    a2 = tl.load(ws + w + 2, mask=m, other=0.0).to(ACC)
    b2 = tl.load(ws + w + 3, mask=m, other=1.0).to(ACC)
    c1 = tl.load(ws + w + 4, mask=m, other=0.0).to(ACC)
    a1, b1, a2, b2, c1 = tl.associative_scan((a1, b1, a2, b2, c1), 1, combine_pair)
    END: tl.constexpr = SEG_BLOCK - 1
    return _pick(a1, j, END), _pick(b1, j, END), _pick(a2, j, END), _pick(b2, j, END), _pick(c1, j, END)


@triton.jit
def _ranks_beyond(fold, REVERSE: tl.constexpr):
    """How many ranks lie beyond this one in scan order (``fold``: see the module docstring)."""
    if REVERSE:
        return fold[1] - 1 - fold[2]
    else:
        return fold[2]


@triton.jit
def _rank_maps(fold, i, WIDTH: tl.constexpr, R, REVERSE: tl.constexpr):
    """The i-th rank beyond this one, walking from the window's far end in scan order: where its
    ``WIDTH*R + 1`` numbers start in ``fold``'s maps, and whether it holds steps (int32)."""
    if REVERSE:
        j = fold[1] - 1 - i
    else:
        j = i
    base = fold[0] + j * (WIDTH * R + 1)
    return base, (tl.load(base + WIDTH * R) != 0).to(tl.int32)


@triton.jit
def _fold_ranks(fold, rows, rmask, own, R, REVERSE: tl.constexpr, ACC: tl.constexpr):
    """The carry a chunk receives from the maps of the ranks beyond it in scan order (``fold``:
    see the module docstring): the first of them holding steps (the window's far end) starts
    from its own carry, each later one applies its map; a rank without steps passes the value
    on; with none beyond holding steps, ``own`` (this rank's own carry)."""
    c = tl.zeros((rows.shape[0],), ACC)
    seen = tl.zeros((rows.shape[0],), tl.int32)  # a rank holding steps was met
    for i in range(_ranks_beyond(fold, REVERSE)):
        base, present = _rank_maps(fold, i, 3, R, REVERSE)
        h = tl.load(base + rows * 3, mask=rmask, other=0.0).to(ACC)
        g = tl.load(base + rows * 3 + 1, mask=rmask, other=0.0).to(ACC)
        o = tl.load(base + rows * 3 + 2, mask=rmask, other=0.0).to(ACC)
        c = tl.where(present != 0, _step(h, g, tl.where(seen != 0, c, o)), c)
        seen = tl.maximum(seen, present)
    return tl.where(seen != 0, c, own) / tl.load(fold[3]).to(ACC)


@triton.jit
def _fold_pairs(fold, rows, rmask, own_x, own_y, R, REVERSE: tl.constexpr, ACC: tl.constexpr):
    """:func:`_fold_ranks` for two-state maps: ``7R + 1`` numbers a rank, per row the map
    ``(a1, b1, a2, b2, c)`` from carry 0 and the rank's own carries ``y``, ``x``; returns the
    carries ``(x, y)`` this chunk receives."""
    x = tl.zeros((rows.shape[0],), ACC)
    y = tl.zeros((rows.shape[0],), ACC)
    seen = tl.zeros((rows.shape[0],), tl.int32)  # a rank holding steps was met
    for i in range(_ranks_beyond(fold, REVERSE)):
        base, present = _rank_maps(fold, i, 7, R, REVERSE)
        a1 = tl.load(base + rows * 7, mask=rmask, other=0.0).to(ACC)
        b1 = tl.load(base + rows * 7 + 1, mask=rmask, other=0.0).to(ACC)
        a2 = tl.load(base + rows * 7 + 2, mask=rmask, other=0.0).to(ACC)
        b2 = tl.load(base + rows * 7 + 3, mask=rmask, other=0.0).to(ACC)
        c1 = tl.load(base + rows * 7 + 4, mask=rmask, other=0.0).to(ACC)
        sy = tl.where(seen != 0, y, tl.load(base + rows * 7 + 5, mask=rmask, other=0.0).to(ACC))
        sx = tl.where(seen != 0, x, tl.load(base + rows * 7 + 6, mask=rmask, other=0.0).to(ACC))
        y = tl.where(present != 0, _step(a2, b2, sy) + tl.where(c1 == 0, 0.0, c1 * sx), y)
        x = tl.where(present != 0, _step(a1, b1, sx), x)
        seen = tl.maximum(seen, present)
    return tl.where(seen != 0, x, own_x), tl.where(seen != 0, y, own_y)


@triton.jit
def moments_of(v, valid):
    """(n, mean, M2) of the float64 values ``v`` where ``valid`` (a tile of any rank): mean 0
    where n = 0, M2 the sum of squared deviations about the tile's own mean, from registers."""
    n = tl.sum(valid.to(tl.float64))
    mean = tl.sum(tl.where(valid, v, 0.0)) / tl.maximum(n, 1.0)
    d = tl.where(valid, v - mean, 0.0)
    return n, mean, tl.sum(d * d)


@triton.jit
def _reduce_output(moments, tile, rows, t, mask):
    """The tile's partial moments of the output ``moments[1]`` into ``parts[tile]`` (module
    docstring)."""
    tl.debug_barrier()  # the tile's stores, by whichever threads, before it is read back
    v = load(moments[1], rows, t, mask, tl.float64)
    if moments[2] is None:
        valid = mask
    else:
        valid = mask & load_flag(moments[2], rows, t, mask)
    n, mean, m2 = moments_of(v, valid)
    at = moments[0] + 3 * tile.to(tl.int64)
    tl.store(at, n)
    tl.store(at + 1, mean)
    tl.store(at + 2, m2)



@triton.jit
def _coefficients(BUILD: tl.constexpr, ins, rows, t, mask, T, ACC: tl.constexpr, EVEN: tl.constexpr):
    """BUILD's ``(alpha, beta, ctx)``, the identity map outside ``mask`` (unless the tile is
    full, ``EVEN``)."""
    alpha, beta, ctx = BUILD(ins, rows, t, mask, T, ACC)
    if not EVEN:
        alpha = tl.where(mask, alpha, 0.0)
        beta = tl.where(mask, beta, 1.0)
    return alpha, beta, ctx


@triton.jit
def _pair_coefficients(BUILD: tl.constexpr, ins, rows, t, mask, T, ACC: tl.constexpr, EVEN: tl.constexpr):
    """A two-state BUILD's ``(a1, b1, a2, b2, c1, ctx)``, the identity map outside ``mask``
    (unless the tile is full, ``EVEN``)."""
    alphas, betas, ctx = BUILD(ins, rows, t, mask, T, ACC)
    a1 = alphas[0]
    a2 = alphas[1]
    b1 = betas[0]
    b2 = betas[1]
    c1 = betas[2]
    if not EVEN:
        a1 = tl.where(mask, a1, 0.0)
        a2 = tl.where(mask, a2, 0.0)
        b1 = tl.where(mask, b1, 1.0)
        b2 = tl.where(mask, b2, 1.0)
        c1 = tl.where(mask, c1, 0.0)
    return a1, b1, a2, b2, c1, ctx


@triton.jit
def _walk_step(k, j, c_lo, c_hi, rmask, T, REVERSE: tl.constexpr, BLOCK_T: tl.constexpr, EVEN_T: tl.constexpr,
               IDX: tl.constexpr):
    """Step j in scan order of the k-th chunk of ``[c_lo, c_hi)`` in scan order, as a one-step
    tile: ``t`` ([1]) and the [BLOCK_R, 1] mask."""
    if REVERSE:
        t = (c_hi - 1 - k) * BLOCK_T + (BLOCK_T - 1 - j)
    else:
        t = (c_lo + k) * BLOCK_T + j
    t = (t + tl.arange(0, 1)).to(IDX)
    if EVEN_T:
        mask = rmask[:, None] & tl.full((1, 1), 1, tl.int1)
    else:
        mask = rmask[:, None] & (t < T)[None, :]
    return t, mask


@triton.jit
def _walk_chunk(ins, rows, rmask, T, k, c_lo, c_hi, BUILD: tl.constexpr, REVERSE: tl.constexpr, ACC: tl.constexpr,
                BLOCK_T: tl.constexpr, EVEN_R: tl.constexpr, EVEN_T: tl.constexpr, IDX: tl.constexpr):
    """The k-th chunk of ``[c_lo, c_hi)`` in scan order as a tuple of its steps' ``(t, mask,
    (alpha, beta, ctx))``: every step's BUILD, so every load of the chunk, before any use."""
    chunk = ()
    for j in tl.static_range(BLOCK_T):
        t, mask = _walk_step(k, j, c_lo, c_hi, rmask, T, REVERSE, BLOCK_T, EVEN_T, IDX)
        chunk = chunk + ((t, mask, _coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)),)
    return chunk


@triton.jit
def _walk_apply(ins, outs, rows, t, mask, alpha, beta, ctx, y, m_b, STORE: tl.constexpr, PHASE: tl.constexpr, T,
                ACC: tl.constexpr):
    """One step of :func:`_walk`: y = alpha + beta*y, then phase 1 folds beta into the segment's
    map ``m_b``, phases 0 and 2 store. Returns ``(y, m_b)``."""
    y_prev = y
    y = _step(alpha, beta, y)
    if PHASE == 1:
        m_b = tl.where(beta == 0, 0.0, beta * m_b)
    else:
        STORE(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC)
    return y, m_b


@triton.jit
def _walk(ins, outs, rows, rmask, T, c_lo, c_hi, n_iter, ca, cb, BUILD: tl.constexpr, STORE: tl.constexpr,
          REVERSE: tl.constexpr, PHASE: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
          EVEN_R: tl.constexpr, EVEN_T: tl.constexpr, IDX: tl.constexpr, WALK: tl.constexpr):
    """The WALK regime of one-value scans: the chunks of ``[c_lo, c_hi)`` in scan order, each
    step of a chunk a ``[BLOCK_R, 1]`` tile (BUILD and STORE see ``t`` of one step), y = a + b*y
    per step, no scan across lanes. Each program's rows are the lanes: where the rows are
    contiguous (time-major data) every step loads ``BLOCK_R`` neighbouring values. Phase 1 folds
    the steps into the segment's map ``(ca, cb)``; phases 0 and 2 store y (``y_prev`` is the
    value before the step, the carry at the window's edge). Returns ``(ca, cb)``.

    ``WALK = 2`` (phases 0 and 2) walks each chunk twice: first with no stores, to the carry at
    its end, then again from its start, storing. The compiler keeps each load after the stores
    before it (they might alias), so in one pass every step waits for its loads; in the first
    pass the chunk's loads are all in flight at once, and the second reads them from the cache.
    ``WALK = 3`` walks each chunk once from registers: every step's BUILD (its loads) first, kept
    in a tuple, then the steps in order with their stores, so the chunk's loads are in flight
    together and none is repeated. ``WALK = 4`` as 3, each chunk's loads issued before the
    previous chunk's steps and stores (a chunk ahead in registers; its loop carries the whole
    tuple, which triton 3.6 takes about 24 s a kernel to compile at 16 steps, 3 s at 8)."""
    EARLY: tl.constexpr = WALK == 2 and PHASE != 1
    GATHER: tl.constexpr = WALK >= 3
    PREFETCH: tl.constexpr = WALK == 4
    y = ca[:, None]
    m_b = cb[:, None]
    if PREFETCH:
        chunk = _walk_chunk(ins, rows, rmask, T, 0, c_lo, c_hi, BUILD, REVERSE, ACC, BLOCK_T, EVEN_R, EVEN_T, IDX)
    for k in range(n_iter):
        if GATHER:
            if PREFETCH:  # the next chunk's loads (the last chunk's again at the end) before this one's stores
                ahead = _walk_chunk(ins, rows, rmask, T, k + (k + 1 < n_iter), c_lo, c_hi, BUILD, REVERSE, ACC,
                                    BLOCK_T, EVEN_R, EVEN_T, IDX)
            else:
                chunk = _walk_chunk(ins, rows, rmask, T, k, c_lo, c_hi, BUILD, REVERSE, ACC, BLOCK_T, EVEN_R, EVEN_T,
                                    IDX)
            for j in tl.static_range(BLOCK_T):
                t, mask, coefficients = chunk[j]
                alpha, beta, ctx = coefficients
                y, m_b = _walk_apply(ins, outs, rows, t, mask, alpha, beta, ctx, y, m_b, STORE, PHASE, T, ACC)
            if PREFETCH:
                chunk = ahead
        else:
            if EARLY:
                y_end = y
                for j in tl.static_range(BLOCK_T):
                    t, mask = _walk_step(k, j, c_lo, c_hi, rmask, T, REVERSE, BLOCK_T, EVEN_T, IDX)
                    alpha, beta, ctx = _coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)
                    y_end = _step(alpha, beta, y_end)
            for j in tl.static_range(BLOCK_T):
                t, mask = _walk_step(k, j, c_lo, c_hi, rmask, T, REVERSE, BLOCK_T, EVEN_T, IDX)
                alpha, beta, ctx = _coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)
                y, m_b = _walk_apply(ins, outs, rows, t, mask, alpha, beta, ctx, y, m_b, STORE, PHASE, T, ACC)
            if EARLY:
                y = y_end  # the same value: the first pass's loads feed the carry, so none is dropped
    return tl.sum(y, axis=1), tl.sum(m_b, axis=1)


@triton.jit
def _walk_pairs(ins, outs, rows, rmask, T, c_lo, c_hi, n_iter, s1, s2, s3, s4, s5, BUILD: tl.constexpr,
                STORE: tl.constexpr, REVERSE: tl.constexpr, PHASE: tl.constexpr, ACC: tl.constexpr,
                BLOCK_T: tl.constexpr, EVEN_R: tl.constexpr, EVEN_T: tl.constexpr, IDX: tl.constexpr,
                WALK: tl.constexpr):
    """:func:`_walk` for the two-state scan (``PAIR``; ``WALK`` 3 and 4 walk as 1). Phase 1:
    ``(s1, ..., s5)`` is the map ``(a1, b1, a2, b2, c)`` folded so far, returned with the
    chunks' steps folded in; phase 0: ``s1``, ``s2`` are the carries ``(x, y)``, returned first
    (the others unused)."""
    EARLY: tl.constexpr = WALK == 2 and PHASE != 1
    m1 = s1[:, None]
    m2 = s2[:, None]
    m3 = s3[:, None]
    m4 = s4[:, None]
    m5 = s5[:, None]
    for k in range(n_iter):
        if EARLY:
            x_end = m1
            y_end = m2
            for j in tl.static_range(BLOCK_T):
                t, mask = _walk_step(k, j, c_lo, c_hi, rmask, T, REVERSE, BLOCK_T, EVEN_T, IDX)
                a1, b1, a2, b2, c1, ctx = _pair_coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)
                y_end = _step(a2, b2, y_end) + tl.where(c1 == 0, 0.0, c1 * x_end)
                x_end = _step(a1, b1, x_end)
        for j in tl.static_range(BLOCK_T):
            t, mask = _walk_step(k, j, c_lo, c_hi, rmask, T, REVERSE, BLOCK_T, EVEN_T, IDX)
            a1, b1, a2, b2, c1, ctx = _pair_coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)
            if PHASE == 1:
                m1, m2, m3, m4, m5 = combine_pair(m1, m2, m3, m4, m5, a1, b1, a2, b2, c1)
            else:
                x = m1
                m1 = _step(a1, b1, x)
                m2 = _step(a2, b2, m2) + tl.where(c1 == 0, 0.0, c1 * x)
                STORE(ins, outs, rows, t, mask, m2, m2, ctx, T, ACC)
        if EARLY:
            m1 = x_end
            m2 = y_end
    return tl.sum(m1, axis=1), tl.sum(m2, axis=1), tl.sum(m3, axis=1), tl.sum(m4, axis=1), tl.sum(m5, axis=1)


@triton.jit
def scan_kernel(ins, outs, ws, fold, moments, R, T, seg_chunks, n_seg,
                BUILD: tl.constexpr, INIT: tl.constexpr, STORE: tl.constexpr,
                REVERSE: tl.constexpr, NEED_PREV: tl.constexpr, PHASE: tl.constexpr, ACC: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, VEC: tl.constexpr, SEG_BLOCK: tl.constexpr,
                EVEN_R: tl.constexpr, EVEN_T: tl.constexpr, ONE_CHUNK: tl.constexpr, PAIR: tl.constexpr,
                WALK: tl.constexpr, PREV_MEM: tl.constexpr, IDX: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if EVEN_R:
        rmask = tl.full((BLOCK_R,), 1, tl.int1)
    else:
        rmask = rows < R
    rows = rows.to(IDX)
    seg = tl.program_id(1)  # segment index in scan order
    lanes = tl.arange(0, BLOCK_T)
    # chunks are aligned to BLOCK_T from t = 0; the step of each lane within its chunk, in load order
    MIRROR: tl.constexpr = REVERSE and VEC > 0
    DOWN: tl.constexpr = REVERSE and VEC == 0  # natural lanes, scanned with reverse=True
    if MIRROR:
        steps = _mirrored_steps(lanes, VEC)
    else:
        steps = lanes
    END: tl.constexpr = 0 if DOWN else BLOCK_T - 1  # the last lane in scan order
    n_chunks = tl.cdiv(T, BLOCK_T)
    if REVERSE:
        c_hi = n_chunks - seg * seg_chunks
        c_lo = tl.maximum(c_hi - seg_chunks, 0)
    else:
        c_lo = seg * seg_chunks
        c_hi = tl.minimum(c_lo + seg_chunks, n_chunks)

    if PAIR and PHASE == 1:  # the identity map of the two-state scan
        ma1 = tl.zeros((BLOCK_R,), ACC)
        mb1 = ma1 + 1.0
        ma2 = ma1
        mb2 = mb1
        mc1 = ma1
    elif PAIR:
        cx, ca = INIT(ins, rows, rmask, T, ACC)
        if fold is not None:
            cx, ca = _fold_pairs(fold, rows, rmask, cx, ca, R, REVERSE, ACC)
        if PHASE == 2:
            s1, s2, s3, s4, s5 = _pair_segments(ws, rows, rmask, n_seg, seg, ACC, SEG_BLOCK)
            ca = _step(s3, s4, ca) + tl.where(s5 == 0, 0.0, s5 * cx)
            cx = _step(s1, s2, cx)
    elif PHASE == 1:
        ca = tl.zeros((BLOCK_R,), ACC)
        cb = tl.zeros((BLOCK_R,), ACC) + 1.0
    else:
        ca = INIT(ins, rows, rmask, T, ACC)
        if fold is not None:
            ca = _fold_ranks(fold, rows, rmask, ca, R, REVERSE, ACC)
        cb = tl.zeros((BLOCK_R,), ACC)
        if PHASE == 2:
            seg_a, seg_b = _segments(ws, rows, rmask, n_seg, seg, ACC, SEG_BLOCK)
            ca = _step(seg_a, seg_b, ca)

    if ONE_CHUNK:
        n_iter = 1
    else:
        n_iter = c_hi - c_lo
    if WALK:  # one step at a time (time-major data): see _walk
        if PAIR and PHASE == 1:
            ma1, mb1, ma2, mb2, mc1 = _walk_pairs(ins, outs, rows, rmask, T, c_lo, c_hi, n_iter, ma1, mb1, ma2, mb2,
                                                  mc1, BUILD, STORE, REVERSE, PHASE, ACC, BLOCK_T, EVEN_R, EVEN_T,
                                                  IDX, WALK)
        elif PAIR:
            cx, ca, _u1, _u2, _u3 = _walk_pairs(ins, outs, rows, rmask, T, c_lo, c_hi, n_iter, cx, ca, ca, ca, ca,
                                                BUILD, STORE, REVERSE, PHASE, ACC, BLOCK_T, EVEN_R, EVEN_T, IDX,
                                                WALK)
        else:
            ca, cb = _walk(ins, outs, rows, rmask, T, c_lo, c_hi, n_iter, ca, cb, BUILD, STORE, REVERSE, PHASE, ACC,
                           BLOCK_T, EVEN_R, EVEN_T, IDX, WALK)
    else:
        for k in range(n_iter):
            if REVERSE:
                c = c_hi - 1 - k
            else:
                c = c_lo + k
            t = (c * BLOCK_T + steps).to(IDX)
            if EVEN_T:
                mask = rmask[:, None] & tl.full((1, BLOCK_T), 1, tl.int1)
            else:
                mask = rmask[:, None] & (t < T)[None, :]
            if PAIR:
                a1, b1, a2, b2, c1, ctx = _pair_coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)
                if MIRROR:
                    a1, b1, a2, b2, c1 = (_mirror(a1, VEC), _mirror(b1, VEC), _mirror(a2, VEC), _mirror(b2, VEC),
                                          _mirror(c1, VEC))
                A1, B1, A2, B2, C1 = tl.associative_scan((a1, b1, a2, b2, c1), 1, combine_pair, reverse=DOWN)
                if PHASE == 1:
                    ma1, mb1, ma2, mb2, mc1 = combine_pair(ma1, mb1, ma2, mb2, mc1, _pick(A1, lanes, END),
                                                           _pick(B1, lanes, END), _pick(A2, lanes, END),
                                                           _pick(B2, lanes, END), _pick(C1, lanes, END))
                else:
                    x = _step(A1, B1, cx[:, None])
                    y = _step(A2, B2, ca[:, None]) + tl.where(C1 == 0, 0.0, C1 * cx[:, None])
                    if not ONE_CHUNK:
                        cx = _pick(x, lanes, END)
                        ca = _pick(y, lanes, END)
                    if MIRROR:
                        y = _mirror(y, VEC)
                    STORE(ins, outs, rows, t, mask, y, y, ctx, T, ACC)
                    if moments[0] is not None:
                        _reduce_output(moments, tl.program_id(0) * n_chunks + c, rows, t, mask)
            else:
                alpha, beta, ctx = _coefficients(BUILD, ins, rows, t, mask, T, ACC, EVEN_R and EVEN_T)
                if MIRROR:
                    alpha = _mirror(alpha, VEC)
                    beta = _mirror(beta, VEC)
                A, B = tl.associative_scan((alpha, beta), 1, combine, reverse=DOWN)
                if PHASE == 1:
                    a_end = _pick(A, lanes, END)
                    b_end = _pick(B, lanes, END)
                    ca = _step(a_end, b_end, ca)
                    cb = b_end * cb
                else:
                    y = _step(A, B, ca[:, None])
                    if NEED_PREV and not PREV_MEM:
                        y_prev = _shifted(y, lanes, ca, DOWN)
                        if MIRROR:
                            y_prev = _mirror(y_prev, VEC)
                    if not ONE_CHUNK:
                        ca = _pick(y, lanes, END)
                    if MIRROR:
                        y = _mirror(y, VEC)
                    if NEED_PREV and PREV_MEM:
                        STORE(ins, outs, rows, t, mask, y, None, ctx, T, ACC)
                    else:
                        if not NEED_PREV:
                            y_prev = y
                        STORE(ins, outs, rows, t, mask, y, y_prev, ctx, T, ACC)
                    if moments[0] is not None:
                        _reduce_output(moments, tl.program_id(0) * n_chunks + c, rows, t, mask)

    if PHASE == 1 and PAIR:
        w = (rows.to(tl.int64) * n_seg + seg) * 5
        tl.store(ws + w, ma1, mask=rmask)
        tl.store(ws + w + 1, mb1, mask=rmask)
        tl.store(ws + w + 2, ma2, mask=rmask)
        tl.store(ws + w + 3, mb2, mask=rmask)
        tl.store(ws + w + 4, mc1, mask=rmask)
    elif PHASE == 1:
        w = (rows.to(tl.int64) * n_seg + seg) * 2
        tl.store(ws + w, ca, mask=rmask)
        tl.store(ws + w + 1, cb, mask=rmask)


@triton.jit
def edge_kernel(ws, edge, carry, bootstrap, R, n_seg, PAIR: tl.constexpr, BLOCK_R: tl.constexpr,
                SEG_BLOCK: tl.constexpr):
    """Each row's edge map (rl_triton/core/spec.py) from the maps phase 1 left in ``ws``: the
    segments' maps folded in scan order, then applied to the launch's own carries (``carry``,
    and for two-state scans ``bootstrap``, the first state; contiguous ``[R]`` or None for 0).
    ``edge`` is a contiguous ``[R, 2]`` (two-state: ``[R, 5]``) float tensor."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    if carry is None:
        c_in = tl.zeros((BLOCK_R,), tl.float64)
    else:
        c_in = tl.load(carry + r64, mask=rmask, other=0.0).to(tl.float64)
    if PAIR:
        if bootstrap is None:
            x_in = tl.zeros((BLOCK_R,), tl.float64)
        else:
            x_in = tl.load(bootstrap + r64, mask=rmask, other=0.0).to(tl.float64)
        w = r64 * 5
        if SEG_BLOCK == 1:
            a1 = tl.load(ws + w, mask=rmask, other=0.0).to(tl.float64)
            b1 = tl.load(ws + w + 1, mask=rmask, other=1.0).to(tl.float64)
            a2 = tl.load(ws + w + 2, mask=rmask, other=0.0).to(tl.float64)
            b2 = tl.load(ws + w + 3, mask=rmask, other=1.0).to(tl.float64)
            c1 = tl.load(ws + w + 4, mask=rmask, other=0.0).to(tl.float64)
        else:
            a1, b1, a2, b2, c1 = _pair_segments(ws, rows, rmask, n_seg, n_seg, tl.float64, SEG_BLOCK)
        y = _step(a2, b2, c_in) + tl.where(c1 == 0, 0.0, c1 * x_in)
        out = edge.dtype.element_ty
        tl.store(edge + w, _step(a1, b1, x_in).to(out), mask=rmask)
        tl.store(edge + w + 1, b1.to(out), mask=rmask)
        tl.store(edge + w + 2, y.to(out), mask=rmask)
        tl.store(edge + w + 3, b2.to(out), mask=rmask)
        tl.store(edge + w + 4, c1.to(out), mask=rmask)
    else:
        a_end, b_end = _segments(ws, rows, rmask, n_seg, n_seg, tl.float64, SEG_BLOCK)
        out = edge.dtype.element_ty
        tl.store(edge + r64 * 2, _step(a_end, b_end, c_in).to(out), mask=rmask)
        tl.store(edge + r64 * 2 + 1, b_end.to(out), mask=rmask)


@triton.jit
def hand_kernel(ws, send, own, own_x, offset, cut, scale, R, n_seg, PAIR: tl.constexpr, BLOCK_R: tl.constexpr,
                SEG_BLOCK: tl.constexpr):
    """A chunk's handed map into ``send`` (rl_triton/core/sharded.py): per row, from the
    segments' maps phase 1 left in ``ws`` folded in scan order (``a + b*carry``), ``h = offset +
    scale*a`` and ``g = b``, both 0 where ``cut``, then the row's own carry (``3R + 1`` numbers);
    for two-state maps (``PAIR``, one segment) ``(a1, b1, a2, b2, c)``, the own carry ``y`` and
    the own first state ``own_x`` (``7R + 1``); last, 1 (this rank holds steps). ``own``,
    ``own_x``, ``offset``, ``cut``: ``(pointer, row stride)`` per-row views or None (0, 0, 0,
    never); ``scale``: a one-element tensor or None (1)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    r64 = rows.to(tl.int64)
    out = send.dtype.element_ty
    if own is None:
        o = tl.zeros((BLOCK_R,), tl.float64)
    else:
        o = tl.load(own[0] + rows * own[1], mask=rmask, other=0.0).to(tl.float64)
    if PAIR and SEG_BLOCK == 1:
        for k in tl.static_range(5):
            m = tl.load(ws + r64 * 5 + k, mask=rmask, other=0.0)
            tl.store(send + r64 * 7 + k, m.to(out), mask=rmask)
    elif PAIR:  # the segments' maps folded
        a1, b1, a2, b2, c1 = _pair_segments(ws, rows, rmask, n_seg, n_seg, tl.float64, SEG_BLOCK)
        tl.store(send + r64 * 7, a1.to(out), mask=rmask)
        tl.store(send + r64 * 7 + 1, b1.to(out), mask=rmask)
        tl.store(send + r64 * 7 + 2, a2.to(out), mask=rmask)
        tl.store(send + r64 * 7 + 3, b2.to(out), mask=rmask)
        tl.store(send + r64 * 7 + 4, c1.to(out), mask=rmask)
    if PAIR:
        if own_x is None:
            ox = tl.zeros((BLOCK_R,), tl.float64)
        else:
            ox = tl.load(own_x[0] + rows * own_x[1], mask=rmask, other=0.0).to(tl.float64)
        tl.store(send + r64 * 7 + 5, o.to(out), mask=rmask)
        tl.store(send + r64 * 7 + 6, ox.to(out), mask=rmask)
        if tl.program_id(0) == 0:
            tl.store(send + 7 * R + tl.arange(0, 1), tl.full((1,), 1.0, tl.float64).to(out))
    else:
        a, b = _segments(ws, rows, rmask, n_seg, n_seg, tl.float64, SEG_BLOCK)
        if scale is not None:
            a = a * tl.load(scale).to(tl.float64)
        if offset is not None:
            a = tl.load(offset[0] + rows * offset[1], mask=rmask, other=0.0).to(tl.float64) + a
        if cut is not None:
            stop = tl.load(cut[0] + rows * cut[1], mask=rmask, other=0) != 0
            a = tl.where(stop, 0.0, a)
            b = tl.where(stop, 0.0, b)
        tl.store(send + r64 * 3, a.to(out), mask=rmask)
        tl.store(send + r64 * 3 + 1, b.to(out), mask=rmask)
        tl.store(send + r64 * 3 + 2, o.to(out), mask=rmask)
        if tl.program_id(0) == 0:
            tl.store(send + 3 * R + tl.arange(0, 1), tl.full((1,), 1.0, tl.float64).to(out))
