"""The rows of an early-drafted step whose trees run beside prefill chunks (``worker/step_rows.py``): which token
row and logits row each tree node and chunk has, the drafter's first-pass inputs, and the walk of every request.

vLLM orders a batch decodes first (requests of at most ``1 + num_speculative_tokens`` tokens), so in the engine
tests the trees come before the chunks; a chunk as short as a tree may come before trees, as here."""

from types import SimpleNamespace

import numpy as np
import torch

from vllm_bole.spec_decode.device_walk import greedy_walk
from vllm_bole.worker.step_rows import StepRows

# Batch: a tree of 3 nodes, a chunk that completes its prompt (5 tokens), a tree of 2 nodes, a chunk that stops
# short of its prompt's end (4 tokens; vLLM discards its sample).
SCHEDULED = [3, 5, 2, 4]
TREES = [0, 2]
PARENTS = [[-1, 0, 0], [-1, 0]]
COMPUTED = [20, 0, 30, 8]
PROMPT_TOKENS = np.arange(1000, 1100).reshape(4, 25)   # the requests' known tokens, by position


def _step(tree_only=False, plain_decodes=()):
    req_ids = [f"r{i}" for i in range(4)]
    starts = np.concatenate([[0], np.cumsum(SCHEDULED)]).tolist()
    batch = SimpleNamespace(num_reqs=4, req_ids=req_ids, num_computed_tokens_cpu=np.array(COMPUTED),
                            token_ids_cpu=PROMPT_TOKENS)
    runner = SimpleNamespace(input_batch=batch, device=torch.device("cpu"),
                             discard_request_mask=SimpleNamespace(np=np.array([False, False, False, True])))
    forest = SimpleNamespace(tree_req_indices=TREES, tree_only=tree_only, plain_decodes=list(plain_decodes),
                             query_starts=[starts[r] for r in TREES])
    out = SimpleNamespace(num_scheduled_tokens=dict(zip(req_ids, SCHEDULED)),
                          total_num_scheduled_tokens=sum(SCHEDULED))
    return runner, forest, out


def test_mixed_step_rows_place_nodes_and_chunks():
    rows = StepRows.of(*_step())
    assert rows.chunks == [1, 3] and rows.drafts == [True, True, True, False] and rows.sizes == SCHEDULED
    assert rows.logit_starts == [0, 3, 4, 6, 7]   # every tree node, one row per chunk
    assert rows.node_tokens.tolist() == [0, 1, 2, 8, 9]
    assert rows.node_logits.tolist() == [0, 1, 2, 4, 5]
    assert rows.tree_starts.tolist() == [0, 8] and rows.tree_shift.tolist() == [0, 5]
    assert rows.chunk_last.tolist() == [7, 13] and rows.chunk_logits.tolist() == [3, 6]
    # the partial chunk is followed by its prompt's token at position 8 + 4
    assert rows.chunk_next.tolist() == [-1, int(PROMPT_TOKENS[3, 12])]
    assert rows.grown_from.tolist() == [0, 1, 2, 8, 9, 7, 13]   # the drafter's LM head reads only these


def test_first_pass_inputs_follow_each_row():
    rows = StepRows.of(*_step())
    after = torch.arange(500, 507)             # the target's token after each logits row
    input_ids = torch.arange(14) + 100         # the step's token rows
    got = rows.next_tokens(after, input_ids, 14).tolist()
    want = [500, 501, 502,                     # tree 0: the target's token after each node
            104, 105, 106, 107, 503,           # the completing chunk: next prompt tokens, then its sample
            504, 505,                          # tree 2
            111, 112, 113, int(PROMPT_TOKENS[3, 12])]   # the partial chunk: next prompt tokens, then the known one
    assert got == want


def test_walk_of_every_request_maps_tree_paths_to_token_rows():
    rows = StepRows.of(*_step())
    tokens = torch.tensor([-1, 7, 8, -1, 9])   # node tokens: tree 0's children 7, 8; tree 2's child 9
    parent = torch.tensor([p for ps in PARENTS for p in ps], dtype=torch.int32)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    after = torch.tensor([8, 0, 0, 42, 9, 3, 0])   # by logits row: tree 0 accepts node 2, tree 2 node 1
    node_after = rows.by_node(after)
    assert node_after.tolist() == [8, 0, 0, 9, 3]
    walk = greedy_walk(node_after, tokens, parent, cu, 1, node_after)
    trees, every = rows.batch_walk(walk, after, 4)
    assert trees.rows[:, :2].tolist() == [[0, 2], [8, 9]] and trees.deepest.tolist() == [2, 1]
    assert every.length.tolist() == [2, 1, 2, 1]
    assert every.rows[:, :2].tolist() == [[0, 2], [7, -1], [8, 9], [13, -1]]
    assert every.emitted[:, :2].tolist() == [[8, 0], [42, -1], [9, 3], [int(PROMPT_TOKENS[3, 12]), -1]]


def test_steps_of_trees_only_need_no_indices():
    runner, forest, out = _step(tree_only=True)
    forest.tree_req_indices, forest.query_starts = [0, 1, 2, 3], [0, 3, 8, 10]
    rows = StepRows.of(runner, forest, out)
    assert rows.tree_only and rows.logit_starts == [0, 3, 8, 10, 14] and rows.node_tokens is None
    after = torch.arange(14)
    assert rows.next_tokens(after, None, 14) is after and rows.by_node(after) is after


def test_a_decode_without_drafts_keeps_the_step_off_the_early_path():
    assert StepRows.of(*_step(plain_decodes=[(1, "r1", 3)])) is None
