"""Packed variable-length prefill: prompts of different lengths in one call give the logits and the
cache slots each prompt gets alone, continue from their slots, and hand over to decode."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from tests.helpers import seeded, tol

FP32 = tol(torch.float32)


@pytest.fixture(scope="module")
def model():
    # fp32 on the CPU (the kernels run in the interpreter); chunk_size 16, so a 19-token prompt
    # spans two chunks of the scan and the 1-token one is shorter than the conv width
    return fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")


def prompts_of(lengths, seed):
    g = seeded(seed)
    return [torch.randint(0, 256, (n,), generator=g) for n in lengths]


def cu_seqlens_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def poison(cache, seed):
    """Random contents in every slot: a prompt without initial state must not read them, and
    slots outside the call must keep them bit for bit."""
    g = seeded(seed)
    for pool in (*cache.conv, *cache.ssm):
        pool.copy_(torch.randn(pool.shape, generator=g).to(pool.dtype))


def test_packed_prefill_equals_each_prompt_alone(model):
    lengths = (1, 5, 19)
    prompts = prompts_of(lengths, 0)
    cache = model.new_cache(5)
    poison(cache, 1)
    before = [t.clone() for t in (*cache.conv, *cache.ssm)]
    slots = torch.tensor([3, 0, 4], dtype=torch.int32)  # shuffled; slots 1 and 2 not in the call
    logits = model.prefill_varlen(torch.cat(prompts), cu_seqlens_of(lengths), cache, slots, has_initial_state=False)
    assert logits.shape == (3, model.cfg.vocab_size) and logits.dtype == torch.float32

    for b, prompt in enumerate(prompts):
        alone = model.new_cache(1)
        want = model.prefill(prompt[None], alone, alone.alloc(1))
        torch.testing.assert_close(logits[b], want[0], **FP32)
        s = int(slots[b])
        for layer in range(model.cfg.n_layer):
            torch.testing.assert_close(cache.conv[layer][s], alone.conv[layer][0], **FP32)
            torch.testing.assert_close(cache.ssm[layer][s], alone.ssm[layer][0], **FP32)
    for old, new in zip(before, (*cache.conv, *cache.ssm)):
        assert torch.equal(old[[1, 2]], new[[1, 2]])


def test_packed_prefill_continues_from_slots_then_decodes(model):
    """Teacher forcing against one full forward per sequence: a packed prefill of two prefixes, a
    packed call where both continue from their slots (the second across a scan chunk boundary)
    next to a new prompt that must not read its poisoned slot, then decode steps; each equals the
    full forward's logits at the same position. The full forwards are the yardstick and run the
    ops' references (TRITON_INTERPRET=0 at call time): an independent one, while the packed
    prefills and decode steps under test run the kernels."""
    first, rest, fresh, steps = (1, 6), (3, 12), 2, 2
    seqs = prompts_of([a + b + steps for a, b in zip(first, rest)] + [fresh + steps], 2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        full = [model(s[None])[0] for s in seqs]  # [L, V] each
    cache = model.new_cache(4)
    poison(cache, 3)
    slots = torch.tensor([3, 1, 0], dtype=torch.int32)

    got = model.prefill_varlen(torch.cat([s[:n] for s, n in zip(seqs, first)]), cu_seqlens_of(first), cache,
                               slots[:2], has_initial_state=False)
    for b, n in enumerate(first):
        torch.testing.assert_close(got[b], full[b][n - 1], **FP32)

    starts, ends = [*first, 0], [*(a + b for a, b in zip(first, rest)), fresh]
    ids = torch.cat([s[a:e] for s, a, e in zip(seqs, starts, ends)])
    flags = torch.tensor([True, True, False])
    got = model.prefill_varlen(ids, cu_seqlens_of([e - a for a, e in zip(starts, ends)]), cache, slots, flags)
    for b, e in enumerate(ends):
        torch.testing.assert_close(got[b], full[b][e - 1], **FP32)

    for k in range(steps):
        tokens = torch.stack([s[e + k] for s, e in zip(seqs, ends)])
        got = model.decode(tokens, cache, slots)
        for b, e in enumerate(ends):
            torch.testing.assert_close(got[b], full[b][e + k], **FP32)


def test_prefill_varlen_rejects_bad_input(model):
    cache = model.new_cache(2)
    slots = torch.tensor([0, 1], dtype=torch.int32)
    ids = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"prompts \[1\] have none"):
        model.prefill_varlen(ids, torch.tensor([0, 4, 4], dtype=torch.int32), cache, slots)
    with pytest.raises(ValueError, match="`slots` expected shape"):
        model.prefill_varlen(ids, torch.tensor([0, 4], dtype=torch.int32), cache, slots)
    with pytest.raises(ValueError, match=r"expected shape \(T,\)"):
        model.prefill_varlen(ids[None], torch.tensor([0, 4], dtype=torch.int32), cache, slots[:1])
    with pytest.raises(ValueError, match=r"`live_seqs` expected an int in \[0, B=2\] or None, got 5"):
        model.prefill_varlen(ids, torch.tensor([0, 2, 4], dtype=torch.int32), cache, slots, live_seqs=5)


class HostReads:
    """Counts host reads of tensor values made by fastmamba's code (``.tolist()``, ``.item()``,
    ``bool()`` / ``int()`` of a tensor), not the Triton interpreter's own copies."""

    METHODS = ("tolist", "item", "__bool__", "__int__", "__index__", "__float__")

    def __init__(self, monkeypatch):
        import sys

        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counting(t, *args, _original=original, **kwargs):
                if sys._getframe(1).f_globals.get("__name__", "").startswith("fastmamba"):
                    self.count += 1
                return _original(t, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counting)


