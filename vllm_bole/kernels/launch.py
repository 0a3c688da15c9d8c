"""Host-side helpers shared by the Triton kernels' launches: what a launch over vLLM's persistent per-layer caches
can build once instead of every step (address tables, checks and flags)."""

import weakref

import torch


_TABLES: dict = {}


def device_table(rows, device) -> torch.Tensor:
    """int64 tensor of ``rows`` (cache addresses, strides) on ``device``, built once per distinct content.

    The caches of a running engine keep their addresses, so after the first step this is a dict lookup:
    no host-to-device copy, which also lets a launch be captured in a CUDA graph.
    """
    key = (str(device), tuple(map(tuple, rows)))
    table = _TABLES.get(key)
    if table is None:
        if len(_TABLES) > 256:
            _TABLES.clear()
        table = _TABLES[key] = torch.tensor(rows, dtype=torch.int64, device=device)
    return table


_PLANS: dict = {}


def launch_plan(kind: str, tensors, build):
    """``build()`` (a launch's checks, address tables and flags) once per kernel ``kind`` and exact tensor
    objects: over vLLM's persistent per-layer caches the per-layer checks cost more host time than the launch.
    The entry keeps weak references: a tensor that died (its id then reusable) makes the entry rebuild."""
    tensors = list(tensors)
    key = (kind, *map(id, tensors))
    hit = _PLANS.get(key)
    if hit is None or any(ref() is not t for ref, t in zip(hit[0], tensors)):
        if len(_PLANS) > 256:
            _PLANS.clear()
        hit = _PLANS[key] = (tuple(weakref.ref(t) for t in tensors), build())
    return hit[1]
