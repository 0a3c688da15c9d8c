"""Tree drafters: what a drafter receives after each verification step and how one is chosen."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .tree import DraftTree


class RequestContexts(Sequence):
    """``DraftStep.contexts``, each request's token list built only when a drafter reads it (most drafters only
    ask whether a request drafts: building every context each step costs O(context) host time per request).
    ``parts[r]``: None (the request does not draft) or (prompt ids, output ids, how many of those to take,
    this step's new tokens); the output list is read up to that length, as it was when the step ended."""

    def __init__(self, parts: list):
        self._parts = parts

    def __len__(self) -> int:
        return len(self._parts)

    def drafting(self) -> list[bool]:
        """Per request, whether it drafts (no context is built)."""
        return [part is not None for part in self._parts]

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        part = self._parts[r]
        if part is None:
            return None
        prompt, output, n_output, new = part
        return list(prompt or []) + list(output[:n_output]) + list(new)


def drafting(contexts) -> list[bool]:
    """Per request of ``DraftStep.contexts`` (a list or :class:`RequestContexts`), whether it drafts."""
    return contexts.drafting() if isinstance(contexts, RequestContexts) else [c is not None for c in contexts]


@dataclass
class DraftStep:
    """Everything a drafter may use after a verification step, per batch request (index = batch row).

    contexts[r]: the request's tokens so far, including the ones accepted in this step (None: do not draft,
    e.g. a prefill chunk that sampled nothing). hidden_states: the target's hidden states of this step's
    tokens. first_pass[r]: (rows of hidden_states, the token that follows each row, each row's position) for
    the tokens this step committed (a verified tree contributes its accepted path only); None if the request
    ran no tokens. common_attn_metadata: vLLM's metadata of this step for the drafter's KV-cache group.
    per_request, budget: the runner keeps each tree's ``per_request`` best nodes and then ``budget`` nodes over
    the batch (``tree.select_step``), so a drafter may stop growing what cannot be kept.
    quotas (``selection: "per_request"``): per batch request, exactly how many nodes its tree keeps (at most:
    fewer only if the drafter has fewer candidates); a drafter that keeps its trees on the device then sets
    ``queued`` (``spec_decode/queued_drafts.py``) before ``propose_deferred`` returns, so that the step can be
    scheduled before the drafts are done.
    fill_quotas: every tree must hold exactly its quota (async scheduling placed that many placeholder drafts
    before the drafter ran), so a drafter grows at least enough candidates for it.
    all_rows: the drafter's first pass already ran over every verified node (MTP: (hidden states, top children)
    per row of the step, ``MTPTreeDrafter.first_pass_all_rows``), so it skips its catch-up.
    rope: under M-RoPE, when some request's positions run behind its token index (images), the ``[3, rows]``
    positions of the step's rows as the target ran them (first_pass rows index it as they index hidden_states).
    width: a drafter growing a beam of this many queries per request and level (1: a chain of rank-1 children;
    None: ``topk``); the runner asks for 1 where the selection would keep a chain anyway
    (``BudgetPolicy.width``).
    sampled: for a drafter that reads no contexts (``reads_contexts``) after a step without trees, (batch
    requests, a device tensor of every batch request's sampled token): those requests' first-pass token lists end
    in a stand-in for their sampled token, which the drafter writes over it on the device; contexts[r] then holds
    the request's tokens without it.
    """

    req_ids: list[str]
    contexts: "Sequence[list[int] | None]"
    hidden_states: torch.Tensor | None = None
    first_pass: list[tuple[list[int], list[int], list[int]] | None] | None = None
    common_attn_metadata: object = None
    per_request: int | None = None
    budget: int | None = None
    quotas: list[int] | None = None
    queued: object = None   # QueuedDrafts, set by a drafter whose trees stay on the device
    fill_quotas: bool = False
    all_rows: tuple | None = None
    rope: "torch.Tensor | None" = None
    width: int | None = None
    sampled: "tuple[list[int], torch.Tensor] | None" = None


class TreeDrafter:
    """Base class: ``propose`` returns one DraftTree (possibly empty) per batch request. The runner then keeps
    the step's selection of their nodes (``tree.select_step``), unless the drafter says it returns exactly that
    already (``selects``)."""

    selects = False
    # Early drafting (worker/early_drafting.py): a drafter that drafts from every verified node right behind the
    # target forward, before the host walks, says so and implements first_pass_all_rows and propose_from_walk
    # (the MTP drafter); the others draft after the walk.
    drafts_early = False
    # A drafter that learns from what the target emits (the MTP drafter's draft_vocab "auto") says so and
    # implements observe_emitted; the runner then hands it each step's tokens.
    observes_emitted = False
    # A drafter that reads the requests' tokens on the host (DraftStep.contexts, beyond whether each drafts) says
    # so; the others take a step's sampled tokens on the device after a step without trees (DraftStep.sampled).
    reads_contexts = True

    def __init__(self, runner, bole_config):
        self.runner = runner
        self.bole_config = bole_config
        self.graphs = None   # the drafter's CUDA graphs of its levels, if any (bole_graph_counts)
        self.beam = None     # the beam growing its levels on the device, if any (early drafting needs one)
        self.chain_steps = 0   # steps grown as one-wide chains (DraftStep.width 1)

    def propose(self, step: DraftStep) -> list[DraftTree]:
        raise NotImplementedError

    def beams(self) -> list:
        """The device beams growing its levels, if any (each with its CUDA graphs, ``graphs``)."""
        return [] if self.beam is None else [self.beam]

    def observe_emitted(self, tokens: torch.Tensor) -> None:
        """Once per step, before its forward (with ``observes_emitted``): ``tokens``, a device tensor of the first
        token each request's step reads (for a decode the target's last token: what it emitted, whatever was
        drafted)."""
        raise NotImplementedError

    def own_kv_layers(self) -> tuple[str, ...]:
        """Attention layers whose K/V the drafter rewrites itself at every committed position; the runner's
        K/V compaction leaves them out (it runs after the drafter is queued)."""
        return ()

    def first_pass_all_rows(self, cm, forest, next_tokens, positions, slots, seq_lens, hidden, rope=None):
        """Early drafting: the drafter's pass over every node of the verified ``forest``, queued right behind the
        target forward; ``next_tokens`` is the target's token after each node (its argmax or draw)."""
        raise NotImplementedError

    def propose_from_walk(self, step: DraftStep, walk, first_pass, positions, root_bound: int):
        """Early drafting: :meth:`propose_deferred` from the device walk's paths before the host knows them,
        after :meth:`first_pass_all_rows` (``first_pass``)."""
        raise NotImplementedError

    def propose_deferred(self, step: DraftStep):
        """``finish()`` that returns :meth:`propose`'s trees. A drafter whose work runs on the device may return
        before it is done (the runner calls ``finish`` once vLLM asks for the drafts, after its output
        processing); by default the trees are made now."""
        trees = self.propose(step)
        return lambda: trees
