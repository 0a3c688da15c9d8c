"""Drafts finish when vLLM takes them (worker/model_runner.py): ``propose_draft_token_ids`` only queues the
drafter's work; ``take_draft_token_ids`` (after vLLM's output processing) or, failing that, the next
``execute_model`` waits for it and turns it into the step's trees and draft token ids, once."""

import collections
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.outputs import DraftTokenIds

from vllm_bole.spec_decode.drafter import DraftStep, TreeDrafter
from vllm_bole.spec_decode.tree import DraftTree
from vllm_bole.worker.commit import Committer
from vllm_bole.worker.drafting import Drafting
from vllm_bole.worker.forest_builder import ForestBuilder
from vllm_bole.worker.model_runner import BoleModelRunnerMixin


class _Base:
    """What the mixin calls of vLLM's runner here."""

    def take_draft_token_ids(self):
        return DraftTokenIds(list(self.bole_forest_builder.trees), self._draft_token_ids)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return ("executed", dict(self.bole_forest_builder.trees))

    def _update_states_after_model_execute(self, output_token_ids, scheduler_output):
        self.vllm_updates = getattr(self, "vllm_updates", 0) + 1


class _Runner(BoleModelRunnerMixin, _Base):
    pass


def _runner():
    runner = _Runner.__new__(_Runner)
    runner._bole_profiler, runner._bole_step_times, runner._bole_forest = None, None, None
    runner.bole_forest_builder = ForestBuilder(runner)
    runner._draft_token_ids, runner.bole_drafting = None, Drafting(runner)
    runner.bole_commit, runner._bole_early_draft = Committer(runner), None
    runner.bole_budget = SimpleNamespace(choice=None)
    runner.uses_mrope = False
    runner.cache_config = SimpleNamespace(mamba_cache_mode="none")   # (no prefix caching)
    runner.bole_drafter = SimpleNamespace(selects=True, own_kv_layers=lambda: ("mtp.attn",), reads_contexts=True)
    runner.requests = collections.defaultdict(lambda: SimpleNamespace(sampling_params=None))
    return runner


def _pending(runner, calls):
    step = DraftStep(req_ids=["a", "b"], contexts=[[1], [2]])

    def finish():
        calls.append(1)
        return [DraftTree([5, 6], [-1, 0], [0.9, 0.8]), DraftTree([7], [-1], [0.5])]

    runner.bole_drafting.pending = (step, finish)


def test_take_finishes_the_pending_drafts_once():
    runner, calls = _runner(), []
    _pending(runner, calls)
    assert calls == []                                        # queued, not waited for
    assert runner.take_draft_token_ids() == DraftTokenIds(["a", "b"], [[5, 6], [7]])
    assert calls == [1] and runner.bole_drafting.pending is None
    trees = runner.bole_forest_builder.trees
    assert trees["a"].tokens == [5, 6] and trees["b"].tokens == [7]
    assert runner.take_draft_token_ids() == DraftTokenIds(["a", "b"], [[5, 6], [7]]) and calls == [1]


def test_structured_requests_drafts_carry_their_trees_parents():
    """The scheduler fills a structured-output request's grammar rows along its tree (worker/tree_grammar.py)."""
    from vllm_bole.worker.tree_grammar import PARENTS_ATTR

    runner, calls = _runner(), []
    runner.requests["a"] = SimpleNamespace(sampling_params=SamplingParams(
        structured_outputs=StructuredOutputsParams(regex="[a-z]+")))
    _pending(runner, calls)
    drafts = runner.take_draft_token_ids()
    assert getattr(drafts, PARENTS_ATTR) == {"a": [-1, 0]}


def test_the_next_step_finishes_drafts_nobody_took():
    runner, calls = _runner(), []
    _pending(runner, calls)
    out = runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert calls == [1] and out[0] == "executed" and sorted(out[1]) == ["a", "b"]


