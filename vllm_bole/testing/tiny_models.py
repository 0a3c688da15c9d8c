"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints that vLLM loads offline.

Each builder writes an HF-style directory (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``) whose weight names are exactly those
vLLM 0.26's loaders read, MTP layer included. The weights are random but shaped so
that greedy decoding (1) has wide argmax margins, so bf16 noise does not flip it,
(2) depends on the Gated DeltaNet conv and recurrent state, and (3) is often, not
always, drafted right by the MTP layer:

* Each token's embedding is a random "identity" part, a class bit ``c = +-1`` along a
  direction ``e`` and a constant part along ``f`` (a bias for the gates below).
* ``lm_head`` gives each token two candidate successors ``{k+, k-}``: a normed hidden
  state ``u_j + m * d`` (``u_j`` token ``j``'s unit identity part, ``d`` the "mode"
  direction) scores ``logit_scale * (1 + m)`` on ``k+``, ``(1 - m)`` on ``k-`` and far
  less on every other token.
* A "recall head" in the first GDN layer (key head 0 and its value heads) writes
  ``m = +-mode_scale`` from the class of the *previous* token: its query is the previous
  token's key (a conv tap), so ``S_t q_t`` reads back the value the recurrent state
  stored one step earlier, which carries that token's class. Greedy decoding is thus a
  second-order Markov chain computed through the conv state and the recurrent state.
  All other mixer / MLP weights add only small random updates (``context_scale``), and
  no layer reads ``d``.
* The MTP layer's ``fc`` passes the normed next-token embedding through (vLLM
  concatenates ``[embedding, hidden]``) and turns the class of the current token, read
  from the target hidden state and blurred by a token-dependent error
  (``mtp_class_noise``), into a small mode (``mtp_mode_scale``); its decoder layer is a
  noisy copy of the last full-attention layer. Its top-2 is nearly always the right pair
  and its top-1 right for ~75-80% of tokens, so chains of drafts are often accepted and
  a two-way tree nearly always holds the answer (stock MTP, k=3, in vLLM on CPU: ~65% of
  draft tokens accepted, outputs equal to plain greedy).

The full-attention layers do not steer greedy choices. Special tokens, tokens that do
not decode to printable ASCII and ids past the tokenizer's vocabulary are never
predicted, so greedy decoding never emits EOS: bound generation with ``max_tokens``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import envs

KINDS = ("qwen3_5", "qwen3_5_vision", "qwen3_5_moe", "qwen3_next")

CORPUS_PATH = Path(__file__).with_name("corpus.txt")

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinyShape:
    """Dimensions shared by both architectures (GDN-shaped: 2 key / 4 value heads)."""

    vocab_size: int = 1024
    hidden_size: int = 256
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    full_attention_interval: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 32
    linear_value_head_dim: int = 32
    linear_conv_kernel_dim: int = 4
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    # the MoE kinds (Qwen3.5-MoE, Qwen3-Next)
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64
    shared_expert_intermediate_size: int = 128

    @property
    def layer_types(self) -> list[str]:
        return [
            "full_attention" if (i + 1) % self.full_attention_interval == 0 else "linear_attention"
            for i in range(self.num_hidden_layers)
        ]


