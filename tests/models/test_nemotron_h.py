"""NemotronHLM: logits equal transformers' NemotronHForCausalLM (plain PyTorch path) on a tiny random
checkpoint with all three layer kinds, GQA and n_groups > 1; greedy continuations equal; step-by-step
decode equals one full forward; a request's results do not depend on its batch, slot or pages;
bad configs and checkpoints raise errors naming the field or tensor."""
from __future__ import annotations

import json

import pytest
import torch

from fastmamba.models.nemotron_h import PRESETS, NemotronHConfig, NemotronHLM, load_nemotron_h
from fastmamba.ops._common.dispatch import interpreter_enabled
from tests.helpers import hf_gated_norm_is_grouped, seeded, tol

transformers = pytest.importorskip("transformers")
FP32 = tol(torch.float32)
INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import
VOCAB = 96
PATTERN = "*M-M*-M"  # attention first and in the middle, two MLPs, three Mamba layers


def hf_norm_is_grouped() -> bool:
    """transformers up to 5.17 normalise the gated RMSNorm over all of d_inner, ignoring n_groups
    (later releases normalise each group, as mamba_ssm and we do): parity with G > 1 needs the latter.
    Checked on a mixer's own norm by what it computes (tests.helpers.hf_gated_norm_is_grouped)."""
    from transformers.models.nemotron_h import modeling_nemotron_h

    cfg = transformers.NemotronHConfig(vocab_size=16, hidden_size=32, hybrid_override_pattern="M",
                                       mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8)
    return hf_gated_norm_is_grouped(modeling_nemotron_h.NemotronHMamba2Mixer(cfg, 0), 64, 2)


# transformers routes its Mamba ops to mamba_ssm / causal_conv1d whenever they import (for CPU
# tensors too); compare with its plain PyTorch path (see tests/models/test_mamba2_lm.py)
HF_ROUTED = ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined",
             "causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    """These tests check the model (its wiring, cache and loading), so the ops run their PyTorch
    references: the Mamba prefill scan takes about 30 s per layer call in the interpreter on this
    machine. The kernels have their own tests (tests/ops/); ``test_decode_runs_the_triton_kernels``
    runs the decode step's kernels inside the model."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def hf_plain_torch_path(monkeypatch):
    from transformers.models.nemotron_h import modeling_nemotron_h

    for name in HF_ROUTED:
        fn = getattr(modeling_nemotron_h, name, None)
        if fn is not None and getattr(fn, "__wrapped__", None) is not None:
            monkeypatch.setattr(modeling_nemotron_h, name, fn.__wrapped__)


def tiny_hf(path, *, tie: bool = False, seed: int = 0):
    """A random tiny NemotronHForCausalLM saved with save_pretrained; returns (model, dir).
    Mamba width 6 x 16 = 96 (not expand * hidden = 128), 2 groups; GQA 4 query / 2 KV heads."""
    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern=PATTERN, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=80, mamba_num_heads=6, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, tie_word_embeddings=tie,
        layer_norm_epsilon=1e-5,
    )
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    with torch.no_grad():  # larger weights than the default init, so every layer moves the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory):
    if not hf_norm_is_grouped():
        pytest.skip(f"transformers {transformers.__version__} normalises the gated norm over all groups "
                    "(fixed in later releases); grouped parity needs a newer one")
    hf, path = tiny_hf(tmp_path_factory.mktemp("nemotron_h") / "hf")
    return hf, load_nemotron_h(path, device="cpu")


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


