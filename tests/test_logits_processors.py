"""Requests with logits processors through Bole equal vLLM without speculation (CPU, tiny Qwen3.5, greedy).

vLLM 0.26 rejects min_p and logit_bias with its own speculative methods (its rejection sampler does not apply
them to drafts). Bole builds vLLM's built-in logits processors and applies them itself: each tree row of a request
with a logit bias, penalties, bad words, allowed token ids or min_tokens is processed as vLLM would process the
request with the row's path appended to its output (min_tokens requests verify only their roots under async
scheduling); min-p shapes a sampled request's tree rows and leaves a greedy one's argmax alone.
"""

import pytest

from e2e_support import (assert_lossless, random_requests, run_engine, sync_and_async_runs, vocab_size,
                          write_oracle)

pytestmark = pytest.mark.vllm


def test_front_end_accepts_min_p_and_logit_bias_for_bole_only(tiny_qwen3_5_dir):
    """vLLM's request validation, as its input processor runs it: a Bole engine takes min_p and logit_bias, an MTP
    chain engine still rejects them, and the processor keeps its speculative config."""
    from types import SimpleNamespace

    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.engine.input_processor import InputProcessor

    from vllm_bole import plugin

    plugin.register()

    def validate(spec, params):
        cfg = EngineArgs(model=tiny_qwen3_5_dir, language_model_only=True, enable_prefix_caching=False,
                         speculative_config=spec).create_engine_config()
        processor = SimpleNamespace(vllm_config=cfg, model_config=cfg.model_config,
                                    speculative_config=cfg.speculative_config,
                                    structured_outputs_config=cfg.structured_outputs_config, tokenizer=None,
                                    use_v2_model_runner=False)
        InputProcessor._validate_params(processor, params, ("generate",))
        assert processor.speculative_config is cfg.speculative_config is not None

    for params in (SamplingParams(min_p=0.1), SamplingParams(logit_bias={3: 2.0})):
        validate({"method": "bole"}, params)
        with pytest.raises(ValueError, match="min_p and logit_bias sampling parameters are not yet supported"):
            validate({"method": "mtp", "num_speculative_tokens": 2}, params)


def _lossless_runs(tmp_path, model: str, requests: list[dict], ref: dict) -> dict[str, dict]:
    """The requests through Bole, planted trees scheduled synchronously and MTP trees under async scheduling; each
    run's outputs equal ``ref`` (vLLM without speculation) and some drafts were accepted."""
    write_oracle(tmp_path, requests, ref)
    runs = {}
    for name, spec in sync_and_async_runs(tmp_path).items():
        out = runs[name] = run_engine(tmp_path, name, {"model": model, "requests": requests, "logprobs": 2, **spec})
        assert_lossless(ref, out, max_near_ties=2)
        print(f"{name}: counters {out['counters']}, scheduling {out['scheduling']}")
        assert out["counters"]["num_accepted_tokens"] > 0, out["counters"]
    return runs