def test_unselected_drafters_are_cut_by_the_step_budget():
    runner, calls = _runner(), []
    runner.bole_drafter = SimpleNamespace(selects=False)
    _pending(runner, calls)
    step, finish = runner.bole_drafting.pending
    step.per_request, step.budget = 5, 2                      # two nodes over the batch
    runner.take_draft_token_ids()
    assert [len(t) for t in runner.bole_forest_builder.trees.values()] == [2, 0]


def test_default_deferred_proposal_is_the_proposal():
    class Fixed(TreeDrafter):
        def propose(self, step):
            return [DraftTree([3], [-1], [1.0])]

    finish = Fixed(None, None).propose_deferred(DraftStep(req_ids=["a"], contexts=[[1]]))
    assert [t.tokens for t in finish()] == [[3]]


def test_queued_drafts_reach_vllm_as_placeholders_without_waiting():
    """selection "per_request": vLLM takes placeholder drafts of the trees' sizes; the trees are not waited for
    (the step reads them from the device and the walk reads the host copy)."""
    from vllm_bole.spec_decode.queued_drafts import PLACEHOLDER, QueuedDrafts

    runner, calls = _runner(), []
    _pending(runner, calls)
    step, finish = runner.bole_drafting.pending
    trees = [DraftTree([5, 6], [-1, 0], [0.9, 0.8]), DraftTree([7], [-1], [0.5])]
    step.queued = QueuedDrafts.of_trees(step.req_ids, trees, "cpu")
    assert runner.take_draft_token_ids().draft_token_ids == [[PLACEHOLDER] * 2, [PLACEHOLDER]]
    assert calls == [] and runner.bole_drafting.pending is None and runner.bole_drafting.last_nodes == 3
    assert runner.bole_forest_builder.queued == (step.queued, finish, step.req_ids)


def test_structured_outputs_keep_real_draft_ids():
    """vLLM checks a structured-output request's drafts against its grammar: such batches keep real ids."""
    runner = _runner()
    runner.bole_config = SimpleNamespace(selection="per_request")
    free = SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=None))
    runner.requests = {"a": free, "b": SimpleNamespace(sampling_params=None)}
    step = DraftStep(req_ids=["a", "b"], contexts=[[1], [2]])
    assert runner.bole_drafting.queues_drafts(step)
    runner.requests["b"] = SimpleNamespace(sampling_params=SimpleNamespace(structured_outputs=object()))
    assert not runner.bole_drafting.queues_drafts(step)
    runner.requests["b"] = free
    runner.bole_config = SimpleNamespace(selection="global")
    assert not runner.bole_drafting.queues_drafts(step)


def test_contexts_are_built_when_read_and_frozen_at_the_step():
    from vllm_bole.spec_decode.drafter import RequestContexts, drafting

    output = [7, 8]
    contexts = RequestContexts([((1, 2), output, 2, [9]), None])
    output.append(10)                                  # the next step's token: not part of this step's context
    assert drafting(contexts) == [True, False] and drafting([[1], None]) == [True, False]
    assert contexts[0] == [1, 2, 7, 8, 9] and contexts[1] is None
    assert list(contexts) == [[1, 2, 7, 8, 9], None] and len(contexts) == 2 and contexts[:1] == [[1, 2, 7, 8, 9]]


def test_queued_trees_map_to_the_drafting_steps_requests():
    """The drafter's trees come per request of its step, the queued rows only for the requests that drafted."""
    from vllm_bole.spec_decode.queued_drafts import QueuedDrafts
    from vllm_bole.step.forest import StepForest

    runner = _runner()
    runner.input_batch = SimpleNamespace(req_ids=["b", "c"])
    trees = [DraftTree(), DraftTree([5, 6], [-1, 0], [0.9, 0.8]), DraftTree([7], [-1], [0.5])]
    queued = QueuedDrafts.of_trees(["b", "c"], trees[1:], "cpu")          # "a" drafted nothing
    forest = StepForest(req_ids=["b", "c"], tree_req_indices=[0, 1], parent=None, cu_seqlens=None,
                        tokens=[None, None], tree_parents=[None, None])
    runner.bole_forest_builder.read_queued_trees((queued, lambda: trees, ["a", "b", "c"]), [(0, 0, 2), (1, 1, 1)],
                                                 forest)
    assert forest.tokens == [[-1, 5, 6], [-1, 7]] and forest.tree_parents == [[-1, 0, 1], [-1, 0]]


