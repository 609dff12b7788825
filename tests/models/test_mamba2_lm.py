"""Mamba2LM: logits equal Hugging Face's Mamba2ForCausalLM (its plain PyTorch path) for checkpoints
in both formats; step-by-step decode equals one full forward; batching does not change a request."""
from __future__ import annotations

import json

import pytest
import torch

import fastmamba
from fastmamba.models import Mamba2Config
from tests.helpers import hf_gated_norm_is_grouped

transformers = pytest.importorskip("transformers")  # in the test extra; the parity tests need it


def hf_norm_is_grouped() -> bool:
    """transformers up to 5.17 normalise the gated RMSNorm over all of d_inner, ignoring n_groups
    (mamba_ssm and later transformers normalise each group): parity with G > 1 needs the latter.
    Checked on a mixer's own norm by what it computes (tests.helpers.hf_gated_norm_is_grouped)."""
    from transformers.models.mamba2 import modeling_mamba2

    cfg = transformers.Mamba2Config(hidden_size=32, num_heads=4, head_dim=16, expand=2, state_size=8,
                                    n_groups=2, num_hidden_layers=1, vocab_size=16)
    return hf_gated_norm_is_grouped(modeling_mamba2.Mamba2Mixer(cfg, 0), 64, 2)


# transformers routes its Mamba-2 ops to mamba_ssm (or causal_conv1d) whenever that imports, for CPU
# tensors too; the GPU machine carries mamba_ssm for the peer benchmarks, where its Triton kernels
# then fail on the CPU model here. The parity tests compare with the plain PyTorch path.
HF_ROUTED = ("mamba2_chunk_scan", "mamba2_selective_state_update", "mamba2_split_conv1d_scan_combined",
             "causal_conv1d_fn", "causal_conv1d_update")


@pytest.fixture(autouse=True)
def hf_plain_torch_path(monkeypatch):
    from transformers.models.mamba2 import modeling_mamba2

    for name in HF_ROUTED:
        fn = getattr(modeling_mamba2, name, None)
        if fn is not None and getattr(fn, "__wrapped__", None) is not None:
            monkeypatch.setattr(modeling_mamba2, name, fn.__wrapped__)


def tiny_hf(tmp_path, *, tie: bool, seed: int = 0, groups: int = 1):
    """A random 2-layer HF Mamba2 model saved with save_pretrained; returns (model, dir)."""
    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(
        hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=groups,
        vocab_size=96, conv_kernel=4, chunk_size=8, use_conv_bias=True, use_bias=False,
        tie_word_embeddings=tie, residual_in_fp32=True, layer_norm_epsilon=1e-5,
    )
    model = transformers.Mamba2ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # the default init leaves norms at one and D at one: randomise what we load
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("norm_f.weight") or name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
    out = tmp_path / "hf"
    model.save_pretrained(out)
    return model, out


def hf_logits(model, ids):
    with torch.no_grad():
        return model(ids).logits.float()


@pytest.mark.parametrize("tie,groups", [(False, 1), (True, 1), (False, 2)], ids=["untied", "tied", "untied-G2"])
def test_logits_match_hf_transformers(tmp_path, tie, groups):
    if groups > 1 and not hf_norm_is_grouped():
        pytest.skip(f"transformers {transformers.__version__} normalises the gated norm over all groups "
                    "(fixed in later releases); grouped parity needs a newer one")
    hf, path = tiny_hf(tmp_path, tie=tie, groups=groups)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    ours = fastmamba.load_model(path, device="cpu")
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def _write_state_spaces(hf, path, *, tie: bool, as_bin: bool):
    """The same weights as a state-spaces (mamba_ssm MambaLMHeadModel) checkpoint directory."""
    from safetensors.torch import save_file

    path.mkdir()
    sd = {k.replace("backbone.embeddings.", "backbone.embedding."): v.clone().contiguous()
          for k, v in hf.state_dict().items()}
    if tie:
        sd.pop("lm_head.weight", None)
    c = hf.config
    config = {
        "d_model": c.hidden_size, "n_layer": c.num_hidden_layers, "vocab_size": c.vocab_size,
        "ssm_cfg": {"layer": "Mamba2", "d_state": c.state_size, "d_conv": c.conv_kernel, "expand": c.expand,
                    "headdim": c.head_dim, "ngroups": c.n_groups},
        "rms_norm": True, "residual_in_fp32": True, "fused_add_norm": True, "pad_vocab_size_multiple": 8,
        "tie_embeddings": tie,
    }
    (path / "config.json").write_text(json.dumps(config))
    if as_bin:
        torch.save(sd, path / "pytorch_model.bin")
    else:
        save_file(sd, str(path / "model.safetensors"))


