"""Tile building blocks shared by the tree GDN verify kernels (``triton_verify``, ``triton_verify_split``):
the ancestor mask of a row tile against a column tile, log P of a row tile, the exact unit-lower inverse, q/k
rows with their normalisation factors, and the coupling G, C between a row tile and an earlier column tile."""

import triton
import triton.language as tl


@triton.jit
def tile_ancestor_mask(bits, bos, rows, cols, t, W: tl.constexpr):
    """[len(rows), len(cols)] bool: cols[j] is rows[i] or one of its ancestors (local indices)."""
    ok = (rows[:, None] < t) & (cols[None, :] < t)
    word = tl.load(bits + (bos + rows)[:, None] * W + (cols // 32)[None, :], mask=ok, other=0)
    return ok & (((word >> (cols % 32)[None, :]) & 1) != 0)


@triton.jit
def tile_log_decay(g, bits, bos, rows, r, hv, o_t, t, stride_g, BT: tl.constexpr, W: tl.constexpr):
    """log P of row tile ``r``: the sum of g over each row's ancestors and itself (column tiles 0..r)."""
    acc = tl.zeros([BT], dtype=tl.float32)
    for c in range(r + 1):
        cols = c * BT + o_t
        anc = tile_ancestor_mask(bits, bos, rows, cols, t, W)
        gc = tl.load(g + (bos + cols) * stride_g + hv, mask=cols < t, other=0.0).to(tl.float32)
        acc += tl.sum(tl.where(anc, gc[None, :], 0.0), 1)
    return acc


@triton.jit
def unit_lower_inverse(G, BT: tl.constexpr, LOG_BT: tl.constexpr, PREC: tl.constexpr):
    """(I + G)^{-1} of a strictly lower-triangular [BT, BT] G, exact up to rounding."""
    o = tl.arange(0, BT)
    # First step in closed form: for 2x2 blocks, [[1, 0], [x, 1]]^{-1} = [[1, 0], [-x, 1]].
    pairs = ((o[:, None] >> 1) == (o[None, :] >> 1)) & (o[:, None] != o[None, :])
    M = tl.where(o[:, None] == o[None, :], 1.0, 0.0) - tl.where(pairs, G, 0.0)
    for s in tl.static_range(1, LOG_BT):
        # M is the inverse of I + (G restricted to 2^s-blocks); add the coupling between block pairs.
        off = ((o[:, None] >> (s + 1)) == (o[None, :] >> (s + 1))) & ((o[:, None] >> s) != (o[None, :] >> s))
        Gb = tl.where(off, G, 0.0)
        M = M - tl.dot(tl.dot(M, Gb, input_precision=PREC), M, input_precision=PREC)
    return M


@triton.jit
def load_qk(ptr, stride, bos, rows, hk, o_k, t, scale, HK: tl.constexpr, DK: tl.constexpr,
             L2NORM: tl.constexpr, BF16_DOTS: tl.constexpr):
    """Raw rows [BT, BK] and the per-row factor (L2 norm, scale) that the math applies to them.

    Dots run on the raw rows and the factors scale the results, so bf16 operands stay exact and half the
    size; without BF16_DOTS the rows are widened to fp32 first.
    """
    x = tl.load(ptr + (bos + rows)[:, None] * stride + hk * DK + o_k[None, :],
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
def coupling(q_r, k_r, fq_r, fk_r, g_r, beta_r, k, stride_k, bits, g_cum, bos, rows, c, hv, hk, o_t, o_k, t,
              HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BT: tl.constexpr, W: tl.constexpr,
              L2NORM: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr):
    """G and C between row tile ``rows`` and an earlier column tile ``c``, and that tile's columns."""
    cols = c * BT + o_t
    k_c, fk_c = load_qk(k, stride_k, bos, cols, hk, o_k, t, 1.0, HK, DK, L2NORM, BF16_DOTS)
    g_c = tl.load(g_cum + (bos + cols) * HV + hv, mask=cols < t, other=0.0)
    anc = tile_ancestor_mask(bits, bos, rows, cols, t, W)
    dec = tl.where(anc, tl.exp(tl.minimum(g_r[:, None] - g_c[None, :], 0.0)), 0.0) * fk_c[None, :]
    G = (beta_r * fk_r)[:, None] * dec * tl.dot(k_r, tl.trans(k_c), input_precision=PREC)
    C = fq_r[:, None] * dec * tl.dot(q_r, tl.trans(k_c), input_precision=PREC)
    return G, C, cols
