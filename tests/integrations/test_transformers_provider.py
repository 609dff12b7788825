"""fastmamba as transformers' kernel provider: transformers' logits and greedy tokens with the
provider equal those without it, on tiny random checkpoints written by save_pretrained (Mamba-2,
dense Nemotron-H, MoE Nemotron-3), batch 1 and a left-padded batch of 3, with and without a cache;
the provider really runs (fastmamba op calls are counted); ``unuse`` restores transformers' path;
an unsupported transformers version is refused.

The parity tests run the ops' PyTorch references (TRITON_INTERPRET=0: a generate loop in the
interpreter takes minutes); ``test_interpreter_runs_the_triton_kernels`` drives the real Triton
kernels inside transformers' model under the interpreter.
"""
from __future__ import annotations

import collections
import subprocess
import sys
import textwrap

import pytest
import torch

import fastmamba.ops as fops
import fastmamba.ops.moe as fmoe
from fastmamba.ops._common.dispatch import interpreter_enabled
from tests.integrations import tiny_hf

transformers = pytest.importorskip("transformers")
from fastmamba.integrations import transformers as provider  # noqa: E402

INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import
KINDS = ("mamba2", "nemotron-h", "nemotron-3-moe")
OPS = ("causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined", "selective_state_update",
       "rmsnorm_fn")
MOE_OPS = ("fused_moe", "moe_route")
FP32 = dict(atol=1e-4, rtol=1e-4)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {k: tiny_hf.build(k, tmp_path_factory.mktemp(k.replace("-", "_")) / "ckpt") for k in KINDS}


@pytest.fixture
def calls(monkeypatch):
    """Counts every call into the fastmamba ops the provider uses (wrapped where it looks them up)."""
    counts = collections.Counter()

    def counting(mod, name):
        fn = getattr(mod, name)

        def wrapped(*a, **k):
            counts[name] += 1
            return fn(*a, **k)
        monkeypatch.setattr(mod, name, wrapped)

    for name in OPS:
        counting(fops, name)
    for name in MOE_OPS:
        counting(fmoe, name)
    return counts


@pytest.fixture
def references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' PyTorch references on CPU tensors


def cache_names(model) -> tuple[str, str]:
    """The cache's keyword in forward and attribute in its output: ``cache`` from transformers 5.25,
    ``cache_params`` (Mamba-2) / ``past_key_values`` (Nemotron-H) before."""
    import inspect

    for name in ("cache", "cache_params", "past_key_values"):
        if name in inspect.signature(model.forward).parameters:
            return name, name
    raise AssertionError(f"{type(model).__name__}.forward takes no cache argument")


