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
  tree-size bound (:func:`stand_in`): the step replays that one, its extra rows with KV slot -1 and past every
  request's tree and its extra requests empty, so they cost compute and nothing else. The key is captured only
  once its stand-ins have cost about as much as a capture would (:class:`StandIns`: an eager run, a synchronize
  and the capture, 50-150 ms at 9B shapes, several steps' worth), and not before its :data:`CAPTURE_AFTER`-th occurrence: a drained batch's one-off token counts and a
  budget rule's trial sizes then cost no capture each. ``VLLM_BOLE_CAPTURE_AFTER=1`` turns stand-ins off.
"""

import functools
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from unittest.mock import patch

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context
from vllm.utils.math_utils import next_power_of_2

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

def capture_after_from_env() -> int:
    """``VLLM_BOLE_CAPTURE_AFTER`` as a positive integer (default 3), or a one-line error naming it."""
    value = os.environ.get("VLLM_BOLE_CAPTURE_AFTER", "3")
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"VLLM_BOLE_CAPTURE_AFTER must be a positive integer (1: capture every new graph shape at "
                         f"once), got {value!r}")
    return int(value)


# The fewest occurrences of a key not yet held before it is captured; the ones before replay a larger held graph
# (:func:`stand_in`). 1 captures every new key at once (no stand-ins). ``tests/test_e2e_lossless.py`` forces
# stand-ins with ``VLLM_BOLE_CAPTURE_AFTER`` above 1000 and checks that a step used one.
CAPTURE_AFTER = capture_after_from_env()
# Past CAPTURE_AFTER, a key is captured once the extra rows its stand-ins ran add up to this many of its own steps
# (:func:`padding_cost`; rent until the rent paid equals the price): a capture costs an eager run, a synchronize
# and the capture itself, 50-150 ms at 9B shapes on an H200, about 5-10 steps of 10-25 ms.
CAPTURE_COST_STEPS = 8.0
# A forward of n rows costs about c * (max(n, FLAT_ROWS) + FIXED_ROWS): up to FLAT_ROWS rows about the same whatever
# its rows (it reads the weights once), then linear from a fixed part worth FIXED_ROWS rows. The H200's calibrated
# 9B target forward at batch 32: 6.6 ms at 8 nodes, 6.7 at 96, 7.2 at 128, 9.0 at 256, 15.1 at 512.
FLAT_ROWS = 128
FIXED_ROWS = 224
# A wider node bound tiles every tree by more rows in the GDN and tree-attention kernels: at 9B shapes and batch 16
# the GDN verify of 16-node tiles takes 29 us per layer, of 32-node tiles 45 us (docs/results.md, "GDN tree
# kernels"), about 0.4 ms over 24 layers of a 10-20 ms step.
WIDER_BOUND_COST = 0.05
# The most a stand-in may add to a step, in steps of its own (:func:`padding_cost`): e.g. 304 rows for a step of up
# to 128, 880 for one of 512.
MAX_PAD_COST = 0.5


@dataclass
class GraphStep:
    """What the layers of a graph-mode forward read instead of the step's own host values."""

    num_tokens: int          # padded rows of every activation
    num_reqs: int
    max_nodes: int           # bound on any tree's size under this key
    long_prefix: bool        # attention route: FlashAttention's prefix pass + the tree kernel
    max_model_len: int
    block_tables: dict[str, torch.Tensor]  # layer name -> its KV-cache group's persistent block table
    scratch_storage: dict    # row capacity -> GDN step buffers shared by the graphs within it (attention/gdn.py)
    # Attention inputs over all ``num_reqs`` (requests past the step's are empty: vLLM pads query_start_loc
    # with its last value and seq_lens with 0); None: the layer's own metadata (the drafter's graphs).
    query_start_loc: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    _slots: dict = field(default_factory=dict, repr=False)

    def state_slots(self, layer_name: str) -> torch.Tensor:
        """``[R]`` state slot of every request for one GDN layer: column 0 of its group's block table (vLLM
        keeps one state block per request without prefix caching), read inside the graph."""
        table = self.block_tables[layer_name]
        if table.data_ptr() not in self._slots:
            self._slots[table.data_ptr()] = table[:self.num_reqs, 0].contiguous()
        return self._slots[table.data_ptr()]

    def block_table(self, layer_name: str) -> torch.Tensor:
        return self.block_tables[layer_name][:self.num_reqs]


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
        """Every layer's persistent block table (GDN layers: column 0 is the state slot)."""
        if self._block_tables is None:
            runner = self.runner
            self._block_tables = {
                name: runner.input_batch.block_table[gid].block_table.gpu
                for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups) for name in group.layer_names}
        return self._block_tables

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
        # The commit after this step reads the layers and slot tensors of *this* graph's capture.
        scratch.layers[:], scratch.slots[:] = entry.gdn_layers, entry.gdn_slots
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
                                 scratch_storage=self.scratch_storage,
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