def test_a_verified_steps_commit_waits_for_the_drafter_or_the_next_step(monkeypatch):
    """The accepted paths are committed after the drafter is queued; when vLLM skips the drafter, before the
    next step's forward. Once either way, and without the drafter's own K/V layers (its catch-up rewrites them)."""
    import vllm_bole.worker.commit as commit

    calls = []
    monkeypatch.setattr(commit, "commit_step", lambda forest: calls.append(("state", forest)))
    monkeypatch.setattr(commit, "compact_accepted_kv",
                        lambda runner, forest, skip: calls.append(("kv", forest, skip)))
    runner = _runner()
    runner.device = SimpleNamespace(type="cpu")
    forest = runner._bole_forest = SimpleNamespace(accepted_paths=[[0, 2]], accepted_device=None, kv_compacted=False)
    runner._update_states_after_model_execute(SimpleNamespace(device=SimpleNamespace(type="cpu")), None)
    assert calls == [] and runner.bole_commit.pending is forest and runner.vllm_updates == 1
    runner._bole_forest = None
    out = runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert out[0] == "executed" and calls == [("state", forest), ("kv", forest, ("mtp.attn",))]
    runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert len(calls) == 2 and runner.bole_commit.pending is None
    # A step whose drafting before the walk moved every layer's K/V and then failed: the state only (a second
    # move of the same path would read slots the first one overwrote).
    moved = runner._bole_forest = SimpleNamespace(accepted_paths=[[0, 2]], accepted_device=None, kv_compacted=True)
    runner._update_states_after_model_execute(SimpleNamespace(device=SimpleNamespace(type="cpu")), None)
    runner._bole_forest = None
    runner.execute_model(SimpleNamespace(num_spec_tokens_to_schedule=0))
    assert calls[2:] == [("state", moved)] and runner.bole_commit.pending is None


@pytest.mark.parametrize("root_only,asynchronous", [
    (dict(prompt_logprobs=1), False), (dict(prompt_logprobs=1), True), (dict(min_tokens=4), True)])
def test_root_only_requests_carry_no_drafts(root_only, asynchronous):
    """A request whose next token comes from vLLM's sampler with its settings (prompt logprobs; under async
    scheduling min_tokens: its tree would not be walked past the root) drafts nothing, while its drafter K/V still
    catches up; the step's node budget goes to the other requests."""
    import numpy as np

    from vllm_bole.spec_decode.drafter import drafting
    from vllm_bole.spec_decode.queued_drafts import quotas_of

    runner = _runner()
    runner.use_async_spec_decode, runner.bole_drafting.host_emitted = asynchronous, {}
    runner.requests = {r: SimpleNamespace(sampling_params=SamplingParams(temperature=0.0, **extra),
                                          prompt_token_ids=[1, 2], output_token_ids=[3])
                       for r, extra in (("a", root_only), ("b", {}), ("c", {}))}
    runner.input_batch = SimpleNamespace(req_ids=["a", "b", "c"], num_computed_tokens_cpu=np.array([3, 3, 3]),
                                         token_ids_cpu=np.zeros((3, 8), dtype=np.int64))
    runner.discard_request_mask = SimpleNamespace(np=np.zeros(3, dtype=bool))
    runner.input_ids = SimpleNamespace(cpu=torch.tensor([3, 3, 3]))
    runner.bole_walk = SimpleNamespace(paths=None)   # (no tree walked last step)
    scheduled = SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1, "c": 1})
    step = runner.bole_drafting.step_of(scheduled, torch.tensor([[4], [5], [6]]), None, None)
    assert drafting(step.contexts) == [False, True, True]
    assert [fp[1] for fp in step.first_pass] == [[4], [5], [6]]          # every request's drafter K/V catches up
    assert quotas_of(drafting(step.contexts), per_request=8, budget=10) == [0, 5, 5]


