"""Synthetic acceptance for benchmarking trees at real shapes with dummy weights.

Like vLLM's ``rejection_sample_method: "synthetic"`` for chains, the accepted path is drawn from given rates
instead of the target's tokens (the emitted tokens are then the drafts', so outputs are meaningless).
``rates`` follow vLLM's ``synthetic_acceptance_rates``: ``rates[d-1]`` is the *unconditional* probability that
the rank-1 chain is accepted through depth d, so a one-wide tree accepts exactly like vLLM's synthetic chain
with the same list. At depth d the target's token is the node's rank-1 child with the conditional probability
``rates[d-1] / rates[d-2]`` (past the list the last conditional rate repeats), else rank 2 with probability
``sibling_rates[0]``, else rank 3 with ``sibling_rates[1]``, and so on; if that child is not in the tree (or no
rank is drawn) the walk stops. A child's rank is its order among its siblings, which is the drafter's
probability order.
"""

import random
from dataclasses import dataclass, field

from ..errors import BoleConfigError
from .tree import children_of

# Per-position acceptance of a strong MTP chain (Qwen3.6-27B recipe), then 0.3.
DEFAULT_RATES = (0.917, 0.837, 0.648, 0.538, 0.451, 0.348, 0.3)
DEFAULT_SIBLING_RATES = (0.35, 0.2, 0.1)


@dataclass(frozen=True)
class SyntheticAcceptance:
    rates: tuple[float, ...] = DEFAULT_RATES
    sibling_rates: tuple[float, ...] = DEFAULT_SIBLING_RATES
    seed: int = 0
    _rng: random.Random = field(default=None, compare=False, repr=False)
    _conditional: tuple[float, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_rng", random.Random(self.seed))
        prev = (1.0,) + self.rates[:-1]
        object.__setattr__(self, "_conditional", tuple(r / p if p > 0 else 0.0 for r, p in zip(self.rates, prev)))

    def rank1_rate(self, depth: int) -> float:
        """Probability that the rank-1 child at ``depth`` is accepted, given its parent was."""
        return self._conditional[min(depth, len(self._conditional)) - 1]

    def draw_rank(self, depth: int) -> int | None:
        """0-based sibling rank of the target's token at ``depth`` (1 = children of the root), or None."""
        rng = self._rng
        if rng.random() < self.rank1_rate(depth):
            return 0
        for rank, rate in enumerate(self.sibling_rates, start=1):
            if rng.random() < rate:
                return rank
        return None

    def child_probability(self, depth: int, rank: int) -> float:
        """Probability that :meth:`draw_rank` at ``depth`` returns ``rank``: what a calibrated drafter's
        conditional probability of that child would be."""
        first = self.rank1_rate(depth)
        if rank == 0:
            return first
        if rank > len(self.sibling_rates):
            return 0.0
        p = 1.0 - first
        for rate in self.sibling_rates[:rank - 1]:
            p *= 1.0 - rate
        return p * self.sibling_rates[rank - 1]

    def walk(self, parents: list[int]) -> list[int]:
        """Accepted path (local indices, root 0 first) of a verification tree with ``parents[0] == -1``."""
        children = children_of(parents)
        path = [0]
        while True:
            rank = self.draw_rank(len(path))
            kids = children.get(path[-1], [])
            if rank is None or rank >= len(kids):
                return path
            path.append(kids[rank])


def parse_synthetic(value) -> SyntheticAcceptance | None:
    """From ``speculative_config["synthetic_acceptance"]``: false/None, true (defaults) or
    ``{"rates": [...], "sibling_rates": [...], "seed": int}``."""
    if value in (None, False):
        return None
    if value is True:
        return SyntheticAcceptance()
    if not isinstance(value, dict) or set(value) - {"rates", "sibling_rates", "seed"}:
        raise BoleConfigError("speculative_config.synthetic_acceptance must be true or a dict with keys "
                              f"'rates', 'sibling_rates', 'seed'; got {value!r}")
    rates = tuple(value.get("rates", DEFAULT_RATES))
    siblings = tuple(value.get("sibling_rates", DEFAULT_SIBLING_RATES))
    if not rates or not all(isinstance(r, (int, float)) and 0.0 <= r <= 1.0 for r in rates + siblings):
        raise BoleConfigError("speculative_config.synthetic_acceptance rates must be numbers in [0, 1], "
                              f"got rates={list(rates)} sibling_rates={list(siblings)}")
    if any(later > earlier for earlier, later in zip(rates, rates[1:])):
        raise BoleConfigError("speculative_config.synthetic_acceptance.rates are unconditional per-depth rates "
                              f"(as vLLM's synthetic_acceptance_rates) and must be non-increasing, got {list(rates)}")
    return SyntheticAcceptance(rates, siblings, int(value.get("seed", 0)))
