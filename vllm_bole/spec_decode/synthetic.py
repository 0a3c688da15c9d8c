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

``draft_vocab_coverage`` (with ``draft_vocab``: the drafter proposes from part of the vocabulary) is the share of the
target's tokens inside that part, as ``vllm-bole draft-vocab`` measures it on text: at every depth the target's
token falls outside it with probability ``1 - draft_vocab_coverage``, no child can match, and the walk stops; else
the ranks are drawn as above. Rank-based draws alone would let a draft vocabulary cost no acceptance at all.

An acceptance profile (``vllm-bole acceptance-profile``: rates measured on a model's own trees) replays through
``{"profile": FILE}``: its ``synthetic_acceptance`` block holds the two lists.
"""

import json
import random
from dataclasses import dataclass, field

from ..errors import BoleConfigError
from .tree import children_of

# Per-position acceptance of a strong MTP chain (Qwen3.6-27B recipe), then 0.3.
DEFAULT_RATES = (0.917, 0.837, 0.648, 0.538, 0.451, 0.348, 0.3)
DEFAULT_SIBLING_RATES = (0.35, 0.2, 0.1)
PROFILE_FORMAT = "vllm-bole-acceptance-profile"   # the "format" field of an acceptance profile


@dataclass(frozen=True)
class SyntheticAcceptance:
    rates: tuple[float, ...] = DEFAULT_RATES
    sibling_rates: tuple[float, ...] = DEFAULT_SIBLING_RATES
    seed: int = 0
    draft_vocab_coverage: float = 1.0
    _rng: random.Random = field(default=None, compare=False, repr=False)
    _conditional: tuple[float, ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_rng", random.Random(self.seed))
        prev = (1.0,) + self.rates[:-1]
        object.__setattr__(self, "_conditional", tuple(r / p if p > 0 else 0.0 for r, p in zip(self.rates, prev)))

    @classmethod
    def from_profile(cls, path: str, seed: int = 0, draft_vocab_coverage: float = 1.0) -> "SyntheticAcceptance":
        """The rates of an acceptance profile (:func:`profile_rates`)."""
        return cls(*profile_rates(path), seed, draft_vocab_coverage)

    def rank1_rate(self, depth: int) -> float:
        """Probability that the rank-1 child at ``depth`` is accepted, given its parent was."""
        return self.draft_vocab_coverage * self.in_vocab_rank1_rate(depth)

    def in_vocab_rank1_rate(self, depth: int) -> float:
        """:meth:`rank1_rate` given that the target's token is one the drafter can propose (inside its draft
        vocabulary): the rank-1 rate the draws use after the coverage draw."""
        return self._conditional[min(depth, len(self._conditional)) - 1]

    def draw_rank(self, depth: int) -> int | None:
        """0-based sibling rank of the target's token at ``depth`` (1 = children of the root), or None."""
        rng = self._rng
        if self.draft_vocab_coverage < 1.0 and rng.random() >= self.draft_vocab_coverage:
            return None   # the target's token is outside the draft vocabulary
        if rng.random() < self.in_vocab_rank1_rate(depth):
            return 0
        for rank, rate in enumerate(self.sibling_rates, start=1):
            if rng.random() < rate:
                return rank
        return None

    def child_probability(self, depth: int, rank: int) -> float:
        """Probability that :meth:`draw_rank` at ``depth`` returns ``rank``: what a calibrated drafter's
        conditional probability of that child would be."""
        first = self.in_vocab_rank1_rate(depth)
        if rank == 0:
            return self.draft_vocab_coverage * first
        if rank > len(self.sibling_rates):
            return 0.0
        p = self.draft_vocab_coverage * (1.0 - first)
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
    """From ``speculative_config["synthetic_acceptance"]``: false/None, true (defaults),
    ``{"rates": [...], "sibling_rates": [...], "seed": int}`` or ``{"profile": FILE, "seed": int}``, either dict
    with ``"draft_vocab_coverage": float`` in (0, 1] too."""
    if value in (None, False):
        return None
    if value is True:
        return SyntheticAcceptance()
    if not isinstance(value, dict) or set(value) - {"rates", "sibling_rates", "seed", "profile",
                                                    "draft_vocab_coverage"}:
        raise BoleConfigError("speculative_config.synthetic_acceptance must be true or a dict with keys "
                              f"'rates', 'sibling_rates', 'seed' (or 'profile', 'seed') and optionally "
                              f"'draft_vocab_coverage'; got {value!r}")
    seed = value.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BoleConfigError(f"speculative_config.synthetic_acceptance.seed must be an integer, got {seed!r}")
    coverage = value.get("draft_vocab_coverage", 1.0)
    if isinstance(coverage, bool) or not isinstance(coverage, (int, float)) or not 0.0 < coverage <= 1.0:
        raise BoleConfigError("speculative_config.synthetic_acceptance.draft_vocab_coverage must be a number in "
                              f"(0, 1], got {coverage!r}")
    if "profile" in value:
        if {"rates", "sibling_rates"} & set(value):
            raise BoleConfigError("speculative_config.synthetic_acceptance takes 'profile' or 'rates' and "
                                  f"'sibling_rates', not both; got {value!r}")
        return SyntheticAcceptance.from_profile(value["profile"], seed, float(coverage))
    rates = tuple(value.get("rates", DEFAULT_RATES))
    siblings = tuple(value.get("sibling_rates", DEFAULT_SIBLING_RATES))
    _check_rates(rates, siblings, "speculative_config.synthetic_acceptance")
    return SyntheticAcceptance(rates, siblings, seed, float(coverage))


