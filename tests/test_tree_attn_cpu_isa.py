"""The CPU tree attention runs vLLM's plain-layout kernel wherever vLLM would pick its AMX one."""

import pytest

pytest.importorskip("vllm")

from vllm.v1.attention.backends import cpu_attn  # noqa: E402

from vllm_bole.attention.tree_attn_cpu import BoleCPUAttentionBackend  # noqa: E402


@pytest.mark.parametrize("vllm_isa,expected", [("amx", "vec"), ("vec", "vec"), ("vec16", "vec16")])
def test_builder_and_layers_agree_on_a_plain_layout_isa(monkeypatch, vllm_isa, expected):
    # Both pick their ISA in __init__ from the same vLLM rule; stand in for it with the CPU under test.
    def parent_init(self, *args, **kwargs):
        self.isa = vllm_isa

    monkeypatch.setattr(cpu_attn.CPUAttentionMetadataBuilder, "__init__", parent_init)
    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "__init__", parent_init)
    builder = BoleCPUAttentionBackend.get_builder_cls()()
    impl = BoleCPUAttentionBackend.get_impl_cls()()
    assert builder.isa == impl.isa == expected


def test_an_isa_without_the_plain_layout_fails_in_one_line(monkeypatch):
    def parent_init(self, *args, **kwargs):
        self.isa = "neon"

    monkeypatch.setattr(cpu_attn.CPUAttentionBackendImpl, "__init__", parent_init)
    with pytest.raises(RuntimeError, match="'neon'"):
        BoleCPUAttentionBackend.get_impl_cls()()
