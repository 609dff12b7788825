"""The LMs' public methods refuse bad token ids, slots and cu_seqlens before the cache moves
(issue 48, "touches state before failing"): each rejected call names the argument, what was
expected and what came, and leaves every slot's length, the free pages and every state / K/V
tensor exactly as they were; the cache then serves a good call. Nemotron-H with MoE layers
(``nemotron-3-tiny``: Mamba, attention, MLP and MoE) and Mamba-2. Also: ``load_model`` refuses a
checkpoint whose weights hold NaN or inf, naming the tensor."""
from __future__ import annotations

import pytest
import torch

from fastmamba.models import load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def reference_ops(monkeypatch):
    """The ops run their PyTorch references: the checks under test sit in front of them."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


PRESETS = ("nemotron-3-tiny", "mamba2-tiny")
_MODELS: dict = {}


def model_of(preset: str):
    if preset not in _MODELS:
        _MODELS[preset] = load_model(preset, device="cpu")
    return _MODELS[preset]


@pytest.fixture(scope="module", params=PRESETS)
def model(request):
    return model_of(request.param)


def is_hybrid(model) -> bool:
    """A model whose cache tracks each slot's length (and pages its K/V): Nemotron-H."""
    return model.cfg.paged_cache


def fresh_cache(model, *, speculate: int = 0):
    """A cache with two requests that have run a prompt each (slots 0 and 1; slot 2 free)."""
    if is_hybrid(model):
        cache = model.new_cache(3, max_seq_len=32, page_size=4, speculate=speculate)
    else:
        cache = model.new_cache(3, speculate=speculate)
    slots = cache.alloc(2)
    model.prefill_varlen(torch.arange(3, 10), torch.tensor([0, 3, 7], dtype=torch.int32), cache, slots)
    return cache, slots


def snapshot(cache):
    """Everything a rejected call must leave alone: lengths, free pages and every tensor."""
    if cache.kv is not None:  # attention layers: lengths and K/V pages too
        lengths = [cache.length(s) for s in range(cache.max_batch)]
        tensors = [*cache.conv, *cache.ssm, *cache.kv.k, *cache.kv.v, cache.kv.block_table, cache.kv.seq_lens]
        return lengths, cache.free_pages, [t.clone() for t in tensors]
    return None, None, [t.clone() for t in (*cache.conv, *cache.ssm)]


def assert_unchanged(cache, before):
    lengths, free, tensors = snapshot(cache)
    assert (lengths, free) == before[:2]
    for a, b in zip(tensors, before[2]):
        assert torch.equal(a, b)


