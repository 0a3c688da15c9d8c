"""What a tree of q nodes per request is worth: expected accepted tokens per step, from the walks so far.

The model is the one synthetic acceptance draws from (``spec_decode/synthetic.py``): at depth d the target's
token is the rank-1 child with a conditional rate ``a_d``, else rank r with ``s_r`` given that no lower rank was
(a child's rank is its order among its siblings, the drafter's probability order). Each walk shows, at every
node of its accepted path that has children in the tree, which rank the target took or that it took none of
those present; ranks past the children present go unseen (censored, so they count as no trial). Counts decay
by ``DECAY`` per ``WALKS_PER_DECAY`` walks seen (a memory of about 400 walks), so the rates follow the traffic,
and as many walks stand behind them at batch 1 (one walk a step) as at batch 32 (a decay per step instead would
keep 50 walks at batch 1: few trials for the deeper rates, and so a noisy curve where the rule weighs its
largest trees). Depths with fewer than ``MIN_TRIALS`` trials take the deepest well-measured rate above them.

``accepted(q)``: 1 + the sum of the q best nodes' path probabilities in the best-first tree those rates give
(the bonus token, then each kept node's chance to be on the accepted path), which is what a drafter whose
scores match these rates would keep. The budget rule ``"throughput"`` (``spec_decode/budget.py``) weighs it
against the calibrated cost of verifying the nodes.
"""

import collections
import heapq

import numpy as np
import torch

from ..step.host_copy import HostCopy
from .tree import children_of

DECAY = 0.98
WALKS_PER_DECAY = 8   # walks per DECAY step: 1 / (1 - DECAY) * WALKS_PER_DECAY = 400 walks of memory
MIN_TRIALS = 8.0
TREES_PER_STEP = 32   # walks a step contributes at most (the host time stays small at large batches)
REFRESH_STEPS = 8     # the curve is recomputed after this many observed steps (the rates move slowly)


class AcceptanceModel:
    def __init__(self, topk: int, max_depth: int):
        self.k, self.depth = topk, max_depth
        self.first_trials = np.zeros(max_depth + 1)    # [d]: walks that reached a node of depth d - 1 with children
        self.first_hits = np.zeros(max_depth + 1)      # ... whose rank-1 child (there) the target took
        self.sib_trials = np.zeros(max(topk, 1))       # [r]: rank r present and no lower rank taken
        self.sib_hits = np.zeros(max(topk, 1))
        self.steps = 0
        self._curve: list[float] | None = None
        self._chain = 0         # chain_nodes at the curve's rates
        self._curve_steps = 0   # ``steps`` when the curve was computed

    def observe(self, parents: list[list[int]], paths: list[list[int]]) -> None:
        """One step's walks: per tree, its verification parents (node 0 the root) and accepted path."""
        decay = DECAY ** (min(len(paths), TREES_PER_STEP) / WALKS_PER_DECAY)
        for arr in (self.first_trials, self.first_hits, self.sib_trials, self.sib_hits):
            arr *= decay
        for vp, path in zip(parents[:TREES_PER_STEP], paths[:TREES_PER_STEP]):
            children = children_of(vp)
            for j, node in enumerate(path):
                kids = children.get(node, [])
                d = j + 1
                if not kids or d > self.depth:
                    break
                rank = kids.index(path[j + 1]) if j + 1 < len(path) else None
                self.first_trials[d] += 1
                self.first_hits[d] += rank == 0
                for r in range(1, min(len(kids), self.k)):
                    if rank is not None and rank < r:
                        break
                    self.sib_trials[r] += 1
                    self.sib_hits[r] += rank == r
        self.steps += 1

    @property
    def ready(self) -> bool:
        return self.first_trials[1] >= MIN_TRIALS

    def rates(self) -> tuple[list[float], list[float]]:
        """(``a_d`` for d = 1..max_depth, ``s_r`` for r = 1..topk-1), from the counts."""
        first, last = [], 0.0
        for d in range(1, self.depth + 1):
            if self.first_trials[d] >= MIN_TRIALS:
                last = self.first_hits[d] / self.first_trials[d]
            first.append(float(last))
        sib = [float(self.sib_hits[r] / self.sib_trials[r]) if self.sib_trials[r] >= MIN_TRIALS else 0.0
               for r in range(1, self.k)]
        return first, sib

    def accepted(self, q: int) -> float:
        """Expected tokens a request's step yields with a tree of its q best nodes (1 for q = 0; q past
        topk * max_depth, the most a request carries, counts as that)."""
        self._refresh()
        return self._curve[min(max(q, 0), len(self._curve) - 1)]

    def chain_nodes(self) -> int:
        """:func:`chain_nodes` at the measured rates (siblings not yet measured count as never accepted), as
        recent as the curve's."""
        self._refresh()
        return self._chain

    def _refresh(self) -> None:
        """The curve and the chain length from the rates, again once ``REFRESH_STEPS`` steps were observed."""
        if self._curve is None or self.steps - self._curve_steps >= REFRESH_STEPS:
            first, sib = self.rates()
            self._curve = best_first_curve(first, sib, self.k, self.depth, cap=self.k * self.depth)
            self._chain = chain_nodes(first, sib, self.k, self.depth)
            self._curve_steps = self.steps

    def tokens_per_step(self, nodes: int, batch: int, per_request: int) -> float:
        """Expected tokens of a step of ``batch`` requests sharing ``nodes`` evenly (``queued_drafts.quotas_of``:
        the first ones get the remainder), each at most ``per_request``."""
        if batch <= 0:
            return 0.0
        base, extra = divmod(max(nodes, 0), batch)
        return ((batch - extra) * self.accepted(min(base, per_request))
                + extra * self.accepted(min(base + 1, per_request)))


