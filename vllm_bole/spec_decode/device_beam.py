"""The MTP drafter's tree levels grown on the device: no copy to the host between levels.

Every growing request keeps a beam of ``topk`` frontier nodes. A level feeds the frontier through the MTP layer
(each query sees the committed prefix plus the MTP entries of its ancestors and itself), takes each query's
``topk`` children and keeps the ``topk`` best new nodes (cumulative score; ties to the earlier node) as the next
frontier: node for node the tree the host bookkeeping grows (``MTPTreeDrafter._grow_on_host``) when it prunes
nothing. What a level reads from the tree (tokens, hidden-state rows, ancestor bits) is gathered on the device;
the rest (positions, KV slots, lengths, row layout) follows from the beam's fixed shape and the roots' positions,
which the host knows. The step's selection (``tree.select_step``) runs on the device too, in a few stable sorts,
and only the kept nodes come to the host, once, after the last level.

Pruning: levels stop once no frontier node beats its request's selection floor (``tree.selection_floors``,
computed on the device; one scalar read per level, one level late so that it never drains the GPU queue).
Frontier nodes below their floor still expand within a level that runs; their children score no higher, so the
selection never keeps them.
"""

import numpy as np
import torch
from vllm.utils.math_utils import cdiv

from ..worker.forest_context import DeviceTreeRows, TreeRows
from .tree import DraftTree


def region_words(max_depth: int, topk: int) -> int:
    """Bit words of a drafter level's region (a request's queries so far, at most depth * topk keys), with the
    width of the drafter level graphs' bit buffer."""
    return cdiv(max_depth * topk + 1, 32)


def pack_bits(mask: torch.Tensor, words: int) -> torch.Tensor:
    """``[rows, cols]`` bool -> ``[rows, words]`` int32, column j at bit j % 32 of word j // 32 (the layout of
    ``DeviceTreeRows.bits``), on the mask's device."""
    rows, cols = mask.shape
    wide = torch.zeros(rows, words * 32, dtype=torch.int64, device=mask.device)
    wide[:, :cols] = mask
    weights = torch.ones(32, dtype=torch.int64, device=mask.device) << torch.arange(32, device=mask.device)
    packed = (wide.view(rows, words, 32) * weights).sum(dim=-1)        # < 2^32: the int32 bit pattern
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def selection_alive(scores: torch.Tensor, frontier_scores: torch.Tensor, per_request: int | None,
                    budget: int | None) -> torch.Tensor:
    """0-dim bool on the device: whether some request's frontier node beats its selection floor (the device twin
    of ``tree.selection_floors`` over ``[G, n]`` candidate scores, every request holding ``n``)."""
    g, n = scores.shape
    floor = torch.full((g,), -torch.inf, dtype=scores.dtype, device=scores.device)
    if per_request is not None:
        keep = max(min(per_request, n), 1)
        best = scores.topk(keep, dim=1).values                          # [G, keep], descending
        if n >= per_request:
            floor = best[:, -1]
        if budget is not None and best.numel() >= budget:
            cut = best.flatten().topk(budget).values[-1]
            floor = torch.maximum(floor, cut)
    return (frontier_scores > floor[:, None]).any()


def selected_mask(scores: torch.Tensor, depths: torch.Tensor, per_request: int | None,
                  budget: int | None) -> torch.Tensor:
    """``[G, n]`` bool: the nodes :func:`tree.select_step` keeps of ``G`` candidate trees with ``[G, n]`` scores
    and ``[n]`` depths (the same in every tree), on the scores' device: each request's ``per_request`` best by
    (score, shallower, lower index), then the ``budget`` best of those by (score, shallower, lower request, lower
    index); stable sorts, least significant key first."""
    g, n = scores.shape
    by_depth = torch.sort(depths, stable=True).indices
    order = by_depth[torch.sort(scores[:, by_depth], dim=1, descending=True, stable=True).indices]
    keep = order if per_request is None else order[:, :max(min(per_request, n), 0)]
    rows = torch.arange(g, device=scores.device)[:, None].expand_as(keep).reshape(-1)
    idx = keep.reshape(-1)
    perm = torch.argsort(idx, stable=True)
    perm = perm[torch.argsort(rows[perm], stable=True)]
    perm = perm[torch.argsort(depths[idx[perm]], stable=True)]
    perm = perm[torch.sort(scores[rows[perm], idx[perm]], descending=True, stable=True).indices]
    if budget is not None:
        perm = perm[:max(budget, 0)]
    chosen = torch.zeros(g, n, dtype=torch.bool, device=scores.device)
    chosen[rows[perm], idx[perm]] = True
    return chosen


