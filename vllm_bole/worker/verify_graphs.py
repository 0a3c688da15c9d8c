"""Full CUDA graphs of tree verification steps (GPU).

vLLM runs Bole's steps with piecewise CUDA graphs: the pieces between layers replay, but every GDN and
attention layer runs eagerly, and at Qwen3.5 sizes their host work (about 1 ms per GDN layer) is what the GPU
waits on. A step whose scheduled tokens are all tree nodes ("tree-only": no prefill in the batch) is instead
replayed from a graph of the whole target forward that Bole captures itself, one per key
(padded token count, number of requests, attention route, bound on the trees' sizes):

- the inputs keep fixed addresses: vLLM's persistent input ids / embeddings, positions, slot mappings,
  query_start_loc, seq_lens and block tables, and Bole's forest buffer (parents, cu_seqlens), written before
  every replay;
- every host value a layer would read from the step is replaced by a bound of the key
  (:class:`GraphStep`: the key's bound on tree sizes, longest sequence); the kernels read the real sizes from
  ``cu_seqlens`` / ``seq_lens`` on the device;
- a key is captured the first time it occurs: one eager run of the graph-mode layer code (Triton compiles
  there; it computes this step's outputs), the capture, then a replay. Re-running a verification forward is
  harmless: it writes only this step's K/V slots and Bole's per-step scratch;
- unless a held graph of the same route has a few more tokens, or as many for up to twice the requests or the
  tree-size bound (``attention/graph_mode.stand_in``): the step replays that one, its extra rows with KV slot -1
  and past every request's tree and its extra requests empty, so they cost compute and nothing else. The key is
  captured only once its stand-ins have cost about as much as a capture would (``graph_mode.StandIns``: an eager
  run, a synchronize and the capture, 50-150 ms at 9B shapes, several steps' worth), and not before its
  ``CAPTURE_AFTER``-th occurrence: a drained batch's one-off token counts and a budget rule's trial sizes then
  cost no capture each. ``VLLM_BOLE_CAPTURE_AFTER=1`` turns stand-ins off.
"""

import functools
import time
from dataclasses import dataclass

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.kv_cache_interface import MambaSpec

from ..attention.graph_mode import GraphStep, StandIns, capture, leading_rows
from ..attention.tree_attn_gpu import reads_prefix_itself
from ..logger import init_logger

logger = init_logger(__name__)

# Tree-size bounds of the graph keys below the largest tree a request may carry: the GDN and tree-attention kernels
# size their row tiles by the bound, so a step of 5-node trees run under a 33-node bound did the work of 64-row tiles.
NODE_BOUNDS = (8, 16, 32)

# Graphs kept per engine; later keys run with vLLM's piecewise graphs. The graphs share one pool (a graph keeps
# only its output there; activations are reused across captures) and one GDN scratch per power-of-two token
# capacity, so a graph costs its capture time (tens of ms) more than memory. A calibration sweep plus serving
# batch sizes 1..64 holds a few hundred keys.
MAX_GRAPHS = 384


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    output: object
    scratch: object          # the GDN layers' step buffers (shared by the graphs of one token count)
    gdn_layers: list         # the GDN layers the capture saw, in order, and the slot tensors it recorded
    gdn_slots: list          # (written by every replay) for the commit
    input_ptrs: tuple


def _ptrs(inputs) -> tuple:
    return tuple(t.data_ptr() if isinstance(t, torch.Tensor) else t for t in inputs)


