"""Bole's model runner: carries a packed forest of draft trees through vLLM's V1 GPU/CPU model runner.

A step's stages, in order: ``_prepare_inputs`` has the forest builder (``worker/forest_builder.py``) turn each
request's scheduled drafts into its verification tree (root = last sampled token) and publishes the forest to the
layers; the target forward verifies it; ``_sample`` has the walk (``worker/tree_walk.py``) follow each tree (the
argmax for greedy requests, a draw at each node for sampled ones); ``propose_draft_token_ids`` has the drafting
stage (``worker/drafting.py``) ask the tree drafter for new trees within the budget policy's node budget
(``worker/budget_policy.py``), and the commit (``worker/commit.py``) then writes the accepted paths' GDN state and
moves their K/V to contiguous slots. With
``early_drafting`` (the default) a step of trees whose requests are greedy or plainly sampled does the walk, the
drafting and the commit on the device right behind its forward instead (``worker/early_drafting.py``).
"""

import numpy as np
import torch
from vllm.utils.math_utils import next_power_of_2
from vllm.v1.utils import record_function_or_nullcontext

from .. import envs
from .._vllm_compat import (RUNNER_OVERRIDES, check_overrides, copy_valid_sampled_token_count,
                             discarded_cpu_draws_undone, module_attr_override, save_discarded_cpu_generators,
                             step_draft_ids)
from ..config import bole_config_from_vllm
from ..logger import init_logger
from ..spec_decode.make_drafter import make_drafter
from ..spec_decode.synthetic import parse_synthetic
from ..spec_decode.tree_sampler import builtin_logitsprocs, walks_tree
from ..spec_decode.walk_record import WalkLog
from ..step.forest import StepForest, set_current_forest
from . import early_drafting
from .budget_policy import BudgetPolicy
from .commit import Committer
from .drafting import Drafting, no_draft_ids
from .forest_builder import ForestBuilder
from .step_profile import StepFacts, StepProfiler, StepTimes, profiled
from .tree_walk import TreeWalk

logger = init_logger(__name__)