@dataclass(frozen=True)
class WeightRecipe:
    """How the random weights are shaped (see the module docstring)."""

    seed: int = 0
    context_scale: float = 0.1  # RMS of each mixer / MLP random update (embedding RMS is 1)
    class_scale: float = 1.0  # size of the embedding's class component
    mode_scale: float = 1.0  # |m| the recall head writes
    logit_scale: float = 20.0  # logit of both successors of a pure identity embedding
    mtp_mode_scale: float = 0.2  # |m| the MTP writes; small, so its top-2 is the pair
    mtp_class_noise: float = 1.0  # MTP reads class + this * N(0, 1): ~20% of tokens wrong
    mtp_noise: float = 0.02  # relative noise on the MTP copy of the last full-attention layer
    fc_noise: float = 0.05  # relative noise on the MTP fc pass-through


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def train_tokenizer(vocab_size: int):
    """Byte-level BPE trained on ``corpus.txt``; deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS_PATH.read_text().splitlines(keepends=True), trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > vocab_size {vocab_size}")
    return tokenizer


def _printable_tokens(tokenizer) -> torch.Tensor:
    """Ids of ordinary tokens that decode on their own to visible ASCII text."""
    ids = []
    for i in range(tokenizer.get_vocab_size()):
        text = tokenizer.decode([i], skip_special_tokens=True)
        if text.strip() and text.isascii() and text.isprintable():
            ids.append(i)
    return torch.tensor(ids)


def _write_tokenizer(path: Path, tokenizer) -> None:
    tokenizer.save(str(path / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1) + "\n")


# ---------------------------------------------------------------------------
# Random weights
# ---------------------------------------------------------------------------


class _Init:
    """Seeded float32 initialiser (weights are cast to bf16 when saved)."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def uniform(self, *shape: int, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=self.gen)

    def perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen)

    def noisy_copy(self, t: torch.Tensor, rel: float) -> torch.Tensor:
        scale = t.std().item() if t.numel() > 1 else 0.0
        return t + self.normal(*t.shape, std=rel * scale)


@dataclass(frozen=True)
class _Directions:
    """Orthonormal directions of the hidden space with a fixed role."""

    mode: torch.Tensor  # d: written by the recall head, read by lm_head only
    cls: torch.Tensor  # e: the embedding's class bit
    const: torch.Tensor  # f: shared by every embedding, a bias for the recall head's gates
    mtp_confusion: torch.Tensor  # identity-part direction the MTP mixes into the class

    @classmethod
    def draw(cls, init: _Init, hidden: int) -> _Directions:
        q, _ = torch.linalg.qr(init.normal(hidden, 4, std=1.0))
        return cls(*q.T)

    def identity_projector(self) -> torch.Tensor:
        """Projects onto the identity subspace (everything but mode, class and const)."""
        basis = torch.stack([self.mode, self.cls, self.const])
        return torch.eye(len(self.mode)) - basis.T @ basis


# Per-element RMS of what the mixers / MLPs feed their output projections.
_MIXER_OUT_RMS = {"linear_attention": 0.58, "full_attention": 0.13, "mlp": 0.6}
_OUTPUT_PROJECTIONS = ("o_proj.weight", "out_proj.weight", "down_proj.weight")

# Recall head pre-activations (gates are driven by the constant embedding part).
_RECALL_QK_GAIN = 1.5  # std of the query / key pre-activations
_RECALL_V_GAIN = 3.0  # value pre-activation for class +-1 (silu(+-3) = 2.86 / -0.14)
_RECALL_Z = 2.5  # output gate pre-activation
_RECALL_B = 3.0  # beta = sigmoid(3) = 0.95: each write nearly replaces the old value
_RECALL_DECAY = 0.9  # exp(g): older values fade slowly but are mostly overwritten


def _output_projection(init: _Init, hidden: int, fan_in: int, source: str, out_scale: float) -> torch.Tensor:
    return init.normal(hidden, fan_in, std=out_scale / (_MIXER_OUT_RMS[source] * math.sqrt(fan_in)))


def _full_attention(init: _Init, s: TinyShape, recipe: WeightRecipe) -> dict[str, torch.Tensor]:
    h, hd, nh, nkv = s.hidden_size, s.head_dim, s.num_attention_heads, s.num_key_value_heads
    in_std = 1.0 / math.sqrt(h)
    return {
        # Per head: [query (head_dim) | output gate (head_dim)], as attn_output_gate expects.
        "self_attn.q_proj.weight": init.normal(2 * nh * hd, h, std=in_std),
        "self_attn.k_proj.weight": init.normal(nkv * hd, h, std=in_std),
        "self_attn.v_proj.weight": init.normal(nkv * hd, h, std=in_std),
        "self_attn.o_proj.weight": _output_projection(
            init, h, nh * hd, "full_attention", recipe.context_scale
        ),
        # Gemma-style RMSNorm: the weight is an offset from 1.
        "self_attn.q_norm.weight": torch.zeros(hd),
        "self_attn.k_norm.weight": torch.zeros(hd),
    }