class VerifyGraphs:
    """Bole's verification graphs of one model runner, and the persistent forest buffer they read."""

    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple, _Graph] = {}
        self.scratch: dict[int, object] = {}   # padded token count -> GDNStepScratch (views of the storage)
        self.scratch_storage: dict[int, object] = {}
        self.pool = None   # at the first capture
        self.capacity = runner.max_num_tokens
        self.forest_buf = torch.zeros(self.capacity + runner.max_num_reqs + 1, dtype=torch.int32,
                                      device=runner.device)
        self._block_tables = None
        self._state_block_sizes = None
        self._full_logged = False
        self.replays = 0   # verification steps run from a graph (the capturing step included)
        self.capture_ms = 0.0   # host time spent capturing (eager warm-up, synchronize, capture), all captures
        # Stand-ins of larger request buckets and node bounds too: the layers read the graph's requests and bound
        # (_enter), and vLLM pads query_start_loc and seq_lens past the step's requests to the buffers' ends.
        self.stand_ins = StandIns(wider=True)

    # ---- forest buffer --------------------------------------------------------------------------------
    def forest_tensors(self, parents, cu_seqlens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(parent ``[N]``, cu_seqlens ``[B+1]``) as views of the persistent buffer, filled from the host (or
        from a device tensor of parents); cu_seqlens continues with its last value up to the capacity (empty
        requests, for padded graphs)."""
        n, cap = len(parents), self.capacity
        if not isinstance(parents, torch.Tensor):
            parents = torch.tensor(parents, dtype=torch.int32)
        self.forest_buf[:n].copy_(parents, non_blocking=True)
        tail = self.forest_buf.numel() - cap - len(cu_seqlens)
        self.forest_buf[cap:].copy_(torch.tensor(cu_seqlens + cu_seqlens[-1:] * tail, dtype=torch.int32),
                                    non_blocking=True)
        return self.forest_buf[:n], self._cu_seqlens(len(cu_seqlens) - 1)

    def _cu_seqlens(self, num_trees: int) -> torch.Tensor:
        """The forest buffer's cu_seqlens of the first ``num_trees`` trees (the step's, then empty ones)."""
        return self.forest_buf[self.capacity:self.capacity + num_trees + 1]

    def block_tables(self) -> dict[str, torch.Tensor]:
        """Every layer's persistent block table (GDN layers: the state slot's column, :meth:`state_block_sizes`)."""
        if self._block_tables is None:
            runner = self.runner
            self._block_tables = {
                name: runner.input_batch.block_table[gid].block_table.gpu
                for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups) for name in group.layer_names}
        return self._block_tables

    def state_block_sizes(self) -> dict[str, int]:
        """With prefix caching (``mamba_cache_mode`` "align"), each state layer's block size: its running state
        moves along the block table (``GraphStep.state_slots``); otherwise empty (column 0)."""
        if self._state_block_sizes is None:
            runner = self.runner
            self._state_block_sizes = {}
            if runner.cache_config.mamba_cache_mode == "align":
                self._state_block_sizes = {name: g.kv_cache_spec.block_size
                                           for g in runner.kv_cache_config.kv_cache_groups
                                           if isinstance(g.kv_cache_spec, MambaSpec) for name in g.layer_names}
        return self._state_block_sizes

    # ---- one step -------------------------------------------------------------------------------------
    def key(self, forest, inputs) -> tuple | None:
        """(padded tokens, requests, long prefix, node bound) when this step can run from a graph, else None."""
        input_ids, positions, inputs_embeds, intermediate_tensors, _ = inputs
        if not forest.tree_only or intermediate_tensors is not None:
            return None
        if get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.PIECEWISE:
            return None   # eager configurations, or more tokens than vLLM captures
        rows = input_ids if input_ids is not None else inputs_embeds
        # Requests padded to a power of two with empty ones: fewer keys as requests come and go.
        bucket = min(next_power_of_2(forest.num_trees), self.runner.max_num_reqs)
        return (rows.shape[0], bucket, not reads_prefix_itself(forest.max_seq_len, rows.shape[0]),
                node_bound(forest.max_nodes, rows.shape[0], self.runner.bole_config.max_nodes_per_request + 1))

    def forward(self, forest, call, inputs):
        """The step's model output: replayed from the key's graph (captured now if new), or ``call()``."""
        key = self.key(forest, inputs)
        if key is None:
            return call()
        rows = key[0]
        entry = self.graphs.get(key)
        if entry is None:
            held = self.stand_ins.pick(key, self.graphs, forest.max_seq_len, MAX_GRAPHS)
            if held is not None:
                key, entry = held, self.graphs[held]
                self._unused_rows_write_nothing(rows, key[0])
            elif len(self.graphs) >= MAX_GRAPHS:
                if not self._full_logged:
                    logger.info("Bole holds %d verification CUDA graphs; new shapes run piecewise", MAX_GRAPHS)
                    self._full_logged = True
                return call()
        if entry is not None and entry.input_ptrs != _ptrs(inputs):
            return call()   # vLLM moved an input buffer: the graph would read stale memory
        forest.promote_plain_decodes(self.forest_tensors)   # a graph runs them as one-node trees
        if entry is None:
            entry = self._capture(key, forest, call, inputs)
        self._enter(key, forest)
        scratch = forest.gdn_scratch = entry.scratch
        # The commit after this step reads the layers and slot tensors of *this* graph's capture, and the step's
        # block checkpoints (prefix caching), which no layer's host code saw.
        scratch.layers[:], scratch.slots[:] = entry.gdn_layers, entry.gdn_slots
        scratch.checkpoints[:] = (step_checkpoints(entry.gdn_layers, forest.tree_req_indices)
                                  if self.state_block_sizes() else [])
        entry.graph.replay()
        self.replays += 1
        forest.cu_seqlens = self._cu_seqlens(forest.num_trees)
        return leading_rows(entry.output, rows) if key[0] != rows else entry.output

    def _unused_rows_write_nothing(self, rows: int, upto: int) -> None:
        """KV slot -1 for the rows a stand-in graph has past the step's ``rows`` (vLLM set it up to ``rows``),
        in every KV-cache group's persistent slot mapping, which the graph's layers read."""
        for table in self.runner.input_batch.block_table:
            table.slot_mapping.gpu[rows:upto].fill_(-1)

    def _enter(self, key, forest) -> None:
        """Point the forest at the key's bounds and buffers (what the layers read in graph mode); the GDN
        scratch of the token count starts without layers, as the first GDN layer of a forward expects."""
        tokens, reqs, long_prefix, bound = key
        runner = self.runner
        forest.graph = GraphStep(num_tokens=tokens, num_reqs=reqs, max_nodes=bound, long_prefix=long_prefix,
                                 max_model_len=runner.max_model_len, block_tables=self.block_tables(),
                                 scratch_storage=self.scratch_storage, state_block_sizes=self.state_block_sizes(),
                                 query_start_loc=runner.query_start_loc.gpu[:reqs + 1],
                                 seq_lens=runner.seq_lens[:reqs])
        forest.parent = self.forest_buf[:tokens]
        # The layers see ``reqs`` trees (the step's, then empty ones); the commit gets the step's back.
        forest.cu_seqlens = self._cu_seqlens(reqs)
        forest.max_nodes = bound
        forest.reset_device_cache()
        scratch = self.scratch.get(tokens)
        if scratch is not None:
            scratch.reset()
        forest.gdn_scratch = scratch

    def _capture(self, key, forest, call, inputs) -> _Graph:
        start = time.perf_counter()
        context = get_forward_context()
        mode = context.cudagraph_runtime_mode
        # Inside Bole's graph vLLM's pieces run their compiled code instead of replaying their own graphs.
        context.cudagraph_runtime_mode = CUDAGraphMode.NONE
        try:
            self._enter(key, forest)
            call()  # warm-up at the graph's shapes; allocates the GDN scratch of this token count
            self.scratch[key[0]] = forest.gdn_scratch
            torch.cuda.synchronize()
            self._enter(key, forest)
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph, output = capture(call, self.pool)
        finally:
            context.cudagraph_runtime_mode = mode
        scratch = forest.gdn_scratch
        entry = _Graph(graph=graph, output=output, scratch=scratch, gdn_layers=list(scratch.layers),
                       gdn_slots=list(scratch.slots), input_ptrs=_ptrs(inputs))
        self.graphs[key] = entry
        spent_ms = (time.perf_counter() - start) * 1e3
        self.capture_ms += spent_ms
        logger.debug("Bole captured the verification graph of %d tokens, %d requests (%s prefixes, trees of at most "
                     "%d nodes) in %.0f ms", key[0], key[1], "long" if key[2] else "short", key[3], spent_ms)
        if len(self.graphs) == 1:
            logger.info("Bole verifies tree-only steps from full CUDA graphs (captured per token count, "
                        "request count, prefix route and tree-size bound on first use)")
        return entry


def step_checkpoints(layers, req_indices: list[int]) -> list:
    """Per GDN layer, the block checkpoints of this step's metadata (``gdn_metadata.BlockCheckpoints``, prefix
    caching; else None) over the forest's requests ``req_indices``."""
    attn = get_forward_context().attn_metadata
    over: dict[int, object] = {}   # the layers of one KV-cache group share their metadata
    out = []
    for layer in layers:
        meta = attn.get(layer.prefix) if isinstance(attn, dict) else None
        checkpoints = getattr(meta, "bole_checkpoints", None)
        if checkpoints is not None and id(checkpoints) not in over:
            over[id(checkpoints)] = checkpoints.over(req_indices)
        out.append(None if checkpoints is None else over[id(checkpoints)])
    return out


def node_bound(max_nodes: int, tokens: int, cap: int) -> int:
    """The node bound of a graph key for a step whose largest tree has ``max_nodes`` nodes (a plain decode: 1):
    the first of :data:`NODE_BOUNDS` that holds it, else ``cap`` (the largest tree a request may carry), never
    above the step's padded ``tokens``. Few values, so few keys; every tree of the step fits."""
    need = max(max_nodes, 1)
    bound = next((b for b in NODE_BOUNDS if need <= b < cap), cap)
    return min(bound, tokens)


def model_forward(graphs: VerifyGraphs, forest, call, input_ids, positions, intermediate_tensors, inputs_embeds,
                  model_kwargs):
    """The runner's model call of a step with a forest: through Bole's graphs when the step allows, else
    ``call`` as vLLM does it."""
    call = functools.partial(call, input_ids=input_ids, positions=positions,
                             intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                             **model_kwargs)
    inputs = (input_ids, positions, inputs_embeds, intermediate_tensors,
              tuple(sorted((k, v.data_ptr() if isinstance(v, torch.Tensor) else repr(v))
                           for k, v in model_kwargs.items())))
    return graphs.forward(forest, call, inputs)