def trees_of_selection(host: np.ndarray, g: int, n: int) -> list[DraftTree]:
    """The ``g`` trees of selected nodes given as ``[5, S]`` rows (request, node, token, parent node, score),
    sorted by request then node: parents re-indexed within each request's kept nodes."""
    r, i = host[0].astype(np.int64), host[1].astype(np.int64)
    counts = np.bincount(r, minlength=g)
    local = np.arange(len(r)) - np.repeat(np.cumsum(counts) - counts, counts)
    new_index = np.full((g, n), -1, dtype=np.int64)
    new_index[r, i] = local
    par = host[3].astype(np.int64)
    par = np.where(par >= 0, new_index[r, np.maximum(par, 0)], -1)
    tokens, scores = host[2].astype(np.int64), host[4]
    bounds = np.cumsum(counts)[:-1]
    return [DraftTree(t.tolist(), p.tolist(), s.tolist())
            for t, p, s in zip(np.split(tokens, bounds), np.split(par, bounds), np.split(scores, bounds))]


class DeviceBeam:
    def __init__(self, drafter):
        self.drafter = drafter
        cfg = drafter.bole_config
        self.k, self.max_depth = cfg.topk, cfg.max_depth
        self.words = region_words(self.max_depth, self.k)
        self._rates: torch.Tensor | None = None
        self.levels_run = 0   # expansion levels grown so far (all steps)

    def _child_probs(self, p: torch.Tensor, depth: int) -> torch.Tensor:
        """Scores of children at ``depth`` relative to their parent, rank order: the drafter's probabilities,
        or under synthetic acceptance the rates the walk accepts each rank with (``MTPTreeDrafter._child_scores``)."""
        synthetic = self.drafter.synthetic
        if synthetic is None:
            return p
        if self._rates is None:
            self._rates = torch.tensor([[synthetic.child_probability(d, r) for r in range(self.k)]
                                        for d in range(self.max_depth + 2)], dtype=torch.float64, device=p.device)
        return self._rates[depth].expand_as(p)

    def levels(self, per_request: int | None, budget: int | None) -> int:
        """Expansion levels after the root's children: none deeper than a kept tree can reach."""
        deepest = self.max_depth
        if per_request is not None:
            deepest = min(deepest, per_request)
        if budget is not None:
            deepest = min(deepest, budget)
        return max(deepest - 1, 0)

    def grow(self, step, cm, reqs: list[int], roots: list[int], hidden: torch.Tensor,
             top: torch.Tensor | None = None) -> list[DraftTree]:
        """The selected trees of batch requests ``reqs`` (root positions ``roots``); ``hidden`` ``[G, H]``: the
        MTP hidden state that predicts each root's children; ``top``: its top children, if already computed."""
        k, g, device = self.k, len(reqs), hidden.device
        if step.budget is not None and step.budget <= 0 or step.per_request is not None and step.per_request <= 0:
            return [DraftTree() for _ in reqs]
        levels = self.levels(step.per_request, step.budget)
        m = k + levels * k * k
        # Candidates: token ids, local parents (-1: the root) and cumulative scores, in float64: the products
        # (and so the ties) of the host bookkeeping, and one copy to the host for all three.
        tokens = torch.zeros(g, m, dtype=torch.float64, device=device)
        parents = torch.full((g, m), -1.0, dtype=torch.float64, device=device)
        scores = torch.zeros(g, m, dtype=torch.float64, device=device)
        depths = np.ones(m, dtype=np.int64)

        top = (top if top is not None else self.drafter._top_rows(hidden)).double()   # [G, 2k]
        p = self._child_probs(top[:, :k], 1)
        tokens[:, :k], scores[:, :k] = top[:, k:], p
        order = torch.sort(p, dim=1, descending=True, stable=True).indices   # [G, k]
        front = order
        front_tok, front_score = top[:, k:].gather(1, order), p.gather(1, order)
        front_row = torch.arange(g, device=device)[:, None].expand(g, k)    # row of ``prev`` per query
        front_slot = None                     # each frontier node's parent among the last level's queries
        prev, anc, n = hidden, None, k
        roots_np = np.asarray(roots, dtype=np.int64)
        cols = torch.arange(k, device=device)
        # flags[j]: whether a frontier node beat its floor once level j's nodes existed. Level d reads flags[d-2]
        # (no frontier node beat it after level d-2: level d-1's nodes and all deeper ones are below it, and
        # floors only rise), so the read waits for work the GPU finished while level d-1 was queued.
        check = step.per_request is not None
        flags = [self._flag(scores[:, :n], front_score, step)] if check else []
        for d in range(1, levels + 1):
            if check and d >= 2 and not self._read(flags[d - 2]):
                break
            # The level's queries see their parent query's region and themselves (key (d-1)k + j).
            if anc is None:
                anc = torch.zeros(g, k, self.max_depth * k, dtype=torch.bool, device=device)
            else:
                anc = anc.gather(1, front_slot[:, :, None].expand(-1, -1, anc.shape[2]))
            anc[:, cols, (d - 1) * k + cols] = True
            hid = prev[(front_row.reshape(-1)).long()]
            prev, top = self._run_level(cm, reqs, roots_np, d, front_tok.reshape(-1), hid, anc)
            self.levels_run += 1
            top = top.double()
            p = self._child_probs(top[:, :k], d + 1).reshape(g, k, k)
            child_tok = top[:, k:].reshape(g, k * k)
            child_score = (front_score[:, :, None] * p).reshape(g, k * k)
            tokens[:, n:n + k * k] = child_tok
            scores[:, n:n + k * k] = child_score
            parents[:, n:n + k * k] = front.double().repeat_interleave(k, dim=1)
            depths[n:n + k * k] = d + 1
            order = torch.sort(child_score, dim=1, descending=True, stable=True).indices[:, :k]
            front = n + order
            front_tok, front_score = child_tok.gather(1, order), child_score.gather(1, order)
            front_slot = order // k
            front_row = torch.arange(g, device=device)[:, None] * k + front_slot
            n += k * k
            if check:
                flags.append(self._flag(scores[:, :n], front_score, step))
        chosen = selected_mask(scores[:, :n], torch.from_numpy(depths[:n]).to(device), step.per_request,
                               step.budget)
        r, i = chosen.nonzero(as_tuple=True)       # by request, then node: parents before children
        host = torch.stack([r.double(), i.double(), tokens[r, i], parents[r, i], scores[r, i]]).cpu().numpy()
        return trees_of_selection(host, g, n)

    @staticmethod
    def host_rows(hidden: torch.Tensor) -> bool:
        """Whether the attention backend reads tree rows as host masks (CPU) rather than device bits (GPU)."""
        return hidden.device.type == "cpu"

    @staticmethod
    def _flag(scores: torch.Tensor, front_score: torch.Tensor, step):
        """:func:`selection_alive` now, on its way to the host without draining the queue: (value, event)."""
        alive = selection_alive(scores, front_score, step.per_request, step.budget)
        if not alive.is_cuda:
            return alive, None
        host = torch.empty((), dtype=torch.bool, pin_memory=True)
        host.copy_(alive, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return host, event

    @staticmethod
    def _read(flag) -> bool:
        value, event = flag
        if event is not None:
            event.synchronize()
        return bool(value)

    def _run_level(self, cm, reqs: list[int], roots: np.ndarray, d: int, tokens: torch.Tensor,
                   hidden: torch.Tensor, anc: torch.Tensor):
        """One level's MTP forward: (hidden ``[G*k, H]``, top children ``[G*k, 2k]``). Query j of request c
        is row c*k + j at position root + d - 1, its KV at position root + (d-1)k + j; the request's region is
        its d*k queries so far."""
        drafter, k, g = self.drafter, self.k, len(reqs)
        rows = g * k
        positions = np.repeat(roots + d - 1, k)
        kv_pos = roots[:, None] + (d - 1) * k + np.arange(k)
        slots = drafter._slots(np.asarray(reqs)[:, None], kv_pos).ravel()
        seq_lens = roots + d * k
        # What the metadata reads of a chunk: batch request, query count, sequence length.
        chunks = [(r, range(k), None, int(s), None) for r, s in zip(reqs, seq_lens)]
        written = drafter._write_arrays(tokens.long(), positions, slots, hidden)
        visible = anc[:, :, :d * k]
        if self.host_rows(hidden):   # the CPU backend recomputes tree rows from host masks
            tree_rows = [TreeRows(req_index=i, row_start=i * k, region_mask=visible[i]) for i in range(g)]
            out = drafter._forward_written(cm, chunks, tree_rows, *written)
            return out, drafter._top_rows(out)
        c = np.arange(g, dtype=np.int32)
        meta = torch.from_numpy(np.stack([c, c * k, np.full(g, k), np.full(g, d * k), c * k], axis=1)
                                .astype(np.int32))
        bits = pack_bits(visible.reshape(rows, d * k), self.words)
        if drafter.graphs is not None:
            out = drafter.graphs.level(cm, chunks, (meta, bits), *written)
            if out is not None:
                return out
        device_rows = DeviceTreeRows(meta=meta.to(hidden.device, non_blocking=True), bits=bits, num_rows=rows,
                                     max_rows=k)
        out = drafter._forward_written(cm, chunks, [], *written, device_rows=device_rows)
        return out, drafter._top_rows(out)
