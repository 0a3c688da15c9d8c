"""Train a small Qwen3.5 checkpoint with a jointly trained MTP head on offline text (the Python standard library).

    python -m vllm_bole.testing.train_small --out DIR [--size small|tiny] [--steps N] [--seed S] [--corpus PATH]
    python -m vllm_bole.testing.train_small [--size small|tiny]       # train once into the cache, print its dir
    python -m vllm_bole.testing.train_small --check DIR              # load in vLLM with MTP, report counters
    python -m vllm_bole.testing.train_small --measure DIR --report R.json   # acceptance table through vLLM
    python -m vllm_bole.testing.train_small --measure DIR --timed 3   # and tok/s (GPU: VLLM_BOLE_TEST_CUDA_GRAPHS=1)
    python -m vllm_bole.testing.train_small --measure DIR --chains "" --draft-vocab 512,1024   # draft vocabularies
    python -m vllm_bole.testing.train_small --measure-shared-prefix DIR   # acceptance after prefix-cache hits

The target is ``transformers``' own ``Qwen3_5ForCausalLM`` (Gated DeltaNet and gated full attention in the 3:1
pattern of ``TinyShape.layer_types``, M-RoPE with the tiny models' ``rope_parameters``), so the trained weights
mean in vLLM what they meant in training. The MTP head is the layer vLLM's ``Qwen3_5MTP`` runs, rebuilt from the
same transformers modules: at position ``t`` it takes the target's final (normed) hidden state ``h_t`` and the
embedding of token ``t+1``, computes ``fc([pre_fc_norm_embedding(emb), pre_fc_norm_hidden(h_t)])``, one full
attention decoder layer (causal over the MTP positions), ``norm`` and the shared ``lm_head``, and is trained on
token ``t+2`` (loss ``main + mtp_weight * mtp``, gradients into the shared trunk, as DeepSeek-V3 / Qwen3-Next
train it). The embedding and ``lm_head`` are shared with the target (``mtp_use_dedicated_embeddings: false``).

Text: the top-level ``*.py`` files of the running Python's standard library (``sysconfig`` ``stdlib``), sorted by
name; every ``HOLDOUT_EVERY``-th file is held out for evaluation and prompts. A byte-level BPE tokenizer with
``tiny_models``' special tokens is trained on the training files. Everything is seeded: the same seed, corpus,
size and torch build give the same checkpoint (up to CPU thread-count rounding in float32 reductions).

Training runs in float32 on CPU; weights are saved in bf16 under the names vLLM loads for
``Qwen3_5ForConditionalGeneration`` (``model.language_model.*``, ``lm_head.weight``, ``mtp.*``) with the tiny
models' config (no vision weights: load with ``language_model_only=True``, :func:`engine_kwargs`). The output
directory also gets ``train_report.json``: the loss curve and the held-out metrics (:func:`evaluate`).

A recorded ``small`` run (Python 3.11.7's standard library, torch 2.11 CPU, one thread on a shared 2-core machine;
the 30-minute cap stopped it after 571 of its 700 scheduled steps, 1.17M tokens; the same run without the cap:
``--stop-after 571`` instead of ``--max-seconds 1800``)::

    python -m vllm_bole.testing.train_small --out DIR --size small --seed 0 --threads 1 --max-seconds 1800

9.1M parameters; held-out (48 windows of 256 tokens): target loss 8.38 -> 3.74, top-1 33.5%; MTP loss 3.75, top-1
on the true token t+2 32.9%; MTP argmax = the target's greedy t+2 where its greedy t+1 was right: 74.3% (of 4080).
Through vLLM (``--measure``: 16 held-out code prompts, 96 greedy tokens, bf16, CPU), mean acceptance length:
MTP chain k=1..4 1.79 / 2.35 / 2.80 / 3.07; Bole default 3.29; Bole depth 8 / topk 4 / 32 nodes per request 4.12;
every output equal to vLLM's without speculation up to exact bf16 ties.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from vllm_bole.testing.tiny_models import (
    SPECIAL_TOKENS,
    TinyShape,
    _qwen3_5_config,
    _save_weights,
    _write_tokenizer,
)

HOLDOUT_EVERY = 10
FILE_SEPARATOR = "<|endoftext|>"


@dataclass(frozen=True)
class TrainSize:
    shape: TinyShape
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    max_corpus_chars: int | None  # train on the first files up to this many characters (None: all)
    eval_windows: int
    mtp_weight: float = 0.5
    weight_decay: float = 0.01
    log_every: int = 10


SIZES = {
    # CI smoke: the tiny models' shape (vLLM runs it on CPU), a few steps on ~300 kB of text.
    "tiny": TrainSize(shape=TinyShape(vocab_size=1024), seq_len=64, batch_size=4, steps=6, lr=3e-3, warmup=0,
                      max_corpus_chars=300_000, eval_windows=8, log_every=1),
    # 2-3 s a step on a shared 2-core CPU with --threads 1 (one thread ran 2-4x faster than two while other
    # processes used the cores), 22-35 minutes: 8 layers (6 GDN + 2 full attention), hidden 256, 4096-token
    # vocabulary, 1.4M training tokens (~1.1 epochs of the standard library's top-level modules).
    "small": TrainSize(shape=TinyShape(vocab_size=4096, hidden_size=256, intermediate_size=768,
                                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=64),
                       seq_len=256, batch_size=8, steps=700, lr=2e-3, warmup=30, max_corpus_chars=None,
                       eval_windows=48, log_every=10),
}


# ---------------------------------------------------------------------------
# Text and tokenizer
# ---------------------------------------------------------------------------


def default_corpus() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(corpus: str | os.PathLike | None = None) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files): a directory's top-level ``*.py`` sorted by name (or one file, split
    into 100-line pieces); every ``HOLDOUT_EVERY``-th is held out."""
    root = Path(corpus) if corpus is not None else default_corpus()
    files = sorted(root.glob("*.py")) if root.is_dir() else [root]
    if len(files) < 2 * HOLDOUT_EVERY:
        raise ValueError(f"{root}: need at least {2 * HOLDOUT_EVERY} files, found {len(files)}")
    held = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return [f for f in files if f not in held], held