def node_bound(max_nodes: int, tokens: int, cap: int) -> int:
    """The node bound of a graph key for a step whose largest tree has ``max_nodes`` nodes (a plain decode: 1):
    the first of :data:`NODE_BOUNDS` that holds it, else ``cap`` (the largest tree a request may carry), never
    above the step's padded ``tokens``. Few values, so few keys; every tree of the step fits."""
    need = max(max_nodes, 1)
    bound = next((b for b in NODE_BOUNDS if need <= b < cap), cap)
    return min(bound, tokens)


def stand_in(key: tuple, held, max_seq_len: int, wider: bool = False) -> tuple | None:
    """The held key whose graph can run a step of ``key`` (padded tokens, requests, long prefix, node bound) at the
    least :func:`padding_cost`, at most :data:`MAX_PAD_COST` (then the fewest tokens): more tokens than the step's,
    the same request bucket and node bound, and the attention route the step would take at that token count. None
    when there is none. ``wider`` (verification graphs) also takes a held graph of up to twice the request bucket or
    the node bound, at as many tokens or more: its extra requests are empty, as a bucket's padding requests always
    are, and a bound only has to hold every tree of the step; of equal cost and tokens, the smaller bucket."""
    rows, reqs, long_prefix, bound = key

    def runs(k) -> bool:
        if not (rows <= k[0] and k[2] == long_prefix and k[2] == (not reads_prefix_itself(max_seq_len, k[0]))):
            return False
        if k[1] == reqs and k[3] == bound:
            return rows < k[0]
        return wider and reqs <= k[1] <= 2 * reqs and bound <= k[3] <= 2 * bound

    priced = [(padding_cost(key, k), k[0], k[3], k[1], k) for k in held if runs(k)]
    return min((p for p in priced if p[0] <= MAX_PAD_COST), default=(None,))[-1]


def padding_cost(key: tuple, held: tuple) -> float:
    """What replaying the graph of ``held`` for a step of ``key`` adds, as a share of the step's own forward (the
    cost model of :data:`FLAT_ROWS` and :data:`FIXED_ROWS`), plus :data:`WIDER_BOUND_COST` for a wider node bound.
    Empty requests of a larger bucket cost nothing here (their kernel programs find no rows)."""
    own = max(key[0], FLAT_ROWS) + FIXED_ROWS
    return (max(held[0], FLAT_ROWS) + FIXED_ROWS - own) / own + (WIDER_BOUND_COST if held[3] > key[3] else 0.0)


class StandIns:
    """When a key not held replays a larger held graph (:func:`stand_in`) instead of being captured, for one holder
    of graphs (verification or drafter levels): the misses per key, what its stand-ins' padding has cost so far
    (:func:`padding_cost`, in steps of its own), and the replays that stood in. A key is captured once that cost
    reaches :data:`CAPTURE_COST_STEPS` (at its :data:`CAPTURE_AFTER`-th occurrence at the earliest): a shape that
    keeps coming back under a much larger graph gets its own soon, one a few rows short of a held graph or below
    :data:`FLAT_ROWS` rarely or never, and a one-off never."""

    def __init__(self, wider: bool = False):
        self.wider = wider                 # :func:`stand_in`'s: larger request buckets and node bounds too
        self.misses: Counter = Counter()   # key -> steps it occurred without its own graph
        self.cost: Counter = Counter()     # key -> its stand-ins' padding so far, in steps
        self.replays = 0

    def pick(self, key: tuple, held: dict, max_seq_len: int, max_graphs: int) -> tuple | None:
        """The held key to replay for ``key`` (not held), or None: capture ``key`` (when the holder is full: run
        without a graph). A stand-in while the key's misses are fewer than ``CAPTURE_AFTER`` or its stand-ins
        have cost less than ``CAPTURE_COST_STEPS``, and whenever the holder is full; None when none fits."""
        self.misses[key] += 1
        other = stand_in(key, held, max_seq_len, self.wider)
        if other is None:
            return None
        self.cost[key] += padding_cost(key, other)
        if len(held) < max_graphs and (CAPTURE_AFTER == 1 or self.misses[key] >= CAPTURE_AFTER
                                       and self.cost[key] >= CAPTURE_COST_STEPS):
            return None
        self.replays += 1
        return other


def leading_rows(output, rows: int):
    """A graph's output cut to the step's ``rows`` (tensors, or tuples / lists of them, as the model returns)."""
    if isinstance(output, torch.Tensor):
        return output[:rows]
    if isinstance(output, (tuple, list)):
        return type(output)(leading_rows(o, rows) for o in output)
    return output


def capture(call, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """``call()`` captured into a new graph in ``pool`` (after an eager warm-up at the same shapes)."""
    graph = torch.cuda.CUDAGraph()
    # As vLLM's own captures: no full garbage collection and cache release per graph (tens of ms each).
    with patch("gc.collect", lambda *args, **kwargs: None), \
            patch("torch.cuda.empty_cache", lambda *args, **kwargs: None), \
            torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = call()
    return graph, output


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
