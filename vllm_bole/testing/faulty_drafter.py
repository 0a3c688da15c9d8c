"""An MTP tree drafter whose drafting before the walk fails once (``drafter_args``: ``{"fail_at": n}``, the n-th
such step; with ``"mixed": true``, the n-th such step whose trees run beside prefill chunks): tests that the runner
then drafts that step after the walk, and every later one too (of that kind), losslessly. Steps of the start-up
warm-up (GPU engines) do not count: a failure there would leave the tested requests nothing to fall back from."""

from ..spec_decode.mtp_tree_drafter import MTPTreeDrafter
from ..worker.warmup import REQUEST_PREFIX


class FailOnceBeforeWalk(MTPTreeDrafter):
    def __init__(self, runner, bole_config):
        super().__init__(runner, bole_config)
        self.fail_at = int(bole_config.drafter_args.get("fail_at", 3))
        self.mixed_only = bool(bole_config.drafter_args.get("mixed", False))
        self.calls = 0

    def propose_from_walk(self, *args, **kwargs):
        forest = self.runner._bole_forest
        warmup = any(r.startswith(REQUEST_PREFIX) for r in forest.req_ids)
        if not warmup and (not self.mixed_only or not forest.tree_only):
            self.calls += 1
            if self.calls == self.fail_at:
                raise RuntimeError("a planned failure of the drafting before the walk")
        return super().propose_from_walk(*args, **kwargs)
