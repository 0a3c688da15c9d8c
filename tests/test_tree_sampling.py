"""Sampled tree verification ("sample, then match"): the walk rule, its exactness, and the per-row target
distribution against vLLM's own Sampler (CPU, no engine)."""

import itertools
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.sampler import Sampler

from vllm.v1.sample.ops.topk_topp_sampler import random_sample

from vllm_bole.spec_decode.tree_sampler import (SeededDraws, is_plain_greedy, is_plain_random, pad_outputs,
                                                row_depths, sample_tree_rows, tree_row_probs, tree_rows_supported,
                                                walk_tree, walks_tree)

VOCAB = 64


def _metadata(temperature, top_k=None, top_p=None, min_p=None, generators=None) -> SamplingMetadata:
    """A batch's sampling metadata as vLLM's input batch builds it (min-p through vLLM's processor)."""
    n = len(temperature)
    procs = []
    if min_p is not None:
        proc = MinPLogitsProcessor(SimpleNamespace(scheduler_config=SimpleNamespace(max_num_seqs=8)),
                                   torch.device("cpu"), False)
        proc.update_state(BatchUpdate(batch_size=n, removed=[], moved=[],
                                      added=[(i, SamplingParams(min_p=m), None, []) for i, m in enumerate(min_p)]))
        procs.append(proc)
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32), all_greedy=False, all_random=True,
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int32),
        generators=generators or {}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(procs))