def _install_recall_head(
    gdn: dict[str, torch.Tensor], init: _Init, s: TinyShape, recipe: WeightRecipe, dirs: _Directions
) -> None:
    """Turn key head 0 and its value heads into the recall head (canonical GDN layout).

    The query q_t = silu(P x_{t-1}) (conv tap t-1) equals the previous key k_{t-1} = silu(P x_{t-1})
    (tap t one step earlier), so with beta ~ 1 the output S_t q_t is mostly v_{t-1}, whose first
    half of channels is silu(+3 c) and second half silu(-3 c) for that token's class c. After the
    gated RMSNorm (gate from the constant embedding part) out_proj writes first half minus second
    half into the mode direction.
    """
    h = s.hidden_size
    dk, dv = s.linear_key_head_dim, s.linear_value_head_dim
    key_dim = s.linear_num_key_heads * dk
    heads = s.linear_num_value_heads // s.linear_num_key_heads
    width = s.linear_conv_kernel_dim
    proj = init.normal(dk, h, std=_RECALL_QK_GAIN / math.sqrt(h)) @ dirs.identity_projector()
    gdn["q"][:dk] = proj
    gdn["k"][:dk] = proj
    half = dv // 2
    pattern = torch.cat([torch.ones(half), -torch.ones(dv - half)]).repeat(heads)
    gdn["v"][: heads * dv] = torch.outer(pattern, dirs.cls) * (_RECALL_V_GAIN / recipe.class_scale)
    gdn["z"][: heads * dv] = torch.outer(torch.ones(heads * dv), dirs.const) * _RECALL_Z
    gdn["b"][:heads] = torch.outer(torch.ones(heads), dirs.const) * _RECALL_B
    gdn["a"][:heads] = 0.0
    gdn["A_log"][:heads] = 0.0
    gdn["dt_bias"][:heads] = math.log(math.expm1(-math.log(_RECALL_DECAY)))  # g = -softplus(dt_bias)

    def tap(offset: int) -> torch.Tensor:  # conv weight reading the token `offset` steps back
        return torch.nn.functional.one_hot(torch.tensor(width - 1 - offset), width).float()

    gdn["conv"][:dk, 0] = tap(1)
    gdn["conv"][key_dim : key_dim + dk, 0] = tap(0)
    gdn["conv"][2 * key_dim : 2 * key_dim + heads * dv, 0] = tap(0)

    # Readout of one head after the gated RMSNorm, for class +1.
    silu = torch.nn.functional.silu
    hi, lo = (silu(torch.tensor(x)).item() for x in (_RECALL_V_GAIN, -_RECALL_V_GAIN))
    per_head = half * (hi - lo) / math.sqrt((hi**2 + lo**2) / 2) * silu(torch.tensor(_RECALL_Z)).item()
    readout = torch.cat([pattern, torch.zeros(gdn["out"].shape[1] - heads * dv)])
    # The embedding has norm ~sqrt(hidden); m is measured relative to it.
    gdn["out"] += (recipe.mode_scale * math.sqrt(h) / (heads * per_head)) * torch.outer(dirs.mode, readout)