def run(model, ids, mask, use_cache: bool):
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, use_cache=use_cache).logits
        gen = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             do_sample=False, use_cache=use_cache, return_dict_in_generate=True,
                             output_logits=True)
    return logits, gen.sequences, torch.stack(gen.logits, 1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("use_cache", [True, False], ids=["cache", "no-cache"])
@pytest.mark.parametrize("batch", [1, 3], ids=["B1", "B3-left-padded"])
@pytest.mark.parametrize("kind", KINDS)
def test_provider_equals_transformers(kind, batch, use_cache, checkpoints, calls, references):
    check_parity(kind, batch, use_cache, checkpoints, calls)


@pytest.mark.skipif(not INTERPRETER_AT_START, reason="needs TRITON_INTERPRET=1 set before Python starts")
def test_generate_equals_transformers_on_the_triton_kernels(checkpoints, calls):
    """The same parity with the real Triton kernels under the interpreter: the hybrid MoE model, the
    left-padded batch of 3, prefill and cached greedy decode."""
    check_parity("nemotron-3-moe", 3, True, checkpoints, calls)


def check_parity(kind, batch, use_cache, checkpoints, calls):
    model = tiny_hf.load(checkpoints[kind])
    ids, mask = tiny_hf.prompts(batch)
    ref_logits, ref_tokens, ref_steps = run(model, ids, mask, use_cache)
    assert sum(calls.values()) == 0  # transformers' own path touched no fastmamba op

    with provider.use(model):
        logits, tokens, steps = run(model, ids, mask, use_cache)

    real = mask.bool()  # padding positions' logits are not compared (both sides compute garbage there alike)
    torch.testing.assert_close(logits[real], ref_logits[real], **FP32)
    assert rel_err(logits[real], ref_logits[real]) <= 1e-4
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(steps, ref_steps, **FP32)
    # the provider ran: prefill conv + scan + norm every forward, the decode step's ops with a cache
    assert calls["causal_conv1d_fn"] > 0 and calls["mamba_chunk_scan_combined"] > 0 and calls["rmsnorm_fn"] > 0
    if use_cache:
        assert calls["causal_conv1d_update"] > 0 and calls["selective_state_update"] > 0
    else:
        assert calls["causal_conv1d_update"] == 0 and calls["selective_state_update"] == 0
    if kind == "nemotron-3-moe":
        assert calls["fused_moe"] > 0 and calls["moe_route"] > 0


def test_decode_steps_write_the_cache_in_place(checkpoints, calls, references):
    """Teacher-forced decode with transformers' DynamicCache: every step's logits and the cache's conv
    and recurrent states equal transformers' own, one token at a time (the state update runs in
    place on the cache's tensors)."""
    model = tiny_hf.load(checkpoints["nemotron-3-moe"])
    ids, mask = tiny_hf.prompts(3)
    steps = torch.randint(1, tiny_hf.VOCAB, (3, 4), generator=torch.Generator().manual_seed(5))

    kw, attr = cache_names(model)

    def decode():
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
            cache, logits, m = getattr(out, attr), [], mask
            for t in range(steps.shape[1]):
                m = torch.cat([m, torch.ones_like(m[:, :1])], 1)
                out = model(steps[:, t:t + 1], attention_mask=m, use_cache=True, **{kw: cache})
                logits.append(out.logits[:, -1])
        mixers = [i for i, t in enumerate(model.config.layer_types) if t in ("linear_attention", "mamba")]
        states = [(cache.layers[i].conv_states[0].clone(), cache.layers[i].recurrent_states[0].clone())
                  for i in mixers]
        return torch.stack(logits, 1), states

    ref_logits, ref_states = decode()
    with provider.use(model):
        logits, states = decode()
    torch.testing.assert_close(logits, ref_logits, **FP32)
    assert len(states) == 2
    # the first mixer's conv state holds copies of in_proj(embeddings): exact; later ones hold inputs
    # that went through other layers (rounding of a different order)
    assert torch.equal(states[0][0], ref_states[0][0])
    for (conv, ssm), (ref_conv, ref_ssm) in zip(states, ref_states):
        torch.testing.assert_close(conv, ref_conv, **FP32)
        torch.testing.assert_close(ssm, ref_ssm, **FP32)
    assert calls["selective_state_update"] == 2 * steps.shape[1]


def _hook_state(model) -> list:
    """Every forward the provider may replace, as the instance dicts hold them."""
    out = []
    for m in model.modules():
        for w in getattr(m, "_kernel_funcs", {}).values():
            out.append(("hook", w.__dict__.get("forward")))
        if type(m).__name__ in ("Mamba2Mixer", "NemotronHMamba2Mixer", "Mamba2RMSNormGated", "NemotronHRMSNormGated",
                                "MambaRMSNormGated", "Zamba2RMSNormGated", "NemotronHTopkRouter",
                                "Mamba2Block", "NemotronHBlock"):  # blocks: the decode graphs' runs
            out.append((type(m).__name__, m.__dict__.get("forward")))
    return out


def expected_mode(model) -> str:
    """Per-mixer hook wrappers exist where transformers accepts the installed `kernels` package."""
    mixers = [m for m in model.modules() if type(m).__name__ in ("Mamba2Mixer", "NemotronHMamba2Mixer")]
    return "instance" if all(hasattr(m, "_kernel_funcs") for m in mixers) else "dispatch"


@pytest.mark.parametrize("kind", KINDS)
def test_static_cache_generate_equals_transformers(kind, checkpoints, calls, references):
    """``generate(cache_implementation="static")`` (K/V written in place into preallocated tensors)
    under the provider: transformers' tokens and step logits, the provider's ops doing the work."""
    model = tiny_hf.load(checkpoints[kind])
    ids, mask = tiny_hf.prompts(3)
    kw = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
              cache_implementation="static", return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        with provider.use(model):
            got = model.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    assert rel_err(torch.stack(got.logits, 1), torch.stack(want.logits, 1)) <= 1e-4
    assert sum(calls.values()) > 0


@pytest.mark.parametrize("kind", ["mamba2", "nemotron-3-moe"])
def test_unuse_restores_transformers(kind, checkpoints, calls, references):
    model = tiny_hf.load(checkpoints[kind])
    ids, mask = tiny_hf.prompts(3)
    before, experts_before = _hook_state(model), model.get_experts_implementation()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits

    p = provider.use(model)
    assert provider.is_used(model) and provider.use(model) is p  # a second use is the same provider
    assert p.mode == expected_mode(model)
    assert any(f is not None for _, f in _hook_state(model))
    if kind == "nemotron-3-moe":
        assert model.config._experts_implementation == provider.EXPERTS_NAME
    assert provider.unuse(model) is True
    assert provider.unuse(model) is False  # nothing left to undo

    after = _hook_state(model)
    assert len(after) == len(before) and all(a[1] is b[1] for a, b in zip(after, before))
    assert model.get_experts_implementation() == experts_before
    n = sum(calls.values())
    with torch.no_grad():
        again = model(ids, attention_mask=mask).logits
    assert sum(calls.values()) == n  # no fastmamba op ran
    assert torch.equal(again, ref)


def test_unsupported_transformers_is_refused(checkpoints, monkeypatch):
    model = tiny_hf.load(checkpoints["mamba2"])
    before = _hook_state(model)
    # the module object in sys.modules now (transformers may swap its lazy module after a load)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.16.0")
    with pytest.raises(RuntimeError, match=r"supports transformers >=5\.17,<6 .*found 5\.16\.0"):
        provider.use(model)
    assert not provider.is_used(model) and all(a[1] is b[1] for a, b in zip(_hook_state(model), before))
    for bad in ("5.16.2", "6.0.0", "4.57.0"):
        with pytest.raises(RuntimeError, match="5.17"):
            provider.check_transformers_version(bad)
    for good in ("5.17.0", "5.25.0", "5.99.1"):
        assert provider.check_transformers_version(good) == good


def test_not_a_mamba_model_is_refused():
    with pytest.raises(ValueError, match="has no Mamba-2 mixer"):
        provider.use(torch.nn.Linear(2, 2))


def test_without_kernels_package_the_dispatchers_serve_used_models_only(checkpoints):
    """transformers without the `kernels` package gives mixers no private hook wrappers: the provider
    then replaces the hooks in the modeling module by dispatchers that run fastmamba only inside a
    used model's mixers, and removes them with the last unuse. A fresh process with kernels hidden."""
    code = textwrap.dedent(f"""
        import os, sys, collections, torch
        os.environ["TRITON_INTERPRET"] = "0"
        import transformers.utils.import_utils as iu
        iu.is_kernels_available = lambda *a, **k: False
        from transformers.models.mamba2 import modeling_mamba2 as mm
        import fastmamba.ops as fops
        from fastmamba.integrations import transformers as provider
        from tests.integrations import tiny_hf
        counts = collections.Counter()
        for name in ("causal_conv1d_fn", "mamba_chunk_scan_combined", "selective_state_update"):
            fn = getattr(fops, name)
            setattr(fops, name, (lambda fn, name: lambda *a, **k: (counts.update([name]), fn(*a, **k))[1])(fn, name))
        path = {str(checkpoints['mamba2'])!r}
        a, b = tiny_hf.load(path, use_kernels=False), tiny_hf.load(path, use_kernels=False)
        assert not hasattr(a.backbone.layers[0].mixer, "_kernel_funcs")
        names = [n for n in ("causal_conv1d_forward", "mamba2_scan_forward", "causal_conv1d_fn", "causal_conv1d_update",
                             "mamba2_selective_state_update", "mamba2_chunk_scan") if hasattr(mm, n)]
        originals = [getattr(mm, n) for n in names]
        ids, mask = tiny_hf.prompts(3)
        with torch.no_grad():
            ref = a.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            p = provider.use(a)
            assert p.mode == "dispatch", p.mode
            out = a.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            n = sum(counts.values())
            other = b.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
            assert sum(counts.values()) == n, "a model without use() ran fastmamba"
            provider.unuse(a)
        assert torch.equal(out, ref) and torch.equal(other, ref)
        assert counts["selective_state_update"] > 0 and counts["mamba_chunk_scan_combined"] > 0, counts
        assert [getattr(mm, n) for n in names] == originals
        print("OK")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]))
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.skipif(not INTERPRETER_AT_START, reason="needs TRITON_INTERPRET=1 set before Python starts")
def test_interpreter_runs_the_triton_kernels(tmp_path, calls):
    """The real Triton kernels (conv, chunked scan, state update, gated norm) inside transformers'
    Mamba2ForCausalLM under the interpreter: a prompt and two cached decode steps equal
    transformers' own logits."""
    cfg = transformers.Mamba2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1, state_size=16, head_dim=16,
                                    num_heads=2, expand=2, n_groups=1, conv_kernel=4, chunk_size=8,
                                    layer_norm_epsilon=1e-5)
    torch.manual_seed(0)
    model = transformers.Mamba2ForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(5)
    ids = torch.randint(0, 32, (1, 5))
    nxt = torch.randint(0, 32, (1, 2))

    kw, attr = cache_names(model)

    def steps():
        with torch.no_grad():
            out = model(ids, use_cache=True)
            cache, logits = getattr(out, attr), [out.logits[:, -1]]
            for t in range(nxt.shape[1]):
                out = model(nxt[:, t:t + 1], use_cache=True, **{kw: cache})
                logits.append(out.logits[:, -1])
        return torch.stack(logits, 1)

    ref = steps()
    with provider.use(model):
        got = steps()
    torch.testing.assert_close(got, ref, **FP32)
    assert calls["mamba_chunk_scan_combined"] == 1 and calls["selective_state_update"] == 2
    assert calls["causal_conv1d_fn"] == 1 and calls["causal_conv1d_update"] == 2 and calls["rmsnorm_fn"] == 3
