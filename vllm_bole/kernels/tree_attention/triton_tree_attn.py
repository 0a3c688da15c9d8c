"""Triton tree attention over vLLM's paged KV cache, and one-launch KV compaction (BOLE.md "Full-attention
layers").

Cache layout: vLLM 0.26's FlashAttention cache, logically ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` with K in the first half of the last dim and V in the second. Physical strides may differ
(any permutation or padding); the kernels take them as arguments. A slot is ``block * block_size + offset``
(vLLM's ``slot_mapping``); block tables map a request's position ``p`` to block ``table[p // block_size]``.

Tree rows (built once per forward by ``step.forest.DeviceTreeRows``): tree request i has
``meta[i] = (batch index b, first query row, rows n, region length T, first row of bits)``. Its positions
``seq_lens[b] - T .. seq_lens[b] - 1`` are its region (K/V already in the cache), the positions before them
its committed prefix, and its n query rows are the region's last n positions. Query row r sees region key j
iff bit ``j % 32`` of ``bits[first + r, j // 32]`` is set (its ancestors and itself).

:func:`tree_attention_paged`: one program per (tile of ``BM`` rows [, part of the value columns], KV head, tree
request), every query head of that KV head's GQA group in the same tile (``BM * group`` query rows), online
softmax in fp32 over one loop of key tiles: the committed prefix, then the region keys its rows see (tiles aligned
to the ancestor-bit words). The committed prefix either comes from FlashAttention's non-causal pass over it
(``prefix_out`` / ``prefix_lse``, merged in the epilogue; FlashAttention splits long prefixes over the whole
GPU) or is read by the same programs first (one launch, for short prefixes). Where the loop spans few cache
blocks their ids sit in registers, so no load of the loop depends on another and the key tiles are fetched
stages ahead. No host sync and no allocation, so it can run between CUDA-graph pieces or inside a graph.

:func:`compact_kv_paged`: moves K/V from source slots to destination slots for every layer in one launch,
layers reached through a table of cache base addresses (like the GDN commit).
"""

import math
import re

import torch
import triton
import triton.language as tl

from ..launch import device_table, launch_plan
from .reference import FlashPagedKV, paged_tree_attention

META_FIELDS = 5  # batch index, first query row, rows, region length, first row of bits


def _interpreting() -> bool:
    # Triton's interpreter multiplies bf16 tiles as raw integers, so there the dots run in fp32.
    return triton.knobs.runtime.interpret


