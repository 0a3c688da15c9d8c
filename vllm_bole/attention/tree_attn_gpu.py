"""GPU attention backend that runs tree rows with their ancestor mask (vLLM's FlashAttention underneath).

Tree rows (``StepForest.attention_rows``, from the verifier or the MTP drafter) see their request's committed
prefix plus their visible region keys. vLLM 0.26 writes the step's K/V before ``forward``
(``forward_includes_kv_cache_update = False``), so the tree kernel reads every key from the paged cache:
- "split": FlashAttention's non-causal pass over the prefixes (``seqused_k`` = prefix length, with its LSE;
  it splits long prefixes over the GPU), then the Triton tree kernel over each row's region keys, which merges
  the two in its epilogue;
- "single": the tree kernel alone reads prefix and region (one launch; each program walks its prefix alone).
The route rule (:func:`reads_prefix_itself`), fit to the H200 runs of benchmarks/tree_attention.py (B 1/8/32,
prefix 128/1024/4096, 4/16/64 nodes per request; Qwen3.5-9B heads): "single" iff the longest sequence is at most
``INLINE_PREFIX_MAX_SEQ`` (512) keys and the step has at most ``INLINE_MAX_TREE_ROWS`` (2048) tree rows. Measured:
"single" is faster at the 128-token prefixes (e.g. B=8, 64 nodes: 17.1 vs 25.9 us; B=32, 64 nodes,
2048 rows: 37.3 vs 51.5 us), "split" at every 1024- or 4096-token prefix (e.g. B=32, 64 nodes, 1024: 101.8 vs
136.8 us; B=1, 4 nodes, 1024: 18.3 vs 59.0 us). The rule reads host values only (longest sequence, tree rows), so
a CUDA graph's key carries it: the graphs of worker/verify_graphs.py and spec_decode/{draft,beam}_graphs.py apply
it to their padded token counts.
When every row of the batch is a tree row, vLLM's causal pass is skipped; otherwise (prefills in the same
step) it runs first, and the tree kernel overwrites the tree rows.
"""


import torch
from vllm.utils.torch_utils import canonicalize_singleton_dim_strides
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import fa_utils
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .. import envs
from ..kernels.tree_attention import triton_tree_attn
from ..step.forest import current_forest

# Both routes are exact. VLLM_BOLE_INLINE_PREFIX_MAX_SEQ replaces the rule by one threshold on the longest
# sequence (tests use 0 to run the prefix pass on short models).
_FORCED_MAX_SEQ = envs.VLLM_BOLE_INLINE_PREFIX_MAX_SEQ
INLINE_PREFIX_MAX_SEQ = 512 if _FORCED_MAX_SEQ is None else _FORCED_MAX_SEQ
INLINE_MAX_TREE_ROWS = 2048


def reads_prefix_itself(max_seq_len: int, tree_rows: int) -> bool:
    """Whether the tree kernel alone serves a forward ("single" route, module docstring), from host values only:
    the longest sequence and the step's tree rows (in a graph, its padded token count)."""
    if _FORCED_MAX_SEQ is not None:
        return max_seq_len <= INLINE_PREFIX_MAX_SEQ
    return max_seq_len <= INLINE_PREFIX_MAX_SEQ and tree_rows <= INLINE_MAX_TREE_ROWS


def unsupported_reason(impl: FlashAttentionImpl) -> str | None:
    """Why tree rows cannot run on this layer, or None."""
    if impl.attn_type != AttentionType.DECODER:
        return f"attention type {impl.attn_type}"
    if impl.kv_cache_dtype not in ("auto", "bfloat16", "float16"):
        return f"kv_cache_dtype {impl.kv_cache_dtype!r}"
    if impl.sliding_window != (-1, -1):
        return "sliding-window attention"
    if impl.alibi_slopes is not None or impl.sinks is not None or impl.logits_soft_cap:
        return "ALiBi, attention sinks or logits soft-capping"
    if impl.dcp_world_size > 1 or impl.pcp_world_size > 1:
        return "context parallelism"
    return None


def prefix_pass(impl: FlashAttentionImpl, query, kv_cache, attn_metadata, prefix_lens, out, graph=None,
                query_start_loc=None, block_table=None) -> torch.Tensor:
    """FlashAttention over every request's first ``prefix_lens[b]`` keys for all its query rows, non-causal,
    into ``out``; returns the LSE ``[Hq, num_tokens]``. Requests with ``prefix_lens`` 0 attend to nothing.
    In graph mode the host lengths are the graph's bounds, not this step's."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    max_q = graph.max_nodes if graph is not None else attn_metadata.max_query_len
    max_k = graph.max_model_len if graph is not None else attn_metadata.max_seq_len
    _, lse = fa_utils.flash_attn_varlen_func(
        q=query, k=canonicalize_singleton_dim_strides(key_cache), v=canonicalize_singleton_dim_strides(value_cache),
        out=out, cu_seqlens_q=attn_metadata.query_start_loc if query_start_loc is None else query_start_loc,
        max_seqlen_q=max_q, seqused_k=prefix_lens, max_seqlen_k=max_k, softmax_scale=impl.scale, causal=False,
        block_table=attn_metadata.block_table if block_table is None else block_table, return_softmax_lse=True,
        fa_version=impl.vllm_flash_attn_version, num_splits=attn_metadata.max_num_splits)
    return lse


class BoleFlashAttentionImpl(FlashAttentionImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tree_unsupported = unsupported_reason(self)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        forest = current_forest()
        if attn_metadata is None or forest is None or not forest.has_tree_rows:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                   output_block_scale)
        if self.tree_unsupported or output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"Bole tree attention does not support "
                                      f"{self.tree_unsupported or 'fused output quantization'}")
        rows = forest.device_rows(query.device)
        graph = forest.graph
        # Graph mode (worker/verify_graphs.py): every row is a tree node or padding, and host values are the
        # graph's bounds (this step's token count and longest sequence would be baked into the graph).
        n = query.shape[0] if graph is not None else attn_metadata.num_actual_tokens
        only_trees = graph is not None or rows.num_rows == n
        if not only_trees:
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output)
        qsl, seq_lens, block_table = attn_metadata.query_start_loc, attn_metadata.seq_lens, attn_metadata.block_table
        if graph is not None and graph.query_start_loc is not None:  # over the graph's (padded) requests
            qsl, seq_lens, block_table = graph.query_start_loc, graph.seq_lens, graph.block_table(layer.layer_name)
        prefix_out = prefix_lse = None
        if graph.long_prefix if graph is not None else not reads_prefix_itself(
                attn_metadata.max_seq_len, rows.num_rows):
            # With only tree rows the prefix pass writes straight into the output, merged there in place.
            prefix_out = output[:n] if only_trees else torch.empty_like(output[:n])
            prefix_lse = prefix_pass(self, query[:n], kv_cache, attn_metadata, rows.prefix_lens(seq_lens), prefix_out,
                                     graph, qsl, block_table)
        # A bound on the sequences the tree kernel reads whole: the rule's, which bounds them on this route. Not the
        # step's longest sequence: a graph's metadata holds capture-time values, and in eager steps each new bound
        # would be a kernel variant of its own (the table of blocks is sized by it) compiled mid-serving.
        max_seq = INLINE_PREFIX_MAX_SEQ
        triton_tree_attn.tree_attention_paged(
            query[:n], kv_cache, block_table, seq_lens, rows.meta, rows.bits, self.scale, max_rows=rows.max_rows,
            out=output[:n], prefix_out=prefix_out, prefix_lse=prefix_lse, max_seq_len=max_seq)
        return output


class BoleFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return BoleFlashAttentionImpl
