"""Tile building blocks shared by the tree GDN verify kernels (``triton_verify``, ``triton_verify_split``):
the ancestor mask of a row tile against a column tile, the diagonal tile of a row tile (log P, G, C and the
exact unit-lower inverse), q/k rows with their normalisation factors, and the coupling G, C between a row tile
and an earlier column tile."""

import triton
import triton.language as tl


@triton.jit
def tile_ancestor_mask(bits, bos, rows, cols, t, W: tl.constexpr):
    """[len(rows), len(cols)] bool: cols[j] is rows[i] or one of its ancestors (local indices)."""
    ok = (rows[:, None] < t) & (cols[None, :] < t)
    word = tl.load(bits + bos * W + (rows[:, None] * W + (cols // 32)[None, :]), mask=ok, other=0)
    return ok & (((word >> (cols % 32)[None, :]) & 1) != 0)


@triton.jit
def tile_ancestor_mask_by_row(bits, bos, rows, c, o_t, t, BT: tl.constexpr, W: tl.constexpr):
    """tile_ancestor_mask of column tile c, from each row's one or two bitmask words (64 columns span at most
    two). With per-row loads the tile takes the layout of the matrix products it meets; the per-element word
    load of tile_ancestor_mask sets a layout of its own."""
    tl.static_assert(BT <= 64)
    cols = c * BT + o_t
    mr = rows < t
    word = (c * BT) // 32
    p = bits + bos * W + (rows * W + word)
    lo = tl.load(p, mask=mr, other=0)
    if BT > 32:
        hi = tl.load(p + 1, mask=mr & (word + 1 < W), other=0)
        words = tl.where(o_t[None, :] < 32, lo[:, None], hi[:, None])
    else:
        words = lo[:, None]
    return mr[:, None] & (cols < t)[None, :] & (((words >> (cols % 32)[None, :]) & 1) != 0)


@triton.jit
def tile_log_decay(g, bits, bos, rows, r, hv, o_t, t, stride_g, BT: tl.constexpr, W: tl.constexpr):
    """log P of row tile ``r``: the sum of g over each row's ancestors and itself (column tiles 0..r)."""
    acc = tl.zeros([BT], dtype=tl.float32)
    for c in range(r + 1):
        cols = c * BT + o_t
        anc = tile_ancestor_mask(bits, bos, rows, cols, t, W)
        gc = tl.load(g + bos * stride_g + hv + cols * stride_g, mask=cols < t, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(anc, gc[None, :], 0.0), 1)
    return acc


@triton.jit
def unit_lower_inverse(G, BT: tl.constexpr, LOG_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + G)^{-1} of a strictly lower-triangular [BT, BT] G, exact up to rounding.

    Block doubling: with M the inverse of I + (G within 2^s-blocks), M - M G M between the two halves of
    each 2^(s+1)-block is the inverse there, the rest of M staying. M is block diagonal, so there M G M
    reads only G between those halves: G enters whole and the mask falls on the product.
    """
    o = tl.arange(0, BT)
    x = o[:, None] ^ o[None, :]
    # First step in closed form: for 2x2 blocks, [[1, 0], [x, 1]]^{-1} = [[1, 0], [-x, 1]].
    M = tl.where(x == 0, 1.0, 0.0) - tl.where(x == 1, G, 0.0)
    for s in tl.static_range(1, LOG_BT):
        T = tl.dot(tl.dot(M, G, input_precision=PREC), M, input_precision=PREC)
        M = M - tl.where((x >> s) == 1, T, 0.0)
    return M


@triton.jit
def load_qk(ptr, stride, bos, rows, hk, o_k, t, scale, HK: tl.constexpr, DK: tl.constexpr,
            L2NORM: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Raw rows [BT, BK] and the per-row factor (L2 norm, scale) that the math applies to them.

    Dots run on the raw rows and the factors scale the results, so bf16 operands stay exact and half the
    size; without BF16_DOTS the rows are widened to fp32 first.
    """
    x = tl.load(ptr + bos * stride + hk * DK + (rows[:, None] * stride + o_k[None, :]),
                mask=(rows < t)[:, None] & (o_k < DK)[None, :], other=0.0)
    if not BF16_DOTS:
        x = x.to(tl.float32)
    if L2NORM:
        xf = x.to(tl.float32)
        factor = scale * tl.rsqrt(tl.sum(xf * xf, 1) + 1e-6)
    else:
        factor = tl.zeros([x.shape[0]], dtype=tl.float32) + scale
    return x, factor


@triton.jit
def diagonal_tile(q, k, g, beta, k_out, g_cum, bits, bos, r, hv, hk, o_t, o_k, t, scale, k_part,
                  stride_q, stride_k, stride_g, stride_beta, HK: tl.constexpr, HV: tl.constexpr,
                  DK: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr, W: tl.constexpr,
                  K_PART: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr,
                  LOGP: tl.constexpr):
    """Row tile r's own block. Stores its log P and its share of the normalised k: with K_PART = 0 all columns
    where k_part == 0, else columns [k_part * K_PART, (k_part + 1) * K_PART) where k_part >= 0. Returns
    (I + G_rr)^{-1}, C_rr and what the couplings and value products reuse: q_r, k_r, fq_r, fk_r, g_r (log P of
    the rows), beta_r.

    log P (g_cum) of earlier tiles must be stored already (the couplings read it back). LOGP: 0 the tree is
    this one tile (r = 0), 1 log P by masked sums over the column tiles up to r, 2 log P read back from g_cum
    (stored by the caller).
    """
    rows = r * BT + o_t
    mr = rows < t
    if LOGP == 2:
        # Stored by the caller for every tile beforehand.
        g_r = tl.load(g_cum + bos * HV + hv + rows * HV, mask=mr, other=0.0)
    else:
        g_r = tile_log_decay(g, bits, bos, rows, r, hv, o_t, t, stride_g, BT, W)
    if LOGP != 2:
        tl.store(g_cum + bos * HV + hv + rows * HV, g_r, mask=mr)
    beta_r = tl.load(beta + bos * stride_beta + hv + rows * stride_beta, mask=mr, other=0.0).to(tl.float32)

    k_r, fk_r = load_qk(k, stride_k, bos, rows, hk, o_k, t, 1.0, HK, DK, L2NORM, BF16_DOTS)
    if K_PART == 0:
        tl.store(k_out + (bos * HK + hk) * DK + (rows[:, None] * (HK * DK) + o_k[None, :]),
                 k_r.to(tl.float32) * fk_r[:, None], mask=(mr & (k_part == 0))[:, None] & (o_k < DK)[None, :])
    elif k_part >= 0:
        # Read again (a cache hit) rather than widening k_r: the fp32 store then takes its own layout, with
        # no [BT, BK] fp32 tile converted through shared memory.
        o_c = k_part * K_PART + tl.arange(0, K_PART)
        m_c = mr[:, None] & (o_c < DK)[None, :]
        k_c = tl.load(k + bos * stride_k + hk * DK + (rows[:, None] * stride_k + o_c[None, :]), mask=m_c, other=0.0)
        tl.store(k_out + (bos * HK + hk) * DK + (rows[:, None] * (HK * DK) + o_c[None, :]),
                 k_c.to(tl.float32) * fk_r[:, None], mask=m_c)
    q_r, fq_r = load_qk(q, stride_q, bos, rows, hk, o_k, t, scale, HK, DK, L2NORM, BF16_DOTS)
    if LOGP == 0:
        # The per-element mask served the row sums of log P in its own layout; this one is built in the
        # layout of the products, with no [BT, BT] conversion.
        anc = tile_ancestor_mask_by_row(bits, bos, rows, r, o_t, t, BT, W)
    else:
        anc = tile_ancestor_mask(bits, bos, rows, rows, t, W)
    decay = tl.where(anc, tl.exp(tl.minimum(g_r[:, None] - g_r[None, :], 0.0)), 0.0)
    kk = tl.dot(k_r, tl.trans(k_r), input_precision=PREC)
    qk = tl.dot(q_r, tl.trans(k_r), input_precision=PREC)
    # C before the inverse: where nothing else needs q and k, they are dead while it runs. Products first, so
    # the element-wise work stays in the matrix-product layout.
    C = qk * decay * fq_r[:, None] * fk_r[None, :]
    G = tl.where(o_t[:, None] != o_t[None, :], kk * decay * (beta_r * fk_r)[:, None] * fk_r[None, :], 0.0)
    M = unit_lower_inverse(G, BT, LOG_BT, PREC)
    return M, C, q_r, k_r, fq_r, fk_r, g_r, beta_r


@triton.jit
def coupling(q_r, k_r, fq_r, fk_r, g_r, beta_r, k, stride_k, bits, g_cum, bos, rows, c, hv, hk, o_t, o_k, t,
             HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, W: tl.constexpr,
             L2NORM: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr):
    """G and C between row tile ``rows`` and an earlier column tile ``c``, and that tile's columns."""
    cols = c * BT + o_t
    k_c, fk_c = load_qk(k, stride_k, bos, cols, hk, o_k, t, 1.0, HK, DK, L2NORM, BF16_DOTS)
    g_c = tl.load(g_cum + bos * HV + hv + cols * HV, mask=cols < t, other=0.0)
    anc = tile_ancestor_mask(bits, bos, rows, cols, t, W)
    dec = tl.where(anc, tl.exp(tl.minimum(g_r[:, None] - g_c[None, :], 0.0)), 0.0) * fk_c[None, :]
    G = (beta_r * fk_r)[:, None] * dec * tl.dot(k_r, tl.trans(k_c), input_precision=PREC)
    C = fq_r[:, None] * dec * tl.dot(q_r, tl.trans(k_c), input_precision=PREC)
    return G, C, cols
