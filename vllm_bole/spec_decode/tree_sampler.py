"""Greedy tree verification: follow the child whose token is the target's argmax, then add the bonus token."""

import torch


def is_plain_greedy(params) -> bool:
    """True for requests whose next token is exactly the argmax of the raw logits (no logits processors).

    Other requests verify only the root: their next token comes from vLLM's sampler with all their settings.
    """
    if params is None:
        return False
    return (
        params.temperature == 0.0
        and params.presence_penalty == 0.0 and params.frequency_penalty == 0.0
        and params.repetition_penalty == 1.0
        and not params.prompt_logprobs
        and not params.bad_words and not params.logit_bias and not params.allowed_token_ids
        and not params.min_tokens
        and getattr(params, "structured_outputs", None) is None
    )


def walk_tree(parents: list[int], tokens: list[int], argmax: list[int]) -> list[int]:
    """Accepted path (local node indices, root first) of one verification tree.

    ``parents[0] = -1`` is the root; ``argmax[i]`` is the target's greedy token after node i.
    """
    children: dict[int, list[int]] = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault(p, []).append(i)
    path = [0]
    while True:
        want = argmax[path[-1]]
        nxt = next((c for c in children.get(path[-1], ()) if tokens[c] == want), None)
        if nxt is None:
            return path
        path.append(nxt)


def pad_outputs(outputs: list[list[int]], device) -> torch.Tensor:
    width = max(len(o) for o in outputs)
    out = torch.full((len(outputs), width), -1, dtype=torch.int32)
    for i, o in enumerate(outputs):
        out[i, :len(o)] = torch.tensor(o, dtype=torch.int32)
    return out.to(device)
