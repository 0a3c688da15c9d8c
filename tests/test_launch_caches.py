"""What per-step host work is kept between steps: the kernels' launch plans (per exact cache tensors, rebuilt for
new ones) and the device beam's constant index tensors (per values, never written). (The beam graphs' row layout:
tests/test_beam_graphs.py.)"""

import gc

import torch

from vllm_bole.kernels.launch import launch_plan
from vllm_bole.spec_decode.device_beam import device_constant


def test_launch_plan_is_built_once_per_tensor_set_and_again_for_new_tensors():
    built = []

    def build():
        built.append(1)
        return len(built)

    a, b = torch.zeros(4), torch.zeros(4)
    assert launch_plan("k", [a, b], build) == 1 and launch_plan("k", [a, b], build) == 1
    assert launch_plan("other", [a, b], build) == 2          # per kernel kind
    assert launch_plan("k", [b, a], build) == 3              # order matters (address tables)
    old = id(a)
    del a
    gc.collect()
    fresh = [torch.zeros(4) for _ in range(64)]               # one of them may take the dead tensor's id
    for t in fresh:
        n = len(built)
        got = launch_plan("k", [t, b], build)
        assert got == n + 1, "a dead tensor's plan served a new tensor" if id(t) == old else "not rebuilt"


def test_device_constants_are_made_once_per_values():
    x = device_constant((1, 2, 3), "cpu")
    assert x.dtype == torch.int64 and x.tolist() == [1, 2, 3]
    assert device_constant((1, 2, 3), "cpu") is x and device_constant((1, 2), "cpu") is not x
    assert device_constant((), "cpu").numel() == 0