# ---------------------------------------------------------------------------------------------------------
# Tree attention
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _kv_tile(kv_head, bt_row, table, pg0, pos, ok, kv_s0, kv_s2, kv_s3, dv0, D: tl.constexpr, DP: tl.constexpr,
             DV: tl.constexpr, BS: tl.constexpr, NPG: tl.constexpr, DOT_F32: tl.constexpr):
    """K ``[keys, DP]`` and the program's V columns ``dv0 ..`` ``[keys, DV]`` at request positions ``pos``
    (zeros where not ``ok``: nothing outside the request is read). With ``NPG`` the blocks come from ``table``
    (the request's blocks from block ``pg0`` on, in registers), so the loads of a key tile depend on no other
    load of the loop and the compiler can issue them stages ahead."""
    if NPG > 0:
        blk = tl.gather(table, tl.minimum(tl.maximum(pos // BS - pg0, 0), NPG - 1), 0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // BS, mask=ok, other=0).to(tl.int64)
    base = blk * kv_s0 + (pos % BS).to(tl.int64) * kv_s2
    d = tl.arange(0, DP)
    e = dv0 + tl.arange(0, DV)
    K = tl.load(kv_head + base[:, None] + d[None, :] * kv_s3, mask=ok[:, None] & (d < D)[None, :], other=0.0)
    V = tl.load(kv_head + base[:, None] + (e + D)[None, :] * kv_s3, mask=ok[:, None] & (e < D)[None, :], other=0.0)
    if DOT_F32:
        K = K.to(tl.float32)
        V = V.to(tl.float32)
    return K, V


@triton.jit
def _attend(Q, m_i, l_i, acc, K, V, visible, scale_log2, PREC: tl.constexpr):
    """One online-softmax step over a key tile (``visible``: [rows, keys])."""
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
def _prefix_partial(prefix_out, prefix_lse, row, head, e, me, row_ok, p_s0, p_s1, lse_s0, lse_s1):
    """FlashAttention's prefix partial of the tile's rows (LSE in log2 units, normalised output columns ``e``).
    Read whatever the prefix length: rows of an empty prefix may hold anything (FA2 writes +inf LSE, FA3 -inf,
    NaN elsewhere) and the epilogue selects them away, so the loads need not wait for ``seq_lens``."""
    lse_p = tl.load(prefix_lse + head * lse_s0 + row * lse_s1, mask=row_ok, other=float("-inf"))
    o_p = tl.load(prefix_out + (row * p_s0 + head * p_s1)[:, None] + e[None, :], mask=me, other=0.0)
    return lse_p * 1.4426950408889634, o_p


# Runs eagerly in steps that mix trees and prefill chunks: per-step sizes (bit words, the prefix LSE's row stride:
# the step's token count) and the alignment of per-step tensors read a word per row (the bits of a packed forest
# follow its meta, at an offset of 20 bytes per tree) do not make Triton compile a variant mid-serving.
@triton.jit(do_not_specialize=["words", "lse_s0"], do_not_specialize_on_alignment=["seq_lens", "meta", "bits"])
def _tree_attn_kernel(
    q, kv, out, prefix_out, prefix_lse, block_table, seq_lens, meta, bits, words, scale_log2, meta_s0,
    q_s0, q_s1, o_s0, o_s1, p_s0, p_s1, lse_s0, lse_s1, kv_s0, kv_s1, kv_s2, kv_s3, bt_s0,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, DV: tl.constexpr, BS: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NPG: tl.constexpr, MERGE: tl.constexpr, EARLY: tl.constexpr,
    DOT_F32: tl.constexpr, PREC: tl.constexpr,
):
    # Tiles (and value-column parts) of one (request, KV head) are neighbours in launch order, so they read
    # that request's K/V from L2 at about the same time.
    pid, hkv, i = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NDV: tl.constexpr = DP // DV
    tile = pid // NDV
    dv0 = (pid % NDV) * DV
    fields = meta + i * meta_s0
    b = tl.load(fields)
    row0 = tl.load(fields + 1)
    n = tl.load(fields + 2)
    t = tl.load(fields + 3)
    bit0 = tl.load(fields + 4)
    m0 = tile * BM
    if m0 >= n:
        return
    R: tl.constexpr = BM * GP
    r = tl.arange(0, R)
    node = m0 + r // GP                      # query row of the request
    g = r % GP
    row_ok = (node < n) & (g < G)
    head = hkv * G + g
    row = (row0 + node).to(tl.int64)
    d = tl.arange(0, DP)
    Q = tl.load(q + (row * q_s0 + head * q_s1)[:, None] + d[None, :], mask=row_ok[:, None] & (d < D)[None, :],
                other=0.0)
    if DOT_F32:
        Q = Q.to(tl.float32)
    e = dv0 + tl.arange(0, DV)
    me = row_ok[:, None] & (e < D)[None, :]
    if MERGE:
        if EARLY:   # its latency hides behind the keys
            lse_p, o_p = _prefix_partial(prefix_out, prefix_lse, row, head, e, me, row_ok, p_s0, p_s1, lse_s0,
                                         lse_s1)
    prefix = tl.load(seq_lens + b) - t
    m_i = tl.full([R], -1e30, tl.float32)
    l_i = tl.zeros([R], tl.float32)
    acc = tl.zeros([R, DV], tl.float32)
    bt_row = block_table + b.to(tl.int64) * bt_s0
    kv_head = kv + hkv.to(tl.int64) * kv_s1

    # One loop over key tiles: first the committed prefix (only without MERGE; every key visible to every row,
    # no bits read), then the region up to the tile's last row (a row sees no key after its own, region key
    # t - n + node) in tiles aligned to the bit words: one word per row and tile (two for 64 keys), no per-key
    # gather. One loop keeps one software pipeline across both parts.
    tl.static_assert(BN == 16 or BN == 32 or BN == 64)
    cols = tl.arange(0, BN)
    nr = tl.minimum(t, t - n + m0 + BM)
    n_pre = 0 if MERGE else tl.cdiv(prefix, BN)
    bit_row = bits + (bit0 + node).to(tl.int64) * words
    pg0 = prefix // BS if MERGE else 0               # first block the loop reads
    if NPG > 0:
        pg = pg0 + tl.arange(0, NPG)
        table = tl.load(bt_row + pg, mask=pg < tl.cdiv(prefix + t, BS), other=0)
    else:
        table = pg0                                  # not read
    for it in range(0, n_pre + tl.cdiv(nr, BN)):
        in_pre = it < n_pre
        j0 = tl.maximum(it - n_pre, 0) * BN          # region key of the tile's first column
        start = tl.where(in_pre, it * BN, prefix + j0)
        ok = tl.where(in_pre, start + cols < prefix, j0 + cols < nr)
        w = j0 // 32
        in_reg = row_ok & (it >= n_pre)
        if BN == 64:
            lo_w = tl.load(bit_row + w, mask=in_reg, other=0)
            hi_w = tl.load(bit_row + w + 1, mask=in_reg & (w + 1 < words), other=0)
            word = tl.where((cols < 32)[None, :], lo_w[:, None], hi_w[:, None])
            seen = (word >> (cols % 32)[None, :]) & 1
        else:
            word = tl.load(bit_row + w, mask=in_reg, other=0)
            seen = (word[:, None] >> ((j0 % 32) + cols)[None, :]) & 1
        vis = ((seen != 0) | in_pre) & ok[None, :]
        K, V = _kv_tile(kv_head, bt_row, table, pg0, start + cols, ok, kv_s0, kv_s2, kv_s3, dv0, D, DP, DV, BS, NPG,
                        DOT_F32)
        m_i, l_i, acc = _attend(Q, m_i, l_i, acc, K, V, vis, scale_log2, PREC)

    if MERGE:
        if not EARLY:
            lse_p, o_p = _prefix_partial(prefix_out, prefix_lse, row, head, e, me, row_ok, p_s0, p_s1, lse_s0,
                                         lse_s1)
        has = prefix > 0
        lse_p = tl.where(has, lse_p, float("-inf"))
        m_all = tl.maximum(m_i, lse_p)
        w_tree = tl.exp2(m_i - m_all)
        w_prefix = tl.exp2(lse_p - m_all)
        den = l_i * w_tree + w_prefix
        den = tl.where(den > 0, den, 1.0)
        o_p = tl.where(has, o_p.to(tl.float32), 0.0)
        o = (acc * w_tree[:, None] + o_p * w_prefix[:, None]) / den[:, None]
    else:
        l_i = tl.where(l_i > 0, l_i, 1.0)
        o = acc / l_i[:, None]
    tl.store(out + (row * o_s0 + head * o_s1)[:, None] + e[None, :], o.to(out.dtype.element_ty), mask=me)


def tile_config(rows: int, block_n: int, num_warps: int, num_stages: int, group: int, max_rows: int,
                maxnreg: int | None = None, value_parts: int = 1) -> dict:
    """A tile of about ``rows`` query rows (``block_m`` tree rows times ``next_pow2(group)`` heads, at least 16
    for tl.dot, no more tree rows than ``max_rows`` needs) and ``block_n`` keys per step (16, 32 or 64);
    ``value_parts`` programs share a tile, each accumulating its part of the value columns (fewer registers,
    more programs, the scores computed once per part); ``maxnreg`` caps the registers per thread."""
    gp = triton.next_power_of_2(group)
    bm = min(max(1, rows // gp), triton.next_power_of_2(max(max_rows, 1)))
    bm = max(bm, triton.cdiv(16, gp))
    return {"block_m": bm, "block_n": block_n, "num_warps": num_warps, "num_stages": num_stages,
            "value_parts": value_parts, "maxnreg": maxnreg}


def config_name(cfg: dict, group: int) -> str:
    """``r{rows}n{keys}w{warps}s{stages}[v{value parts}][m{maxnreg}]`` of a launch configuration (rows: query
    rows of a tile)."""
    rows = cfg["block_m"] * triton.next_power_of_2(group)
    parts = f"v{cfg['value_parts']}" if cfg.get("value_parts", 1) > 1 else ""
    cap = f"m{cfg['maxnreg']}" if cfg.get("maxnreg") else ""
    return f"r{rows}n{cfg['block_n']}w{cfg['num_warps']}s{cfg['num_stages']}{parts}{cap}"


def parse_config(name: str, group: int, max_rows: int) -> dict:
    """The launch configuration named ``name`` (:func:`config_name`) for trees of up to ``max_rows`` rows."""
    m = re.fullmatch(r"r(\d+)n(\d+)w(\d+)s(\d+)(?:v(\d+))?(?:m(\d+))?", name)
    if m is None:
        raise ValueError(f"not a launch configuration name: {name!r}")
    r, n, w, s, v, cap = (int(x) if x else None for x in m.groups())
    return tile_config(r, n, w, s, group, max_rows, cap, v or 1)


# Launch configurations fit to the H200 runs of benchmarks/tree_attention.py (Qwen3.5-9B heads, block size 304):
# - steps of at most SMALL_STEP_ROWS tree rows (requests times the largest tree) run 16-row tiles, whose few
#   programs are latency-bound: the single route's loop over prefix and region pipelined three deep (B=1,
#   prefix 1024, 4 nodes: 59.0 us against 63.0 two deep); the split route's region loop, one key tile long
#   while the trees have at most 32 rows, with 8 warps and nothing to pipeline (18.3 against 19.0 us at that
#   shape), else two deep (25.2 us at 64 nodes);
# - larger steps run 64-row tiles of 16 keys three deep, two programs a multiprocessor (B=8 x 64 nodes, prefix
#   128: 17.1 us against 23.7 for the unpipelined 64-row tile of 8 warps);
# - steps of more than LARGE_STEP_ROWS rows run 128-row tiles of 8 warps, which read each request's keys half
#   as often (B=32 x 64 nodes, prefix 128: 37.3 against 43.2 us; prefix 1024, split route: 101.8 against 102.7).
SMALL_STEP_ROWS = 128
LARGE_STEP_ROWS = 1024


def launch_config(group: int, head_size: int, max_rows: int, num_trees: int, device: torch.device,
                  merge: bool = False, fp32: bool = False) -> dict:
    """The tile for a launch of ``num_trees`` requests of at most ``max_rows`` rows (host values only, so a
    CUDA graph's capacity bounds pick the same tile at every replay); ``merge``: the split route's launch; ``fp32``:
    float32 queries and keys, whose 128-row tile pipelined three deep would need 385 KiB of shared memory (Hopper
    has 227), so they keep the 64-row tile."""
    if device.type != "cuda":
        return tile_config(16, 32, 4, 1, group, max_rows)
    rows = num_trees * max_rows
    if rows <= SMALL_STEP_ROWS:
        if not merge:
            return tile_config(16, 32, 4, 3, group, max_rows)
        return tile_config(16, 32, 8, 1, group, max_rows) if max_rows <= 32 else tile_config(16, 32, 4, 2, group,
                                                                                               max_rows)
    if rows <= LARGE_STEP_ROWS or fp32:
        return tile_config(64, 16, 4, 3, group, max_rows)
    return tile_config(128, 32, 8, 3, group, max_rows)


# A launch reads the blocks of its key loop from a table in registers (no dependent load in the loop) when the
# loop spans at most this many cache blocks.
MAX_TABLE_BLOCKS = 16


def table_blocks(block_size: int, region_keys: int, max_seq_len: int | None, merge: bool) -> int:
    """Cache blocks the key loop of one program may touch (a power of two), or 0 for more than
    ``MAX_TABLE_BLOCKS`` or an unknown bound: the split route's loop spans the region (at most
    ``region_keys``, from any offset), the single route's the whole sequence (at most ``max_seq_len``)."""
    if merge:
        blocks = triton.cdiv(max(region_keys - 1, 0), block_size) + 1
    elif max_seq_len is None:
        return 0
    else:
        blocks = max(triton.cdiv(max_seq_len, block_size), 1)
    blocks = triton.next_power_of_2(blocks)
    return blocks if blocks <= MAX_TABLE_BLOCKS else 0


def launch_variant(group: int, head_size: int, max_rows: int, num_trees: int, device: torch.device,
                   merge: bool, fp32: bool = False) -> tuple:
    """What decides which compiled variant of the kernel a launch of :func:`tree_attention_paged` uses besides
    the model's shapes and the route's bound on sequences: the tile and the words of the bit rows."""
    cfg = launch_config(group, head_size, max_rows, num_trees, device, merge, fp32)
    return tuple(sorted(cfg.items())) + (merge, triton.cdiv(max_rows, 32))


def tree_attention_paged(q, kv_cache, block_table, seq_lens, meta, bits, scale, *, max_rows, out=None,
                         prefix_out=None, prefix_lse=None, config=None, max_seq_len=None):
    """Ancestor-masked attention of every tree row over its request's paged KV (see the module docstring).

    q: ``[num_tokens, Hq, d]``; kv_cache: ``[num_blocks, Hkv, block_size, 2d]`` (any strides); block_table:
    ``[B, max_blocks]`` int32; seq_lens: ``[B]``; meta: ``[R, 5]`` int32; bits: ``[rows, words]`` int32;
    max_rows: the largest request's rows (or a capacity: it sizes the grid). prefix_out ``[num_tokens, Hq, d]``
    and prefix_lse ``[Hq, num_tokens]``: FlashAttention's non-causal pass over every tree request's prefix
    (may be ``out`` itself); without them the kernel reads the prefix too. Rows outside every tree are left as
    they are in ``out`` (zeros when out is None). max_seq_len: a host bound on every tree request's sequence
    length (None: unknown), so a short single-route loop reads its blocks from a table.
    """
    _, hkv, bs, two_d = kv_cache.shape
    _, hq, d = q.shape
    if two_d != 2 * d or hq % hkv:
        raise ValueError(f"tree attention: kv_cache {tuple(kv_cache.shape)} does not fit q {tuple(q.shape)}")
    if q.device.type != "cuda" and not _interpreting():
        raise ValueError("tree_attention_paged needs CUDA tensors (or TRITON_INTERPRET=1); on CPU use "
                         "reference.paged_tree_attention")
    if out is None:
        out = torch.zeros_like(q)
    if meta.shape[0] == 0 or max_rows == 0:
        return out
    merge = prefix_out is not None
    if merge:
        assert prefix_lse is not None and prefix_out.shape == q.shape and prefix_out.stride(-1) == 1
    else:
        prefix_out = prefix_lse = out        # never read (MERGE is off): any pointer will do
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and out.shape == q.shape
    assert meta.shape[1] == META_FIELDS and meta.stride(1) == 1 and bits.is_contiguous()
    group = hq // hkv
    cfg = config or launch_config(group, d, max_rows, meta.shape[0], q.device, merge, q.dtype == torch.float32)
    bm, bn = cfg["block_m"], cfg["block_n"]
    parts = cfg.get("value_parts", 1)
    dp = max(16, triton.next_power_of_2(d))
    rows = bm * triton.next_power_of_2(group)
    assert rows >= 16 and bn in (16, 32, 64) and dp % parts == 0 and dp // parts >= 16
    dv = dp // parts
    # The prefix partial is loaded before the key loops where it costs at most 32 registers a thread.
    early = cfg.get("early", rows * dv <= 2048 * cfg["num_warps"])
    dot_f32 = q.dtype == torch.float32 or _interpreting()
    npg = cfg.get("table_blocks", table_blocks(bs, 32 * bits.shape[1], max_seq_len, merge))
    grid = (triton.cdiv(max_rows, bm) * parts, hkv, meta.shape[0])
    _tree_attn_kernel[grid](
        q, kv_cache, out, prefix_out, prefix_lse, block_table, seq_lens, meta, bits, bits.shape[1],
        scale * math.log2(math.e), meta.stride(0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), prefix_out.stride(0), prefix_out.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), *kv_cache.stride(), block_table.stride(0),
        G=group, GP=triton.next_power_of_2(group), D=d, DP=dp, DV=dv, BS=bs, BM=bm, BN=bn, NPG=npg, MERGE=merge,
        EARLY=merge and early, DOT_F32=dot_f32, PREC="tf32x3" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], maxnreg=cfg.get("maxnreg"),
    )
    return out


def tree_attention_paged_reference(q, kv_cache, block_table, seq_lens, tree_rows, scale, *, out=None):
    """Torch version of :func:`tree_attention_paged` from the host-side rows (``TreeRows``: request index,
    first row, dense region mask); syncs, for tests and benchmarks."""
    if out is None:
        out = torch.zeros_like(q)
    paged_tree_attention(FlashPagedKV(kv_cache), q, out, seq_lens.tolist(), block_table, tree_rows, scale)
    return out


# ---------------------------------------------------------------------------------------------------------
# KV compaction
# ---------------------------------------------------------------------------------------------------------
# Runs eagerly every step with that step's number of moves; the source and destination slots are views of one
# tensor at an offset that varies: no specialization on either, so no recompilation mid-run.
# FROM_WALK: the moves come as a device walk's path rows (``compact_walked_kv_paged``) and their slots are read
# here from the slot mapping, instead of a dozen small torch ops per step building ``src``/``dst``.
@triton.jit(do_not_specialize=["idx_layer_stride", "M", "W"],
            do_not_specialize_on_alignment=["src", "dst", "walk_rows", "starts"])
def _compact_kernel(ptrs, ref, src, dst, idx_layer_stride, M, s0, s1, s2, s3, walk_rows, starts, W,
                    BS: tl.constexpr, TWO_D: tl.constexpr, BD: tl.constexpr, BMC: tl.constexpr,
                    ALIGNED: tl.constexpr, FROM_WALK: tl.constexpr):
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
        if FROM_WALK:   # src, dst: slot mappings; path node j of request b moves to row starts[b] + j
            row = tl.load(walk_rows + i, mask=ok, other=-1).to(tl.int64)
            to = tl.load(starts + i // W, mask=ok, other=0).to(tl.int64) + i % W
            ok = ok & (row >= 0) & (row != to)
            a = tl.load(src + idx + row, mask=ok, other=-1).to(tl.int64)
            z = tl.load(dst + idx + to, mask=ok, other=-1).to(tl.int64)
        else:
            a = tl.load(src + idx + i, mask=ok, other=-1).to(tl.int64)
            z = tl.load(dst + idx + i, mask=ok, other=-1).to(tl.int64)
        ok = ok & (a >= 0) & (z >= 0)
        m2 = ok[:, None] & c_ok
        x = tl.load(base + ((a // BS) * s0 + (a % BS) * s2 + head)[:, None] + c_off, mask=m2)
        # Every source of the tile is read before any destination of it is written.
        tl.debug_barrier()
        tl.store(base + ((z // BS) * s0 + (z % BS) * s2 + head)[:, None] + c_off, x, mask=m2)
        tl.debug_barrier()


def compact_walked_kv_paged(kv_caches, walk_rows, starts, slot_mappings, *, block_d=128, block_m=64, num_warps=4):
    """:func:`compact_kv_paged` of a device walk's moves (``spec_decode.device_walk.DeviceWalk``), in one launch
    that reads the slots itself: ``walk_rows`` ``[B, W]`` each request's path rows in path order (-1 past the
    path), ``starts`` ``[B]`` its first row; node j moves from row ``walk_rows[b, j]`` to row ``starts[b] + j``
    unless it is there. ``slot_mappings``: ``[N']`` the rows' slots, shared by all layers, or ``[L, N']`` per
    layer. The torch version is ``worker/kv_compaction.walked_row_moves`` plus :func:`compact_kv_paged`."""
    kv_caches = list(kv_caches)
    if not kv_caches or walk_rows.numel() == 0:
        return
    assert walk_rows.is_contiguous() and walk_rows.dim() == 2 and starts.shape[0] == walk_rows.shape[0]
    if slot_mappings.dim() == 2:
        assert slot_mappings.shape[0] == len(kv_caches) and slot_mappings.stride(1) == 1
    _launch_compact(kv_caches, slot_mappings, slot_mappings, walk_rows.numel(), walk_rows, starts,
                    walk_rows.shape[1], block_d, block_m, num_warps)


def compact_tile(moves: int, block_m: int = 64) -> int:
    """The row tile of a compaction of ``moves`` moves: the only launch parameter that follows the step (the
    warm-up compiles each, ``worker/kernel_warmup.py``)."""
    return min(block_m, max(16, triton.next_power_of_2(moves)))


def _launch_compact(kv_caches, src, dst, m, walk_rows, starts, w, block_d, block_m, num_warps):
    ref = kv_caches[0]
    nb, hkv, bs, two_d = ref.shape

    def plan():
        assert all(c.shape == ref.shape and c.dtype == ref.dtype and c.stride() == ref.stride() for c in kv_caches)
        return (device_table([[c.data_ptr() for c in kv_caches]], ref.device),
                all(c.data_ptr() % 16 == 0 for c in kv_caches))

    ptrs, aligned = launch_plan("compact_kv", kv_caches, plan)
    bd = min(block_d, triton.next_power_of_2(two_d))
    walk = walk_rows is not None
    _compact_kernel[(len(kv_caches), hkv, triton.cdiv(two_d, bd))](
        ptrs[0], ref, src, dst, src.stride(0) if src.dim() == 2 else 0, m, *ref.stride(),
        walk_rows if walk else src, starts if walk else src, max(w, 1),
        BS=bs, TWO_D=two_d, BD=bd, BMC=compact_tile(m, block_m),
        ALIGNED=aligned, FROM_WALK=walk, num_warps=num_warps,
    )


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
    assert src_slots.shape == dst_slots.shape and src_slots.dim() in (1, 2)
    if src_slots.dim() == 2:
        assert src_slots.shape[0] == len(kv_caches)
    src_slots, dst_slots = src_slots.contiguous(), dst_slots.contiguous()
    _launch_compact(kv_caches, src_slots, dst_slots, src_slots.shape[-1], None, None, 0, block_d, block_m,
                    num_warps)


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
