"""Full CUDA graphs of the MTP drafter's tree levels (GPU).

A tree level is one MTP forward over the new queries of every growing request, then the LM head and the top-k
children. With vLLM's piecewise graphs its attention layer, the LM head and the top-k run eagerly, and that host
work is most of a level's time. A level is instead replayed from a graph of all of it, keyed by (padded tokens,
requests, attention route, rows per request) and captured the first time its key occurs (eager warm-up, capture,
replay; a level only writes its own queries' MTP K/V slots, so running it again is harmless). The catch-up
forward over the tokens a step committed (at most depth + 1 per request) runs the same way, as causal tree rows.

Fixed addresses: the proposer's persistent token / position / hidden-state / slot buffers, and this module's
query_start_loc, seq_lens, block-table rows and tree-row buffers, refilled before every replay. The attention
layer reads the graph's bounds (``GraphStep``) instead of the level's host values.

As the verification graphs (``attention/graph_mode.stand_in``), a key not held yet replays a held graph of a few
more tokens (its extra rows with KV slot -1, past every request's queries) until those stand-ins have cost
about a capture's worth (``verify_graphs.StandIns``), and is captured then.
"""

import time

import torch
from vllm.config import CUDAGraphMode
from vllm.utils.math_utils import cdiv, next_power_of_2
from vllm.v1.spec_decode.utils import PADDING_SLOT_ID

from .._vllm_compat import drafter_slot_buffer
from ..attention.graph_mode import GraphStep, StandIns, capture
from ..attention.tree_attn_gpu import reads_prefix_itself
from ..logger import init_logger
from ..step.forest import DeviceTreeRows, StepForest
from .device_beam import region_words

logger = init_logger(__name__)

MAX_GRAPHS = 384   # as the verification graphs' cap (worker/verify_graphs.py); levels are cheaper to hold


