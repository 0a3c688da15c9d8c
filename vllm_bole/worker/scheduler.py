"""Bole's scheduler: vLLM's V1 scheduler with draft-placeholder padding turned off.

vLLM pads newly resumed decode requests with ``num_speculative_tokens`` placeholder drafts so chain batches
stay uniform for CUDA graphs; Bole's trees vary in size per request, so it schedules only real drafts. The
accepted-token bookkeeping (``num_computed_tokens -= drafts - accepted``) already holds for trees: the accepted
path is moved to contiguous KV slots before the next step.
"""

from vllm.v1.core.sched.scheduler import Scheduler


class BoleScheduler(Scheduler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # A constant per-batch-size schedule disables placeholder padding without changing how many draft
        # tokens a request may carry.
        self.dynamic_sd_lookup = [self.num_spec_tokens] * (self.scheduler_config.max_num_seqs + 1)
