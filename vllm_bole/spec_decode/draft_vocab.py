"""The MTP drafter's LM head over part of the vocabulary (``draft_vocab``).

At small batch a draft level costs mostly its LM head: the full vocabulary (248k rows on Qwen3.5, about 2 GB of
weights) is read once per level, several levels per step. Drafts are only proposals, verified by the target over
the full vocabulary, so drafting from the most frequent tokens changes which tokens are proposed and never the
output (the draft vocabularies of EAGLE-3 and FR-Spec). What it costs is acceptance whenever the target's token
is outside the subset.

The subset's rows of the LM head are copied once, when the drafter is built (before vLLM sizes the KV cache, so
they count as weights); a later weight reload leaves the copy stale, which lowers acceptance only.

``draft_vocab: "auto"`` learns the subset from what is served: an eighth of the vocabulary (:func:`auto_size`),
first the lowest ids, then after ``FIRST_REFRESH`` steps and every ``REFRESH_STEPS`` steps the ids the target
emitted most often (each step's first token of every request: the target's own token, whatever was drafted),
with older counts fading (:class:`AdaptiveCounts`). The refresh rewrites the subset's ids and LM-head rows in
place, so the drafter's CUDA graphs, which read them by address, stay valid; a step's drafts come from the subset
of the moment they were drafted (the target verifies them over the full vocabulary, so outputs never depend on
it).
"""

import json
from pathlib import Path

import torch

from ..errors import BoleConfigError
from ..logger import init_logger

logger = init_logger(__name__)


def eos_token_ids(model_config) -> set[int]:
    """The model's end-of-sequence ids (config and generation config): always drafted, so that stops are."""
    ids = set()
    sources = [getattr(model_config.hf_text_config, "eos_token_id", None)]
    try:
        sources.append(model_config.try_get_generation_config().get("eos_token_id"))
    except Exception:  # no generation config (a bare config.json): the model config's id is enough
        pass
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


AUTO = "auto"
AUTO_SHARE = 8        # "auto": an eighth of the vocabulary (32768 of Qwen3.5's 248k would be 7.6)
FIRST_REFRESH = 8     # "auto": steps before the first refresh of the subset (the lowest ids until then)
REFRESH_STEPS = 64    # "auto": steps between two later refreshes
DECAY = 0.5           # "auto": what the counts keep at each refresh (recent traffic weighs more)


def auto_size(vocab_size: int) -> int:
    """The size of the ``"auto"`` draft vocabulary."""
    return max(vocab_size // AUTO_SHARE, 1)


def draft_token_ids(setting: int | str, vocab_size: int, always: set[int]) -> torch.Tensor:
    """Sorted token ids of the draft vocabulary: ``setting`` an int N, the N lowest ids (byte-level BPE
    vocabularies such as Qwen's number tokens in merge order, so low ids tend to be frequent), ``"auto"`` (to
    start with: the :func:`auto_size` lowest), or the path of a JSON list of token ids; plus ``always``."""
    if setting == AUTO:
        setting = auto_size(vocab_size)
    if isinstance(setting, int):
        if setting > vocab_size:
            raise BoleConfigError(f"speculative_config.draft_vocab must be at most the vocabulary size "
                                  f"{vocab_size}, got {setting}")
        ids = set(range(setting))
    else:
        try:
            listed = json.loads(Path(setting).read_text())
        except (OSError, ValueError) as e:
            raise BoleConfigError(f"speculative_config.draft_vocab: cannot read a JSON list of token ids from "
                                  f"{setting!r} ({e})") from e
        if (not isinstance(listed, list) or not listed
                or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in listed)):
            raise BoleConfigError(f"speculative_config.draft_vocab: {setting!r} must hold a non-empty JSON list of "
                                  f"token ids in [0, {vocab_size})")
        ids = set(listed)
    ids.update(t for t in always if 0 <= t < vocab_size)
    return torch.tensor(sorted(ids), dtype=torch.long)


