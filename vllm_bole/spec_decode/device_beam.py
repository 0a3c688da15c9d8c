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

from dataclasses import dataclass, fields

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.utils.torch_utils import async_tensor_h2d

from ..kernels import _use_triton
from ..kernels.forest import pack_bits
from ..kernels.tree_select import reference as select_reference
from ..step.forest import TreeRows
from ..step.host_copy import HostCopy
from .tree import DraftTree


_CONSTANTS: dict = {}


def device_constant(values: tuple, device) -> torch.Tensor:
    """An int64 device tensor of ``values``, made once (pinned, non-blocking) and never written: the small
    per-step index tensors a fixed step shape repeats (request rows, quotas) cost a host copy each otherwise."""
    key = (str(device), values)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) > 1024:
            _CONSTANTS.clear()
        t = _CONSTANTS[key] = async_tensor_h2d(list(values), device, torch.long)
    return t


def request_rows(table: torch.Tensor, reqs: list[int]) -> torch.Tensor:
    """Rows ``reqs`` of a per-request device tensor (a block table, the walk's path ends): a slice when they are
    the batch's first requests in order (a step over the whole batch), else one gather by an index made once
    (:func:`device_constant`)."""
    if reqs == list(range(len(reqs))):
        return table[:len(reqs)]
    return table[device_constant(tuple(reqs), table.device)]


def region_words(max_depth: int, topk: int) -> int:
    """Bit words of a drafter level's region (a request's queries so far, at most depth * topk keys), with the
    width of the drafter level graphs' bit buffer."""
    return cdiv(max_depth * topk + 1, 32)


def selection_alive(scores: torch.Tensor, frontier_scores: torch.Tensor, per_request: int | None,
                    budget: "int | torch.Tensor | None", real: torch.Tensor | None = None) -> torch.Tensor:
    """0-dim bool on the device: whether some request's frontier node beats its selection floor (the device twin
    of ``tree.selection_floors`` over ``[G, n]`` candidate scores, every request holding ``n``). ``budget``: an
    int, or a 0-dim device tensor (inside a graph, where it is data); ``real``: ``[G]`` bool, the requests that
    count (the others are a graph's padding)."""
    g, n = scores.shape
    floor = torch.full((g,), -torch.inf, dtype=scores.dtype, device=scores.device)
    if per_request is not None:
        keep = max(min(per_request, n), 1)
        best = scores.topk(keep, dim=1).values                          # [G, keep], descending
        if n >= per_request:
            floor = best[:, -1]
        if real is not None:
            best = torch.where(real[:, None], best, -torch.inf)
        if isinstance(budget, torch.Tensor):
            # The budget-th best of the real requests' kept scores (padding sorts last), if they hold that many.
            flat = best.flatten().sort(descending=True).values
            held = (real.sum() if real is not None else g) * keep
            cut = flat.gather(0, (budget - 1).clamp(0, flat.numel() - 1).reshape(1))[0]   # no host read
            floor = torch.where(budget <= held, torch.maximum(floor, cut), floor)
        elif budget is not None and best.numel() >= budget:
            cut = best.flatten().topk(budget).values[-1]
            floor = torch.maximum(floor, cut)
    alive = frontier_scores > floor[:, None]
    if real is not None:
        alive = alive & real[:, None]
    return alive.any()


def selected_mask(scores: torch.Tensor, depths: torch.Tensor, per_request: int | None,
                  budget: int | None) -> torch.Tensor:
    """``[G, n]`` bool: the nodes :func:`tree.select_step` keeps of ``G`` candidate trees with ``[G, n]`` scores
    and ``[n]`` depths (the same in every tree), on the scores' device: each request's ``per_request`` best by
    (score, shallower, lower index), then the ``budget`` best of those by (score, shallower, lower request, lower
    index); stable sorts, least significant key first."""
    g, n = scores.shape
    order = select_reference.best_first(scores, depths)
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
    # A device tensor of values: a Python True would be copied from the host, waiting for the queued levels.
    chosen[rows[perm], idx[perm]] = torch.ones(perm.shape, dtype=torch.bool, device=scores.device)
    return chosen


