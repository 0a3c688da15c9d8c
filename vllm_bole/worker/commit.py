"""The last stage of a Bole step: the commit of the accepted paths.

A verified forest leaves a GDN state, conv window and K/V behind for every node it verified; the next verification
reads the accepted path's only, as the request's running state and at contiguous slots. The commit writes them
(``attention.gdn.commit_step``, ``kv_compaction.compact_accepted_kv``). It is queued behind the drafter's levels,
so that its host work overlaps them on the device, and runs before the next forward at the latest. The early path
(``worker/early_drafting.py``) commits on the device before the walk instead.
"""

import torch

from ..attention.gdn import commit_step
from ..spec_decode.queued_drafts import PLACEHOLDER
from ..step.forest import StepForest
from .kv_compaction import compact_accepted_kv
from .step_profile import profiled


class Committer:
    """Commits the accepted paths of the model runner ``runner``'s verified forests. ``pending``: a verified forest
    whose accepted paths await their commit (at most one: the next step's forward commits it first)."""

    def __init__(self, runner):
        self.runner = runner
        self.pending: StepForest | None = None

    def after_walk(self, forest: StepForest | None, early_draft) -> None:
        """Queues the commit of ``forest``'s accepted paths, unless the early path committed them before the walk;
        where the drafter's first pass wrote its K/V at every node's slot (``early_draft``) and its levels are
        still to run, the drafter's own layers' K/V moves now (its levels read the accepted path's at contiguous
        slots, and the commit leaves those layers out)."""
        if forest is None or forest.accepted_paths is None:
            return
        if forest.accepted_device is None:   # (else committed before the walk: early_drafting)
            self.pending = forest
        if early_draft is not None and early_draft.rows is not None and not early_draft.drafted:
            compact_accepted_kv(self.runner, forest, only=self.runner.bole_drafter.own_kv_layers())

    def run(self) -> None:
        """The accepted paths' GDN state, conv windows and K/V of the pending forest, if any. The drafter's own
        attention layers are left out while it rewrites their K/V at every committed position in its catch-up
        (MTP): moved after its levels ran, they would overwrite what the levels wrote."""
        forest, self.pending = self.pending, None
        if forest is None:
            return
        runner = self.runner
        with profiled(runner._bole_profiler, "commit"):
            commit_step(forest)
            if not forest.kv_compacted:   # (drafting before the walk moved every layer's before it failed)
                drafter = runner.bole_drafter
                compact_accepted_kv(runner, forest, skip=drafter.own_kv_layers() if drafter else ())

    def accepted_counts(self, output_token_ids: torch.Tensor) -> None:
        """vLLM's accepted-token counts for hybrid models (what its GDN metadata reads next step), from host
        tokens: no device round trip; with prefix caching, what its state-block preprocess reads."""
        runner = self.runner
        if not runner.speculative_config or not runner.model_config.is_hybrid:
            return
        num_reqs = output_token_ids.size(0)
        if runner.cache_config.mamba_cache_mode == "align":
            # Prefix caching: the commit wrote the accepted state into the running block and the state of a block
            # boundary the path reached into the boundary's block (commit_step), where vLLM's postprocess copies
            # a chain's per-token states. A count of 1 makes its next preprocess move the running state as is.
            counts = torch.ones(num_reqs, dtype=torch.int32)
        else:
            counts = (output_token_ids != PLACEHOLDER).sum(dim=1, dtype=torch.int32)
        runner.num_accepted_tokens.cpu[:num_reqs] = counts
        runner.num_accepted_tokens.copy_to_gpu(num_reqs)
        runner.input_batch.num_accepted_tokens_cpu_tensor[:num_reqs] = counts
        runner.num_accepted_tokens_event.record()