def resolved_synthetic(value):
    """``synthetic_acceptance`` as the engine's processes get it, checked: a profile's file is read here, once,
    and its rates replace it."""
    synthetic = parse_synthetic(value)
    if isinstance(value, dict) and "profile" in value:
        return {"rates": list(synthetic.rates), "sibling_rates": list(synthetic.sibling_rates), "seed": synthetic.seed,
                **({"draft_vocab_coverage": synthetic.draft_vocab_coverage} if "draft_vocab_coverage" in value else {})}
    return value


def profile_rates(path, field: str = "speculative_config.synthetic_acceptance.profile"
                  ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(rates, sibling_rates) of an acceptance profile: the rank-1 chain's unconditional rates and the sibling
    ranks' conditional rates it measured. A bad file is a one-line error naming ``field``."""
    if not isinstance(path, str) or not path:
        raise BoleConfigError(f"{field} must be the path of an acceptance profile (JSON written by "
                              f"vllm-bole acceptance-profile), got {path!r}")
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise BoleConfigError(f"{field}: cannot read {path!r} ({e.strerror or e})") from None
    except ValueError as e:
        raise BoleConfigError(f"{field}: {path!r} is not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != PROFILE_FORMAT:
        raise BoleConfigError(f"{field}: {path!r} is not an acceptance profile (its \"format\" must be "
                              f"{PROFILE_FORMAT!r}; vllm-bole acceptance-profile writes one)")
    block = data.get("synthetic_acceptance")
    if not isinstance(block, dict) or not all(isinstance(block.get(k), list) for k in ("rates", "sibling_rates")):
        raise BoleConfigError(f"{field}: {path!r} needs \"synthetic_acceptance\": {{\"rates\": [...], "
                              f"\"sibling_rates\": [...]}}, got {block!r}")
    rates, siblings = tuple(block["rates"]), tuple(block["sibling_rates"])
    _check_rates(rates, siblings, f"{field} {path!r}: synthetic_acceptance")
    return rates, siblings


def _check_rates(rates: tuple, siblings: tuple, where: str) -> None:
    if not rates or not all(isinstance(r, (int, float)) and not isinstance(r, bool) and 0.0 <= r <= 1.0
                            for r in rates + siblings):
        raise BoleConfigError(f"{where} rates must be numbers in [0, 1], "
                              f"got rates={list(rates)} sibling_rates={list(siblings)}")
    if any(later > earlier for earlier, later in zip(rates, rates[1:])):
        raise BoleConfigError(f"{where}.rates are unconditional per-depth rates (as vLLM's "
                              f"synthetic_acceptance_rates) and must be non-increasing, got {list(rates)}")
