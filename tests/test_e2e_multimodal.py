"""Image prompts: greedy generation with Bole equals vLLM without speculation (CPU, tiny Qwen3.5 with a vision
tower).

A multimodal engine differs from the text-only ones of the other end-to-end tests where Bole meets vLLM: the
target runs from input embeddings, and after an image the M-RoPE positions run behind the token index (an
image of g tokens advances them by its grid's larger side only), so a tree node's three positions are the
prefix's plus its depth, not its token index. The planted drafter hides the true continuation (with the image
tokens expanded, as the engine saw the prompt) at every depth and sibling position; the MTP drafter runs the
product path. Greedy tokens on the tiny model hardly depend on the attention layers, so on CPU the target's
logprobs of the chosen tokens must also match the reference's (``e2e_support.assert_same_logprobs``: a tree
row's M-RoPE positions left at the token index moved them by 2e-2 here, bf16 noise by 4e-4).
"""

import json

import pytest

from e2e_support import assert_lossless, assert_same_logprobs, bole_engine, run_engine

pytestmark = pytest.mark.vllm

KIND = "qwen3_5_vision"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("e2e_mm")


@pytest.fixture(scope="module")
def model():
    from vllm_bole.testing.tiny_models import tiny_model_dir

    return tiny_model_dir(KIND)


@pytest.fixture(scope="module")
def requests_(model):
    import random

    config = json.load(open(f"{model}/config.json"))
    image = [config["vision_start_token_id"], config["image_token_id"], config["vision_end_token_id"]]
    rng = random.Random(5)

    def text(n):
        return [rng.randrange(10, config["text_config"]["vocab_size"]) for _ in range(n)]

    def picture(height, width, seed):
        return {"height": height, "width": width, "seed": seed}

    requests = [
        {"prompt": text(9) + image + text(6), "images": [picture(64, 96, 1)]},
        {"prompt": text(4) + image + text(3) + image + text(5), "images": [picture(96, 64, 2), picture(128, 128, 3)]},
        {"prompt": image + text(7), "images": [picture(160, 96, 4)]},
        {"prompt": text(17)},
    ]
    return [dict(r, max_tokens=MAX_TOKENS) for r in requests]


@pytest.fixture(scope="module")
def reference(tmp, model, requests_):
    ref = run_engine(tmp, "ref", {"model": model, "kind": KIND, "requests": requests_, "logprobs": 2})
    # The oracle holds the prompts as the engine saw them: each image placeholder expanded to its image's tokens.
    (tmp / "oracle.json").write_text(json.dumps([{"prompt": o["prompt_ids"], "output": o["tokens"]}
                                                 for o in ref["outputs"]]))
    lengths = [len(o["prompt_ids"]) for o in ref["outputs"]]
    assert all(n > len(r["prompt"]) for n, r in zip(lengths, requests_) if "images" in r), lengths
    return ref


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_planted_trees_with_images_are_lossless(tmp, model, requests_, reference, asynchronous):
    name = f"planted_{'async' if asynchronous else 'sync'}"
    depth, topk = 6, 3
    engine = bole_engine(tmp, name, depth, topk, budget=4 * depth * topk, async_scheduling=asynchronous)
    spec = {"model": model, "kind": KIND, "requests": requests_, "logprobs": 2, "engine": engine}
    if asynchronous:
        spec["cpu_async_scheduling"] = True
    out = run_engine(tmp, name, spec)
    divs = assert_lossless(reference, out, max_near_ties=1)
    print(f"{name}: near-tie divergences {len(divs)}; counters {out['counters']}; scheduling {out['scheduling']}")
    print(f"largest logprob gap {assert_same_logprobs(reference, out):.2e}")
    assert out["scheduling"]["async_scheduling"] == asynchronous, out["scheduling"]
    assert [o["prompt_ids"] for o in out["outputs"]] == [o["prompt_ids"] for o in reference["outputs"]]
    per_pos = out["counters"]["accepted_per_pos"]
    assert per_pos[depth - 1] > 0, f"no request accepted a full depth-{depth} path: {per_pos}"
    stats = [json.loads(line) for line in (tmp / f"{name}.stats.jsonl").read_text().splitlines()]
    assert any(any(s > 0 for s in d["siblings"]) for d in stats), "truth never under a non-first sibling"


