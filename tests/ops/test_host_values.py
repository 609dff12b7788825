"""host_list: one host read per tensor version, never a stale value."""
from __future__ import annotations

import torch

from fastmamba.ops._common import host_values
from fastmamba.ops._common.host_values import host_list


def test_reuses_until_modified_in_place_or_freed(monkeypatch):
    reads = []
    real = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real(self))
    t = torch.tensor([0, 3, 5])
    assert host_list(t) == [0, 3, 5]
    assert host_list(t) == [0, 3, 5]
    assert len(reads) == 1  # the second call reused the first read
    t[1] = 4
    assert host_list(t) == [0, 4, 5]
    view = t[1:]
    view.add_(1)  # through a view: the shared version counter moves too
    assert host_list(t) == [0, 5, 6]
    assert len(reads) == 3
    before = len(host_values._values)
    del t, view
    assert len(host_values._values) == before - 1  # freed tensors leave the cache


def test_equal_values_in_a_new_tensor_are_read_again():
    a = torch.tensor([0, 1, 2])
    assert host_list(a) == [0, 1, 2]
    b = torch.tensor([0, 7, 9])
    assert host_list(b) == [0, 7, 9]


def test_inference_tensors_are_read_every_time():
    with torch.inference_mode():
        t = torch.tensor([0, 2])
        assert host_list(t) == [0, 2]
        t[1] = 3
        assert host_list(t) == [0, 3]