@pytest.mark.parametrize("tie,as_bin", [(True, False), (False, True)], ids=["tied-safetensors", "untied-bin"])
def test_state_spaces_checkpoint_matches_hf(tmp_path, tie, as_bin):
    hf, _ = tiny_hf(tmp_path, tie=tie, seed=2)
    ss = tmp_path / "state-spaces"
    _write_state_spaces(hf, ss, tie=tie, as_bin=as_bin)
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    ours = fastmamba.load_model(ss, device="cpu")
    assert ours.cfg.tie_embeddings == tie
    torch.testing.assert_close(ours(ids), hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_config_formats_agree():
    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "expand": 2,
          "state_size": 16, "n_groups": 2, "vocab_size": 96, "conv_kernel": 4, "tie_word_embeddings": True}
    ss = {"d_model": 64, "n_layer": 2, "vocab_size": 90, "pad_vocab_size_multiple": 16, "tie_embeddings": True,
          "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 2}}
    a, b = Mamba2Config.from_dict(hf), Mamba2Config.from_dict(ss)
    assert b.vocab_size == 96  # padded to the multiple
    assert (a.nheads, a.conv_dim, a.d_in_proj) == (b.nheads, b.conv_dim, b.d_in_proj) == (8, 192, 328)  # d_in_proj = 128 + 192 + 8
    with pytest.raises(ValueError, match="num_heads=7"):
        Mamba2Config.from_dict(dict(hf, num_heads=7))
    with pytest.raises(ValueError, match="only 'Mamba2'"):
        Mamba2Config.from_dict(dict(ss, ssm_cfg={"layer": "Mamba1"}))
    with pytest.raises(ValueError, match="neither"):
        Mamba2Config.from_dict({"n_embd": 3})


def test_decode_steps_equal_full_forward():
    """Teacher forcing: prefill k tokens, then decode the rest one at a time from the cache."""
    model = fastmamba.load_model("mamba2-tiny", device="cpu")
    ids = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(4))
    full = model(ids)
    cache = model.new_cache(5)
    cache.alloc(1)  # occupy slot 0 so the requests use other rows
    slots = cache.alloc(2)
    torch.testing.assert_close(model.prefill(ids[:, :4], cache, slots), full[:, 3], atol=1e-5, rtol=1e-5)
    for t in range(4, 9):
        torch.testing.assert_close(model.decode(ids[:, t], cache, slots), full[:, t], atol=1e-5, rtol=1e-5)


def test_request_does_not_depend_on_its_batch():
    """A request's logits are the same alone or next to another request, in any slot."""
    model = fastmamba.load_model("mamba2-tiny", device="cpu")
    g = torch.Generator().manual_seed(5)
    a, b = torch.randint(0, 256, (1, 6), generator=g), torch.randint(0, 256, (1, 6), generator=g)
    alone = model.new_cache(1)
    s = alone.alloc(1)
    out_alone = [model.prefill(a, alone, s)]
    out_alone += [model.decode(a[:, -1], alone, s) for _ in range(3)]
    shared = model.new_cache(4)
    shared.alloc(2)
    slots = shared.alloc(2).flip(0)  # request a in the higher slot, b beside it
    pair = torch.cat([a, b])
    out_pair = [model.prefill(pair, shared, slots)]
    out_pair += [model.decode(pair[:, -1], shared, slots) for _ in range(3)]
    for x, y in zip(out_alone, out_pair):
        torch.testing.assert_close(y[0], x[0], atol=1e-6, rtol=1e-6)