def test_logit_bias_and_min_p_requests_are_lossless(tmp_path, tiny_qwen3_5_dir):
    model = tiny_qwen3_5_dir
    vocab = vocab_size(model)
    requests = random_requests(vocab, [5, 12, 30, 7, 9, 16, 11, 6], 32, seed=5)
    requests.append(dict(requests[0]))   # request 0 without its bias: the bias must change the output
    bias = {str(t): 20.0 for t in range(vocab // 2, vocab, 9)}   # the tiny model's top token leads by 7-10 nats
    requests[0]["logit_bias"] = bias
    requests[1]["logit_bias"] = {str(t): -100.0 for t in range(10, vocab // 2, 3)}
    requests[2]["min_p"] = 0.5   # greedy: min-p keeps the argmax
    allowed = list(range(100, 700, 23))   # (the tokenizer has fewer tokens than the model vocabulary)
    requests[3] |= {"allowed_token_ids": allowed, "min_tokens": 8, "stop_token_ids": allowed[:3]}
    requests[4] |= {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    requests[5]["repetition_penalty"] = 3.0
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 2,
                                       "engine": {"max_num_seqs": 8}})
    outputs = [o["tokens"] for o in ref["outputs"]]
    assert outputs[0] != outputs[-1]
    assert all(t >= vocab // 2 and (t - vocab // 2) % 9 == 0 for t in outputs[0]), outputs[0]
    assert not any(10 <= t < vocab // 2 and (t - 10) % 3 == 0 for t in outputs[1]), outputs[1]
    assert set(outputs[3]) <= set(allowed) and len(outputs[3]) >= 8, outputs[3]
    runs = _lossless_runs(tmp_path, model, requests, ref)
    assert runs["mtp_async"]["scheduling"]["scheduler"] == "BoleAsyncScheduler"
    assert runs["mtp_async"]["scheduling"]["batch_queue"]


def _successor_bigrams(model: str, tok) -> dict[str, tuple[int, int]]:
    """Strings of (token, its first successor under the tiny model's head) that the tokenizer encodes back to
    exactly those two tokens, as vLLM encodes a bad word, with the two tokens."""
    from safetensors.torch import load_file

    weights = load_file(f"{model}/model.safetensors")
    embed = weights["model.language_model.embed_tokens.weight"].float()
    head = weights["lm_head.weight"].float()
    n = len(tok)
    hidden = embed[:n] / embed[:n].pow(2).mean(-1, keepdim=True).sqrt()
    first = (hidden @ head.T).argmax(dim=-1).tolist()
    from vllm_bole.testing.tiny_models import SPECIAL_TOKENS

    words = {}
    for a in range(len(SPECIAL_TOKENS), n):
        text = tok.decode([a, first[a]])
        # (vLLM encodes a bad word with its leading spaces stripped)
        if (text.strip() == text and "\ufffd" not in text
                and tok.encode(text, add_special_tokens=False) == [a, first[a]]):
            words[text] = (a, first[a])
    assert len(words) > 100, len(words)
    return words


def test_penalty_bias_bad_words_and_min_tokens_requests_walk_their_trees(tmp_path, tiny_qwen3_5_dir):
    """Every tree row of such a request is processed with the row's path appended to the output: with planted
    trees (the true continuation under random siblings) they accept deep, and the outputs equal vLLM's without
    speculation, synchronous and async."""
    from transformers import AutoTokenizer

    model = tiny_qwen3_5_dir
    vocab = vocab_size(model)
    tok = AutoTokenizer.from_pretrained(model)
    requests = random_requests(vocab, [9, 14, 6, 21, 11], 40, seed=11)
    requests[0] |= {"presence_penalty": 1.5, "frequency_penalty": 0.7}
    requests[1]["repetition_penalty"] = 2.5
    allowed = list(range(100, 700, 23))
    requests[2] |= {"allowed_token_ids": allowed, "min_tokens": 12, "stop_token_ids": allowed[:3]}
    requests[3]["logit_bias"] = {str(t): 9.0 for t in range(vocab // 2, vocab, 5)}
    # one-token words (masked at every row) and two-token ones (masked after their first token, on a row's path)
    # Two-token bad words (a, b), b one of the two successors the tiny model's head gives a: after a, b is masked,
    # so a row whose path ends in a must mask b (the path's tokens are part of the row's output).
    bigrams = _successor_bigrams(model, tok)
    requests[4]["bad_words"] = list(bigrams)
    ref = run_engine(tmp_path, "ref", {"model": model, "requests": requests, "logprobs": 2,
                                       "engine": {"max_num_seqs": 8}})
    outputs = [o["tokens"] for o in ref["outputs"]]
    assert set(outputs[2]) <= set(allowed) and len(outputs[2]) >= 12, outputs[2]
    runs = _lossless_runs(tmp_path, model, requests, ref)
    # Every request has such settings: a root-only walk would give exactly 1 token per step. The planted drafter
    # hides the true continuation to a random depth of up to 4 (a mean of about 2.8 tokens per step).
    assert runs["planted_sync"]["counters"]["mean_acceptance_length"] > 2.2, runs["planted_sync"]["counters"]

    # Sampled (temperature 0.8: the tiny model's logits are sharp, so MTP drafts are accepted), with the bad words
    # and a presence penalty: the drawn rows are processed too, so no emitted pair is a bad word.
    sampled = [dict(r, temperature=0.8, seed=i, presence_penalty=0.5, bad_words=list(bigrams))
               for i, r in enumerate(random_requests(vocab, [7, 10, 13, 8], 40, seed=12))]
    spec = sync_and_async_runs(tmp_path)["mtp_async"]
    out = run_engine(tmp_path, "sampled_mtp_async", {"model": model, "requests": sampled, **spec})
    banned = set(bigrams.values())
    for o in out["outputs"]:
        assert len(o["tokens"]) == 40 and not banned & set(zip(o["tokens"], o["tokens"][1:])), o["tokens"]
    assert out["counters"]["num_accepted_tokens"] > 0, out["counters"]
