"""Triton tree attention over vLLM's paged KV cache, and one-launch KV compaction (BOLE.md "Full-attention
layers").

Cache layout: vLLM 0.26's FlashAttention cache, logically ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` with K in the first half of the last dim and V in the second. Physical strides may differ
(any permutation or padding); the kernels take them as arguments. A slot is ``block * block_size + offset``
(vLLM's ``slot_mapping``); block tables map a request's position ``p`` to block ``table[p // block_size]``.

:func:`tree_attention_paged`: one program per (request, KV head, tile of ``BM`` nodes), every query head of
that KV head's GQA group in the same tile (``BM * group`` query rows). Online softmax (fp32) first over the
committed prefix ``[0, prefix_len)`` read through the block table, then over the request's tree region (its
last T positions) with the ancestor mask. Column tiles of the tree region are visited deepest first while
each row walks up its parent chain, so the whole ancestor relation costs one walk of every row's depth per
program: a column tile ``[j0, j0 + BN)`` records the nodes a row passes before all rows are above ``j0``
(parents precede children, so no ancestor of a later tile is missed). Exact for any tree size; row tiles
beyond ``BM`` nodes are further programs. No host sync when ``max_nodes`` is given, no allocation but the
output (pass ``out``), so it can be captured in a CUDA graph.

:func:`compact_kv_paged`: moves K/V from source slots to destination slots for every layer in one launch,
layers reached through a table of cache base addresses (like the GDN commit).
"""

import math

import torch
import triton
import triton.language as tl

from ..forest import ancestor_mask
from ..tree_gdn.triton_commit import device_table
from .reference import tree_attention


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 tiles as raw integers, so there the dots run in fp32.
    return triton.knobs.runtime.interpret