class AdaptiveCounts:
    """``draft_vocab: "auto"``: how often the target emitted each token lately, on the device. ``observe`` adds a
    step's tokens without waiting for the device; :meth:`top` names the subset to draft from next. A small prior
    falling with the id orders tokens never seen as the lowest-ids subset does."""

    def __init__(self, vocab_size: int, always: set[int], device):
        self.counts = 1e-3 * (1.0 - torch.arange(vocab_size, dtype=torch.float32, device=device) / vocab_size)
        for t in always:   # the EOS ids stay in the subset
            if 0 <= t < vocab_size:
                self.counts[t] = float("inf")
        self._prior = self.counts.clone()
        self.steps = 0

    def reset(self) -> None:
        """Back to no observations (the prior alone)."""
        self.counts.copy_(self._prior)
        self.steps = 0

    def observe(self, tokens: torch.Tensor) -> bool:
        """Counts ``tokens`` (a device tensor of token ids); True when a refresh is due."""
        self.counts.index_add_(0, tokens.long(), torch.ones_like(tokens, dtype=torch.float32))
        self.steps += 1
        return self.steps == FIRST_REFRESH or self.steps % REFRESH_STEPS == 0

    def top(self, size: int) -> torch.Tensor:
        """The ``size`` most emitted ids, sorted; the counts then fade (``DECAY``)."""
        ids = self.counts.topk(size).indices.sort().values
        self.counts.mul_(DECAY)
        return ids


class DraftVocab:
    """LM-head rows of the draft vocabulary: ``logits(hidden)`` over them, ``ids`` their token ids. ``adaptive``:
    the counts that move the subset (``draft_vocab: "auto"``), else None; ``head``: the full LM head's weight and
    bias (where the refreshed rows come from)."""

    def __init__(self, ids: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, logits_processor=None,
                 adaptive: AdaptiveCounts | None = None, head: tuple | None = None):
        self.ids, self.weight, self.bias = ids, weight, bias
        self.scale = getattr(logits_processor, "scale", 1.0)
        self.soft_cap = getattr(logits_processor, "soft_cap", None)
        self.adaptive, self._head = adaptive, head
        self._first_ids = ids.clone() if adaptive is not None else None
        self.refreshes = 0

    def restart(self) -> None:
        """``draft_vocab: "auto"``: back to the first subset, with no counts (after the start-up warm-up, whose
        random prompts say nothing of the served tokens); no-op for a fixed subset."""
        if self.adaptive is None:
            return
        self.adaptive.reset()
        self._move_to(self._first_ids)
        self.refreshes = 0

    def observe(self, tokens: torch.Tensor) -> None:
        """``draft_vocab: "auto"``: a step's emitted ``tokens`` (device ids); when a refresh is due the subset moves
        to the most emitted ids, in place (no-op for a fixed subset)."""
        if self.adaptive is None or not self.adaptive.observe(tokens):
            return
        self._move_to(self.adaptive.top(self.size))
        self.refreshes += 1

    def _move_to(self, ids: torch.Tensor) -> None:
        """The subset's ids and LM-head rows to ``ids``, in place (graphs read them by address)."""
        self.ids.copy_(ids)
        weight, bias = self._head
        torch.index_select(weight, 0, ids, out=self.weight)
        if bias is not None:
            torch.index_select(bias, 0, ids, out=self.bias)

    @property
    def size(self) -> int:
        return self.ids.numel()

    @classmethod
    def of_model(cls, model, setting: int | str, model_config, tp_size: int) -> "DraftVocab | None":
        """The draft head of a vLLM MTP model (its ``lm_head`` and ``logits_processor``), or None (with a warning)
        where the rows cannot be cut out: a quantized or tensor-parallel LM head keeps the full vocabulary."""
        head = model.lm_head
        method = type(getattr(head, "quant_method", None)).__name__
        if tp_size > 1 or method != "UnquantizedEmbeddingMethod":
            # "auto" (the default) asks for a draft vocabulary only where one can be had: no warning for it
            log = logger.info if setting == AUTO else logger.warning
            log("Bole's draft_vocab needs an unquantized LM head on one rank (tensor parallel size %d, %s): the "
                "drafter keeps the full vocabulary", tp_size, method)
            return None
        vocab_size = model_config.get_vocab_size()
        always = eos_token_ids(model_config)
        ids = draft_token_ids(setting, vocab_size, always).to(head.weight.device)
        bias = getattr(head, "bias", None)
        adaptive = AdaptiveCounts(vocab_size, always, head.weight.device) if setting == AUTO else None
        vocab = cls(ids, head.weight.index_select(0, ids).contiguous(),
                    None if bias is None else bias.index_select(0, ids), getattr(model, "logits_processor", None),
                    adaptive, (head.weight, bias))
        logger.info("Bole drafts from %d of the %d vocabulary tokens (draft_vocab%s; %.0f MiB of LM-head rows)",
                    vocab.size, vocab_size, ": the most emitted, refreshed every %d steps" % REFRESH_STEPS
                    if adaptive is not None else "", vocab.weight.numel() * vocab.weight.element_size() / 2**20)
        return vocab

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[rows, size]`` logits of the draft vocabulary, as vLLM's logits processor would give them."""
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias)
        if self.soft_cap is not None:
            logits = torch.tanh(logits / self.soft_cap) * self.soft_cap
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
