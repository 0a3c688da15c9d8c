"""Bole's schedulers: vLLM's V1 scheduler with draft-placeholder padding turned off, and its async twin.

vLLM pads newly resumed decode requests with ``num_speculative_tokens`` placeholder drafts so chain batches
stay uniform for CUDA graphs; Bole's trees vary in size per request, so it schedules only real drafts. The
accepted-token bookkeeping (``num_computed_tokens -= drafts - accepted``) already holds for trees: the accepted
path is moved to contiguous KV slots before the next step.

Under ``async_scheduling`` vLLM schedules step N+1 before step N's drafts exist, giving every decode request
``num_spec_tokens_to_schedule`` placeholder drafts; :class:`BoleAsyncScheduler` sets that number to each request's
node quota for the batch (the step's budget split evenly: the calibrated one, or under ``budget_rule "throughput"``
the model runner's, :func:`async_quotas`), gives the remainder one node each to the first drafting requests
(``SchedulerOutput.bole_one_more``, :class:`Placeholders`), and the runner drafts exactly that many nodes per
request (``Drafting.plan``), so every placeholder has its queued node.
"""

import time
from dataclasses import dataclass

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

from .._vllm_compat import (SCHEDULER_OVERRIDES, check_overrides, engine_link, hit_as_without_drafter,
                            keep_state_blocks_until_cached, publish_blocks_when_finished)
from ..attention.graph_mode import capture_totals
from ..config import bole_config_from_vllm
from ..logger import init_logger
from ..spec_decode.budget import BUDGET_ATTR, BudgetLog, node_budget, with_applicable_rule
from ..spec_decode.tree_sampler import walks_tree
from .tree_grammar import PARENTS_ATTR, REQUEST_ATTR, tree_grammar_bitmask, tree_parents

logger = init_logger(__name__)


class _NoPlaceholderPadding:
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A constant per-batch-size schedule disables placeholder padding without changing how many draft
        # tokens a request may carry.
        self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)


class _PrefixCachedStates:
    """Prefix caching: GDN state blocks stay until published, so the commit can fill a boundary's block that a step
    crossed (``_vllm_compat.keep_state_blocks_until_cached``), a finishing request publishes the blocks that its
    last step completed (``_vllm_compat.publish_blocks_when_finished``), and hits are as long as without a drafter
    (``_vllm_compat.hit_as_without_drafter``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.cache_config.enable_prefix_caching:
            keep_state_blocks_until_cached(self)
            publish_blocks_when_finished(self)
            hit_as_without_drafter(self)


class _TreeGrammars:
    """Structured-output requests with tree drafts: the drafts keep their tree (synchronous scheduling:
    ``update_draft_token_ids``; async: ``update_draft_token_ids_in_output``, for a step whose sampling vLLM deferred),
    and the grammar bitmask has one row per tree node filled after the node's path (:mod:`.tree_grammar`)."""

    def update_draft_token_ids(self, draft_token_ids) -> None:
        trees = getattr(draft_token_ids, PARENTS_ATTR, None) or {}
        for req_id in draft_token_ids.req_ids:   # (a tree's parents belong to its own drafts only)
            if (request := self.requests.get(req_id)) is not None:
                setattr(request, REQUEST_ATTR, None)
        if not trees:
            return super().update_draft_token_ids(draft_token_ids)
        rest = ([], [])
        manager = self.structured_output_manager
        for req_id, tokens in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            if req_id not in trees or request is None or request.is_finished() or request.is_prefill_chunk:
                rest[0].append(req_id)
                rest[1].append(tokens)
                continue
            if not (manager.should_advance(request) and manager.should_fill_bitmask(request)):
                # Still reasoning (the grammar applies after the reasoning end, which vLLM detects in a chain of
                # drafts but no tree walk here does): no drafts this step.
                tokens = []
            # No chain check (validate_tokens): nodes the grammar forbids stay, unreachable, in the tree.
            request.spec_token_ids = tokens
            setattr(request, REQUEST_ATTR, (list(tokens), list(trees[req_id][:len(tokens)])))
        if rest[0]:
            super().update_draft_token_ids(DraftTokenIds(*rest))

    def update_draft_token_ids_in_output(self, draft_token_ids, scheduler_output) -> None:
        """Async scheduling: the trees behind a deferred step's placeholders, as they are (no chain check)."""
        trees = getattr(draft_token_ids, PARENTS_ATTR, None) or {}
        rest = ([], [])
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, tokens in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids):
            request = self.requests.get(req_id)
            scheduled = spec.get(req_id)
            if req_id not in trees or request is None or request.is_finished() or not scheduled:
                rest[0].append(req_id)
                rest[1].append(tokens)
                continue
            if len(tokens) < len(scheduled):
                raise RuntimeError(f"request {req_id}: a tree of {len(tokens)} drafts behind {len(scheduled)} "
                                   "placeholders")
            tokens = list(tokens[:len(scheduled)])
            spec[req_id] = tokens
            setattr(request, REQUEST_ATTR, (tokens, list(trees[req_id][:len(tokens)])))
        if rest[0]:
            super().update_draft_token_ids_in_output(DraftTokenIds(*rest), scheduler_output)

    def get_grammar_bitmask(self, scheduler_output):
        spec = scheduler_output.scheduled_spec_decode_tokens
        structured = [req_id for req_id in scheduler_output.num_scheduled_tokens
                      if (req := self.requests.get(req_id)) and req.use_structured_output and not req.is_prefill_chunk]
        if not structured or not any(tree_parents(self.requests[r], spec.get(r, [])) for r in structured):
            return super().get_grammar_bitmask(scheduler_output)
        bitmask = tree_grammar_bitmask(self.structured_output_manager, self.requests, structured, spec)
        return GrammarOutput(structured, bitmask)