def calls(model, cache, slots):
    """{label: (call, exception type, message)} for each probe of ``model``; ``V`` the vocabulary."""
    V = model.cfg.vocab_size
    name = type(model).__name__
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    ids5 = torch.tensor([1, 2, 3, 4, 5])
    probes = [
        ("decode-id-vocab", lambda: model.decode(torch.tensor([1, V]), cache, slots), ValueError,
         rf"{name}.decode: `token_ids` values must lie in \[0, vocab_size={V}\)"),
        ("decode-id-negative", lambda: model.decode(torch.tensor([-1, 3]), cache, slots), ValueError,
         rf"{name}.decode: `token_ids` values must lie in \[0, vocab_size={V}\)"),
        ("decode-id-float", lambda: model.decode(torch.tensor([1.0, 2.0]), cache, slots), TypeError,
         rf"{name}.decode: `token_ids` expected an int32 or int64 tensor of token ids, got dtype float32"),
        ("decode-slots-float", lambda: model.decode(torch.tensor([1, 2]), cache, slots.float()), TypeError,
         rf"{name}.decode: `slots` expected an int32 or int64 tensor"),
        ("prefill_varlen-id-vocab", lambda: model.prefill_varlen(torch.tensor([1, 2, V, 4, 5]), cu, cache, slots),
         ValueError, rf"{name}.prefill_varlen: `input_ids` values must lie in \[0, vocab_size={V}\) \(token ids\); got {V}"),
        ("prefill_varlen-id-negative", lambda: model.prefill_varlen(torch.tensor([1, -2, 3, 4, 5]), cu, cache, slots),
         ValueError, rf"`input_ids` values must lie in \[0, vocab_size={V}\) \(token ids\); got -2"),
        ("prefill_varlen-id-float", lambda: model.prefill_varlen(ids5.float(), cu, cache, slots), TypeError,
         r"`input_ids` expected an int32 or int64 tensor of token ids, got dtype float32"),
        ("prefill_varlen-cu-float", lambda: model.prefill_varlen(ids5, cu.float(), cache, slots), TypeError,
         r"`cu_seqlens` expected an int32 or int64 tensor"),
        ("prefill_varlen-cu-decreasing", lambda: model.prefill_varlen(ids5, torch.tensor([0, 4, 3, 5]), cache,
                                                                       torch.tensor([0, 1, 2])),
         ValueError, r"`cu_seqlens` must .*never decrease|`cu_seqlens` must not decrease"),
        ("prefill_varlen-slots-float", lambda: model.prefill_varlen(ids5, cu, cache, slots.double()), TypeError,
         r"`slots` expected an int32 or int64 tensor"),
        ("prefill_varlen-host-lists-id-vocab",
         lambda: model.prefill_varlen(torch.tensor([1, 2, V, 4, 5]), cu, cache, slots, cu_seqlens_host=[0, 2, 5],
                                      slots_host=slots.tolist()),
         ValueError, rf"`input_ids` values must lie in \[0, vocab_size={V}\)"),
        ("prefill-id-vocab", lambda: model.prefill(torch.tensor([[1, V], [2, 3]]), cache, slots), ValueError,
         r"`input_ids` values must lie in"),
        ("prefill-id-float", lambda: model.prefill(torch.ones(2, 2), cache, slots), TypeError,
         rf"{name}.prefill: `input_ids` expected an int32 or int64 tensor"),
    ]
    if is_hybrid(model):
        probes += [
            ("step-id-vocab", lambda: model.step(torch.tensor([V + 5, 1]), cache, slots), ValueError,
             r"`token_ids` values must lie in"),
            ("decode-slot-not-allocated", lambda: model.decode(torch.tensor([1, 2]), cache, torch.tensor([0, 2])),
             ValueError, r"slot 2 is not allocated"),
            ("prefill_varlen-slot-not-allocated",
             lambda: model.prefill_varlen(ids5, cu, cache, torch.tensor([2, 0])), ValueError, r"slot 2 is not allocated"),
        ]
    else:
        probes += [
            ("prefill_varlen-slot-out-of-range",
             lambda: model.prefill_varlen(ids5, cu, cache, torch.tensor([7, 0])), ValueError, r"`slots` values must lie"),
            ("decode-slot-out-of-range", lambda: model.decode(torch.tensor([1, 2]), cache, torch.tensor([0, 3])),
             ValueError, rf"{name}.decode: `slots` values must lie in \[0, 3\) .* got \[3\]"),
        ]
    return {label: rest for label, *rest in probes}


PROBES = [(preset, label) for preset in PRESETS for label in calls(model_of(preset), None, None)]


@pytest.mark.parametrize("preset,label", PROBES, ids=[f"{p}-{lb}" for p, lb in PROBES])
def test_rejected_call_leaves_the_cache_as_it_was(preset, label):
    model = model_of(preset)
    cache, slots = fresh_cache(model)
    call, exc, message = calls(model, cache, slots)[label]
    before = snapshot(cache)
    with pytest.raises(exc, match=message):
        call()
    assert_unchanged(cache, before)
    out = model.decode(torch.tensor([4, 5]), cache, slots)  # the cache still serves
    assert out.shape == (2, model.cfg.vocab_size) and bool(torch.isfinite(out).all()), label


