"""Tree GDN verification and commit at Qwen3.5-9B shapes (HK=16, HV=32, dk=dv=128, bf16), on the GPU.

For every batch B and tree size T (a random tree per request, seeded):
  bole_us        closed-form tree verify (Triton), per layer, the best of the launch configs timed (with
                 --sweep: SWEEP beside the default); the forest's ancestor bitmask, built once per step for
                 all layers, is timed apart (ancestor_bits_us)
  vllm_chain_us  vLLM's spec-decode kernel ``fused_sigmoid_gating_delta_rule_update`` on chains of T tokens,
                 one state slot per token exactly as vLLM's spec decoding runs it
  sequential_us  a per-node tree recurrence that reloads each parent's state snapshot from global memory
and the bytes each moves, the HBM floor of the verify (every input read once, every output written once, at
the copy bandwidth measured here), the transient state of the tree (factors vs per-node snapshots) and the
factored commit of 24 GDN layers in one launch.

Timing: each variant is captured in one CUDA graph over R rotated input sets (so the L2 does not serve
repeats) and the median replay time over R is reported. g and beta are inputs of the tree kernels (vLLM
computes them with its gating kernel beforehand); the chain kernel computes them inline.

Usage: python benchmarks/gdn_kernels.py [--sweep] [--smoke]    (--smoke: tiny shapes on CPU, Triton interpreter)
Needs vLLM's FLA files: vLLM installed, or BOLE_VLLM_FLA_DIR (see tests/vllm_fla.py).
"""

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import vllm_fla  # noqa: E402
from forest_shapes import make_forest  # noqa: E402
from vllm_bole.kernels.reference import TreeFactors  # noqa: E402
from vllm_bole.kernels.tree_gdn import triton_commit, triton_verify, triton_verify_split  # noqa: E402

GDN_LAYERS = 24


@triton.jit
def _sequential_tree_kernel(q, k, v, g, beta, h0, o, snap, parent, cu_seqlens, scale,
                            HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                            BV: tl.constexpr):
    # Token-by-token GDN over a tree, like vLLM's recurrent kernel, except each node starts from its
    # parent's state snapshot in global memory instead of the previous token's state in registers.
    b, hv, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = hv // (HV // HK)
    bos = tl.load(cu_seqlens + b).to(tl.int64)
    eos = tl.load(cu_seqlens + b + 1).to(tl.int64)
    o_k = tl.arange(0, DK)
    o_v = vb * BV + tl.arange(0, BV)
    blk = o_v[:, None] * DK + o_k[None, :]
    for i in range(bos, eos):
        p = tl.load(parent + i)
        from_parent = tl.load(snap + ((bos + p) * HV + hv) * DV * DK + blk, mask=p >= 0, other=0.0)
        from_root = tl.load(h0 + (b * HV + hv) * DV * DK + blk, mask=p < 0, other=0.0)
        h = from_parent + from_root
        b_q = tl.load(q + (i * HK + hk) * DK + o_k).to(tl.float32)
        b_k = tl.load(k + (i * HK + hk) * DK + o_k).to(tl.float32)
        b_v = tl.load(v + (i * HV + hv) * DV + o_v).to(tl.float32)
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6) * scale
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        h *= tl.exp(tl.load(g + i * HV + hv))
        b_v = (b_v - tl.sum(h * b_k[None, :], 1)) * tl.load(beta + i * HV + hv)
        h += b_v[:, None] * b_k[None, :]
        tl.store(o + (i * HV + hv) * DV + o_v, tl.sum(h * b_q[None, :], 1).to(o.dtype.element_ty))
        tl.store(snap + (i * HV + hv) * DV * DK + blk, h)
        # A later node of this program may read the snapshot through other threads.
        tl.debug_barrier()


