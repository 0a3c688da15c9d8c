"""The tree kernels' launch variants of eager steps, compiled at start-up (the last part of ``worker/warmup.py``).

Steps that mix trees and prefill chunks run eagerly, and there the tree kernels choose their launch parameters
(row tiles, one kernel or two, the attention route's tile) from the step's number of trees and its largest tree.
Triton compiles each new choice on first use, a stall of 0.3 to 1.3 s in the middle of serving. The warm-up's
requests only reach the tree sizes the budget rule gave them, so this module launches the kernels once per
variant any (trees, nodes) can choose (``launch_variant`` next to each kernel's ``launch_config``), with the
smallest forest of that variant: chains of dummy rows over the layers' own caches, which the kernels only read.
Everything else a compiled variant depends on is the model's shapes, or is kept out of Triton's specialization
(per-step sizes and the alignment of per-step index tensors: ``do_not_specialize`` at the kernels). The
compaction of the accepted K/V (its row tile follows the step's number of moves) and, under asynchronous
scheduling, vLLM's next-token kernel (which Triton specializes on the step's request count and row width) get the
same treatment.
"""

import time
from collections.abc import Callable, Hashable
from types import SimpleNamespace

import torch
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.kv_cache_interface import AttentionSpec

from .._vllm_compat import launch_next_token_kernel
from ..attention.gdn import BoleQwenGDN
from ..attention.tree_attn_gpu import INLINE_PREFIX_MAX_SEQ, BoleFlashAttentionImpl, reads_prefix_itself
from ..kernels.tree_attention import triton_tree_attn
from ..kernels.tree_gdn import triton_verify
from ..logger import init_logger
from ..step.forest import DeviceTreeRows
from .kv_compaction import attention_groups, compact_layers

logger = init_logger(__name__)


def representatives(variant: Callable[[int, int], Hashable], max_trees: int, max_nodes: int
                    ) -> list[tuple[int, int]]:
    """One (trees, nodes) per distinct ``variant(trees, nodes)`` over every step of 1..``max_trees`` trees whose
    largest has 1..``max_nodes`` nodes (host arithmetic only): the fewest trees, then the fewest nodes, that reach
    it."""
    chosen: dict[Hashable, tuple[int, int]] = {}
    for trees in range(1, max_trees + 1):
        for nodes in range(1, max_nodes + 1):
            chosen.setdefault(variant(trees, nodes), (trees, nodes))
    return sorted(chosen.values())