def _gated_deltanet(
    init: _Init, s: TinyShape, recipe: WeightRecipe, dirs: _Directions, recall: bool, interleaved: bool
) -> dict[str, torch.Tensor]:
    """GDN weights; ``interleaved`` selects Qwen3-Next's fused per-key-head-group layout."""
    h = s.hidden_size
    nk, nv = s.linear_num_key_heads, s.linear_num_value_heads
    dk, dv = s.linear_key_head_dim, s.linear_value_head_dim
    key_dim, value_dim = nk * dk, nv * dv
    in_std = 1.0 / math.sqrt(h)
    # Decay rates spread over short and long memories: g = -exp(A_log) * softplus(a + dt_bias).
    dt = torch.exp(init.uniform(nv, low=math.log(1e-3), high=math.log(1e-1)))
    gdn = {
        "q": init.normal(key_dim, h, std=in_std),
        "k": init.normal(key_dim, h, std=in_std),
        "v": init.normal(value_dim, h, std=in_std),
        "z": init.normal(value_dim, h, std=in_std),
        "b": init.normal(nv, h, std=in_std),
        "a": init.normal(nv, h, std=0.5 * in_std),
        "conv": init.normal(2 * key_dim + value_dim, 1, s.linear_conv_kernel_dim, std=0.5),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),  # inverse softplus
        "A_log": torch.log(init.uniform(nv, low=1.0, high=16.0)),
        "out": _output_projection(init, h, value_dim, "linear_attention", recipe.context_scale),
    }
    if recall:
        _install_recall_head(gdn, init, s, recipe, dirs)
    weights = {
        "linear_attn.conv1d.weight": gdn["conv"],
        "linear_attn.dt_bias": gdn["dt_bias"],
        "linear_attn.A_log": gdn["A_log"],
        "linear_attn.norm.weight": torch.ones(dv),  # gated RMSNorm: plain multiplicative weight
        "linear_attn.out_proj.weight": gdn["out"],
    }
    q, k, v, z, b, a = (gdn[n] for n in "qkvzba")
    if not interleaved:
        weights |= {
            "linear_attn.in_proj_qkv.weight": torch.cat([q, k, v]),
            "linear_attn.in_proj_z.weight": z,
            "linear_attn.in_proj_b.weight": b,
            "linear_attn.in_proj_a.weight": a,
        }
        return weights
    r = nv // nk  # value heads per key head
    qkvz, ba = [], []
    for g in range(nk):
        qkvz += [
            q[g * dk : (g + 1) * dk],
            k[g * dk : (g + 1) * dk],
            v[g * r * dv : (g + 1) * r * dv],
            z[g * r * dv : (g + 1) * r * dv],
        ]
        ba += [b[g * r : (g + 1) * r], a[g * r : (g + 1) * r]]
    weights |= {
        "linear_attn.in_proj_qkvz.weight": torch.cat(qkvz),
        "linear_attn.in_proj_ba.weight": torch.cat(ba),
    }
    return weights


def _dense_mlp(
    init: _Init, hidden: int, inter: int, out_scale: float, prefix: str
) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.gate_proj.weight": init.normal(inter, hidden, std=1.0 / math.sqrt(hidden)),
        f"{prefix}.up_proj.weight": init.normal(inter, hidden, std=1.0 / math.sqrt(hidden)),
        f"{prefix}.down_proj.weight": _output_projection(init, hidden, inter, "mlp", out_scale),
    }


def _sparse_moe(init: _Init, s: TinyShape, recipe: WeightRecipe) -> dict[str, torch.Tensor]:
    h = s.hidden_size
    # Routed experts are mixed with weights summing to 1 and the shared expert is
    # sigmoid-gated; half the scale each keeps the block's update near context_scale.
    out_scale = recipe.context_scale / 2
    weights = {
        "mlp.gate.weight": init.normal(s.num_experts, h, std=1.0 / math.sqrt(h)),
        "mlp.shared_expert_gate.weight": init.normal(1, h, std=1.0 / math.sqrt(h)),
    }
    for e in range(s.num_experts):
        weights |= _dense_mlp(init, h, s.moe_intermediate_size, out_scale, f"mlp.experts.{e}")
    weights |= _dense_mlp(init, h, s.shared_expert_intermediate_size, out_scale, "mlp.shared_expert")
    return weights


def _decoder_layer(
    init: _Init, s: TinyShape, recipe: WeightRecipe, kind: str, dirs: _Directions, index: int
) -> dict[str, torch.Tensor]:
    if s.layer_types[index] == "full_attention":
        weights = _full_attention(init, s, recipe)
    else:
        first_gdn = s.layer_types.index("linear_attention") == index
        weights = _gated_deltanet(init, s, recipe, dirs, recall=first_gdn, interleaved=kind == "qwen3_next")
    if kind in ("qwen3_5_moe", "qwen3_next"):
        weights |= _sparse_moe(init, s, recipe)
    else:
        weights |= _dense_mlp(init, s.hidden_size, s.intermediate_size, recipe.context_scale, "mlp")
    weights["input_layernorm.weight"] = torch.zeros(s.hidden_size)
    weights["post_attention_layernorm.weight"] = torch.zeros(s.hidden_size)
    # The mode is write-only: no layer reads it, so it steers the logits and nothing else.
    for name, t in weights.items():
        if t.dim() == 2 and t.shape[1] == s.hidden_size and not name.endswith(_OUTPUT_PROJECTIONS):
            weights[name] = t - torch.outer(t @ dirs.mode, dirs.mode)
    return weights


