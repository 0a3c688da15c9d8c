"""Paged-cache layouts for attention tests and benchmarks."""

import torch


def shuffled_block_table(seq_lens, block_size: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A ``[B, max blocks]`` int32 block table giving each request the blocks its ``seq_lens`` need, drawn in a
    shuffled order from a pool of ``sum + 1`` blocks (one block nobody owns); returns (table, pool size)."""
    blocks = [-(-s // block_size) for s in seq_lens]
    pool = sum(blocks) + 1
    perm = torch.randperm(pool, generator=gen)
    table = torch.zeros(len(blocks), max(blocks), dtype=torch.int32)
    first = 0
    for b, nb in enumerate(blocks):
        table[b, :nb] = perm[first:first + nb]
        first += nb
    return table, pool
