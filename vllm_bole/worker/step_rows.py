"""Where each request of an early-drafted step sits in the step's rows.

A step's forward has a token row per scheduled token; its logits have a row per tree node and one per other request
(the last token of a prefill chunk); the verification forest numbers the tree nodes alone. In a step of trees only
the three orders are one. In a step whose trees run beside prefill chunks (a mixed step) they differ, and early
drafting (``worker/early_drafting.py``) reads the walk's inputs by node and writes the drafter's by token row through
the index tensors here, made on the host with one copy to the device.
"""

from dataclasses import dataclass

import numpy as np
import torch
from vllm.utils.torch_utils import async_tensor_h2d

from ..spec_decode.device_walk import DeviceWalk


@dataclass
class StepRows:
    """Rows of a step whose every request is a tree or a prefill chunk. ``sizes``: per batch request, its scheduled
    tokens; ``logit_starts``: per batch request, its first logits row (and the total at the end); ``chunks``: batch
    indices of the prefill chunks; ``drafts``: per batch request, whether it drafts after this step (a chunk only if
    it completes its prompt). The device tensors are None in a step of trees only."""

    sizes: list[int]
    logit_starts: list[int]
    chunks: list[int]
    drafts: list[bool]
    node_tokens: torch.Tensor | None = None    # [N] token row of each forest node
    node_logits: torch.Tensor | None = None    # [N] logits row of each forest node
    tree_starts: torch.Tensor | None = None    # [T] int32 token row of each tree's root
    tree_shift: torch.Tensor | None = None     # [T] a tree's token rows minus its node rows
    tree_reqs: torch.Tensor | None = None      # [T] batch index of each tree
    chunk_reqs: torch.Tensor | None = None     # [C] batch index of each chunk
    chunk_last: torch.Tensor | None = None     # [C] token row of each chunk's last token
    chunk_logits: torch.Tensor | None = None   # [C] logits row of each chunk
    chunk_next: torch.Tensor | None = None     # [C] the prompt's next token after a partial chunk; -1: it completes
    grown_from: torch.Tensor | None = None     # the token rows a next tree may grow from: tree nodes, chunk ends

    @property
    def tree_only(self) -> bool:
        return not self.chunks

    @classmethod
    def of(cls, runner, forest, scheduler_output) -> "StepRows | None":
        """The rows of the runner's step, or None where a request is a decode without drafts. Every request beside
        the trees runs a chunk of tokens (a prompt's, or a preempted request's recomputed ones) with one logits row."""
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        if forest.plain_decodes or not forest.tree_req_indices:
            return None
        counts = [scheduler_output.num_scheduled_tokens[r] for r in batch.req_ids]
        if forest.tree_only:
            if forest.tree_req_indices != list(range(num_reqs)):
                return None
            return cls(sizes=counts, logit_starts=forest.query_starts + [scheduler_output.total_num_scheduled_tokens],
                       chunks=[], drafts=[True] * num_reqs)
        tree_of = dict(zip(forest.tree_req_indices, range(len(forest.tree_req_indices))))
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        sizes = [counts[r] for r in forest.tree_req_indices]
        token_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        logit_rows = [sizes[tree_of[r]] if r in tree_of else 1 for r in range(num_reqs)]
        logit_start = np.concatenate([[0], np.cumsum(logit_rows)]).astype(np.int64)
        chunks = [r for r in range(num_reqs) if r not in tree_of]
        # A chunk whose sample vLLM discards (it stops short of the request's tokens) is followed by a known token.
        discard = runner.discard_request_mask.np
        chunk_next = [int(batch.token_ids_cpu[r, int(computed[r]) + counts[r]]) if discard[r] else -1 for r in chunks]
        trees = forest.tree_req_indices
        node_tokens = np.concatenate([token_start[r] + np.arange(sizes[i]) for i, r in enumerate(trees)])
        node_logits = np.concatenate([logit_start[r] + np.arange(sizes[i]) for i, r in enumerate(trees)])
        tree_arr = np.asarray(trees, dtype=np.int64)
        tree_starts = token_start[tree_arr]
        tree_shift = tree_starts - np.concatenate([[0], np.cumsum(sizes)[:-1]])
        chunk_arr = np.asarray(chunks, dtype=np.int64)
        chunk_last = token_start[chunk_arr + 1] - 1
        parts = [node_tokens, node_logits, tree_starts, tree_shift, tree_arr, chunk_arr, chunk_last,
                 logit_start[chunk_arr], np.asarray(chunk_next, dtype=np.int64), node_tokens, chunk_last]
        flat = async_tensor_h2d(np.concatenate(parts).tolist(), runner.device, torch.long)
        views = torch.split(flat, [len(p) for p in parts[:-2]] + [len(node_tokens) + len(chunk_last)])
        return cls(sizes=counts, logit_starts=logit_start.tolist(), chunks=chunks,
                   drafts=[not discard[r] for r in range(num_reqs)],
                   node_tokens=views[0], node_logits=views[1], tree_shift=views[3],
                   # (int32, as a forest's offsets, which the compaction kernel reads in a step of trees only)
                   tree_starts=views[2].to(torch.int32),
                   tree_reqs=views[4], chunk_reqs=views[5], chunk_last=views[6], chunk_logits=views[7],
                   chunk_next=views[8], grown_from=views[9])

    def by_node(self, logit_values: torch.Tensor) -> torch.Tensor:
        """A per-logits-row tensor read at the forest's nodes."""
        return logit_values if self.tree_only else logit_values[self.node_logits]

    def node_input_tokens(self, input_ids: torch.Tensor, n: int) -> torch.Tensor:
        """Each forest node's token (``input_ids``: the step's token rows; ``n``: its forest's nodes)."""
        return input_ids[:n] if self.tree_only else input_ids[self.node_tokens]

    def chunk_tokens(self, after: torch.Tensor) -> torch.Tensor:
        """``[C]`` the token after each chunk's last row: its draw (``after``, by logits row) where the chunk
        completes its prompt, else the prompt's next token."""
        return torch.where(self.chunk_next >= 0, self.chunk_next, after[self.chunk_logits].long())

    def next_tokens(self, after: torch.Tensor, input_ids: torch.Tensor, n: int) -> torch.Tensor:
        """``[n]`` the token that follows each of the step's ``n`` token rows, the drafter's first-pass input: a
        tree node's target token (``after``), a chunk row's next prompt token, a chunk's last row's
        :meth:`chunk_tokens`."""
        if self.tree_only:
            return after
        out = torch.empty(n, dtype=torch.long, device=after.device)
        out[:n - 1] = input_ids[1:n]
        out[self.node_tokens] = after[self.node_logits].long()
        out[self.chunk_last] = self.chunk_tokens(after)
        return out

    def batch_walk(self, walk: DeviceWalk, after: torch.Tensor, num_reqs: int) -> tuple[DeviceWalk, DeviceWalk]:
        """(the trees' walk with its rows as token rows, the walk of every batch request: a tree's path, or a
        chunk's last row alone, emitting :meth:`chunk_tokens`). ``walk``: the forest's walk, rows by node. In a step
        of trees only, ``walk`` twice."""
        if self.tree_only:
            return walk, walk
        rows = torch.where(walk.rows >= 0, walk.rows + self.tree_shift[:, None], -1)
        trees = DeviceWalk(rows=rows, length=walk.length, deepest=walk.deepest, emitted=walk.emitted)
        width = walk.rows.shape[1]
        device = rows.device
        all_rows = torch.full((num_reqs, width), -1, dtype=rows.dtype, device=device)
        emitted = torch.full((num_reqs, width), -1, dtype=walk.emitted.dtype, device=device)
        length = torch.ones(num_reqs, dtype=walk.length.dtype, device=device)
        deepest = torch.zeros(num_reqs, dtype=walk.deepest.dtype, device=device)
        all_rows[self.tree_reqs] = rows
        emitted[self.tree_reqs] = walk.emitted
        length[self.tree_reqs] = walk.length
        deepest[self.tree_reqs] = walk.deepest
        all_rows[self.chunk_reqs, 0] = self.chunk_last
        emitted[self.chunk_reqs, 0] = self.chunk_tokens(after).to(emitted.dtype)
        return trees, DeviceWalk(rows=all_rows, length=length, deepest=deepest, emitted=emitted)

