"""Accepted-path KV compaction: exactly the moved slots change, on vLLM's CPU cache layout (torch) and on the
FlashAttention layout for all attention layers of all KV-cache groups (Triton; interpreted without a GPU)."""

import types

import pytest
import torch

from triton_modes import DEV, GPU, import_kernel_modules

# Before vLLM imports Triton: without a GPU, Triton's own library must be built for the interpreter too.
(ta,) = import_kernel_modules("vllm_bole.kernels.tree_attention.triton_tree_attn")

from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from vllm_bole.attention.tree_attn_cpu import CPUPagedKV  # noqa: E402
from vllm_bole.kernels.tree_attention.reference import FlashPagedKV, compact_kv, tree_attention  # noqa: E402
from vllm_bole.worker import kv_compaction  # noqa: E402
from vllm_bole.step.forest import StepForest  # noqa: E402
from vllm_bole.worker.kv_compaction import accepted_slot_moves  # noqa: E402


def _cpu_cache(nb=6, h=2, bs=16, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(nb, h, bs, 2 * d, generator=g).bfloat16()


def test_paged_view_matches_vllm_cpu_layout():
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU attention cache op exists in its CPU build only")

    cache = torch.zeros(4, 2, 32, 128, dtype=torch.bfloat16)
    kv = cache.view(4, 2, 64, 64)
    kc, vc = kv.chunk(2, dim=2)
    k, v = torch.randn(40, 2, 64).bfloat16(), torch.randn(40, 2, 64).bfloat16()
    slots = torch.arange(40) + 7
    ops.cpu_attn_reshape_and_cache(k, v, kc, vc, slots, "vec", k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    got_k, got_v = CPUPagedKV(cache).get(slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


@pytest.mark.parametrize("seed", range(5))
def test_compaction_moves_exactly_the_accepted_path(seed):
    cache = _cpu_cache(seed=seed)
    before = cache.clone()
    paged = CPUPagedKV(cache)
    # Two requests whose tree nodes sit at linear slots starting at 5 and 40.
    paths = [[0, 2, 5, 6], [0, 1, 3]]
    forest = StepForest(req_ids=["a", "b"], tree_req_indices=[0, 1], parent=None, cu_seqlens=None,
                        tokens=[[0] * 8, [0] * 5], query_starts=[0, 8])
    forest.accepted_paths = paths
    slot_mapping = torch.tensor([5 + i for i in range(8)] + [40 + i for i in range(5)])
    src, dst = accepted_slot_moves(forest, slot_mapping)
    k_src, v_src = paged.get(src)
    compact_kv(paged, src, dst)
    k_dst, v_dst = paged.get(dst)
    assert torch.equal(k_dst, k_src) and torch.equal(v_dst, v_src)
    changed = (cache != before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    touched_blocks = sorted({int(s) // 16 for s in dst})
    assert set(changed) <= set(touched_blocks)
    untouched = [s for s in range(6 * 16) if s not in dst.tolist()]
    k0, v0 = CPUPagedKV(before).get(torch.tensor(untouched))
    k1, v1 = paged.get(torch.tensor(untouched))
    assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_tree_attention_reference_masks_non_ancestors():
    torch.manual_seed(0)
    q = torch.randn(3, 4, 16)
    k, v = torch.randn(7, 2, 16), torch.randn(7, 2, 16)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 is a sibling of node 1
    out = tree_attention(q, k, v, mask, 0.25)
    # Row 2 must equal attention over prefix (4 keys) + key 4 + key 6 only.
    keep = torch.tensor([0, 1, 2, 3, 4, 6])
    ref = tree_attention(q[2:3], k[keep], v[keep], torch.ones(1, 2, dtype=torch.bool), 0.25)
    assert torch.allclose(out[2:3], ref, atol=1e-6)


def _fake_runner(groups, caches):
    """groups: (spec or None for a non-attention group, layer names, slot mapping); caches: name -> tensor."""
    return types.SimpleNamespace(
        compilation_config=types.SimpleNamespace(
            static_forward_context={n: types.SimpleNamespace(kv_cache=c) for n, c in caches.items()}),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[
            types.SimpleNamespace(kv_cache_spec=spec if spec is not None else object(), layer_names=names)
            for spec, names, _ in groups]),
        input_batch=types.SimpleNamespace(block_table=[
            types.SimpleNamespace(slot_mapping=types.SimpleNamespace(gpu=slots.to(DEV))) for _, _, slots in groups]))


def test_gpu_compaction_moves_every_attention_layer_in_one_launch_per_layout(monkeypatch):
    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kv_compaction.current_platform, "is_cpu", lambda: False)
    launches = []
    real = ta.compact_kv_paged
    monkeypatch.setattr(ta, "compact_kv_paged", lambda caches, *a: launches.append(len(caches)) or real(caches, *a))
    g = torch.Generator().manual_seed(1)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    # Target layers in two KV-cache groups (own block tables, one shared buffer layout), a GDN group, and the
    # drafter's layer with a cache of another size (its own launch).
    buf = torch.randn(6, 3, 16, 2, 16, generator=g).to(DEV)               # physical [blocks, layer, bs, h, 2d]
    caches = {f"attn{i}": buf[:, i].permute(0, 2, 1, 3) for i in range(3)}
    caches["mtp"] = torch.randn(4, 16, 2, 16, generator=g).to(DEV).permute(0, 2, 1, 3)
    caches["gdn"] = torch.randn(6, 64, generator=g).to(DEV)
    paths = [[0, 2, 5, 6], [0, 1, 3]]
    forest = StepForest(req_ids=["a", "b"], tree_req_indices=[0, 1], parent=None, cu_seqlens=None,
                        tokens=[[0] * 8, [0] * 5], query_starts=[0, 8])
    forest.accepted_paths = paths
    groups = [(spec, ["attn0", "attn2"], torch.tensor([5 + i for i in range(8)] + [40 + i for i in range(5)])),
              (None, ["gdn"], torch.zeros(13, dtype=torch.long)),
              (spec, ["attn1"], torch.tensor([70 + i for i in range(8)] + [17 + i for i in range(5)])),
              (spec, ["mtp"], torch.tensor([3 + i for i in range(8)] + [50 + i for i in range(5)]))]
    before = {n: c.clone() for n, c in caches.items()}
    kv_compaction.compact_accepted_kv(_fake_runner(groups, caches), forest)
    assert sorted(launches) == [1, 3]
    assert torch.equal(caches["gdn"], before["gdn"])
    for spec_, names, slots in groups:
        if spec_ is None:
            continue
        src, dst = accepted_slot_moves(forest, slots)
        for name in names:
            want = before[name].clone()
            compact_kv(FlashPagedKV(want), src.to(DEV), dst.to(DEV))
            assert torch.equal(caches[name], want), name
            assert not torch.equal(want, before[name])


@pytest.mark.parametrize("seed", range(6))
def test_gpu_compaction_of_a_device_walk_is_the_host_paths_compaction(monkeypatch, seed):
    """A device walk's moves (the one-launch kernel that reads the walk's rows and the slot mappings itself,
    drafting before the walk) leave every layer's cache as the host paths' moves do: random paths (chains, deep
    paths under later siblings, root only), a layer group of its own, padded path columns."""
    import random

    from vllm_bole.spec_decode.device_walk import DeviceWalk

    if not GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(kv_compaction.current_platform, "is_cpu", lambda: False)
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.float32)
    sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
    paths = []
    for size in sizes:   # increasing local nodes from the root: node j of a path lies at depth j
        path = [0]
        while path[-1] < size - 1 and rng.random() < 0.8:
            path.append(rng.randint(path[-1] + 1, size - 1))
        paths.append(path)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    n, w = sum(sizes), max(len(p) for p in paths) + rng.randint(0, 2)
    rows = torch.full((len(sizes), w), -1, dtype=torch.long)
    for b, path in enumerate(paths):
        rows[b, :len(path)] = torch.tensor([starts[b] + j for j in path])
    walk = DeviceWalk(rows=rows.to(DEV), length=None, deepest=None, emitted=None)
    forest = StepForest(req_ids=[str(i) for i in range(len(sizes))], tree_req_indices=list(range(len(sizes))),
                        parent=None, cu_seqlens=torch.tensor(starts + [n], dtype=torch.int32).to(DEV),
                        tokens=[[0] * s for s in sizes], query_starts=starts)
    forest.accepted_paths = paths
    buf = torch.randn(8, 2, 16, 2, 16, generator=g).to(DEV)
    caches = {"attn0": buf[:, 0].permute(0, 2, 1, 3), "attn1": buf[:, 1].permute(0, 2, 1, 3)}
    caches["mtp"] = torch.randn(8, 16, 2, 16, generator=g).to(DEV).permute(0, 2, 1, 3)
    perm = torch.randperm(8 * 16, generator=g)
    groups = [(spec, ["attn0", "mtp"], perm[:n]), (spec, ["attn1"], perm[n:2 * n])]
    before = {k: c.clone() for k, c in caches.items()}
    kv_compaction.compact_accepted_kv(_fake_runner(groups, caches), forest, walk=walk)
    for spec_, names, slots in groups:
        src, dst = accepted_slot_moves(forest, slots)
        for name in names:
            want = before[name].clone()
            compact_kv(FlashPagedKV(want), src.to(DEV), dst.to(DEV))
            assert torch.equal(caches[name], want), name