def test_mtp_tree_drafter_with_images_is_lossless(tmp, model, requests_, reference):
    out = run_engine(tmp, "mtp", {"model": model, "kind": KIND, "requests": requests_, "logprobs": 2,
                                  "engine": bole_engine(tmp, "mtp", depth=3, topk=2, budget="auto", drafter="mtp")})
    divs = assert_lossless(reference, out, max_near_ties=1)
    print(f"mtp: near-tie divergences {len(divs)}; counters {out['counters']}; "
          f"largest logprob gap {assert_same_logprobs(reference, out):.2e}")
    assert out["counters"]["num_drafts"] > 0, out["counters"]


@pytest.mark.parametrize("variant", ["early", "late", "host_levels", "async"])
def test_mtp_drafter_rows_take_the_targets_positions(tmp, model, requests_, reference, variant, monkeypatch):
    """Every MTP row of a request with images carries the target's M-RoPE positions: over the prompt the
    target's own (an image's rows a grid's, so its three sections differ), past it the token position plus the
    request's offset in all three sections, for the committed tokens and the draft nodes alike (drafting
    before the walk, after it, and with the levels grown on the host). One request at a time, so that every
    logged forward belongs to the one request of its batch. ``async``: drafting before the walk under async
    scheduling (the default on a GPU)."""
    if variant == "host_levels":
        monkeypatch.setenv("VLLM_BOLE_HOST_DRAFT_LEVELS", "1")
    log = tmp / f"rope_{variant}.jsonl"
    engine = bole_engine(tmp, f"rope_{variant}", depth=3, topk=2, budget="auto", drafter="mtp", max_num_seqs=1)
    engine["speculative_config"] |= {"drafter": "vllm_bole.testing.rope_recorder:RopeRecordingDrafter",
                                     "drafter_args": {"log": str(log)},
                                     "early_drafting": variant in ("early", "async")}
    # No logprobs: with them the levels would wait for the host walk, and the device-rooted plans go untested.
    spec = {"model": model, "kind": KIND, "requests": requests_, "engine": engine}
    if variant == "async":
        engine["async_scheduling"] = spec["cpu_async_scheduling"] = True
    out = run_engine(tmp, f"rope_{variant}", spec)
    assert out["scheduling"]["async_scheduling"] == (variant == "async"), out["scheduling"]
    assert_lossless(reference, out, max_near_ties=0)
    assert (out["early_draft_steps"] > 0) == (variant in ("early", "async")), out["early_draft_steps"]
    assert (out["device_levels"] is None) == (variant == "host_levels"), out["device_levels"]
    forwards = [json.loads(line) for line in log.read_text().splitlines()]
    offsets, prompt_rows, drafted_rows, grid_rows = {}, 0, 0, 0
    for fw in forwards:
        assert len(fw["batch"]) == 1, fw["batch"]
        req, prompt_len, offset = fw["batch"][0]
        offsets[req] = offset
        for i, p in enumerate(fw["positions"]):
            sections = [fw["rope"][s][i] for s in range(3)]
            if p >= prompt_len:
                assert sections == [p + offset] * 3, (req, p, offset, sections)
                drafted_rows += offset != 0
            else:
                prompt_rows += offset != 0
                grid_rows += len(set(sections)) > 1
            if p == prompt_len - 1:   # the prompt's last token is text: its target position has the offset
                assert sections == [p + offset] * 3, (req, p, offset, sections)
    assert sum(o != 0 for o in offsets.values()) == 3, offsets   # the three requests with images
    assert prompt_rows and drafted_rows and grid_rows, (prompt_rows, drafted_rows, grid_rows)