def test_presets_are_deterministic_and_errors_are_clear(tmp_path):
    m1 = fastmamba.load_model("mamba2-tiny", device="cpu")
    m2 = fastmamba.load_model("mamba2-tiny", device="cpu")
    assert all(torch.equal(p, q) for p, q in zip(m1.state_dict().values(), m2.state_dict().values()))
    with pytest.raises(FileNotFoundError, match="neither a directory nor a preset"):
        fastmamba.load_model(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        fastmamba.load_model(tmp_path / "empty")


def _prefill_then_decode(model, ids, **tricks) -> torch.Tensor:
    """The prefill's logits and 3 decode steps' with ``tricks`` switched (the defaults restored after)."""
    model.set_decode_tricks(**tricks)
    try:
        cache = model.new_cache(3)
        slots = cache.alloc(2)
        out = [model.prefill(ids, cache, slots)]
        out += [model.decode(ids[:, t], cache, slots) for t in range(3)]
    finally:
        model.set_decode_tricks()
    return torch.stack(out)


@pytest.fixture(scope="module")
def all_tricks_run():
    """The fp32 tiny preset, its inputs and its logits with every decode trick on: computed once for
    the switches below (each then runs only its own switched-off path)."""
    # fp32 weights: in bf16 the switched paths round in different places (the GPU run at commit
    # 1f58add failed this test for fused_conv and one more switch with the bf16 default on CUDA)
    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32,
                                 device="cuda" if torch.cuda.is_available() else "cpu")
    dev = model.lm_head.weight.device
    ids = torch.randint(0, model.cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(6)).to(dev)
    return model, ids, _prefill_then_decode(model, ids)


@pytest.mark.parametrize("switch", ["A_in_kernel", "gate_in_scan", "fused_conv"])
def test_each_decode_trick_off_gives_the_same_logits(switch, all_tricks_run):
    model, ids, want = all_tricks_run
    torch.testing.assert_close(_prefill_then_decode(model, ids, **{switch: False}), want, atol=1e-5, rtol=1e-5)


def _count_norm_calls(model, monkeypatch) -> list[int]:
    """Counts calls of the mixers' own norm (RMSNormGated.forward) into a one-element list."""
    calls = [0]
    for layer in model.backbone.layers:
        norm = layer.mixer.norm
        original = norm.forward

        def counted(*args, _original=original, **kwargs):
            calls[0] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(norm, "forward", counted)
    return calls


def test_norm_in_scan_leaves_out_the_norm_pass(monkeypatch):
    """With norm_in_scan (the default) a prefill of enough tokens runs no norm of its own: the scan
    sums the squares and the next block boundary scales the rows; the logits, the states and the
    decode steps after it equal the norm-pass run's (fp32). Fewer tokens, or a norm with groups,
    keep the norm's pass."""
    from fastmamba.layers import mamba2

    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32,
                                 device="cuda" if torch.cuda.is_available() else "cpu")
    dev = model.lm_head.weight.device
    calls = _count_norm_calls(model, monkeypatch)
    ids = torch.randint(0, model.cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(8)).to(dev)
    cache = model.new_cache(3)
    model.prefill(ids, cache, cache.alloc(3))
    assert calls[0] == model.cfg.n_layer  # 21 tokens: fewer than DEFER_NORM_MIN_TOKENS
    monkeypatch.setattr(mamba2, "DEFER_NORM_MIN_TOKENS", 8)
    runs = []
    for on in (True, False):
        model.set_decode_tricks(norm_in_scan=on)
        assert all(layer.mixer.defers_norm(21) == on for layer in model.backbone.layers)
        cache = model.new_cache(4)
        slots = cache.alloc(3)
        calls[0] = 0
        logits = model.prefill(ids, cache, slots)
        assert calls[0] == (0 if on else model.cfg.n_layer)
        runs.append((logits, cache.ssm[0][slots.long()].clone(), model.decode(ids[:, -1], cache, slots)))
    model.set_decode_tricks()
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    grouped = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    for layer in grouped.backbone.layers:  # two norm groups: 1 / rms differs per group, not a row scale
        layer.mixer.norm.group_size = grouped.cfg.d_inner // 2
    assert not any(layer.mixer.defers_norm(21) for layer in grouped.backbone.layers)
    calls = _count_norm_calls(grouped, monkeypatch)
    cache = grouped.new_cache(1)
    grouped.prefill(ids[:1].cpu(), cache, cache.alloc(1))
    assert calls[0] == grouped.cfg.n_layer
    mixer = grouped.backbone.layers[0].mixer
    with pytest.raises(ValueError, match="`norm_sumsq` given but this mixer cannot defer its norm"):
        mixer.forward_varlen(torch.zeros(2, grouped.cfg.d_model), torch.tensor([0, 2], dtype=torch.int32),
                             cache.conv[0], cache.ssm[0], norm_sumsq=torch.zeros(2, grouped.cfg.d_inner // 16))
