"""StagedInputs: typed views of one pinned host block and one device block, one asynchronous copy
(needs CUDA: pinned memory and a device). The graphs that read them are tested in
test_prefill_graphs.py and test_engine*.py."""
from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory and a device copy need CUDA")


def _staged(writer: str = "numpy"):
    """writer: "numpy" (the host views ``set`` writes through when numpy is installed) or "torch"
    (the path without numpy)."""
    from fastmamba.generation.staging import StagedInputs

    st = StagedInputs({"ids": (torch.int64, 37), "cu": (torch.int32, 5), "flags": (torch.bool, 3),
                       "slots": (torch.int32, 4)}, torch.device("cuda"))
    assert st._np is not None  # numpy is in the test environment
    if writer == "torch":
        st._np = None
    return st


@pytest.mark.parametrize("writer", ["numpy", "torch"])
def test_fields_round_trip_in_one_copy(writer):
    st = _staged(writer)
    for name, dtype, n in (("ids", torch.int64, 37), ("cu", torch.int32, 5), ("flags", torch.bool, 3),
                           ("slots", torch.int32, 4)):
        assert st.dev[name].dtype == dtype and st.dev[name].shape == (n,) and st.dev[name].is_cuda
        assert st.dev[name].data_ptr() % 16 == 0  # each field on its own 16-byte boundary
    for _ in range(3):  # rewrites after an upload wait for it; the device sees every round
        ids = [random.randrange(-2**40, 2**40) for _ in range(37)]
        cu, slots, flags = [0, 3, 9, 9, 20], [-1, 7, 2**31 - 1, 0], [True, False, True]
        st.set("ids", ids)
        st.set("cu", cu)
        st.set("slots", slots)
        st.set("flags", flags)
        st.dev["ids"].fill_(123)  # stale device values must be overwritten, not kept
        st.upload()
        assert st.dev["ids"].tolist() == ids and st.dev["cu"].tolist() == cu
        assert st.dev["slots"].tolist() == slots and st.dev["flags"].tolist() == flags


@pytest.mark.parametrize("writer", ["numpy", "torch"])
def test_partial_writes_keep_the_rest_and_overflow_is_refused(writer):
    st = _staged(writer)
    st.set("slots", [5, 6, 7, 8])
    st.set("slots", [1], start=2)
    st.upload()
    assert st.dev["slots"].tolist() == [5, 6, 1, 8]
    with pytest.raises(ValueError, match="overflow field 'cu' of 5"):
        st.set("cu", [0] * 4, start=2)
    with pytest.raises(KeyError):
        st.set("nope", [1])
