"""The offline tiny-checkpoint builder: configs, tokenizer, weight names and shaping.

The vLLM-facing tests construct vLLM's own model classes (no engine) and load the
checkpoint through their ``load_weights``; the ``vllm``-marked test starts engines.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_bole.testing import engine_kwargs, tiny_model_dir
from vllm_bole.testing.tiny_models import EOS_TOKEN, SPECIAL_TOKENS, main


@pytest.fixture
def stock_vllm(monkeypatch):
    """vLLM without plugins, offline, with a small CPU KV cache."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_PLUGINS", "")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def tiny_dirs(tiny_qwen3_5_dir) -> dict[str, str]:
    cache = Path(tiny_qwen3_5_dir).parent
    return {"qwen3_5": tiny_qwen3_5_dir, "qwen3_5_moe": tiny_model_dir("qwen3_5_moe", cache_dir=cache),
            "qwen3_next": tiny_model_dir("qwen3_next", cache_dir=cache)}


def _weights(model_dir: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def test_cache_builds_once_and_cli_writes_a_checkpoint(tmp_path, capsys):
    first = tiny_model_dir("qwen3_5", cache_dir=tmp_path)
    stamp = (Path(first) / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir("qwen3_5", cache_dir=tmp_path) == first
    assert (Path(first) / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [Path(first).name]  # no staging left

    main(["--kind", "qwen3_next", "--out", str(tmp_path / "next")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "next")
    assert {p.name for p in (tmp_path / "next").iterdir()} == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_same_seed_gives_same_weights(tmp_path, tiny_qwen3_5_dir):
    from vllm_bole.testing import build_tiny_qwen3_5

    again = _weights(build_tiny_qwen3_5(tmp_path / "again"))
    reference = _weights(tiny_qwen3_5_dir)
    assert again.keys() == reference.keys()
    assert all(torch.equal(again[k], reference[k]) for k in reference)
    other = _weights(build_tiny_qwen3_5(tmp_path / "other", seed=1))
    assert not torch.equal(other["lm_head.weight"], reference["lm_head.weight"])


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_vllm_parses_config(tiny_dirs, kind, stock_vllm):
    from vllm.transformers_utils.config import get_config

    config = get_config(tiny_dirs[kind], trust_remote_code=False)
    text = config.get_text_config()
    assert type(config).__name__ == {"qwen3_5": "Qwen3_5Config", "qwen3_5_moe": "Qwen3_5MoeConfig",
                                     "qwen3_next": "Qwen3NextConfig"}[kind]
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (2, 4)
    assert text.mamba_ssm_dtype == "float32"
    if kind == "qwen3_next":
        assert config.num_nextn_predict_layers == 1
    else:
        assert text.mtp_num_hidden_layers == 1
    if kind != "qwen3_5":
        assert text.num_experts == 4 and text.shared_expert_intermediate_size > 0


def test_tokenizer_round_trips_text(tiny_qwen3_5_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_5_dir)
    config = json.loads((Path(tiny_qwen3_5_dir) / "config.json").read_text())
    for text in [
        "The river starts high in the hills.",
        "  leading spaces, tabs\tand\nnewlines  ",
        "Unicode: naïve café — 東京 🚀",
        "",
    ]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == text
    assert len(tokenizer) <= config["text_config"]["vocab_size"]
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.eos_token_id == config["text_config"]["eos_token_id"]
    assert all(tokenizer.convert_tokens_to_ids(t) < len(SPECIAL_TOKENS) for t in SPECIAL_TOKENS)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_lm_head_gives_each_token_a_pair_of_successors(tiny_qwen3_5_dir):
    from transformers import AutoTokenizer

    weights = {k: v.float() for k, v in _weights(tiny_qwen3_5_dir).items()}
    embed, head = weights["model.language_model.embed_tokens.weight"], weights["lm_head.weight"]
    num_tokens = len(AutoTokenizer.from_pretrained(tiny_qwen3_5_dir))
    hidden = embed[:num_tokens] / embed[:num_tokens].pow(2).mean(-1, keepdim=True).sqrt()
    top = (hidden @ head.T).topk(3)
    # Two successors near logit_scale, the third far below; never a special token or unused id.
    assert (top.values[:, 1] > 10).all() and (top.values[:, 2] < 0.7 * top.values[:, 1]).all()
    assert (top.indices[:, :2] >= len(SPECIAL_TOKENS)).all() and (top.indices[:, :2] < num_tokens).all()
    assert head[:len(SPECIAL_TOKENS)].abs().sum() == 0 and head[num_tokens:].abs().sum() == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("part", ["target", "mtp"])
def test_checkpoint_covers_every_vllm_parameter(tiny_dirs, kind, part, stock_vllm):
    """Build vLLM's target / MTP model class (no engine) and load the checkpoint into it."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator
    from vllm.utils.torch_utils import set_default_torch_dtype

    model_dir = tiny_dirs[kind]
    vllm_config = EngineArgs(
        model=model_dir,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        **engine_kwargs(kind),
    ).create_engine_config()
    if part == "mtp":
        model_config = vllm_config.speculative_config.draft_model_config
    else:
        model_config = vllm_config.model_config
    with set_current_vllm_config(vllm_config), set_default_torch_dtype(torch.bfloat16):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{_free_port()}", 0, backend="gloo")
        destroy_model_parallel()  # the expert-parallel group depends on the model
        initialize_model_parallel(1, 1)
        model = initialize_model(vllm_config=vllm_config, model_config=model_config)
        files = [str(Path(model_dir) / "model.safetensors")]
        loaded = model.load_weights(safetensors_weights_iterator(files, use_tqdm_on_load=False))
    # FusedMoE registers its weights under `routed_experts` but reports them without it, and
    # once per tensor rather than per expert: expert coverage is checked on the names below.
    expected = {name.replace(".routed_experts.", ".") for name, _ in model.named_parameters()}
    assert expected - loaded == set()
    assert loaded - expected == set()
    if kind != "qwen3_5":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config", config)
        if part == "mtp":
            layers = ["mtp.layers.0"]
        else:
            prefix = "model.language_model" if kind == "qwen3_5_moe" else "model"
            layers = [f"{prefix}.layers.{i}" for i in range(config["num_hidden_layers"])]
        experts = {n for n in _weights(model_dir) if ".mlp.experts." in n and n.startswith(tuple(layers))}
        assert experts == {
            f"{layer}.mlp.experts.{e}.{proj}.weight"
            for layer in layers
            for e in range(config["num_experts"])
            for proj in ("gate_proj", "up_proj", "down_proj")
        }
    assert type(model).__name__ == {
        ("qwen3_5", "target"): "Qwen3_5ForConditionalGeneration",
        ("qwen3_5", "mtp"): "Qwen3_5MTP",
        ("qwen3_5_moe", "target"): "Qwen3_5MoeForConditionalGeneration",
        ("qwen3_5_moe", "mtp"): "Qwen3_5MoeMTP",
        ("qwen3_next", "target"): "Qwen3NextForCausalLM",
        ("qwen3_next", "mtp"): "Qwen3NextMTP",
    }[kind, part]


@pytest.mark.vllm
def test_mtp_matches_plain_greedy_with_high_acceptance(tiny_qwen3_5_dir, tmp_path):
    """Stock vLLM (no plugins) with its own MTP against itself without speculation: the tiny model's MTP layer is
    trained-like enough for a high acceptance and no greedy near-ties. Runs in a fresh process with the engine core
    in-process, as the other engine tests: an engine core spawned from the test process could not start on one
    machine (it died importing transformers) while it started everywhere else."""
    report = tmp_path / "greedy_check.json"
    env = dict(os.environ, VLLM_PLUGINS="", HF_HUB_OFFLINE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "vllm_bole.testing.greedy_check", "--model", tiny_qwen3_5_dir, "--max-tokens", "24",
         "--spec", json.dumps({"method": "mtp", "num_speculative_tokens": 3}), "--report", str(report)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert report.exists(), f"greedy_check failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}"
    result = json.loads(report.read_text())
    assert [c["status"] for c in result["comparisons"]] == ["identical"] * len(result["plain_texts"])
    assert proc.returncode == 0
    assert result["min_top2_gap"] > 0.3  # no bf16 near-ties
    assert result["spec_decode"]["acceptance_rate"] > 0.5
