"""The warm-up's launch variants of eager steps (``worker/kernel_warmup.py``): one launch per variant, and a
variant names everything that makes Triton compile a launch anew (checked on the launches themselves, recorded
on the host: no kernel runs)."""

import inspect
import math
from types import SimpleNamespace

import pytest
import torch

from triton_modes import import_kernel_modules, interpreter

# As the kernel tests import them: kernel modules imported here first must hold interpreted kernels for them.
triton_verify_split, triton_verify, triton_tree_attn = import_kernel_modules(
    "vllm_bole.kernels.tree_gdn.triton_verify_split", "vllm_bole.kernels.tree_gdn.triton_verify",
    "vllm_bole.kernels.tree_attention.triton_tree_attn")
with interpreter():
    from vllm_bole.worker import kernel_warmup

CUDA = torch.device("cuda")   # launch rules read its type only (and the SM count, patched)
SMS = 132


class _Recorder:
    """Stands in for a Triton kernel: records what Triton keys a compiled variant on (constexprs, launch options,
    the classes of the integer arguments it specializes: 1, a multiple of 16, other)."""

    def __init__(self, kernel):
        # A compiled-mode or interpreted kernel (its jit options in ``kwargs``); vLLM's kernels are plain functions
        # where vLLM finds no GPU, and then every argument counts.
        self.names = list(inspect.signature(getattr(kernel, "fn", kernel)).parameters)
        options = getattr(kernel, "do_not_specialize", None) or getattr(kernel, "kwargs", {}).get("do_not_specialize")
        self.unspecialized = {self.names[d] if isinstance(d, int) else d for d in options or ()}
        self.keys = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            ints = tuple((name, 1 if a == 1 else 16 if a % 16 == 0 else 0) for name, a in zip(self.names, args)
                         if isinstance(a, int) and not isinstance(a, bool) and name not in self.unspecialized)
            self.keys.append((tuple(sorted(kwargs.items())), ints))
        return launch


def _compiled(recorders) -> tuple:
    """What the launches of one call compiled, kernel by kernel (and forgets them)."""
    out = tuple((name, tuple(r.keys)) for name, r in recorders.items())
    for r in recorders.values():
        r.keys.clear()
    return out


def _check(call, variant, max_trees, max_nodes, recorders):
    """Every (trees, nodes) compiles what the warm-up's launch of its variant compiled."""
    reps = kernel_warmup.representatives(variant, max_trees, max_nodes)
    assert len({variant(*r) for r in reps}) == len(reps)
    compiled = {}
    for trees, nodes in reps:
        call(trees, nodes)
        compiled[variant(trees, nodes)] = _compiled(recorders)
    for trees in range(1, max_trees + 1):
        for nodes in range(1, max_nodes + 1):
            call(trees, nodes)
            assert _compiled(recorders) == compiled[variant(trees, nodes)], (trees, nodes)
    return reps


def test_representatives_are_the_first_step_shape_of_each_variant():
    reps = kernel_warmup.representatives(lambda t, n: (t >= 3, n > 16), 5, 20)
    assert reps == [(1, 1), (1, 17), (3, 1), (3, 17)]


@pytest.mark.parametrize("hv", [16, 32])
def test_gdn_variants_cover_every_step_shape(monkeypatch, hv):
    monkeypatch.setattr(triton_verify, "_num_sms", lambda device: SMS)
    recorders = {}
    for module, name in ((triton_verify, "_tree_gdn_verify_kernel"), (triton_verify_split, "_tree_matrices_kernel"),
                         (triton_verify_split, "_tree_values_kernel")):
        recorders[name] = _Recorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    hk, dk, dv, max_trees, max_nodes = 8, 128, 128, 24, 65
    rows = max_trees * max_nodes
    q, k = torch.zeros(rows, hk, dk), torch.zeros(rows, hk, dk)
    v, g, beta = torch.zeros(rows, hv, dv), torch.zeros(rows, hv), torch.zeros(rows, hv)
    state = torch.zeros(1, hv, dv, dk)
    out = torch.empty(rows, hv, dv)
    factors = triton_verify.TreeFactors(k=torch.empty(rows, hk, dk), u=torch.empty(rows, hv, dv),
                                        g_cum=torch.empty(rows, hv))

    def call(trees, nodes):
        n = trees * nodes
        parent, cu = kernel_warmup.chain_forest(trees, nodes, "cpu")
        part = triton_verify.TreeFactors(k=factors.k[:n], u=factors.u[:n], g_cum=factors.g_cum[:n])
        triton_verify.tree_gdn_verify(q[:n], k[:n], v[:n], g[:n], beta[:n], state, parent, cu,
                                      state_indices=torch.zeros(trees, dtype=torch.int32), max_seqlen=nodes,
                                      bits=torch.zeros(n, math.ceil(nodes / 32), dtype=torch.int32),
                                      out_factors=part, out=out[:n])

    def variant(trees, nodes):
        return triton_verify.launch_variant(trees, hv, dv, nodes, CUDA)

    reps = _check(call, variant, max_trees, max_nodes, recorders)
    assert len(reps) <= 12   # a few seconds of compiling at start-up, not minutes


