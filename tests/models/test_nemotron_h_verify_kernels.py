"""``NemotronHLM.verify`` with the Triton kernels (the interpreter on a CPU): its T logits per
request equal T plain decode steps from the same cache and a full forward, at a context long
enough that the attention layers' verify read (T query rows per request, one length each) runs
split-K with runs past the short rows' ends (forced: the automatic choice is 1 on a CPU, on a GPU
it splits when B*T x Hkv programs leave the SMs idle, as at the 8B preset's batch 1)."""
from __future__ import annotations

import pytest
import torch

import fastmamba.ops.attention.api as attention_api
from fastmamba.models.nemotron_h import NemotronHConfig, NemotronHLM, random_init
from tests.helpers import seeded, tol

pytestmark = pytest.mark.kernels

# attention twice (GQA 4/2), Mamba with 2 groups, MLP; 4-token pages
CFG = NemotronHConfig(d_model=64, vocab_size=256, pattern="M*-*", n_heads=4, n_kv_heads=2, head_dim=16,
                      intermediate_size=96, mamba_nheads=8, mamba_headdim=16, n_groups=2, d_state=16, chunk_size=16)
PAGE = 4


def scaled(model):
    with torch.no_grad():  # larger mixer weights than random_init's: every layer moves the logits
        for block in model.backbone.layers:
            for p in block.mixer.parameters():
                if p.dim() == 2:
                    p.mul_(3)
    return model


# the split-K of the attention read and the Mamba layers' verify path are independent: each path
# once, each split count once (the four combinations cost twice the interpreter time for no new case)
@pytest.mark.parametrize("path,splits", [("replay", 4), ("legacy", 1)])
def test_verify_equals_decode_steps_with_kernels(path, splits, monkeypatch):
    """Two requests (slots 1 and 0; contexts 33 and 18: odd, inside pages) verify K=3 drafts: the
    logits equal 4 decode steps from a twin cache and a full forward; then a commit of 2 and 4
    tokens and a second verify still equal decoding the accepted history.

    Verify, commit, the spec cache's prefill and the twin's decode steps run the kernels; the
    yardsticks around them (the full forwards and the twin cache's prefills) run the ops' PyTorch
    references (TRITON_INTERPRET=0 at call time): the same numbers to fp32 tolerance, an independent
    check, and about half the interpreter time."""
    monkeypatch.setattr(attention_api, "_auto_splits", lambda q, programs, max_pages: splits)

    def on_references(fn, *args):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "0")
            return fn(*args)

    model = scaled(random_init(NemotronHLM(CFG, device="cpu", dtype=torch.float32))).eval()
    K, T = 3, 4
    g = seeded(11)
    ctx = [33, 18]
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in ctx]
    cu = torch.tensor([0, ctx[0], sum(ctx)], dtype=torch.int32)
    slots = torch.tensor([1, 0], dtype=torch.int32)
    spec = model.new_cache(2, max_seq_len=64, page_size=PAGE, speculate=K)
    plain = model.new_cache(2, max_seq_len=64, page_size=PAGE)
    if path == "legacy":
        spec.reserve_legacy(2)
    for c in (spec, plain):
        c.alloc(2)
    model.prefill_varlen(torch.tensor(prompts[0] + prompts[1]), cu, spec, slots)
    on_references(model.prefill_varlen, torch.tensor(prompts[0] + prompts[1]), cu, plain, slots)
    hist = [list(p) for p in prompts]
    for rnd, accepted in enumerate(([2, 4], [4, 1])):
        toks = torch.randint(0, 256, (2, T), generator=g)
        got = model.verify(toks, spec, slots, path=path)
        for b in range(2):
            full = on_references(model, torch.tensor([hist[b] + toks[b].tolist()]))[0, -T:]
            torch.testing.assert_close(got[b], full, **tol(torch.float32))
        steps = []
        for t in range(T):  # the twin cache decodes the T inputs one by one ...
            steps.append(model.decode(toks[:, t], plain, slots))
        torch.testing.assert_close(got, torch.stack(steps, 1), **tol(torch.float32))
        model.commit(spec, slots, torch.tensor(accepted, dtype=torch.int32), path=path)
        # ... and is rebuilt at the accepted history (a fresh prefill of it)
        for b in range(2):
            hist[b] += toks[b, :accepted[b]].tolist()
        assert [spec.length(1), spec.length(0)] == [len(h) for h in hist]
        spec.kv.check()
        if rnd == 0:  # (the last round's rebuild would be compared with nothing)
            plain = model.new_cache(2, max_seq_len=64, page_size=PAGE)
            plain.alloc(2)
            on_references(model.prefill_varlen, torch.tensor(hist[0] + hist[1]),
                          torch.tensor([0, len(hist[0]), len(hist[0]) + len(hist[1])], dtype=torch.int32), plain, slots)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_equals_decode_steps_8b_attention_gpu(dtype):
    """The 8B preset's attention and Mamba shapes (32/8 heads of 128, 16-token pages; 8 groups,
    chunk 128) in a 6-layer model at a 2048-token context, K=5, batch 1 (the automatic split-K):
    verify logits vs 6 decode steps, max error relative to the largest logit: fp32 below 1e-3,
    bf16 below max(3e-2, twice decode's own distance from a full forward) (rounding of the different
    GEMM shapes, M=6 vs M=1; a wrong length, row or split gives errors of order 1)."""
    cfg = NemotronHConfig(d_model=1024, vocab_size=4096, pattern="M*-M*-", n_heads=32, n_kv_heads=8, head_dim=128,
                          intermediate_size=2048, mamba_nheads=32, mamba_headdim=64, n_groups=8, d_state=128)
    model = scaled(random_init(NemotronHLM(cfg, device="cuda", dtype=dtype))).eval()
    K, T, L = 5, 6, 2048
    g = seeded(3)
    prompt = torch.randint(0, cfg.vocab_size, (1, L), generator=g).cuda()
    toks = torch.randint(0, cfg.vocab_size, (1, T), generator=g).cuda()
    slots = torch.zeros(1, dtype=torch.int32, device="cuda")
    spec = model.new_cache(1, max_seq_len=L + 64, speculate=K)
    plain = model.new_cache(1, max_seq_len=L + 64)
    for c in (spec, plain):
        c.alloc(1)
        model.prefill(prompt, c, slots)
    got = model.verify(toks, spec, slots, path="replay")[0]
    want = torch.stack([model.decode(toks[:, t], plain, slots)[0] for t in range(T)])
    full = model(torch.cat([prompt, toks], 1))[0, -T:]  # the yardstick: the same model's rounding elsewhere
    scale = full.abs().max()
    err = ((got - want).abs().max() / scale).item()
    err_decode = ((want - full).abs().max() / scale).item()
    print(f"{dtype}: verify vs decode {err:.2e}, decode vs full forward {err_decode:.2e} (relative to max |logit|)")
    assert err < (1e-3 if dtype == torch.float32 else max(3e-2, 2 * err_decode)), (err, err_decode)
