"""Tiny random transformers checkpoints (Mamba-2, dense Nemotron-H, MoE Nemotron-3) written by
save_pretrained, for the provider's parity tests. fp32, weights scaled so every layer moves the logits."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 96


def configs() -> dict:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, ssm_state_size=16, conv_kernel=4, chunk_size=8,
                  layer_norm_epsilon=1e-5, pad_token_id=0, eos_token_id=None, bos_token_id=None)
    hybrid = dict(common, num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48,
                  mamba_num_heads=4, mamba_head_dim=16, n_groups=2)
    return {
        "mamba2": transformers.Mamba2Config(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=4,
            expand=2, n_groups=2, conv_kernel=4, chunk_size=8, layer_norm_epsilon=1e-5, pad_token_id=0,
            eos_token_id=None, bos_token_id=None),
        "nemotron-h": transformers.NemotronHConfig(hybrid_override_pattern="M*M-", **hybrid),
        # MoE: 8 routed experts in 2 groups (grouped top-k), a shared expert, attention between
        "nemotron-3-moe": transformers.NemotronHConfig(
            hybrid_override_pattern="ME*ME", n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            moe_intermediate_size=24, moe_shared_expert_intermediate_size=32, routed_scaling_factor=2.5,
            norm_topk_prob=True, **hybrid),
    }


def build(kind: str, path: Path, seed: int = 0, fixed_routing: bool = False) -> Path:
    """Write a random ``kind`` checkpoint to ``path`` with save_pretrained; returns path.

    fixed_routing: the MoE router's selection bias makes every token pick experts 0 and 1 (their
    weights still vary per token), for bf16 comparisons: a near-tie in the scores otherwise flips an
    expert under any rounding change and moves that token's logits far more than bf16 noise."""
    import transformers

    cfg = configs()[kind]
    cls = transformers.Mamba2ForCausalLM if kind == "mamba2" else transformers.NemotronHForCausalLM
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():  # larger weights than the default init, so every layer moves the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".D"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("gate.weight"):  # router: spread scores, no near-ties in the top-k
                p.copy_(torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
                if fixed_routing:  # sigmoid scores lie in (0, 1): a bias gap of 2 decides the selection
                    b.zero_()
                    b[:2] = torch.tensor([3.0, 2.5])
    model.save_pretrained(path)
    return path


def load(path: Path, **kwargs):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def prompts(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [batch, 7] and attention_mask; batch 3 is left-padded to lengths 7, 5, 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, 7), generator=g)
    mask = torch.ones_like(ids)
    for b, n_pad in enumerate((0, 2, 4)[:batch]):
        ids[b, :n_pad] = 0
        mask[b, :n_pad] = 0
    return ids, mask