# The step counters BoleModelRunnerMixin.step_counts reports
STEP_COUNTS = ("first_pass_steps", "early_draft_steps", "early_mixed_steps", "device_output_steps", "queued_trees",
               "stale_placeholders", "chain_steps")


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
        self._bole_step_times = StepTimes.from_env()
        # VLLM_BOLE_RECORD_WALKS: every verified tree and its walk, for acceptance profiles (None: not kept)
        self.bole_walk_log = WalkLog() if envs.VLLM_BOLE_RECORD_WALKS else None
        self._bole_graphs = None
        # the step's verification forest from the drafts awaiting verification (which it holds)
        self.bole_forest_builder = ForestBuilder(self)
        # which path of each verified tree the target accepts, and the step's tokens
        self.bole_walk = TreeWalk(self)
        # the node budget of each step and what its rule measures
        self.bole_budget = BudgetPolicy(vllm_config, self.speculative_config.num_speculative_tokens)
        # the next trees, within the budget policy's node budget
        self.bole_drafting = Drafting(self)
        # the accepted paths' GDN state and K/V of each verified forest
        self.bole_commit = Committer(self)
        # This step's drafting queued behind its target forward (early_drafting.EarlyDraft), if any
        self._bole_early_draft = None
        self.bole_first_pass_steps = 0   # steps whose drafter first pass ran before the walk
        self.bole_early_draft_steps = 0   # steps whose whole drafting and commit were queued before the walk
        self.bole_early_mixed_steps = 0   # of those, steps whose trees ran beside prefill chunks
        self.bole_device_output_steps = 0   # of those, steps whose tokens stayed on the device (async scheduling)
        # speculative_config.early_drafting: the drafter's first pass over every node before the walk; otherwise
        # it catches up after the walk
        self._bole_early_drafting = self.bole_config.early_drafting
        self._bole_draft_before_walk = True   # off after a failure of the drafting before the walk
        self._bole_early_mixed = True   # off after a failure of early drafting in a step with prefill chunks
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
        if self._bole_step_times is not None:
            self._bole_step_times.begin(scheduler_output.num_scheduled_tokens,
                                        self._bole_step_facts(scheduler_output))
        # Drafts vLLM did not take (tensor-parallel ranks other than the output rank) finish before the step
        # that verifies them (queued drafts only move aside: the step reads them from the device). So does the
        # commit of a step whose drafter did not run (vLLM skips it when the batch does not fit the drafter).
        self.bole_commit.run()
        self.bole_drafting.finish()
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

    def _bole_step_facts(self, scheduler_output) -> StepFacts:
        """What a step runs, for the step times (``VLLM_BOLE_SLOW_STEP_MS``): its requests and tokens, the
        requests with more tokens than their drafts and root (prefill chunks), those with drafts, and the counters
        whose change tells the path it took."""
        spec = scheduler_output.scheduled_spec_decode_tokens
        prefills = sum(n > 1 + len(spec.get(r, ())) for r, n in scheduler_output.num_scheduled_tokens.items())
        verify, draft = self.bole_graph_counts()
        return StepFacts(requests=len(scheduler_output.num_scheduled_tokens),
                         tokens=scheduler_output.total_num_scheduled_tokens, prefilling=prefills,
                         trees=sum(bool(d) for d in spec.values()), early_drafted=self.bole_early_draft_steps,
                         verify_graphs=verify, drafter_graphs=draft)

    @property
    def bole_async(self) -> bool:
        """Whether vLLM schedules asynchronously: the next step is scheduled, with placeholder drafts, before
        this one's drafts exist, and this step's tokens stay on the device (docs/design.md, "Async scheduling")."""
        return bool(getattr(self, "use_async_spec_decode", False))

    def _walks_tree(self, req_id: str) -> bool:
        """Whether the request's tree is walked past its root (``tree_sampler.walks_tree``); root-only requests
        (prompt logprobs; under async scheduling min_tokens) draft nothing."""
        params = self.requests[req_id].sampling_params
        return params is None or walks_tree(params, self.bole_async)   # (None: no sampling settings to honour)

    def step_counts(self) -> dict:
        """Steps and trees by the path they took (reports and tests), for each name of :data:`STEP_COUNTS`."""
        builder = self.bole_forest_builder
        return {"first_pass_steps": self.bole_first_pass_steps, "early_draft_steps": self.bole_early_draft_steps,
                "early_mixed_steps": self.bole_early_mixed_steps,
                "device_output_steps": self.bole_device_output_steps, "queued_trees": builder.queued_trees,
                "stale_placeholders": builder.stale_placeholders,
                "chain_steps": self.bole_drafter.chain_steps if self.bole_drafter is not None else 0}

    def bole_after_warmup(self) -> None:
        """The start-up warm-up is over (``worker/warmup.py``): what its random traffic taught the runner goes (the
        budget policy's measurements, the draft vocabulary's counts, recorded walks, the step counters); its
        compiled kernels and captured graphs stay."""
        self.bole_drafting.finish()
        self.bole_budget = BudgetPolicy(self.vllm_config, self.speculative_config.num_speculative_tokens)
        vocab = getattr(self.bole_drafter, "draft_vocab", None)
        if vocab is not None:
            vocab.restart()
        if self.bole_walk_log is not None:
            self.bole_walk_log = WalkLog()
        self.bole_first_pass_steps = self.bole_early_draft_steps = self.bole_device_output_steps = 0
        self.bole_early_mixed_steps = 0
        self.bole_forest_builder.queued_trees = self.bole_forest_builder.stale_placeholders = 0
        if self._bole_step_times is not None:
            self._bole_step_times.reset()
        if self.bole_drafter is not None:
            self.bole_drafter.chain_steps = 0

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
        if self.bole_drafter is not None and self.bole_drafter.observes_emitted and len(num_scheduled_tokens):
            # each request's first input token: for a decode, the target's last emitted one (on the device)
            starts = self.query_start_loc.gpu[:len(num_scheduled_tokens)]
            self.bole_drafter.observe_emitted(self.input_ids.gpu[starts])
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
        early = self._bole_early_draft
        if self.bole_async:
            self._async_next_tokens(sampled_token_ids, None if early is None else early.next_tokens)
        if early is not None and early.drafted:
            return no_draft_ids(self.bole_async)   # drafted before the walk (early_drafting): pending already
        with profiled(self._bole_profiler, "draft"):
            self.bole_drafting.propose(scheduler_output, sampled_token_ids, hidden_states, common_attn_metadata,
                                       None if early is None else early.rows)
        self.bole_commit.run()
        if self._bole_profiler is not None:   # phases stay synchronous: the drafts are finished now
            self.bole_drafting.finish()
            return step_draft_ids(self)   # (vLLM stores what this returns over what Drafting.finish set)
        # vLLM keeps this as the step's drafts; they are filled in when it takes them (take_draft_token_ids),
        # so its output processing runs while the device finishes the drafter's last levels.
        return no_draft_ids(self.bole_async)

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

    def take_draft_token_ids(self):
        self.bole_drafting.finish()
        return self.bole_drafting.take(None if self.bole_async else super().take_draft_token_ids())

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
