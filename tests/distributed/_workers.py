"""Functions the tensor-parallel tests run on every spawned rank (importable, so "spawn" finds them).

Each builds its rank's model, runs the same fixed inputs as the test's TP=1 reference and returns
plain CPU tensors / lists (rank 0's result is what the test compares; every rank returns its own
so the test can check that the ranks agree)."""
from __future__ import annotations

import torch

from fastmamba.distributed import build_tp_mamba2, load_tp_model, shard_state_dict_into


def run_model(model, prompts: torch.Tensor, steps: torch.Tensor) -> dict:
    """Prefill ``prompts`` [B, L] into slots 0..B-1, then one decode step per column of ``steps``
    [B, n]; the logits of each call, fp32 on the CPU."""
    dev = model.lm_head.weight.device
    prompts, steps = prompts.to(dev), steps.to(dev)
    nreq = prompts.shape[0]
    cache = model.new_cache(nreq + 1)
    slots = torch.arange(nreq, dtype=torch.int32, device=dev)
    out = [model.prefill(prompts, cache, slots).cpu()]
    for j in range(steps.shape[1]):
        out.append(model.decode(steps[:, j].contiguous(), cache, slots).cpu())
    # a packed varlen prefill of two different lengths, into fresh slots
    cache2 = model.new_cache(2)
    ids = torch.cat([prompts[0, :3], prompts[-1]])
    cu = torch.tensor([0, 3, 3 + prompts.shape[1]], dtype=torch.int32, device=dev)
    out.append(model.prefill_varlen(ids, cu, cache2, torch.arange(2, dtype=torch.int32, device=dev)).cpu())
    return {"logits": out}


def greedy(model, prompt_lists: list[list[int]], max_new_tokens: int, speculate: int = 0, *,
           cuda_graphs: bool = False) -> list[list[int]]:
    """The engine's greedy outputs (``speculate`` K > 0: speculative decoding, n-gram drafts)."""
    from fastmamba.generation.drafters import NgramDrafter
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams

    spec = dict(speculate=speculate, drafter=NgramDrafter()) if speculate else {}
    engine = Engine(model, max_batch=len(prompt_lists), cuda_graphs=cuda_graphs, **spec)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    reqs = engine.generate(prompt_lists, params)
    return [list(r) for r in reqs]


def tp_check(tp, cfg, state_dict, ckpt_dir, prompts, steps, prompt_lists, max_new_tokens, *,
             cuda_graphs: bool = False, dtype: torch.dtype = torch.float32, hybrid=None) -> dict:
    """From memory (``state_dict``) and, when given, from the safetensors checkpoint ``ckpt_dir``:
    the logits of ``run_model``, the engine's greedy outputs and the bytes each load read; with
    ``hybrid`` = (cases, prompts, steps), also ``tp_nemotron_h``'s logits (same ranks, no new spawn)."""
    model = build_tp_mamba2(cfg, tp, dtype=dtype)
    shard_state_dict_into(model, state_dict)
    result = run_model(model.eval(), prompts, steps)
    result["greedy"] = greedy(model, prompt_lists, max_new_tokens, cuda_graphs=cuda_graphs)
    result["greedy_spec"] = greedy(model, prompt_lists, max_new_tokens, speculate=2, cuda_graphs=cuda_graphs)
    result["local_bytes"] = sum(p.nbytes for p in model.parameters())  # a tied lm_head counted once
    if ckpt_dir is not None:
        loaded = load_tp_model(ckpt_dir, tp)
        result["file_bytes_read"] = loaded.load_stats.bytes_read
        result["file_checkpoint_bytes"] = loaded.load_stats.checkpoint_bytes
        result["file_logits"] = run_model(loaded, prompts, steps)["logits"]
    if cfg.ngroups == 1 and tp.world_size > 1:  # the norm's separate all-reduce (not fused into out_proj's)
        unfused = build_tp_mamba2(cfg, tp, dtype=dtype, fuse_norm_reduce=False)
        shard_state_dict_into(unfused, state_dict)
        assert unfused.backbone.layers[0].mixer.norm.defer_to is None
        assert model.backbone.layers[0].mixer.norm.defer_to is not None
        result["unfused_logits"] = run_model(unfused.eval(), prompts, steps)["logits"]
    from fastmamba.distributed.runtime import check_ranks_agree

    check_ranks_agree(tp, result["greedy"])  # equal outputs pass
    try:  # a rank that generated something else is caught
        check_ranks_agree(tp, [[tp.rank == tp.world_size - 1]])
        result["divergence_caught"] = False
    except RuntimeError as exc:
        result["divergence_caught"] = str(exc)
    from fastmamba.bench.tp import collective_ms

    result["coll_ms"] = collective_ms(model, tp, 2, reps=3)  # the benchmark's collectives-only step runs
    if hybrid is not None:
        result["hybrid"] = tp_nemotron_h(tp, *hybrid)
    result["rank"] = tp.rank
    return result