def read_texts(files: list[Path], max_chars: int | None = None) -> list[str]:
    texts, total = [], 0
    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        total += len(text)
        if max_chars is not None and total >= max_chars:
            break
    return texts


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (as ``tiny_models.train_tokenizer``, on the given texts); deterministic for a corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator((line for t in texts for line in t.splitlines(keepends=True)), trainer)
    return tokenizer


def encode_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All texts as one token stream, separated by ``<|endoftext|>``."""
    sep = tokenizer.token_to_id(FILE_SEPARATOR)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids += enc.ids + [sep]
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------
# Model: transformers' Qwen3.5 target + vLLM's MTP layer
# ---------------------------------------------------------------------------


def text_config(shape: TinyShape, token_ids: dict[str, int]) -> dict:
    """The checkpoint's ``config.json`` (``tiny_models``' Qwen3.5 config for ``shape``)."""
    config = _qwen3_5_config(shape, token_ids)
    config["text_config"]["max_position_embeddings"] = shape.max_position_embeddings
    return config


def build_model(config: dict, seed: int):
    """(target, mtp): transformers' ``Qwen3_5ForCausalLM`` and the MTP modules, in float32, seeded."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        Qwen3_5DecoderLayer,
        Qwen3_5ForCausalLM,
        Qwen3_5RMSNorm,
    )

    text = {k: v for k, v in config["text_config"].items() if k != "model_type"}
    cfg = Qwen3_5TextConfig(**text)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    target = Qwen3_5ForCausalLM(cfg).float()
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    full = cfg.layer_types.index("full_attention")   # the MTP layer is a full-attention decoder layer
    mtp = torch.nn.ModuleDict({
        "fc": torch.nn.Linear(2 * h, h, bias=False),
        "pre_fc_norm_embedding": Qwen3_5RMSNorm(h, eps=eps),
        "pre_fc_norm_hidden": Qwen3_5RMSNorm(h, eps=eps),
        "layers": torch.nn.ModuleList([Qwen3_5DecoderLayer(cfg, full)]),
        "norm": Qwen3_5RMSNorm(h, eps=eps),
    }).float()
    std = cfg.initializer_range
    for module in mtp.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.normal_(module.weight, std=std)
    return target, mtp


