"""Tree attention of the full-attention layers at Qwen3.5-9B shape (16 query / 4 KV heads of 256, bf16), on GPU.

For every batch B, committed prefix P and nodes per request T (a random tree per request, seeded), per layer:
  tree_us    Bole's backend forward as it runs in a verification step of tree rows only: the route
             (tree_attn_gpu.reads_prefix_itself) and the kernel's launch configuration
             (triton_tree_attn.launch_config) its rules pick; split_us and single_us are both routes at the
             configuration the rule picks for each, "configs" every candidate configuration of each route:
             split:  FlashAttention's non-causal prefix pass + the Triton tree kernel merging it in place
             single: the Triton tree kernel alone, reading prefix and region
  prefix_us  FlashAttention's prefix pass alone (the split route's first part), with FA3's own split heuristic
             (num_splits 0, as the backend runs it outside CUDA graphs); with --prefix-splits N.., also
             prefix_us_by_splits: the pass with num_splits N (FA3 splits each sequence's keys over that many
             programs and merges them), to see whether the split route's first part has time to give
  fa3_us     vLLM's FlashAttention forward on the same B*T query tokens with the plain causal mask (the chain
             case), with the ahead-of-time schedule vLLM's metadata builder gives it
  flex_us    torch FlexAttention (compiled per shape; with --flex-dynamic, shapes dynamic after the first: one
             compile for the sweep, but slower kernels, e.g. 940 vs 303 us at B=8, prefix 1024, 16 nodes; the
             row's "flex_compile" says which) with the ancestor mask, over the same K/V laid out densely per
             request (no paging: a favourable setting for it); its block mask is built outside the timing
It first checks both routes and FlexAttention against the torch reference on a few batches (several requests,
prefixes 0..1500, mixed tree shapes, vLLM's hybrid block sizes) and aborts on a mismatch or a NaN.

Timing: each variant is captured in one CUDA graph over R rotated input sets (so the L2 does not serve repeats)
and the median replay time over the reps is reported (benchmarks/gdn_kernels.py's Timer). The tree rows' device
description is built once per step for all layers; its host time is reported apart (rows_host_us).

Every candidate configuration (--configs) is timed in both routes at every shape, so the rules can be fit to
one run; --rederive re-applies the current rules to the rows of --out (no GPU needed).

Usage: python benchmarks/tree_attention.py [--quick] [--batch ..] [--prefix ..] [--nodes ..] [--append]
       [--shapes B,P,T ..] [--configs ..] [--block-size N] [--reps N] [--sets N] [--flex-dynamic] [--rederive]
       [--no-flex] [--no-check] [--commit C] [--kernels] [--prefix-splits N ..]
       (--append merges the rows into an existing --out file, so a sweep can run in parts)
Needs a CUDA build of vLLM 0.26 (FlashAttention 3 on Hopper).
"""

import argparse
import dataclasses
import json
import random
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: E402
from vllm.v1.attention.backends import fa_utils  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadata  # noqa: E402

from forest_shapes import make_tree  # noqa: E402
from gdn_kernels import Timer  # noqa: E402
from paged_cache import shuffled_block_table  # noqa: E402
from vllm_bole.attention import tree_attn_gpu  # noqa: E402
from vllm_bole.kernels.forest import ancestor_mask  # noqa: E402
from vllm_bole.kernels.tree_attention import triton_tree_attn  # noqa: E402
from vllm_bole.kernels.tree_attention.triton_tree_attn import tree_attention_paged_reference  # noqa: E402
from vllm_bole.step.forest import StepForest, TreeRows, forest_scope  # noqa: E402

HQ, HKV, D, DTYPE = 16, 4, 256, torch.bfloat16
SCALE = D ** -0.5
TOL = 2e-2
# vLLM's attention block size for Qwen3.5-9B with bf16 GDN state and 8 speculative tokens (page >= GDN state).
BLOCK_SIZE = 304
SWEEP = dict(batch=(1, 8, 32), prefix=(128, 1024, 4096), nodes=(4, 16, 64))
QUICK = ((1, 128, 4), (1, 4096, 16), (8, 1024, 16), (32, 128, 64), (32, 4096, 64))
ROUTES = ("split", "single")
# Launch configurations of the tree kernel timed at every shape (names as triton_tree_attn.config_name).
CANDIDATES = ("r16n32w4s3", "r16n32w4s2", "r16n32w8s1", "r64n16w4s3", "r128n32w8s3", "r64n32w8s1", "r64n32w4s3v2",
              "r32n32w4s3", "r64n32w8s3")
