"""The MTP drafter's first pass over every verified node (``MTPTreeDrafter.first_pass_all_rows``), device-row
branch (the GPU's), on CPU with stand-ins: what it hands to the drafter graphs or the eager forward, for a step of
trees and for trees beside a prefill chunk."""

from types import SimpleNamespace

import pytest
import torch

from vllm_bole.spec_decode.mtp_tree_drafter import MTPTreeDrafter
from vllm_bole.step.forest import DeviceTreeRows, StepForest, flat_forest

TREES = [[-1, 0, 0], [-1], [-1, 0, 1, 1, 0]]     # verification trees: node 0 the root
SEQ_LENS = [40, 7, 300]                          # prefix + tree size, per tree
SIZES = [len(t) for t in TREES]


def _forest(bound: int) -> StepForest:
    parent, cu = flat_forest(TREES)
    starts = cu[:-1]
    forest = StepForest(req_ids=["a", "b", "c"], tree_req_indices=[0, 1, 2],
                        parent=torch.tensor(parent + [5, 5], dtype=torch.int32),   # a graph's padded buffer
                        cu_seqlens=torch.tensor(cu, dtype=torch.int32), tokens=[[-1] * len(t) for t in TREES],
                        tree_parents=TREES, max_nodes=bound, query_starts=starts, attention_rows=None)
    # The verification's ancestor bits (device_bits() on a GPU), here from the host masks, padded rows after.
    bits = DeviceTreeRows.pack(forest.rows(), "cpu", words=1).bits
    forest.attention_rows = None
    forest.device_bits = lambda: torch.cat([bits, torch.full((2, 1), -1, dtype=torch.int32)])
    return forest, bits


def _drafter(graph_out, tree_rows=17):
    drafter = MTPTreeDrafter.__new__(MTPTreeDrafter)
    calls = {}

    def write_arrays(tokens, positions, slots, hidden, rope=None):
        calls["written"] = (tokens.tolist(), positions.tolist(), slots.tolist(), hidden[:, 0].tolist())
        return hidden.shape[0], hidden.shape[0] + 3, "mode"

    def level(cm, chunks, rows, n, padded, mode, max_rows=None):
        calls["level"] = (chunks, rows[0].tolist(), rows[1].tolist(), n, padded, mode, max_rows)
        return graph_out

    def forward_written(cm, chunks, tree_rows, n, padded, mode, device_rows=None):
        calls["eager"] = (chunks, device_rows.meta.tolist(), device_rows.bits.tolist(), device_rows.max_rows)
        calls["tree_rows"] = device_rows.num_rows
        return torch.ones(n, 1)

    drafter._write_arrays, drafter._forward_written = write_arrays, forward_written
    drafter._host_tree_rows = lambda hidden: False
    drafter._top_rows = lambda hidden: hidden * 10
    drafter.graphs = SimpleNamespace(level=level, tree_rows=tree_rows)
    return drafter, calls


@pytest.mark.parametrize("graph", [True, False])
def test_first_pass_hands_the_forest_rows_over(graph):
    n = sum(len(t) for t in TREES)
    forest, bits = _forest(bound=9)
    drafter, calls = _drafter((torch.zeros(n, 1), torch.zeros(n, 8)) if graph else None)
    tokens, positions = torch.arange(100, 100 + n + 4), torch.arange(n + 4) * 2
    slots, hidden = torch.arange(n + 4) + 1000, torch.arange(n, dtype=torch.float32)[:, None]
    out = drafter.first_pass_all_rows(None, forest, tokens, positions, slots, SIZES, SEQ_LENS, hidden)
    assert calls["written"] == (tokens[:n].tolist(), positions[:n].tolist(), slots[:n].tolist(),
                                hidden[:, 0].tolist())
    chunks = [(0, range(3), None, 40, None), (1, range(1), None, 7, None), (2, range(5), None, 300, None)]
    meta = [[0, 0, 3, 3, 0], [1, 3, 1, 1, 3], [2, 4, 5, 5, 4]]   # (tree, first row, rows, region, first bit row)
    level = calls["level"]
    assert level[0] == chunks and level[1] == meta and level[2] == bits.tolist()     # padded rows cut off
    assert level[3:] == (n, n + 3, "mode", 9)    # the forest's bound keys the graph, not this step's sizes
    if graph:
        assert out[0].shape == (n, 1) and "eager" not in calls
    else:   # no graph: the same rows through the eager forward on the device rows
        assert calls["eager"] == (chunks, meta, bits.tolist(), 9)
        assert torch.equal(out[1], torch.full((n, 1), 10.0))


def test_first_pass_needs_a_size_per_row():
    forest, _ = _forest(bound=9)
    drafter, _ = _drafter(None)
    n = sum(len(t) for t in TREES)
    with pytest.raises(ValueError, match="hidden rows"):
        drafter.first_pass_all_rows(None, forest, torch.zeros(n), torch.zeros(n), torch.zeros(n), SIZES[:2],
                                    SEQ_LENS[:2], torch.zeros(n, 1))


def test_first_pass_beside_a_prefill_chunk_runs_the_chunk_causally():
    """Batch: tree 0, a prompt chunk of 4 rows, tree 2 (the last). The chunk is a request of the forward without
    tree rows (attention runs it causally); the trees' meta rows name their token rows and their node rows of
    the bits; the forward runs eagerly (no drafter graph holds a chunk), with the trees' 8 rows as tree rows."""
    trees = [TREES[0], TREES[2]]
    parent, cu = flat_forest(trees)
    forest = StepForest(req_ids=["a", "c"], tree_req_indices=[0, 2], parent=torch.tensor(parent, dtype=torch.int32),
                        cu_seqlens=torch.tensor(cu, dtype=torch.int32), tokens=[[-1] * len(t) for t in trees],
                        tree_parents=trees, max_nodes=5, sizes=[3, 5], query_starts=[0, 7], attention_rows=None)
    bits = DeviceTreeRows.pack(forest.rows(), "cpu", words=1).bits
    forest.device_bits = lambda: bits
    drafter, calls = _drafter((torch.zeros(12, 1), torch.zeros(12, 8)))
    n = 12
    grown_from = torch.tensor([0, 1, 2, 7, 8, 9, 10, 11, 6])   # the trees' nodes and the chunk's end
    _, top = drafter.first_pass_all_rows(None, forest, torch.arange(n), torch.arange(n), torch.arange(n), [3, 4, 5],
                                         [40, 20, 300], torch.zeros(n, 1), top_rows=grown_from)
    # the LM head ran over those rows only
    assert top[:, 0].tolist() == [10.0] * 3 + [0.0] * 3 + [10.0] * 6
    chunks, meta, got_bits, max_rows = calls["eager"]
    assert "level" not in calls
    assert chunks == [(0, range(3), None, 40, None), (1, range(4), None, 20, None), (2, range(5), None, 300, None)]
    assert meta == [[0, 0, 3, 3, 0], [2, 7, 5, 5, 3]] and got_bits == bits.tolist()
    assert max_rows == 5 and calls["tree_rows"] == 8


def test_first_pass_without_graph_room_runs_eagerly():
    """Trees wider than the drafter graphs' tree-row buffers run eagerly."""
    forest, bits = _forest(bound=9)
    drafter, calls = _drafter((None, None), tree_rows=4)
    n = sum(len(t) for t in TREES)
    drafter.first_pass_all_rows(None, forest, torch.zeros(n), torch.zeros(n), torch.zeros(n), SIZES, SEQ_LENS,
                                torch.zeros(n, 1))
    assert "level" not in calls and calls["eager"][3] == 9