def prompts_of(lengths, seed):
    g = seeded(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def cu_of(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def micro_model(pattern: str, *, n_groups: int = 2, seed: int = 0) -> NemotronHLM:
    """A random fp32 model small enough for the interpreter's Mamba kernels (two Mamba heads of 16;
    2 query / 1 KV heads), layers as ``pattern`` says."""
    from fastmamba.models.nemotron_h import random_init

    cfg = NemotronHConfig(d_model=32, vocab_size=VOCAB, pattern=pattern, n_heads=2, n_kv_heads=1, head_dim=16,
                          intermediate_size=48, mamba_nheads=2, mamba_headdim=16, n_groups=n_groups, d_state=16,
                          chunk_size=8)
    return random_init(NemotronHLM(cfg, dtype=torch.float32), seed=seed).eval()


def cache_tensors(cache) -> tuple[torch.Tensor, ...]:
    """Every state and K/V pool of a HybridCache with attention layers."""
    return (*cache.conv, *cache.ssm, *cache.kv.k, *cache.kv.v)


LENGTHS = (1, 5, 11, 19)  # one token; shorter than the conv; across chunks of 8


def test_config_reads_the_checkpoint(hf_pair):
    _, ours = hf_pair
    c = ours.cfg
    assert (c.pattern, c.n_heads, c.n_kv_heads, c.head_dim, c.mamba_nheads, c.n_groups) == (PATTERN, 4, 2, 16, 6, 2)
    assert c.mamba.d_inner == 96 and not c.tie_embeddings and ours.dtype == torch.float32


def test_logits_match_transformers(hf_pair):
    hf, ours = hf_pair
    prompts = prompts_of(LENGTHS, 0)
    cache = ours.new_cache(4, max_seq_len=32, page_size=4)
    last = ours.prefill_varlen(torch.cat(prompts), cu_of(LENGTHS), cache, cache.alloc(4))
    for b, p in enumerate(prompts):
        want = hf_logits(hf, p[None])
        torch.testing.assert_close(ours(p[None]), want, **FP32)
        torch.testing.assert_close(last[b], want[0, -1], **FP32)


def test_tied_checkpoint_matches_transformers(tmp_path):
    if not hf_norm_is_grouped():
        pytest.skip(f"transformers {transformers.__version__}: ungrouped gated norm (see hf_pair)")
    from safetensors.torch import load_file, save_file

    # transformers 5.24 never ties NemotronH's head (``_tied_weights_keys = {}``); a tied checkpoint
    # is one whose file holds the embeddings only: write it so, from a model whose head equals them
    hf, path = tiny_hf(tmp_path / "tied", tie=True, seed=1)
    with torch.no_grad():
        hf.lm_head.weight.copy_(hf.model.embeddings.weight)
    sd = {k: v for k, v in load_file(str(path / "model.safetensors")).items() if k != "lm_head.weight"}
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    ours = load_nemotron_h(path, device="cpu")
    assert ours.cfg.tie_embeddings and ours.lm_head.weight is ours.backbone.embeddings.weight
    ids = prompts_of([9], 3)[0][None]
    torch.testing.assert_close(ours(ids), hf_logits(hf, ids), **FP32)


def test_greedy_continuations_equal_transformers(hf_pair):
    hf, ours = hf_pair
    prompts = prompts_of((3, 8), 5)
    cache = ours.new_cache(2, max_seq_len=32, page_size=4)
    slots = cache.alloc(2)
    tok = ours.prefill_varlen(torch.cat(prompts), cu_of((3, 8)), cache, slots).argmax(-1)
    ours_out = [tok]
    for _ in range(3):
        tok = ours.decode(tok, cache, slots).argmax(-1)
        ours_out.append(tok)
    ours_out = torch.stack(ours_out, 1)
    for b, p in enumerate(prompts):
        seq = p[None]
        for _ in range(4):  # transformers greedy by full forwards (no cache of its own involved)
            seq = torch.cat([seq, hf_logits(hf, seq)[:, -1].argmax(-1, keepdim=True)], 1)
        assert ours_out[b].tolist() == seq[0, len(p):].tolist()
    assert len(set(ours_out.flatten().tolist())) > 2  # the continuation is not one repeated token


def test_decode_equals_full_forward(hf_pair):
    """Teacher forcing: a prefill in two chunks (the second continues the first's states and
    cached K/V), then one token at a time, gives the logits of one full forward."""
    _, ours = hf_pair
    ids = prompts_of([21], 7)[0]
    full = ours(ids[None])[0]
    cache = ours.new_cache(2, max_seq_len=32, page_size=4)
    cache.alloc(1)  # slot 0 taken: the request runs in slot 1
    slot = cache.alloc(1)
    got = [ours.prefill(ids[None, :6], cache, slot)[0], ours.prefill(ids[None, 6:9], cache, slot)[0]]
    for t in range(9, 21):
        got.append(ours.decode(ids[t:t + 1], cache, slot)[0])
    torch.testing.assert_close(torch.stack(got), full[[5, *range(8, 21)]], **FP32)
    assert cache.length(1) == 21 and cache.kv.length(1) == 21


def test_request_is_independent_of_batch_slot_and_pages(hf_pair):
    """The same request alone (slot 0, the first pages) and inside a batch of other requests (slot
    3, pages after theirs, a pad row beside it): equal tokens and logits."""
    _, ours = hf_pair
    target, *others = prompts_of((7, 4, 9, 2), 11)
    alone = ours.new_cache(4, max_seq_len=32, page_size=4)
    a_slot = alone.alloc(1)
    a_logits = [ours.prefill(target[None], alone, a_slot)[0]]
    busy = ours.new_cache(4, max_seq_len=32, page_size=4)
    o_slots = busy.alloc(3)
    ours.prefill_varlen(torch.cat(others), cu_of([4, 9, 2]), busy, o_slots)  # others first: other pages
    b_slot = busy.alloc(1)
    b_logits = [ours.prefill(target[None], busy, b_slot)[0]]
    assert b_slot.tolist() == [3] and busy.kv.pages_of(3) != alone.kv.pages_of(0)
    torch.testing.assert_close(b_logits[0], a_logits[0], **FP32)  # packed with others vs alone: GEMM shapes differ
    a_tok = b_tok = a_logits[0].argmax(-1, keepdim=True)
    other_tok = torch.tensor([1, 2, 3])
    pad = torch.tensor([-1], dtype=torch.int32)
    for _ in range(3):
        a = ours.decode(a_tok, alone, a_slot)[0]
        # the batch: another request, the target, a pad row, the rest
        batch_slots = torch.cat([o_slots[:1], b_slot, pad, o_slots[1:]])
        out = ours.decode(torch.cat([other_tok[:1], b_tok, torch.zeros(1, dtype=torch.long), other_tok[1:]]),
                          busy, batch_slots)
        b = out[1]
        # not bit for bit: CPU GEMMs of 1 and 5 rows round differently (same shapes are exact:
        # test_decode_is_exact_across_slots_and_pages)
        torch.testing.assert_close(b, a, **FP32)
        assert a.argmax() == b.argmax()
        a_tok, b_tok = a.argmax(-1, keepdim=True), b.argmax(-1, keepdim=True)
    assert busy.length(3) == alone.length(0) == 10


def test_decode_is_exact_across_slots_and_pages():
    """Same batch shape, the request in another slot with other pages: bit-identical logits."""
    m = load_nemotron_h("nemotron-h-tiny", device="cpu")
    ids = prompts_of([6], 2)[0]
    outs = []
    for taken in (0, 2):
        cache = m.new_cache(3, max_seq_len=32, page_size=4)
        if taken:
            filler = cache.alloc(taken)
            m.prefill(torch.zeros(taken, 9, dtype=torch.long), cache, filler)
        slot = cache.alloc(1)
        logits = [m.prefill(ids[None, :5], cache, slot)[0], m.decode(ids[5:], cache, slot)[0]]
        outs.append((int(slot[0]), cache.kv.pages_of(int(slot[0])), torch.stack(logits)))
    (s0, p0, l0), (s1, p1, l1) = outs
    assert s0 != s1 and p0 != p1
    assert torch.equal(l0, l1)


BASE = dict(model_type="nemotron_h", hidden_size=64, vocab_size=96, hybrid_override_pattern="M*-",
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=80,
            mamba_num_heads=6, mamba_head_dim=16, n_groups=2, ssm_state_size=16)


@pytest.mark.parametrize("change,field", [
    (dict(model_type="mamba2"), "model_type"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(hybrid_override_pattern="M*X"), "hybrid_override_pattern"),
    (dict(hybrid_override_pattern="M*E", num_experts_per_tok=9), "num_experts_per_tok"),  # MoE: more in test_nemotron3_moe
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(n_groups=4), "n_groups"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
    (dict(time_step_limit=[0.001, 0.1]), "time_step_limit"),
    (dict(layers_block_type=["mamba", "mlp", "mlp"]), "layers_block_type"),
    (dict(num_hidden_layers=4), "num_hidden_layers"),
    (dict(head_dim=16.5), "head_dim"),
    (dict(attention_bias=True), "attention_bias"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_bad_config_names_the_field(change, field):
    with pytest.raises(ValueError, match=f"NemotronHConfig: `{field}`"):
        NemotronHConfig.from_dict({**BASE, **change})


def test_config_pattern_sources_agree():
    a = NemotronHConfig.from_dict(BASE)
    b = NemotronHConfig.from_dict({**{k: v for k, v in BASE.items() if k != "hybrid_override_pattern"},
                                   "layers_block_type": ["mamba", "attention", "mlp"]})
    c = NemotronHConfig.from_dict({**BASE, "layer_types": ["linear_attention", "full_attention", "mlp"]})
    assert a == b == c and a.pattern == "M*-"
    assert PRESETS["nemotron-h-8b"].pattern.count("*") == 4 and PRESETS["nemotron-h-4b"].mamba.d_inner == 7168


def test_bad_checkpoint_names_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    m = load_nemotron_h("nemotron-h-tiny", device="cpu")
    d = tmp_path / "ckpt"
    d.mkdir()
    cfg = PRESETS["nemotron-h-tiny"]
    (d / "config.json").write_text(json.dumps({
        **BASE, "hidden_size": cfg.d_model, "vocab_size": cfg.vocab_size, "hybrid_override_pattern": cfg.pattern,
        "intermediate_size": cfg.intermediate_size, "mamba_num_heads": cfg.mamba_nheads, "chunk_size": cfg.chunk_size}))
    sd = {k: v.clone() for k, v in m.state_dict().items()}
    save_file(sd, str(d / "model.safetensors"))
    again = load_nemotron_h(d, device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (1, 5))
    assert torch.equal(again(ids), m(ids))
    sd = load_file(str(d / "model.safetensors"))
    sd.pop("backbone.layers.1.mixer.k_proj.weight")
    sd["backbone.layers.2.mixer.up_proj.weight"] = sd["backbone.layers.2.mixer.up_proj.weight"][:-1]
    sd["backbone.layers.0.mixer.q_proj.weight"] = torch.zeros(3)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError) as e:
        load_nemotron_h(d, device="cpu")
    msg = str(e.value)
    assert "backbone.layers.1.mixer.k_proj.weight" in msg and "missing" in msg
    assert "backbone.layers.2.mixer.up_proj.weight: expected (96, 64), got (95, 64)" in msg
    assert "backbone.layers.0.mixer.q_proj.weight" in msg and "unexpected" in msg


def test_decode_runs_the_triton_kernels(monkeypatch):
    """A decode step with the kernels (the interpreter on a CPU) equals the reference ops' step, pad
    row included, and leaves the same states and K/V behind. A micro model (two Mamba heads): the
    interpreter costs seconds per Mamba layer call."""
    if not INTERPRETER_AT_START:
        pytest.skip("needs TRITON_INTERPRET=1 before Python starts (Triton reads it at import); the GPU tests "
                    "run the kernels on CUDA tensors")
    m = micro_model("M*-")
    prompts = prompts_of((3, 6), 4)
    caches = []
    for _ in range(2):
        cache = m.new_cache(3, max_seq_len=16, page_size=4)
        cache.alloc(1)
        slots = cache.alloc(2)  # slots 1 and 2
        m.prefill_varlen(torch.cat(prompts), cu_of((3, 6)), cache, slots)
        caches.append(cache)
    slots = torch.tensor([2, -1, 1], dtype=torch.int32)
    tokens = torch.tensor([5, 0, 9])
    want = m.decode(tokens, caches[0], slots)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    got = m.decode(tokens, caches[1], slots)
    torch.testing.assert_close(got, want, **FP32)
    for a, b in zip(cache_tensors(caches[0]), cache_tensors(caches[1])):
        torch.testing.assert_close(a, b, **FP32)


def test_prefill_with_host_lists_reads_nothing_back(monkeypatch):
    """With the host's own cu_seqlens and slots (as the engine passes them) a hybrid prefill reads
    nothing back from the device: the attention layers' prefill takes the lists too, and the flags,
    positions and token rows go down in one copy (issue 19's host-free prefill path). Without them,
    the model boundary reads cu_seqlens and slots in one copy, and its layers nothing more. Same
    logits, states and K/V either way. A micro model: the Mamba kernels run in the interpreter."""
    from tests.models.test_prefill_varlen import HostReads

    if not INTERPRETER_AT_START:
        pytest.skip("counts the kernels' path (TRITON_INTERPRET=1 before Python starts); the references "
                    "loop over host values")
    m = micro_model("*M*-")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    lengths = (3, 6)
    ids, cu = torch.cat(prompts_of(lengths, 5)), cu_of(lengths)
    logits, counts, caches = [], [], []
    for extra in ({}, dict(cu_seqlens_host=cu.tolist(), slots_host=[1, 2])):
        cache = m.new_cache(3, max_seq_len=16, page_size=4)
        cache.alloc(1)
        slots = cache.alloc(2)  # slots 1 and 2
        with monkeypatch.context() as mp:
            reads = HostReads(mp)
            logits.append(m.prefill_varlen(ids, cu, cache, slots, **extra))
            counts.append(reads.count)
        caches.append(cache)
    assert counts == [1, 0]  # cu_seqlens, slots and the token ids' range in one read
    assert torch.equal(logits[0], logits[1])
    for a, b in zip(cache_tensors(caches[0]), cache_tensors(caches[1])):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_hybrid_prefill_with_host_lists_never_synchronizes():
    """On a GPU, with the host's metadata (as the engine passes it), a hybrid prefill (Mamba,
    attention with a cached context, MLP) runs with no device-to-host sync:
    torch.cuda.set_sync_debug_mode("error") turns any into an error."""
    m = load_nemotron_h("nemotron-h-tiny", dtype=torch.float32, device="cuda")
    cache = m.new_cache(4, max_seq_len=64, page_size=16)
    slots = cache.alloc(2)
    sl = slots.tolist()
    first, second = prompts_of((5, 9), 6), prompts_of((4, 3), 7)
    for prompts in (first, second):  # the second call continues both requests (cached K/V and states)
        lengths = [len(p) for p in prompts]
        ids, cu = torch.cat(prompts).cuda(), cu_of(lengths)
        cu_dev = cu.cuda()
        if prompts is second:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = m.prefill_varlen(ids, cu_dev, cache, slots, cu_seqlens_host=cu.tolist(), slots_host=sl)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert out.shape == (2, m.cfg.vocab_size) and bool(torch.isfinite(out).all())


def test_prefill_and_decode_reject_bad_input_before_touching_the_cache():
    m = load_nemotron_h("nemotron-h-tiny", device="cpu")
    cache = m.new_cache(3, max_seq_len=8, page_size=4)
    slots = cache.alloc(2)
    ids = torch.arange(5)
    with pytest.raises(ValueError, match="every prompt needs at least one token"):
        m.prefill_varlen(ids, torch.tensor([0, 0, 5], dtype=torch.int32), cache, slots)
    with pytest.raises(ValueError, match="`slots` must be distinct allocated slots"):
        m.prefill_varlen(ids, torch.tensor([0, 2, 5], dtype=torch.int32), cache, torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="HybridCache.grow: slot 2 is not allocated"):
        m.prefill_varlen(ids, torch.tensor([0, 2, 5], dtype=torch.int32), cache, torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="would hold 9 tokens, more than max_len=8"):
        m.prefill_varlen(torch.arange(9), torch.tensor([0, 9], dtype=torch.int32), cache, slots[:1])
    with pytest.raises(ValueError, match="`cu_seqlens` must start at 0, never decrease and end at T=5"):
        m.prefill_varlen(ids, torch.tensor([0, 2, 4], dtype=torch.int32), cache, slots)
    with pytest.raises(ValueError, match="NemotronHLM.decode: `token_ids` and `slots` expected shape"):
        m.decode(ids[:3], cache, slots)
    assert cache.length(0) == cache.length(1) == 0 and cache.kv.free_pages == cache.kv.num_pages
    assert all(torch.count_nonzero(t) == 0 for t in (*cache.ssm, *cache.conv, *cache.kv.k))


@pytest.mark.gpu
def test_8b_preset_decodes_on_gpu():
    """The 8B-class preset in bf16: prefill and decode run, logits are finite and decode matches
    a full forward's last position within bf16 tolerance."""
    m = load_nemotron_h("nemotron-h-8b", device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, m.cfg.vocab_size, (2, 33), device="cuda")
    cache = m.new_cache(2, max_seq_len=64)
    slots = cache.alloc(2)
    m.prefill(ids[:, :32], cache, slots)
    step = m.decode(ids[:, 32], cache, slots)
    full = m(ids)[:, -1]
    assert torch.isfinite(step).all()
    torch.testing.assert_close(step, full, atol=0.5, rtol=0.05)  # bf16 end to end through 52 layers


@pytest.mark.parametrize("pattern", ["M-M", "*-*", "-*M"], ids=["no-attention", "no-mamba", "mlp-first"])
def test_any_pattern_decodes_like_its_forward(pattern):
    """Kinds are only a pattern: without attention (no KV pool), without Mamba (no slot pools) or
    starting with an MLP, step-by-step decode equals the full forward. The second half of the
    steps runs with ``grow=False`` after the caller grew the cache (the CUDA-graph replay path)."""
    if not INTERPRETER_AT_START:
        pytest.skip("needs TRITON_INTERPRET=1 before Python starts (Triton reads it at import); the GPU tests "
                    "run the kernels on CUDA tensors")
    m = micro_model(pattern, n_groups=1, seed=3)
    ids = prompts_of([10], 9)[0]
    full = m(ids[None])[0]
    cache = m.new_cache(1, max_seq_len=16, page_size=4)
    assert (cache.kv is None) == ("*" not in pattern) and (cache.state is None) == ("M" not in pattern)
    slot = cache.alloc(1)
    got = [m.prefill(ids[None, :4], cache, slot)[0]]
    for t in range(4, 10):
        if t >= 7:
            cache.grow([0], [1])
        got.append(m.decode(ids[t:t + 1], cache, slot, grow=t < 7)[0])
    torch.testing.assert_close(torch.stack(got), full[3:], **FP32)


def test_sharded_checkpoint_loads_the_same(hf_pair, tmp_path):
    hf, ours = hf_pair
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    sharded = load_nemotron_h(tmp_path / "sharded", device="cpu")
    for (name, a), (_, b) in zip(ours.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


def test_config_bools_and_floats_are_typed():
    """A string where a JSON boolean or number goes is refused by field name (as Mamba2Config does)."""
    from fastmamba.models.nemotron_h import NemotronHConfig

    base = {"model_type": "nemotron_h", "hidden_size": 64, "vocab_size": 128, "hybrid_override_pattern": "M*-",
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
            "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16}
    NemotronHConfig.from_dict(base)
    for field, value in (("use_conv_bias", "false"), ("residual_in_fp32", 1), ("tie_word_embeddings", "yes"),
                         ("layer_norm_epsilon", "1e-5")):
        with pytest.raises(ValueError, match=field):
            NemotronHConfig.from_dict({**base, field: value})
