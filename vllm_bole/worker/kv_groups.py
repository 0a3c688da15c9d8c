"""KV-cache groups of a Bole engine: the split of a hybrid model's layers that holds a request in the fewest bytes.

vLLM's hybrid KV cache gives every block id one page in each of ``group size`` shared tensors, and splits the
layers of each KV-cache spec into groups of that size, padding the last group of a type. It takes the smallest
type's layer count as the size, so on the Qwen3.5-9B shape the MTP layer's attention (9 attention layers against
24 GDN layers) makes groups of 9: 3 GDN groups of 8 layers in 9 slots, a ninth page on every GDN block. Groups of
3 pad nothing: 3 attention groups and 8 GDN groups, 60 pages per 2048-token request instead of 63 (plain vLLM
without the MTP layer: 56).

Every size is tried through vLLM's own accounting (the bytes one request of ``max_model_len`` holds: per GDN group
one state block, two with prefix caching, as vLLM's "align" mode holds them; and the pool's null block, which the
start-up check counts for a Bole engine, ``_vllm_compat.wrap_kv_cache_check``); more groups cost host time every
step (each has its own block table to allocate, copy and map: vLLM's scheduler allocates every running request's
slots group by group), so ties go to fewer groups and a split never has more than ``MAX_GROUPS_FACTOR`` times vLLM's
groups. ``kv_cache_groups: "vllm"`` keeps vLLM's groups.
"""

from collections import defaultdict

from vllm.utils.math_utils import cdiv
from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, UniformTypeKVCacheSpecs

from .._vllm_compat import kv_bytes_per_request, kv_cache_group_specs
from ..config import bole_config_from_vllm
from ..logger import init_logger

logger = init_logger(__name__)

MAX_GROUPS_FACTOR = 3


def fewest_bytes_groups(vllm_config, kv_cache_spec: dict, groups: list) -> list:
    """vLLM's ``groups`` of the layers in ``kv_cache_spec``, or a split of each spec's layers into groups of one
    common size whose requests take fewer bytes (speculative_config ``kv_cache_groups: "vllm"``: vLLM's always)."""
    if bole_config_from_vllm(vllm_config).kv_cache_groups == "vllm" or not _splittable(groups):
        return groups
    spec_of = {name: g.kv_cache_spec for g in groups for name in g.layer_names}   # page sizes already unified
    by_spec = _layers_by_spec([name for name in kv_cache_spec if name in spec_of], spec_of)
    vllm_bytes = kv_bytes_per_request(vllm_config, groups)
    best, best_bytes = groups, vllm_bytes
    for size in range(1, max(len(layers) for layers in by_spec) + 1):
        candidate = kv_cache_group_specs(spec_of, split_layers(by_spec, size))
        if len(candidate) > MAX_GROUPS_FACTOR * len(groups):
            continue
        nbytes = kv_bytes_per_request(vllm_config, candidate)
        if (nbytes, len(candidate)) < (best_bytes, len(best)):
            best, best_bytes = candidate, nbytes
    if best is not groups:
        logger.info("Bole KV-cache groups: %d groups of %d layers instead of vLLM's %d of %d (%.1f%% less KV "
                    "memory per request)", len(best), _size(best), len(groups), _size(groups),
                    100 * (1 - best_bytes / vllm_bytes))
    return best


def split_layers(by_spec: list[list[str]], size: int) -> list[list[str]]:
    """Each spec's layers in groups of at most ``size``, interleaved as vLLM interleaves them (layer i goes to
    group i mod k, so pipeline stages pad evenly)."""
    out = []
    for layers in by_spec:
        k = cdiv(len(layers), size)
        out += [layers[i::k] for i in range(k)]
    return out


def _layers_by_spec(names: list[str], spec_of: dict) -> list[list[str]]:
    """The layer names of each distinct spec, in model order (the order vLLM numbers its groups in)."""
    by_spec = defaultdict(list)
    for name in names:
        by_spec[spec_of[name]].append(name)
    return list(by_spec.values())


def _splittable(groups: list) -> bool:
    """Several groups of plain specs with one page size: vLLM's general hybrid layout, the one a split changes."""
    specs = [g.kv_cache_spec for g in groups]
    return (len(groups) > 1 and len({s.page_size_bytes for s in specs}) == 1
            and not any(isinstance(s, (UniformTypeKVCacheSpecs, HiddenStateCacheSpec)) for s in specs))


def _size(groups: list) -> int:
    return max(len(g.layer_names) for g in groups)
