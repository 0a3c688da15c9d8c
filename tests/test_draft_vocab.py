"""The MTP drafter's draft vocabulary (``draft_vocab``): which ids it holds, and that the drafter's top children
are those of the target's logits over exactly these ids."""

import json
from types import SimpleNamespace

import pytest
import torch

from vllm_bole.config import BoleConfigError, parse_bole_config
from vllm_bole.spec_decode.draft_vocab import DraftVocab, draft_token_ids, eos_token_ids
from vllm_bole.spec_decode.mtp_tree_drafter import MTPTreeDrafter


def test_ids_of_a_count_and_of_a_file(tmp_path):
    assert draft_token_ids(4, 100, {97}).tolist() == [0, 1, 2, 3, 97]
    assert draft_token_ids(4, 100, {2, 500}).tolist() == [0, 1, 2, 3]   # ids past the vocabulary are dropped
    path = tmp_path / "ids.json"
    path.write_text(json.dumps([40, 7, 7, 12]))
    assert draft_token_ids(str(path), 100, {99}).tolist() == [7, 12, 40, 99]


@pytest.mark.parametrize("content,match", [
    ("[1, 200]", r"token ids in \[0, 100\)"), ("[]", "non-empty"), ('{"a": 1}', "JSON list"), ("[1.5]", "token ids"),
    ("not json", "cannot read")])
def test_bad_files_name_the_field(tmp_path, content, match):
    path = tmp_path / "ids.json"
    path.write_text(content)
    with pytest.raises(BoleConfigError, match=match) as e:
        draft_token_ids(str(path), 100, set())
    assert "speculative_config.draft_vocab" in str(e.value) and "\n" not in str(e.value)


def test_auto_starts_from_an_eighth_of_the_lowest_ids():
    assert draft_token_ids("auto", 80, {79}).tolist() == list(range(10)) + [79]
    cfg, _ = parse_bole_config({"method": "bole", "draft_vocab": "auto"})
    assert cfg.draft_vocab == "auto"
    with pytest.raises(BoleConfigError, match='a token count, "auto" or the path'):
        parse_bole_config({"method": "bole", "draft_vocab": "autox"})


def test_auto_follows_the_emitted_tokens_in_place():
    """``draft_vocab: "auto"``: every REFRESH_STEPS steps the subset becomes the most emitted ids (the EOS id
    always in), with the full head's rows, written into the same tensors (the drafter's graphs read them by
    address); older counts fade, so a change of traffic moves it."""
    from vllm_bole.spec_decode import draft_vocab as dv

    gen = torch.Generator().manual_seed(1)
    vocab, hidden = 96, 8
    head = _head(vocab, hidden, gen)
    model = SimpleNamespace(lm_head=head, logits_processor=SimpleNamespace(scale=1.0, soft_cap=None))
    model_config = SimpleNamespace(get_vocab_size=lambda: vocab, hf_text_config=SimpleNamespace(eos_token_id=95),
                                   try_get_generation_config=lambda: {})
    draft = DraftVocab.of_model(model, "auto", model_config, tp_size=1)
    assert draft.ids.tolist() == list(range(12)) + [95] and draft.adaptive is not None
    ptrs = draft.ids.data_ptr(), draft.weight.data_ptr()
    hot = torch.arange(40, 52)
    for step in range(1, dv.REFRESH_STEPS + 1):   # 3 emissions of each per step
        draft.observe(torch.cat([hot, hot, hot]))
        assert draft.refreshes == (step >= dv.FIRST_REFRESH) + (step >= dv.REFRESH_STEPS), step
        if step == dv.FIRST_REFRESH:
            assert (draft.ids.data_ptr(), draft.weight.data_ptr()) == ptrs
            assert draft.ids.tolist() == hot.tolist() + [95]   # the 12 emitted ids and the EOS id
            assert torch.equal(draft.weight, head.weight[draft.ids])
    # The traffic moves: other ids, once each per step. Three refreshes later they have been emitted as often
    # as the first ones were, which only the fading counts put first.
    for _ in range(3 * dv.REFRESH_STEPS):
        draft.observe(torch.arange(60, 72))
    assert draft.refreshes == 5 and draft.ids.tolist() == list(range(60, 72)) + [95]
    assert torch.equal(draft.weight, head.weight[draft.ids])
    fixed = DraftVocab.of_model(model, 12, model_config, tp_size=1)
    fixed.observe(hot)   # a fixed subset stays
    assert fixed.adaptive is None and fixed.ids.tolist() == list(range(12)) + [95]


def test_a_count_past_the_vocabulary_fails():
    with pytest.raises(BoleConfigError, match="at most the vocabulary size 100"):
        draft_token_ids(101, 100, set())


def test_eos_ids_of_config_and_generation_config():
    cfg = SimpleNamespace(hf_text_config=SimpleNamespace(eos_token_id=5),
                          try_get_generation_config=lambda: {"eos_token_id": [6, 7]})
    assert eos_token_ids(cfg) == {5, 6, 7}

    def missing():
        raise OSError("no generation config")

    assert eos_token_ids(SimpleNamespace(hf_text_config=SimpleNamespace(), try_get_generation_config=missing)) == set()


