"""Grammar bitmask rows of tree drafts (``worker/tree_grammar.py``) against vLLM's own chain bitmask on each path.

vLLM's ``StructuredOutputManager.grammar_bitmask`` fills a chain of drafts' rows by advancing the grammar through
the drafts before each row. For every node of a random tree, the tree's row must equal the last row vLLM fills for
the chain of tokens on the node's path; nodes below a token the grammar forbids get unconstrained rows; the grammar
ends where it started. A small deterministic grammar stands in for xgrammar.
"""

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from forest_shapes import SHAPES, make_tree

VOCAB = 64
EOS = 0


class ToyGrammar:
    """Token t may follow a history h when (t + len(h) + sum(h)) % 3 != 0; EOS terminates."""

    def __init__(self):
        self.history: list[int] = []

    def _allowed(self, token: int) -> bool:
        return (token + len(self.history) + sum(self.history)) % 3 != 0

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        if self.is_terminated():
            return False
        for token in tokens:
            if not self._allowed(token):
                return False
            self.history.append(token)
        return True

    def rollback(self, num_tokens: int) -> None:
        del self.history[len(self.history) - num_tokens:]

    def is_terminated(self) -> bool:
        return bool(self.history) and self.history[-1] == EOS

    def fill_bitmask(self, bitmask: torch.Tensor, idx: int) -> None:
        bits = np.zeros(VOCAB // 32, dtype=np.uint32)
        for t in range(VOCAB):
            if self._allowed(t):
                bits[t >> 5] |= np.uint32(1 << (t & 31))
        bitmask[idx] = torch.from_numpy(bits.view(np.int32))


def _manager(max_num_seqs: int, spec_tokens: int):
    from vllm.v1.structured_output import StructuredOutputManager

    manager = StructuredOutputManager.__new__(StructuredOutputManager)   # the real methods, no backend set-up
    manager.vllm_config = SimpleNamespace(num_speculative_tokens=spec_tokens,
                                          scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
                                          model_config=SimpleNamespace(is_diffusion=False))
    manager.backend = SimpleNamespace(allocate_token_bitmask=lambda n: torch.full((n, VOCAB // 32), -1,
                                                                                     dtype=torch.int32))
    manager._grammar_bitmask = None
    manager._full_mask = torch.tensor(-1, dtype=torch.int32)
    manager.fill_bitmask_parallel_threshold = 128
    manager.reasoner_cls = None
    manager.enable_in_reasoning = False
    return manager


def _request(history: list[int]):
    grammar = ToyGrammar()
    assert grammar.accept_tokens("r", history)
    return SimpleNamespace(structured_output_request=SimpleNamespace(grammar=grammar, reasoner=None),
                           use_structured_output=True, all_token_ids=[])


def _chain_row(manager, request, path: list[int]) -> np.ndarray:
    """vLLM's row after the chain ``path`` (the last row it fills before the bonus row's)."""
    rows = manager.grammar_bitmask({"r": request}, ["r"], {"r": path})
    return rows[len(path)].copy()


def _valid(history: list[int], path: list[int]) -> bool:
    g = ToyGrammar()
    g.history = list(history)
    for t in path:
        if g.is_terminated():
            continue   # (vLLM does not advance a terminated grammar)
        if not g.accept_tokens("r", [t]):
            return False
    return True


@pytest.mark.parametrize("shape", SHAPES)
def test_tree_rows_equal_vllms_chain_rows_on_each_path(shape):
    from vllm_bole.worker.tree_grammar import REQUEST_ATTR, tree_grammar_bitmask

    rng = random.Random(hash(shape) % 1000)
    for trial in range(6):
        sizes = [rng.randrange(1, 12) for _ in range(3)]
        histories = [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(4))] for _ in sizes]
        histories = [[t for t in h if ToyGrammar()._allowed(t)][:1] for h in histories]   # valid starts
        reqs, scheduled, trees = {}, {}, {}
        for i, (n, history) in enumerate(zip(sizes, histories)):
            parents = make_tree(shape, n, rng)
            g = ToyGrammar()
            g.history = list(history)
            tokens = []
            for p in parents:   # mostly allowed tokens, some forbidden ones and an EOS now and then
                tokens.append(EOS if rng.random() < 0.1 else rng.randrange(1, VOCAB))
            req = _request(history)
            setattr(req, REQUEST_ATTR, (tokens, parents))
            reqs[f"r{i}"], scheduled[f"r{i}"], trees[f"r{i}"] = req, tokens, parents
        reqs["plain"], scheduled["plain"] = _request([]), []   # a structured request without drafts
        order = ["r0", "plain", "r1", "r2"]
        manager = _manager(8, 16)
        rows = tree_grammar_bitmask(manager, reqs, order, scheduled).copy()
        assert rows.shape[0] == sum(1 + len(scheduled[r]) for r in order)
        start = 0
        for r in order:
            tokens, parents = scheduled[r], trees.get(r, [])
            history = list(reqs[r].structured_output_request.grammar.history)
            check = _manager(8, 16)
            for node in range(len(tokens) + 1):
                path, j = [], node - 1
                while j >= 0:
                    path.insert(0, tokens[j])
                    j = parents[j]
                if _valid(history, path):
                    want = _chain_row(check, _request(history), path)
                else:
                    want = np.full(VOCAB // 32, -1, dtype=np.int32)
                assert np.array_equal(rows[start + node], want), (shape, trial, r, node, path)
            assert reqs[r].structured_output_request.grammar.history == history   # rolled back
            start += 1 + len(tokens)


def test_scheduler_keeps_tree_drafts_with_their_parents():
    """``update_draft_token_ids``: a structured-output request's tree drafts stay whole (no chain check) with their
    parents; one whose grammar a reasoning parser still holds back gets none; other requests go through vLLM's
    own path. ``update_draft_token_ids_in_output`` (async scheduling) puts the trees behind the placeholders."""
    from vllm.v1.outputs import DraftTokenIds

    from vllm_bole.worker.scheduler import _TreeGrammars
    from vllm_bole.worker.tree_grammar import PARENTS_ATTR, REQUEST_ATTR, tree_parents

    class Base:
        def update_draft_token_ids(self, draft_token_ids):
            self.vllm_took = list(draft_token_ids.req_ids)

        def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output):
            self.vllm_took = list(draft_token_ids.req_ids)

    class Sched(_TreeGrammars, Base):
        pass

    def request(reasoning_over=True):
        return SimpleNamespace(is_finished=lambda: False, is_prefill_chunk=False, spec_token_ids=[],
                               reasoning_over=reasoning_over)

    sched = Sched()
    sched.requests = {"a": request(), "b": request(reasoning_over=False), "c": request()}
    sched.structured_output_manager = SimpleNamespace(should_advance=lambda r: True,
                                                      should_fill_bitmask=lambda r: r.reasoning_over)
    drafts = DraftTokenIds(["a", "b", "c"], [[5, 6, 7], [8, 9], [1, 2]])
    setattr(drafts, PARENTS_ATTR, {"a": [-1, -1, 0], "b": [-1, 0]})
    sched.update_draft_token_ids(drafts)
    assert sched.requests["a"].spec_token_ids == [5, 6, 7] and sched.requests["b"].spec_token_ids == []
    assert sched.vllm_took == ["c"]
    assert tree_parents(sched.requests["a"], [5, 6]) == [-1, -1]            # a prefix the scheduler cut
    assert tree_parents(sched.requests["a"], [5, 7]) is None                # not its drafts: a chain
    assert getattr(sched.requests["c"], REQUEST_ATTR) is None

    out = SimpleNamespace(scheduled_spec_decode_tokens={"a": [-1, -1], "c": [-1]})
    drafts = DraftTokenIds(["a", "c"], [[3, 4, 4], [1]])
    setattr(drafts, PARENTS_ATTR, {"a": [-1, 0, 0]})
    sched.update_draft_token_ids_in_output(drafts, out)
    assert out.scheduled_spec_decode_tokens["a"] == [3, 4] and tree_parents(sched.requests["a"], [3, 4]) == [-1, 0]
    assert sched.vllm_took == ["c"]
    drafts = DraftTokenIds(["a"], [[3]])
    setattr(drafts, PARENTS_ATTR, {"a": [-1]})
    with pytest.raises(RuntimeError, match="a tree of 1 drafts behind 2 placeholders"):
        sched.update_draft_token_ids_in_output(drafts, out)
