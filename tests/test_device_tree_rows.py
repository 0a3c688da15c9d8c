"""The tree rows' descriptions: the host masks of a verification step and their packed device form."""

import random

import torch

from forest_shapes import SHAPES, make_tree
from sequential_gdn import seed_of
from vllm_bole.kernels.forest import ancestor_mask
from vllm_bole.step.forest import DeviceTreeRows, StepForest, TreeRows, ancestor_masks


def test_forest_masks_match_per_tree_masks():
    rng = random.Random(seed_of("masks"))
    trees = [make_tree(s, t, rng) for s in SHAPES for t in (1, 2, 7, 33, 64, 100)]
    for tree, mask in zip(trees, ancestor_masks(trees)):
        assert torch.equal(mask, ancestor_mask(torch.tensor(tree, dtype=torch.int32)))
    assert ancestor_masks([]) == []


def test_step_rows_start_at_each_requests_first_row():
    forest = StepForest(req_ids=["a", "b"], tree_req_indices=[0, 2], parent=None, cu_seqlens=None, tokens=[],
                        tree_parents=[[-1, 0, 0], [-1]], query_starts=[0, 9], attention_rows=None)
    assert [(r.req_index, r.row_start, tuple(r.region_mask.shape)) for r in forest.rows()] == [
        (0, 0, (3, 3)), (2, 9, (1, 1))]
    assert forest.device_rows("cpu") is forest.device_rows("cpu")


