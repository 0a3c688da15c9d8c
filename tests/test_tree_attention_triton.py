"""Triton tree attention over the paged KV cache and KV compaction, against their torch references.

On a CUDA machine the kernels run compiled; without one they run under Triton's interpreter at small head
counts and dims (the real Qwen3.5 shape is GPU-only). Caches use the FlashAttention logical layout
``[num_blocks, kv_heads, block_size, 2 * head_size]`` with several physical layouts, shuffled block tables,
and NaN in every cache entry no request owns, so a read outside a request's positions shows up as NaN.
Every batch runs both ways the GPU backend runs the kernel: reading the prefix itself, and merging a
FlashAttention-style prefix pass (its torch stand-in here, NaN on rows of an empty prefix) in place or not.
"""

import random

import pytest
import torch

from sequential_gdn import build_forest, rel_err, seed_of
from triton_modes import DEV, GPU, import_kernel_modules
from vllm_bole.kernels.forest import ancestor_mask, path_to_root
from vllm_bole.kernels.tree_attention.reference import FlashPagedKV, paged_prefix_attention
from vllm_bole.step.forest import DeviceTreeRows, TreeRows

FP32_TOL = 1e-4
BF16_TOL = 2e-2
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")
needs_gpu = pytest.mark.skipif(not GPU, reason="real-shape heads are too slow in the Triton interpreter; "
                                               "needs a CUDA device")


(ta,) = import_kernel_modules("vllm_bole.kernels.tree_attention.triton_tree_attn")


@pytest.fixture(autouse=True)
def _triton_mode(monkeypatch):
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


# --------------------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------------------
def _alloc_cache(nb, hkv, bs, d, layout, dtype, gen):
    """A cache with the logical shape ``[nb, hkv, bs, 2d]`` in one of several physical layouts."""
    if layout == "contiguous":
        return torch.randn(nb, hkv, bs, 2 * d, generator=gen).to(dtype)
    if layout == "heads_inner":  # physical [nb, bs, hkv, 2d], as FlashAttention's NHD cache is stored
        return torch.randn(nb, bs, hkv, 2 * d, generator=gen).to(dtype).permute(0, 2, 1, 3)
    if layout == "padded":       # every block row padded, so no stride is a product of the shape
        buf = torch.randn(nb, hkv + 1, bs, 2 * d + 8, generator=gen).to(dtype)
        return buf[:, 1:, :, 4:4 + 2 * d]
    raise ValueError(layout)