@pytest.mark.parametrize("merge", [False, True])
def test_tree_attention_variants_cover_every_step_shape(monkeypatch, merge):
    launch_config = triton_tree_attn.launch_config
    monkeypatch.setattr(triton_tree_attn, "launch_config",
                        lambda group, d, rows, trees, device, merge=False, fp32=False: launch_config(
                            group, d, rows, trees, CUDA, merge, fp32))
    monkeypatch.setattr(triton_tree_attn, "_interpreting", lambda: True)
    recorders = {"_tree_attn_kernel": _Recorder(triton_tree_attn._tree_attn_kernel)}
    monkeypatch.setattr(triton_tree_attn, "_tree_attn_kernel", recorders["_tree_attn_kernel"])
    hq, hkv, d, bs, max_trees, max_nodes = 16, 4, 256, 64, 40, 65
    rows = max_trees * max_nodes
    q, out = torch.zeros(rows, hq, d, dtype=torch.bfloat16), torch.empty(rows, hq, d, dtype=torch.bfloat16)
    kv = torch.zeros(2, hkv, bs, 2 * d, dtype=torch.bfloat16)
    prefix_lse = torch.zeros(hq, rows)

    def call(trees, nodes):
        n = trees * nodes
        first = torch.arange(trees, dtype=torch.int32)
        meta = torch.stack([first, first * nodes, torch.full_like(first, nodes), torch.full_like(first, nodes),
                            first * nodes], dim=1)
        prefix = {"prefix_out": out[:n], "prefix_lse": prefix_lse[:, :n]} if merge else {}
        triton_tree_attn.tree_attention_paged(
            q[:n], kv, torch.zeros(trees, 40, dtype=torch.int32), torch.full((trees,), nodes, dtype=torch.int32),
            meta, torch.zeros(n, math.ceil(nodes / 32), dtype=torch.int32), 0.1, max_rows=nodes, out=out[:n],
            max_seq_len=512, **prefix)

    def variant(trees, nodes):
        return triton_tree_attn.launch_variant(hq // hkv, d, nodes, trees, CUDA, merge)

    reps = _check(call, variant, max_trees, max_nodes, recorders)
    assert len(reps) <= 16


def test_next_token_variants_cover_every_step_shape(monkeypatch):
    from vllm.v1.spec_decode import utils

    from vllm_bole._vllm_compat import launch_next_token_kernel

    recorders = {"next tokens": _Recorder(utils.eagle_prepare_next_token_padded_kernel)}
    monkeypatch.setattr(utils, "eagle_prepare_next_token_padded_kernel", recorders["next tokens"])
    runner = SimpleNamespace(discard_request_mask=SimpleNamespace(gpu=torch.zeros(64, dtype=torch.bool)),
                             drafter=SimpleNamespace(backup_next_token_ids=SimpleNamespace(gpu=torch.zeros(64))),
                             input_batch=SimpleNamespace(vocab_size=1000))

    def call(batch, width):
        launch_next_token_kernel(runner, torch.full((batch, width), -1, dtype=torch.int32))

    reps = _check(call, kernel_warmup.next_token_variant, 40, 17, recorders)
    assert len(reps) == 3 * 7   # request counts 1, 16k, other; widths 1, 2, 3-4, 5-8, 9-15, 16, 17


def test_compaction_variants_cover_every_step(monkeypatch):
    """The warm-up's compactions compile every variant a step's moves reach: slot pairs of any count, and device
    walks of any request count and path width."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_bole.worker.kv_compaction import compact_layers

    monkeypatch.setattr(triton_tree_attn, "_interpreting", lambda: True)
    recorders = {"_compact_kernel": _Recorder(triton_tree_attn._compact_kernel)}
    monkeypatch.setattr(triton_tree_attn, "_compact_kernel", recorders["_compact_kernel"])
    max_trees, max_depth = 40, 8
    caches = {f"layer{i}": SimpleNamespace(kv_cache=torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16))
              for i in range(3)}
    slot_mapping = torch.zeros(max_trees * (max_depth + 1), dtype=torch.long)
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    runner = SimpleNamespace(
        compilation_config=SimpleNamespace(static_forward_context=caches), device=torch.device("cpu"),
        kv_cache_config=SimpleNamespace(
            kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=list(caches))]),
        input_batch=SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slot_mapping))]))
    count = kernel_warmup.warm_compaction(runner, max_trees * (max_depth + 1))
    warmed = set(recorders["_compact_kernel"].keys)
    assert count == len(warmed) == 6   # row tiles 16, 32, 64; slot pairs and device walks
    recorders["_compact_kernel"].keys.clear()
    layers = [c.kv_cache for c in caches.values()]
    for trees in range(1, max_trees + 1):
        for width in range(1, max_depth + 2):
            moves = torch.full((trees * width,), 5, dtype=torch.long)
            compact_layers(layers, [moves] * 3, [moves + 1] * 3)
            walk = SimpleNamespace(rows=torch.full((trees, width), 3, dtype=torch.long))
            compact_layers(layers, [slot_mapping] * 3, [slot_mapping] * 3, walk=walk,
                           starts=torch.zeros(trees, dtype=torch.int32))
    assert set(recorders["_compact_kernel"].keys) == warmed
