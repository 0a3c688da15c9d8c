"""Structured outputs over draft trees: the grammar bitmask of every tree node (scheduler side).

vLLM checks a request's drafts against its grammar as one chain: ``grammar.validate_tokens`` keeps the longest
valid prefix, and ``StructuredOutputManager.grammar_bitmask`` fills one bitmask row per draft after advancing the
grammar through the drafts before it. A tree's nodes are not a chain: node i's row is the grammar's state after the
tokens on the path from the root down to i. :func:`tree_grammar_bitmask` fills the rows in that layout (row 0 the
root, row 1 + i node i, the layout of the request's logits rows) by a depth-first walk that advances the grammar one
token down and rolls it back one token up. A node whose token its parent's row forbids is never accepted (its
parent's row masks it), so it is not removed: its row and its subtree's rows stay unconstrained, as vLLM leaves the
rows after an invalid (-1) draft.

The runner sends the trees' parents with the draft token ids (:data:`PARENTS_ATTR`); the scheduler keeps them on
the request (:data:`REQUEST_ATTR`) beside the tokens they belong to, and uses them only while the scheduled drafts
are a prefix of those tokens (vLLM may cut drafts to a prefix, which keeps a tree connected).
"""

import numpy as np

from .._vllm_compat import fill_grammar_rows, grammar_bitmask
from ..spec_decode.tree import children_of

# DraftTokenIds attribute: {req_id: parents} of tree drafts of structured-output requests (-1: child of the root).
PARENTS_ATTR = "bole_tree_parents"
# Request attribute: (tokens, parents) of its last tree drafts.
REQUEST_ATTR = "bole_tree_drafts"


def tree_parents(request, scheduled: list[int]) -> list[int] | None:
    """Parents of the request's scheduled drafts when they are (a prefix of) its last tree, else None (a chain)."""
    drafts = getattr(request, REQUEST_ATTR, None)
    if drafts is None or not scheduled:
        return None
    tokens, parents = drafts
    n = len(scheduled)
    return list(parents[:n]) if len(tokens) >= n and list(tokens[:n]) == list(scheduled) else None


def tree_grammar_bitmask(manager, requests: dict, structured_ids: list[str], scheduled: dict[str, list[int]]):
    """The batch's bitmask rows as vLLM's ``grammar_bitmask`` lays them out (per request in ``structured_ids``
    order: its root, then one row per scheduled draft), with each draft's row filled after the tokens on its path.
    Requests without drafts get vLLM's single row; drafts that are not a tree's run as a chain. Only for requests
    whose grammar is applied from the first row (``manager.should_fill_bitmask``); a request still reasoning
    carries no drafts (``scheduler._TreeGrammars``)."""
    spec = manager.vllm_config.num_speculative_tokens
    rows = manager.vllm_config.scheduler_config.max_num_seqs * (1 + spec)
    bits = grammar_bitmask(manager, rows).numpy()   # (shares the tensor's memory)
    row = 0
    for req_id in structured_ids:
        request = requests[req_id]
        grammar = request.structured_output_request.grammar
        apply = manager.should_fill_bitmask(request)
        tokens = list(scheduled.get(req_id, ()))
        parents = tree_parents(request, tokens)
        if parents is None:
            parents = list(range(-1, len(tokens) - 1))
        if tokens and not apply:
            raise RuntimeError(f"request {req_id} carries drafts while its grammar is not applied yet")
        # verification nodes: 0 the root, 1 + i draft i
        children = children_of([-1] + [p + 1 for p in parents])
        _fill_subtree(manager, bits, grammar, req_id, tokens, children, 0, row, apply)
        row += 1 + len(tokens)
    return bits[:row]


def _fill_subtree(manager, bits: np.ndarray, grammar, req_id: str, tokens, children, node: int, first_row: int,
                  valid: bool) -> None:
    """Rows of ``node`` and its descendants; the grammar stands at ``node``'s path (``valid``) or the node is
    unreachable (its rows unconstrained)."""
    row = first_row + node
    fill_grammar_rows(manager, ((grammar, row, valid),))
    for child in children.get(node, ()):
        # vLLM does not advance a terminated grammar (the rows after it stay unconstrained); a token the parent's
        # row masks is never accepted, so its subtree is unreachable
        advanced = (valid and not grammar.is_terminated() and _allowed(bits[row], tokens[child - 1])
                    and grammar.accept_tokens(req_id, [tokens[child - 1]]))
        _fill_subtree(manager, bits, grammar, req_id, tokens, children, child, first_row,
                      advanced or (valid and grammar.is_terminated()))
        if advanced:
            grammar.rollback(1)


def _allowed(row: np.ndarray, token: int) -> bool:
    return 0 <= token < row.shape[0] * 32 and bool((int(row[token >> 5]) >> (token & 31)) & 1)
