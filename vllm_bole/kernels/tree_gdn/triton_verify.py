"""Triton closed-form tree GDN verification (BOLE.md, Theorem 1), value-blocked.

One program per (request, value head, value split). Nodes are taken in row tiles of ``BT``. For each tile the
ancestor-masked G and C are built once on chip and (I + G)^{-1} of the tile is formed exactly by block
doubling (M_2b = M_b - M_b G_b M_b, with G_b the entries between the two halves of each 2b-block: the block
form of forward substitution, log2(BT) pairs of matmuls, stable at any depth). The program's value blocks
reuse G, C and the inverse; earlier tiles of a long tree enter through G_rc U_c and C_rc U_c.

The ancestor relation comes from a per-node bitmask built once per forest by pointer jumping
(:func:`ancestor_bits`), so the kernel never walks parent chains.

This fused kernel serves small batches and large trees; :func:`launch_config` sends the rest to the two-kernel
path of :mod:`triton_verify_split`, which builds the per-tree matrices once instead of once per value split.
"""

import torch
import triton
import triton.language as tl

from .reference import TreeFactors
from .triton_tiles import coupling, diagonal_tile, tile_log_decay
from .triton_verify_split import verify_split


# Both kernels here also run eagerly (steps with prefill chunks): no variant per alignment of the per-step index
# tensors, which they read at per-tree offsets anyway.
@triton.jit(do_not_specialize_on_alignment=["parent", "cu_seqlens"])
def _ancestor_bits_kernel(parent, cu_seqlens, bits, jump, W: tl.constexpr, TP: tl.constexpr,
                          WP: tl.constexpr, LOG: tl.constexpr):
    # bits[i] starts as {i}; after step s it covers i's ancestors closer than 2^s, jump[i] is the 2^s-th one.
    b = tl.program_id(0)
    bos = tl.load(cu_seqlens + b)
    t = tl.load(cu_seqlens + b + 1) - bos
    i = tl.arange(0, TP)
    w = tl.arange(0, WP)
    valid = i < t
    m2 = valid[:, None] & (w[None, :] < W)
    par = tl.load(parent + bos + i, mask=valid, other=-1)
    acc = tl.where(w[None, :] == (i // 32)[:, None], 1 << (i % 32)[:, None], 0)
    p_bits = bits + (bos + i)[:, None] * W + w[None, :]
    tl.store(p_bits, acc, mask=m2)
    tl.store(jump + bos + i, par, mask=valid)
    for _ in tl.static_range(LOG):
        tl.debug_barrier()
        has = valid & (par >= 0)
        acc |= tl.load(bits + (bos + par)[:, None] * W + w[None, :], mask=has[:, None] & m2, other=0)
        par = tl.load(jump + bos + par, mask=has, other=-1)
        tl.debug_barrier()
        tl.store(p_bits, acc, mask=m2)
        tl.store(jump + bos + i, par, mask=valid)


def ancestor_bits(parent: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """``[N, ceil(max_seqlen/32)]`` int32: bit j of node i's row is set iff local node j is i or its ancestor.

    Depends only on the forest, so one call serves every layer and head.
    """
    n, batch = parent.numel(), cu_seqlens.numel() - 1
    words = max(1, triton.cdiv(max_seqlen, 32))
    bits = torch.empty(n, words, dtype=torch.int32, device=parent.device)
    jump = torch.empty(n, dtype=torch.int32, device=parent.device)
    tp = max(16, triton.next_power_of_2(max_seqlen))
    if n and batch:
        _ancestor_bits_kernel[(batch,)](parent, cu_seqlens, bits, jump, W=words, TP=tp,
                                        WP=max(2, triton.next_power_of_2(words)), LOG=tp.bit_length() - 1,
                                        num_warps=4)
    return bits


@triton.jit(do_not_specialize_on_alignment=["state_idx", "cu_seqlens"])
def _tree_gdn_verify_kernel(
    q, k, v, g, beta, h0, state_idx, o, k_out, u_out, g_cum, bits, cu_seqlens, scale,
    stride_q, stride_k, stride_v, stride_g, stride_beta, stride_h_slot, stride_h_head, stride_h_v,
    HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, NVB: tl.constexpr, BT: tl.constexpr, LOG_BT: tl.constexpr, W: tl.constexpr,
    L2NORM: tl.constexpr, PREC: tl.constexpr, BF16_DOTS: tl.constexpr,
):
    b, hv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    t = tl.load(cu_seqlens + b + 1) - tl.load(cu_seqlens + b)
    n_tiles = tl.cdiv(t, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    mk = o_k < DK
    # The first value split of a key head's first value head stores k.
    k_part = tl.where((split == 0) & (hv % (HV // HK) == 0), 0, -1)
    # The committed state is read in place from the request's cache slot (no gathered copy).
    slot = tl.load(state_idx + b).to(tl.int64)
    h0_head = h0 + slot * stride_h_slot + hv * stride_h_head
    # This head's rows of u and o (row pitch HV * DV).
    uo = (bos * HV + hv) * DV

    # log P_i = sum of g over the ancestors of i and i itself.
    for r in range(n_tiles):
        rows = r * BT + o_t
        tl.store(g_cum + bos * HV + hv + rows * HV, tile_log_decay(g, bits, bos, rows, r, hv, o_t, t, stride_g, BT, W),
                 mask=rows < t)
    tl.debug_barrier()

    for r in range(n_tiles):
        rows = r * BT + o_t
        mr = rows < t
        M, C, q_r, k_r, fq_r, fk_r, g_r, beta_r = diagonal_tile(
            q, k, g, beta, k_out, g_cum, bits, bos, r, hv, hk, o_t, o_k, t, scale, k_part, stride_q,
            stride_k, stride_g, stride_beta, HK, HV, DK, BT, LOG_BT, W, 0, L2NORM, PREC, BF16_DOTS, 2)
        p_r = tl.exp(g_r)

        # The previous tile's coupling is shared by all value blocks (trees up to 2 tiles need no other);
        # older tiles are rebuilt per value block, keeping the register footprint flat.
        G_p = tl.zeros([BT, BT], dtype=tl.float32)
        C_p = tl.zeros([BT, BT], dtype=tl.float32)
        cols_p = rows - BT
        if r > 0:
            G_p, C_p, cols_p = coupling(q_r, k_r, fq_r, fk_r, g_r, beta_r, k, stride_k, bits, g_cum, bos, rows,
                                         r - 1, hv, hk, o_t, o_k, t, HK, HV, DK, BT, W, L2NORM, PREC, BF16_DOTS)

        for vb in range(NVB):
            o_v = (split * NVB + vb) * BV + tl.arange(0, BV)
            mv = o_v < DV
            # S^T block [BV, BK] of the committed state (vLLM's [dv, dk] layout).
            s_t = tl.load(h0_head + (o_v[:, None] * stride_h_v + o_k[None, :]),
                          mask=mv[:, None] & mk[None, :], other=0.0).to(tl.float32)
            b_v = tl.load(v + bos * stride_v + hv * DV + (rows[:, None] * stride_v + o_v[None, :]),
                          mask=mr[:, None] & mv[None, :], other=0.0).to(tl.float32)
            if BF16_DOTS:
                # K S feeds u, which the commit folds into the state: S as bf16 hi + lo, two exact-product
                # matmuls (~16 mantissa bits). Q S only feeds this step's bf16 output: S in bf16 suffices.
                s_hi = s_t.to(tl.bfloat16)
                s_lo = (s_t - s_hi.to(tl.float32)).to(tl.bfloat16)
                ks = tl.dot(k_r, tl.trans(s_hi), tl.dot(k_r, tl.trans(s_lo)))
                qs = tl.dot(q_r, tl.trans(s_hi))
            else:
                ks = tl.dot(k_r, tl.trans(s_t), input_precision=PREC)
                qs = tl.dot(q_r, tl.trans(s_t), input_precision=PREC)
            R = beta_r[:, None] * (b_v - (p_r * fk_r)[:, None] * ks)
            O = (p_r * fq_r)[:, None] * qs
            if r > 0:
                u_p = tl.load(u_out + uo + (cols_p[:, None] * (HV * DV) + o_v[None, :]),
                              mask=mv[None, :], other=0.0)
                R -= tl.dot(G_p, u_p, input_precision=PREC)
                O += tl.dot(C_p, u_p, input_precision=PREC)
            for c in range(r - 1):
                G_rc, C_rc, cols = coupling(q_r, k_r, fq_r, fk_r, g_r, beta_r, k, stride_k, bits, g_cum, bos,
                                             rows, c, hv, hk, o_t, o_k, t, HK, HV, DK, BT, W, L2NORM, PREC,
                                             BF16_DOTS)
                u_c = tl.load(u_out + uo + (cols[:, None] * (HV * DV) + o_v[None, :]),
                              mask=mv[None, :], other=0.0)
                R -= tl.dot(G_rc, u_c, input_precision=PREC)
                O += tl.dot(C_rc, u_c, input_precision=PREC)
            U = tl.dot(M, R, input_precision=PREC)
            O += tl.dot(C, U, input_precision=PREC)
            m2 = mr[:, None] & mv[None, :]
            p_out = rows[:, None] * (HV * DV) + o_v[None, :]
            tl.store(u_out + uo + p_out, U, mask=m2)
            tl.store(o + uo + p_out, O.to(o.dtype.element_ty), mask=m2)
        # Later tiles read this tile's u.
        tl.debug_barrier()


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 tiles as raw integers, so there the dots run in fp32.
    return triton.knobs.runtime.interpret


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def launch_config(batch: int, hv: int, dv: int, max_seqlen: int, device: torch.device) -> dict:
    """Launch parameters, from sweeps on H200 at Qwen3.5 shapes (benchmarks/gdn_kernels.py --sweep).

    The two-kernel path (:mod:`triton_verify_split`: per-tree matrices once, then one program per value
    block) measured fastest for trees of 33 to 64 nodes at every batch, each tree one 64-row tile; for trees
    of up to 32 nodes from half a program per SM on, and for trees of up to 16 from two. From two programs
    per SM on, the matrices take 16-row tiles with 2 warps: a longer chain per program, but half the
    registers, so twice the programs in flight. The value kernel of 64-row tiles is capped at 128 registers
    (``maxnreg``). Elsewhere the fused kernel: under half a program per SM every
    32-wide value block gets its own program (each rebuilds G and C) with 16-node tiles, otherwise one
    program per (request, head) walks value blocks of 64 with row tiles of up to 32 nodes.
    """
    sms, programs = _num_sms(device), batch * hv
    tile = max(16, triton.next_power_of_2(max_seqlen))
    if tile == 64 or (tile <= 32 and programs >= (2 * sms if tile == 16 else sms // 2)):
        matrices_tile = 16 if tile <= 32 and programs >= 2 * sms else tile
        cfg = {"matrices_block_t": matrices_tile, "matrices_num_warps": 2 if matrices_tile == 16 else 4,
               "block_t": tile, "block_v": min(32 if tile == 16 else 64, max(16, triton.next_power_of_2(dv))),
               "num_warps": 4, "num_stages": 1}
        if tile == 64:
            # 64-row value tiles at 128 registers: four programs per SM instead of three.
            cfg["maxnreg"] = 128
        return cfg
    if programs < sms // 2:
        block_t, block_v = 16, min(32, max(16, triton.next_power_of_2(dv)))
        splits = triton.cdiv(dv, block_v)
    else:
        block_t = min(32, tile)
        block_v, splits = min(64, max(16, triton.next_power_of_2(dv))), 1
    return {"block_t": block_t, "block_v": block_v, "v_splits": splits, "num_warps": 4, "num_stages": 1}


def launch_variant(batch: int, hv: int, dv: int, max_seqlen: int, device: torch.device) -> tuple:
    """What decides which compiled variant of the kernels a launch uses, besides the model's shapes: the launch
    parameters and the largest tree's size class (row tiles, one tile or more, bit words). Launches of equal
    variants compile once (the start-up warm-up launches one of each, ``worker/kernel_warmup.py``)."""
    cfg = launch_config(batch, hv, dv, max_seqlen, device)
    return tuple(sorted(cfg.items())) + (max(16, triton.next_power_of_2(max_seqlen)), triton.cdiv(max_seqlen, 32))


def tree_gdn_verify(q, k, v, g, beta, initial_state, parent, cu_seqlens, *, scale=None,
                    use_qk_l2norm_in_kernel=False, state_indices=None, max_seqlen=None, bits=None,
                    out_factors=None, config=None, out=None):
    """Same contract as :func:`reference.tree_gdn_verify`.

    initial_state may be any float dtype with a contiguous last dim; with ``state_indices`` it is a whole
    state cache read in place. max_seqlen (largest tree; read from cu_seqlens when None, which syncs) and
    bits (from :func:`ancestor_bits`, shared by all layers of one forest) let a caller skip the host sync and
    the per-layer mask build; out_factors (a :class:`TreeFactors` of preallocated tensors) receives the
    factors, e.g. one layer's slice of a step-wide buffer; out (contiguous ``[N, HV, dv]``, dtype of v) receives
    the output, e.g. the layer's own output buffer; config overrides :func:`launch_config`.
    """
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    batch = cu_seqlens.numel() - 1
    assert hv % hk == 0 and initial_state.shape[1:] == (hv, dv, dk)
    if state_indices is None:
        assert initial_state.shape[0] == batch
        state_indices = torch.arange(batch, dtype=torch.int32, device=q.device)
    assert state_indices.shape == (batch,)
    assert q.stride(-1) == 1 and q.stride(-2) == dk and k.stride() == q.stride()
    assert v.stride(-1) == 1 and v.stride(-2) == dv
    scale = dk ** -0.5 if scale is None else scale
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if batch else 0
    if bits is None:
        bits = ancestor_bits(parent, cu_seqlens, max(max_seqlen, 1))
    h0 = initial_state if initial_state.stride(-1) == 1 else initial_state.contiguous()
    cfg = config or launch_config(batch, hv, dv, max_seqlen, q.device)
    # 64-row tiles run on Hopper's asynchronous matmul path, which Triton 3.6 miscompiled under the fused
    # kernel's loops (illegal addresses on H200); the two-kernel path takes them only for one-tile trees.
    if "matrices_block_t" in cfg:
        tiles = (cfg["matrices_block_t"], cfg["block_t"])
        assert all(bt in (16, 32) or (bt == 64 and max_seqlen <= 64) for bt in tiles), f"row tiles {tiles}"
    else:
        assert cfg["block_t"] in (16, 32), f"block_t must be 16 or 32, got {cfg['block_t']}"

    o = torch.empty(n, hv, dv, dtype=v.dtype, device=q.device) if out is None else out
    assert o.shape == (n, hv, dv) and o.dtype == v.dtype and o.is_contiguous()
    if out_factors is None:
        out_factors = TreeFactors(k=torch.empty(n, hk, dk, dtype=torch.float32, device=q.device),
                                  u=torch.empty(n, hv, dv, dtype=torch.float32, device=q.device),
                                  g_cum=torch.empty(n, hv, dtype=torch.float32, device=q.device))
    k_out, u, g_cum = out_factors.k, out_factors.u, out_factors.g_cum
    assert k_out.shape == (n, hk, dk) and u.shape == (n, hv, dv) and g_cum.shape == (n, hv)
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in (k_out, u, g_cum))
    # fp32 inputs keep fp32 accuracy (3 tf32 passes); with 16-bit inputs only the fp32 intermediates
    # (inverse, C U) go through tf32, below the bf16 rounding of the output.
    prec = "tf32x3" if q.dtype == torch.float32 else "tf32"
    bf16_dots = q.dtype == torch.bfloat16 and not _interpreting()
    if n and batch and "matrices_block_t" in cfg:

        verify_split(q, k, v, g, beta, h0, state_indices, bits, cu_seqlens, max_seqlen, o, out_factors,
                     scale, use_qk_l2norm_in_kernel, cfg, prec, bf16_dots)
    elif n and batch:
        block_v, splits = cfg["block_v"], cfg["v_splits"]
        nvb = triton.cdiv(triton.cdiv(dv, block_v), splits)
        _tree_gdn_verify_kernel[(batch, hv, splits)](
            q, k, v, g, beta, h0, state_indices, o, k_out, u, g_cum, bits, cu_seqlens, scale,
            q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0), *h0.stride()[:3],
            HK=hk, HV=hv, DK=dk, DV=dv, BK=max(16, triton.next_power_of_2(dk)), BV=block_v, NVB=nvb,
            BT=cfg["block_t"], LOG_BT=cfg["block_t"].bit_length() - 1, W=bits.shape[1],
            L2NORM=use_qk_l2norm_in_kernel, PREC=prec, BF16_DOTS=bf16_dots,
            num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 1),
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
        )
    return o, out_factors