def forward(target, mtp, ids: torch.Tensor):
    """Target logits at every position ([B, T, V]) and MTP logits at positions 0..T-2 ([B, T-1, V]): MTP slot
    ``t`` reads ``h_t`` and token ``t+1`` and predicts token ``t+2``, as vLLM's ``Qwen3_5MultiTokenPredictor``."""
    hidden = target.model(input_ids=ids).last_hidden_state      # after the final norm, what vLLM hands the MTP
    logits = target.lm_head(hidden)
    emb = target.model.embed_tokens(ids[:, 1:])
    x = mtp["fc"](torch.cat([mtp["pre_fc_norm_embedding"](emb), mtp["pre_fc_norm_hidden"](hidden[:, :-1])], -1))
    positions = torch.arange(x.shape[1]).unsqueeze(0).expand(x.shape[0], -1)
    rope = target.model.rotary_emb(x, positions)
    for layer in mtp["layers"]:
        x = layer(x, position_embeddings=rope, attention_mask=None, position_ids=positions)  # sdpa: causal
    return logits, target.lm_head(mtp["norm"](x))


def losses(target, mtp, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits, mtp_logits = forward(target, mtp, ids)
    vocab = logits.shape[-1]
    main = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
    extra = F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab), ids[:, 2:].reshape(-1))
    return main, extra


@torch.no_grad()
def evaluate(target, mtp, windows: torch.Tensor, batch: int = 8) -> dict:
    """Held-out metrics over ``windows`` ([N, T]):

    * ``main_loss`` / ``main_top1``: the target's next-token loss and top-1 accuracy;
    * ``mtp_loss`` / ``mtp_top1``: the MTP head's loss and top-1 accuracy on the true token ``t+2`` (given the
      true token ``t+1``);
    * ``mtp_agreement``: where the target's greedy token at ``t+1`` is the true one (so the teacher-forced context
      is what greedy decoding would have), how often the MTP's argmax equals the target's greedy token at ``t+2``:
      the chance vLLM accepts a first MTP draft in greedy decoding; ``mtp_agreement_all``: the same over all
      positions (the target's argmax at ``t+1`` under teacher forcing)."""
    target.eval(), mtp.eval()
    sums = dict(main_loss=0.0, mtp_loss=0.0, main_top1=0, mtp_top1=0, agree=0, agree_n=0, agree_all=0)
    n_main = n_mtp = 0
    for i in range(0, len(windows), batch):
        ids = windows[i:i + batch]
        logits, mtp_logits = forward(target, mtp, ids)
        vocab = logits.shape[-1]
        main_pred, mtp_pred = logits.argmax(-1), mtp_logits.argmax(-1)
        sums["main_loss"] += F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1),
                                             reduction="sum").item()
        sums["mtp_loss"] += F.cross_entropy(mtp_logits[:, :-1].reshape(-1, vocab), ids[:, 2:].reshape(-1),
                                            reduction="sum").item()
        sums["main_top1"] += (main_pred[:, :-1] == ids[:, 1:]).sum().item()
        sums["mtp_top1"] += (mtp_pred[:, :-1] == ids[:, 2:]).sum().item()
        # MTP slot t (t = 0..T-3) against the target's greedy token at t+2 (logits at position t+1).
        agree = mtp_pred[:, :-1] == main_pred[:, 1:-1]
        right_next = main_pred[:, :-2] == ids[:, 1:-1]      # target's greedy t+1 is the true t+1
        sums["agree"] += (agree & right_next).sum().item()
        sums["agree_n"] += right_next.sum().item()
        sums["agree_all"] += agree.sum().item()
        n_main += ids[:, 1:].numel()
        n_mtp += ids[:, 2:].numel()
    target.train(), mtp.train()
    return {"main_loss": sums["main_loss"] / n_main, "mtp_loss": sums["mtp_loss"] / n_mtp,
            "main_top1": sums["main_top1"] / n_main, "mtp_top1": sums["mtp_top1"] / n_mtp,
            "mtp_agreement": sums["agree"] / max(sums["agree_n"], 1), "mtp_agreement_n": sums["agree_n"],
            "mtp_agreement_all": sums["agree_all"] / n_mtp, "tokens": n_main}


# ---------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------