def run_nemotron_h(model, prompts: torch.Tensor, steps: torch.Tensor) -> list[torch.Tensor]:
    """A hybrid's prefill of ``prompts`` [B, L] then one decode per column of ``steps``: the logits."""
    dev = model.lm_head.weight.device
    prompts, steps = prompts.to(dev), steps.to(dev)
    cache = model.new_cache(prompts.shape[0], max_seq_len=32, page_size=4)
    slots = cache.alloc(prompts.shape[0])
    out = [model.prefill(prompts, cache, slots).cpu()]
    for j in range(steps.shape[1]):
        out.append(model.decode(steps[:, j].contiguous(), cache, slots).cpu())
    return out


def _tp_hybrids(tp, cases):
    """Each (config, whole state dict) of ``cases`` as this rank's sharded ``NemotronHLM`` (fp32, eval)."""
    from fastmamba.distributed.nemotron_h import build_tp_nemotron_h

    for cfg, state_dict in cases:
        model = build_tp_nemotron_h(cfg, tp, dtype=torch.float32)
        shard_state_dict_into(model, state_dict)
        yield model.eval()


def tp_nemotron_h(tp, cases, prompts, steps) -> list[list[torch.Tensor]]:
    """For each (config, whole state dict) of ``cases``: the sharded hybrid's ``run_nemotron_h`` logits."""
    return [run_nemotron_h(model, prompts, steps) for model in _tp_hybrids(tp, cases)]


def run_nemotron_h_graphed(model, prompt_lists: list[list[int]], max_new_tokens: int) -> dict:
    """A hybrid on a GPU through the runtime's graphs: the logits of ``GraphedPrefill`` over the
    packed prompts (fresh slots), and the engine's greedy outputs with CUDA graphs (graphed prefill
    and decode)."""
    from fastmamba.generation.prefill_graphs import GraphedPrefill

    cache = model.new_cache(len(prompt_lists), max_seq_len=64, page_size=4)
    slots = cache.take(len(prompt_lists))
    prefiller = GraphedPrefill(model, cache, max_tokens=64, max_requests=len(prompt_lists))
    assert prefiller.fits([len(p) for p in prompt_lists])
    logits = prefiller.prefill(prompt_lists, slots, False).float().cpu()
    return {"graphed_logits": logits, "greedy": greedy(model, prompt_lists, max_new_tokens, cuda_graphs=True)}


def tp_nemotron_h_graphed(tp, cases, prompt_lists, max_new_tokens) -> list[dict]:
    """For each (config, whole state dict) of ``cases``: the sharded hybrid's ``run_nemotron_h_graphed``."""
    return [dict(run_nemotron_h_graphed(model, prompt_lists, max_new_tokens), rank=tp.rank)
            for model in _tp_hybrids(tp, cases)]


def tp_dirs_greedy(tp, dirs: list[str], prompt_lists: list[list[int]], max_new_tokens: int) -> dict:
    """For each checkpoint directory of ``dirs`` (Mamba-2 or Nemotron-H): this rank's model read by
    ``load_tp_model`` (its own slices), the engine's greedy outputs and the bytes the load read.
    Then the group is destroyed here and the gloo threads still alive are returned (none when
    ``destroy_tp`` frees the group: a group left alive aborts torchrun ranks at exit)."""
    from fastmamba.distributed.group import destroy_tp, live_gloo_threads

    out = {"greedy": [], "bytes_read": [], "checkpoint_bytes": [], "rank": tp.rank}
    for d in dirs:
        model = load_tp_model(d, tp)
        out["greedy"].append(greedy(model, prompt_lists, max_new_tokens))
        out["bytes_read"].append(model.load_stats.bytes_read)
        out["checkpoint_bytes"].append(model.load_stats.checkpoint_bytes)
        del model
    destroy_tp()
    out["gloo_threads_after_destroy"] = live_gloo_threads()
    return out


def tp_moe(tp, cases, prompts, steps, ckpt_dir: str, prompt_lists: list[list[int]], max_new_tokens: int) -> dict:
    """MoE hybrids on this rank: ``tp_nemotron_h``'s logits for ``cases``; the greedy outputs of the
    save_pretrained checkpoint ``ckpt_dir`` (per-expert tensors, read as slices) and of the
    ``nemotron-3-tiny-mtp`` preset (whose MTP layer a rank's model leaves out)."""
    out = {"rank": tp.rank, "logits": tp_nemotron_h(tp, cases, prompts, steps)}
    model = load_tp_model(ckpt_dir, tp)
    out["reduced"] = [b.mixer.reduce is not None for b in model.backbone.layers if b.kind == "E"]
    out["dir_greedy"] = greedy(model, prompt_lists, max_new_tokens)
    out["dir_bytes"] = (model.load_stats.bytes_read, model.load_stats.checkpoint_bytes)
    mtp = load_tp_model("nemotron-3-tiny-mtp", tp)
    out["mtp_dropped"] = mtp.mtp is None
    out["mtp_greedy"] = greedy(mtp, prompt_lists, max_new_tokens)
    return out


def tp_cache_bytes(tp, names: list[str]) -> dict:
    """{name: (weight bytes, slot bytes, page bytes)} of this rank's loaded share of each preset (fp32)."""
    from fastmamba.generation.capacity import per_request_bytes, weight_bytes

    out = {}
    for name in names:
        model = load_tp_model(name, tp, dtype=torch.float32)
        out[name] = (weight_bytes(model), *per_request_bytes(model, max_seq_len=256))
    return out
