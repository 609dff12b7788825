"""``bench e2e --peer``: transformers' models on the same weights at batch 1 (Mamba2ForCausalLM's plain
PyTorch path; NemotronHForCausalLM.generate for hybrids)."""
from __future__ import annotations

import statistics
import sys

import torch

from fastmamba.bench.e2e_runs import timed


def run_peer(model, prompt_len: int, gen_len: int, device) -> dict | None:
    """transformers' Mamba2ForCausalLM on the same weights, batch 1, greedy (its PyTorch path)."""
    try:
        import transformers
    except ImportError as exc:
        print(f"peer skipped: {exc}", file=sys.stderr)
        return None
    c = model.cfg
    hf_cfg = transformers.Mamba2Config(
        hidden_size=c.d_model, num_hidden_layers=c.n_layer, num_heads=c.nheads, head_dim=c.headdim,
        expand=c.expand, state_size=c.d_state, n_groups=c.ngroups, vocab_size=c.vocab_size,
        conv_kernel=c.d_conv, chunk_size=c.chunk_size, tie_word_embeddings=c.tie_embeddings,
        use_conv_bias=c.conv_bias, use_bias=c.proj_bias, layer_norm_epsilon=c.norm_eps,
    )
    with torch.device("meta"):
        hf = transformers.Mamba2ForCausalLM(hf_cfg)
    hf.load_state_dict(model.state_dict(), assign=True, strict=False)
    hf = hf.to(device=device, dtype=model.dtype).eval()
    ids = torch.randint(0, c.vocab_size, (1, prompt_len), device=device)
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, use_cache=True)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=4, do_sample=False)  # warm-up
        t_total = timed(lambda: hf.generate(ids, **kw), device)
        t_prefill = timed(lambda: hf(ids), device)
    t_decode = max(t_total - t_prefill, 1e-9)
    return {"batch": 1, "provider": f"transformers {transformers.__version__} (torch path)",
            "ms_per_step": 1e3 * t_decode / gen_len, "decode_tok_s": gen_len / t_decode}


def run_peer_hybrid(model, prompt_len: int, gen_len: int, device) -> dict | None:
    """transformers' NemotronHForCausalLM.generate on the same weights, batch 1, greedy."""
    try:
        import transformers

        c = model.cfg
        kw = dict(vocab_size=c.vocab_size, hidden_size=c.d_model, num_attention_heads=c.n_heads,
                  num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, intermediate_size=c.intermediate_size,
                  mamba_num_heads=c.mamba_nheads, mamba_head_dim=c.mamba_headdim, n_groups=c.n_groups,
                  ssm_state_size=c.d_state, conv_kernel=c.d_conv, chunk_size=c.chunk_size,
                  tie_word_embeddings=c.tie_embeddings, layer_norm_epsilon=c.norm_eps, use_conv_bias=c.conv_bias,
                  use_bias=c.mamba_proj_bias, mlp_bias=c.mlp_bias, residual_in_fp32=c.residual_in_fp32)
        if "E" in c.pattern:  # MoE layers: the same field names in both configs
            kw.update({k: getattr(c, k) for k in (
                "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                "moe_shared_expert_intermediate_size", "moe_latent_size", "n_group", "topk_group",
                "norm_topk_prob", "routed_scaling_factor")})
        # the pattern string: what 5.17 reads, and what later releases turn into ``layers_block_type``
        hf_cfg = transformers.NemotronHConfig(hybrid_override_pattern=c.pattern, num_hidden_layers=c.n_layer, **kw)
        from fastmamba.models.nemotron_h import _pattern_of

        got = _pattern_of({k: getattr(hf_cfg, k, None) for k in ("hybrid_override_pattern", "layers_block_type")})
        if got != c.pattern:
            raise ValueError(f"its config reads the layer pattern as {got!r}, ours is {c.pattern!r}")
        with torch.device("meta"):
            hf = transformers.NemotronHForCausalLM(hf_cfg)
        sd = model.state_dict()  # transformers' checkpoint names; its module tree may say model. for backbone.
        if not any(k.startswith("backbone.") for k in hf.state_dict()):
            base = next(k for k in hf.state_dict() if k.endswith("embeddings.weight")).split("embeddings.weight")[0]
            sd = {(base + k[len("backbone."):] if k.startswith("backbone.") else k): v for k, v in sd.items()}
        missing, unexpected = hf.load_state_dict(sd, assign=True, strict=False)
        if missing or unexpected:
            raise ValueError(f"weights do not map: missing {missing[:4]}, unexpected {unexpected[:4]}")
        hf = hf.to(device=device, dtype=model.dtype).eval()
    except Exception as exc:  # the peer is optional: say why and go on
        print(f"peer skipped: transformers' NemotronHForCausalLM: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None
    ids = torch.randint(0, model.cfg.vocab_size, (1, prompt_len), device=device)
    kw = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, use_cache=True)
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm-up
        # medians of 3: a single pair of runs moved the decode estimate by +-30% (its host-bound steps)
        t_total = statistics.median(timed(lambda: hf.generate(ids, **kw), device) for _ in range(3))
        t_prefill = statistics.median(
            timed(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False), device)
            for _ in range(3))
    t_decode = max(t_total - t_prefill, 1e-9)
    return {"batch": 1, "provider": f"transformers {transformers.__version__} NemotronH", "context": prompt_len,
            "ttft_ms": 1e3 * t_prefill, "ms_per_step": 1e3 * t_decode / max(gen_len - 1, 1),
            "decode_tok_s": max(gen_len - 1, 1) / t_decode}