def test_prefill_reads_the_host_at_most_once(model, monkeypatch):
    """Metadata validated once at the model boundary; the layers' ops (2 layers: conv and scan
    each) read nothing. With the host's own lists (as the engine has them), nothing is read at all."""
    from fastmamba.ops._common.dispatch import interpreter_enabled

    if not interpreter_enabled():
        pytest.skip("counts the kernels' path (TRITON_INTERPRET=1 on a CPU); the references loop over host values")
    lengths = (3, 1, 6)
    ids = torch.cat(prompts_of(lengths, 7))
    cu = cu_seqlens_of(lengths)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)  # a padding prompt in the middle
    caches, logits, counts = [], [], []
    for extra in ({}, dict(cu_seqlens_host=cu.tolist(), slots_host=slots.tolist())):
        caches.append(model.new_cache(3))
        reads = HostReads(monkeypatch)
        logits.append(model.prefill_varlen(ids, cu, caches[-1], slots, has_initial_state=False, **extra))
        counts.append(reads.count)
        monkeypatch.undo()
    assert counts == [1, 0]
    torch.testing.assert_close(logits[1][[0, 2]], logits[0][[0, 2]], atol=0.0, rtol=0.0)
    for a, b in zip((*caches[0].conv, *caches[0].ssm), (*caches[1].conv, *caches[1].ssm)):
        assert torch.equal(a, b)
    alone = model.new_cache(1)
    torch.testing.assert_close(logits[0][2], model.prefill(ids[None, 4:], alone, alone.alloc(1))[0], **FP32)


def test_prefill_metadata_errors_touch_nothing(model):
    cache = model.new_cache(3)
    poison(cache, 9)
    before = [t.clone() for t in (*cache.conv, *cache.ssm)]
    ids = torch.zeros(5, dtype=torch.int64)
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    cases = [
        (cu, torch.tensor([0, 3], dtype=torch.int32), {}, r"`slots` values must lie in \[0, 3\).*got \[3\]"),
        (cu, torch.tensor([1, 1], dtype=torch.int32), {}, r"must not share a slot; slots \[1\]"),
        (torch.tensor([0, 3, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), {},
         "must start at 0, never decrease and end at T=5"),
        (torch.tensor([0, 2, 4], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), {},
         "end at T=5"),
        (cu, torch.tensor([0, 1], dtype=torch.int32), {"slots_host": [0], "cu_seqlens_host": [0, 2, 5]},
         "`slots_host` has 1 values, its tensor 2"),
        (cu, torch.tensor([0, 1], dtype=torch.int32), {"slots_host": [0, 7], "cu_seqlens_host": [0, 2, 5]},
         r"got \[7\]"),
    ]
    for cu_t, slots, extra, match in cases:
        with pytest.raises(ValueError, match=match):
            model.prefill_varlen(ids, cu_t, cache, slots, **extra)
    with pytest.raises(TypeError, match="`slots` expected an int32 or int64 tensor of cache slots, got dtype float32"):
        model.prefill_varlen(ids, cu, cache, torch.tensor([0.0, 1.0]))
    for old, new in zip(before, (*cache.conv, *cache.ssm)):
        assert torch.equal(old, new)


@pytest.mark.gpu
def test_gpu_prefill_never_synchronizes():
    """With the host's own metadata (as the engine passes it), a packed prefill on a GPU runs with no
    device-to-host read: torch.cuda.set_sync_debug_mode("error") turns any sync into an error."""
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cuda")
    lengths = (3, 1, 6)
    ids = torch.cat(prompts_of(lengths, 8)).cuda()
    cu = cu_seqlens_of(lengths)
    slots = torch.tensor([2, -1, 0], dtype=torch.int32)
    cache = m.new_cache(4)
    cu_dev, slots_dev = cu.cuda(), slots.cuda()
    m.prefill_varlen(ids, cu_dev, cache, slots_dev, cu_seqlens_host=cu.tolist(), slots_host=slots.tolist())  # warm
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        m.prefill_varlen(ids, cu_dev, cache, slots_dev, cu_seqlens_host=cu.tolist(), slots_host=slots.tolist())
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