class DraftGraphs:
    def __init__(self, drafter):
        self.drafter = drafter
        runner, topk = drafter.runner, drafter.bole_config.topk
        reqs, dev = runner.max_num_reqs, runner.device
        self.query_start_loc = torch.zeros(reqs + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(reqs, dtype=torch.int32, device=dev)
        self.block_table = None                      # [reqs, blocks] once the KV cache exists
        # Tree rows: a level has at most topk queries per request, over at most depth * topk + 1 region keys; the
        # catch-up forward at most depth + 1 rows per request (the accepted path and the bonus token); the first
        # pass over a verified forest (MTPTreeDrafter.first_pass_all_rows) a whole tree per request. Rows wider
        # than a forward's region keep stale bits there, which the kernel never reads (keys past the region).
        depth = drafter.bole_config.max_depth
        self.words = region_words(depth, topk)
        self.catch_up_rows = depth + 1
        self.tree_rows = drafter.bole_config.max_nodes_per_request + 1
        self.meta = torch.zeros(reqs, 5, dtype=torch.int32, device=dev)
        self.bits = torch.zeros(reqs * max(topk, self.catch_up_rows, self.tree_rows),
                                max(self.words, cdiv(self.tree_rows, 32)), dtype=torch.int32, device=dev)
        self.pool = None   # at the first capture; not shared with the verification graphs' pool
        self._layout = None   # (bucket, query_start_loc, row metadata) the buffers hold
        self.graphs: dict[tuple, tuple] = {}
        self.replays = 0
        self.capture_ms = 0.0   # host time spent capturing, all captures
        self.stand_ins = StandIns()
        self.disabled = False
        self._full_logged = False

    def level(self, cm, chunks, rows, n: int, padded: int, mode, tree_rows=(), max_rows: int | None = None):
        """(MTP hidden ``[n, H]``, top children ``[n, 2k]``) of one tree level whose inputs the drafter has
        written (``_write_inputs``: ``n`` tokens padded to ``padded``, vLLM's graph ``mode`` for that size),
        from its graph; None when the level cannot run from one (more tokens than vLLM captures for the
        drafter, too many graphs, a capture failed). ``rows``: the level's tree rows as (meta ``[reqs, 5]`` on
        the host, bits ``[rows, words]`` on the host or the device), the layout of ``DeviceTreeRows``;
        ``tree_rows``: the same rows on the host, if the drafter has them (the forest's ``attention_rows``; the
        graph reads ``rows``); ``max_rows``: the bound on any request's rows (default topk: a tree level)."""
        drafter = self.drafter
        if self.disabled or mode != CUDAGraphMode.PIECEWISE:
            return None
        # Requests padded to a power of two with empty ones (no queries, no keys): fewer keys to capture as
        # the pruned levels' request counts vary.
        reqs = len(chunks)
        bucket = min(next_power_of_2(reqs), self.seq_lens.numel())
        max_seq_len = max(c[3] for c in chunks)
        key = (padded, bucket, not reads_prefix_itself(max_seq_len, padded), max_rows or drafter.bole_config.topk)
        entry = self.graphs.get(key)
        held = None if entry is not None else self.stand_ins.pick(key, self.graphs, max_seq_len, MAX_GRAPHS)
        if held is not None:
            key, entry = held, self.graphs[held]
            # The stand-in's extra rows write no K/V (vLLM padded the slots up to ``padded`` only).
            drafter_slot_buffer(drafter.proposer)[padded:key[0]].fill_(PADDING_SLOT_ID)
        if entry is None and len(self.graphs) >= MAX_GRAPHS:
            if not self._full_logged:
                logger.info("Bole holds %d drafter CUDA graphs; new level shapes run piecewise", MAX_GRAPHS)
                self._full_logged = True
            return None
        if self.block_table is None:
            self.block_table = torch.zeros_like(cm.block_table_tensor[:1]).expand(
                self.seq_lens.numel(), -1).contiguous()
        # The level's requests and rows go into the fixed buffers (the graph reads nothing else from the host).
        qsl, seq_lens, table_rows = drafter._request_tensors(cm, chunks, bucket)
        views = (self.query_start_loc[:bucket + 1], self.seq_lens[:bucket], self.block_table[:bucket])
        views[1].copy_(seq_lens, non_blocking=True)
        views[2][:reqs].copy_(table_rows)
        meta, bits = rows
        # query_start_loc and the row metadata repeat from step to step at a fixed step shape (async
        # scheduling's first passes): copied only when they differ from what the buffers hold.
        layout = (bucket, qsl.numpy().tobytes(), meta.numpy().tobytes())
        if layout != self._layout:
            views[0].copy_(qsl, non_blocking=True)
            if bucket > reqs:  # an empty request j has no rows and is its own batch index (its prefix stays 0)
                pad = torch.zeros(bucket - reqs, 5, dtype=torch.int32)
                pad[:, 0] = torch.arange(reqs, bucket)
                meta = torch.cat([meta, pad])
            self.meta[:bucket].copy_(meta, non_blocking=True)
            self._layout = layout
        self.bits[:bits.shape[0], :bits.shape[1]].copy_(bits, non_blocking=True)
        if entry is None:
            try:
                entry = self._capture(key, drafter._metadata(cm, chunks, n, views), tree_rows, padded)
            except Exception as e:  # the level runs as before; nothing of it was committed
                logger.warning("Bole's drafter CUDA graphs are off: capturing a level failed (%s: %s)",
                               type(e).__name__, e)
                self.disabled = True
                return None
        entry[0].replay()
        self.replays += 1
        hidden_out, top = entry[1]
        return hidden_out[:n], top[:n]

    def _forest(self, key, tree_rows) -> StepForest:
        padded, reqs, long_prefix, max_rows = key
        forest = StepForest(req_ids=[], tree_req_indices=[], parent=None, cu_seqlens=None, tokens=[],
                            attention_rows=list(tree_rows), graph=GraphStep(
                                num_tokens=padded, num_reqs=reqs, max_nodes=max_rows, long_prefix=long_prefix,
                                max_model_len=self.drafter.runner.max_model_len, block_tables={},
                                scratch_storage={}))
        forest._device_rows = DeviceTreeRows(meta=self.meta[:reqs], bits=self.bits[:reqs * max_rows],
                                             num_rows=padded, max_rows=max_rows)   # reqs: the key's bucket
        return forest

    def _capture(self, key, per_layer, tree_rows, padded: int):
        start = time.perf_counter()
        drafter = self.drafter
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()

        def call():
            # A fresh forest per run: its device rows cache what they compute (inside the graph when capturing).
            hidden = drafter._run_model(per_layer, self._forest(key, tree_rows), padded, CUDAGraphMode.NONE)
            return hidden, drafter._top_rows(hidden)

        call()
        torch.cuda.synchronize()
        entry = capture(call, self.pool)
        self.graphs[key] = entry
        spent_ms = (time.perf_counter() - start) * 1e3
        self.capture_ms += spent_ms
        logger.debug("Bole captured the drafter level graph of %d tokens, %d requests in %.0f ms", key[0], key[1],
                     spent_ms)
        if len(self.graphs) == 1:
            logger.info("Bole drafts tree levels from full CUDA graphs (captured per token count, request count "
                        "and prefix route on first use)")
        return entry
