"""Triton closed-form tree GDN verification in two launches: per-tree matrices, then value blocks.

With A = (I + G)^{-1} diag(beta) and W = C A (BOLE.md, Theorem 1), for R = V - diag(P) K S:

    U = A R,    O = diag(P) Q S + W R.

The first kernel, one program per (request, value head), builds g_cum, the ancestor-masked G and C and from
them A and W for the whole tree, row tile by row tile (the diagonal tile's inverse by block doubling, earlier
tiles by block forward substitution), into a scratch buffer of T values per node. The second, one program per
(request, value head, value block), reads the committed state block once and does only the state products and
two matrix products per tile pair: no serial chain is repeated per value block, and every value block is its
own program. Where both kernels take the whole tree as one tile, the scratch holds C instead of W and the
second kernel forms O = diag(P) Q S + C U: the first skips the product C A, the second chains its two.
"""

import torch
import triton
import triton.language as tl

from .triton_tiles import coupling, diagonal_tile, load_qk


# Both kernels also run eagerly (steps with prefill chunks): no variant per alignment of the per-step index
# tensors, which are only read a scalar at a time.
@triton.jit(do_not_specialize_on_alignment=["cu_seqlens"])
def _tree_matrices_kernel(
    q, k, g, beta, k_out, g_cum, aw, bits, cu_seqlens, scale, aw_plane, tp,
    stride_q, stride_k, stride_g, stride_beta,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, BT: tl.constexpr,
    LOG_BT: tl.constexpr, W: tl.constexpr, K_PART: tl.constexpr, ONE_TILE: tl.constexpr, STORE_C: tl.constexpr,
    L2NORM: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr,
):
    hv, b = tl.program_id(0), tl.program_id(1)
    hk = hv // (HV // HK)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    t = tl.load(cu_seqlens + b + 1) - tl.load(cu_seqlens + b)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    # The value heads of a key head share the store of its k (K_PART columns each), or the first stores it.
    k_part = hv % (HV // HK)
    # The request's rows of this head's A and W planes (row pitch HV * tp): per-element offsets stay 32-bit.
    a_head = aw + bos * (HV * tp) + hv * tp
    w_head = a_head + aw_plane

    if ONE_TILE:
        # Every tree fits one row tile: straight-line code, no loops around the matrix products.
        M, C, q_r, k_r, fq_r, fk_r, g_r, beta_r = diagonal_tile(
            q, k, g, beta, k_out, g_cum, bits, bos, 0, hv, hk, o_t, o_k, t, scale, k_part, stride_q,
            stride_k, stride_g, stride_beta, HK, HV, DK, BT, LOG_BT, W, K_PART, L2NORM, PREC, BF16_DOTS, 0)
        p_rr = o_t[:, None] * (HV * tp) + o_t[None, :]
        # Whole rows up to tp (A, C and W are zero past t): row masks alone let the stores vectorise.
        m2 = (o_t < t)[:, None] & (o_t < tp)[None, :]
        A = M * beta_r[None, :]
        if STORE_C:
            # The value kernel forms C U itself: no C A product here.
            tl.store(w_head + p_rr, C, mask=m2)
            tl.store(a_head + p_rr, A, mask=m2)
        else:
            tl.store(a_head + p_rr, A, mask=m2)
            tl.store(w_head + p_rr, tl.dot(C, A, input_precision=PREC), mask=m2)
    else:
        for r in range(tl.cdiv(t, BT)):
            M, C, q_r, k_r, fq_r, fk_r, g_r, beta_r = diagonal_tile(
                q, k, g, beta, k_out, g_cum, bits, bos, r, hv, hk, o_t, o_k, t, scale, k_part,
                stride_q, stride_k, stride_g, stride_beta, HK, HV, DK, BT, LOG_BT, W, K_PART, L2NORM, PREC,
                BF16_DOTS, 1)
            rows = r * BT + o_t
            mr = rows < t
            A = M * beta_r[None, :]
            p_rr = rows[:, None] * (HV * tp) + rows[None, :]
            tl.store(a_head + p_rr, A, mask=mr[:, None] & mr[None, :])
            tl.store(w_head + p_rr, tl.dot(C, A, input_precision=PREC), mask=mr[:, None] & mr[None, :])
            # Earlier column tiles c (block forward substitution over the finished rows above):
            # A_rc = -M_rr sum_{j=c}^{r-1} G_rj A_jc,  W_rc = sum_{j=c}^{r} C_rj A_jc.
            for c in range(r):
                cols_c = c * BT + o_t
                acc_g = tl.zeros([BT, BT], dtype=tl.float32)
                acc_c = tl.zeros([BT, BT], dtype=tl.float32)
                for j in range(c, r):
                    G_rj, C_rj, cols_j = coupling(q_r, k_r, fq_r, fk_r, g_r, beta_r, k, stride_k, bits, g_cum,
                                                   bos, rows, j, hv, hk, o_t, o_k, t, HK, HV, DK, BT, W, L2NORM,
                                                   PREC, BF16_DOTS)
                    p_jc = cols_j[:, None] * (HV * tp) + cols_c[None, :]
                    A_jc = tl.load(a_head + p_jc, mask=(cols_j < t)[:, None] & (cols_c < t)[None, :], other=0.0)
                    acc_g += tl.dot(G_rj, A_jc, input_precision=PREC)
                    acc_c += tl.dot(C_rj, A_jc, input_precision=PREC)
                A_rc = -tl.dot(M, acc_g, input_precision=PREC)
                W_rc = acc_c + tl.dot(C, A_rc, input_precision=PREC)
                p_rc = rows[:, None] * (HV * tp) + cols_c[None, :]
                m_rc = mr[:, None] & (cols_c < t)[None, :]
                tl.store(a_head + p_rc, A_rc, mask=m_rc)
                tl.store(w_head + p_rc, W_rc, mask=m_rc)
            # Later row tiles read this tile's g_cum and A.
            tl.debug_barrier()


@triton.jit
def _residual(k, v, g_cum, s_hi, s_lo, s_t, bos, rows, hv, hk, o_k, o_v, t, stride_k, stride_v,
              HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, L2NORM: tl.constexpr,
              PREC: tl.constexpr, BF16_DOTS: tl.constexpr):
    """R = V - diag(P) K S of one row tile and value block (S^T given as s_t, or bf16 hi + lo)."""
    mr = rows < t
    k_r, fk_r = load_qk(k, stride_k, bos, rows, hk, o_k, t, 1.0, HK, DK, L2NORM, BF16_DOTS)
    p_r = tl.exp(tl.load(g_cum + bos * HV + hv + rows * HV, mask=mr, other=0.0))
    b_v = tl.load(v + bos * stride_v + hv * DV + (rows[:, None] * stride_v + o_v[None, :]),
                  mask=mr[:, None] & (o_v < DV)[None, :], other=0.0).to(tl.float32)
    if BF16_DOTS:
        # K S feeds u, which the commit folds into the state: S as bf16 hi + lo, two exact-product matmuls.
        ks = tl.dot(k_r, tl.trans(s_hi), tl.dot(k_r, tl.trans(s_lo)))
    else:
        ks = tl.dot(k_r, tl.trans(s_t), input_precision=PREC)
    return b_v - (p_r * fk_r)[:, None] * ks


@triton.jit
def _state_output(q, g_cum, s_hi, s_t, bos, rows, hv, hk, o_k, t, stride_q, scale, HK: tl.constexpr,
                  HV: tl.constexpr, DK: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                  BF16_DOTS: tl.constexpr):
    """diag(P) Q S of one row tile and value block (Q S only feeds the output: S in bf16 suffices)."""
    q_r, fq_r = load_qk(q, stride_q, bos, rows, hk, o_k, t, scale, HK, DK, L2NORM, BF16_DOTS)
    p_r = tl.exp(tl.load(g_cum + bos * HV + hv + rows * HV, mask=rows < t, other=0.0))
    if BF16_DOTS:
        qs = tl.dot(q_r, tl.trans(s_hi))
    else:
        qs = tl.dot(q_r, tl.trans(s_t), input_precision=PREC)
    return (p_r * fq_r)[:, None] * qs


@triton.jit(do_not_specialize_on_alignment=["state_idx", "cu_seqlens"])
def _tree_values_kernel(
    q, k, v, h0, state_idx, o, u_out, g_cum, aw, cu_seqlens, scale, aw_plane, tp,
    stride_q, stride_k, stride_v, stride_h_slot, stride_h_head, stride_h_v,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, BT: tl.constexpr, ONE_TILE: tl.constexpr, C_PLANE: tl.constexpr, L2NORM: tl.constexpr,
    PREC: tl.constexpr, BF16_DOTS: tl.constexpr,
):
    vb, hv, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    t = tl.load(cu_seqlens + b + 1) - tl.load(cu_seqlens + b)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = vb * BV + tl.arange(0, BV)
    mv = o_v < DV
    a_head = aw + bos * (HV * tp) + hv * tp
    w_head = a_head + aw_plane
    # This head's rows of u and o (row pitch HV * DV).
    uo = (bos * HV + hv) * DV
    # S^T block [BV, BK] of the committed state, read in place from the request's cache slot.
    slot = tl.load(state_idx + b).to(tl.int64)
    s_t = tl.load(h0 + slot * stride_h_slot + hv * stride_h_head + (o_v[:, None] * stride_h_v + o_k[None, :]),
                  mask=mv[:, None] & (o_k < DK)[None, :], other=0.0).to(tl.float32)
    s_hi = s_t.to(tl.bfloat16)
    s_lo = (s_t - s_hi.to(tl.float32)).to(tl.bfloat16)

    if ONE_TILE:
        # Every tree fits one row tile: nothing to stage.
        rows = o_t
        mr = rows < t
        R = _residual(k, v, g_cum, s_hi, s_lo, s_t, bos, rows, hv, hk, o_k, o_v, t, stride_k, stride_v,
                      HK, HV, DK, DV, L2NORM, PREC, BF16_DOTS)
        O = _state_output(q, g_cum, s_hi, s_t, bos, rows, hv, hk, o_k, t, stride_q, scale, HK, HV, DK, L2NORM,
                          PREC, BF16_DOTS)
        p_rr = rows[:, None] * (HV * tp) + rows[None, :]
        if C_PLANE:
            # One matrix tile wrote A and C in whole rows up to tp; O = P Q S + C U.
            m_rr = mr[:, None] & (rows < tp)[None, :]
            U = tl.dot(tl.load(a_head + p_rr, mask=m_rr, other=0.0), R, input_precision=PREC)
            O += tl.dot(tl.load(w_head + p_rr, mask=m_rr, other=0.0), U, input_precision=PREC)
        else:
            # A and W are lower triangular; the scratch above the diagonal may be unwritten.
            m_rr = mr[:, None] & (rows[None, :] <= rows[:, None])
            U = tl.dot(tl.load(a_head + p_rr, mask=m_rr, other=0.0), R, input_precision=PREC)
            O += tl.dot(tl.load(w_head + p_rr, mask=m_rr, other=0.0), R, input_precision=PREC)
        p_out = rows[:, None] * (HV * DV) + o_v[None, :]
        m2 = mr[:, None] & mv[None, :]
        tl.store(u_out + uo + p_out, U, mask=m2)
        tl.store(o + uo + p_out, O.to(o.dtype.element_ty), mask=m2)
    else:
        n_tiles = tl.cdiv(t, BT)
        # R of every tile, staged in u's rows. Row tile r reads R of tiles 0..r, so going last tile first,
        # each tile's U can overwrite its R.
        for c in range(n_tiles):
            rows = c * BT + o_t
            R = _residual(k, v, g_cum, s_hi, s_lo, s_t, bos, rows, hv, hk, o_k, o_v, t, stride_k, stride_v,
                          HK, HV, DK, DV, L2NORM, PREC, BF16_DOTS)
            tl.store(u_out + uo + (rows[:, None] * (HV * DV) + o_v[None, :]), R,
                     mask=(rows < t)[:, None] & mv[None, :])
        tl.debug_barrier()
        for i in range(n_tiles):
            r = n_tiles - 1 - i
            rows = r * BT + o_t
            mr = rows < t
            O = _state_output(q, g_cum, s_hi, s_t, bos, rows, hv, hk, o_k, t, stride_q, scale, HK, HV, DK,
                              L2NORM, PREC, BF16_DOTS)
            U = tl.zeros([BT, BV], dtype=tl.float32)
            for c in range(r + 1):
                cols = c * BT + o_t
                mc = cols < t
                R_c = tl.load(u_out + uo + (cols[:, None] * (HV * DV) + o_v[None, :]),
                              mask=mc[:, None] & mv[None, :], other=0.0)
                p_rc = rows[:, None] * (HV * tp) + cols[None, :]
                m_rc = mr[:, None] & (cols[None, :] <= rows[:, None])
                U += tl.dot(tl.load(a_head + p_rc, mask=m_rc, other=0.0), R_c, input_precision=PREC)
                O += tl.dot(tl.load(w_head + p_rc, mask=m_rc, other=0.0), R_c, input_precision=PREC)
            # Every thread has read this tile's R before any U overwrites it.
            tl.debug_barrier()
            p_out = rows[:, None] * (HV * DV) + o_v[None, :]
            m2 = mr[:, None] & mv[None, :]
            tl.store(u_out + uo + p_out, U, mask=m2)
            tl.store(o + uo + p_out, O.to(o.dtype.element_ty), mask=m2)


def k_part_width(bk: int, group: int) -> int:
    """Columns of k that each of the ``group`` value heads of a key head stores: an equal share where it is a
    power of two of at least 8, else 0 (the group's first head stores all)."""
    share = bk // group
    return share if group & (group - 1) == 0 and share >= 8 else 0


def verify_split(q, k, v, g, beta, h0, state_indices, bits, cu_seqlens, max_seqlen, o, factors, scale,
                 use_qk_l2norm_in_kernel, cfg, prec, bf16_dots):
    """Launch both kernels (arguments as prepared by :func:`triton_verify.tree_gdn_verify`)."""
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    batch = cu_seqlens.numel() - 1
    bt_m, bt_v, block_v = cfg["matrices_block_t"], cfg["block_t"], cfg["block_v"]
    # A and W of a request are [T, T]: each node's row holds one value per node of its tree.
    tp = max(16, triton.cdiv(max_seqlen, 16) * 16)
    aw = torch.empty(2, n, hv, tp, dtype=torch.float32, device=q.device)
    bk = max(16, triton.next_power_of_2(dk))
    # Both kernels see the whole tree as one tile: the second plane holds C and the value kernel forms C U.
    c_plane = max_seqlen <= bt_m and max_seqlen <= bt_v
    _tree_matrices_kernel[(hv, batch)](
        q, k, g, beta, factors.k, factors.g_cum, aw, bits, cu_seqlens, scale, aw[0].numel(), tp,
        q.stride(0), k.stride(0), g.stride(0), beta.stride(0),
        HK=hk, HV=hv, DK=dk, BK=bk, BT=bt_m, LOG_BT=bt_m.bit_length() - 1, W=bits.shape[1],
        K_PART=k_part_width(bk, hv // hk), ONE_TILE=max_seqlen <= bt_m, STORE_C=c_plane,
        L2NORM=use_qk_l2norm_in_kernel, PREC=prec, BF16_DOTS=bf16_dots, num_warps=cfg.get("matrices_num_warps", 4),
        num_stages=1)
    _tree_values_kernel[(triton.cdiv(dv, block_v), hv, batch)](
        q, k, v, h0, state_indices, o, factors.u, factors.g_cum, aw, cu_seqlens, scale, aw[0].numel(), tp,
        q.stride(0), k.stride(0), v.stride(0), *h0.stride()[:3],
        HK=hk, HV=hv, DK=dk, DV=dv, BK=bk, BV=block_v, BT=bt_v, ONE_TILE=max_seqlen <= bt_v, C_PLANE=c_plane,
        L2NORM=use_qk_l2norm_in_kernel, PREC=prec, BF16_DOTS=bf16_dots, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 1), **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
