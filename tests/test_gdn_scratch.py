"""The GDN layers' step buffers: graphs of different token counts share one allocation per row capacity."""

from types import SimpleNamespace

import torch


def _layer():
    return SimpleNamespace(num_k_heads=4, num_v_heads=8, tp_size=1, head_k_dim=16, head_v_dim=8)


def test_rows_view_is_a_contiguous_prefix_of_the_storage():
    from vllm_bole.attention.gdn import GDNStepScratch

    x = torch.zeros(5, 96, dtype=torch.bfloat16)
    storage = GDNStepScratch(3, _layer(), x, rows=8)
    view = storage.rows_view(5)
    pairs = [(storage.factors.k, view.factors.k, (4, 16)), (storage.factors.u, view.factors.u, (8, 8)),
             (storage.factors.g_cum, view.factors.g_cum, (8,)), (storage.conv_inputs, view.conv_inputs, (96,))]
    for big, small, tail in pairs:
        assert big.shape == (3, 8, *tail) and small.shape == (3, 5, *tail) and small.is_contiguous()
        assert small.data_ptr() == big.data_ptr() and small.dtype == big.dtype
        big.zero_()   # (uninitialized storage may hold ones)
        small.fill_(1)
        assert big.view(-1)[:small.numel()].eq(1).all() and not big.view(-1)[small.numel():].eq(1).any()
    assert view.layers == [] and view.slots == [] and view.layers is not storage.layers


def test_graph_mode_scratch_is_shared_per_power_of_two(monkeypatch):
    from vllm_bole.attention.gdn import BoleQwenGDN, GDNStepScratch

    monkeypatch.setattr(BoleQwenGDN, "num_layers", 3)
    store = {}
    made = []
    for n in (5, 8, 7, 9, 16):
        forest = SimpleNamespace(gdn_scratch=None, graph=SimpleNamespace(scratch_storage=store))
        made.append(GDNStepScratch.of(forest, _layer(), torch.zeros(n, 96, dtype=torch.bfloat16)))
        assert forest.gdn_scratch is made[-1] and made[-1].conv_inputs.shape[1] == n
    assert sorted(store) == [8, 16]
    assert made[0].factors.u.data_ptr() == made[1].factors.u.data_ptr() == made[2].factors.u.data_ptr()
    assert made[3].factors.u.data_ptr() == made[4].factors.u.data_ptr() != made[0].factors.u.data_ptr()
    assert store[8].factors.u.shape[:2] == (3, 8) and store[16].factors.u.shape[:2] == (3, 16)
