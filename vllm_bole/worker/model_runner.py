"""Bole's model runner: carries a packed forest of draft trees through vLLM's V1 GPU/CPU model runner.

A step's stages, in order: ``_prepare_inputs`` has the forest builder (``worker/forest_builder.py``) turn each
request's scheduled drafts into its verification tree (root = last sampled token) and publishes the forest to the
layers; the target forward verifies it; ``_sample`` has the walk (``worker/tree_walk.py``) follow each tree (the
argmax for greedy requests, a draw at each node for sampled ones); ``propose_draft_token_ids`` asks the tree
drafter for new trees within the budget policy's node budget (``worker/budget_policy.py``), and the commit
(``worker/commit.py``) then writes the accepted paths' GDN state and moves their K/V to contiguous slots. With
``early_drafting`` (the default) a step of trees whose requests are greedy or plainly sampled does the walk, the
drafting and the commit on the device right behind its forward instead (``worker/early_drafting.py``).
"""

import numpy as np
import torch
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.outputs import DraftTokenIds
from vllm.v1.utils import record_function_or_nullcontext

from .. import envs
from .._vllm_compat import (RUNNER_OVERRIDES, check_overrides, copy_valid_sampled_token_count,
                             discarded_cpu_draws_undone, module_attr_override, save_discarded_cpu_generators,
                             set_step_draft_ids, step_draft_ids)
from ..config import bole_config_from_vllm
from ..logger import init_logger
from ..spec_decode.budget import BUDGET_ATTR
from ..spec_decode.drafter import DraftStep, RequestContexts, drafting
from ..spec_decode.make_drafter import make_drafter
from ..spec_decode.queued_drafts import PLACEHOLDER, QueuedDrafts, quotas_of, select_quotas
from ..spec_decode.synthetic import parse_synthetic
from ..spec_decode.tree import select_step
from ..spec_decode.tree_sampler import builtin_logitsprocs, walks_tree
from ..spec_decode.walk_record import WalkLog
from ..step.forest import StepForest, set_current_forest
from . import early_drafting
from .budget_policy import BudgetPolicy
from .commit import Committer
from .forest_builder import ForestBuilder
from .scheduler import Placeholders
from .step_profile import StepProfiler, profiled
from .tree_grammar import PARENTS_ATTR
from .tree_walk import TreeWalk

logger = init_logger(__name__)


# The step counters BoleModelRunnerMixin.step_counts reports
STEP_COUNTS = ("first_pass_steps", "early_draft_steps", "device_output_steps", "queued_trees", "stale_placeholders",
               "chain_steps")


