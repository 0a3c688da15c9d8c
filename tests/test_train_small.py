"""The trained stand-in (vllm_bole.testing.train_small) at its tiny size: training lowers the losses, is seeded,
writes the checkpoint names vLLM loads, and vLLM runs it with MTP speculation on its trained MTP weights."""

import contextlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from vllm_bole.testing import train_small


@contextlib.contextmanager
def one_thread():
    """Train on one torch thread: on a busy 2-core machine it ran 2-10x faster than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train_small") / "tiny"
    with one_thread():
        result = train_small.train(out, "tiny", seed=0, log=lambda s: None)
    return out, result


def test_losses_fall(trained):
    out, result = trained
    curve = result.curve
    assert len(curve) == train_small.SIZES["tiny"].steps
    first, last = curve[0], curve[-1]
    assert last["main_loss"] < first["main_loss"] - 0.5, curve
    assert last["mtp_loss"] < first["mtp_loss"] - 0.5, curve
    assert result.final_eval["main_loss"] < result.initial_eval["main_loss"] - 0.3
    assert result.final_eval["mtp_loss"] < result.initial_eval["mtp_loss"] - 0.3
    report = json.loads((out / "train_report.json").read_text())
    assert report["final_eval"] == result.final_eval and len(report["curve"]) == len(curve)


def test_checkpoint_layout(trained):
    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    text = config["text_config"]
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert text["mtp_num_hidden_layers"] == 1 and text["rope_parameters"]["mrope_interleaved"]
    weights = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    mtp = {k for k in weights if k.startswith("mtp.")}
    assert {"mtp.fc.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight"} <= mtp
    assert weights["mtp.fc.weight"].shape == (text["hidden_size"], 2 * text["hidden_size"])
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" in weights
    assert "model.language_model.layers.3.self_attn.q_norm.weight" in weights
    assert set(weights) - mtp - {"lm_head.weight"} == {k for k in weights if k.startswith("model.language_model.")}
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()


def test_seeded(tmp_path):
    with one_thread():
        a = train_small.train(tmp_path / "a", "tiny", steps=2, seed=3, log=lambda s: None)
        b = train_small.train(tmp_path / "b", "tiny", steps=2, seed=3, log=lambda s: None)
    assert a.curve == b.curve
    wa, wb = (load_file(str(tmp_path / n / "model.safetensors")) for n in "ab")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_mtp_reads_the_next_token(trained):
    """The MTP forward at slot t depends on token t+1 and on nothing after it (causal)."""
    out, _ = trained
    config = json.loads((out / "config.json").read_text())
    target, mtp = train_small.build_model(config, seed=0)
    ids = torch.randint(10, 900, (1, 20), generator=torch.Generator().manual_seed(0))
    changed = ids.clone()
    changed[0, 11] = (ids[0, 11] + 1) % 900 + 10
    with torch.no_grad():
        _, a = train_small.forward(target, mtp, ids)
        _, b = train_small.forward(target, mtp, changed)
    assert torch.allclose(a[0, :10], b[0, :10], rtol=0, atol=1e-5)   # slots before 10 see tokens up to 10
    assert not torch.allclose(a[0, 10], b[0, 10])     # slot 10 reads the embedding of token 11


@pytest.mark.vllm
def test_vllm_runs_the_trained_mtp(trained, tmp_path):
    pytest.importorskip("vllm")
    out, _ = trained
    report = tmp_path / "check.json"
    env = dict(os.environ, VLLM_PLUGINS="", HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, "-m", "vllm_bole.testing.train_small", "--check", str(out),
                           "--report", str(report)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(report.read_text())
    assert [len(o) for o in result["outputs"]] == [24] * 4
    assert result["mtp_weights_equal"] and all(result["mtp_weights_equal"].values()), result["mtp_weights_equal"]
    assert result["mtp_params_not_loaded"] == [], result["mtp_params_not_loaded"]
    counters = result["counters"]
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == 2 * counters["num_drafts"]
    assert counters["num_accepted_tokens"] > 0, counters


@pytest.mark.vllm
def test_bole_default_is_lossless_on_the_stand_in(trained, tmp_path):
    """Bole as a user starts it (``{"method": "bole"}``) on the trained checkpoint: greedy outputs equal vLLM's
    without speculation (bf16 near-ties aside), drafted by the checkpoint's own MTP head."""
    from e2e_support import assert_lossless

    out, _ = trained
    requests = [{"prompt": p, "max_tokens": 32} for p in train_small.code_prompts(str(out), count=8, prompt_tokens=32)]
    base = {"model": str(out), "kind": "qwen3_5", "requests": requests, "logprobs": 2}
    plain = train_small._engine(base | {"engine": {"max_num_seqs": 8}}, tmp_path, "plain")
    bole = train_small._engine(base | {"timed": 2, "engine": {"max_num_seqs": 8,
                                                              "speculative_config": {"method": "bole"}}},
                               tmp_path, "bole")
    assert_lossless(plain, bole, max_near_ties=2)
    counters = bole["counters"]
    assert counters["num_drafts"] > 0 and counters["num_accepted_tokens"] > 0, counters
    # (--measure --timed: the same requests again, timed; greedy, so as many tokens as the first generate)
    timed = bole["timed"]
    assert len(timed["runs_s"]) == 2 and timed["output_tokens"] == sum(len(o["tokens"]) for o in bole["outputs"])
    assert timed["tok_s"] > 0 and "timed" not in plain


@pytest.mark.vllm
def test_measure_shared_prefix_hits_the_shared_blocks(trained, tmp_path):
    """``--measure-shared-prefix`` on the stand-in: every request after the first reads the shared block from the
    prefix cache (Bole looks prefixes up as vLLM does without a drafter: the whole block, not one block less), and
    Bole's trees accept drafts of the checkpoint's MTP head."""
    out, _ = trained
    report = train_small.measure_shared_prefix(str(out), blocks=1, count=3, max_tokens=16, work_dir=tmp_path,
                                               log=lambda s: None)
    block, rows = report["block_size"], report["rows"]
    assert report["shared_tokens"] == block
    assert rows["bole_prefix_caching"]["cached_tokens"] == [0, block, block], rows["bole_prefix_caching"]
    assert rows["bole"]["cached_tokens"] == [0, 0, 0]
    assert rows["bole"]["num_drafts"] > 0 and rows["bole"]["num_accepted_tokens"] > 0, rows["bole"]
    # greedy: Bole's tokens are the plain run's, a bf16 near-tie aside (test_bole_default_is_lossless_on_the_stand_in)
    assert rows["plain"]["identical_requests"] == 3, rows
    assert rows["bole"]["identical_requests"] >= 2 and rows["bole_prefix_caching"]["identical_requests"] >= 2, rows
