"""Prefix caching: the commit writes the GDN state and conv window of the block boundary an accepted path reaches
into that boundary's block (``attention/gdn.py`` ``commit_step``), besides the whole path's into the running slot.

The boundary's node comes from the host walk's paths or, with ``early_drafting``, from the device walk's
(``_device_boundary_nodes``: the host may not know the paths yet); both give the same states.

The tiny models' logits hardly depend on the GDN state (with the boundary write left out, turn 2 read stale states
from its cache hits and the chosen tokens' logprobs stayed within 3.1e-3 of the reference, against 2.4e-3 with it),
so the end-to-end tests (``test_e2e_prefix_caching.py``) compare the cached blocks' states with vLLM's. Here the
written states are compared with the reference commit of each path's prefix.
"""

from types import SimpleNamespace

import pytest
import torch

from vllm_bole.attention import gdn
from vllm_bole.attention.gdn_metadata import BlockCheckpoints
from vllm_bole.kernels import TreeFactors
from vllm_bole.kernels.tree_conv1d.reference import commit_conv_state
from vllm_bole.kernels.tree_gdn.reference import commit_accepted

HK, HV, DK, DV, DIM, W = 2, 4, 8, 8, 16, 4
NUM_SLOTS, LAYERS = 12, 2
# Three requests' trees (local parents, root first) and their accepted paths:
PARENTS = [[-1, 0, 1, 0, 2, 4], [-1, 0, 1], [-1, 0, 0, 1]]
PATHS = [[0, 1, 2, 4, 5], [0, 1], [0, 1, 3]]
RUNNING = [3, 6, 9]


# Rows of the step's flat token arrays before each tree's root (a prefill ahead of the trees): the device walk's
# paths are flat rows.
ROW_OFFSET = 5
PADDED_SLOT = 11


def _step(lengths, targets, walk="host", padded=False):
    torch.manual_seed(0)
    n = sum(map(len, PARENTS))
    cu = torch.tensor([0, *torch.tensor(list(map(len, PARENTS))).cumsum(0).tolist()], dtype=torch.int32)
    layers = [SimpleNamespace(ssm=torch.randn(NUM_SLOTS, HV, DV, DK), conv=torch.randn(NUM_SLOTS, DIM, W - 1))
              for _ in range(LAYERS)]
    scratch = gdn.GDNStepScratch.__new__(gdn.GDNStepScratch)
    scratch.layers = layers
    # a verification graph's slots cover its padded requests too (one more here, slot PADDED_SLOT)
    scratch.slots = [torch.tensor(RUNNING + [PADDED_SLOT] * padded, dtype=torch.int32) for _ in layers]
    scratch.checkpoints = [BlockCheckpoints(path_lengths=lengths, slots=torch.tensor(targets, dtype=torch.int32),
                                            req_indices=[0, 1, 2]) for _ in layers]
    scratch.factors = TreeFactors(k=torch.randn(LAYERS, n, HK, DK), u=torch.randn(LAYERS, n, HV, DV),
                                  g_cum=-torch.rand(LAYERS, n, HV))
    scratch.conv_inputs = torch.randn(LAYERS, n, DIM)
    forest = SimpleNamespace(
        gdn_scratch=scratch, accepted_device=None, accepted_paths=PATHS,
        accepted=torch.tensor([p[-1] for p in PATHS], dtype=torch.int32),
        parent=torch.tensor([p for tree in PARENTS for p in tree], dtype=torch.int32), cu_seqlens=cu)
    if walk == "device":   # as early_drafting leaves it: the paths on the device only
        starts = [ROW_OFFSET + c for c in cu[:-1].tolist()]
        width = max(map(len, PATHS)) + 1
        rows = [[start + node for node in p] + [-1] * (width - len(p)) for p, start in zip(PATHS, starts)]
        forest.accepted_paths, forest.query_starts = None, starts
        forest.accepted_device = torch.tensor([p[-1] for p in PATHS])
        forest.accepted_rows_device = torch.tensor(rows)
    return forest, scratch, layers


