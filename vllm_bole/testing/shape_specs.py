"""The Qwen3.5-9B shape's engine config and KV-cache layer specs without weights or a GPU: the config with its
hybrid pages aligned as on a GPU (16-token kernel blocks), and the specs as the layers build them (8 attention
layers, 24 GDN layers, the MTP layer's attention), for the functions vLLM's engine core sizes its KV cache with."""

from pathlib import Path

import torch

MODEL = Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "qwen3.5-9b-shape"


def engine_config(spec, prefix_caching: bool = False):
    """The 9B shape's config at 2048 tokens with ``spec`` as its speculative config."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    cfg = EngineArgs(model=str(MODEL), skip_tokenizer_init=True, load_format="dummy", max_model_len=2048,
                     block_size=16, language_model_only=True, speculative_config=spec,
                     enable_prefix_caching=prefix_caching).create_engine_config()
    Platform._align_hybrid_block_size(cfg, CPUAttentionBackend)
    return cfg


def layer_specs(cfg, spec_blocks: int, mtp: bool) -> dict:
    """Layer name -> KV-cache spec, as the attention and GDN layers (and the MTP layer's attention) give them;
    ``spec_blocks``: the GDN layers' speculative state blocks (vLLM's MTP chain: its drafts; Bole: none)."""
    from vllm.model_executor.models import ModelRegistry
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from vllm_bole._vllm_compat import attr_override

    cc, text = cfg.cache_config, cfg.model_config.hf_text_config
    attn = FullAttentionSpec(block_size=cc.block_size, num_kv_heads=text.num_key_value_heads,
                             head_size=text.head_dim, dtype=torch.bfloat16)
    model_cls, _ = ModelRegistry.resolve_model_cls(cfg.model_config.architecture, model_config=cfg.model_config)
    with attr_override(cfg, "speculative_config", cfg.speculative_config if spec_blocks else None):
        shapes = model_cls.get_mamba_state_shape_from_config(cfg)   # Bole's GDN layers: no draft conv columns
        dtypes = model_cls.get_mamba_state_dtype_from_config(cfg)
    gdn = MambaSpec(shapes=shapes, dtypes=dtypes, block_size=cc.mamba_block_size or cc.block_size,
                    page_size_padded=cc.mamba_page_size_padded, mamba_type="gdn_attention",
                    mamba_cache_mode=cc.mamba_cache_mode, num_speculative_blocks=spec_blocks)
    specs = {f"language_model.model.layers.{i}.attn": attn if kind == "full_attention" else gdn
             for i, kind in enumerate(text.layer_types)}
    if mtp:
        specs["mtp.layers.0.self_attn.attn"] = attn
    return specs