def test_pack_keeps_every_mask_bit():
    rng = random.Random(seed_of("pack"))
    shapes = [(40, 40), (3, 3), (70, 13), (1, 1), (96, 96)]            # (region T, rows n): n < T as the drafter
    rows, first = [], 0
    for b, (t, n) in enumerate(shapes):
        mask = ancestor_mask(torch.tensor(make_tree("random", t, rng), dtype=torch.int32))[t - n:]
        rows.append(TreeRows(req_index=b, row_start=first, region_mask=mask))
        first += n + 2
    packed = DeviceTreeRows.pack(rows, "cpu")
    assert packed.num_rows == sum(n for _, n in shapes) and packed.max_rows == 96 and packed.bits.shape[1] == 3
    bits = packed.bits.long() & 0xFFFFFFFF
    j = torch.arange(32 * bits.shape[1])
    for i, tr in enumerate(rows):
        b, row0, n, t, first = packed.meta[i].tolist()
        assert (b, row0, (n, t)) == (tr.req_index, tr.row_start, tuple(tr.region_mask.shape))
        unpacked = ((bits[first:first + n, j // 32] >> (j % 32)) & 1).bool()
        assert torch.equal(unpacked[:, :t], tr.region_mask) and not unpacked[:, t:].any()


def test_prefix_lens_per_batch_request():
    rows = [TreeRows(req_index=b, row_start=0, region_mask=torch.ones(1, t, dtype=torch.bool))
            for b, t in zip([0, 1, 3], [40, 3, 70])]
    packed = DeviceTreeRows.pack(rows, "cpu")
    seq_lens = torch.tensor([50, 7, 100, 80, 33], dtype=torch.int32)   # requests 2 and 4 have no tree
    assert packed.prefix_lens(seq_lens).tolist() == [10, 4, 0, 10, 0]
    assert packed.prefix_lens(seq_lens) is packed.prefix_lens(seq_lens)


def test_graph_rows_built_on_device_equal_packed_host_rows():
    """A graph-captured verification forward builds its rows from the device forest (parents, cu_seqlens,
    ancestor bits, with a capacity bound as the tree size): they must say what the host-packed rows say."""
    from triton_modes import DEV, import_kernel_modules, interpreter

    (tv,) = import_kernel_modules("vllm_bole.kernels.tree_gdn.triton_verify")
    rng = random.Random(seed_of("graph-rows"))
    trees = [make_tree(s, t, rng) for s, t in [("random", 9), ("chain", 1), ("star", 33), ("random", 20)]]
    sizes = [len(t) for t in trees]
    cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    padded = sum(sizes) + 5                                     # padding rows after the last tree
    parent = torch.full((padded,), -1, dtype=torch.int32, device=DEV)
    parent[:sum(sizes)] = torch.tensor([p for t in trees for p in t], dtype=torch.int32)
    bound = 40                                                  # any bound on the tree sizes
    forest = StepForest(req_ids=list("abcd"), tree_req_indices=[0, 1, 2, 3], parent=parent, cu_seqlens=cu,
                        tokens=[], tree_parents=trees, max_nodes=bound,
                        query_starts=cu[:-1].tolist(), graph=object(), attention_rows=None)
    with interpreter():
        forest._bits = tv.ancestor_bits(parent, cu, bound)
    on_device = forest.device_rows(DEV)
    host = DeviceTreeRows.pack(forest.rows(), "cpu")
    assert torch.equal(on_device.meta.cpu(), host.meta) and on_device.max_rows == bound
    j = torch.arange(max(sizes))
    for b, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        got = ((on_device.bits.cpu().long()[s:e][:, j[:e - s] // 32] >> (j[:e - s] % 32)) & 1).bool()
        assert torch.equal(got, forest.rows()[b].region_mask)
    seq_lens = torch.tensor([50, 7, 100, 80], dtype=torch.int32, device=DEV)
    assert on_device.prefix_lens(seq_lens).tolist() == [50 - 9, 7 - 1, 100 - 33, 80 - 20]


def test_plain_decodes_become_one_node_trees_in_batch_order():
    def forest_tensors(parents, cu):
        return torch.tensor(parents, dtype=torch.int32), torch.tensor(cu, dtype=torch.int32)

    parent, cu = forest_tensors([-1, 0, 0, -1, 0], [0, 3, 5])
    forest = StepForest(req_ids=["b", "d"], tree_req_indices=[1, 3], parent=parent, cu_seqlens=cu,
                        tokens=[[-1, 7, 8], [-1, 9]], tree_parents=[[-1, 0, 0], [-1, 0]], max_nodes=3,
                        query_starts=[1, 5], tree_only=True, attention_rows=None,
                        plain_decodes=[(0, "a", 0), (2, "c", 4), (4, "e", 7)])
    assert forest.num_trees == 5 and forest.has_tree_rows
    forest.promote_plain_decodes(forest_tensors)
    assert forest.tree_req_indices == [0, 1, 2, 3, 4] and forest.req_ids == list("abcde")
    assert forest.query_starts == [0, 1, 4, 5, 7] and forest.tokens[0] == [-1] and forest.tokens[1] == [-1, 7, 8]
    assert forest.parent.tolist() == [-1, -1, 0, 0, -1, -1, 0, -1] and forest.cu_seqlens.tolist() == [0, 1, 4, 5, 7, 8]
    assert forest.plain_decodes == [] and forest.num_trees == 5 and forest.max_nodes == 3
    assert [tuple(r.region_mask.shape) for r in forest.rows()] == [(1, 1), (3, 3), (1, 1), (2, 2), (1, 1)]
    assert [r.row_start for r in forest.rows()] == [0, 1, 4, 5, 7]


def test_eager_rows_beside_chunks_need_no_host_trees():
    """An eager forward (trees beside prefill chunks) builds its rows from the host's sizes and first rows and the
    device ancestor bits: they must say what the rows packed from the host trees say, and must not wait for trees
    still drafted on the device (``materialize``)."""
    from triton_modes import DEV, import_kernel_modules, interpreter

    (tv,) = import_kernel_modules("vllm_bole.kernels.tree_gdn.triton_verify")
    rng = random.Random(seed_of("eager-rows"))
    trees = [make_tree(s, t, rng) for s, t in [("random", 9), ("chain", 1), ("star", 33), ("random", 40)]]
    sizes = [len(t) for t in trees]
    cu = torch.tensor([0] + torch.tensor(sizes).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    parent = torch.tensor([p for t in trees for p in t], dtype=torch.int32, device=DEV)
    # batch requests 1, 2, 4, 5 are trees; 0 and 3 prefill chunks of 100 and 7 rows before them
    batch, starts = [1, 2, 4, 5], [100, 109, 117, 150]
    waited = []
    forest = StepForest(req_ids=list("bcef"), tree_req_indices=batch, parent=parent, cu_seqlens=cu, tokens=[],
                        tree_parents=[None] * 4, max_nodes=max(sizes), sizes=sizes, query_starts=starts,
                        attention_rows=None, on_host=lambda f: waited.append(True))
    with interpreter():
        forest._bits = tv.ancestor_bits(parent, cu, max(sizes))
    eager = forest.device_rows(DEV)
    assert not waited and eager.num_rows == sum(sizes) and eager.max_rows == 40
    forest.on_host, forest.tree_parents = None, trees
    host = DeviceTreeRows.pack(forest.rows(), "cpu")
    assert torch.equal(eager.meta.cpu(), host.meta) and torch.equal(eager.bits.cpu(), host.bits)
    seq_lens = torch.tensor([300, 50, 7, 120, 100, 80], dtype=torch.int32, device=DEV)
    assert eager.prefix_lens(seq_lens).tolist() == [0, 50 - 9, 7 - 1, 0, 100 - 33, 80 - 40]