def quota_selection(scores: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor,
                    req_ids: list[str], counts: list[int]):
    """(chosen ``[G, n]`` float64 0/1, :class:`~.queued_drafts.QueuedDrafts`): each request's ``counts[g]`` best
    candidates, queued in candidate order (``kernels/tree_select/reference.quota_select``); on CUDA one Triton
    launch (``kernels/tree_select/triton_select.py``) instead of the torch twin's twenty-odd ops. Entries of the
    queued rows past a request's count are unspecified."""
    from .queued_drafts import QueuedDrafts

    device, n = scores.device, scores.shape[1]
    counts_dev = device_constant(tuple(counts), device)
    width = max(max(counts, default=0), 1)
    select = select_reference.quota_select
    if _use_triton(scores):
        from ..kernels.tree_select import triton_select

        if n <= triton_select.MAX_CANDIDATES:
            select = triton_select.quota_select
    chosen, tok, par, dep = select(scores, depths, tokens, parents, counts_dev, width)
    return chosen, QueuedDrafts(req_ids=req_ids, counts=counts, tokens=tok, parents=par, depths=dep)


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


@dataclass
class BeamState:
    """One step's growing trees, ``G`` requests of ``m`` candidate slots each, updated in place level by level
    (a level replayed from a graph reads and writes these same tensors: ``spec_decode/beam_graphs.py``).
    Candidates: token ids, local parents (-1: the root) and cumulative scores, in float64: the products (and so
    the ties) of the host bookkeeping, and one copy to the host for all three."""

    tokens: torch.Tensor        # [G, m] float64
    parents: torch.Tensor       # [G, m] float64
    scores: torch.Tensor        # [G, m] float64
    front: torch.Tensor         # [G, k] int64: the frontier's candidate indices
    front_tok: torch.Tensor     # [G, k] float64
    front_score: torch.Tensor   # [G, k] float64
    front_slot: torch.Tensor    # [G, k] int64: each frontier node's parent among the last level's queries
    # The next level's inputs, laid out by the level before it (DeviceBeam.start for the first):
    front_ids: torch.Tensor     # [G, k] int64: the frontier's token ids (the queries)
    anc: torch.Tensor           # [G, k, depth * k] bool: region keys the frontier's queries see
    bits: torch.Tensor          # [G * k, words] int32: ``anc`` packed (pack_bits), as the attention backend reads it
    hid: torch.Tensor           # [G * k, H]: the MTP hidden state that predicted each frontier node

    @classmethod
    def empty(cls, g: int, m: int, k: int, depth: int, hidden: torch.Tensor) -> "BeamState":
        f64 = dict(dtype=torch.float64, device=hidden.device)
        i64 = dict(dtype=torch.long, device=hidden.device)
        return cls(tokens=torch.zeros(g, m, **f64), parents=torch.full((g, m), -1.0, **f64),
                   scores=torch.zeros(g, m, **f64), front=torch.zeros(g, k, **i64), front_tok=torch.zeros(g, k, **f64),
                   front_score=torch.zeros(g, k, **f64), front_slot=torch.zeros(g, k, **i64),
                   front_ids=torch.zeros(g, k, **i64),
                   anc=torch.zeros(g, k, depth * k, dtype=torch.bool, device=hidden.device),
                   bits=torch.zeros(g * k, region_words(depth, k), dtype=torch.int32, device=hidden.device),
                   hid=torch.zeros(g * k, hidden.shape[1], dtype=hidden.dtype, device=hidden.device))

    def rows(self, g: int) -> "BeamState":
        """The first ``g`` requests' rows (views)."""
        k = self.front.shape[1]
        return BeamState(**{f.name: getattr(self, f.name)[:g * k if f.name in ("hid", "bits") else g]
                            for f in fields(self)})


