"""A device-beam level's bookkeeping in one Triton launch (kernels/tree_select/triton_beam.py; the interpreter
without a GPU) leaves the beam state exactly as its torch twin (``kernels/tree_select/reference.beam_advance``)
does: candidates, the next frontier (stable on score ties), and the next level's ancestor regions, token ids and
hidden rows."""

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from triton_modes import DEV, import_kernel_modules, interpreter
from vllm_bole.kernels.tree_select import reference
from vllm_bole.spec_decode.device_beam import BeamState, DeviceBeam

# The interpreter converts 1-element arrays to scalars, which numpy now warns about on every kernel step.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


class _Rates:
    """Synthetic acceptance's child scores: the same for every rank-r child at a depth (many score ties)."""

    def child_probability(self, depth: int, rank: int) -> float:
        return [0.9, 0.35, 0.2, 0.1, 0.05][rank] * (0.97 ** depth)


def _beam(k: int, depth: int, synthetic: bool) -> DeviceBeam:
    beam = object.__new__(DeviceBeam)
    beam.k, beam.max_depth, beam._rates = k, depth, None
    beam.drafter = SimpleNamespace(synthetic=_Rates() if synthetic else None)
    return beam


def _state(rng, g: int, k: int, depth: int, d: int, hsize: int, ties: bool) -> BeamState:
    m = k + (depth - 1) * k * k
    hidden = torch.zeros(1, hsize, dtype=torch.bfloat16)
    s = BeamState.empty(g, m, k, depth, hidden)
    n = k + (d - 1) * k * k
    s.scores[:, :n] = torch.tensor(rng.random((g, n)))
    s.tokens[:, :n] = torch.tensor(rng.integers(0, 1000, (g, n)), dtype=torch.float64)
    front_score = rng.choice([0.5, 0.25], size=(g, k)) if ties else rng.random((g, k))
    s.front_score.copy_(torch.tensor(front_score))
    s.front.copy_(torch.tensor(rng.integers(0, n, (g, k))))
    s.front_tok.copy_(torch.tensor(rng.integers(0, 1000, (g, k)), dtype=torch.float64))
    s.front_slot.copy_(torch.tensor(rng.integers(0, k, (g, k))))
    s.anc.copy_(torch.tensor(rng.random((g, k, depth * k)) < 0.4))
    s.hid.copy_(torch.tensor(rng.standard_normal((g * k, hsize))).to(torch.bfloat16))
    return s


def _to(s: BeamState, device) -> BeamState:
    return BeamState(**{f.name: getattr(s, f.name).clone().to(device) for f in dataclasses.fields(s)})


@pytest.mark.parametrize("seed", range(16))
def test_triton_advance_is_the_torch_one(seed):
    (mod,) = import_kernel_modules("vllm_bole.kernels.tree_select.triton_beam")
    rng = np.random.default_rng(900 + seed)
    k, depth = int(rng.integers(1, 5)), int(rng.integers(2, 9))
    g, d = int(rng.integers(1, 6)), int(rng.integers(1, depth))
    synthetic, ties = seed % 2 == 1, seed % 3 == 0
    hsize = [8, 24, 100][seed % 3]
    s = _state(rng, g, k, depth, d, hsize, ties)
    out = torch.tensor(rng.standard_normal((g * k, hsize))).to(torch.bfloat16)
    probs = rng.choice([0.5, 0.25], size=(g * k, k)) if ties else np.sort(rng.random((g * k, k)))[:, ::-1]
    top = torch.tensor(np.concatenate([probs, rng.integers(0, 50000, (g * k, k))], axis=1), dtype=torch.float32)
    beam = _beam(k, depth, synthetic)
    want = _to(s, "cpu")
    cpu_rates = beam._synthetic_rates("cpu")
    reference.beam_advance(want, d, out, top, None if cpu_rates is None else cpu_rates[d + 1])
    got = _to(s, DEV)
    # A wider top-children buffer, as the drafter's rows may be strided.
    wide = torch.cat([top, torch.full((g * k, 3), -1.0)], dim=1).to(DEV)[:, :2 * k]
    rates = _beam(k, depth, synthetic)._synthetic_rates(DEV)   # (a beam keeps its table on one device)
    with interpreter():
        mod.beam_advance(got, d, out.to(DEV), wide, None if rates is None else rates[d + 1])
    for f in dataclasses.fields(BeamState):
        assert torch.equal(getattr(got, f.name).cpu(), getattr(want, f.name)), f.name