# ---------------------------------------------------------------------------------------------------------
# Tree attention
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _attend(Q, m_i, l_i, acc, kv_head, bt_row, pos, pos_ok, visible, scale_log2, kv_s0, kv_s2, kv_s3,
            D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr):
    """One online-softmax step over the keys at request positions ``pos`` (``visible``: [rows, keys])."""
    blk = tl.load(bt_row + pos // BS, mask=pos_ok, other=0).to(tl.int64)
    base = blk * kv_s0 + (pos % BS).to(tl.int64) * kv_s2
    d = tl.arange(0, DP)
    m2 = pos_ok[:, None] & (d < D)[None, :]
    K = tl.load(kv_head + base[:, None] + d[None, :] * kv_s3, mask=m2, other=0.0)
    V = tl.load(kv_head + base[:, None] + (d + D)[None, :] * kv_s3, mask=m2, other=0.0)
    if DOT_F32:
        K = K.to(tl.float32)
        V = V.to(tl.float32)
    s = tl.dot(Q, tl.trans(K), input_precision=PREC) * scale_log2
    s = tl.where(visible, s, float("-inf"))
    # m_i starts finite (-1e30), so a row with nothing visible in this tile gets p = 0 and alpha = 1.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(V.dtype), V, input_precision=PREC)
    return m_new, l_i, acc


@triton.jit
def _tree_attn_kernel(
    q, kv, out, block_table, seq_lens, query_start_loc, parent, tree_cu, scale_log2,
    q_s0, q_s1, o_s0, o_s1, kv_s0, kv_s1, kv_s2, kv_s3, bt_s0,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, DOT_F32: tl.constexpr, PREC: tl.constexpr,
):
    b, hkv, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(tree_cu + b)
    t = tl.load(tree_cu + b + 1) - bos
    m0 = tile * BM
    if m0 >= t:
        return
    qs = tl.load(query_start_loc + b)
    prefix = tl.load(seq_lens + b) - t
    R: tl.constexpr = BM * GP
    r = tl.arange(0, R)
    node = m0 + r // GP                      # local node of each query row
    g = r % GP
    row_ok = (node < t) & (g < G)
    head = hkv * G + g
    d = tl.arange(0, DP)
    md = row_ok[:, None] & (d < D)[None, :]
    Q = tl.load(q + ((qs + node).to(tl.int64) * q_s0 + head * q_s1)[:, None] + d[None, :], mask=md, other=0.0)
    if DOT_F32:
        Q = Q.to(tl.float32)
    m_i = tl.full([R], -1e30, tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DP], tl.float32)
    bt_row = block_table + b.to(tl.int64) * bt_s0
    kv_head = kv + hkv.to(tl.int64) * kv_s1
    cols = tl.arange(0, BN)

    # Committed prefix: every key visible; the loop ends at the prefix, so later blocks are never read.
    for start in range(0, prefix, BN):
        pos = start + cols
        ok = pos < prefix
        m_i, l_i, acc = _attend(Q, m_i, l_i, acc, kv_head, bt_row, pos, ok, ok[None, :], scale_log2,
                                kv_s0, kv_s2, kv_s3, D, DP, BS, DOT_F32, PREC)

    # Tree region: nodes m0 + BM - 1 and below hold every ancestor of this tile's rows.
    hi = tl.minimum(t, m0 + BM)
    n_ct = tl.cdiv(hi, BN)
    cur = tl.where(row_ok, node, -1)
    for jt in range(0, n_ct):
        j0 = (n_ct - 1 - jt) * BN
        j = j0 + cols
        vis = tl.zeros([R, BN], dtype=tl.int1)
        while tl.max(cur, 0) >= j0:
            vis = vis | (cur[:, None] == j[None, :])
            # Only rows still inside this tile or deeper step up; the others wait for a lower tile.
            up = cur >= j0
            cur = tl.where(up, tl.load(parent + bos + cur, mask=up, other=-1), cur)
        ok = j < hi
        m_i, l_i, acc = _attend(Q, m_i, l_i, acc, kv_head, bt_row, prefix + j, ok, vis & ok[None, :],
                                scale_log2, kv_s0, kv_s2, kv_s3, D, DP, BS, DOT_F32, PREC)

    l_i = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_i[:, None]
    tl.store(out + ((qs + node).to(tl.int64) * o_s0 + head * o_s1)[:, None] + d[None, :],
             o.to(out.dtype.element_ty), mask=md)