@dataclass
class LevelPlan:
    """What a step's levels read besides the beam, from the roots alone: level d's query c*k + j (request c) sits
    at position root + d - 1 with its KV at position root + (d-1)k + j; the request's region is its d*k queries.
    From host roots the arrays are numpy; from device roots (roots not yet known on the host: the runner drafts
    before it walks) positions, slots and seq_lens are device tensors, and ``seq_max`` is a host bound."""

    positions: "np.ndarray | torch.Tensor"   # [L, G*k] int64
    slots: "np.ndarray | torch.Tensor"       # [L, G*k] int64 KV slots
    seq_lens: "np.ndarray | torch.Tensor"    # [L, G] int64
    meta: np.ndarray                         # [L, G, 5] int32 tree-row metadata (DeviceTreeRows.meta)
    seq_max: list[int]                       # per level: the longest sequence (or a bound on it)
    rope: "np.ndarray | torch.Tensor | None" = None   # [L, G*k] RoPE positions where they differ (images)

    @property
    def rope_positions(self) -> "np.ndarray | torch.Tensor":
        """``[L, G*k]``: the positions the rows' RoPE takes: ``positions`` plus each request's M-RoPE text offset
        (``MTPTreeDrafter.text_offsets``), the same in all three sections."""
        return self.positions if self.rope is None else self.rope

    @classmethod
    def of(cls, drafter, reqs: list[int], roots, levels: int, k: int, root_bound: int | None = None) -> "LevelPlan":
        """``roots``: ``[G]`` root positions, numpy or a device tensor (then ``root_bound`` bounds them)."""
        g = len(reqs)
        offsets = drafter.text_offsets(reqs)
        c = np.arange(g, dtype=np.int32)
        meta = np.zeros((levels, g, 5), dtype=np.int32)
        meta[:, :, 0], meta[:, :, 1], meta[:, :, 2], meta[:, :, 4] = c, c * k, k, c * k
        meta[:, :, 3] = np.arange(1, levels + 1)[:, None] * k
        if isinstance(roots, torch.Tensor):
            dev = roots.device
            roots = roots.long()
            d = device_constant(tuple(range(1, levels + 1)), dev)[:, None]          # [L, 1]
            positions = (roots[None, :] + d - 1).repeat_interleave(k, dim=1)       # [L, G*k]
            kv_pos = (roots[None, :, None] + (d[:, :, None] - 1) * k
                      + device_constant(tuple(range(k)), dev)).reshape(levels, g * k)
            r = device_constant(tuple(x for x in reqs for _ in range(k)), dev)
            slots = drafter._device_slots(r[None, :], kv_pos)
            rope = None if offsets is None else positions + device_constant(
                tuple(o for o in offsets for _ in range(k)), dev)
            return cls(positions=positions, slots=slots, seq_lens=roots[None, :] + d * k, meta=meta,
                       seq_max=[root_bound + (i + 1) * k for i in range(levels)], rope=rope)
        d = np.arange(1, levels + 1)[:, None]                                        # [L, 1]
        positions = np.repeat(roots[None, :] + d - 1, k, axis=1)                     # [L, G*k]
        kv_pos = (roots[None, :, None] + (d[:, :, None] - 1) * k + np.arange(k)).reshape(levels, g * k)
        slots = drafter._slots(np.repeat(np.asarray(reqs, dtype=np.int64), k)[None, :], kv_pos)
        seq_lens = roots[None, :] + d * k
        rope = None if offsets is None else positions + np.repeat(np.asarray(offsets, dtype=np.int64), k)[None, :]
        return cls(positions=positions, slots=np.asarray(slots, dtype=np.int64).reshape(levels, g * k),
                   seq_lens=seq_lens, meta=meta, seq_max=[int(x) for x in seq_lens.max(axis=1)], rope=rope)

    def host_seq_lens(self, d: int) -> list[int]:
        """Level ``d``'s sequence lengths on the host (from device roots: a copy that waits for them)."""
        row = self.seq_lens[d - 1]
        return row.tolist() if isinstance(row, torch.Tensor) else [int(x) for x in row]