@pytest.mark.parametrize("bad", ["vocab", "negative", "float"])
def test_verify_checks_token_ids_before_the_cache_moves(model, bad):
    cache, slots = fresh_cache(model, speculate=2)
    V = model.cfg.vocab_size
    ids = {"vocab": torch.tensor([[1, 2, 3], [4, V, 6]]), "negative": torch.tensor([[1, 2, 3], [4, -1, 6]]),
           "float": torch.ones(2, 3)}[bad]
    before = snapshot(cache)
    exc, message = (TypeError, "expected an int32 or int64 tensor") if bad == "float" else (
        ValueError, rf"`token_ids` values must lie in \[0, vocab_size={V}\)")
    with pytest.raises(exc, match=rf"{type(model).__name__}.verify: .*{message}"):
        model.verify(ids, cache, slots)
    assert_unchanged(cache, before)


# ---------------------------------------------------------------------------------------------
# load_model refuses non-finite weights


def tiny_checkpoint(family, path):
    if family == "mamba2":
        cfg = transformers.Mamba2Config(hidden_size=32, num_hidden_layers=1, num_heads=4, head_dim=16, expand=2,
                                        state_size=16, n_groups=1, vocab_size=64, conv_kernel=4, chunk_size=8)
        model = transformers.Mamba2ForCausalLM(cfg)
    else:
        cfg = transformers.NemotronHConfig(vocab_size=64, hidden_size=32, hybrid_override_pattern="M*E",
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           mamba_num_heads=2, mamba_head_dim=16, n_groups=1, ssm_state_size=16,
                                           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                           moe_shared_expert_intermediate_size=16)
        model = transformers.NemotronHForCausalLM(cfg)
    model.float().save_pretrained(path)
    return path


@pytest.mark.parametrize("family,tensor", [
    ("mamba2", "backbone.layers.0.mixer.in_proj.weight"),
    ("nemotron_h", "backbone.layers.0.mixer.A_log"),
    ("nemotron_h", "backbone.layers.2.mixer.experts.3.up_proj.weight"),
    ("nemotron_h", "backbone.layers.2.mixer.gate.e_score_correction_bias"),
])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_load_model_refuses_non_finite_weights(tmp_path, family, tensor, value):
    from safetensors.torch import load_file, save_file

    d = tiny_checkpoint(family, tmp_path / "ckpt")
    load_model(d, device="cpu")  # the clean checkpoint loads
    sd = load_file(str(d / "model.safetensors"))
    assert tensor in sd
    sd[tensor] = sd[tensor].clone()
    sd[tensor].view(-1)[1] = value
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="not all finite") as e:
        load_model(d, device="cpu")
    kind = "NaN" if value != value else "inf"
    assert f"{tensor}: 1 of {sd[tensor].numel()} values are {kind}" in str(e.value)


@pytest.mark.gpu
@pytest.mark.parametrize("preset", PRESETS)
def test_checks_add_no_synchronize_on_gpu(preset, monkeypatch):
    """On a GPU the checks cost no device-to-host sync where the call read nothing before: a prefill
    with the host's lists and a decode whose cache the caller grew or whose slots it checked
    (``grow=False``: the engine's and the CUDA graphs' calls) run under
    torch.cuda.set_sync_debug_mode("error"); the MoE layers included."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = load_model(preset, device="cuda", dtype=torch.float32)
    hybrid = is_hybrid(model)
    cache = model.new_cache(3, max_seq_len=32, page_size=4) if hybrid else model.new_cache(3)
    slots = cache.alloc(2)
    sl = slots.tolist()
    ids = torch.arange(3, 10, device="cuda")
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device="cuda")
    tok = torch.tensor([4, 5], device="cuda")
    grow = {"grow": False}
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model.prefill_varlen(ids, cu, cache, slots, cu_seqlens_host=[0, 3, 7], slots_host=sl)
        if hybrid:  # the engine grows the cache on the host (a K/V page may go down), then decodes
            torch.cuda.set_sync_debug_mode(0)
            cache.grow(sl, [1, 1])
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        out = model.decode(tok, cache, slots, **grow)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert out.shape == (2, model.cfg.vocab_size) and bool(torch.isfinite(out).all())
