"""The draft stage of a Bole step: the next trees, within the step's node budget.

After the walk, each request that drafts gets a context (its tokens and what the step emitted) and the drafter's
first pass rows over what the step verified (``DraftStep``); the budget policy sizes the trees (a node budget and
per-request quotas; under async scheduling the scheduler fixed the quotas already); the drafter grows them on the
device (``propose_deferred``) and vLLM takes them as draft token ids, or as placeholders while the trees stay queued
on the device for the forest builder. The early path (``worker/early_drafting.py``) drafts before the walk instead,
through the same planning.
"""

from vllm.v1.outputs import DraftTokenIds
from vllm.v1.utils import record_function_or_nullcontext

from .._vllm_compat import set_step_draft_ids
from ..spec_decode.budget import BUDGET_ATTR
from ..spec_decode.drafter import DraftStep, RequestContexts, drafting
from ..spec_decode.queued_drafts import PLACEHOLDER, QueuedDrafts, quotas_of, select_quotas
from ..spec_decode.tree import select_step
from .scheduler import Placeholders
from .step_profile import profiled
from .tree_grammar import PARENTS_ATTR


class Drafting:
    """The draft stage of the model runner ``runner``. ``pending``: ``(DraftStep, finish)`` of drafts the drafter
    queued on the device, not yet finished; ``last_nodes``: the nodes of the last proposal (what the next step
    verifies); ``host_emitted``: under async scheduling, per request, the tokens the last host-walked step emitted
    (:meth:`fill_placeholders`)."""

    def __init__(self, runner):
        self.runner = runner
        self.pending = None
        self.last_nodes = 0
        self.host_emitted: dict[str, list[int]] = {}

    # ---- the step's trees ---------------------------------------------------------------------------------
    def propose(self, scheduler_output, sampled_token_ids, hidden_states, common_attn_metadata, early_rows):
        """Queues the drafter's trees for the step just walked (``early_rows``: the rows of a first pass that ran
        before the walk, else None) and keeps them pending until vLLM takes them."""
        runner = self.runner
        step = self.step_of(scheduler_output, sampled_token_ids, hidden_states, common_attn_metadata,
                            first_pass_ran=early_rows is not None)
        if early_rows is not None:
            step.all_rows = early_rows
        self.plan(step, Placeholders.of(scheduler_output), queued=False)
        finish = runner.bole_drafter.propose_deferred(step)
        if step.quotas is not None and step.queued is None:
            # A drafter that builds its trees on the host: they exist now; each keeps its quota (under async
            # scheduling, fills it: vLLM scheduled that many placeholders already).
            trees = select_quotas(finish(), step.quotas)
            if runner.bole_async:
                trees = [t.padded(q) for t, q in zip(trees, step.quotas)]
            step.queued = QueuedDrafts.of_trees(step.req_ids, trees, runner.device)
            finish = lambda: trees  # noqa: E731
        self.pending = (step, finish)

    def finish(self) -> None:
        """The pending drafts' trees (waits for the drafter's selection), as vLLM's draft token ids."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        runner = self.runner
        step, finish = pending
        with record_function_or_nullcontext("bole: finish_drafts"):
            if step.queued is not None:
                # vLLM gets placeholders of the trees' sizes and schedules the next step while the device drafts; the
                # step reads the drafts from the device (ForestBuilder.build) and walks the host trees
                # (StepForest.on_host).
                runner.bole_forest_builder.queued = (step.queued, finish, step.req_ids)
                self.last_nodes = sum(step.queued.counts)
                # (under async scheduling vLLM holds placeholders already and expects no ids)
                set_step_draft_ids(runner, None if runner.bole_async else step.queued.placeholder_ids(step.req_ids))
            else:
                with profiled(runner._bole_profiler, "draft"):
                    trees = finish()
                    if not runner.bole_drafter.selects:
                        trees = select_step(trees, step.per_request, step.budget)
                runner.bole_forest_builder.trees = {req_id: t for req_id, t in zip(step.req_ids, trees)}
                self.last_nodes = sum(len(t) for t in trees)
                set_step_draft_ids(runner, [t.tokens for t in trees])
        if runner._bole_profiler is not None:
            forest = runner._bole_forest
            runner._bole_profiler.end_step(None if forest is None else "trees" if forest.tree_only else "mixed")

    def take(self, drafts):
        """What vLLM takes as the step's draft token ids: ``drafts`` (vLLM's own take, synchronous scheduling) with
        the trees of structured-output requests and the budget choice attached; under async scheduling (where only
        vLLM's structured-output path asks) the structured-output trees of the step just started."""
        runner = self.runner
        if runner.bole_async:
            return self.structured_trees()
        if drafts is not None:
            # Structured-output requests' trees: the scheduler fills one grammar row per node after its path.
            proposed = runner.bole_forest_builder.trees
            trees = {req_id: proposed[req_id].parents for req_id in drafts.req_ids
                     if self._structured(req_id) and req_id in proposed}
            if trees:
                setattr(drafts, PARENTS_ATTR, trees)
            setattr(drafts, BUDGET_ATTR, runner.bole_budget.choice)
        runner.bole_budget.choice = None
        return drafts

    def structured_trees(self):
        """The trees of the structured-output requests of the step just started (async scheduling: vLLM holds
        their drafts as placeholders and asks for them before it fills their grammar rows), with their parents;
        None without such trees. Waits for the host copy of the queued trees."""
        runner = self.runner
        forest = runner._bole_forest
        if forest is None:
            return None
        index = [i for i, req_id in enumerate(forest.req_ids) if self._structured(req_id)]
        if not index:
            return None
        forest.materialize()
        req_ids = [forest.req_ids[i] for i in index]
        drafts = DraftTokenIds(req_ids, [list(forest.tokens[i][1:]) for i in index])
        setattr(drafts, PARENTS_ATTR, {req_id: [p - 1 for p in forest.tree_parents[i][1:]]
                                       for req_id, i in zip(req_ids, index)})
        return drafts

    def step_of(self, scheduler_output, sampled_token_ids, hidden_states, common_attn_metadata,
                first_pass_ran: bool = False) -> DraftStep:
        """The drafting step of the batch just walked: each drafting request's context, and the drafter's first
        pass rows (the verified path's nodes, or the tokens a request without a tree ran)."""
        runner = self.runner
        req_ids = list(runner.input_batch.req_ids)
        discard = runner.discard_request_mask.np[:len(req_ids)]
        forest = runner._bole_forest
        # A step without trees (prefill chunks, plain decodes) samples one token for every request it does not
        # discard. A drafter that reads no host context then needs it only as its first pass's last input, which
        # it takes on the device (DraftStep.sampled): the host goes on without waiting for the forward, and
        # the next step is prepared while the device runs it and the drafting (as vLLM's chain drafter runs).
        on_device = forest is None and not runner.bole_drafter.reads_contexts
        sampled = None if on_device else sampled_token_ids.tolist()
        tree_of = {r: i for i, r in enumerate(forest.tree_req_indices)} if forest is not None else {}
        paths = runner.bole_walk.paths
        input_ids = runner.input_ids.cpu
        contexts, first_pass, row = [], [], 0
        emitted = {}
        sampled_rows = []   # (on_device) the requests whose first pass ends in their sampled token
        for r, req_id in enumerate(req_ids):
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            new = [] if on_device else [t for t in sampled[r] if t != -1]
            ran = not discard[r] and (on_device or bool(new))
            # A root-only request's next token comes from vLLM's sampler (prompt logprobs, min_tokens
            # under async scheduling, ...): nothing of its tree would be walked past the root
            # (tree_sampler.walks_tree), so it drafts nothing and the step's node budget goes to the others. Its MTP
            # KV still catches up (first_pass).
            drafts = ran and runner._walks_tree(req_id)
            state = runner.requests[req_id]
            if runner.bole_async:
                self.fill_placeholders(req_id, state.output_token_ids)
                if not on_device:
                    emitted[req_id] = new
            start = int(runner.input_batch.num_computed_tokens_cpu[r])
            if r in tree_of:
                path = paths[r]
                tokens = forest.tokens[tree_of[r]]
                first_pass.append(([row + p for p in path], [tokens[p] for p in path[1:]] + [new[-1]],
                                   [start + m for m in range(len(path))]))
            elif n:
                if ran and on_device:   # (a stand-in: the drafter writes the sampled token over it)
                    sampled_rows.append(r)
                    following = 0
                else:
                    following = new[-1] if ran else int(runner.input_batch.token_ids_cpu[r, start + n])
                first_pass.append((list(range(row, row + n)), input_ids[row + 1:row + n].tolist() + [following],
                                   list(range(start, start + n))))
            else:
                first_pass.append(None)
            row += n
            contexts.append((state.prompt_token_ids, state.output_token_ids, len(state.output_token_ids), new)
                            if drafts else None)
        self.host_emitted = emitted
        return DraftStep(req_ids=req_ids, contexts=RequestContexts(contexts), hidden_states=hidden_states,
                         first_pass=first_pass, common_attn_metadata=common_attn_metadata,
                         sampled=(sampled_rows, sampled_token_ids[:, 0]) if sampled_rows else None,
                         # the catch-up reads it; none runs after a first pass over every verified node
                         rope=None if first_pass_ran else runner.bole_rope(row))

    def fill_placeholders(self, req_id: str, output: list[int]) -> None:
        """Under async scheduling vLLM's host copy of a request's output ends in placeholders (-1) for the last
        step's tokens, as many as it might have emitted: a drafter that reads the context (host drafters, which
        walk on the host every step) gets the tokens it emitted instead, as vLLM's own penalty path does
        (``InputBatch.update_async_output_token_ids``)."""
        last = self.host_emitted.get(req_id)
        if not last or not output or output[-1] != PLACEHOLDER:
            return
        first = len(output)
        while first > 0 and output[first - 1] == PLACEHOLDER:
            first -= 1
        output[first:] = last[:len(output) - first]

    def _structured(self, req_id: str) -> bool:
        """Whether the request has structured outputs (the scheduler fills grammar rows along its tree)."""
        params = self.runner.requests[req_id].sampling_params
        return params is not None and params.structured_outputs is not None

    # ---- the step's size ----------------------------------------------------------------------------------
    def plan(self, step: DraftStep, placeholders: Placeholders, queued: bool) -> None:
        """The step's per-request cap, node budget and, for drafts that go to vLLM as placeholders, each
        request's quota; and whether its trees are one-wide chains (``BudgetPolicy.width``). ``placeholders``:
        what the async scheduler gave each request (``Placeholders.of``); ``queued``: the drafts are queued
        whatever the batch holds (the early path), else :meth:`queues_drafts` decides."""
        if self.runner.bole_async:
            self._plan_async(step, placeholders)
        else:
            self._plan_budget(step)
            if queued or self.queues_drafts(step):
                step.quotas = quotas_of(drafting(step.contexts), step.per_request, step.budget)
        step.width = self.runner.bole_budget.width(nodes_per_tree(step))

    def queues_drafts(self, step: DraftStep) -> bool:
        """Whether this step's drafts go to vLLM as placeholders (``selection: "per_request"``): not when a
        request has structured outputs, whose drafts the scheduler reads to fill their grammar rows (not asked under
        async scheduling, where drafts always go as placeholders: vLLM asks for those trees before it fills the
        rows, :meth:`structured_trees`)."""
        runner = self.runner
        if runner.bole_config.selection != "per_request":
            return False
        return not any(self._structured(req_id) for req_id in step.req_ids)

    def _plan_async(self, step: DraftStep, placeholders: Placeholders) -> None:
        """Under async scheduling the scheduler fixed the next trees' sizes when it scheduled this step: each
        drafting request gets as many nodes as its placeholders (``num_spec_tokens_to_schedule``, one more for
        those in ``bole_one_more``), root-only requests none (prompt logprobs, min_tokens, ...:
        ``tree_sampler.walks_tree``; the scheduler gave them no placeholders and :meth:`step_of` no context).
        Under ``budget_rule "throughput"`` the step clock ticks here and the walks copied so far reach the
        acceptance model, for the scheduler's next budgets (``BudgetPolicy.async_budget``)."""
        runner = self.runner
        budget = runner.bole_budget
        if budget.rule == "throughput":
            self.tick_clock(len(step.req_ids))
            budget.device_walks.observe_ready()
        step.per_request = runner.speculative_config.num_speculative_tokens
        step.quotas = [placeholders.quota(req_id) if d else 0
                       for d, req_id in zip(drafting(step.contexts), step.req_ids)]
        step.budget = sum(step.quotas)
        step.fill_quotas = True
        budget.planned_async(len(step.req_ids), step.budget)

    def _plan_budget(self, step: DraftStep) -> None:
        """The step's per-request cap and node budget (``budget_rule "step"``/``"throughput"``: the clock
        ticks here)."""
        runner = self.runner
        num_reqs = len(step.req_ids)
        context_len = self._mean_context(num_reqs)
        step.per_request = runner.speculative_config.num_speculative_tokens
        if runner.bole_budget.rule != "decode":   # the step just run verified the last drafts
            self.tick_clock(num_reqs, context_len)
        step.budget = runner.bole_budget.plan(num_reqs, context_len)

    def _mean_context(self, num_reqs: int) -> int | None:
        """The batch's mean context length (picks the calibration table's KV bucket)."""
        return int(self.runner.input_batch.num_computed_tokens_cpu[:num_reqs].mean()) if num_reqs else None

    def tick_clock(self, num_reqs: int, context_len: int | None = None) -> None:
        """One step of the budget's step clock (``budget_rule "step"``/``"throughput"``), once per step when
        drafting starts: the step just run verified the last drafts."""
        runner = self.runner
        if context_len is None:
            context_len = self._mean_context(num_reqs)
        forest = runner._bole_forest
        runner.bole_budget.tick(num_reqs, context_len, forest is not None and forest.tree_only, self.last_nodes,
                                sum(runner.bole_graph_counts()))


def nodes_per_tree(step: DraftStep) -> int:
    """The most nodes a tree of ``step`` may keep: its largest quota, else the budget shared evenly over the
    drafting requests (the global selection keeps a request's best nodes above one score floor), at most the
    per-request cap."""
    if step.quotas is not None:
        return max(step.quotas, default=0)
    n = sum(drafting(step.contexts))
    if n == 0:
        return 0
    share = step.per_request if step.budget is None else -(-step.budget // n)
    return min(share, step.per_request) if step.per_request is not None else share


def no_draft_ids(asynchronous: bool):
    """What vLLM keeps as a step's draft ids until Bole fills them in: a list, or under async scheduling None
    (vLLM's next step then scatters no draft ids: Bole writes the draft rows from the device)."""
    return None if asynchronous else []
