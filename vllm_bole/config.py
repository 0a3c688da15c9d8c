"""Bole's speculative configuration: parsed and validated in one place.

Users write ``speculative_config={"method": "bole", ...}``. vLLM's own ``SpeculativeConfig`` knows no such
method, so :func:`translate_speculative_config` turns the dict into what vLLM validates (the model's own MTP
drafter, ``num_speculative_tokens`` = the most tree nodes one request may carry) and returns the Bole settings,
which travel to every process in ``additional_config["bole"]``.
"""

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import BoleConfigError
from .spec_decode.budget_table import MEASURED
from .spec_decode.synthetic import resolved_synthetic

BOLE_METHOD = "bole"
BUDGET_RULES = ("decode", "step", "throughput")
SELECTIONS = ("per_request", "global")
KV_CACHE_GROUPS = ("fewest_bytes", "vllm")
# The MTP drafter's draft vocabulary when the config names none: learned from the served tokens (a full-vocabulary
# LM head is most of a draft level's cost at small batch; docs/results.md, "Draft vocabulary").
DEFAULT_DRAFT_VOCAB = "auto"
ADDITIONAL_CONFIG_KEY = "bole"
# Keys vLLM's SpeculativeConfig accepts next to a Bole method and that Bole passes through unchanged.
_PASSTHROUGH_KEYS = {"draft_tensor_parallel_size", "max_model_len", "disable_by_batch_size"}


@dataclass(frozen=True)
class BoleConfig:
    # Deepest tree level a drafter may propose (vLLM's ``num_speculative_tokens``).
    max_depth: int = 8
    # Children expanded per frontier node.
    topk: int = 4
    # Tree nodes verified per engine step over the whole batch: an int, or "auto" (calibrated table).
    budget: int | str = "auto"
    # Calibration table that "auto" reads (None: $VLLM_BOLE_BUDGET_TABLE, else ~/.cache/vllm-bole/budget_table.json;
    # "measured": none, the throughput rule measures whole steps).
    budget_table: str | None = None
    # How "auto" reads the table: "decode", the calibrated B_ver (T_ver(N) <= (1+eps) T_dec); "step", the largest
    # N whose extra verification costs at most eps of the measured step; "throughput" (the default with "auto"),
    # the N from B_ver up with the most expected tokens per unit of measured step time (spec_decode/budget.py).
    # A fixed budget reads no table: "decode" then.
    budget_rule: str = "throughput"
    # How a step's budget is shared: "per_request", an even share per request, so the node counts are known before
    # the drafts and the next step is scheduled while the device drafts (spec_decode/queued_drafts.py); "global",
    # the best nodes over the whole batch (the scheduler waits for the drafts).
    selection: str = "per_request"
    # "mtp" (the model's own MTP head) or "module.path:ClassName" of a tree drafter.
    drafter: str = "mtp"
    # Free-form arguments handed to a custom drafter.
    drafter_args: dict[str, Any] = field(default_factory=dict)
    # Benchmarks only: accept paths from given rates instead of the target (see spec_decode/synthetic.py).
    synthetic_acceptance: bool | dict[str, Any] | None = None
    # GPU: replay tree verification steps from Bole's own full CUDA graphs (off under enforce_eager).
    cuda_graphs: bool = True
    # MTP drafter: propose tokens from part of the vocabulary only (spec_decode/draft_vocab.py): "auto" (the
    # default), an eighth of it, the tokens the target emitted most; an int N, the N lowest token ids; a path, a JSON
    # list of token ids; None, all of it. The model's EOS ids are always in it.
    draft_vocab: int | str | None = "auto"
    # Queue the drafting of the next trees (and the walk and commit) on the device right behind the target forward,
    # before the host walks the trees (worker/early_drafting.py), in steps whose requests are all greedy or plainly
    # sampled trees; false: the drafter catches up after the host walk.
    early_drafting: bool = True
    # How the layers are split into KV-cache groups (worker/kv_groups.py): "fewest_bytes", the split that holds a
    # request in the fewest bytes (more concurrent requests; more groups, each with its own block table to allocate
    # and map every step); "vllm", vLLM's own groups.
    kv_cache_groups: str = "fewest_bytes"
    # Before the engine reports ready, run warm-up requests through it (worker/warmup.py): the CUDA graphs and
    # Triton kernels that serving would otherwise capture and compile on first use, stalling those steps. "auto"
    # (the default): where CUDA graphs run (a GPU, without enforce_eager); true or false: always or never.
    warmup: bool | str = "auto"

    @property
    def max_nodes_per_request(self) -> int:
        """Draft nodes one request may carry in a step (the token slots vLLM reserves per request)."""
        return self.max_depth * self.topk

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BoleConfig":
        return cls(**d)