def _expected(layer, scratch, forest, i, nodes):
    f = TreeFactors(k=scratch.factors.k[i], u=scratch.factors.u[i], g_cum=scratch.factors.g_cum[i])
    idx = torch.tensor(RUNNING)
    acc = torch.tensor(nodes, dtype=torch.int32)
    return (commit_accepted(layer.ssm[idx], f, acc, forest.parent, forest.cu_seqlens),
            commit_conv_state(layer.conv[idx], scratch.conv_inputs[i], forest.parent, forest.cu_seqlens, acc))


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("walk", ["host", "device"])
def test_commit_writes_the_boundary_state_into_its_block(monkeypatch, walk, padded):
    monkeypatch.setattr(gdn, "_cache_views", lambda layer: (layer.ssm, layer.conv))
    # request 0 reaches its boundary after 3 of its 5 path tokens; request 1's boundary is past its path (3 > 2);
    # request 2's boundary block is vLLM's null block (0): nothing is written
    lengths, targets = [3, 3, 2], [1, 4, 0]
    forest, scratch, layers = _step(lengths, targets, walk, padded)
    before = [(layer.ssm.clone(), layer.conv.clone()) for layer in layers]
    boundary = [[p[m - 1] if 0 < m <= len(p) else -1 for p, m in zip(PATHS, lengths)]]
    expected = [(_expected(layer, scratch, forest, i, boundary[0]), _expected(layer, scratch, forest, i,
                                                                            [p[-1] for p in PATHS]))
                for i, layer in enumerate(layers)]
    gdn.commit_step(forest)
    for layer, (ssm0, conv0), ((ssm_b, conv_b), (ssm_f, conv_f)) in zip(layers, before, expected):
        torch.testing.assert_close(layer.ssm[1], ssm_b[0])          # the state after 3 tokens of request 0's path
        torch.testing.assert_close(layer.conv[1], conv_b[0])
        torch.testing.assert_close(layer.ssm[RUNNING], ssm_f)      # the whole paths in the running slots
        torch.testing.assert_close(layer.conv[RUNNING], conv_f)
        if walk == "device":   # request 1's block holds the state before the step (its path fell short of it)
            assert torch.equal(layer.ssm[4], ssm0[RUNNING[1]]) and torch.equal(layer.conv[4], conv0[RUNNING[1]])
        written = (1, *RUNNING) if walk == "host" else (1, 4, *RUNNING)
        untouched = [s for s in range(NUM_SLOTS) if s not in written]
        assert torch.equal(layer.ssm[untouched], ssm0[untouched]) and torch.equal(layer.conv[untouched],
                                                                                 conv0[untouched])


def test_without_block_checkpoints_only_the_running_slots_change(monkeypatch):
    monkeypatch.setattr(gdn, "_cache_views", lambda layer: (layer.ssm, layer.conv))
    forest, scratch, layers = _step([0, 0, 0], [0, 0, 0])
    before = [layer.ssm.clone() for layer in layers]
    gdn.commit_step(forest)
    untouched = [s for s in range(NUM_SLOTS) if s not in RUNNING]
    for layer, ssm0 in zip(layers, before):
        assert torch.equal(layer.ssm[untouched], ssm0[untouched])


def test_checkpoints_over_a_graphs_requests():
    """A verification graph's forest holds plain decodes as one-node trees: its checkpoints are the metadata's tree
    requests' in place, none (length 0, null block) for the others."""
    tree_only = BlockCheckpoints(path_lengths=[3, 0, 5], slots=torch.tensor([7, 8, 9], dtype=torch.int32),
                                 req_indices=[1, 2, 4])
    assert tree_only.over([1, 2, 4]) is tree_only
    over = tree_only.over([0, 1, 2, 3, 4])
    assert over.path_lengths == [0, 3, 0, 0, 5] and over.slots.tolist() == [0, 7, 8, 0, 9]
    assert over.req_indices == [0, 1, 2, 3, 4] and over.slots.dtype == torch.int32


def test_checkpoints_read_the_runners_corrected_counts():
    """Under async scheduling the metadata's host counts would be a copy of the device's (a wait for the device) and
    its host sequence lengths assume every draft of the last step accepted: the checkpoints take each tree request's
    computed tokens from the runner's persistent counts, which vLLM corrects before it builds the metadata
    (``StepForest.computed_cpu``), and its running block from those plus its scheduled tokens."""
    from vllm_bole.attention.gdn_metadata import BoleGDNMetadataBuilder
    from vllm_bole.step.forest import set_current_forest

    class DeviceCounts:   # the metadata's counts: reading them would copy from the device
        block_table_tensor = torch.arange(12, dtype=torch.int32).view(3, 4)   # slot = 4 * request + column
        query_start_loc_cpu = torch.tensor([0, 4, 7, 8])

        @property
        def num_computed_tokens_cpu(self):
            raise AssertionError("the metadata's host counts were read")

    builder = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4))
    mask = torch.tensor([True, True, False])   # requests 0 and 1 verify trees of 4 and 3 nodes
    forest = SimpleNamespace(computed_cpu=torch.tensor([6, 3, 9, 0]))   # (request 2's, and a free row)
    set_current_forest(forest)
    try:
        got = BoleGDNMetadataBuilder._checkpoints(builder, DeviceCounts(), mask)
    finally:
        set_current_forest(None)
    # request 0: 6 computed, running block (6 + 4 - 1) // 4 = 2, boundary 8 after a path of 2 into block 1;
    # request 1: 3 computed, running block 1, boundary 4 after a path of 1 into block 0 (the counts that assume
    # the last drafts accepted, 7 and 5, would give a path of 1 into block 1 and none)
    assert got.path_lengths == [2, 1] and got.slots.tolist() == [1, 4] and got.req_indices == [0, 1]