def _vllm_probs(batch_logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The processed distribution vLLM's Sampler samples from, per batch row."""
    _, logprobs = Sampler(logprobs_mode="processed_logprobs").sample(batch_logits.clone(), metadata)
    return logprobs.exp()


# ---- the walk rule --------------------------------------------------------------------------------------------
def test_walk_follows_draws_and_stops_at_first_miss():
    # root 0 -> 1 (tok 10), 2 (tok 11); 1 -> 3 (tok 20), 4 (tok 21); 4 -> 5 (tok 30)
    parents = [-1, 0, 0, 1, 1, 4]
    tokens = [-1, 10, 11, 20, 21, 30]
    draws = [10, 21, 7, 7, 30, 8]  # draws[i]: the target's sample after node i
    assert walk_tree(parents, tokens, draws) == [0, 1, 4, 5]     # bonus = draws[5] = 8 (node 5 is a leaf)
    draws[4] = 22
    assert walk_tree(parents, tokens, draws) == [0, 1, 4]        # bonus = draws[4] = 22
    assert walk_tree(parents, tokens, [11, 0, 20, 0, 0, 0]) == [0, 2]  # node 2 has no children
    assert walk_tree(parents, tokens, [12, 10, 0, 0, 0, 0]) == [0]     # first draw matches no child
    # Draws at rows off the path never matter.
    assert walk_tree(parents, tokens, [10, 20, 99, 99, 99, 99]) == [0, 1, 3]


def test_sample_then_match_is_exact():
    """Enumerating every draw on every row of a tree: the emitted tokens, continued autoregressively to a fixed
    length, have exactly the autoregressive distribution."""
    vocab, length = 3, 4

    def p(prefix: tuple) -> list[float]:  # a made-up target, different after every prefix
        w = [1.0 + ((7 * len(prefix) + sum(prefix) * 3 + t * (2 + len(prefix))) % 5) for t in range(vocab)]
        return [x / sum(w) for x in w]

    def continued(seq: tuple) -> dict[tuple, float]:  # autoregressive continuation of seq to `length` tokens
        if len(seq) == length:
            return {seq: 1.0}
        return {s: p(seq)[x] * q for x in range(vocab) for s, q in continued(seq + (x,)).items()}

    # root -> tok 0 (1), tok 1 (2); node 1 -> tok 2 (3), tok 0 (4); node 4 -> tok 1 (5)
    parents = [-1, 0, 0, 1, 1, 4]
    tokens = [-1, 0, 1, 2, 0, 1]
    prefixes = [()]
    for i in range(1, len(parents)):
        prefixes.append(prefixes[parents[i]] + (tokens[i],))
    got: dict[tuple, float] = {}
    lengths = set()
    for draws in itertools.product(range(vocab), repeat=len(parents)):
        prob = 1.0
        for row, x in enumerate(draws):
            prob *= p(prefixes[row])[x]
        path = walk_tree(parents, tokens, list(draws))
        emitted = tuple(tokens[j] for j in path[1:]) + (draws[path[-1]],)
        lengths.add(len(emitted))
        for s, q in continued(emitted).items():
            got[s] = got.get(s, 0.0) + prob * q
    assert lengths == {1, 2, 3, 4}
    want = continued(())
    assert got.keys() == want.keys()
    for s in want:
        assert got[s] == pytest.approx(want[s], abs=1e-12), s


# ---- the per-row target distribution ----------------------------------------------------------------------------
CASES = {
    "topk_topp_minp": dict(temperature=[0.7, 1.5, 3.0], top_k=[5, VOCAB, 12], top_p=[1.0, 0.8, 0.9],
                           min_p=[0.0, 0.05, 0.2]),
    "temperature_only": dict(temperature=[0.5, 2.0, 1.0]),
    "topk_only": dict(temperature=[1.0, 4.0, 0.9], top_k=[3, 7, VOCAB]),
    "minp_only": dict(temperature=[1.0, 4.0, 2.0], min_p=[0.1, 0.0, 0.3]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tree_row_probs_equal_vllm_sampler(case):
    metadata = _metadata(**CASES[case])
    gen = torch.Generator().manual_seed(0)
    row_req = torch.tensor([0, 0, 1, 2, 2, 2, 1, 0])
    rows = torch.randn(len(row_req), VOCAB, generator=gen) * 3
    before = rows.clone()
    probs = tree_row_probs(rows, row_req, metadata)
    assert torch.equal(rows, before), "raw logits must stay untouched"
    for i, r in enumerate(row_req.tolist()):
        batch = torch.randn(3, VOCAB, generator=gen) * 3
        batch[r] = rows[i]
        torch.testing.assert_close(probs[i], _vllm_probs(batch, metadata)[r], rtol=1e-5, atol=1e-6)
    assert (probs > 0).sum(dim=1).min() >= 1


def test_seeded_rows_use_the_request_generator():
    metadata = _metadata([1.5, 1.5], top_k=[20, 20], generators={1: torch.Generator().manual_seed(5)})
    rows = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    row_req = [0, 0, 1, 1, 1, 0]
    depth = [0, 1, 0, 1, 1, 2]
    first = sample_tree_rows(rows, row_req, metadata, row_depth=depth)
    metadata.generators[1] = torch.Generator().manual_seed(5)
    torch.manual_seed(123)  # the unseeded request's rows draw from the default generator
    second = sample_tree_rows(rows, row_req, metadata, row_depth=depth)
    assert [first[i] for i in (2, 3, 4)] == [second[i] for i in (2, 3, 4)]
    # Every draw is in its row's support.
    probs = tree_row_probs(rows, torch.tensor(row_req), metadata)
    assert all(probs[i, t] > 0 for i, t in enumerate(second))


def test_seeded_rows_read_the_noise_stream_of_their_output_position():
    """A seeded request's tree rows draw one noise vector per depth from its generator, and after the walk the
    generator goes back to just after the vectors the emitted tokens used: the emitted tokens are then exactly
    what vLLM's sampler emits one token per step from the same seed (each step's row being the path's node), and
    the generator ends in the same state, whatever the tree's shape and whatever else the step drew."""
    metadata = _metadata([1.5], top_k=[20])
    # root 0; 0 -> 1, 2; 1 -> 3, 4; 3 -> 5, 6; 2 -> 7; 5 -> 8 (depths 0, 1, 1, 2, 2, 3, 3, 2, 4)
    parents = [-1, 0, 0, 1, 1, 3, 3, 2, 5]
    rows = torch.randn(len(parents), VOCAB, generator=torch.Generator().manual_seed(2)) * 2
    for stop_depth in (0, 1, 3, 4):
        metadata.generators = {0: torch.Generator().manual_seed(11)}
        seeded = SeededDraws()
        draws = sample_tree_rows(rows, [0] * len(parents), metadata, row_depth=row_depths(parents), seeded=seeded)
        # The first child of each node on the main path (0, 1, 3, 5, 8) holds the parent's draw down to
        # ``stop_depth``; every other node a token that differs from its parent's draw.
        main = [0, 1, 3, 5, 8]
        tokens = [-1] + [(draws[p] + 1) % VOCAB for p in parents[1:]]
        for d in range(stop_depth):
            tokens[main[d + 1]] = draws[main[d]]
        path = walk_tree(parents, tokens, draws)
        assert path == main[:stop_depth + 1]
        emitted = [tokens[j] for j in path[1:]] + [draws[path[-1]]]
        metadata.generators[0].manual_seed(99)   # e.g. vLLM's sampler at the bonus row: undone by the rewind
        seeded.rewind(metadata.generators, {0: len(path)})
        reference = torch.Generator().manual_seed(11)
        probs = tree_row_probs(rows, torch.zeros(len(parents), dtype=torch.long), metadata)
        want = [random_sample(probs[j:j + 1].clone(), {0: reference}).item() for j in path]
        assert emitted == want
        assert torch.equal(metadata.generators[0].get_state(), reference.get_state())


def test_seeded_rows_need_their_depths():
    metadata = _metadata([1.0], generators={0: torch.Generator().manual_seed(1)})
    with pytest.raises(ValueError, match="row_depth"):
        sample_tree_rows(torch.zeros(2, VOCAB), [0, 0], metadata)
    assert row_depths([-1, 0, 0, 1, 3]) == [0, 1, 1, 2, 3]


def test_sample_tree_rows_matches_row_distribution():
    """Many draws of one row: the empirical frequencies track the processed probabilities."""
    metadata = _metadata([2.0], top_k=[6], top_p=[0.95], min_p=[0.02])
    row = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    n = 20000
    draws = sample_tree_rows(row.expand(n, VOCAB), [0] * n, metadata)
    freq = torch.bincount(torch.tensor(draws), minlength=VOCAB).float() / n
    probs = tree_row_probs(row, torch.tensor([0]), metadata)[0]
    assert ((freq > 0) <= (probs > 0)).all()
    torch.testing.assert_close(freq, probs, atol=0.02, rtol=0)


def test_request_classes():
    assert is_plain_greedy(SamplingParams(temperature=0.0))
    assert not is_plain_random(SamplingParams(temperature=0.0))
    assert is_plain_random(SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, seed=3))
    for extra in (dict(presence_penalty=0.5), dict(repetition_penalty=1.1), dict(logit_bias={3: 1.0}),
                  dict(min_tokens=2), dict(bad_words=["x"]), dict(allowed_token_ids=[1, 2]), dict(prompt_logprobs=1)):
        assert not is_plain_random(SamplingParams(temperature=0.8, **extra)), extra
        # Not plain, so not on the early path; but their rows get vLLM's processing with each row's path
        # (processed_tree_rows), except prompt logprobs (root-only) and min_tokens under async scheduling.
        for temperature in (0.0, 0.8):
            params = SamplingParams(temperature=temperature, **extra)
            assert walks_tree(params) == ("prompt_logprobs" not in extra), extra
            assert walks_tree(params, asynchronous=True) == (not {"prompt_logprobs", "min_tokens"} & set(extra))
    # A grammar: one bitmask row per tree node from the scheduler.
    structured = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    assert walks_tree(structured) and walks_tree(structured, asynchronous=True)
    assert walks_tree(SamplingParams(temperature=0.0, min_p=0.2)) and walks_tree(SamplingParams(temperature=0.5))
    assert not walks_tree(None)
    assert not is_plain_random(None) and not is_plain_greedy(None)
    assert tree_rows_supported(_metadata([1.0], min_p=[0.1]))
    custom = _metadata([1.0])
    custom.logitsprocs.argmax_invariant.append(object())
    assert not tree_rows_supported(custom)


@pytest.mark.parametrize("outputs", [[[5], [7]], [[5, 6, 9], [7]], [[3]], [[1, 2], [4, 5]]])
def test_padded_outputs_parse_like_vllm(outputs):
    """The walk's host token matrix (at least two wide) reads back through vLLM's spec-decode parsing as the
    emitted tokens, discarded requests emptied, as vLLM's one-token path would give them."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler

    padded = pad_outputs(outputs, "cpu", min_width=2)
    assert padded.device.type == "cpu" and padded.shape == (len(outputs), max(2, *map(len, outputs)))
    parsed, _ = RejectionSampler.parse_output(padded, vocab_size=100)
    assert parsed == outputs
    dropped, _ = RejectionSampler.parse_output(padded, vocab_size=100, discard_req_indices=[0])
    assert dropped == [[]] + outputs[1:]


# ---- rows of requests with penalties, bad words, allowed ids, a logit bias, min_tokens -------------------------
def _processed_metadata(params: list, prompts: list[list[int]], outputs: list[list[int]]) -> SamplingMetadata:
    """Sampling metadata of a batch as vLLM's input batch builds it for these requests (its built-in logit-bias and
    min-tokens processors, penalties, allowed ids, bad words as token ids)."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinTokensLogitsProcessor

    n, cpu = len(params), torch.device("cpu")
    procs = [MinTokensLogitsProcessor(None, cpu, False), LogitBiasLogitsProcessor(None, cpu, False)]
    for proc in procs:
        proc.update_state(BatchUpdate(batch_size=n, removed=[], moved=[],
                                      added=[(i, p, prompts[i], outputs[i]) for i, p in enumerate(params)]))
    width = max(len(p) for p in prompts)
    mask = torch.zeros(n, VOCAB, dtype=torch.bool)
    for i, p in enumerate(params):
        if p.allowed_token_ids:
            mask[i] = True
            mask[i, p.allowed_token_ids] = False
    return SamplingMetadata(
        temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32), all_greedy=False,
        all_random=False, top_p=None, top_k=None, generators={}, max_num_logprobs=None, no_penalties=False,
        prompt_token_ids=torch.tensor([p + [VOCAB] * (width - len(p)) for p in prompts]),
        frequency_penalties=torch.tensor([p.frequency_penalty for p in params]),
        presence_penalties=torch.tensor([p.presence_penalty for p in params]),
        repetition_penalties=torch.tensor([p.repetition_penalty for p in params]),
        output_token_ids=outputs, allowed_token_ids_mask=mask,
        bad_words_token_ids={i: p._bad_words_token_ids for i, p in enumerate(params) if p._bad_words_token_ids},
        logitsprocs=LogitsProcessors(procs))


