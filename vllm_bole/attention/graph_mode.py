"""A forward replayed from a full CUDA graph: what Bole's layers read inside one instead of the step's host values
(:class:`GraphStep`), the capture, and when a shape borrows a larger held graph instead of getting its own
(:class:`StandIns`). Shared by the three graph holders: verification steps (``worker/verify_graphs.py``), the
drafter's catch-up (``spec_decode/draft_graphs.py``) and its tree levels (``spec_decode/beam_graphs.py``).
"""

import time
from collections import Counter
from dataclasses import dataclass, field
from unittest.mock import patch

import torch

from .. import envs
from .tree_attn_gpu import reads_prefix_itself


# The fewest occurrences of a key not yet held before it is captured; the ones before replay a larger held graph
# (:func:`stand_in`). 1 captures every new key at once (no stand-ins). ``tests/test_e2e_lossless.py`` forces
# stand-ins with ``VLLM_BOLE_CAPTURE_AFTER`` above 1000 and checks that a step used one.
CAPTURE_AFTER = envs.VLLM_BOLE_CAPTURE_AFTER
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
    # Prefix caching (vLLM's "align" mode): GDN layer name -> its group's block size; the running state of a
    # request then lives in the block of its last scheduled token
    state_block_sizes: dict[str, int] = field(default_factory=dict)
    _slots: dict = field(default_factory=dict, repr=False)

    def state_slots(self, layer_name: str) -> torch.Tensor:
        """``[R]`` state slot of every request for one GDN layer, read inside the graph from its group's block
        table: column 0 (vLLM keeps one state block per request without prefix caching), or with prefix caching
        the column of the last scheduled token, ``(seq_len - 1) // block_size``, as vLLM's
        ``mamba_get_block_table_tensor`` picks it (padded requests, ``seq_len`` 0: column 0)."""
        table = self.block_tables[layer_name]
        if table.data_ptr() not in self._slots:
            block = self.state_block_sizes.get(layer_name)
            if block is None:
                slots = table[:self.num_reqs, 0].contiguous()
            else:
                column = ((self.seq_lens[:self.num_reqs] - 1) // block).clamp_(min=0)
                slots = table[:self.num_reqs].gather(1, column[:, None].long()).squeeze(1)
            self._slots[table.data_ptr()] = slots
        return self._slots[table.data_ptr()]

    def block_table(self, layer_name: str) -> torch.Tensor:
        return self.block_tables[layer_name][:self.num_reqs]


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


# Graphs captured so far in this process and the milliseconds their captures took: a capture stalls its step, so
# the scheduler's stats line reports those of each interval (spec_decode/budget.BudgetLog).
_captures = [0, 0.0]


def capture_totals() -> tuple[int, float]:
    """(graphs captured, milliseconds capturing) since the process started."""
    return _captures[0], _captures[1]


def capture(call, pool) -> tuple[torch.cuda.CUDAGraph, object]:
    """``call()`` captured into a new graph in ``pool`` (after an eager warm-up at the same shapes)."""
    start = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    # As vLLM's own captures: no full garbage collection and cache release per graph (tens of ms each).
    with patch("gc.collect", lambda *args, **kwargs: None), \
            patch("torch.cuda.empty_cache", lambda *args, **kwargs: None), \
            torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        output = call()
    _captures[0] += 1
    _captures[1] += 1e3 * (time.perf_counter() - start)
    return graph, output