class Batch:
    """Request b: tree ``spec[b] = (shape, T[, n])`` over a committed prefix of ``prefixes[b]`` tokens, K/V
    already in a paged cache whose blocks are shuffled. Its query rows are the tree's last n nodes (all T by
    default; fewer as in the MTP drafter's levels), optionally separated by non-tree rows."""

    def __init__(self, spec, prefixes, *, hq=4, hkv=2, d=16, bs=16, dtype=torch.float32, layout="contiguous",
                 gap_rows=0, seed_params=()):
        seed = seed_of("attn", spec, prefixes, hq, hkv, d, bs, str(dtype), layout, gap_rows, *seed_params)
        rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
        self.parent, self.cu = build_forest([s[:2] for s in spec], rng)
        sizes = (self.cu[1:] - self.cu[:-1]).tolist()
        rows_of = [s[2] if len(s) > 2 else t for s, t in zip(spec, sizes)]
        self.seq_lens = [p + t for p, t in zip(prefixes, sizes)]
        n_blocks = [-(-s // bs) for s in self.seq_lens]
        nb = sum(n_blocks) + 2                     # two spare blocks nobody owns
        perm = torch.randperm(nb, generator=gen).tolist()
        width = max(n_blocks + [1]) + 2
        self.block_table = torch.full((len(sizes), width), perm[-1], dtype=torch.int32)  # unused -> spare
        self.kv = _alloc_cache(nb, hkv, bs, d, layout, dtype, gen)
        owned = torch.zeros(nb, bs, dtype=torch.bool)
        k = 0
        for b, n in enumerate(n_blocks):
            for j in range(n):
                self.block_table[b, j] = perm[k]
                owned[perm[k], :min(bs, self.seq_lens[b] - j * bs)] = True
                k += 1
        self.kv.masked_fill_(~owned[:, None, :, None], float("nan"))
        qsl, rows, self.tree_rows = [], 0, []
        cu = self.cu.tolist()
        for b, (t, n) in enumerate(zip(sizes, rows_of)):
            rows += gap_rows
            qsl.append(rows)
            if t:
                mask = ancestor_mask(self.parent[cu[b]:cu[b + 1]])[t - n:]
                self.tree_rows.append(TreeRows(req_index=b, row_start=rows, region_mask=mask))
            rows += n
        self.query_start_loc = qsl + [rows + gap_rows]
        self.q = torch.randn(rows + gap_rows, hq, d, generator=gen).to(dtype)
        self.scale = d ** -0.5
        self.sizes = sizes
        self.rows_of = rows_of

    def reference(self):
        return ta.tree_attention_paged_reference(self.q, self.kv, self.block_table, torch.tensor(self.seq_lens),
                                                 self.tree_rows, self.scale)

    def prefix_pass(self):
        """The stand-in for FlashAttention's non-causal pass over every request's prefix: (out, lse)."""
        prefixes = [s - t for s, t in zip(self.seq_lens, self.sizes)]
        return paged_prefix_attention(FlashPagedKV(self.kv), self.q, prefixes, self.block_table,
                                      self.query_start_loc, self.scale)

    def tree_row_index(self):
        return torch.cat([torch.arange(r.row_start, r.row_start + r.region_mask.shape[0]) for r in self.tree_rows]
                         + [torch.zeros(0, dtype=torch.long)])


def _to_dev_view(t):
    """Copy a (possibly non-contiguous) view to the device keeping its strides."""
    if t.device.type == DEV:
        return t
    base = t.untyped_storage()
    flat = torch.empty(0, dtype=t.dtype).set_(base).to(DEV)
    return flat.as_strided(t.size(), t.stride(), t.storage_offset())


MODES = ("inline", "merge", "merge_in_place")


def run_kernel(batch: Batch, mode: str, *, config=None, max_rows=None):
    """The kernel's output (on the host) with untouched rows set to 7. The single route gets the batch's longest
    sequence as its bound, as the backend passes it (its blocks then come from a table where they are few)."""
    dq, dkv = _to_dev_view(batch.q), _to_dev_view(batch.kv)
    rows = DeviceTreeRows.pack(batch.tree_rows, DEV)
    out = torch.full_like(dq, 7.0)
    kw = {}
    if mode != "inline":
        p_out, p_lse = (t.to(DEV) for t in batch.prefix_pass())
        if mode == "merge_in_place":   # the backend's all-tree step: the prefix pass writes into the output
            out[batch.tree_row_index().to(DEV)] = p_out[batch.tree_row_index().to(DEV)]
            p_out = out
        kw = dict(prefix_out=p_out, prefix_lse=p_lse)
    got = ta.tree_attention_paged(dq, dkv, batch.block_table.to(DEV),
                                  torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEV), rows.meta,
                                  rows.bits, batch.scale, max_rows=max_rows or rows.max_rows, out=out,
                                  config=config, max_seq_len=max(batch.seq_lens), **kw)
    assert got is out and got.dtype == batch.q.dtype
    return got.cpu()


def check(batch: Batch, *, tol=None, config=None, max_rows=None, modes=MODES):
    want = batch.reference()
    rows = batch.tree_row_index()
    other = torch.ones(batch.q.shape[0], dtype=torch.bool)
    other[rows] = False
    tol = tol or (FP32_TOL if batch.q.dtype == torch.float32 else BF16_TOL)
    for mode in modes:
        got = run_kernel(batch, mode, config=config, max_rows=max_rows)
        assert torch.isfinite(got[rows].float()).all(), f"{mode}: NaN/inf in tree rows"
        assert (got[other] == 7.0).all(), f"{mode}: rows outside every tree must stay untouched"
        if rows.numel():
            err = rel_err(got[rows], want[rows])
            assert err <= tol, f"{mode}: rel err {err:.2e}"


# --------------------------------------------------------------------------------------------------------
# The torch references themselves, against a direct per-row softmax
# --------------------------------------------------------------------------------------------------------
def _direct(batch, b, row, h, keys_at):
    """Softmax attention of query row ``row``, head ``h`` over request b's positions ``keys_at``."""
    q, kv, bt = batch.q, batch.kv, batch.block_table
    d = q.shape[-1]
    bs = kv.shape[2]
    hk = h // (q.shape[1] // kv.shape[1])
    keys = [kv[int(bt[b, p // bs]), hk, p % bs] for p in keys_at]
    k = torch.stack([x[:d] for x in keys]).double()
    v = torch.stack([x[d:] for x in keys]).double()
    s = k @ q[row, h].double() * batch.scale
    return torch.softmax(s, 0) @ v, torch.logsumexp(s, 0)


def test_references_match_direct_softmax():
    batch = Batch([("random", 7), ("chain", 3), ("kary2", 9, 4)], [5, 20, 0], hq=4, hkv=2, d=8, bs=4,
                  seed_params=("direct",))
    got = batch.reference()
    p_out, p_lse = batch.prefix_pass()
    cu = batch.cu.tolist()
    for rows in batch.tree_rows:
        b = rows.req_index
        t, n = batch.sizes[b], batch.rows_of[b]
        prefix = batch.seq_lens[b] - t
        for i in range(n):
            visible = list(range(prefix)) + [prefix + j for j in path_to_root(batch.parent[cu[b]:cu[b + 1]],
                                                                               t - n + i)]
            row = rows.row_start + i
            for h in range(batch.q.shape[1]):
                want, _ = _direct(batch, b, row, h, visible)
                assert torch.allclose(got[row, h].double(), want, atol=1e-5)
                if prefix:
                    want, lse = _direct(batch, b, row, h, range(prefix))
                    assert torch.allclose(p_out[row, h].double(), want, atol=1e-5)
                    assert abs(p_lse[h, row].item() - lse.item()) < 1e-4


def test_cpu_tensors_need_the_interpreter(monkeypatch):
    if GPU:
        pytest.skip("CPU dispatch only matters without a GPU")
    monkeypatch.setattr(ta, "_interpreting", lambda: False)
    batch = Batch([("kary2", 6)], [9], seed_params=("dispatch",))
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        run_kernel(batch, "inline")


# --------------------------------------------------------------------------------------------------------
# Triton tree attention
# --------------------------------------------------------------------------------------------------------
SHAPES = ("chain", "star", "kary2", "kary3", "kary4", "random", "deep")
TREE_CASES = ([("single", 1)] + [(s, t) for s in SHAPES for t in (5, 40)]
              + [("chain", 64), ("random", 64), ("deep", 100), ("kary4", 90)])


@pytest.mark.parametrize("shape,t", TREE_CASES)
def test_tree_shapes(shape, t):
    check(Batch([(shape, t)], [37], seed_params=(shape, t)))


MULTI = [("single", 1), ("chain", 7), ("kary3", 13), ("random", 21), ("deep", 34), ("star", 5), ("kary2", 2),
         ("random", 70)]
PREFIXES = [0, 1, 15, 16, 33, 250, 300, 64]


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize("layout", ["contiguous", "heads_inner", "padded"])
def test_batch_of_requests_prefixes_and_layouts(bs, layout):
    check(Batch(MULTI, PREFIXES, bs=bs, layout=layout, gap_rows=1))


def test_drafter_levels_are_the_regions_last_rows():
    # The MTP drafter's levels: a few new rows at the end of a longer region of earlier queries.
    spec = [("kary4", 21, 4), ("random", 80, 16), ("chain", 9, 1), ("star", 40, 39), ("single", 1, 1)]
    check(Batch(spec, [12, 0, 100, 33, 5], gap_rows=2, seed_params=("drafter",)))


@pytest.mark.parametrize("hq,hkv,d", [(2, 2, 16), (4, 1, 16), (6, 2, 16), (8, 2, 32), (4, 4, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_dims_dtypes(hq, hkv, d, dtype):
    check(Batch([("random", 19), ("chain", 9), ("single", 1)], [40, 0, 130], hq=hq, hkv=hkv, d=d,
                dtype=dtype))


@pytest.mark.parametrize("block_m,block_n", [(8, 16), (16, 16), (8, 64), (32, 32)])
def test_tile_sizes(block_m, block_n):
    # BN below, equal to and above the block size and a bitmask word; row tiles smaller than a tree.
    cfg = {"block_m": block_m, "block_n": block_n, "num_warps": 4, "num_stages": 1}
    check(Batch([("deep", 40), ("kary2", 17), ("star", 3), ("random", 50, 7)], [70, 31, 0, 9], bs=32,
                seed_params=(block_m, block_n)), config=cfg)


@pytest.mark.parametrize("table", [0, 1, 4, 16])
@pytest.mark.parametrize("bs", [16, 64])
def test_block_table_in_registers_or_read_per_key(table, bs):
    # The key loop's blocks from a table of the first blocks it reads (single route: the sequence's; split
    # route: from the region's first block on) or read per key (0). Regions that start inside a block and
    # cross one, trees longer than a block, prefixes of whole blocks and none.
    spec = [("random", 20), ("kary3", 13), ("chain", 3), ("deep", 37), ("single", 1)]
    prefixes = [2 * bs - 5, bs, 0, 3, 0] if table != 1 else [bs - 7, 0, bs + 2, 1, 2 * bs]
    if table == 1:     # one block: every region within one block
        spec = [("random", 7), ("kary3", 5), ("chain", 3), ("single", 1), ("star", 4)]
        prefixes = [3, 0, bs + 2, 1, 2 * bs]
    batch = Batch(spec, prefixes, bs=bs, seed_params=("table", table, bs))
    cfg = ta.tile_config(16, 16, 4, 1, 2, max(batch.rows_of)) | {"table_blocks": table}
    modes = MODES if table in (0, 16) else ("merge",)      # a table covers a whole sequence only when it is large
    check(batch, config=cfg, modes=modes)


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("parts", [1, 2])
def test_value_parts_and_prefix_partial_timing(early, parts):
    # Programs of one tile each accumulating half the value columns; the prefix partial read before or after
    # the key loop.
    cfg = ta.tile_config(32, 32, 4, 2, 4, 64, value_parts=parts) | {"early": early}
    check(Batch([("random", 23), ("chain", 6), ("kary2", 40, 9)], [50, 0, 17], hq=8, hkv=2, d=32,
                seed_params=("parts", parts, early)), config=cfg)


def test_config_names_round_trip():
    for name in ("r16n32w4s3", "r64n32w4s3v2", "r64n32w8s1", "r32n16w4s2m168", "r128n64w8s4v2m200"):
        assert ta.config_name(ta.parse_config(name, 4, 64), 4) == name
    assert ta.table_blocks(304, 64, None, True) == 2 and ta.table_blocks(16, 64, None, True) == 8
    assert ta.table_blocks(304, 64, 512, False) == 2 and ta.table_blocks(16, 64, 512, False) == 0
    assert ta.table_blocks(16, 64, None, False) == 0 and ta.table_blocks(304, 32, 4160, False) == 16


def test_capacity_grid_and_requests_without_trees():
    # Batch requests without a tree (no TreeRows) and a grid sized for capacity, not for the step's rows.
    batch = Batch([("random", 12), ("chain", 5), ("kary2", 6)], [20, 3, 8], gap_rows=1, seed_params=("capacity",))
    batch.tree_rows = [batch.tree_rows[0], batch.tree_rows[2]]
    check(batch, max_rows=256)


def test_scores_far_apart_stay_finite():
    # Large logits: the online softmax and the merge must rescale, not overflow.
    batch = Batch([("random", 30), ("chain", 4)], [100, 17], seed_params=("large",))
    batch.q *= 40
    check(batch)


@needs_gpu
@pytest.mark.parametrize("bs", [16, 32, 64])
def test_real_shape_bf16(bs):
    spec = [("kary4", 64), ("deep", 64), ("random", 48), ("single", 1), ("chain", 9), ("random", 128),
            ("kary4", 200, 16)]
    check(Batch(spec, [4000, 1, 513, 2048, 0, 777, 64], hq=16, hkv=4, d=256, bs=bs, dtype=torch.bfloat16,
                layout="heads_inner"))


@needs_gpu
def test_real_shape_fp32_many_requests():
    spec = [("random", 1 + (7 * i) % 64) for i in range(64)]
    check(Batch(spec, [(37 * i) % 1500 for i in range(64)], hq=16, hkv=4, d=256, bs=16))


@pytest.mark.parametrize("merge", [False, True])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("max_rows,num_trees", [(1, 1), (4, 32), (16, 8), (64, 1), (64, 2), (64, 16), (64, 32),
                                                (300, 64)])
def test_launch_config_fits_every_step(group, max_rows, num_trees, merge):
    gp = 1 << (group - 1).bit_length()
    cfg = ta.launch_config(group, 256, max_rows, num_trees, torch.device("cuda"), merge=merge)
    assert cfg["block_m"] * gp >= 16 and cfg["block_n"] in (16, 32, 64)
    assert cfg["block_m"] <= max(1 << (max_rows - 1).bit_length(), -(-16 // gp))
    rows = num_trees * max_rows
    want = (16 if rows <= ta.SMALL_STEP_ROWS else 64 if rows <= ta.LARGE_STEP_ROWS else 128)
    assert cfg["block_m"] * gp == max(16, min(want, gp * (1 << (max_rows - 1).bit_length())))
    one_tile = merge and rows <= ta.SMALL_STEP_ROWS and max_rows <= 32
    assert (cfg["num_warps"], cfg["num_stages"]) == ((8, 1) if one_tile else (4, 2) if merge and rows <= ta.SMALL_STEP_ROWS
                                                      else (4, 3) if rows <= ta.LARGE_STEP_ROWS else (8, 3))
    # fp32 tiles fit shared memory up to 64 rows
    fp32 = ta.launch_config(group, 256, max_rows, num_trees, torch.device("cuda"), merge=merge, fp32=True)
    assert fp32 == (cfg if rows <= ta.LARGE_STEP_ROWS else ta.tile_config(64, 16, 4, 3, group, max_rows))


# Launch configurations the benchmark times (benchmarks/tree_attention.py's CANDIDATES) and the rule's.
GPU_TILES = ["r16n32w4s3", "r16n32w4s2", "r16n32w8s1", "r64n16w4s3", "r128n32w8s3", "r64n32w8s1", "r64n32w4s3v2",
             "r32n32w4s3", "r64n32w8s3"]


@needs_gpu
@pytest.mark.parametrize("name", GPU_TILES)
def test_real_shape_launch_configs(name):
    # The benchmark's block size; a wide tree, a drafter level, a deep one, a single node, a small chain.
    spec = [("kary4", 64), ("random", 40, 33), ("deep", 37), ("single", 1), ("chain", 5)]
    batch = Batch(spec, [4000, 300, 0, 1200, 77], hq=16, hkv=4, d=256, bs=304, dtype=torch.bfloat16,
                  layout="heads_inner", seed_params=(name,))
    check(batch, config=ta.parse_config(name, 4, 64))
    # Short sequences: the single route's blocks from a table.
    short = Batch([("kary4", 64), ("random", 40, 33), ("single", 1), ("chain", 5)], [128, 300, 0, 500], hq=16,
                  hkv=4, d=256, bs=304, dtype=torch.bfloat16, layout="heads_inner", seed_params=(name, "short"))
    check(short, config=ta.parse_config(name, 4, 64))


# --------------------------------------------------------------------------------------------------------
# KV compaction
# --------------------------------------------------------------------------------------------------------
def _accepted_moves(batch: Batch, rng: random.Random, bs: int):
    """Slot moves of a random accepted path per request, in path order (as the runner lists them)."""
    src, dst = [], []
    cu = batch.cu.tolist()
    for b, t in enumerate(batch.sizes):
        if t == 0:
            continue
        prefix = batch.seq_lens[b] - t
        path = path_to_root(batch.parent[cu[b]:cu[b + 1]], rng.randrange(t))

        def slot(p):
            return int(batch.block_table[b, p // bs]) * bs + p % bs

        for j, node in enumerate(path):
            if node != j:
                src.append(slot(prefix + node))
                dst.append(slot(prefix + j))
    return src, dst


def _layer_caches(n_layers, nb, hkv, bs, d, dtype, gen):
    """Per-layer caches as strided views into one padded buffer (heads inner, like FlashAttention)."""
    buf = torch.randn(nb, n_layers, bs, hkv, 2 * d + 4, generator=gen).to(dtype)
    views = [buf[:, layer, :, :, 2:2 + 2 * d].permute(0, 2, 1, 3) for layer in range(n_layers)]
    return buf, views


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("per_layer_slots", [False, True])
@pytest.mark.parametrize("block_m", [16, 64])
def test_compact_moves_exactly_accepted_slots(dtype, per_layer_slots, block_m):
    bs, hkv, d, n_layers = 16, 2, 8, 3
    spec = [("deep", 40), ("random", 25), ("single", 1), ("kary2", 30), ("chain", 20), ("star", 9)]
    batch = Batch(spec, [17, 0, 5, 31, 60, 2], bs=bs, seed_params=("compact",))
    rng = random.Random(seed_of("compact", str(dtype), per_layer_slots))
    gen = torch.Generator().manual_seed(seed_of("compact-cache", str(dtype)))
    nb = batch.kv.shape[0]
    buf, caches = _layer_caches(n_layers, nb, hkv, bs, d, dtype, gen)
    moves = [_accepted_moves(batch, rng, bs) for _ in range(n_layers if per_layer_slots else 1)]
    m = max(len(s) for s, _ in moves) + 3                 # capacity-sized, padded with -1
    pad = [(s + [-1] * (m - len(s)), t + [-1] * (m - len(t))) for s, t in moves]
    src = torch.tensor([s for s, _ in pad], dtype=torch.int64)
    dst = torch.tensor([t for _, t in pad], dtype=torch.int64)
    if not per_layer_slots:
        src, dst = src[0], dst[0]
    assert sum(len(s) for s, _ in moves) > 0

    want_buf = buf.clone()
    want = [want_buf[:, layer, :, :, 2:2 + 2 * d].permute(0, 2, 1, 3) for layer in range(n_layers)]
    ta.compact_kv_paged_reference(want, src, dst)
    dbuf = buf.clone().to(DEV)
    dcaches = [dbuf[:, layer, :, :, 2:2 + 2 * d].permute(0, 2, 1, 3) for layer in range(n_layers)]
    ta.compact_kv_paged(dcaches, src.to(DEV), dst.to(DEV), block_m=block_m)
    got = dbuf.cpu()
    assert torch.equal(got, want_buf)
    # Exactly the destination slots changed, each to its source's original K/V.
    for layer in range(n_layers):
        s_l, d_l = moves[layer if per_layer_slots else 0]
        changed = torch.zeros(nb, bs, dtype=torch.bool)
        for a, z in zip(s_l, d_l):
            changed[z // bs, z % bs] = True
            assert torch.equal(got[z // bs, layer, z % bs, :, 2:2 + 2 * d], buf[a // bs, layer, a % bs, :, 2:2 + 2 * d])
        assert torch.equal(got[:, layer][~changed], buf[:, layer][~changed])
    assert torch.equal(got[..., :2], buf[..., :2]) and torch.equal(got[..., -2:], buf[..., -2:])


def test_compact_reads_every_source_before_writing():
    # A cycle of moves inside one tile: every destination is also a source.
    gen = torch.Generator().manual_seed(seed_of("cycle"))
    buf, caches = _layer_caches(2, 4, 2, 16, 16, torch.float32, gen)
    src = torch.tensor([3, 20, 40, 63])
    dst = torch.tensor([20, 40, 63, 3])
    want_buf = buf.clone()
    ta.compact_kv_paged_reference([want_buf[:, i, :, :, 2:34].permute(0, 2, 1, 3) for i in range(2)], src, dst)
    dbuf = buf.clone().to(DEV)
    ta.compact_kv_paged([dbuf[:, i, :, :, 2:34].permute(0, 2, 1, 3) for i in range(2)], src.to(DEV), dst.to(DEV))
    assert torch.equal(dbuf.cpu(), want_buf)
    assert torch.equal(want_buf[1, :, 4, :, 2:34], buf[0, :, 3, :, 2:34])  # slot 3 -> 20


def test_compact_nothing_to_move():
    gen = torch.Generator().manual_seed(seed_of("empty"))
    buf, caches = _layer_caches(2, 3, 2, 16, 8, torch.float32, gen)
    dbuf = buf.clone().to(DEV)
    views = [dbuf[:, i, :, :, 2:18].permute(0, 2, 1, 3) for i in range(2)]
    ta.compact_kv_paged(views, torch.zeros(0, dtype=torch.int64, device=DEV),
                        torch.zeros(0, dtype=torch.int64, device=DEV))
    ta.compact_kv_paged(views, torch.full((5,), -1, device=DEV), torch.full((5,), -1, device=DEV))
    assert torch.equal(dbuf.cpu(), buf)


@pytest.mark.parametrize("mode", MODES)
def test_padded_requests_and_capacity_rows_change_nothing(mode):
    """As a full CUDA graph runs the kernel: empty requests after the real ones (their own batch index, no
    rows, seq_len 0), padding query rows after the last tree, and a capacity bound for the grid."""
    batch = Batch([("random", 9), ("chain", 3), ("kary2", 9, 4)], [5, 40, 0], seed_params=("padded",))
    want = batch.reference()
    extra_reqs, extra_rows = 3, 5
    rows = DeviceTreeRows.pack(batch.tree_rows, "cpu")
    b = rows.meta.shape[0]
    pad = torch.zeros(extra_reqs, 5, dtype=torch.int32)
    pad[:, 0] = torch.arange(b, b + extra_reqs)
    meta = torch.cat([rows.meta, pad]).to(DEV)
    seq_lens = torch.tensor(batch.seq_lens + [0] * extra_reqs, dtype=torch.int32, device=DEV)
    table = torch.cat([batch.block_table, batch.block_table[:1].expand(extra_reqs, -1)]).to(DEV)
    q = torch.cat([batch.q, torch.randn(extra_rows, *batch.q.shape[1:])]).to(DEV)
    out = torch.full_like(q, 7.0)
    kw = {}
    if mode != "inline":
        p_out, p_lse = batch.prefix_pass()
        p_out = torch.cat([p_out, torch.zeros(extra_rows, *p_out.shape[1:])]).to(DEV)
        p_lse = torch.cat([p_lse, torch.zeros(p_lse.shape[0], extra_rows)], dim=1).to(DEV)
        if mode == "merge_in_place":
            idx = batch.tree_row_index().to(DEV)
            out[idx] = p_out[idx]
            p_out = out
        kw = dict(prefix_out=p_out, prefix_lse=p_lse)
    ta.tree_attention_paged(q, _to_dev_view(batch.kv), table, seq_lens, meta, rows.bits.to(DEV), batch.scale,
                            max_rows=40, out=out, **kw)
    got, tree = out.cpu(), batch.tree_row_index()
    assert rel_err(got[tree], want[tree]) <= FP32_TOL
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[tree] = False
    assert (got[others] == 7.0).all()
    prefix = DeviceTreeRows(meta=meta, bits=rows.bits.to(DEV), num_rows=q.shape[0], max_rows=40).prefix_lens(seq_lens)
    assert prefix.tolist() == [s - t for s, t in zip(batch.seq_lens, batch.sizes)] + [0] * extra_reqs