def _embeddings(
    init: _Init, s: TinyShape, recipe: WeightRecipe, dirs: _Directions
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (embedding table, unit-normed identity parts)."""
    identity = init.normal(s.vocab_size, s.hidden_size, std=1.0) @ dirs.identity_projector()
    classes = torch.randint(2, (s.vocab_size,), generator=init.gen).float() * 2 - 1
    embed = identity + recipe.class_scale * torch.outer(classes, dirs.cls) + dirs.const
    return embed, identity / identity.norm(dim=-1, keepdim=True)


def _successor_head(
    init: _Init,
    units: torch.Tensor,
    mode_dir: torch.Tensor,
    num_tokens: int,
    targets: torch.Tensor,
    logit_scale: float,
) -> torch.Tensor:
    """lm_head giving each of the first ``num_tokens`` tokens two successors among ``targets``.

    The targets are paired up, ``k+`` with mode sign +1 and ``k-`` with -1. Token ``j``'s
    unit identity part ``u_j`` is added to the rows of both members of its pair ``succ[j]``,
    so an RMS-normed hidden state ``sqrt(hidden) * (u_j + m * mode_dir)`` scores
    ``logit_scale * (1 + m)`` on ``k+`` and ``logit_scale * (1 - m)`` on ``k-``. Rows of
    other ids stay zero.
    """
    vocab, hidden = units.shape
    paired = targets[init.perm(len(targets))][: len(targets) // 2 * 2]
    plus, minus = paired[0::2], paired[1::2]
    partner = torch.full((vocab,), -1, dtype=torch.long)
    partner[plus], partner[minus] = minus, plus
    succ = torch.empty(num_tokens, dtype=torch.long)
    succ[paired] = paired[init.perm(len(paired))]
    others = torch.ones(num_tokens, dtype=torch.bool)
    others[paired] = False
    # Spread the other tokens over distinct pairs: every source adds to its pair's rows, and
    # crowded rows blur the margins.
    spread = init.perm(len(paired))[torch.arange(int(others.sum())) % len(paired)]
    succ[others] = paired[spread]

    head = torch.zeros(vocab, hidden)
    head.index_add_(0, succ, units[:num_tokens])
    head.index_add_(0, partner[succ], units[:num_tokens])
    head[plus] += mode_dir
    head[minus] -= mode_dir
    return head * (logit_scale / math.sqrt(hidden))


def _text_weights(
    s: TinyShape, recipe: WeightRecipe, kind: str, num_tokens: int, targets: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """Returns (decoder weights named relative to the decoder, lm_head, weights named 'mtp.*')."""
    init = _Init(recipe.seed)
    h = s.hidden_size
    dirs = _Directions.draw(init, h)
    embed, units = _embeddings(init, s, recipe, dirs)
    model: dict[str, torch.Tensor] = {"embed_tokens.weight": embed}
    layers = []
    for i in range(s.num_hidden_layers):
        layers.append(_decoder_layer(init, s, recipe, kind, dirs, i))
        model |= {f"layers.{i}.{name}": t for name, t in layers[-1].items()}
    model["norm.weight"] = torch.zeros(h)
    lm_head = _successor_head(init, units, dirs.mode, num_tokens, targets, recipe.logit_scale)

    last_full = max(i for i, t in enumerate(s.layer_types) if t == "full_attention")
    # fc input: [normed next-token embedding | normed hidden state of the position before].
    # The hidden half turns the class of that position's token, blurred by an identity-part
    # direction, into a small mode: the MTP's guess of what the recall head will write.
    class_reader = dirs.cls + recipe.mtp_class_noise * dirs.mtp_confusion
    mode_writer = recipe.mtp_mode_scale * math.sqrt(h) * torch.outer(dirs.mode, class_reader)
    fc = torch.cat([torch.eye(h), mode_writer], dim=1)
    fc += init.normal(h, 2 * h, std=recipe.fc_noise / math.sqrt(h))
    mtp = {
        "mtp.fc.weight": fc,
        "mtp.pre_fc_norm_embedding.weight": torch.zeros(h),
        "mtp.pre_fc_norm_hidden.weight": torch.zeros(h),
        "mtp.norm.weight": torch.zeros(h),
    }
    for name, t in layers[last_full].items():
        mtp[f"mtp.layers.0.{name}"] = init.noisy_copy(t, recipe.mtp_noise)
    return model, lm_head, mtp


def _save_weights(path: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> None:
    from safetensors.torch import save_file

    tensors = {key: t.to(torch.bfloat16).contiguous() for key, t in sorted(tensors.items())}
    save_file(tensors, str(path / name), metadata={"format": "pt"})
    (path / name).chmod(0o644)


# ---------------------------------------------------------------------------
# Configs
# ---------------------------------------------------------------------------


def _common_text_config(s: TinyShape, eos_id: int, pad_id: int) -> dict:
    return {
        "vocab_size": s.vocab_size,
        "hidden_size": s.hidden_size,
        "intermediate_size": s.intermediate_size,
        "num_hidden_layers": s.num_hidden_layers,
        "layer_types": s.layer_types,
        "num_attention_heads": s.num_attention_heads,
        "num_key_value_heads": s.num_key_value_heads,
        "head_dim": s.head_dim,
        "linear_num_key_heads": s.linear_num_key_heads,
        "linear_num_value_heads": s.linear_num_value_heads,
        "linear_key_head_dim": s.linear_key_head_dim,
        "linear_value_head_dim": s.linear_value_head_dim,
        "linear_conv_kernel_dim": s.linear_conv_kernel_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_position_embeddings,
        "rms_norm_eps": s.rms_norm_eps,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        # The CPU GDN prefill kernel needs a float32 recurrent state without AMX.
        "mamba_ssm_dtype": "float32",
    }


def _qwen3_5_config(s: TinyShape, token_ids: dict[str, int]) -> dict:
    rotary_half = int(s.head_dim * 0.25) // 2
    mrope_section = [rotary_half - 2 * (rotary_half // 3), rotary_half // 3, rotary_half // 3]
    text_config = _common_text_config(s, token_ids[EOS_TOKEN], token_ids[PAD_TOKEN]) | {
        "model_type": "qwen3_5_text",
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": mrope_section,
            "partial_rotary_factor": 0.25,
            "rope_theta": 10000000.0,
            "rope_type": "default",
        },
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
    }
    vision_config = {
        "model_type": "qwen3_5_vision",
        "depth": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 64,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 128,
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": s.hidden_size,
        "patch_size": 16,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "dtype": "bfloat16",
        "tie_word_embeddings": False,
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "vision_end_token_id": token_ids["<|vision_end|>"],
        "text_config": text_config,
        "vision_config": vision_config,
    }


def _qwen3_5_moe_config(s: TinyShape, token_ids: dict[str, int]) -> dict:
    """Qwen3.5's config with Qwen3.5-MoE's names and a sparse MoE block (shared expert included) in every layer."""
    config = _qwen3_5_config(s, token_ids)
    text_config = {k: v for k, v in config["text_config"].items() if k != "intermediate_size"} | {
        "model_type": "qwen3_5_moe_text",
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "moe_intermediate_size": s.moe_intermediate_size,
        "shared_expert_intermediate_size": s.shared_expert_intermediate_size,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
    }
    return config | {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_config,
        "vision_config": config["vision_config"] | {"model_type": "qwen3_5_moe_vision"},
    }


def _qwen3_next_config(s: TinyShape, token_ids: dict[str, int]) -> dict:
    return _common_text_config(s, token_ids[EOS_TOKEN], token_ids[PAD_TOKEN]) | {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "dtype": "bfloat16",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": s.num_experts,
        "num_experts_per_tok": s.num_experts_per_tok,
        "moe_intermediate_size": s.moe_intermediate_size,
        "shared_expert_intermediate_size": s.shared_expert_intermediate_size,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "num_nextn_predict_layers": 1,
    }


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------


def _build(path: str | os.PathLike, kind: str, shape: TinyShape, recipe: WeightRecipe) -> str:
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(shape.vocab_size)
    token_ids = {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS}
    model, lm_head, mtp = _text_weights(
        shape, recipe, kind, tokenizer.get_vocab_size(), _printable_tokens(tokenizer)
    )
    if kind in ("qwen3_5", "qwen3_5_moe"):
        config = (_qwen3_5_config if kind == "qwen3_5" else _qwen3_5_moe_config)(shape, token_ids)
        tensors = {f"model.language_model.{name}": t for name, t in model.items()}
    else:
        config = _qwen3_next_config(shape, token_ids)
        tensors = {f"model.{name}": t for name, t in model.items()}
    tensors |= mtp | {"lm_head.weight": lm_head}
    _save_weights(out, tensors)
    _write_tokenizer(out, tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    return str(out)


def build_tiny_qwen3_5(
    path: str | os.PathLike, *, seed: int = 0, shape: TinyShape | None = None, **recipe_overrides: float
) -> str:
    """Write a tiny ``Qwen3_5ForConditionalGeneration`` checkpoint (text weights + MTP, no vision
    weights: load it with ``language_model_only=True``) to ``path`` and return the path.

    ``recipe_overrides`` are :class:`WeightRecipe` fields (``context_scale``, ``logit_scale``, ...).
    """
    return _build(path, "qwen3_5", shape or TinyShape(), WeightRecipe(seed=seed, **recipe_overrides))


def build_tiny_qwen3_5_moe(
    path: str | os.PathLike, *, seed: int = 0, shape: TinyShape | None = None, **recipe_overrides: float
) -> str:
    """Write a tiny ``Qwen3_5MoeForConditionalGeneration`` checkpoint (Qwen3.5's layout with a sparse MoE block
    and a shared expert in every layer, MTP layer included; no vision weights: load it with
    ``language_model_only=True``) to ``path`` and return the path."""
    return _build(path, "qwen3_5_moe", shape or TinyShape(), WeightRecipe(seed=seed, **recipe_overrides))


def build_tiny_qwen3_next(
    path: str | os.PathLike, *, seed: int = 0, shape: TinyShape | None = None, **recipe_overrides: float
) -> str:
    """Write a tiny ``Qwen3NextForCausalLM`` checkpoint (sparse MoE with a shared expert in every
    layer, one MTP layer) to ``path`` and return the path."""
    return _build(path, "qwen3_next", shape or TinyShape(), WeightRecipe(seed=seed, **recipe_overrides))


def build_tiny_qwen3_5_vision(path: str | os.PathLike, *, seed: int = 0) -> str:
    """:func:`build_tiny_qwen3_5` plus a one-block vision tower of random weights (``vision.safetensors``, HF's
    ``Qwen3_5VisionModel`` initialisation) and the image and video processor configs, so that vLLM serves image
    prompts (M-RoPE positions that run behind the token index after each image); load it without
    ``language_model_only`` (:func:`engine_kwargs` of ``"qwen3_5_vision"``)."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    out = Path(build_tiny_qwen3_5(path, seed=seed))
    vision = json.loads((out / "config.json").read_text())["vision_config"]
    with torch.random.fork_rng():
        torch.manual_seed(seed + 1)
        tower = Qwen3_5VisionModel._from_config(
            Qwen3_5VisionConfig(**{k: v for k, v in vision.items() if k != "model_type"}))
    _save_weights(out, {f"model.visual.{name}": t for name, t in tower.state_dict().items()}, "vision.safetensors")
    pixels = {"patch_size": vision["patch_size"], "temporal_patch_size": vision["temporal_patch_size"],
              "merge_size": vision["spatial_merge_size"], "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
              "size": {"shortest_edge": 4096, "longest_edge": 65536}, "processor_class": "Qwen3VLProcessor"}
    (out / "preprocessor_config.json").write_text(
        json.dumps({"image_processor_type": "Qwen2VLImageProcessorFast", **pixels}, indent=1) + "\n")
    (out / "video_preprocessor_config.json").write_text(
        json.dumps({"video_processor_type": "Qwen3VLVideoProcessor", **pixels}, indent=1) + "\n")
    return str(out)


BUILDERS = {"qwen3_5": build_tiny_qwen3_5, "qwen3_5_vision": build_tiny_qwen3_5_vision,
            "qwen3_5_moe": build_tiny_qwen3_5_moe, "qwen3_next": build_tiny_qwen3_next}


def engine_kwargs(kind: str = "qwen3_5") -> dict:
    """``vllm.LLM`` keyword arguments that run a tiny checkpoint (tested on CPU).

    On CPU also set ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) and ``HF_HUB_OFFLINE=1``. On a GPU,
    ``VLLM_BOLE_TEST_CUDA_GRAPHS=1`` runs the engines with torch.compile and CUDA graphs (a few small capture
    sizes) instead of eagerly, so tests cover the graph paths too; ``VLLM_BOLE_TEST_GPU_SHARE=0.15`` lets
    several engines share the GPU (``pytest -n``).
    """
    kwargs = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 256, "max_num_seqs": 8}

    if torch.cuda.is_available():
        # The GPU bundle has no FlashInfer, which vLLM would pick for GDN prefill on Hopper.
        kwargs["additional_config"] = {"gdn_prefill_backend": "triton"}
        if envs.VLLM_BOLE_TEST_CUDA_GRAPHS:
            kwargs["enforce_eager"] = False
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128, 256]}
        share = envs.VLLM_BOLE_TEST_GPU_SHARE
        if share:
            # Engines side by side on one GPU (pytest -n): each takes this share, with a fixed KV cache so that
            # no engine's memory profile counts another's allocations.
            kwargs["gpu_memory_utilization"] = float(share)
            kwargs["kv_cache_memory_bytes"] = 1 << 30
    if kind in ("qwen3_5", "qwen3_5_moe"):
        kwargs["language_model_only"] = True
    elif kind == "qwen3_5_vision":
        # vLLM's processor cache applies the HF processor to the prompt text alone, which this transformers
        # refuses for a prompt with image placeholders: process text and images together instead.
        kwargs |= {"limit_mm_per_prompt": {"image": 2, "video": 0}, "mm_processor_cache_gb": 0}
    else:
        # Qwen3-Next has no config hook that applies the config's mamba_ssm_dtype.
        kwargs["mamba_ssm_cache_dtype"] = "float32"
    return kwargs