def _head(vocab: int, hidden: int, gen: torch.Generator):
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    weight = torch.randn(vocab, hidden, generator=gen)
    return SimpleNamespace(weight=weight, quant_method=UnquantizedEmbeddingMethod())


@pytest.mark.parametrize("seed", range(3))
def test_top_children_are_the_targets_over_the_draft_ids(seed):
    gen = torch.Generator().manual_seed(seed)
    vocab, hidden, k = 300, 16, 4
    head = _head(vocab, hidden, gen)
    model = SimpleNamespace(lm_head=head, logits_processor=SimpleNamespace(scale=1.0, soft_cap=None),
                            compute_logits=lambda h: h @ head.weight.T)
    model_config = SimpleNamespace(get_vocab_size=lambda: vocab, hf_text_config=SimpleNamespace(eos_token_id=299),
                                   try_get_generation_config=lambda: {})
    size = int(torch.randint(k, 120, (1,), generator=gen))
    draft = DraftVocab.of_model(model, size, model_config, tp_size=1)
    assert draft.ids.tolist() == list(range(size)) + [299]
    stub = SimpleNamespace(proposer=SimpleNamespace(model=model), bole_config=SimpleNamespace(topk=k),
                           draft_vocab=draft)
    h = torch.randn(7, hidden, generator=gen)
    top = MTPTreeDrafter._top_rows(stub, h)
    probs, toks = top[:, :k], top[:, k:].long()

    full = model.compute_logits(h)
    allowed = torch.zeros(vocab, dtype=torch.bool)
    allowed[draft.ids] = True
    masked = full.masked_fill(~allowed, -torch.inf)
    want_p, want_t = masked.softmax(-1).topk(k, dim=-1)
    assert torch.equal(toks, want_t)
    torch.testing.assert_close(probs, want_p, rtol=1e-5, atol=1e-6)
    assert allowed[toks].all()

    # Without a draft vocabulary the same call ranks the full vocabulary.
    stub.draft_vocab = None
    full_p, full_t = full.softmax(-1).topk(k, dim=-1)
    top = MTPTreeDrafter._top_rows(stub, h)
    assert torch.equal(top[:, k:].long(), full_t)
    torch.testing.assert_close(top[:, :k], full_p, rtol=1e-5, atol=1e-6)


def test_a_quantized_or_sharded_head_keeps_the_full_vocabulary(monkeypatch):
    """A subset the config names warns that it is not used; "auto", the default, says so at info level."""
    from vllm_bole.spec_decode import draft_vocab as draft_vocab_mod

    logged = []
    monkeypatch.setattr(draft_vocab_mod, "logger", SimpleNamespace(
        warning=lambda *a: logged.append("warning"), info=lambda *a: logged.append("info")))
    gen = torch.Generator().manual_seed(0)
    head = _head(50, 8, gen)
    model_config = SimpleNamespace(get_vocab_size=lambda: 50, hf_text_config=SimpleNamespace(),
                                   try_get_generation_config=lambda: {})
    assert DraftVocab.of_model(SimpleNamespace(lm_head=head), 10, model_config, tp_size=2) is None
    quantized = SimpleNamespace(weight=head.weight, quant_method=object())
    assert DraftVocab.of_model(SimpleNamespace(lm_head=quantized), 10, model_config, tp_size=1) is None
    assert DraftVocab.of_model(SimpleNamespace(lm_head=head), "auto", model_config, tp_size=2) is None
    assert logged == ["warning", "warning", "info"]


def test_draft_vocab_command_counts_the_text(tmp_path):
    """``vllm-bole draft-vocab`` on the tiny model's tokenizer: the ids are the text's most frequent tokens, most
    frequent first, and a drafter config reads them back."""
    from collections import Counter
    from pathlib import Path

    from transformers import AutoTokenizer

    import vllm_bole.testing as testing
    from vllm_bole.cli import main
    from vllm_bole.testing.tiny_models import tiny_model_dir

    model = tiny_model_dir("qwen3_5")
    corpus = Path(testing.__file__).parent / "corpus.txt"
    out = tmp_path / "ids.json"
    assert main(["draft-vocab", "--tokenizer", model, "--text", str(corpus), "--size", "50", "--out", str(out)]) == 0
    ids = json.loads(out.read_text())
    counts = Counter(AutoTokenizer.from_pretrained(model).encode(corpus.read_text(), add_special_tokens=False))
    assert len(ids) == 50 and len(set(ids)) == 50
    freq = [counts[t] for t in ids]
    assert freq == sorted(freq, reverse=True) and min(freq) >= max(c for t, c in counts.items() if t not in ids)
    assert draft_token_ids(str(out), 1024, {1023}).tolist() == sorted(ids + [1023])


def test_most_frequent_breaks_ties_to_the_lower_id():
    from collections import Counter

    from vllm_bole.calibration.draft_vocab import most_frequent

    assert most_frequent(Counter({9: 3, 4: 3, 7: 5, 1: 1}), 3) == [7, 4, 9]
