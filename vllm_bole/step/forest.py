"""The packed forest of the engine step being run, shared by the runner, the GDN layers and attention.

vLLM's forward context carries only per-layer attention metadata; the tree topology, positions and the GDN
factors a step produces live here, set by the runner around each forward and read by Bole's layers.
"""

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.utils.torch_utils import async_tensor_h2d


@dataclass
class TreeRows:
    """One request's tree rows in a forward: the query rows ``[row_start, row_start + n_rows)`` see the whole
    committed prefix plus the last ``region_mask.shape[1]`` key positions that their mask row marks. The rows
    are the region's last ``n_rows`` positions (a verified tree: all of it; the MTP drafter: the new level)."""

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
class DeviceTreeRows:
    """The tree rows of one forward on the device, built once and shared by every attention layer (layout in
    ``kernels/tree_attention/triton_tree_attn.py``)."""

    meta: torch.Tensor   # [R, 5] int32 per tree request: batch index, first query row, rows, region length,
    #                      first row of bits
    bits: torch.Tensor   # [rows of all tree requests, words] int32: bit j of a row = it sees region key j
    num_rows: int
    max_rows: int
    _prefix: tuple = field(default=(None, None), repr=False)

    @classmethod
    def pack(cls, tree_rows: list["TreeRows"], device, words: int = 1) -> "DeviceTreeRows":
        """One host-to-device copy for all requests' rows (bit rows of at least ``words`` words)."""
        shapes = [tuple(rows.region_mask.shape) for rows in tree_rows]
        total = sum(n for n, _ in shapes)
        words = max([-(-t // 32) for _, t in shapes] + [words])
        visible = np.zeros((total, 32 * words), dtype=bool)
        meta = np.zeros((len(tree_rows), 5), dtype=np.int32)
        first = 0
        for i, (rows, (n, t)) in enumerate(zip(tree_rows, shapes)):
            visible[first:first + n, :t] = rows.region_mask.cpu().numpy()
            meta[i] = (rows.req_index, rows.row_start, n, t, first)
            first += n
        bits = np.packbits(visible, axis=1, bitorder="little").view("<i4")       # bit j -> word j // 32
        flat = torch.from_numpy(np.concatenate([meta.ravel(), bits.ravel()]).astype(np.int32))
        flat = flat.to(device, non_blocking=True)
        return cls(meta=flat[:meta.size].view(-1, 5), bits=flat[meta.size:].view(total, words), num_rows=total,
                   max_rows=max([n for n, _ in shapes] + [0]))

    @classmethod
    def of_verified_forest(cls, forest: "StepForest") -> "DeviceTreeRows":
        """Rows of a forest whose request ``i`` is batch request ``i`` and whose rows are all its tree nodes,
        built on the device (inside a CUDA graph; no host data): the region of each tree is the tree, and its
        bits are the forest's ancestor bits."""
        return cls(meta=cls.verified_meta(forest.cu_seqlens), bits=forest.device_bits(), num_rows=forest.parent.numel(),
                   max_rows=forest.max_nodes)

    @classmethod
    def of_forest_rows(cls, forest: "StepForest") -> "DeviceTreeRows":
        """Rows of a forest whose trees sit anywhere among the step's token rows (beside prefill chunks), from the
        host's sizes and first rows and the forest's ancestor bits: nothing waits for trees still drafted on the
        device (``StepForest.materialize``)."""
        starts = np.cumsum([0] + forest.sizes[:-1]).tolist()
        meta = [(r, row, n, n, first) for r, row, n, first
                in zip(forest.tree_req_indices, forest.query_starts, forest.sizes, starts)]
        bits = forest.device_bits()
        meta = async_tensor_h2d(meta, bits.device, torch.int32).view(-1, 5)
        return cls(meta=meta, bits=bits, num_rows=sum(forest.sizes), max_rows=max(forest.sizes))

    @staticmethod
    def verified_meta(cu_seqlens: torch.Tensor) -> torch.Tensor:
        """``meta`` of trees whose tree ``i`` is batch request ``i`` with rows ``cu[i]:cu[i+1]``, each tree its own
        region (on ``cu_seqlens``' device)."""
        starts, sizes = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        index = torch.arange(sizes.numel(), dtype=torch.int32, device=cu_seqlens.device)
        return torch.stack([index, starts, sizes, sizes, starts], dim=1).contiguous()

    def prefix_lens(self, seq_lens: torch.Tensor) -> torch.Tensor:
        """``[B]`` committed prefix length of every batch request (0 without a tree, so FlashAttention's prefix
        pass skips it); computed once per ``seq_lens`` tensor (the layers of a KV-cache group share it)."""
        if self._prefix[0] is not seq_lens:
            req = self.meta[:, 0].long()
            prefix = torch.zeros_like(seq_lens)
            prefix[req] = seq_lens[req] - self.meta[:, 3]
            self._prefix = (seq_lens, prefix)
        return self._prefix[1]


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
    sizes: list[int] = field(default_factory=list)   # per tree request, its nodes (host; empty: unknown)
    # None: the verified trees' rows, built from the forest on first use (:meth:`rows`); a graph-mode forward
    # builds them on the device instead and never needs the host ones
    attention_rows: list[TreeRows] | None = field(default_factory=list)
    # The GDN layers' step-wide buffers (factors, conv inputs, slots; see attention/gdn.py) for the commit
    gdn_scratch: object = None
    accepted_paths: list[list[int]] | None = None  # per tree request, accepted local nodes, root first
    accepted_device: torch.Tensor | None = None    # per tree request, its deepest accepted node (a device walk)
    accepted_rows_device: torch.Tensor | None = None   # [B, W] the device walk's paths, flat rows root first
    kv_compacted: bool = False           # every attention layer's accepted K/V moved already (early_drafting)
    depth_bound: int = 0                 # no node of the step lies deeper (host bound; roots at depth 0)
    # per tree request: row of its first node (the root) in the step's flat token arrays
    query_starts: list[int] = field(default_factory=list)
    # every scheduled token of the step is a tree node or a plain decode (no prefill beside the trees)
    tree_only: bool = False
    # (batch index, request id, row) of the step's decodes without drafts; they run vLLM's own decode path,
    # unless a full CUDA graph runs the step (:meth:`promote_plain_decodes`)
    plain_decodes: list = field(default_factory=list)
    max_seq_len: int = 0                 # longest sequence of the step, this step's tokens included
    # [max batch] the runner's host computed counts by batch index (vLLM's persistent tensor, not a copy: under
    # async scheduling with prefix caching vLLM corrects it in place by the last step's rejected drafts before it
    # builds the step's metadata, where the block checkpoints read it: attention/gdn_metadata.py)
    computed_cpu: torch.Tensor | None = None
    # set while the forward runs from (or is captured into) a full CUDA graph: worker/verify_graphs.py
    graph: object = None
    # Trees whose nodes the step read from queued drafts on the device have None in ``tokens`` and
    # ``tree_parents`` until ``on_host(forest)`` fills them in (:meth:`materialize`; the walk calls it).
    on_host: object = None

    _device_rows: DeviceTreeRows | None = field(default=None, init=False, repr=False)
    _bits: torch.Tensor | None = field(default=None, init=False, repr=False)

    def materialize(self) -> None:
        """The host copy of every tree (``tokens``, ``tree_parents``), if some are still only on the device."""
        if self.on_host is not None:
            fill, self.on_host = self.on_host, None
            fill(self)

    def device_rows(self, device) -> DeviceTreeRows:
        """``attention_rows`` on ``device``, built on first use and shared by every attention layer (in graph
        mode from the device forest, since nothing may come from the host inside a graph)."""
        if self._device_rows is None:
            if self.graph is not None:
                self._device_rows = DeviceTreeRows.of_verified_forest(self)
            elif self.sizes and self.device_bits() is not None:   # eager, beside prefill chunks
                self._device_rows = DeviceTreeRows.of_forest_rows(self)
            else:
                self._device_rows = DeviceTreeRows.pack(self.rows(), device)
        return self._device_rows

    @property
    def has_tree_rows(self) -> bool:
        """Whether attention layers have tree rows to run: host rows, or rows already on the device (the MTP
        drafter's device-grown levels give only those)."""
        if self.attention_rows is None:
            return bool(self.tree_req_indices)
        return bool(self.attention_rows) or self._device_rows is not None

    def rows(self) -> list[TreeRows]:
        """The host tree rows (``attention_rows``), built from the trees on first use."""
        if self.attention_rows is None:
            self.materialize()
            masks = ancestor_masks([self.parents_of(i) for i in range(len(self.tree_req_indices))])
            self.attention_rows = [TreeRows(req_index=r, row_start=self.query_starts[i], region_mask=m)
                                   for i, (r, m) in enumerate(zip(self.tree_req_indices, masks))]
        return self.attention_rows

    def device_bits(self) -> torch.Tensor | None:
        """The forest's ancestor bitmask (:func:`kernels.tree_gdn.triton_verify.ancestor_bits`), built once for
        all layers; None on CPU, where the references need none."""
        if self._bits is None and self.parent.is_cuda and self.max_nodes:
            from ..kernels.tree_gdn.triton_verify import ancestor_bits

            self._bits = ancestor_bits(self.parent, self.cu_seqlens, self.max_nodes)
        return self._bits

    @property
    def num_trees(self) -> int:
        """Trees once the plain decodes are one-node trees."""
        return len(self.tree_req_indices) + len(self.plain_decodes)

    def promote_plain_decodes(self, forest_tensors) -> None:
        """Make each plain decode a one-node tree (its root: the same computation as a decode), in batch
        order, so that a graph sees only trees; ``forest_tensors(parents, cu_seqlens)`` places the device
        forest. The walk then verifies the root alone and the commit writes the state after it."""
        if not self.plain_decodes:
            return
        self.materialize()
        trees = list(zip(self.tree_req_indices, self.req_ids, self.tokens, self.tree_parents, self.query_starts))
        trees += [(r, req_id, [-1], [-1], row) for r, req_id, row in self.plain_decodes]
        trees.sort(key=lambda t: t[0])
        self.tree_req_indices, self.req_ids, self.tokens, self.tree_parents, self.query_starts = (
            list(column) for column in zip(*trees))
        self.parent, self.cu_seqlens = forest_tensors(*flat_forest(self.tree_parents))
        self.max_nodes = max(len(p) for p in self.tree_parents)
        self.sizes = [len(p) for p in self.tree_parents]
        self.plain_decodes = []
        self.reset_device_cache()
        self.attention_rows = None   # rebuilt on use: the graph that runs a promoted forest needs none

    def reset_device_cache(self) -> None:
        """Forget the device rows and bits (a graph capture must build its own, inside the graph)."""
        self._device_rows = None
        self._bits = None

    @property
    def accepted(self) -> list[int] | None:
        """Per tree request, local index of its deepest accepted node."""
        return None if self.accepted_paths is None else [p[-1] for p in self.accepted_paths]

    def parents_of(self, i: int) -> list[int]:
        self.materialize()
        if self.tree_parents:
            return self.tree_parents[i]
        s, e = int(self.cu_seqlens[i]), int(self.cu_seqlens[i + 1])
        return self.parent[s:e].tolist()


def flat_forest(tree_parents: list[list[int]]) -> tuple[list[int], list[int]]:
    """(every tree's local parents in one list, cu_seqlens) of a packed forest."""
    return [p for par in tree_parents for p in par], np.cumsum([0] + [len(p) for p in tree_parents]).tolist()


def ancestor_masks(tree_parents: list[list[int]]) -> list[torch.Tensor]:
    """Every tree's ``[T, T]`` ``kernels.forest.ancestor_mask``, for all trees at once: pointer jumping over the whole
    forest (log2 T array steps instead of a step per node)."""
    sizes = [len(p) for p in tree_parents]
    if not sizes:
        return []
    n, t_max = sum(sizes), max(sizes)
    starts = np.cumsum([0] + sizes[:-1])
    par = np.concatenate([np.asarray(p, dtype=np.int64) for p in tree_parents])
    jump = np.where(par >= 0, par + np.repeat(starts, sizes), -1)     # forest index of the parent
    seen = np.zeros((n, t_max), dtype=bool)
    seen[np.arange(n), np.concatenate([np.arange(t) for t in sizes])] = True
    # After step s, seen[i] holds i's ancestors closer than 2^s and jump[i] is its 2^s-th one.
    for _ in range(t_max.bit_length()):
        has = jump >= 0
        seen[has] |= seen[jump[has]]
        jump = np.where(has, jump[np.maximum(jump, 0)], -1)
    return [torch.from_numpy(seen[s:s + t, :t]) for s, t in zip(starts.tolist(), sizes)]


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