def child_probability(first: list[float], sib: list[float], depth: int, rank: int) -> float:
    a = first[depth - 1]
    if rank == 0:
        return a
    p = 1.0 - a
    for s in sib[:rank - 1]:
        p *= 1.0 - s
    return p * sib[rank - 1] if rank - 1 < len(sib) else 0.0


def chain_nodes(first: list[float], sib: list[float], k: int, max_depth: int) -> int:
    """The most nodes q per request whose best-first tree (the q most probable nodes by these rates) is a chain,
    each node the rank-1 child of the one before: the chain's node at depth d beats every sibling candidate down
    to d (a tie counts against the chain). Up to ``max_depth``; ``k`` 1: every tree is a chain."""
    if k <= 1:
        return max_depth
    best_sibling, p, n = 0.0, 1.0, 0
    for d in range(1, max_depth + 1):
        best_sibling = max(best_sibling, p * max(child_probability(first, sib, d, r) for r in range(1, k)))
        p *= child_probability(first, sib, d, 0)
        if p <= best_sibling:
            break
        n = d
    return n


def best_first_curve(first: list[float], sib: list[float], k: int, max_depth: int, cap: int = 256,
                     coverage: float = 1.0) -> list[float]:
    """``curve[q]`` = 1 + the summed path probabilities of the q most probable nodes (ancestors come first:
    a child is never more probable than its parent). ``coverage``: a draft vocabulary's share of the target's
    tokens (``synthetic_acceptance.draft_vocab_coverage``), which every node's match needs."""
    heap = [(-coverage * child_probability(first, sib, 1, r), 1) for r in range(k)]
    heapq.heapify(heap)
    curve, total = [1.0], 1.0
    while heap and len(curve) <= cap:
        p, d = heapq.heappop(heap)
        if -p <= 0.0:
            break
        total -= p
        curve.append(total)
        if d < max_depth:
            for r in range(k):
                heapq.heappush(heap, (p * coverage * child_probability(first, sib, d + 1, r), d + 1))
    return curve


class DeviceWalks:
    """Walks that stay on the device (async scheduling: the step's tokens go to vLLM as a device tensor), on their
    way to an :class:`AcceptanceModel`: each step's first ``TREES_PER_STEP`` paths and its forest's parents start a
    copy to the host right behind the walk, and :meth:`observe_ready` feeds the copies that are done, never
    waiting for one (a later step picks up the rest)."""

    MAX_PENDING = 4   # copies still in flight beyond these are dropped (the rates move slowly)

    def __init__(self, model: AcceptanceModel):
        self.model = model
        self._pending = collections.deque()

    def send(self, rows, length, parent, cu_seqlens) -> None:
        """``rows`` ``[B, W]`` flat rows of each accepted path (root first, -1 past it), ``length`` ``[B]``,
        ``parent`` ``[N]`` local parents of the forest's nodes, ``cu_seqlens`` ``[B+1]``: device tensors, in one
        copy to the host."""
        n = min(rows.shape[0], TREES_PER_STEP)
        if n == 0:
            return
        if len(self._pending) >= self.MAX_PENDING:
            self._pending.popleft()
        flat = torch.cat([rows[:n].reshape(-1), length[:n], cu_seqlens[:n + 1].long(), parent.long()])
        self._pending.append((n, rows.shape[1], HostCopy(flat)))

    def observe_ready(self) -> int:
        """Observe every copy that is done, oldest first; returns how many steps were observed."""
        seen = 0
        while self._pending and self._pending[0][2].done():
            n, w, copy = self._pending.popleft()
            flat = copy.wait().tolist()
            a, b = n * w, n * w + n
            rows, length, cu, parents = flat[:a], flat[a:b], flat[b:b + n + 1], flat[b + n + 1:]
            self.model.observe([parents[cu[i]:cu[i + 1]] for i in range(n)],
                               [[r - cu[i] for r in rows[i * w:i * w + length[i]]] for i in range(n)])
            seen += 1
        return seen