def launch_config(group: int, head_size: int, max_nodes: int, device: torch.device) -> dict:
    """Tile sizes: ``BM * next_pow2(group)`` query rows (at least 16 for tl.dot), ``BN`` keys per step."""
    gp = triton.next_power_of_2(group)
    rows = 64 if device.type == "cuda" else 16
    bm = min(max(1, rows // gp), triton.next_power_of_2(max(max_nodes, 1)))
    bm = max(bm, triton.cdiv(16, gp))
    bn = 32 if head_size >= 256 or device.type != "cuda" else 64
    return {"block_m": bm, "block_n": bn, "num_warps": 8 if head_size >= 256 else 4, "num_stages": 1}


def _check_cache(q, kv_cache):
    n_tok, hq, d = q.shape
    nb, hkv, bs, two_d = kv_cache.shape
    assert two_d == 2 * d, f"kv_cache last dim {two_d} must be 2 * head_size {d}"
    assert hq % hkv == 0, (hq, hkv)
    return hq, hkv, d, bs


def tree_attention_paged(q, kv_cache, block_table, seq_lens, query_start_loc, tree_parent, tree_cu, scale, *,
                         out=None, max_nodes=None, config=None):
    """Ancestor-masked attention of every tree node over its request's paged KV.

    q: ``[num_tokens, Hq, d]``; kv_cache: ``[num_blocks, Hkv, block_size, 2d]`` (any strides);
    block_table: ``[B, max_blocks]`` int32; seq_lens: ``[B]`` (prefix + tree, the tree's K/V already
    written at positions ``prefix .. seq_len - 1``); query_start_loc: ``[B+1]``, request b's rows start at
    ``query_start_loc[b]`` and are its T nodes in order; tree_parent: ``[N]`` int32 local parents (-1 root,
    parents first); tree_cu: ``[B+1]`` int32 node offsets (T = 0 skips a request). Rows outside every tree
    are left as they are in ``out`` (zeros when out is None). ``max_nodes`` (largest T, or its capacity)
    avoids a host sync. CPU tensors run :func:`tree_attention_paged_reference` unless Triton interprets.
    """
    hq, hkv, d, bs = _check_cache(q, kv_cache)
    if out is None:
        out = torch.zeros_like(q)
    if q.device.type != "cuda" and not _interpreting():
        return tree_attention_paged_reference(q, kv_cache, block_table, seq_lens, query_start_loc, tree_parent,
                                              tree_cu, scale, out=out)
    batch = tree_cu.numel() - 1
    if max_nodes is None:
        max_nodes = int((tree_cu[1:] - tree_cu[:-1]).max()) if batch else 0
    if batch == 0 or max_nodes == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == q.shape
    group = hq // hkv
    cfg = config or launch_config(group, d, max_nodes, q.device)
    bm, bn = cfg["block_m"], cfg["block_n"]
    assert bm * triton.next_power_of_2(group) >= 16 and bn >= 16
    dot_f32 = q.dtype == torch.float32 or _interpreting()
    grid = (batch, hkv, triton.cdiv(max_nodes, bm))
    _tree_attn_kernel[grid](
        q, kv_cache, out, block_table, seq_lens, query_start_loc, tree_parent, tree_cu, scale * math.log2(math.e),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_cache.stride(), block_table.stride(0),
        G=group, GP=triton.next_power_of_2(group), D=d, DP=max(16, triton.next_power_of_2(d)), BS=bs,
        BM=bm, BN=bn, DOT_F32=dot_f32, PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def gather_request_kv(kv_cache, block_table_row, seq_len: int):
    """K and V ``[seq_len, Hkv, d]`` of one request's positions ``0 .. seq_len - 1``."""
    d = kv_cache.shape[-1] // 2
    bs = kv_cache.shape[2]
    pos = torch.arange(seq_len, device=kv_cache.device)
    blk = block_table_row[pos // bs].long()
    rows = kv_cache[blk, :, pos % bs]                     # [seq_len, Hkv, 2d]
    return rows[..., :d], rows[..., d:]


def tree_attention_paged_reference(q, kv_cache, block_table, seq_lens, query_start_loc, tree_parent, tree_cu,
                                   scale, *, out=None, max_nodes=None, config=None):
    """Torch version of :func:`tree_attention_paged`: gathers each request's K/V and calls
    :func:`reference.tree_attention` (syncs; for CPU and tests)."""
    _check_cache(q, kv_cache)
    if out is None:
        out = torch.zeros_like(q)
    cu, qsl, lens = tree_cu.tolist(), query_start_loc.tolist(), seq_lens.tolist()
    for b in range(len(cu) - 1):
        t = cu[b + 1] - cu[b]
        if t == 0:
            continue
        k, v = gather_request_kv(kv_cache, block_table[b], lens[b])
        mask = ancestor_mask(tree_parent[cu[b]:cu[b + 1]].cpu()).to(q.device)
        rows = slice(qsl[b], qsl[b] + t)
        out[rows] = tree_attention(q[rows], k, v, mask, scale).to(out.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------
# KV compaction
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _compact_kernel(ptrs, ref, src, dst, idx_layer_stride, M, s0, s1, s2, s3,
                    BS: tl.constexpr, TWO_D: tl.constexpr, BD: tl.constexpr, BMC: tl.constexpr,
                    ALIGNED: tl.constexpr):
    layer, h, c = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    base = tl.load(ptrs + layer).to(tl.pointer_type(ref.dtype.element_ty))
    if ALIGNED:
        base = tl.multiple_of(base, 16)
    cols = c * BD + tl.arange(0, BD)
    c_off = (cols * s3)[None, :]
    c_ok = (cols < TWO_D)[None, :]
    head = h.to(tl.int64) * s1
    idx = layer.to(tl.int64) * idx_layer_stride
    for m0 in range(0, M, BMC):
        i = m0 + tl.arange(0, BMC)
        ok = i < M
        a = tl.load(src + idx + i, mask=ok, other=-1).to(tl.int64)
        z = tl.load(dst + idx + i, mask=ok, other=-1).to(tl.int64)
        ok = ok & (a >= 0) & (z >= 0)
        m2 = ok[:, None] & c_ok
        x = tl.load(base + ((a // BS) * s0 + (a % BS) * s2 + head)[:, None] + c_off, mask=m2)
        # Every source of the tile is read before any destination of it is written.
        tl.debug_barrier()
        tl.store(base + ((z // BS) * s0 + (z % BS) * s2 + head)[:, None] + c_off, x, mask=m2)
        tl.debug_barrier()


def compact_kv_paged(kv_caches, src_slots, dst_slots, *, block_d=128, block_m=64, num_warps=4):
    """Move K/V of slot ``src_slots[i]`` to slot ``dst_slots[i]`` in every layer's cache, in one launch.

    kv_caches: per-layer ``[num_blocks, Hkv, block_size, 2d]`` views of one shape, dtype and strides (any
    strides). src_slots, dst_slots: ``[M]`` int (shared by all layers) or ``[L, M]`` (per layer, e.g. layers
    of different KV-cache groups); negative entries are padding and skipped, so capacity-sized tensors work.
    All sources of a tile of ``block_m`` entries are read before its destinations are written; across
    tiles no destination may be a later entry's source (true of accepted paths listed in path order: the
    j-th path node moves from tree slot ``node >= j`` to slot j). CPU tensors run the reference.
    """
    kv_caches = list(kv_caches)
    if not kv_caches or src_slots.shape[-1] == 0:
        return
    ref = kv_caches[0]
    if ref.device.type != "cuda" and not _interpreting():
        compact_kv_paged_reference(kv_caches, src_slots, dst_slots)
        return
    assert all(c.shape == ref.shape and c.dtype == ref.dtype and c.stride() == ref.stride() for c in kv_caches)
    assert src_slots.shape == dst_slots.shape and src_slots.dim() in (1, 2)
    if src_slots.dim() == 2:
        assert src_slots.shape[0] == len(kv_caches)
    src_slots, dst_slots = src_slots.contiguous(), dst_slots.contiguous()
    nb, hkv, bs, two_d = ref.shape
    m = src_slots.shape[-1]
    ptrs = device_table([[c.data_ptr() for c in kv_caches]], ref.device)
    bd = min(block_d, triton.next_power_of_2(two_d))
    _compact_kernel[(len(kv_caches), hkv, triton.cdiv(two_d, bd))](
        ptrs[0], ref, src_slots, dst_slots, m if src_slots.dim() == 2 else 0, m, *ref.stride(),
        BS=bs, TWO_D=two_d, BD=bd, BMC=min(block_m, max(16, triton.next_power_of_2(m))),
        ALIGNED=all(c.data_ptr() % 16 == 0 for c in kv_caches), num_warps=num_warps,
    )


def compact_kv_paged_reference(kv_caches, src_slots, dst_slots):
    """Torch version of :func:`compact_kv_paged` (per layer: gather every valid source, then scatter)."""
    for layer, cache in enumerate(kv_caches):
        src = src_slots[layer] if src_slots.dim() == 2 else src_slots
        dst = dst_slots[layer] if dst_slots.dim() == 2 else dst_slots
        keep = (src >= 0) & (dst >= 0)
        src, dst = src[keep].long(), dst[keep].long()
        if src.numel() == 0:
            continue
        bs = cache.shape[2]
        rows = cache[src // bs, :, src % bs].clone()
        cache[dst // bs, :, dst % bs] = rows