def _version_hash(kind: str) -> str:
    digest = hashlib.sha256(kind.encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(CORPUS_PATH.read_bytes())
    return digest.hexdigest()[:12]


def cache_root() -> Path:
    """``$VLLM_BOLE_CACHE``, else ``~/.cache/vllm-bole``."""
    return Path(envs.VLLM_BOLE_CACHE or Path.home() / ".cache" / "vllm-bole")


def tiny_model_dir(kind: str = "qwen3_5", cache_dir: str | os.PathLike | None = None) -> str:
    """Build the default tiny checkpoint of ``kind`` once and return its cached directory.

    The checkpoint lives in ``cache_dir`` (default :func:`cache_root`) under a name carrying
    a hash of this module and the corpus, so editing either builds a fresh one. Builds go
    to a temporary sibling and are renamed into place, so concurrent callers are safe.
    """
    if kind not in BUILDERS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return cached_build(root, f"tiny-{kind}-{_version_hash(kind)}", BUILDERS[kind])


def cached_build(root: Path, name: str, build) -> str:
    """``root / name``, made once by ``build(folder)``: into a temporary sibling, then renamed into place, so
    concurrent callers are safe (a checkpoint is complete once its ``config.json`` is there)."""
    target = root / name
    if (target / "config.json").exists():
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    staging.chmod(0o755)
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():  # not a concurrent build that won
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return str(target)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, default="qwen3_5")
    parser.add_argument("--out", help="output directory (default: the cached tiny_model_dir)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.out is None:
        if args.seed != 0:
            parser.error("--seed needs --out (the cache holds the seed-0 build)")
        print(tiny_model_dir(args.kind))
    else:
        print(BUILDERS[args.kind](args.out, seed=args.seed))


if __name__ == "__main__":
    main()