class _NoHostTokens(torch.Tensor):
    """A device's sampled tokens as the host sees them: reading them would wait for the forward."""

    def tolist(self):
        raise AssertionError("the sampled tokens were read on the host")


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_step_without_trees_drafts_from_the_sampled_tokens_where_they_are(asynchronous):
    """After a step without trees (prefill chunks, plain decodes) a drafter that reads no host context gets the
    sampled tokens as a tensor (DraftStep.sampled) and a stand-in at the end of each first pass that ends in one:
    nothing waits for the forward. A prefill chunk that sampled nothing (discarded) ends in its prompt's next
    token, as before."""
    import numpy as np

    from vllm_bole.spec_decode.drafter import drafting

    runner = _runner()
    runner.bole_drafter.reads_contexts = False
    runner.use_async_spec_decode, runner.bole_drafting.host_emitted = asynchronous, {"a": [9]}
    runner.requests = {r: SimpleNamespace(sampling_params=SamplingParams(temperature=0.0),
                                          prompt_token_ids=[1, 2, 3, 4], output_token_ids=[])
                       for r in ("a", "b", "c")}
    prompt = np.array([[1, 2, 3, 4, 0, 0, 0, 0]] * 3)
    runner.input_batch = SimpleNamespace(req_ids=["a", "b", "c"], num_computed_tokens_cpu=np.array([0, 0, 3]),
                                         token_ids_cpu=prompt)
    # "b" is a partial prefill chunk (its sampled token is discarded), "a" a whole prompt, "c" its last token
    runner.discard_request_mask = SimpleNamespace(np=np.array([False, True, False]))
    runner.input_ids = SimpleNamespace(cpu=torch.tensor([1, 2, 3, 4, 1, 2, 4]))
    runner.bole_walk = SimpleNamespace(paths=None)
    scheduled = SimpleNamespace(num_scheduled_tokens={"a": 4, "b": 2, "c": 1})
    sampled = torch.tensor([[7], [8], [6]]).as_subclass(_NoHostTokens)
    step = runner.bole_drafting.step_of(scheduled, sampled, None, None)
    assert drafting(step.contexts) == [True, False, True]
    assert [fp[1] for fp in step.first_pass] == [[2, 3, 4, 0], [2, 3], [0]]
    assert [fp[0] for fp in step.first_pass] == [[0, 1, 2, 3], [4, 5], [6]]
    rows, tokens = step.sampled
    assert rows == [0, 2] and tokens.tolist.__func__ is _NoHostTokens.tolist
    assert torch.equal(tokens.as_subclass(torch.Tensor), torch.tensor([7, 8, 6]))
    # (the host saw no tokens of this step: a host drafter's placeholders stay for vLLM to fill)
    assert runner.bole_drafting.host_emitted == {}


def test_async_placeholders_in_a_context_become_the_emitted_tokens():
    """Under async scheduling vLLM's host output of a request ends in placeholders for the last step, as many as
    it might have emitted (1 + its drafts); a host drafter's context gets the tokens that step really emitted."""
    runner = _runner()
    runner.bole_drafting.host_emitted = {"a": [11, 12], "b": [13]}
    out_a = [1, 2, -1, -1, -1, -1]               # two emitted of four possible
    runner.bole_drafting.fill_placeholders("a", out_a)
    assert out_a == [1, 2, 11, 12]
    out_b, out_c, out_d = [3, -1], [4, -1, -1], [5, 6]
    runner.bole_drafting.fill_placeholders("b", out_b)
    runner.bole_drafting.fill_placeholders("c", out_c)   # no tokens on record (its last step drafted on the device)
    runner.bole_drafting.fill_placeholders("a", out_d)   # nothing to fill
    assert out_b == [3, 13] and out_c == [4, -1, -1] and out_d == [5, 6]