def sequential_tree(q, k, v, g, beta, h0, parent, cu, snap, o):
    batch, hk, hv, dk, dv = cu.numel() - 1, q.shape[1], v.shape[1], q.shape[2], v.shape[2]
    _sequential_tree_kernel[(batch, hv, dv // 32)](q, k, v, g, beta, h0, o, snap, parent, cu, dk ** -0.5,
                                                   HK=hk, HV=hv, DK=dk, DV=dv, BV=32, num_warps=4)


class Timer:
    """Median time of one call, from CUDA-graph replays of the calls over all input sets."""

    def __init__(self, device, reps):
        self.device, self.reps = device, reps

    def __call__(self, fns) -> float:
        for f in fns:
            f()
        if self.device == "cpu":
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) * 1e6 / len(fns)
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for f in fns:
                f()
        for _ in range(3):
            graph.replay()
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / len(fns))
        del graph
        return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus written."""
    if device == "cpu":
        return 1e11
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    us = Timer(device, 20)([lambda: b.copy_(a)])
    return 2 * a.numel() / (us * 1e-6)


def make_set(batch, t, shape, hk, hv, dk, dv, device, seed):
    """One input set: the forest, GDN inputs, vLLM's gating inputs and its per-token state cache."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    parent, cu = make_forest([(shape, t)] * batch, rng, device=device)
    n = parent.numel()
    dt = torch.bfloat16
    s = dict(parent=parent, cu=cu)
    s["q"] = torch.randn(n, hk, dk, generator=gen).to(device, dt)
    s["k"] = torch.randn(n, hk, dk, generator=gen).to(device, dt)
    s["v"] = torch.randn(n, hv, dv, generator=gen).to(device, dt)
    s["a"] = torch.randn(n, hv, generator=gen).to(device, dt)
    s["b"] = torch.randn(n, hv, generator=gen).to(device, dt)
    s["A_log"] = torch.log(torch.rand(hv, generator=gen) * 16 + 1).to(device)
    s["dt_bias"] = torch.randn(hv, generator=gen).to(device)
    s["g"] = (-s["A_log"].exp() * torch.nn.functional.softplus(s["a"].float() + s["dt_bias"])).contiguous()
    s["beta"] = torch.sigmoid(s["b"].float()).contiguous()
    s["h0"] = 0.1 * torch.randn(batch, hv, dv, dk, generator=gen).to(device)
    s["chain_cu"] = torch.arange(0, n + 1, t, dtype=torch.int32, device=device)
    return s


def chain_call(fla, s, cache, slots, n_acc):
    def run():
        fla.fused_sigmoid_gating_delta_rule_update(
            A_log=s["A_log"], a=s["a"], b=s["b"], dt_bias=s["dt_bias"], q=s["q"][None], k=s["k"][None],
            v=s["v"][None], initial_state=cache, inplace_final_state=True, cu_seqlens=s["chain_cu"],
            ssm_state_indices=slots, num_accepted_tokens=n_acc, use_qk_l2norm_in_kernel=True)
    return run


# Launch configs of both paths beside the default: the fused kernel (row tile, value block, value splits)
# and the two-kernel path (matrix row tile and warps, value row tile, value block).
SWEEP = {
    "fused-bt16-bv32-s4": dict(block_t=16, block_v=32, v_splits=4, num_warps=4),
    "fused-bt16-bv64-s1": dict(block_t=16, block_v=64, v_splits=1, num_warps=4),
    "fused-bt32-bv64-s1": dict(block_t=32, block_v=64, v_splits=1, num_warps=4),
    "split-m16w2-bt16-bv32": dict(matrices_block_t=16, matrices_num_warps=2, block_t=16, block_v=32, num_warps=4),
    "split-m16w2-bt32-bv64": dict(matrices_block_t=16, matrices_num_warps=2, block_t=32, block_v=64, num_warps=4),
    "split-m32w4-bt32-bv64": dict(matrices_block_t=32, matrices_num_warps=4, block_t=32, block_v=64, num_warps=4),
    "split-m64w4-bt64-bv64": dict(matrices_block_t=64, matrices_num_warps=4, block_t=64, block_v=64, num_warps=4),
}


def verify_configs(batch, t, args, device):
    """The default launch config and, with --sweep, the SWEEP configs that fit the tree."""
    default = triton_verify.launch_config(batch, args.hv, args.dv, t, torch.device(device))
    configs = {"default": default}
    if args.sweep:
        for name, cfg in SWEEP.items():
            tiles = [cfg["block_t"], cfg.get("matrices_block_t", 16)]
            fits = all(bt <= max(16, triton.next_power_of_2(t)) for bt in tiles) and (max(tiles) < 64 or t <= 64)
            if cfg["block_v"] <= args.dv and fits and dict(cfg, num_stages=1) != default:
                configs[name] = dict(cfg, num_stages=1)
    return configs


def _compile_one(job):
    """Run one verify launch config once on a small forest, filling Triton's on-disk kernel cache."""
    t, cfg, hk, hv, dk, dv = job
    s = make_set(1, t, "random", hk, hv, dk, dv, "cuda", seed=0)
    try:
        triton_verify.tree_gdn_verify(s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"], s["parent"], s["cu"],
                                      use_qk_l2norm_in_kernel=True, max_seqlen=t, config=cfg)
        torch.cuda.synchronize()
    except triton.runtime.errors.OutOfResources:
        pass


def precompile(args):
    """Compile every verify variant in parallel processes (compiling is most of a sweep's time)."""
    import multiprocessing as mp
    jobs, seen = [], set()
    for t in args.tree:
        for batch in args.batch:
            for cfg in verify_configs(batch, t, args, "cuda").values():
                key = (triton.cdiv(t, 32), tuple(sorted(cfg.items())))
                if key not in seen:
                    seen.add(key)
                    jobs.append((t, cfg, args.hk, args.hv, args.dk, args.dv))
    t0 = time.perf_counter()
    with mp.get_context("spawn").Pool(min(12, len(jobs))) as pool:
        pool.map(_compile_one, jobs)
    print(f"compiled {len(jobs)} verify variants in {time.perf_counter() - t0:.0f} s", flush=True)


