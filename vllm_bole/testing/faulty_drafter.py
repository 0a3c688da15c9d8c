"""An MTP tree drafter whose drafting before the walk fails once (``drafter_args``: ``{"fail_at": n}``, the n-th
such step): tests that the runner then drafts that step after the walk, and every later one too, losslessly."""

from ..spec_decode.mtp_tree_drafter import MTPTreeDrafter


class FailOnceBeforeWalk(MTPTreeDrafter):
    def __init__(self, runner, bole_config):
        super().__init__(runner, bole_config)
        self.fail_at = int(bole_config.drafter_args.get("fail_at", 3))
        self.calls = 0

    def propose_from_walk(self, *args, **kwargs):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("a planned failure of the drafting before the walk")
        return super().propose_from_walk(*args, **kwargs)