class _BudgetLines:
    """With vLLM's stats logging on, a line per stats interval on what set the steps' node budgets
    (:class:`~vllm_bole.spec_decode.budget.BudgetLog`): the async scheduler chooses them itself, the synchronous
    steps' come from the runner with their draft token ids."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # (the graphs are captured in this process: Bole's graphs are off with tensor parallelism)
        self._budget_log = BudgetLog(captures=capture_totals) if self.log_stats else None

    def update_draft_token_ids(self, draft_token_ids) -> None:
        choice = getattr(draft_token_ids, BUDGET_ATTR, None)
        if self._budget_log is not None and choice is not None:
            self._budget_log.record(*choice, time.monotonic())
        super().update_draft_token_ids(draft_token_ids)


class BoleScheduler(_BudgetLines, _TreeGrammars, _NoPlaceholderPadding, _PrefixCachedStates, Scheduler):
    pass


def async_budget(bole_config, batch_size: int, context_len: int | None, model_config=None,
                 source=None) -> tuple[int, bool]:
    """Nodes of the next step of ``batch_size`` decodes under async scheduling, and whether ``source`` chose them:
    ``source(batch_size, context_len)`` when given and known (``budget_rule "throughput"``: the model runner's
    choice from its step clock and acceptance model), else the calibrated B_ver (``"decode"``)."""
    budget = source(batch_size, context_len) if source is not None else None
    if budget is not None:
        return budget, True
    return node_budget(bole_config, batch_size, context_len=context_len, model_config=model_config), False


def async_quotas(budget: int, num_spec_tokens: int, batch_size: int, drafting=()) -> tuple[int, frozenset]:
    """Each request's next tree: ``(k, one_more)``, ``k`` nodes each (the budget split evenly over the batch, at
    most ``num_spec_tokens``) and one more for the first of ``drafting`` (ids of the requests that get
    placeholders) while the budget lasts. With a budget below the batch size, none: every request decodes plainly
    (a step of one-node trees runs as the plain decode graph)."""
    if batch_size <= 0:
        return 0, frozenset()
    k = max(0, min(num_spec_tokens, budget // batch_size))
    if k == 0 or k == num_spec_tokens:
        return k, frozenset()
    drafting = list(drafting)
    return k, frozenset(drafting[:max(0, budget - k * len(drafting))])


@dataclass(frozen=True)
class Placeholders:
    """The placeholder drafts the async scheduler gave each request of a step: ``k``, or ``k + 1`` for the
    requests in ``one_more``; the runner drafts trees of exactly these sizes."""

    k: int
    one_more: frozenset = frozenset()

    @classmethod
    def of(cls, scheduler_output) -> "Placeholders":
        return cls(scheduler_output.num_spec_tokens_to_schedule,
                   getattr(scheduler_output, "bole_one_more", frozenset()))

    def quota(self, req_id: str) -> int:
        return self.k + (req_id in self.one_more)


check_overrides(AsyncScheduler, SCHEDULER_OVERRIDES)


class BoleAsyncScheduler(_BudgetLines, _TreeGrammars, _NoPlaceholderPadding, _PrefixCachedStates, AsyncScheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bole_refresh_budget_rule()
        # A platform may turn async scheduling off after the engine arguments chose this class (vLLM's CPU
        # platform always does): it then schedules as BoleScheduler.
        self._asynchronous = bool(self.scheduler_config.async_scheduling)
        self._source_missing_logged = False

    def bole_refresh_budget_rule(self) -> None:
        """``budget_rule`` as it applies with the calibration table as it is now (the twin of the model runner's ``BudgetPolicy.refresh``)."""
        self.bole_config = with_applicable_rule(bole_config_from_vllm(self.vllm_config), self.vllm_config.model_config)

    def _budget_source(self):
        """The model runner's ``BudgetPolicy.async_budget`` (``budget_rule "throughput"``), or None: the rule "decode"."""
        if self.bole_config.budget_rule != "throughput":
            return None
        source = engine_link(self.vllm_config).budget_source()
        if source is None and not self._source_missing_logged:
            logger.warning("Bole budget_rule 'throughput' under async scheduling reads the model runner of the "
                           "engine core process, and there is none here (a multiprocess executor): using the "
                           "calibrated budget (budget_rule 'decode')")
            self._source_missing_logged = True
        return source

    def _update_request_with_output(self, request, new_token_ids):
        if not self._asynchronous:
            return Scheduler._update_request_with_output(self, request, new_token_ids)
        return super()._update_request_with_output(request, new_token_ids)

    def _update_after_schedule(self, scheduler_output) -> None:
        if not self._asynchronous:
            return Scheduler._update_after_schedule(self, scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        budget = 0
        if scheduled and self.num_spec_tokens:
            n = len(scheduled)
            context = [self.requests[r].num_computed_tokens for r in scheduled]
            budget, by_rule = async_budget(self.bole_config, n, sum(context) // n, self.vllm_config.model_config,
                                           self._budget_source())
            k, _ = async_quotas(budget, self.num_spec_tokens, n)
            scheduler_output.num_spec_tokens_to_schedule = k
            if self._budget_log is not None:
                self._budget_log.record(n, k * n, by_rule, time.monotonic())
        super()._update_after_schedule(scheduler_output)
        drafting = []
        for req_id in scheduled:
            request = self.requests[req_id]
            if request.is_prefill_chunk:
                continue
            if not walks_tree(request.sampling_params, asynchronous=True) or (
                    request.use_structured_output and not self.structured_output_manager.should_fill_bitmask(request)):
                # Its next token comes from vLLM's sampler with all its settings (min_tokens, prompt logprobs, ...,
                # a grammar still held back by a reasoning parser): the runner walks no tree past the root for it,
                # so it gets no placeholders (placeholders it would not fill would also count as output tokens,
                # e.g. toward min_tokens).
                request.spec_token_ids = []
            else:
                drafting.append(req_id)
        k, one_more = async_quotas(budget, self.num_spec_tokens, len(scheduled), drafting)
        scheduler_output.bole_one_more = one_more   # read by the runner (Placeholders.of)
        if one_more:
            more = [-1] * (k + 1)   # read-only, shared like vLLM's own placeholder list
            for req_id in one_more:
                self.requests[req_id].spec_token_ids = more
