"""The packed forest of the engine step being run, shared by the runner, the GDN layers and attention.

vLLM's forward context carries only per-layer attention metadata; the tree topology, positions and the GDN
factors a step produces live here, set by the runner around each forward and read by Bole's layers.
"""

import contextlib
from dataclasses import dataclass, field

import torch

from ..kernels.forest import ancestor_mask


@dataclass
class TreeRows:
    """One request's tree rows in a forward: the query rows ``[row_start, row_start + n_rows)`` see the whole
    committed prefix plus the last ``region_mask.shape[1]`` key positions that their mask row marks."""

    req_index: int
    row_start: int
    region_mask: torch.Tensor  # [n_rows, T] bool

    def differs_from_causal(self) -> torch.Tensor:
        """``[n_rows]`` bool: rows whose visible set is not what a causal kernel already computed for them
        (the query rows are the last ``n_rows`` key positions)."""
        n, t = self.region_mask.shape
        causal = torch.ones(n, t, dtype=torch.bool).tril(diagonal=t - n)
        return (self.region_mask.bool() != causal).any(dim=1)


@dataclass
class StepForest:
    """A verification step's forest: request ``i`` of ``tree_req_indices`` owns nodes
    ``cu_seqlens[i]:cu_seqlens[i+1]`` (node 0 = the last sampled token, the root)."""

    req_ids: list[str]
    tree_req_indices: list[int]          # batch index of each tree request
    parent: torch.Tensor                 # [N] int32 local parent (-1 for the root)
    cu_seqlens: torch.Tensor             # [B+1] int32
    tokens: list[list[int]]              # per request, node tokens (root first)
    tree_parents: list[list[int]] = field(default_factory=list)  # per request, local parents (host copy)
    max_nodes: int = 0                   # largest tree of the step (host int: kernels need no sync for it)
    attention_rows: list[TreeRows] = field(default_factory=list)
    # The GDN layers' step-wide buffers (factors, conv inputs, slots; see attention/gdn.py) for the commit
    gdn_scratch: object = None
    accepted_paths: list[list[int]] | None = None  # per tree request, accepted local nodes, root first
    # per tree request: row of its first node (the root) in the step's flat token arrays
    query_starts: list[int] = field(default_factory=list)

    @property
    def accepted(self) -> list[int] | None:
        """Per tree request, local index of its deepest accepted node."""
        return None if self.accepted_paths is None else [p[-1] for p in self.accepted_paths]

    def parents_of(self, i: int) -> list[int]:
        if self.tree_parents:
            return self.tree_parents[i]
        s, e = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        return self.parent[s:e].tolist()

    def build_attention_rows(self) -> None:
        self.attention_rows = [
            TreeRows(req_index=r, row_start=self.query_starts[i],
                     region_mask=ancestor_mask(torch.tensor(self.parents_of(i), dtype=torch.int32)))
            for i, r in enumerate(self.tree_req_indices)
        ]


_current: StepForest | None = None


def current_forest() -> StepForest | None:
    return _current


def set_current_forest(forest: StepForest | None) -> None:
    """Publish the forest of the step being run (None between steps)."""
    global _current
    _current = forest


@contextlib.contextmanager
def forest_scope(forest: StepForest | None):
    """Make ``forest`` visible to Bole's layers for the duration of one forward."""
    previous = _current
    set_current_forest(forest)
    try:
        yield forest
    finally:
        set_current_forest(previous)