def _int_field(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise BoleConfigError(f"speculative_config.{name} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def parse_bole_config(spec: dict[str, Any]) -> tuple[BoleConfig, dict[str, Any]]:
    """Split a ``{"method": "bole", ...}`` dict into (BoleConfig, remaining vLLM keys)."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    rest = {k: v for k, v in spec.items() if k in _PASSTHROUGH_KEYS}
    known = {"method", "num_speculative_tokens", "topk", "budget", "budget_table", "budget_rule", "selection",
             "drafter", "drafter_args", "synthetic_acceptance", "cuda_graphs", "draft_vocab",
             "early_drafting", "kv_cache_groups", "warmup"} | _PASSTHROUGH_KEYS
    unknown = sorted(set(spec) - known)
    if unknown:
        raise BoleConfigError(
            f"speculative_config has unknown key(s) {unknown} for method 'bole'; allowed: {sorted(known)}")
    depth = _int_field("num_speculative_tokens", spec.get("num_speculative_tokens", 8), 1, 32)
    topk = _int_field("topk", spec.get("topk", 4), 1, 16)
    budget = spec.get("budget", "auto")
    if budget != "auto":
        budget = _int_field("budget", budget, 1, 65536)
    budget_table = spec.get("budget_table")
    if budget_table is not None:
        if not isinstance(budget_table, str) or not budget_table:
            raise BoleConfigError(
                f"speculative_config.budget_table must be a file path (string) or 'measured', got {budget_table!r}")
        if budget != "auto":
            raise BoleConfigError(
                f"speculative_config.budget_table applies only with budget 'auto', got budget={budget!r}")
    budget_rule = spec.get("budget_rule", "throughput" if budget == "auto" else "decode")
    if budget_rule not in BUDGET_RULES:
        raise BoleConfigError(
            f"speculative_config.budget_rule must be one of {list(BUDGET_RULES)}, got {budget_rule!r}")
    if budget_table == MEASURED and budget_rule != "throughput":
        raise BoleConfigError("speculative_config.budget_table 'measured' needs budget_rule 'throughput' (it has no "
                              f"calibrated B_ver for the others), got {budget_rule!r}")
    if budget_rule != "decode" and budget != "auto":
        raise BoleConfigError(
            f"speculative_config.budget_rule applies only with budget 'auto', got budget={budget!r}")
    selection = spec.get("selection", "per_request")
    if selection not in SELECTIONS:
        raise BoleConfigError(
            f"speculative_config.selection must be one of {list(SELECTIONS)}, got {selection!r}")
    drafter = spec.get("drafter", "mtp")
    if not isinstance(drafter, str) or (drafter != "mtp" and ":" not in drafter):
        raise BoleConfigError(
            f"speculative_config.drafter must be 'mtp' or 'module.path:ClassName', got {drafter!r}")
    drafter_args = spec.get("drafter_args", {})
    if not isinstance(drafter_args, dict):
        raise BoleConfigError(f"speculative_config.drafter_args must be a dict, got {type(drafter_args).__name__}")
    # checked here, where the user's config is read (a profile's rates replace its path)
    synthetic = resolved_synthetic(spec.get("synthetic_acceptance"))
    cuda_graphs = spec.get("cuda_graphs", True)
    if not isinstance(cuda_graphs, bool):
        raise BoleConfigError(f"speculative_config.cuda_graphs must be true or false, got {cuda_graphs!r}")
    draft_vocab = _draft_vocab_field(draft_vocab_of(spec), topk, drafter)
    if isinstance(synthetic, dict) and "draft_vocab_coverage" in synthetic and draft_vocab is None:
        raise BoleConfigError("speculative_config.synthetic_acceptance.draft_vocab_coverage applies only with "
                              "draft_vocab (the share of the target's tokens inside it)")
    early_drafting = spec.get("early_drafting", True)
    if not isinstance(early_drafting, bool):
        raise BoleConfigError(f"speculative_config.early_drafting must be true or false, got {early_drafting!r}")
    kv_cache_groups = spec.get("kv_cache_groups", "fewest_bytes")
    if os.environ.get("VLLM_BOLE_KV_GROUPS"):   # the setting's earlier form: not silently ignored
        raise BoleConfigError("VLLM_BOLE_KV_GROUPS is no longer read: set speculative_config.kv_cache_groups "
                              f"({' or '.join(map(repr, KV_CACHE_GROUPS))}) instead")
    if kv_cache_groups not in KV_CACHE_GROUPS:
        raise BoleConfigError(
            f"speculative_config.kv_cache_groups must be one of {list(KV_CACHE_GROUPS)}, got {kv_cache_groups!r}")
    warmup = spec.get("warmup", "auto")
    if warmup != "auto" and not isinstance(warmup, bool):
        raise BoleConfigError(f"speculative_config.warmup must be 'auto', true or false, got {warmup!r}")
    return BoleConfig(max_depth=depth, topk=topk, budget=budget, budget_table=budget_table, budget_rule=budget_rule,
                      selection=selection, drafter=drafter, drafter_args=drafter_args, synthetic_acceptance=synthetic,
                      cuda_graphs=cuda_graphs, draft_vocab=draft_vocab,
                      early_drafting=early_drafting, kv_cache_groups=kv_cache_groups, warmup=warmup), rest


def draft_vocab_of(spec: dict[str, Any]) -> Any:
    """The ``draft_vocab`` setting of a speculative config dict, its default where it names none."""
    spec = {k.replace("-", "_"): v for k, v in spec.items()}
    return spec.get("draft_vocab", DEFAULT_DRAFT_VOCAB if spec.get("drafter", "mtp") == "mtp" else None)


def _draft_vocab_field(value: Any, topk: int, drafter: str) -> int | str | None:
    """``draft_vocab``: None (the full vocabulary), an int of at least ``topk`` tokens, ``"auto"`` (learned from the
    served tokens: ``spec_decode/draft_vocab.py``; the MTP drafter's default), or the path of an existing file (its
    ids are checked against the vocabulary where the model config is known: ``plugin.apply_bole_engine_args``)."""
    if value is None:
        return None
    if drafter != "mtp":
        raise BoleConfigError(
            f"speculative_config.draft_vocab applies only with drafter 'mtp', got drafter={drafter!r}")
    if value == "auto":
        return value
    if isinstance(value, str):
        if not value or not os.path.isfile(value):
            raise BoleConfigError(f"speculative_config.draft_vocab must be a token count, \"auto\" or the path of a "
                                  f"JSON list of token ids; no file {value!r}")
        return value
    return _int_field("draft_vocab", value, topk, 1 << 24)


def bole_config_from_vllm(vllm_config) -> BoleConfig | None:
    """The Bole settings of a built VllmConfig, or None when Bole is off."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    d = extra.get(ADDITIONAL_CONFIG_KEY)
    return BoleConfig.from_dict(d) if d else None
