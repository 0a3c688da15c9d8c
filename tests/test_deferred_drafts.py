"""Drafts finish when vLLM takes them (worker/model_runner.py): ``propose_draft_token_ids`` only queues the
drafter's work; ``take_draft_token_ids`` (after vLLM's output processing) or, failing that, the next
``execute_model`` waits for it and turns it into the step's trees and draft token ids, once."""

from types import SimpleNamespace

from vllm_bole.spec_decode.drafter import DraftStep, TreeDrafter
from vllm_bole.spec_decode.tree import DraftTree
from vllm_bole.worker.model_runner import BoleModelRunnerMixin


class _Base:
    """What the mixin calls of vLLM's runner here."""

    def take_draft_token_ids(self):
        return ("taken", self._draft_token_ids)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        return ("executed", dict(self._bole_trees))


class _Runner(BoleModelRunnerMixin, _Base):
    pass


def _runner():
    runner = _Runner.__new__(_Runner)
    runner._bole_pending, runner._bole_profiler, runner._bole_forest = None, None, None
    runner._bole_trees, runner._draft_token_ids, runner._bole_last_nodes = {}, None, 0
    runner.bole_drafter = SimpleNamespace(selects=True)
    return runner


def _pending(runner, calls):
    step = DraftStep(req_ids=["a", "b"], contexts=[[1], [2]])

    def finish():
        calls.append(1)
        return [DraftTree([5, 6], [-1, 0], [0.9, 0.8]), DraftTree([7], [-1], [0.5])]

    runner._bole_pending = (step, finish)


def test_take_finishes_the_pending_drafts_once():
    runner, calls = _runner(), []
    _pending(runner, calls)
    assert calls == []                                        # queued, not waited for
    assert runner.take_draft_token_ids() == ("taken", [[5, 6], [7]])
    assert calls == [1] and runner._bole_pending is None
    assert runner._bole_trees["a"].tokens == [5, 6] and runner._bole_trees["b"].tokens == [7]
    assert runner.take_draft_token_ids() == ("taken", [[5, 6], [7]]) and calls == [1]


def test_the_next_step_finishes_drafts_nobody_took():
    runner, calls = _runner(), []
    _pending(runner, calls)
    out = runner.execute_model(SimpleNamespace())
    assert calls == [1] and out[0] == "executed" and sorted(out[1]) == ["a", "b"]


def test_unselected_drafters_are_cut_by_the_step_budget():
    runner, calls = _runner(), []
    runner.bole_drafter = SimpleNamespace(selects=False)
    _pending(runner, calls)
    step, finish = runner._bole_pending
    step.per_request, step.budget = 5, 2                      # two nodes over the batch
    runner.take_draft_token_ids()
    assert [len(t) for t in runner._bole_trees.values()] == [2, 0]


def test_default_deferred_proposal_is_the_proposal():
    class Fixed(TreeDrafter):
        def propose(self, step):
            return [DraftTree([3], [-1], [1.0])]

    finish = Fixed(None, None).propose_deferred(DraftStep(req_ids=["a"], contexts=[[1]]))
    assert [t.tokens for t in finish()] == [[3]]