class BoleModelRunnerMixin:
    """Mixed in front of the platform's V1 model runner class (see :func:`bole_runner_class`)."""

    def __init__(self, vllm_config, device):
        # vLLM's built-in logits processors, as without speculation (min-p and logit bias are Bole's to apply)
        with module_attr_override("vllm.v1.worker.gpu_model_runner", "build_logitsprocs", builtin_logitsprocs):
            super().__init__(vllm_config, device)
        self.bole_config = bole_config_from_vllm(vllm_config)   # (its budget_rule as given: see bole_budget.rule)
        self._bole_forest: StepForest | None = None
        self._bole_synthetic = parse_synthetic(self.bole_config.synthetic_acceptance)
        self.bole_drafter = None
        self._bole_profiler = StepProfiler.from_env()
        # VLLM_BOLE_RECORD_WALKS: every verified tree and its walk, for acceptance profiles (None: not kept)
        self.bole_walk_log = WalkLog() if envs.VLLM_BOLE_RECORD_WALKS else None
        self._bole_graphs = None
        self._bole_pending = None   # (DraftStep, finish) of drafts queued on the device, not yet taken
        # the step's verification forest from the drafts awaiting verification (which it holds)
        self.bole_forest_builder = ForestBuilder(self)
        # which path of each verified tree the target accepts, and the step's tokens
        self.bole_walk = TreeWalk(self)
        # the node budget of each step and what its rule measures
        self.bole_budget = BudgetPolicy(vllm_config, self.speculative_config.num_speculative_tokens)
        self._bole_last_nodes = 0        # draft nodes of the last proposal (what the next step verifies)
        # the accepted paths' GDN state and K/V of each verified forest
        self.bole_commit = Committer(self)
        # This step's drafting queued behind its target forward (early_drafting.EarlyDraft), if any
        self._bole_early_draft = None
        self.bole_first_pass_steps = 0   # steps whose drafter first pass ran before the walk
        self.bole_early_draft_steps = 0   # steps whose whole drafting and commit were queued before the walk
        self.bole_device_output_steps = 0   # of those, steps whose tokens stayed on the device (async scheduling)
        # speculative_config.early_drafting: the drafter's first pass over every node before the walk; otherwise
        # it catches up after the walk
        self._bole_early_drafting = self.bole_config.early_drafting
        self._bole_draft_before_walk = True   # off after a failure of the drafting before the walk
        # Under async scheduling: per request, the tokens the last host-walked step emitted (_fill_placeholders)
        self._bole_host_emitted: dict[str, list[int]] = {}
        # CPU: this step's seeded prompt chunks, their generator states before the step sampled (_bookkeeping_sync)
        self._bole_discarded_generators: dict[int, torch.Tensor] = {}

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        self._bole_graphs_allowed = (self.device.type == "cuda" and self.bole_config.cuda_graphs
                                     and not self.model_config.enforce_eager)
        if self._bole_graphs_allowed and self.parallel_config.tensor_parallel_size > 1:
            # A lazy capture would run tensor-parallel all-reduces outside vLLM's graph_capture() context.
            logger.info("Bole's full CUDA graphs are off with tensor parallelism (vLLM's piecewise graphs run)")
            self._bole_graphs_allowed = False
        self.bole_drafter = make_drafter(self, self.bole_config)
        if self._bole_graphs_allowed:
            from .verify_graphs import VerifyGraphs

            self._bole_graphs = VerifyGraphs(self)

    def profile_cudagraph_memory(self) -> int:
        """vLLM's estimate of its graphs' memory, plus what Bole's graphs hold once captured, so that the KV
        cache leaves room for them: the GDN step buffers (one per power-of-two capacity up to the largest
        captured size, under twice the largest) and two more graph pools (verification, drafter levels) taken
        as large as vLLM's own."""
        vllm_graphs = super().profile_cudagraph_memory()
        if self._bole_graphs is None:
            return vllm_graphs
        from ..attention.gdn import BoleQwenGDN

        estimate = 3 * vllm_graphs

        gdn = [m for m in self.compilation_config.static_forward_context.values() if isinstance(m, BoleQwenGDN)]
        if gdn:
            layer = gdn[0]
            hk, hv = layer.num_k_heads // layer.tp_size, layer.num_v_heads // layer.tp_size
            conv_dim = 2 * hk * layer.head_k_dim + hv * layer.head_v_dim
            per_token = len(gdn) * ((hk * layer.head_k_dim + hv * layer.head_v_dim + hv) * 4
                                    + conv_dim * self.model_config.dtype.itemsize)
            capacity = next_power_of_2(self.compilation_config.max_cudagraph_capture_size or 1)
            estimate += 2 * capacity * per_token
        logger.info("Bole reserves %.2f GiB for its full CUDA graphs and GDN step buffers (vLLM's graphs: %.2f GiB)",
                    (estimate - vllm_graphs) / 2**30, vllm_graphs / 2**30)
        return estimate

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):
        if self._bole_graphs is None or self._bole_forest is None:
            return super()._model_forward(input_ids=input_ids, positions=positions,
                                          intermediate_tensors=intermediate_tensors, inputs_embeds=inputs_embeds,
                                          **model_kwargs)
        from .verify_graphs import model_forward

        return model_forward(self._bole_graphs, self._bole_forest, super()._model_forward, input_ids, positions,
                             intermediate_tensors, inputs_embeds, model_kwargs)

    # ---- verification inputs ------------------------------------------------------------------------------
    def execute_model(self, scheduler_output, intermediate_tensors=None):
        # Drafts vLLM did not take (tensor-parallel ranks other than the output rank) finish before the step
        # that verifies them (queued drafts only move aside: the step reads them from the device). So does the
        # commit of a step whose drafter did not run (vLLM skips it when the batch does not fit the drafter).
        self.bole_commit.run()
        self._finish_drafts()
        self._bole_early_draft = None
        try:
            with profiled(self._bole_profiler, "forward"):
                output = super().execute_model(scheduler_output, intermediate_tensors)
            if output is None and self.execute_model_state is not None:
                with torch.inference_mode():   # as vLLM's execute_model and sample_tokens run
                    self._bole_early_draft = early_drafting.launch(self, scheduler_output)
            return output
        finally:
            set_current_forest(None)
            # Queued drafts serve the step right after the one that drafted them (its forest keeps what it read);
            # placeholders scheduled later are verified as chains (ForestBuilder.build).
            self.bole_forest_builder.queued = None

    @property
    def bole_async(self) -> bool:
        """Whether vLLM schedules asynchronously: the next step is scheduled, with placeholder drafts, before
        this one's drafts exist, and this step's tokens stay on the device (docs/design.md, "Async scheduling")."""
        return bool(getattr(self, "use_async_spec_decode", False))

    def _plan_quotas(self, step: DraftStep, placeholders: Placeholders, queued: bool) -> None:
        """The step's per-request cap, node budget and, for drafts that go to vLLM as placeholders, each
        request's quota. ``placeholders``: what the async scheduler gave each request (``Placeholders.of``);
        ``queued``: the drafts are queued whatever the batch holds (the early path), else :meth:`_queues_drafts`
        decides."""
        if self.bole_async:
            self._plan_async(step, placeholders)
        else:
            self._plan_budget(step)
            if queued or self._queues_drafts(step):
                step.quotas = quotas_of(drafting(step.contexts), step.per_request, step.budget)
        step.width = self.bole_budget.width(self._nodes_per_tree(step))

    @staticmethod
    def _nodes_per_tree(step: DraftStep) -> int:
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

    def _plan_async(self, step: DraftStep, placeholders: Placeholders) -> None:
        """Under async scheduling the scheduler fixed the next trees' sizes when it scheduled this step: each
        drafting request gets as many nodes as its placeholders (``num_spec_tokens_to_schedule``, one more for
        those in ``bole_one_more``), root-only requests none (prompt logprobs, min_tokens, ...:
        ``tree_sampler.walks_tree``; the scheduler gave them no placeholders and ``_draft_step`` no context).
        Under ``budget_rule "throughput"`` the step clock ticks here and the walks copied so far reach the
        acceptance model, for the scheduler's next budgets (``BudgetPolicy.async_budget``)."""
        if self.bole_budget.rule == "throughput":
            self._tick_clock(len(step.req_ids))
            self.bole_budget.device_walks.observe_ready()
        step.per_request = self.speculative_config.num_speculative_tokens
        step.quotas = [placeholders.quota(req_id) if d else 0
                       for d, req_id in zip(drafting(step.contexts), step.req_ids)]
        step.budget = sum(step.quotas)
        step.fill_quotas = True
        self.bole_budget.planned_async(len(step.req_ids), step.budget)

    def _structured(self, req_id: str) -> bool:
        params = self.requests[req_id].sampling_params
        return params is not None and params.structured_outputs is not None

    def _walks_tree(self, req_id: str) -> bool:
        """Whether the request's tree is walked past its root (``tree_sampler.walks_tree``); root-only requests
        (prompt logprobs; under async scheduling min_tokens) draft nothing."""
        params = self.requests[req_id].sampling_params
        return params is None or walks_tree(params, self.bole_async)   # (None: no sampling settings to honour)

    def _plan_budget(self, step: DraftStep) -> None:
        """The step's per-request cap and node budget (``budget_rule "step"``/``"throughput"``: the clock
        ticks here)."""
        num_reqs = len(step.req_ids)
        context_len = self._mean_context(num_reqs)
        step.per_request = self.speculative_config.num_speculative_tokens
        if self.bole_budget.rule != "decode":   # the step just run verified the last drafts
            self._tick_clock(num_reqs, context_len)
        step.budget = self.bole_budget.plan(num_reqs, context_len)

    def _mean_context(self, num_reqs: int) -> int | None:
        """The batch's mean context length (picks the calibration table's KV bucket)."""
        return int(self.input_batch.num_computed_tokens_cpu[:num_reqs].mean()) if num_reqs else None

    def _tick_clock(self, num_reqs: int, context_len: int | None = None) -> None:
        """One step of the budget's step clock (``budget_rule "step"``/``"throughput"``), once per step when
        drafting starts: the step just run verified the last drafts."""
        if context_len is None:
            context_len = self._mean_context(num_reqs)
        forest = self._bole_forest
        self.bole_budget.tick(num_reqs, context_len, forest is not None and forest.tree_only, self._bole_last_nodes,
                              sum(self.bole_graph_counts()))

    def step_counts(self) -> dict:
        """Steps and trees by the path they took (reports and tests), for each name of :data:`STEP_COUNTS`."""
        builder = self.bole_forest_builder
        return {"first_pass_steps": self.bole_first_pass_steps, "early_draft_steps": self.bole_early_draft_steps,
                "device_output_steps": self.bole_device_output_steps, "queued_trees": builder.queued_trees,
                "stale_placeholders": builder.stale_placeholders,
                "chain_steps": getattr(self.bole_drafter, "chain_steps", 0)}

    def bole_graph_counts(self) -> tuple[int, int]:
        """(verification graphs, drafter graphs: level and whole-level) captured so far; the holders only grow,
        so a change between two reads means a capture in between."""
        verify = getattr(self, "_bole_graphs", None)
        drafter = self.bole_drafter
        draft = drafter.graphs if drafter is not None else None
        beams = [b.graphs for b in drafter.beams() if b.graphs is not None] if drafter is not None else []
        return (len(verify.graphs) if verify is not None else 0,
                (len(draft.graphs) if draft is not None else 0) + sum(len(b.graphs) for b in beams))

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        logits_indices, spec_meta = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._bole_forest = None
        if spec_meta is not None or self._plain_decode_step(num_scheduled_tokens):
            with record_function_or_nullcontext("bole: build_forest"):
                self._bole_forest = self.bole_forest_builder.build(scheduler_output, num_scheduled_tokens)
            set_current_forest(self._bole_forest)
        return logits_indices, spec_meta

    def _plain_decode_step(self, num_scheduled_tokens: np.ndarray) -> bool:
        """A step of decodes only, none with drafts, that Bole's graphs can run (as one-node trees): its cost
        is then what a tree step's is measured against (calibration's T_dec), and it does not fall back to
        vLLM's piecewise graphs, whose eager GDN and attention layers are host-bound."""
        n = len(num_scheduled_tokens)
        if self._bole_graphs is None or n == 0 or int(num_scheduled_tokens.max()) != 1:
            return False
        batch = self.input_batch
        return bool((batch.num_computed_tokens_cpu[:n] >= batch.num_prompt_tokens[:n]).all())

    # ---- verification -------------------------------------------------------------------------------------
    def _sample(self, logits, spec_decode_metadata):
        self._bole_discarded_generators = save_discarded_cpu_generators(self)
        with profiled(self._bole_profiler, "walk"):
            return self.bole_walk.sample(logits, spec_decode_metadata, super()._sample)

    def _bookkeeping_sync(self, scheduler_output, *args, **kwargs):
        saved, self._bole_discarded_generators = self._bole_discarded_generators, {}
        with discarded_cpu_draws_undone(self, saved):
            return super()._bookkeeping_sync(scheduler_output, *args, **kwargs)

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        if self.cache_config.mamba_cache_mode == "align" or (
                output_token_ids.device.type == "cpu" and self.device.type != "cpu"):
            self.bole_commit.accepted_counts(output_token_ids)
        else:
            super()._update_states_after_model_execute(output_token_ids, scheduler_output)
        # Only the next verification reads the committed GDN state and moved K/V: the commit is queued after the
        # drafter's levels (propose_draft_token_ids), so its host work overlaps them on the device.
        self.bole_commit.after_walk(self._bole_forest, self._bole_early_draft)

    # ---- drafting -----------------------------------------------------------------------------------------
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        # (The last step's drafts were finished when this step's execute_model began.)
        if self.bole_async:
            first = self._bole_early_draft
            self._async_next_tokens(sampled_token_ids, None if first is None else first.next_tokens)
        if self._bole_early_draft is not None and self._bole_early_draft.drafted:
            return self._no_draft_ids()   # drafted before the walk (early_drafting): pending already
        with profiled(self._bole_profiler, "draft"):
            step = self._draft_step(scheduler_output, sampled_token_ids, hidden_states, common_attn_metadata)
            if self._bole_early_draft is not None:
                step.all_rows = self._bole_early_draft.rows
            self._plan_quotas(step, Placeholders.of(scheduler_output), queued=False)
            finish = self.bole_drafter.propose_deferred(step)
            if step.quotas is not None and step.queued is None:
                # A drafter that builds its trees on the host: they exist now; each keeps its quota (under async
                # scheduling, fills it: vLLM scheduled that many placeholders already).
                trees = select_quotas(finish(), step.quotas)
                if self.bole_async:
                    trees = [t.padded(q) for t, q in zip(trees, step.quotas)]
                step.queued = QueuedDrafts.of_trees(step.req_ids, trees, self.device)
                finish = lambda: trees  # noqa: E731
            self._bole_pending = (step, finish)
        self.bole_commit.run()
        if self._bole_profiler is not None:   # phases stay synchronous: the drafts are finished now
            self._finish_drafts()
            return step_draft_ids(self)   # (vLLM stores what this returns over what _finish_drafts set)
        # vLLM keeps this as the step's drafts; they are filled in when it takes them (take_draft_token_ids),
        # so its output processing runs while the device finishes the drafter's last levels.
        return self._no_draft_ids()

    def _no_draft_ids(self):
        """What vLLM keeps as the step's draft ids until Bole fills them in: a list, or under async scheduling
        None (vLLM's next step then scatters no draft ids: Bole writes the draft rows from the device)."""
        return None if self.bole_async else []

    def _async_next_tokens(self, sampled_token_ids: torch.Tensor, sent=None) -> None:
        """Under async scheduling, what vLLM's next step reads on the device instead of the host output: each
        request's last emitted token (the next root) and its count of emitted tokens, from which vLLM corrects
        the next step's positions and sequence lengths (vLLM's drafter helper, as its MTP path calls it).
        ``sent``: (next tokens, counts) of :meth:`send_emitted_counts`, whose host copy left already."""
        if sent is None:
            copy_valid_sampled_token_count(self, *self.send_emitted_counts(sampled_token_ids, copy=False))
            return
        # What _copy_valid_sampled_token_count keeps besides its host copy (vLLM cleared it after sampling).
        next_ids, counts = sent
        if self.use_async_spec_decode:
            self.valid_sampled_token_count_gpu = counts
        self.input_batch.prev_sampled_token_ids = next_ids.unsqueeze(1)

    def send_emitted_counts(self, sampled_token_ids: torch.Tensor, copy: bool = True):
        """(next tokens, emitted counts) of the step on the device; with ``copy`` the counts also start on their
        way to the host (vLLM's event). The next step's host preparation waits for that copy, so the early path
        sends it right behind the walk: the host then prepares the next step while the device drafts."""
        next_ids, counts = self.drafter.prepare_next_token_ids_padded(
            sampled_token_ids.to(torch.int32), self.requests, self.input_batch, self.discard_request_mask.gpu)
        if copy:
            copy_valid_sampled_token_count(self, next_ids, counts)
        return next_ids, counts

    def _finish_drafts(self) -> None:
        """The pending drafts' trees (waits for the drafter's selection), as vLLM's draft token ids."""
        pending, self._bole_pending = self._bole_pending, None
        if pending is None:
            return
        step, finish = pending
        with record_function_or_nullcontext("bole: finish_drafts"):
            if step.queued is not None:
                # vLLM gets placeholders of the trees' sizes and schedules the next step while the device drafts; the
                # step reads the drafts from the device (ForestBuilder.build) and walks the host trees
                # (StepForest.on_host).
                self.bole_forest_builder.queued = (step.queued, finish, step.req_ids)
                self._bole_last_nodes = sum(step.queued.counts)
                # (under async scheduling vLLM holds placeholders already and expects no ids)
                set_step_draft_ids(self, None if self.bole_async else step.queued.placeholder_ids(step.req_ids))
            else:
                with profiled(self._bole_profiler, "draft"):
                    trees = finish()
                    if not self.bole_drafter.selects:
                        trees = select_step(trees, step.per_request, step.budget)
                self.bole_forest_builder.trees = {req_id: t for req_id, t in zip(step.req_ids, trees)}
                self._bole_last_nodes = sum(len(t) for t in trees)
                set_step_draft_ids(self, [t.tokens for t in trees])
        if self._bole_profiler is not None:
            self._bole_profiler.end_step(tree_step=self._bole_forest is not None)

    def _queues_drafts(self, step: DraftStep) -> bool:
        """Whether this step's drafts go to vLLM as placeholders (``selection: "per_request"``): not when a
        request has structured outputs, whose drafts the scheduler reads to fill their grammar rows (not asked under
        async scheduling, where drafts always go as placeholders: vLLM asks for those trees before it fills the
        rows, :meth:`_structured_trees`)."""
        if self.bole_config.selection != "per_request":
            return False
        return not any(self._structured(req_id) for req_id in step.req_ids)

    def take_draft_token_ids(self):
        self._finish_drafts()
        if self.bole_async:
            # Only vLLM's structured-output path asks under async scheduling, before it fills the grammar rows of a
            # step whose forward already runs: that step's trees of structured-output requests.
            return self._structured_trees()
        drafts = super().take_draft_token_ids()
        if drafts is not None:
            # Structured-output requests' trees: the scheduler fills one grammar row per node after its path.
            proposed = self.bole_forest_builder.trees
            trees = {req_id: proposed[req_id].parents for req_id in drafts.req_ids
                     if self._structured(req_id) and req_id in proposed}
            if trees:
                setattr(drafts, PARENTS_ATTR, trees)
            setattr(drafts, BUDGET_ATTR, self.bole_budget.choice)
        self.bole_budget.choice = None
        return drafts

    def _structured_trees(self):
        """The trees of the structured-output requests of the step just started (async scheduling: vLLM holds
        their drafts as placeholders and asks for them before it fills their grammar rows), with their parents;
        None without such trees. Waits for the host copy of the queued trees."""
        forest = self._bole_forest
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

    def _fill_placeholders(self, req_id: str, output: list[int]) -> None:
        """Under async scheduling vLLM's host copy of a request's output ends in placeholders (-1) for the last
        step's tokens, as many as it might have emitted: a drafter that reads the context (host drafters, which
        walk on the host every step) gets the tokens it emitted instead, as vLLM's own penalty path does
        (``InputBatch.update_async_output_token_ids``)."""
        last = self._bole_host_emitted.get(req_id)
        if not last or not output or output[-1] != PLACEHOLDER:
            return
        first = len(output)
        while first > 0 and output[first - 1] == PLACEHOLDER:
            first -= 1
        output[first:] = last[:len(output) - first]

    def _draft_step(self, scheduler_output, sampled_token_ids, hidden_states, common_attn_metadata) -> DraftStep:
        req_ids = list(self.input_batch.req_ids)
        discard = self.discard_request_mask.np[:len(req_ids)]
        sampled = sampled_token_ids.tolist()
        forest = self._bole_forest
        tree_of = {r: i for i, r in enumerate(forest.tree_req_indices)} if forest is not None else {}
        paths = self.bole_walk.paths
        input_ids = self.input_ids.cpu
        contexts, first_pass, row = [], [], 0
        emitted = {}
        for r, req_id in enumerate(req_ids):
            n = scheduler_output.num_scheduled_tokens.get(req_id, 0)
            new = [t for t in sampled[r] if t != -1]
            ran = not discard[r] and bool(new)
            # A root-only request's next token comes from vLLM's sampler (prompt logprobs, min_tokens
            # under async scheduling, ...): nothing of its tree would be walked past the root
            # (tree_sampler.walks_tree), so it drafts nothing and the step's node budget goes to the others. Its MTP
            # KV still catches up (first_pass).
            drafting = ran and self._walks_tree(req_id)
            state = self.requests[req_id]
            if self.bole_async:
                self._fill_placeholders(req_id, state.output_token_ids)
                emitted[req_id] = new
            start = int(self.input_batch.num_computed_tokens_cpu[r])
            if r in tree_of:
                path = paths[r]
                tokens = forest.tokens[tree_of[r]]
                first_pass.append(([row + p for p in path], [tokens[p] for p in path[1:]] + [new[-1]],
                                   [start + m for m in range(len(path))]))
            elif n:
                following = new[-1] if ran else int(self.input_batch.token_ids_cpu[r, start + n])
                first_pass.append((list(range(row, row + n)), input_ids[row + 1:row + n].tolist() + [following],
                                   list(range(start, start + n))))
            else:
                first_pass.append(None)
            row += n
            contexts.append((state.prompt_token_ids, state.output_token_ids, len(state.output_token_ids), new)
                            if drafting else None)
        self._bole_host_emitted = emitted
        return DraftStep(req_ids=req_ids, contexts=RequestContexts(contexts), hidden_states=hidden_states,
                         first_pass=first_pass, common_attn_metadata=common_attn_metadata,
                         # the catch-up reads it; none runs after a first pass over every verified node
                         rope=self.bole_rope(row) if getattr(self._bole_early_draft, "rows", None) is None else None)

    def bole_rope(self, rows: int) -> torch.Tensor | None:
        """The ``[3, rows]`` M-RoPE positions of the step's first ``rows`` rows as the target ran them (a copy: the
        next step rewrites the buffer) when a request of the batch has images (its positions inside an image are
        a grid's, and run behind the token index after it), for the drafter's rows over the same tokens; None
        otherwise (the drafter's rows then take their token positions in every section, which is the same)."""
        if not self.uses_mrope or not any(self.requests[r].mm_features or self.requests[r].mrope_position_delta
                                          for r in self.input_batch.req_ids):
            return None
        return self.mrope_positions.gpu[:, :rows].clone()


_RUNNER_CLASSES: dict[type, type] = {}


def bole_runner_class(base: type) -> type:
    """``BoleModelRunnerMixin`` in front of ``base`` (one class per base)."""
    if base not in _RUNNER_CLASSES:
        check_overrides(base, RUNNER_OVERRIDES)
        _RUNNER_CLASSES[base] = type(f"Bole{base.__name__}", (BoleModelRunnerMixin, base), {})
    return _RUNNER_CLASSES[base]