def chain_forest(trees: int, nodes: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(parent, cu_seqlens) int32 of ``trees`` chains of ``nodes`` nodes (the shape of a tree does not change
    which variant its launch compiles)."""
    parent = torch.arange(-1, nodes - 1, dtype=torch.int32, device=device).repeat(trees)
    cu_seqlens = torch.arange(0, trees * nodes + 1, nodes, dtype=torch.int32, device=device)
    return parent, cu_seqlens


def warm_gdn(layer: BoleQwenGDN, max_trees: int, max_nodes: int, dtype: torch.dtype) -> int:
    """Launches conv, gates and GDN verification once per variant; returns the number of variants."""
    hk, hv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
    dk, dv = layer.head_k_dim, layer.head_v_dim
    device = layer.A_log.device
    shapes = representatives(lambda t, n: triton_verify.launch_variant(t, hv, dv, n, device), max_trees,
                             max_nodes)
    for trees, nodes in shapes:
        parent, cu_seqlens = chain_forest(trees, nodes, device)
        rows = trees * nodes
        x = torch.zeros(rows, 2 * hk * dk + hv * dv, dtype=dtype, device=device)
        ba = torch.zeros(rows, 2 * hv, dtype=dtype, device=device)   # the layer's b and a: column halves
        bits = triton_verify.ancestor_bits(parent, cu_seqlens, nodes) if parent.is_cuda else None
        # (factors None: the verification allocates them, as serving's scratch would hold them)
        layer.tree_kernels(x, ba[:, :hv], ba[:, hv:], torch.zeros(trees, dtype=torch.int32, device=device), parent,
                           cu_seqlens, nodes, bits, torch.empty_like(x), None)
    return len(shapes)


def warm_attention(layer, block_table: torch.Tensor, max_trees: int, max_nodes: int, dtype: torch.dtype) -> int:
    """Launches the tree attention kernel once per variant of either route (``attention/tree_attn_gpu.py``);
    ``block_table``: the layer's group's, whose row stride the dummy table keeps. Returns the number of
    variants."""
    impl = layer.impl
    kv_cache = layer.kv_cache
    hkv, _, two_d = kv_cache.shape[1:]
    hq, d = impl.num_heads, two_d // 2
    group, device = hq // hkv, kv_cache.device
    count = 0
    for merge in (False, True):
        def variant(trees, nodes, merge=merge):
            if not merge and not reads_prefix_itself(max(INLINE_PREFIX_MAX_SEQ, 1), trees * nodes):
                return None   # the rule sends such steps down the other route
            return triton_tree_attn.launch_variant(group, d, nodes, trees, device, merge, dtype == torch.float32)

        for trees, nodes in representatives(variant, max_trees, max_nodes):
            if variant(trees, nodes) is None:
                continue
            rows = trees * nodes
            meta = DeviceTreeRows.verified_meta(chain_forest(trees, nodes, device)[1])
            q = torch.zeros(rows, hq, d, dtype=dtype, device=device)
            prefix = {}
            if merge:
                prefix = {"prefix_out": torch.zeros_like(q),
                          "prefix_lse": torch.zeros(hq, rows, dtype=torch.float32, device=device)}
            triton_tree_attn.tree_attention_paged(
                q, kv_cache, torch.zeros(trees, block_table.shape[1], dtype=block_table.dtype, device=device),
                torch.full((trees,), nodes, dtype=torch.int32, device=device), meta,
                torch.zeros(rows, -(-nodes // 32), dtype=torch.int32, device=device), impl.scale, max_rows=nodes,
                max_seq_len=INLINE_PREFIX_MAX_SEQ, **prefix)
            count += 1
    return count


def warm_compaction(runner, max_moves: int) -> int:
    """The accepted K/V's compaction (``worker/kv_compaction.py``) once per row tile its steps can choose, with
    moves from slot pairs and from a device walk's rows; every move is -1 (skipped), so no cache changes. Returns
    the number of variants."""
    layers = runner.compilation_config.static_forward_context
    caches, slots = [], []
    for slot_mapping, names in attention_groups(runner):
        caches += [layers[name].kv_cache for name in names]
        slots += [slot_mapping] * len(names)
    if not caches:
        return 0
    tiles = representatives(lambda _, moves: triton_tree_attn.compact_tile(moves), 1, max_moves)
    for _, moves in tiles:
        none = torch.full((moves,), -1, dtype=torch.long, device=runner.device)
        compact_layers(caches, [none] * len(caches), [none] * len(caches))
        walk = SimpleNamespace(rows=none[None, :])   # one path of ``moves`` rows, none of them there
        compact_layers(caches, slots, slots, walk=walk, starts=torch.zeros(1, dtype=torch.int32,
                                                                             device=runner.device))
    return 2 * len(tiles)


def next_token_variant(batch: int, width: int) -> tuple:
    """What Triton keys vLLM's next-token kernel on: the classes of its request count and row width (1, a
    multiple of 16, other) and its tile."""
    def cls(n):
        return 1 if n == 1 else 16 if n % 16 == 0 else 0

    return cls(batch), cls(width), next_power_of_2(width)


def warm_next_tokens(runner, max_trees: int, max_depth: int) -> int:
    """vLLM's next-token kernel (asynchronous steps: ``_vllm_compat.launch_next_token_kernel``) once per variant
    of a step's emitted rows (up to ``max_depth + 1`` tokens); returns the number of variants."""
    shapes = representatives(next_token_variant, max_trees, max_depth + 1)
    for batch, width in shapes:
        launch_next_token_kernel(runner, torch.full((batch, width), -1, dtype=torch.int32, device=runner.device))
    return len(shapes)


def warm_up_kernels(runner) -> None:
    """Every launch variant of the tree kernels on ``runner``'s model (a GPU runner of a Bole engine)."""
    start = time.perf_counter()
    layers = runner.compilation_config.static_forward_context
    max_trees = runner.scheduler_config.max_num_seqs
    max_nodes = runner.bole_config.max_nodes_per_request + 1
    dtype = runner.model_config.dtype
    counts = {}
    gdn = next((m for m in layers.values() if isinstance(m, BoleQwenGDN)), None)
    if gdn is not None:
        counts["GDN"] = warm_gdn(gdn, max_trees, max_nodes, dtype)
    for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
        layer = next((layers[name] for name in group.layer_names
                      if isinstance(getattr(layers[name], "impl", None), BoleFlashAttentionImpl)), None)
        if isinstance(group.kv_cache_spec, AttentionSpec) and layer is not None:
            counts["attention"] = warm_attention(layer, runner.input_batch.block_table[gid].block_table.gpu,
                                                 max_trees, max_nodes, dtype)
            break
    counts["compaction"] = warm_compaction(runner, max_trees * (runner.bole_config.max_depth + 1))
    if runner.bole_async:
        counts["next tokens"] = warm_next_tokens(runner, max_trees, runner.bole_config.max_depth)
    torch.cuda.synchronize()
    logger.info("Bole warm-up: tree kernels launched in every variant of eager steps (%s) in %.1f s",
                ", ".join(f"{name}: {n}" for name, n in counts.items()), time.perf_counter() - start)