@dataclass
class TrainResult:
    out: str
    size: str
    steps: int
    seed: int
    seconds: float
    curve: list[dict] = field(default_factory=list)   # step, main_loss, mtp_loss (training batches)
    initial_eval: dict = field(default_factory=dict)
    final_eval: dict = field(default_factory=dict)
    params: int = 0
    train_tokens: int = 0
    corpus: str = ""


def _lr(step: int, size: TrainSize, steps: int) -> float:
    if step < size.warmup:
        return size.lr * (step + 1) / size.warmup
    progress = (step - size.warmup) / max(steps - size.warmup, 1)
    return size.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """``count`` non-overlapping windows spread evenly over a held-out stream."""
    n = len(stream) // seq_len
    picks = torch.linspace(0, n - 1, steps=min(count, n)).long()
    return torch.stack([stream[i * seq_len:(i + 1) * seq_len] for i in picks.tolist()])


def save_checkpoint(out: Path, target, mtp, tokenizer, config: dict) -> None:
    tensors = {f"model.language_model.{k}": v for k, v in target.model.state_dict().items()}
    tensors["lm_head.weight"] = target.lm_head.weight
    tensors |= {f"mtp.{k}": v for k, v in mtp.state_dict().items()}
    _save_weights(out, {k: v.detach() for k, v in tensors.items()})
    _write_tokenizer(out, tokenizer)
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")