def bench_point(batch, t, args, timer, fla, bw, device):
    hk, hv, dk, dv = args.hk, args.hv, args.dk, args.dv
    sets = [make_set(batch, t, args.shape, hk, hv, dk, dv, device, seed=1000 * batch + t + r)
            for r in range(args.sets)]
    n = batch * t
    row = {"B": batch, "T": t}

    # Bole: the ancestor bits are per forest (shared by all layers), timed with the verify all the same.
    configs = verify_configs(batch, t, args, device)
    for s in sets:
        s["bits"] = triton_verify.ancestor_bits(s["parent"], s["cu"], t)

    def verify(s, cfg):
        return lambda: triton_verify.tree_gdn_verify(
            s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"], s["parent"], s["cu"],
            use_qk_l2norm_in_kernel=True, max_seqlen=t, bits=s["bits"], config=cfg)

    config_us = {}
    for name, cfg in configs.items():
        try:
            config_us[name] = timer([verify(s, cfg) for s in sets])
        except triton.runtime.errors.OutOfResources as e:
            print(f"B={batch} T={t} {name}: {e}", flush=True)
    best = min(config_us, key=config_us.get)
    row["bole_us"] = config_us[best]
    row["bole_config"] = dict(configs[best], name=best)
    row["bole_default_us"] = config_us["default"]
    row["config_us"] = config_us
    row["ancestor_bits_us"] = timer([(lambda s=s: triton_verify.ancestor_bits(s["parent"], s["cu"], t))
                                     for s in sets])

    # vLLM's chain spec-decode kernel: one state slot per token (slot 0 is vLLM's null block).
    if fla is not None:
        caches = [torch.empty(1 + n, hv, dv, dk, device=device) for _ in sets]
        for c, s in zip(caches, sets):
            c[1 + s["chain_cu"][:-1].long()] = s["h0"]
        slots = (1 + torch.arange(n, dtype=torch.int32, device=device)).view(batch, t)
        n_acc = torch.ones(batch, dtype=torch.int32, device=device)
        row["vllm_chain_us"] = timer([chain_call(fla, s, c, slots, n_acc) for s, c in zip(sets, caches)])
        del caches
    else:
        row["vllm_chain_us"] = None

    # Sequential per-node tree baseline with per-node state snapshots.
    snaps = [torch.empty(n, hv, dv, dk, device=device) for _ in sets]
    outs = [torch.empty(n, hv, dv, dtype=torch.bfloat16, device=device) for _ in sets]
    row["sequential_us"] = timer([
        (lambda s=s, sn=sn, o=o: sequential_tree(s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"],
                                                 s["parent"], s["cu"], sn, o))
        for s, sn, o in zip(sets, snaps, outs)])
    o_bole, _ = verify(sets[0], configs["default"])()
    row["sequential_vs_bole_rel_err"] = ((outs[0].float() - o_bole.float()).norm() / o_bole.float().norm()).item()
    del snaps, outs

    # Bytes: each input read once, each output written once.
    words = triton.cdiv(t, 32)
    verify_bytes = (2 * n * hk * dk * 2 + n * hv * dv * 2 + 2 * n * hv * 4 + batch * hv * dv * dk * 4
                    + n * hv * dv * 2 + n * hk * dk * 4 + n * hv * dv * 4 + n * hv * 4 + n * words * 4)
    row["verify_bytes"] = verify_bytes
    row["hbm_floor_us"] = verify_bytes / bw * 1e6
    row["bole_gbps"] = verify_bytes / (row["bole_us"] * 1e-6) / 1e9
    row["transient_bytes_factored"] = n * (hk * dk * 4 + hv * dv * 4 + hv * 4) + n * words * 4
    row["transient_bytes_snapshot"] = n * hv * dv * dk * 4
    row["speedup"] = row["vllm_chain_us"] / row["bole_us"] if row["vllm_chain_us"] else None
    row["speedup_vs_sequential"] = row["sequential_us"] / row["bole_us"]

    # Commit of every GDN layer in one launch, into per-layer caches, at each request's deepest node.
    s = sets[0]
    _, f = triton_verify.tree_gdn_verify(s["q"], s["k"], s["v"], s["g"], s["beta"], s["h0"], s["parent"],
                                         s["cu"], use_qk_l2norm_in_kernel=True, max_seqlen=t)
    layers = args.layers
    stacked = TreeFactors(k=f.k.expand(layers, *f.k.shape).contiguous(),
                          u=f.u.expand(layers, *f.u.shape).contiguous(),
                          g_cum=f.g_cum.expand(layers, *f.g_cum.shape).contiguous())
    caches = [torch.randn(batch + 1, hv, dv, dk, device=device) for _ in range(layers)]
    depth = torch.zeros(n, dtype=torch.long)
    par = s["parent"].tolist()
    for i in range(n):
        depth[i] = 0 if par[i] < 0 else depth[(i // t) * t + par[i]] + 1
    accepted = depth.view(batch, t).argmax(1).to(torch.int32).to(device)
    row["accepted_path_len"] = int(depth.view(batch, t).max(1).values.float().mean()) + 1
    state_indices = torch.arange(1, batch + 1, dtype=torch.int32, device=device)
    commit_us = {}
    for block_v, warps in ((32, 4), (64, 4), (64, 8), (128, 8)):
        commit_us[f"bv{block_v}-w{warps}"] = timer([lambda: triton_commit.commit_accepted_inplace(
            caches, state_indices, stacked, accepted, s["parent"], s["cu"], block_v=block_v, num_warps=warps)])
    row["commit_us_all_layers"] = commit_us["bv64-w4"]
    row["commit_variants_us"] = commit_us
    state_bytes = 2 * layers * batch * hv * dv * dk * 4
    row["commit_floor_us"] = state_bytes / bw * 1e6
    row["commit_layers"] = layers
    del caches, stacked, sets
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def _compiled(kernel):
    """Compiled variants of a Triton kernel (for the resource report); empty under the interpreter."""
    caches = getattr(kernel, "device_caches", {})
    return [c for cache in caches.values() for c in cache[0].values()]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--tree", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    ap.add_argument("--shape", default="random", help="tree shape of every request (tests/forest_shapes.py)")
    ap.add_argument("--sets", type=int, default=4, help="rotated input sets per timing")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=GDN_LAYERS)
    ap.add_argument("--sweep", action="store_true", help="also time several launch configs, keep the best")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under the Triton interpreter")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kernels.json"))
    args = ap.parse_args()
    device = "cpu" if args.smoke else "cuda"
    args.hk, args.hv, args.dk, args.dv = (1, 2, 32, 32) if args.smoke else (16, 32, 128, 128)
    if args.smoke:
        args.batch, args.tree, args.sets, args.layers = [1, 2], [8, 16], 1, 2

    fla = vllm_fla.load("fused_sigmoid_gating")
    gpu = "cpu (interpreter)" if args.smoke else torch.cuda.get_device_name()
    bw = copy_bandwidth(device)
    print(f"device: {gpu}; copy bandwidth {bw / 1e12:.2f} TB/s; vLLM chain kernel: "
          f"{'found' if fla else 'MISSING'}", flush=True)
    timer = Timer(device, args.reps)
    rows = []
    if not args.smoke:
        precompile(args)
    # Largest trees last: they alone take the multi-tile path.
    for t in args.tree:
        for batch in args.batch:
            row = bench_point(batch, t, args, timer, fla, bw, device)
            row["gpu"] = gpu
            rows.append(row)
            print(json.dumps(row), flush=True)

    for name, kernel in (("verify", triton_verify._tree_gdn_verify_kernel),
                         ("verify matrices", triton_verify_split._tree_matrices_kernel),
                         ("verify values", triton_verify_split._tree_values_kernel),
                         ("commit", triton_commit._commit_kernel)):
        for compiled in _compiled(kernel):
            print(f"{name} kernel {compiled.name}: {compiled.n_regs} registers, {compiled.n_spills} spills, "
                  f"{compiled.metadata.shared} B shared, {compiled.metadata.num_warps} warps")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1) + "\n")
    fmt = "{:>3} {:>4} {:>9} {:>9} {:>10} {:>8} {:>8} {:>9} {:>8} {:>8} {:>9}"
    print(fmt.format("B", "T", "bole_us", "floor_us", "vllm_us", "speedup", "seq_us", "vs_seq", "transX",
                     "GB/s", "commit_us"))
    for r in rows:
        print(fmt.format(r["B"], r["T"], f"{r['bole_us']:.1f}", f"{r['hbm_floor_us']:.1f}",
                         f"{r['vllm_chain_us']:.1f}" if r["vllm_chain_us"] else "-",
                         f"{r['speedup']:.1f}x" if r["speedup"] else "-", f"{r['sequential_us']:.1f}",
                         f"{r['speedup_vs_sequential']:.1f}x",
                         f"{r['transient_bytes_snapshot'] / r['transient_bytes_factored']:.0f}x",
                         f"{r['bole_gbps']:.0f}", f"{r['commit_us_all_layers']:.1f}"))


if __name__ == "__main__":
    main()
