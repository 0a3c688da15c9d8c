"""GDN attention metadata built once per step instead of once per KV-cache group.

A hybrid model's GDN layers sit in several KV-cache groups (three on Qwen3.5-9B), and vLLM's GDN builder runs for
each, although the groups' metadata differ only in the state slots read from their block tables. vLLM builds a
group's metadata from an earlier group's through ``update_block_table`` where a builder supports it; vLLM's GDN
builder does not. This one does, when a state slot is column 0 of the block table (``mamba_cache_mode`` "none",
which Bole requires) and no full CUDA graph reads the builder's own persistent buffers (Bole runs vLLM's
piecewise graphs).
"""

import dataclasses

import torch
from vllm.v1.attention.backends.gdn_attn import (GDNAttentionBackend, GDNAttentionMetadata,
                                                 GDNAttentionMetadataBuilder)

from ..step.forest import current_forest


@dataclasses.dataclass
class BlockCheckpoints:
    """Per tree request of a step: the accepted-path length (root first) whose GDN state is a block boundary's,
    0 for none; and the state slot of that boundary's block (vLLM's null block, 0, where it holds none)."""

    path_lengths: list[int]
    slots: torch.Tensor   # [tree requests] int32, device
    req_indices: list[int]   # batch index of each tree request

    def over(self, req_indices: list[int]) -> "BlockCheckpoints":
        """The same checkpoints over the requests ``req_indices`` (batch indices, e.g. a verification graph's
        forest, where plain decodes are one-node trees): none (length 0, null block) for a request without one."""
        if req_indices == self.req_indices:
            return self
        row = {r: i for i, r in enumerate(self.req_indices)}
        picked = [row.get(r, len(self.req_indices)) for r in req_indices]
        padded = torch.cat([self.slots, self.slots.new_zeros(1)])
        lengths = self.path_lengths + [0]
        return BlockCheckpoints(path_lengths=[lengths[i] for i in picked],
                                slots=padded[torch.tensor(picked, device=padded.device)], req_indices=list(req_indices))


class BoleGDNMetadataBuilder(GDNAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.supports_update_block_table = (not self.use_full_cuda_graph
                                            and vllm_config.cache_config.mamba_cache_mode == "none")

    def build(self, common_prefix_len, common_attn_metadata, num_accepted_tokens=None,
              num_decode_draft_tokens_cpu=None, fast_build=False) -> GDNAttentionMetadata:
        meta = super().build(common_prefix_len, common_attn_metadata, num_accepted_tokens=num_accepted_tokens,
                             num_decode_draft_tokens_cpu=num_decode_draft_tokens_cpu, fast_build=fast_build)
        # The host mask vLLM's build selected the spec decodes' rows with: the other groups select theirs with it
        # (a device mask would need a sync).
        meta.bole_spec_mask_cpu = (num_decode_draft_tokens_cpu >= 0 if meta.spec_sequence_masks is not None
                                   else None)
        meta.bole_checkpoints = None
        if self.vllm_config.cache_config.mamba_cache_mode == "align" and meta.bole_spec_mask_cpu is not None:
            meta.bole_checkpoints = self._checkpoints(common_attn_metadata, meta.bole_spec_mask_cpu)
        return meta

    def _checkpoints(self, cm, spec_mask_cpu: torch.Tensor) -> "BlockCheckpoints":
        """Prefix caching ("align"): where each tree request's commit writes the state at the first block boundary
        after its computed tokens, if its accepted path reaches it. That block (column ``c // block_size``) is
        published for the prefix cache once the computed tokens pass the boundary, and it holds the running state
        of an earlier step until then; the step's own running block (column ``(seq_len - 1) // block_size``) gets
        the final state. A boundary inside the running block cannot be reached by the accepted path."""
        rows = torch.nonzero(spec_mask_cpu, as_tuple=True)[0]
        bs = self.kv_cache_spec.block_size
        # The runner's host counts (StepForest.computed_cpu): under async scheduling vLLM's host sequence lengths
        # assume that every draft of the last step was accepted, and the metadata's host counts would be a copy
        # of the device's, which waits for the device; vLLM corrects the runner's before it builds the metadata.
        forest = current_forest()
        if forest is not None and forest.computed_cpu is not None:
            computed = forest.computed_cpu[rows]
        else:
            computed = cm.num_computed_tokens_cpu[rows]
        column = computed // bs
        query_lens = cm.query_start_loc_cpu[rows + 1] - cm.query_start_loc_cpu[rows]
        running = (computed + query_lens - 1) // bs
        # path length (root first) whose state is the boundary's; 0: no boundary before the running block
        lengths = torch.where(column < running, (column + 1) * bs - computed, 0)
        slots = cm.block_table_tensor[rows.to(cm.block_table_tensor.device), column.to(cm.block_table_tensor.device)]
        return BlockCheckpoints(path_lengths=lengths.tolist(), slots=slots.to(torch.int32), req_indices=rows.tolist())

    def update_block_table(self, metadata: GDNAttentionMetadata, blk_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> GDNAttentionMetadata:
        """``metadata`` (another group's, from :meth:`build`) with this group's state slots: the block-table
        reads of vLLM's build, and nothing else, redone on ``blk_table``."""
        mask = getattr(metadata, "bole_spec_mask_cpu", None)
        spec = non_spec = prefill = None
        if mask is None:   # no spec decodes: every request reads column 0
            non_spec = blk_table[:, 0]
            if metadata.num_prefills > 0:
                prefill = non_spec[metadata.num_decodes:] if metadata.num_decodes > 0 else non_spec
        else:
            spec = blk_table[mask, :self.num_spec + 1]
            if metadata.num_prefills > 0 or metadata.num_decodes > 0:
                non_spec = blk_table[~mask, 0]
                if metadata.num_prefills > 0:   # (vLLM files plain decodes beside spec decodes as prefills)
                    prefill = non_spec
        return dataclasses.replace(metadata, spec_state_indices_tensor=spec, non_spec_state_indices_tensor=non_spec,
                                   prefill_state_indices=prefill)


class BoleGDNAttentionBackend(GDNAttentionBackend):
    @staticmethod
    def get_builder_cls() -> type[BoleGDNMetadataBuilder]:
        return BoleGDNMetadataBuilder