def train(out: str | os.PathLike, size: str = "small", steps: int | None = None, seed: int = 0,
          corpus: str | os.PathLike | None = None, log=print, max_seconds: float | None = None,
          stop_after: int | None = None) -> TrainResult:
    """Train and save a checkpoint to ``out``; returns the loss curve and held-out metrics. ``stop_after``: stop
    after that many steps of the ``steps``-step learning-rate schedule (reproduces a run that ``max_seconds``, a
    wall-clock cap, stopped early)."""
    spec = SIZES[size]
    steps = spec.steps if steps is None else steps
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train_files, held_files = corpus_files(corpus)
    texts = read_texts(train_files, spec.max_corpus_chars)
    tokenizer = train_tokenizer(texts, spec.shape.vocab_size)
    shape = replace(spec.shape, vocab_size=max(spec.shape.vocab_size, tokenizer.get_vocab_size()))
    stream = encode_stream(tokenizer, texts)
    held = encode_stream(tokenizer, read_texts(held_files, spec.max_corpus_chars))
    windows = eval_windows(held, spec.seq_len, spec.eval_windows)
    log(f"corpus: {len(texts)} training files, {len(stream)} tokens; {len(held)} held-out tokens; "
        f"tokenizer {tokenizer.get_vocab_size()} tokens ({time.perf_counter() - start:.1f}s)")

    config = text_config(shape, {t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS})
    target, mtp = build_model(config, seed)
    params = [p for m in (target, mtp) for p in m.parameters()]
    result = TrainResult(out=str(out), size=size, steps=steps, seed=seed, seconds=0.0,
                         params=sum(p.numel() for p in params), train_tokens=steps * spec.batch_size * spec.seq_len,
                         corpus=str(corpus or default_corpus()))
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=spec.lr, betas=(0.9, 0.95))
    result.initial_eval = evaluate(target, mtp, windows)
    log(f"params {result.params / 1e6:.2f}M; initial held-out: {_fmt(result.initial_eval)}")
    gen = torch.Generator().manual_seed(seed)
    span = spec.seq_len + 1
    for step in range(steps):
        starts = torch.randint(0, len(stream) - span, (spec.batch_size,), generator=gen)
        ids = torch.stack([stream[s:s + spec.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = _lr(step, spec, steps)
        main, extra = losses(target, mtp, ids)
        opt.zero_grad(set_to_none=True)
        (main + spec.mtp_weight * extra).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        result.curve.append({"step": step, "main_loss": round(main.item(), 4), "mtp_loss": round(extra.item(), 4)})
        over_time = max_seconds is not None and time.perf_counter() - start > max_seconds
        if (over_time or (stop_after is not None and step + 1 >= stop_after)) and step < steps - 1:
            log(f"stopping after step {step}" + (f": over {max_seconds}s" if over_time else ""))
            result.steps = step + 1
            result.train_tokens = result.steps * spec.batch_size * spec.seq_len
            break
        if step % spec.log_every == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            log(f"step {step:4d}  main {main.item():.3f}  mtp {extra.item():.3f}  lr {_lr(step, spec, steps):.2e}  "
                f"{elapsed:.0f}s")
    result.final_eval = evaluate(target, mtp, windows)
    log(f"final held-out: {_fmt(result.final_eval)}")
    save_checkpoint(out, target, mtp, tokenizer, config)
    result.seconds = round(time.perf_counter() - start, 1)
    (out / "train_report.json").write_text(json.dumps(asdict(result), indent=1) + "\n")
    log(f"saved {out} ({result.seconds}s)")
    return result


def _version_hash(size: str, seed: int, corpus) -> str:
    """This module's and ``tiny_models``' sources, the size, the seed and the corpus (names and sizes of its files)."""
    from vllm_bole.testing import tiny_models

    digest = hashlib.sha256(f"{size}:{seed}:{torch.__version__}".encode())
    digest.update(Path(__file__).read_bytes())
    digest.update(Path(tiny_models.__file__).read_bytes())
    for group in corpus_files(corpus):
        for f in group:
            digest.update(f"{f.name}:{f.stat().st_size}".encode())
    return digest.hexdigest()[:12]


def trained_model_dir(size: str = "small", seed: int = 0, cache_dir: str | os.PathLike | None = None,
                      corpus: str | os.PathLike | None = None, log=print) -> str:
    """Train the ``size`` checkpoint once and return its cached directory (``cache_dir``, default
    ``tiny_models.cache_root()``), named by a hash of this module, the size, the seed and the corpus; trained in a
    temporary sibling and renamed into place, as ``tiny_models.tiny_model_dir``."""
    from vllm_bole.testing.tiny_models import cache_root, cached_build

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    name = f"trained-{size}-qwen3_5-s{seed}-{_version_hash(size, seed, corpus)}"

    def build(folder: Path) -> None:
        train(folder, size, seed=seed, corpus=corpus, log=log)
        report = json.loads((folder / "train_report.json").read_text()) | {"out": str(root / name)}
        (folder / "train_report.json").write_text(json.dumps(report, indent=1) + "\n")

    return cached_build(root, name, build)


def _fmt(metrics: dict) -> str:
    return " ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())


# ---------------------------------------------------------------------------
# Through vLLM
# ---------------------------------------------------------------------------


def code_prompts(model_dir: str, count: int = 16, prompt_tokens: int = 48, corpus=None, seed: int = 0
                 ) -> list[list[int]]:
    """Token-id prompts: runs of whole lines of held-out source (up to ``prompt_tokens`` tokens each), starting at
    seeded line numbers of the held-out files, one file after another."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    _, held = corpus_files(corpus)
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        lines = held[len(prompts) % len(held)].read_text(encoding="utf-8", errors="replace").splitlines(True)
        lines = [line for line in lines if line.strip()]
        first = rng.randrange(0, max(len(lines) - 40, 1))
        ids: list[int] = []
        for line in lines[first:]:
            more = tokenizer.encode(line).ids
            if len(ids) + len(more) > prompt_tokens:
                break
            ids += more
        if len(ids) >= prompt_tokens // 2:
            prompts.append(ids)
    return prompts


def _engine(spec: dict, out_dir: Path, name: str) -> dict:
    spec_path, out_path = out_dir / f"{name}.spec.json", out_dir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-m", "vllm_bole.testing.engine_run", "--spec", str(spec_path),
                           "--out", str(out_path)], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out_path.read_text())


def training_token_counts(model_dir: str, corpus=None):
    """Token id counts of the training files (never the held-out ones) under the checkpoint's tokenizer, as
    ``vllm-bole draft-vocab`` counts them (its ``most_frequent`` then keeps a draft vocabulary)."""
    from transformers import AutoTokenizer

    from vllm_bole.calibration.draft_vocab import count_tokens

    train_files, _ = corpus_files(corpus)
    return count_tokens(AutoTokenizer.from_pretrained(model_dir), train_files)


def measure(model_dir: str, max_tokens: int = 96, count: int = 16, chains=(1, 2, 3, 4), draft_vocabs=(),
            work_dir=None, log=print, timed: int = 0) -> dict:
    """Greedy decoding of :func:`code_prompts` without speculation, with vLLM's MTP chain for each ``k`` in
    ``chains`` and with Bole (its default, and depth 8 / topk 4 / 32 nodes per request): spec-decode counters
    (mean acceptance length = 1 + accepted / drafts) and whether each run's tokens equal the plain run's. Each
    size N in ``draft_vocabs`` adds the depth 8 / topk 4 row with ``draft_vocab`` N (the N lowest ids) and with
    the N most frequent ids of :func:`training_token_counts`, and ``"auto"`` the row with ``draft_vocab: "auto"``
    (learned during the run) and the default's row with the full vocabulary (the default drafts from "auto");
    ``draft_vocab_coverage`` is the share of the plain run's output tokens inside each subset (for "auto",
    ``auto_final``: the subset it ended with). ``timed``: that many more generates of the same requests in each
    engine, timed (``tok_s``: output tokens per second of the median one; a GPU's numbers, where
    ``VLLM_BOLE_TEST_CUDA_GRAPHS=1`` runs the engines with CUDA graphs)."""
    prompts = code_prompts(model_dir, count)
    requests = [{"prompt": p, "max_tokens": max_tokens} for p in prompts]
    batch = len(prompts)
    base = {"model": model_dir, "kind": "qwen3_5", "requests": requests, "logprobs": 2, "timed": timed}
    engine = {"max_num_seqs": batch}
    # the full vocabulary: the draft-vocabulary rows compare with it
    wide = {"method": "bole", "num_speculative_tokens": 8, "topk": 4, "budget": 32 * batch, "draft_vocab": None}
    configs = {"plain": {}}
    configs |= {f"mtp_k{k}": {"speculative_config": {"method": "mtp", "num_speculative_tokens": k}} for k in chains}
    configs |= {"bole_default": {"speculative_config": {"method": "bole"}},
                "bole_d8_t4_b32": {"speculative_config": wide}}
    work = Path(work_dir or tempfile.mkdtemp(prefix="train-small-measure-"))
    work.mkdir(parents=True, exist_ok=True)
    from vllm_bole.calibration.draft_vocab import most_frequent

    subsets = {}
    counts = training_token_counts(model_dir) if any(n != "auto" for n in draft_vocabs) else None
    for n in draft_vocabs:
        if n == "auto":   # learned while serving; its coverage: of the subset it ended with
            configs["bole_d8_t4_b32_auto"] = {"speculative_config": wide | {"draft_vocab": "auto"}}
            # the default ("auto" too) beside the full vocabulary
            configs["bole_default_full_vocab"] = {"speculative_config": {"method": "bole", "draft_vocab": None}}
            continue
        subsets[f"lowest{n}"] = set(range(n))
        configs[f"bole_d8_t4_b32_lowest{n}"] = {"speculative_config": wide | {"draft_vocab": n}}
        ids = most_frequent(counts, n)
        subsets[f"frequent{n}"] = set(ids)
        (work / f"frequent{n}.json").write_text(json.dumps(ids))
        configs[f"bole_d8_t4_b32_frequent{n}"] = {"speculative_config": wide | {
            "draft_vocab": str(work / f"frequent{n}.json")}}
    rows, plain = {}, None
    for name, extra in configs.items():
        t0 = time.perf_counter()
        out = _engine(base | {"engine": engine | extra}, work, name)
        tokens = [o["tokens"] for o in out["outputs"]]
        if plain is None:
            plain = tokens
        c = out["counters"]
        if name.endswith("_auto"):
            subsets["auto_final"] = set(out["draft_vocab"] or ())
        rows[name] = {"config": extra.get("speculative_config"), "identical": tokens == plain,
                      "identical_requests": sum(a == b for a, b in zip(tokens, plain)),
                      "mean_acceptance_length": c["mean_acceptance_length"], "num_drafts": c["num_drafts"],
                      "num_draft_tokens": c["num_draft_tokens"], "num_accepted_tokens": c["num_accepted_tokens"],
                      "accepted_per_pos": c["accepted_per_pos"], "seconds": round(time.perf_counter() - t0, 1),
                      **({"tok_s": out["timed"]["tok_s"], "timed_runs_s": out["timed"]["runs_s"]} if timed else {})}
        log(f"{name}: {json.dumps(rows[name])}")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    produced = [t for out in plain for t in out]
    coverage = {name: round(sum(t in ids for t in produced) / len(produced), 4) for name, ids in subsets.items()}
    return {"model": model_dir, "prompts": len(prompts), "max_tokens": max_tokens, "batch": batch, "rows": rows,
            **({"draft_vocab_coverage": coverage} if coverage else {}),
            "sample": [{"prompt": tok.decode(p), "output": tok.decode(o)} for p, o in zip(prompts[:3], plain[:3])]}


def measure_shared_prefix(model_dir: str, blocks: int = 4, count: int = 8, max_tokens: int = 96, work_dir=None,
                          log=print) -> dict:
    """What a prefix-cache hit costs Bole's acceptance where requests diverge exactly at a block boundary, the one
    place its drafter reads a stale entry: with prefix caching Bole looks prefixes up as vLLM does without a drafter
    (``_vllm_compat.hit_as_without_drafter``), so the MTP drafter's K/V at the last cached position is the one the
    request that cached the block computed, with that request's next token. ``count`` requests share ``blocks``
    blocks of held-out code and continue with different held-out lines; one request at a time (``max_num_seqs``
    1), so each after the first hits the shared blocks. Bole's default with and without prefix caching, and vLLM
    without speculation: mean acceptance length, cached tokens and whether the tokens equal the plain run's, and
    whether Bole's tokens are the same with and without prefix caching."""
    work = Path(work_dir or tempfile.mkdtemp(prefix="train-small-prefix-"))
    work.mkdir(parents=True, exist_ok=True)
    base = {"model": model_dir, "kind": "qwen3_5", "logprobs": 2}
    probe = _engine(base | {"requests": [{"prompt": [7, 8, 9], "max_tokens": 1}],
                            "engine": {"enable_prefix_caching": True}}, work, "block_size")
    block = probe["block_size"]
    shared = [t for p in code_prompts(model_dir, count=8, prompt_tokens=256, seed=1) for t in p][:blocks * block]
    if len(shared) < blocks * block:
        raise ValueError(f"held-out prompts hold {len(shared)} tokens, fewer than {blocks} blocks of {block}")
    requests = [{"prompt": shared + suffix, "max_tokens": max_tokens} for suffix in code_prompts(model_dir, count)]
    configs = {"plain": {}, "bole": {"speculative_config": {"method": "bole"}},
               "bole_prefix_caching": {"speculative_config": {"method": "bole"}, "enable_prefix_caching": True}}
    rows, tokens_of = {}, {}
    for name, extra in configs.items():   # (plain first: the others' tokens are compared with its)
        engine = {"max_num_seqs": 1, "max_model_len": len(shared) + 64 + max_tokens, "enable_prefix_caching": False}
        engine |= extra
        out = _engine(base | {"requests": requests, "engine": engine}, work, name)
        tokens = tokens_of[name] = [o["tokens"] for o in out["outputs"]]
        c = out["counters"]
        rows[name] = {"identical_requests": sum(a == b for a, b in zip(tokens, tokens_of["plain"])),
                      "cached_tokens": [o["cached_tokens"] for o in out["outputs"]],
                      "mean_acceptance_length": c["mean_acceptance_length"], "num_drafts": c["num_drafts"],
                      "num_accepted_tokens": c["num_accepted_tokens"], "accepted_per_pos": c["accepted_per_pos"]}
        log(f"{name}: {json.dumps(rows[name])}")
    return {"model": model_dir, "block_size": block, "shared_tokens": len(shared), "requests": count,
            "max_tokens": max_tokens, "rows": rows,
            # where Bole with prefix caching reads a stale drafter entry, its tokens could change only by near-ties
            "tokens_equal_with_prefix_caching": tokens_of["bole"] == tokens_of["bole_prefix_caching"]}


def check(model_dir: str, num_speculative_tokens: int = 2, max_tokens: int = 24) -> dict:
    """Load the checkpoint in vLLM (in this process) with MTP speculation and generate greedily from a few code
    prompts. Reports the outputs, the spec-decode counters, whether every ``mtp.*`` tensor vLLM's MTP model read
    equals the saved one (``mtp_weights_equal``: vLLM's CPU linear layers repack their weights, so they are
    compared as the loader hands them over) and whether its loader covered all of the MTP model's parameters."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.model_executor.models import qwen3_5_mtp

    from vllm_bole.testing.greedy_check import spec_decode_counters
    from vllm_bole.testing.tiny_models import engine_kwargs

    read: dict[str, torch.Tensor] = {}
    loaded: dict[str, set] = {}
    load_weights = qwen3_5_mtp.Qwen3_5MTP.load_weights

    def recording_load_weights(self, weights):
        def record(items):
            for name, tensor in items:
                if name.startswith("mtp."):
                    read[name] = tensor.detach().cpu().clone()
                yield name, tensor

        names = load_weights(self, record(weights))
        loaded["params"] = {n for n, _ in self.named_parameters()}
        loaded["loaded"] = set(names)
        return names

    qwen3_5_mtp.Qwen3_5MTP.load_weights = recording_load_weights
    try:
        llm = LLM(model=model_dir, disable_log_stats=False, **(engine_kwargs("qwen3_5") | {"speculative_config": {
            "method": "mtp", "num_speculative_tokens": num_speculative_tokens}}))
    finally:
        qwen3_5_mtp.Qwen3_5MTP.load_weights = load_weights
    prompts = code_prompts(model_dir, 4, prompt_tokens=32)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    saved = {k: v for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items() if k.startswith("mtp.")}
    equal = {k: bool(k in read and torch.equal(read[k].to(v.dtype), v)) for k, v in saved.items()}
    return {"outputs": [list(o.outputs[0].token_ids) for o in outs], "mtp_weights_equal": equal,
            "mtp_params_not_loaded": sorted(loaded.get("params", {"?"}) - loaded.get("loaded", set())),
            "counters": spec_decode_counters(llm.get_metrics())}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="train and write the checkpoint here (default: train once into the cache "
                        "and print its directory)")
    parser.add_argument("--size", choices=sorted(SIZES), default="small")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--corpus", help="directory of *.py files (default: this Python's standard library)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 is fastest on a busy 2-core machine)")
    parser.add_argument("--max-seconds", type=float, help="stop training early after this long (a safety cap)")
    parser.add_argument("--stop-after", type=int, help="stop after this many steps of the --steps schedule")
    parser.add_argument("--check", metavar="DIR", help="load DIR in vLLM with MTP and print a JSON report")
    parser.add_argument("--measure", metavar="DIR", help="acceptance through vLLM on held-out code prompts")
    parser.add_argument("--measure-shared-prefix", metavar="DIR",
                        help="Bole's acceptance where prefix-cache hits end at a block boundary requests diverge at")
    parser.add_argument("--shared-blocks", type=int, default=4,
                        help="--measure-shared-prefix: the blocks the requests share")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--chains", default="1,2,3,4", help="--measure: vLLM MTP chain lengths ('' for none)")
    parser.add_argument("--draft-vocab", default="",
                        help="--measure: draft_vocab sizes to add (each as the lowest ids and as the most frequent), "
                             "and 'auto' (learned during the run)")
    parser.add_argument("--timed", type=int, default=0,
                        help="--measure: timed generates per engine after the measured one (tok/s; for a GPU)")
    parser.add_argument("--report", help="write the --check / --measure / --measure-shared-prefix JSON here too")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.check or args.measure or args.measure_shared_prefix:
        sizes = lambda text: tuple(x if x == "auto" else int(x) for x in text.split(",") if x)   # noqa: E731
        if args.check:
            report = check(args.check)
        elif args.measure_shared_prefix:
            report = measure_shared_prefix(args.measure_shared_prefix, blocks=args.shared_blocks,
                                           max_tokens=args.max_tokens)
        else:
            report = measure(args.measure, max_tokens=args.max_tokens, chains=sizes(args.chains),
                             draft_vocabs=sizes(args.draft_vocab), timed=args.timed)
        text = json.dumps(report, indent=1)
        if args.report:
            Path(args.report).write_text(text + "\n")
        print(text)
        return
    if not args.out:
        print(trained_model_dir(args.size, args.seed, corpus=args.corpus, log=lambda s: print(s, flush=True)))
        return
    train(args.out, args.size, args.steps, args.seed, args.corpus, log=lambda s: print(s, flush=True),
          max_seconds=args.max_seconds, stop_after=args.stop_after)


if __name__ == "__main__":
    main()