def test_processed_rows_equal_vllms_processing_of_each_rows_output():
    """Each tree row of a request is processed as vLLM's sampler processes that request once its output has grown
    by the row's path: the same values as a batch with one request per row."""
    from vllm_bole.spec_decode.tree_sampler import processed_tree_rows

    stop = 7
    params = [SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3,
                             logit_bias={5: 3.0, 9: -2.0}),
              SamplingParams(temperature=0.8, min_tokens=5, stop_token_ids=[stop], bad_words=["x"],
                             allowed_token_ids=list(range(4, 40)))]
    params[0]._bad_words_token_ids, params[1]._bad_words_token_ids = [], [[11], [20, 21], [22, 23, 24]]
    prompts, outputs = [[3, 4, 5, 6], [8, 9]], [[5, 5, 12], [20, 22, 23]]
    # request 0: a 3-node chain; request 1: root, two children, a grandchild (paths [], [21], [24], [24, 25])
    row_req = [0, 0, 0, 1, 1, 1, 1]
    row_path = [[], [5], [5, 12], [], [21], [24], [24, 25]]
    logits = torch.randn(len(row_req), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    got = processed_tree_rows(logits, row_req, row_path, outputs, params, _processed_metadata(params, prompts,
                                                                                                outputs))
    row_outputs = [outputs[r] + path for r, path in zip(row_req, row_path)]
    want = Sampler().apply_logits_processors(
        logits.clone(), _processed_metadata([params[r] for r in row_req], [prompts[r] for r in row_req],
                                            row_outputs), predict_bonus_token=False)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # The path decides: min_tokens masks the stop token below 5 output tokens only; [22, 23, 24] is masked after
    # the output's 22, 23 but not after the path's 24; [11] everywhere.
    assert got[3:6, stop].isinf().all() and not got[6, stop].isinf()
    assert got[3, 24].isinf() and not got[5, 24].isinf() and got[3:, 11].isinf().all()
