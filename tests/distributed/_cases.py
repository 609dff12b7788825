"""Models, inputs and checkpoints shared by the tensor-parallel tests (and conftest's ``tp2_run``)."""
from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models.config import Mamba2Config
from fastmamba.models.loader import random_init
from fastmamba.models.mamba2_lm import Mamba2LM
from tests.distributed._workers import run_model
from tests.helpers import scaled_tiny_model


def state_spaces_config(cfg: Mamba2Config) -> dict:
    return {"d_model": cfg.d_model, "n_layer": cfg.n_layer, "vocab_size": cfg.vocab_size,
            "pad_vocab_size_multiple": 1, "tie_embeddings": cfg.tie_embeddings,
            "ssm_cfg": {"layer": "Mamba2", "d_state": cfg.d_state, "d_conv": cfg.d_conv, "expand": cfg.expand,
                        "headdim": cfg.headdim, "ngroups": cfg.ngroups, "chunk_size": cfg.chunk_size,
                        "bias": cfg.proj_bias, "conv_bias": cfg.conv_bias}}


def save(root, model: Mamba2LM, *, shards: int, state_spaces: bool) -> None:
    """model's weights as safetensors (tied lm_head left out) in ``shards`` files + config.json."""
    sd = {k: v.contiguous() for k, v in model.state_dict().items()
          if not (k == "lm_head.weight" and model.cfg.tie_embeddings)}
    if state_spaces:
        sd["backbone.embedding.weight"] = sd.pop("backbone.embeddings.weight")
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(state_spaces_config(model.cfg)))
    if shards == 1:
        save_file(sd, str(root / "model.safetensors"))
        return
    names = list(sd)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n] for n in names[s::shards]}
        save_file(part, str(root / file))
        weight_map.update({n: file for n in part})
    (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def inputs(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (2, 6), generator=g)
    steps = torch.randint(0, vocab, (2, 3), generator=g)
    prompt_lists = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 2, 9)]
    return prompts, steps, prompt_lists


def reference(model: Mamba2LM, prompts, steps, prompt_lists, max_new):
    logits = run_model(model, prompts, steps)["logits"]
    engine = Engine(model, max_batch=len(prompt_lists), cuda_graphs=False)
    greedy = engine.generate(prompt_lists, SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True))
    return logits, [list(g) for g in greedy]


def tp2_mamba_model() -> Mamba2LM:
    """mamba2-tiny (8 heads, 1 group) with mixers that dominate the logits and per-channel norms."""
    model = scaled_tiny_model("cpu")
    assert model.cfg.ngroups == 1 and model.cfg.nheads == 8
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.out_proj.weight.mul_(10)
            layer.mixer.norm.weight.copy_(1 + 0.5 * torch.randn(layer.mixer.norm.weight.shape, generator=g))
            layer.norm.weight.copy_(1 + 0.5 * torch.randn(layer.norm.weight.shape, generator=g))
    return model


def hybrid_model(cfg, seed):
    """A random NemotronHLM whose blocks matter (scaled projections) and whose norms differ per channel."""
    from fastmamba.models.nemotron_h import NemotronHLM

    model = random_init(NemotronHLM(cfg, device="cpu", dtype=torch.float32), seed=seed).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("in_proj.weight", "conv1d.weight", "q_proj.weight", "k_proj.weight", "up_proj.weight")):
                p.mul_(10)
            elif name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                p.mul_(30)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return model


def moe_model(cfg, seed):
    """``hybrid_model`` with the MoE tensors enlarged too: a router whose top-k is decided by clear
    margins (so TP's different summation order cannot flip a choice) and experts that move the logits."""
    model = hybrid_model(cfg, seed)
    g = torch.Generator().manual_seed(seed + 200)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.mul_(25)
            elif name.endswith("experts.up_proj"):
                p.mul_(10)
            elif name.endswith("experts.down_proj"):
                p.mul_(30)
            elif name.endswith(".bias") and "mixer" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
    return model


def assert_rank_shapes_are_its_slices(cfg, rank: int, world_size: int) -> None:
    """Rank ``rank``'s ``build_tp_nemotron_h`` model (no process group) holds, for every tensor,
    exactly the shape of its plan's slice of the whole model's."""
    from fastmamba.distributed import TPGroup
    from fastmamba.distributed.nemotron_h import build_tp_nemotron_h
    from fastmamba.distributed.shard import slice_tensor
    from fastmamba.models.nemotron_h import NemotronHLM

    model = build_tp_nemotron_h(cfg, TPGroup(rank=rank, world_size=world_size, device=torch.device("cpu")),
                                dtype=torch.float32)
    full = NemotronHLM(cfg, device="meta").state_dict()
    for name, t in model.state_dict().items():
        want = slice_tensor(torch.empty(full[name].shape, device="meta"), model.tp_plan[name]).shape
        assert tuple(t.shape) == tuple(want), name