class DeviceBeam:
    """The device-grown levels of ``drafter`` (an MTP tree drafter), ``width`` queries per request and level
    (default ``topk``; 1: a chain of rank-1 children, whose levels feed one row per request)."""

    def __init__(self, drafter, width: int | None = None):
        self.drafter = drafter
        cfg = drafter.bole_config
        self.k, self.max_depth = width or cfg.topk, cfg.max_depth
        self.top_width = cfg.topk   # the children the drafter's top rows hold (``[rows, 2 * topk]``)
        self.words = region_words(self.max_depth, self.k)
        self._rates: torch.Tensor | None = None
        self.levels_run = 0   # expansion levels grown so far (all steps)
        self._pinned: torch.Tensor | None = None   # early-stop flags on their way to the host (GPU)
        self._events: list | None = None
        self._depths_cache: dict[int, torch.Tensor] = {}
        self._level_hint: dict[int, int] = {}   # quota -> expansion levels its trees reached last (per_request)
        self._level_one: dict[tuple, tuple] = {}   # state shape -> level 1's (anc, bits)
        self.graphs = None    # full CUDA graphs of whole levels (GPU), set by the drafter: spec_decode/beam_graphs.py

    def own_children(self, top: torch.Tensor) -> torch.Tensor:
        """``[rows, 2k]``: the drafter's top children (``[rows, 2 * topk]``: probabilities, then token ids)
        narrowed to this beam's ``k`` best."""
        if self.k == self.top_width:
            return top
        k, t = self.k, self.top_width
        return torch.cat([top[:, :k], top[:, t:t + k]], dim=1)

    def _child_probs(self, p: torch.Tensor, depth: int) -> torch.Tensor:
        """Scores of children at ``depth`` relative to their parent, rank order: the drafter's probabilities,
        or under synthetic acceptance the rates the walk accepts each rank with (``MTPTreeDrafter._child_scores``)."""
        rates = self._synthetic_rates(p.device)
        return p if rates is None else rates[depth].expand_as(p)

    def _synthetic_rates(self, device) -> torch.Tensor | None:
        """``[max_depth + 2, k]`` float64: under synthetic acceptance, the child scores by depth and rank."""
        synthetic = self.drafter.synthetic
        if synthetic is None:
            return None
        if self._rates is None:
            self._rates = torch.tensor([[synthetic.child_probability(d, r) for r in range(self.k)]
                                        for d in range(self.max_depth + 2)], dtype=torch.float64, device=device)
        return self._rates

    def levels(self, per_request: int | None, budget: int | None) -> int:
        """Expansion levels after the root's children: none deeper than a kept tree can reach."""
        deepest = self.max_depth
        if per_request is not None:
            deepest = min(deepest, per_request)
        if budget is not None:
            deepest = min(deepest, budget)
        return max(deepest - 1, 0)

    def grow(self, step, cm, reqs: list[int], roots, hidden: torch.Tensor,
             top: torch.Tensor | None = None, root_bound: int | None = None) -> list[DraftTree]:
        """The selected trees of batch requests ``reqs`` (root positions ``roots``); ``hidden`` ``[G, H]``: the
        MTP hidden state that predicts each root's children; ``top``: its top children, if already computed."""
        return self.grow_deferred(step, cm, reqs, roots, hidden, top, root_bound)()

    def grow_deferred(self, step, cm, reqs: list[int], roots, hidden: torch.Tensor,
                      top: torch.Tensor | None = None, root_bound: int | None = None):
        """:meth:`grow` with every level and the selection queued on the device: returns ``finish()``, which
        waits for the selection's copy to the host and builds the trees (meanwhile the host may do other work).
        With ``step.quotas`` the selection keeps each request's quota of nodes, no level waits for the host, and
        ``step.queued`` holds the selected trees on the device (``spec_decode/queued_drafts.py``). ``roots``: host
        positions, or a ``[G]`` device tensor of them (the runner drafting before its walk) with ``root_bound`` a
        host bound on them."""
        k, g, device = self.k, len(reqs), hidden.device
        quotas = None if step.quotas is None else [step.quotas[r] for r in reqs]
        if quotas is not None and max(quotas, default=0) <= 0:
            return self._no_trees(step, reqs, device)
        if quotas is None and (step.budget is not None and step.budget <= 0
                               or step.per_request is not None and step.per_request <= 0):
            return lambda: [DraftTree() for _ in reqs]
        if quotas is None:
            levels = self.levels(step.per_request, step.budget)
        else:   # no early stop (it would wait for the device): as many levels as recent steps' trees used
            bound = self.levels(max(quotas), None)
            levels = min(bound, self._level_hint.get(max(quotas), bound))
            if step.fill_quotas:   # enough candidates for every quota: k root children, k*k per level
                levels = min(bound, max(levels, -(-max(max(quotas) - k, 0) // (k * k))))
        m = k + levels * k * k
        top = self.own_children(top if top is not None else self.drafter._top_rows(hidden)).double()   # [G, 2k]
        if not isinstance(roots, torch.Tensor):
            roots = np.asarray(roots, dtype=np.int64)
        plan = LevelPlan.of(self.drafter, reqs, roots, levels, k, root_bound) if levels else None
        graphs = self.graphs if levels and not self.host_rows(hidden) else None
        state = graphs.start(cm, reqs, plan, hidden, top, step.budget) if graphs is not None else None
        if state is None:
            graphs, state = None, BeamState.empty(g, m, k, self.max_depth, hidden)
            self.start(state, hidden, top)
        n = k
        # flags[j]: whether a frontier node beat its floor once level j's nodes existed. Level d reads flags[d-2]
        # (no frontier node beat it after level d-2: level d-1's nodes and all deeper ones are below it, and
        # floors only rise), so the read waits for work the GPU finished while level d-1 was queued.
        check = step.per_request is not None and quotas is None
        flags = [self._flag(state.scores[:g, :n], state.front_score[:g], step, 0)] if check else []
        for d in range(1, levels + 1):
            if check and d >= 2 and not self._read(flags[d - 2]):
                break
            # A graph's level also computes its early-stop flag (graphs.flag); an eager level's comes after it.
            ran = graphs is not None and graphs.run(state, d, cm, reqs, plan, step.per_request)
            if not ran:
                self.level(state, d, lambda tok, hid, visible, bits, d=d: self._eager_forward(cm, reqs, plan, d, tok,
                                                                                               hid, visible, bits))
            self.levels_run += 1
            n += k * k
            if check:
                flags.append(graphs.flag(d) if ran else
                             self._flag(state.scores[:g, :n], state.front_score[:g], step, d))
        s, depths = state, self._depths(n, device)
        if quotas is None:
            chosen = selected_mask(s.scores[:g, :n], depths, step.per_request, step.budget)
        else:
            counts = [min(q, n) for q in quotas]
            # (the quotas' device copy is made once per quota tuple, pinned and non-blocking: no wait for the levels)
            chosen, step.queued = quota_selection(s.scores[:g, :n], s.tokens[:g, :n], s.parents[:g, :n], depths,
                                                  [step.req_ids[r] for r in reqs], counts)
        # Every candidate and the selection mask in one fixed-size copy (no sync for the selection's size).
        # A copy of its own per call: a step's selection can still be unread when the next one is copied (drafting
        # before the walk grows step t+2's trees before step t+1's are read).
        host = HostCopy(torch.stack([chosen.double(), s.tokens[:g, :n], s.parents[:g, :n], s.scores[:g, :n]]))
        node_depths = self._host_depths(n) if quotas is not None else None

        def finish() -> list[DraftTree]:
            a = host.wait().numpy()
            r, i = np.nonzero(a[0])                 # by request, then node: parents before children
            if quotas is not None:
                # The next step runs as many levels as this one's trees reached, and one more if they reached
                # the deepest level (the bound caps it).
                deepest = int(node_depths[i].max()) if len(i) else 1
                self._level_hint[max(quotas)] = levels + 1 if deepest > levels else max(deepest, 1)
            return trees_of_selection(np.stack([r, i, a[1][r, i], a[2][r, i], a[3][r, i]]), g, n)

        return finish

    def _no_trees(self, step, reqs: list[int], device):
        from .queued_drafts import QueuedDrafts

        empty = torch.zeros(len(reqs), 1, dtype=torch.int64, device=device)
        step.queued = QueuedDrafts(req_ids=[step.req_ids[r] for r in reqs], counts=[0] * len(reqs), tokens=empty,
                                   parents=empty, depths=empty)
        return lambda: [DraftTree() for _ in reqs]

    def _host_depths(self, n: int) -> np.ndarray:
        """``[n]`` depth of every candidate slot (the root's children: 1; level d's: d + 1), the same for every
        request."""
        k = self.k
        return np.concatenate([np.ones(k, dtype=np.int64)]
                              + [np.full(k * k, d + 1, dtype=np.int64) for d in range(1, (n - k) // (k * k) + 1)])

    def _depths(self, n: int, device) -> torch.Tensor:
        """:meth:`_host_depths` on ``device``, kept per ``n``: a fresh copy from pageable memory would wait for
        the levels queued before it."""
        if n not in self._depths_cache:
            self._depths_cache[n] = torch.from_numpy(self._host_depths(n)).to(device)
        return self._depths_cache[n]

    def start(self, s: BeamState, hidden: torch.Tensor, top: torch.Tensor) -> None:
        """The root's children as candidates and frontier, and level 1's inputs (``hidden``, ``top``: one row
        per request of ``s``)."""
        k, g = self.k, s.front.shape[0]
        p = self._child_probs(top[:, :k], 1)
        s.tokens[:, :k], s.scores[:, :k], s.parents[:, :k] = top[:, k:], p, -1.0
        order = torch.sort(p, dim=1, descending=True, stable=True).indices   # [G, k]
        s.front.copy_(order)
        s.front_tok.copy_(top[:, k:].gather(1, order))
        s.front_score.copy_(p.gather(1, order))
        s.front_ids.copy_(s.front_tok)
        # Level 1's queries see themselves only, and all read their root's hidden state.
        anc, bits = self._level_one_regions(s)
        s.anc.copy_(anc)
        s.bits.copy_(bits)
        s.hid.view(g, k, -1).copy_(hidden[:, None, :])

    def _level_one_regions(self, s: BeamState) -> tuple[torch.Tensor, torch.Tensor]:
        """(anc, bits) of level 1 for ``s``'s shape: query j of every request sees key j only. The same every
        step: made once per shape, then one copy each instead of a zero fill, an OR and a bit packing."""
        key = (tuple(s.anc.shape), tuple(s.bits.shape), str(s.anc.device))
        cached = self._level_one.get(key)
        if cached is None:
            g, k, width = s.anc.shape
            anc = torch.zeros(g, k, width, dtype=torch.bool, device=s.anc.device)
            anc[:, :, :k] = torch.eye(k, dtype=torch.bool, device=s.anc.device)
            cached = self._level_one[key] = (anc, pack_bits(anc.reshape(g * k, width), s.bits.shape[1]))
        return cached

    def level(self, s: BeamState, d: int, forward) -> None:
        """Level ``d``: the frontier's queries through ``forward(tokens [G*k], hidden [G*k, H], visible region
        keys [G, k, d*k], the same packed [G*k, words]) -> (MTP hidden [G*k, H], top children [G*k, 2k])``, then
        :meth:`advance`. Device work only, in place on ``s``: the same code runs eagerly and inside a level's CUDA
        graph."""
        out, top = forward(s.front_ids.reshape(-1), s.hid, s.anc[:, :, :d * self.k], s.bits)
        self.advance(s, d, out, self.own_children(top))

    def advance(self, s: BeamState, d: int, out: torch.Tensor, top: torch.Tensor) -> None:
        """After level ``d``'s forward: each query's ``topk`` children as candidates, the ``topk`` best of them
        (ties to the earlier) as the next frontier, and the next level's inputs. One Triton launch on a GPU
        (``kernels/tree_select/triton_beam.py``), else its torch twin (``kernels/tree_select/reference.py``)."""
        rates = self._synthetic_rates(top.device)
        advance = select_reference.beam_advance
        if _use_triton(s.front):
            from ..kernels.tree_select.triton_beam import beam_advance as advance
        advance(s, d, out, top, None if rates is None else rates[d + 1])

    def host_rows(self, hidden: torch.Tensor) -> bool:
        """Whether the attention backend reads tree rows as host masks (CPU) rather than device bits (GPU)."""
        return self.drafter._host_tree_rows(hidden)

    def _flag(self, scores: torch.Tensor, front_score: torch.Tensor, step, slot: int):
        """:func:`selection_alive` now, on its way to the host (:meth:`send_flag`)."""
        return self.send_flag(selection_alive(scores, front_score, step.per_request, step.budget), slot)

    def send_flag(self, alive: torch.Tensor, slot: int):
        """A 0-dim device bool on its way to the host without draining the queue: (value, event). Each level of
        a step has its own pinned slot and event (a step reads its flags before the next step writes them)."""
        if not alive.is_cuda:
            return alive.clone(), None
        if self._pinned is None:
            self._pinned = torch.zeros(self.max_depth + 1, dtype=torch.bool, pin_memory=True)
            self._events = [torch.cuda.Event() for _ in range(self.max_depth + 1)]
        host, event = self._pinned[slot], self._events[slot]
        host.copy_(alive, non_blocking=True)
        event.record()
        return host, event

    @staticmethod
    def _read(flag) -> bool:
        value, event = flag
        if event is not None:
            event.synchronize()
        return bool(value)

    def _eager_forward(self, cm, reqs: list[int], plan: LevelPlan, d: int, tokens: torch.Tensor,
                       hidden: torch.Tensor, visible: torch.Tensor, bits: torch.Tensor):
        """Level ``d``'s MTP forward outside the beam graphs: (hidden ``[G*k, H]``, top children ``[G*k, 2k]``).
        Rows past the step's requests (a graph state's padding, if the graphs went off within a step) get
        zeros."""
        rows = len(reqs) * self.k
        out, top = self._run_level(cm, reqs, plan, d, tokens[:rows], hidden[:rows], visible[:len(reqs)], bits[:rows])
        if hidden.shape[0] > rows:
            out = torch.cat([out, out.new_zeros(hidden.shape[0] - rows, out.shape[1])])
            top = torch.cat([top, top.new_zeros(hidden.shape[0] - rows, top.shape[1])])
        return out, top

    def _run_level(self, cm, reqs: list[int], plan: LevelPlan, d: int, tokens: torch.Tensor, hidden: torch.Tensor,
                   visible: torch.Tensor, bits: torch.Tensor):
        """One level's MTP forward (the rows of ``plan``'s level ``d``): (hidden ``[G*k, H]``, top children
        ``[G*k, 2k]``)."""
        drafter, k, g = self.drafter, self.k, len(reqs)
        # What the metadata reads of a chunk: batch request, query count, sequence length.
        chunks = [(r, range(k), None, s, None) for r, s in zip(reqs, plan.host_seq_lens(d))]
        rope = None
        if plan.rope is not None:   # images: each request's M-RoPE text offset, in all three sections
            rope = plan.rope[d - 1]
            rope = torch.as_tensor(rope).to(hidden.device, non_blocking=True).unsqueeze(0).expand(3, -1)
        written = drafter._write_arrays(tokens, plan.positions[d - 1], plan.slots[d - 1], hidden, rope)
        if self.host_rows(hidden):   # the CPU backend recomputes tree rows from host masks
            tree_rows = [TreeRows(req_index=i, row_start=i * k, region_mask=visible[i]) for i in range(g)]
            out = drafter._forward_written(cm, chunks, tree_rows, *written)
            return out, drafter._top_rows(out)
        return drafter.forward_device_rows(cm, chunks, torch.from_numpy(plan.meta[d - 1]), bits, written, k)