DEV = "cuda"


def fake_layer():
    """vLLM's attention layer as FlashAttention reads it: its (unit) quantisation scales only."""
    return types.SimpleNamespace(**{f"_{x}_scale": torch.ones(1, device=DEV) for x in "qkv"})


class Step:
    """One input set: requests ``(tree parents, prefix)`` with K/V in a paged cache (vLLM's NHD layout,
    shuffled blocks), the tree rows, vLLM's metadata for the chain case and the dense layout for Flex."""

    def __init__(self, trees, prefixes, block_size, seed, fa_version):
        gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        sizes = [len(p) for p in trees]
        seq_lens = [p + t for p, t in zip(prefixes, sizes)]
        table, pool = shuffled_block_table(seq_lens, block_size, gen)
        self.kv_cache = torch.randn(pool, block_size, HKV, 2 * D, device=DEV, dtype=DTYPE).permute(0, 2, 1, 3)
        n = sum(sizes)
        self.query = torch.randn(n, HQ, D, device=DEV, dtype=DTYPE)
        self.output = torch.empty_like(self.query)
        starts = [0] + torch.tensor(sizes).cumsum(0).tolist()
        self.tree_rows = [TreeRows(req_index=b, row_start=starts[b],
                                   region_mask=ancestor_mask(torch.tensor(p, dtype=torch.int32)))
                          for b, p in enumerate(trees)]
        t0 = time.perf_counter()
        self.forest = StepForest(req_ids=[], tree_req_indices=[], parent=None, cu_seqlens=None, tokens=[],
                                 attention_rows=self.tree_rows)
        self.rows = self.forest.device_rows(torch.device(DEV))
        self.rows.meta.cpu()                              # the copy has arrived
        self.rows_host_us = (time.perf_counter() - t0) * 1e6
        qsl = torch.tensor(starts, dtype=torch.int32, device=DEV)
        seq = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
        schedule = None if fa_version != 3 else fa_utils.get_scheduler_metadata(
            batch_size=len(trees), max_seqlen_q=max(sizes), max_seqlen_k=max(seq_lens), num_heads_q=HQ,
            num_heads_kv=HKV, headdim=D, cache_seqlens=seq, qkv_dtype=DTYPE, cu_seqlens_q=qsl,
            page_size=block_size, causal=True, window_size=(-1, -1), num_splits=0)
        self.meta = FlashAttentionMetadata(
            num_actual_tokens=n, max_query_len=max(sizes), query_start_loc=qsl, max_seq_len=max(seq_lens),
            seq_lens=seq, block_table=table.to(DEV), slot_mapping=torch.zeros(n, dtype=torch.long, device=DEV),
            use_cascade=False, common_prefix_len=0, cu_prefix_query_lens=None, prefix_kv_lens=None,
            suffix_kv_lens=None, scheduler_metadata=schedule)
        self.seq_lens, self.prefixes, self.sizes = seq_lens, prefixes, sizes
        self.flex = None
        self.layer = fake_layer()

    def tree(self, impl):
        with forest_scope(self.forest):
            return impl.forward(self.layer, self.query, None, None, self.kv_cache, self.meta, self.output)

    def chain(self, impl):
        return FlashAttentionImpl.forward(impl, self.layer, self.query, None, None, self.kv_cache, self.meta,
                                          self.output)

    def reference(self):
        return tree_attention_paged_reference(self.query, self.kv_cache, self.meta.block_table, self.meta.seq_lens,
                                              self.tree_rows, SCALE)

    def build_flex(self):
        """Dense per-request K/V ``[1, Hkv, sum(seq_lens), d]`` and the ancestor block mask."""
        bs = self.kv_cache.shape[2]
        ks, vs, kv_req, kv_pos = [], [], [], []
        for b, s in enumerate(self.seq_lens):
            pos = torch.arange(s, device=DEV)
            rows = self.kv_cache[self.meta.block_table[b, pos // bs].long(), :, pos % bs]     # [s, Hkv, 2d]
            ks.append(rows[..., :D])
            vs.append(rows[..., D:])
            kv_req.append(torch.full((s,), b, device=DEV))
            kv_pos.append(pos)
        k = torch.cat(ks).transpose(0, 1)[None].contiguous()
        v = torch.cat(vs).transpose(0, 1)[None].contiguous()
        kv_req, kv_pos = torch.cat(kv_req), torch.cat(kv_pos)
        q_req = torch.repeat_interleave(torch.arange(len(self.sizes), device=DEV),
                                        torch.tensor(self.sizes, device=DEV))
        prefix = torch.tensor(self.prefixes, device=DEV)
        bits = self.rows.bits

        def mask_mod(b, h, qi, kj):
            j = kv_pos[kj] - prefix[kv_req[kj]]              # region key index; negative: committed prefix
            jj = j.clamp(min=0)
            seen = ((bits[qi, jj // 32] >> (jj % 32)) & 1) == 1
            return (q_req[qi] == kv_req[kj]) & ((j < 0) | seen)

        block_mask = create_block_mask(mask_mod, 1, None, self.query.shape[0], k.shape[2], device=DEV,
                                       _compile=DEV == "cuda")
        self.flex = (self.query.transpose(0, 1)[None].contiguous(), k, v, block_mask)

    def flex_attention(self, fn):
        q, k, v, block_mask = self.flex
        return fn(q, k, v, block_mask=block_mask, scale=SCALE, enable_gqa=True)[0].transpose(0, 1)


def make_impl():
    impl = tree_attn_gpu.BoleFlashAttentionImpl(num_heads=HQ, head_size=D, scale=SCALE, num_kv_heads=HKV,
                                                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    assert impl.vllm_flash_attn_version is not None, "vLLM's FlashAttention is not available on this machine"
    return impl


def parse_config(name, max_rows):
    return triton_tree_attn.parse_config(name, HQ // HKV, max_rows)


def with_route(route, fn, config=None):
    """Run ``fn`` with the backend's prefix rule forced to ``route`` and the kernel's launch configuration
    to ``config`` (None: the backend's own rules)."""
    saved = tree_attn_gpu.reads_prefix_itself, triton_tree_attn.launch_config
    if route is not None:
        tree_attn_gpu.reads_prefix_itself = lambda *_: route == "single"
    if config is not None:
        triton_tree_attn.launch_config = lambda *_: config
    try:
        return fn()
    finally:
        tree_attn_gpu.reads_prefix_itself, triton_tree_attn.launch_config = saved


def apply_rules(row):
    """The route and launch configuration the backend's rules pick at the row's shape, and their times."""
    group, dev = HQ // HKV, torch.device("cuda")
    row["route"] = "single" if tree_attn_gpu.reads_prefix_itself(row["prefix"] + row["nodes"],
                                                                 row["B"] * row["nodes"]) else "split"
    for route in ROUTES:
        cfg = triton_tree_attn.launch_config(group, D, row["nodes"], row["B"], dev, merge=route == "split")
        name = triton_tree_attn.config_name(cfg, group)
        row[f"{route}_config"] = name
        row[f"{route}_us"] = row["configs"][route].get(name)
    row["tree_us"] = row[f"{row['route']}_us"]
    row["ratio_vs_fa3"] = row["tree_us"] / row["fa3_us"] if row["tree_us"] is not None else None
    return row


def rel_err(got, want) -> float:
    return ((got.double() - want.double()).abs().max() / want.double().abs().max()).item()


def self_check(impl, flex, block_sizes, configs, sweep_block_size):
    """Both routes and FlexAttention against the torch reference; raises SystemExit on a mismatch."""
    rng = random.Random(7)
    shapes = ("single", "chain", "star", "kary4", "random", "random")
    for bs in block_sizes:
        trees = [make_tree(s, t, rng) for s, t in zip(shapes, (1, 9, 16, 40, 64, 23))]
        step = Step(trees, [0, 1, 300, 1500, 777, bs], bs, seed=bs, fa_version=impl.vllm_flash_attn_version)
        want = step.reference()
        results = {route: with_route(route, lambda: step.tree(impl).clone()) for route in ROUTES}
        for name in configs if bs == sweep_block_size else ():   # every candidate, at the sweep's block size
            cfg = parse_config(name, max(step.sizes))
            for route in ROUTES:
                results[f"{route} {name}"] = with_route(route, lambda: step.tree(impl).clone(), cfg)
        try:
            if flex is not None:
                step.build_flex()
                results["flex"] = step.flex_attention(flex)
        except Exception as e:  # Flex's templates may not fit every shape; the sweep then reports no time
            print(f"check block size {bs}: FlexAttention failed: {type(e).__name__}: {e}", flush=True)
        for name, got in results.items():
            err = rel_err(got, want)
            if not torch.isfinite(got.float()).all() or err > TOL:
                raise SystemExit(f"MISMATCH: {name} at block size {bs}: rel err {err:.3e} (tolerance {TOL}), "
                                 f"finite={bool(torch.isfinite(got.float()).all())}")
            print(f"check block size {bs}: {name} rel err {err:.2e}", flush=True)


def bench_point(batch, prefix, nodes, args, timer, impl, flex):
    steps = [Step([make_tree("random", nodes, random.Random(1000 * batch + nodes + r)) for _ in range(batch)],
                  [prefix] * batch, args.block_size, seed=r, fa_version=impl.vllm_flash_attn_version)
             for r in range(args.sets)]
    row = {"B": batch, "prefix": prefix, "nodes": nodes, "block_size": args.block_size,
           "configs": {route: {} for route in ROUTES}}
    for name in args.configs:
        cfg = parse_config(name, nodes)
        name = triton_tree_attn.config_name(cfg, HQ // HKV)    # small trees clamp the tile: time it once
        for route in ROUTES:
            if name not in row["configs"][route]:
                row["configs"][route][name] = with_route(
                    route, lambda: timer([lambda s=s: s.tree(impl) for s in steps]), cfg)
    def prefix_pass(s, meta):
        return tree_attn_gpu.prefix_pass(impl, s.query, s.kv_cache, meta, s.rows.prefix_lens(s.meta.seq_lens),
                                         s.output)

    row["prefix_us"] = timer([lambda s=s: prefix_pass(s, s.meta) for s in steps])
    if args.prefix_splits:
        row["prefix_us_by_splits"] = {
            str(n): timer([lambda s=s, meta=dataclasses.replace(s.meta, max_num_splits=n): prefix_pass(s, meta)
                           for s in steps])
            for n in args.prefix_splits}
    row["fa3_us"] = timer([lambda s=s: s.chain(impl) for s in steps])
    try:
        row["flex_us"] = None
        if flex is not None:
            for s in steps:
                s.build_flex()
            row["flex_us"] = timer([lambda s=s: s.flex_attention(flex) for s in steps])
    except Exception as e:  # Flex's templates may not fit every shape
        print(f"B={batch} P={prefix} T={nodes}: FlexAttention failed: {type(e).__name__}: {e}", flush=True)
        row["flex_us"] = None
    row["rows_host_us"] = steps[0].rows_host_us
    apply_rules(row)
    del steps
    if DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} shapes: {QUICK}")
    for key, values in SWEEP.items():
        ap.add_argument(f"--{key}", type=int, nargs="+", default=list(values))
    ap.add_argument("--shapes", nargs="+", metavar="B,P,T", help="these shapes instead of the sweep's product")
    ap.add_argument("--append", action="store_true", help="keep the other shapes' rows already in --out")
    ap.add_argument("--configs", nargs="+", default=list(CANDIDATES), help="launch configurations to time")
    ap.add_argument("--rederive", action="store_true", help="re-apply the rules to --out's rows and print")
    ap.add_argument("--flex-dynamic", action="store_true",
                    help="compile FlexAttention once with dynamic shapes (faster sweep, slower Flex kernels)")
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (its compiles take minutes)")
    ap.add_argument("--no-check", action="store_true", help="skip the check against the reference (the tests' job)")
    ap.add_argument("--commit", help="recorded in every row (the code's commit)")
    ap.add_argument("--kernels", action="store_true", help="print every compiled tree kernel's registers at the end")
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--sets", type=int, default=4, help="rotated input sets per timing")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--prefix-splits", type=int, nargs="*", default=[], metavar="N",
                    help="also time the prefix pass alone with FA3's num_splits N (prefix_us_by_splits)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tree_attention.json"))
    args = ap.parse_args()
    out = Path(args.out)
    if args.rederive:
        all_rows = [apply_rules(r) for r in json.loads(out.read_text())]
        out.write_text(json.dumps(all_rows, indent=1) + "\n")
        print_table(all_rows)
        return
    gpu = torch.cuda.get_device_name() if DEV == "cuda" else DEV
    impl = make_impl()
    # FlexAttention's mask functions differ per input set, and per-shape compiles recompile for every shape.
    torch._dynamo.config.recompile_limit = 1024
    flex = None if args.no_flex else torch.compile(flex_attention, dynamic=None if args.flex_dynamic else False)
    print(f"device: {gpu}; FlashAttention {impl.vllm_flash_attn_version}; block size {args.block_size}", flush=True)
    if not args.no_check:
        self_check(impl, flex, sorted({16, 272, 528, args.block_size}), args.configs, args.block_size)
    timer = Timer(DEV, args.reps)
    points = QUICK if args.quick else [(b, p, t) for t in args.nodes for p in args.prefix for b in args.batch]
    if args.shapes:
        points = [tuple(int(x) for x in shape.split(",")) for shape in args.shapes]
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = json.loads(out.read_text()) if args.append and out.exists() else []
    kept = [r for r in kept if (r["B"], r["prefix"], r["nodes"]) not in set(points)]
    rows = []
    for batch, prefix, nodes in points:
        row = bench_point(batch, prefix, nodes, args, timer, impl, flex)
        row["gpu"] = gpu
        row["flex_compile"] = None if args.no_flex else "dynamic" if args.flex_dynamic else "per-shape"
        if args.commit:
            row["commit"] = args.commit
        rows.append(row)
        print(json.dumps(row), flush=True)
        all_rows = sorted(kept + rows, key=lambda r: (r["nodes"], r["prefix"], r["B"]))
        out.write_text(json.dumps(all_rows, indent=1) + "\n")     # after every point: a cut-short run keeps its rows

    print_table(all_rows)
    if args.kernels:
        kernel_report()


def kernel_report():
    """Registers, spills and shared memory of every tree-kernel variant this process compiled."""
    fn = triton_tree_attn._tree_attn_kernel
    names = fn.arg_names
    for kernel_cache, *_ in fn.device_caches.values():
        for ck in kernel_cache.values():
            c = {names[k[0]]: v for k, v in ck.src.constants.items() if names[k[0]].isupper()}
            md = ck.metadata
            print(f"tree kernel BM={c.get('BM')} BN={c.get('BN')} DV={c.get('DV')} NPG={c.get('NPG')} "
                  f"MERGE={c.get('MERGE')} EARLY={c.get('EARLY')} warps={md.num_warps} stages={md.num_stages}: "
                  f"{getattr(ck, 'n_regs', '?')} registers, {getattr(ck, 'n_spills', '?')} spilled, "
                  f"{md.shared} B shared", flush=True)


def print_table(rows):
    def us(x):
        return f"{x:.1f}" if x is not None else "-"

    print("| B | prefix | nodes | tree µs | FA3 chain µs | Flex µs | tree / FA3 | route | split µs | single µs | "
          "prefix pass µs | split config | single config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = f"{r['ratio_vs_fa3']:.2f}×" if r["ratio_vs_fa3"] is not None else "-"
        print(f"| {r['B']} | {r['prefix']} | {r['nodes']} | {us(r['tree_us'])} | {us(r['fa3_us'])} | "
              f"{us(r['flex_us'])} | {ratio} | {r['route']} | {us(r['split_us'])} | {us(r['single_us'])} | "
              f"{us(r['prefix_us'])} | {r['split_config']} | {r['single_config']} |")
    split_rows = [r for r in rows if r.get("prefix_us_by_splits")]
    if split_rows:
        print("\nPrefix pass alone by FA3 num_splits (µs; 0: its heuristic):")
        for r in split_rows:
            times = ", ".join(f"{n}: {us(t)}" for n, t in r["prefix_us_by_splits"].items())
            print(f"B={r['B']} prefix={r['prefix']} nodes={r['nodes']}: 0: {us(r['prefix_us'])}, {times}")


if __name__ == "__main__":
    main()
