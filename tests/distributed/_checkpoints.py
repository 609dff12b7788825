"""Tiny random checkpoints written by transformers' ``save_pretrained`` (what a user downloads),
for the tensor-parallel tests that load checkpoint directories."""
from __future__ import annotations

import torch


def _randomise(model) -> None:
    """Weights large enough that every layer moves the logits; norms and D away from one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm_f.weight", ".D")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif p.dim() == 2:
                p.copy_(torch.randn_like(p) * 0.15)


def save_mamba2(path, *, seed: int = 0) -> str:
    """A 2-layer Mamba2ForCausalLM: 8 heads of 16, 2 B/C groups (split over 2 ranks), vocab 96."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(
        hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, state_size=16, n_groups=2,
        vocab_size=96, conv_kernel=4, chunk_size=8, use_conv_bias=True, use_bias=False, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5)
    model = transformers.Mamba2ForCausalLM(cfg).float().eval()
    _randomise(model)
    model.save_pretrained(path)
    return str(path)


def save_nemotron_h(path, *, seed: int = 0) -> str:
    """A NemotronHForCausalLM of every dense kind (pattern M*-M): 4 query / 2 KV heads of 16, MLP
    80, 8 Mamba heads of 16 in 2 groups, vocab 128."""
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.NemotronHConfig(
        vocab_size=128, hidden_size=64, hybrid_override_pattern="M*-M", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=80, mamba_num_heads=8, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8, tie_word_embeddings=False,
        layer_norm_epsilon=1e-5)
    model = transformers.NemotronHForCausalLM(cfg).float().eval()
    _randomise(model)
    model.save_pretrained(path)
    return str(path)
