"""Target ``e2e``: end-to-end prefill and decode speed of a Mamba-2 LM against the bandwidth roofline.

    python -m fastmamba.bench e2e [--model mamba2-2.7b] [--batch 1,8,64,256] [--prompt-len 128]
                                  [--gen-len 256] [--no-pdl] [--peer] [--json PATH] [--plot PATH]
                                  [--speculate K [--drafter oracle|ngram|model] [--draft-model M]
                                   [--repetitive-prompt]]
                                  [--ssm-dtype fp32,fp16,bf16] [--stochastic-rounding] [--drift N]

Per batch size B: B random prompts are prefilled into their cache slots (timed), then ``gen-len``
greedy decode steps run as CUDA-graph replays (argmax on the GPU, no host sync inside the timed
loop; programmatic dependent launch inside the graphs where the GPU has it, unless ``--no-pdl``). The roofline of one decode step is the bytes it must move, over the device-to-device copy
bandwidth measured in the same run: every weight once (tied embeddings once; of an untied input
embedding table only the B tokens' rows) plus each layer's conv and SSM state rows of the B requests
read and written once. With ``--peer``, Hugging Face
transformers' Mamba2ForCausalLM runs the same weights (its plain PyTorch path) at batch 1.
Without a GPU it says so and runs the tiny preset eagerly on the CPU.

Hybrid models (``--model nemotron-h-8b``, ``nemotron-h-4b``, ``nemotron-h-tiny`` or a Nemotron-H
checkpoint): the prompts default to 2048 tokens (the decode cost now depends on the context), the
prefill runs in groups of at most ``HYBRID_PREFILL_TOKENS`` tokens (its time is the batch's time to
first token: every prompt arrives at once), and each decode step first grows the paged KV on the
host (``HybridCache.grow``, as the engine does), then replays the CUDA graph. The roofline bytes
of a step add, per request, the attention layers' K/V read over the mean context of the timed
steps (plus the new token's K/V written) to the weights and the Mamba layers' conv and SSM states
read and written. ``--peer``: transformers' NemotronHForCausalLM.generate on the same weights at
batch 1 (a few tokens: it is slow). ``--speculate K`` (oracle or ngram drafter) as for Mamba-2: the
engine's speculative run against the plain graphed loop, same tokens expected. --drift and
--ablate are Mamba-2 only.

With ``--speculate K`` the plain run of each batch B is also the baseline of speculative decoding:
its greedy tokens are kept (the oracle drafter replays them), then ``Engine(model, max_batch=B,
speculate=K, drafter=...)`` generates as many tokens from the same prompts (its first step, the
prefill, untimed; on a GPU after an untimed warm-up run that captures its graphs). A second table
reports speculative decode tok/s, the speedup over plain decoding, the acceptance rate (accepted
drafts over proposed ones), the mean tokens emitted per request per verify step, and whether the
tokens equal the plain run's (greedy: they should; in bf16 the verify kernels' rounding can flip a
near-tie of a random-weight model's flat logits, after which the tokens differ and the oracle's
drafts are rejected: fp32 runs match exactly). Drafters:
``oracle`` (every draft accepted: the upper bound), ``ngram`` (prompt lookup; prompts are a random
block of 16 tokens repeated unless ``--no-repetitive-prompt``), ``model`` (``--draft-model``,
default mamba2-130m on a GPU and the target itself on a CPU).

16-bit SSM states: ``--ssm-dtype`` lists the state dtypes to time (default fp32); each 16-bit one runs
with round to nearest, or with stochastic rounding under ``--stochastic-rounding`` (the seeds advance
in place before every step, inside the timed loop, as the engine does). ``--drift N`` runs both
roundings for every 16-bit dtype listed, next to an fp32-state run, and adds a second measurement:
``DRIFT_BATCH`` requests generate N greedy tokens with an fp32 state, and every 16-bit variant decodes
the same tokens (teacher forced, in lockstep, each with its own cache) while its logits are compared
with the fp32 run's at every step: relative error ``max|l - l_fp32| / max|l_fp32|`` per request and
step (max and mean over all), and the first step whose argmax differs from the fp32 run's token.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from fastmamba.bench.kernels import _int_list
from fastmamba.models.quantization import QUANTIZATION_CHOICES

DRAFTERS = ("oracle", "ngram", "model", "mtp")
REPEAT_BLOCK = 16  # repetitive prompts: a random block of this many tokens, repeated


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DRIFT_BATCH = 4  # requests of the drift measurement


def _dtype_list(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {sorted(DTYPES)}, got {text!r}")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset or checkpoint dir (default: mamba2-2.7b on a GPU, mamba2-tiny on a CPU)")
    parser.add_argument("--batch", type=_int_list, default=None, help="default 1,8,64,256 on a GPU, 1,2 on a CPU")
    parser.add_argument("--prompt-len", type=int, default=None,
                        help="prompt tokens (default 128; 2048 for hybrid models, whose decode reads the context)")
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                        help="programmatic dependent launch inside the decode graphs (default: on where the GPU "
                             "has it, sm_90+; --no-pdl turns it off)")
    parser.add_argument("--peer", action="store_true", help="also time transformers' Mamba2ForCausalLM at batch 1")
    parser.add_argument("--ablate", action="store_true",
                        help="also time batch 1 with each decode trick switched off, and with PDL switched")
    parser.add_argument("--json", metavar="PATH", help="append one JSON line per row")
    parser.add_argument("--plot", metavar="PATH", help="PNG of decode tok/s vs batch (needs matplotlib)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="model weights and activations (default: the loader's, bf16 on a GPU)")
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=None,
                        help="fp8: quantise the 16-bit model on load (load_model(..., quantization='fp8'): per-channel "
                             "e4m3 weights, dynamic per-token activations), to set FP8 decode beside bf16")
    parser.add_argument("--verify-path", choices=("auto", "replay", "legacy"), default="auto",
                        help="with --speculate: the engine's verify path (auto: per step from the measured "
                        "crossover table, fastmamba.generation.spec_policy)")
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="also run speculative decoding with K drafts per step against the plain run (0 = off)")
    parser.add_argument("--drafter", choices=DRAFTERS, default="oracle",
                        help="with --speculate: oracle = replay the plain run (default; every draft accepted), "
                             "ngram = prompt lookup, model = greedy drafts of --draft-model, "
                             "mtp = the checkpoint's MTP layer (hybrids with one: nemotron-3-nano-mtp)")
    parser.add_argument("--draft-model", metavar="DIR|PRESET", default=None,
                        help="with --drafter model (default: mamba2-130m on a GPU, the target on a CPU)")
    parser.add_argument("--ssm-dtype", type=_dtype_list, default=["fp32"], metavar="LIST",
                        help="SSM state dtypes to time, comma-separated from fp32,fp16,bf16 (default fp32)")
    parser.add_argument("--stochastic-rounding", action="store_true",
                        help="16-bit states stored with stochastic rounding (default: round to nearest)")
    parser.add_argument("--drift", type=int, default=0, metavar="N",
                        help="time every 16-bit --ssm-dtype with and without stochastic rounding next to fp32, "
                             f"and report the logits' drift from an fp32-state run over N greedy tokens "
                             f"({DRIFT_BATCH} requests, teacher forced)")
    parser.add_argument("--repetitive-prompt", action=argparse.BooleanOptionalAction, default=None,
                        help=f"prompts made of a random block of {REPEAT_BLOCK} tokens repeated "
                             "(default: on with --drafter ngram, off otherwise)")


def decode_weight_bytes(model, batch: int, experts_touched: list[float] | None = None) -> int:
    """Weight bytes one decode step of ``batch`` requests must read: every parameter once (shared ones
    once), except an untied input embedding table, of which the step reads only the rows of its
    ``batch`` tokens (at most ``vocab`` distinct rows); a tied table is read whole by the LM head.

    MoE layers: only the routed experts the step's tokens chose are read. ``experts_touched`` gives,
    per MoE layer in order, the mean count of distinct experts a step's routing touched
    (``count_touched_experts``); None counts top_k x batch (at most E) per layer, exact at batch 1.
    """
    seen, weights = set(), 0
    for name, p in model.named_parameters():
        if name.startswith("mtp."):  # an MTP layer (a drafter) is not read by decode
            continue
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            weights += p.numel() * p.element_size()
    emb = model.backbone.embeddings.weight
    if emb.data_ptr() != model.lm_head.weight.data_ptr():  # untied: a gather of B rows, not the table
        weights -= (emb.shape[0] - min(batch, emb.shape[0])) * emb.shape[1] * emb.element_size()
    for j, moe in enumerate(moe_layers(model)):
        n_experts = moe.cfg.n_experts
        touched = experts_touched[j] if experts_touched is not None else min(n_experts, moe.cfg.top_k * batch)
        weights -= int((n_experts - touched) * expert_bytes(moe))
    return weights


def moe_layers(model) -> list:
    """The model's MoE layers (``fastmamba.layers.moe.MoE``), in layer order (those of its backbone:
    an MTP layer's are the drafter's)."""
    from fastmamba.layers.moe import MoE

    return [m for m in getattr(model, "backbone", model).modules() if isinstance(m, MoE)]


def expert_bytes(moe) -> int:
    """Bytes of one routed expert of a MoE layer (its up_proj and down_proj slices)."""
    up, down = moe.experts.up_proj, moe.experts.down_proj
    return (up[0].numel() + down[0].numel()) * up.element_size()


def count_touched_experts(model, step, tokens: torch.Tensor, steps: int = 4) -> list[float]:
    """Mean distinct routed experts per MoE layer over ``steps`` eager decode steps from ``tokens``
    (``step(tokens) -> tokens``): what the byte model of a MoE decode step counts. The timed steps run
    from CUDA graphs, which cannot report their routing; these steps follow them on the same requests."""
    import fastmamba.layers.moe as moe_module

    layers = moe_layers(model)
    if not layers:
        return []
    seen: list[int] = []
    route = moe_module.moe_route

    def counting(*args, **kwargs):
        routing = route(*args, **kwargs)
        seen.append(int(routing.ids.unique().numel()))
        return routing

    moe_module.moe_route = counting
    try:
        for _ in range(steps):
            tokens = step(tokens)
    finally:
        moe_module.moe_route = route
    n = len(layers)
    return [statistics.fmean(seen[j::n]) for j in range(n)]


def step_bytes(model, batch: int, ssm_dtype: torch.dtype = torch.float32) -> int:
    """Minimum bytes of one decode step: the weights it reads (``decode_weight_bytes``), plus the B
    requests' state rows read + written."""
    weights = decode_weight_bytes(model, batch)
    c = model.cfg
    conv = 2 * batch * c.conv_dim * c.d_conv * model.dtype.itemsize
    ssm = 2 * batch * c.nheads * c.headdim * c.d_state * ssm_dtype.itemsize
    return weights + c.n_layer * (conv + ssm)


def is_hybrid(model) -> bool:
    """A model whose cache pages K/V (Nemotron-H: Mamba-2, attention and MLP layers)."""
    return model.cfg.paged_cache


def hybrid_step_bytes(model, batch: int, context: float, ssm_dtype: torch.dtype = torch.float32,
                      experts_touched: list[float] | None = None) -> int:
    """Minimum bytes of one decode step of a hybrid model: the weights it reads once
    (``decode_weight_bytes``: an untied embedding table only in its B rows); per request, every Mamba
    layer's conv state (model dtype) and SSM state (``ssm_dtype``) read and written, and every
    attention layer's K and V (model dtype) read over ``context`` tokens plus the new token's K and V
    written. The dtypes are the model's: a preset loads in bf16 on a GPU and fp32 on the CPU. MoE
    layers count the routed experts the step touched (``decode_weight_bytes``)."""
    c = model.cfg
    total = decode_weight_bytes(model, batch, experts_touched)
    if "M" in c.pattern:
        m = c.mamba
        conv = m.conv_dim * m.d_conv * model.dtype.itemsize
        ssm = m.nheads * m.headdim * m.d_state * ssm_dtype.itemsize
        per_layer = 2 * (conv + ssm)
        total += batch * c.pattern.count("M") * per_layer
    if "*" in c.pattern:
        kv_token = 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize  # K and V of one token, one layer
        total += int(batch * c.pattern.count("*") * kv_token * (context + 1))
    return total


HYBRID_PREFILL_TOKENS = 16384  # tokens per prefill call of the hybrid benchmark (activations' memory)


def run_batch_hybrid(model, batch: int, prompt_len: int, gen_len: int, *, pdl: bool, device,
                     prompts: torch.Tensor | None = None, ssm_dtype: torch.dtype = torch.float32,
                     page_size: int = 16, record: bool = False) -> dict:
    """``run_batch`` for a hybrid model: prefill (its time is the batch's time to first token), then
    gen_len timed greedy decode steps, each growing the paged KV on the host, then one graph replay."""
    if prompts is None:
        prompts = make_prompts(model.cfg.vocab_size, batch, prompt_len)
    prompts = prompts.to(device)
    cache = model.new_cache(batch, max_seq_len=prompt_len + gen_len + 16, page_size=page_size, ssm_dtype=ssm_dtype)
    warm = cache.alloc(batch)
    model.prefill(prompts[:, :8], cache, warm)  # compile and warm up, then fresh slots (zero states, no pages)
    cache.free(warm)
    slots = cache.alloc(batch)
    slots_host, ones = slots.tolist(), [1] * batch
    group = max(1, HYBRID_PREFILL_TOKENS // prompt_len)

    def prefill():
        return torch.cat([model.prefill(prompts[i:i + group], cache, slots[i:i + group])
                          for i in range(0, batch, group)])

    last = {}
    t_prefill = _timed(lambda: last.setdefault("logits", prefill()).argmax(-1).tolist(), device)
    tokens = last["logits"].argmax(-1)
    emitted = [tokens]

    if device.type == "cuda":
        from fastmamba.generation.cuda_graphs import GraphedDecoder

        decoder = GraphedDecoder(model, cache, batch, pdl=pdl)

        def step(t):
            cache.grow(slots_host, ones)  # the engine's host-side step: pages and lengths
            return decoder.decode(t, slots).argmax(-1)
    else:
        def step(t):
            return model.decode(t, cache, slots).argmax(-1)

    tokens = _warm_up(step, tokens, emitted)
    context0 = cache.length(slots_host[0])
    t_decode = _time_decode(step, tokens, gen_len, device, emitted if record else None)
    context = context0 + (gen_len - 1) / 2  # mean KV length read over the timed steps
    extra = {"tokens": torch.stack(emitted, dim=1).tolist()} if record else {}
    touched = None
    if moe_layers(model):  # after the timed steps (eager: the graphs cannot report their routing)
        def eager_step(t):
            cache.grow(slots_host, ones)
            return model.decode(t, cache, slots).argmax(-1)

        touched = count_touched_experts(model, eager_step, emitted[-1])
        extra["experts_touched"] = round(statistics.fmean(touched), 2)
    return extra | {
        "batch": batch,
        "prefill_s": t_prefill,
        "ttft_ms": 1e3 * t_prefill,
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "ms_per_step": 1e3 * t_decode / gen_len,
        "decode_tok_s": batch * gen_len / t_decode,
        "context": prompt_len,
        "step_bytes": hybrid_step_bytes(model, batch, context, ssm_dtype, touched),
        "ssm_dtype": _state_label(ssm_dtype, False),
        "stochastic_rounding": False,
    }


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
        t_total = statistics.median(_timed(lambda: hf.generate(ids, **kw), device) for _ in range(3))
        t_prefill = statistics.median(
            _timed(lambda: hf.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False), device)
            for _ in range(3))
    t_decode = max(t_total - t_prefill, 1e-9)
    return {"batch": 1, "provider": f"transformers {transformers.__version__} NemotronH", "context": prompt_len,
            "ttft_ms": 1e3 * t_prefill, "ms_per_step": 1e3 * t_decode / max(gen_len - 1, 1),
            "decode_tok_s": max(gen_len - 1, 1) / t_decode}


def _timed(fn, device) -> float:
    """Seconds for fn(), synchronised."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def _warm_up(step, tokens: torch.Tensor, emitted: list) -> torch.Tensor:
    """Three decode steps first (graph capture, compiles); their tokens go to ``emitted``."""
    for _ in range(3):
        tokens = step(tokens)
        emitted.append(tokens)
    return tokens


def _time_decode(step, tokens: torch.Tensor, gen_len: int, device, emitted: list | None) -> float:
    """Seconds for ``gen_len`` decode steps from ``tokens`` (``_timed``); each step's tokens are
    appended to ``emitted`` when given (device tensors: no sync in the loop)."""
    state = {"t": tokens}

    def loop():
        t = state["t"]
        for _ in range(gen_len):
            t = step(t)
            if emitted is not None:
                emitted.append(t)
        state["t"] = t

    return _timed(loop, device)


def make_prompts(vocab_size: int, batch: int, prompt_len: int, *, repetitive: bool = False) -> torch.Tensor:
    """[batch, prompt_len] int64 random token ids on the CPU, seeded by the batch size; repetitive:
    each row a random block of REPEAT_BLOCK tokens repeated (cut to prompt_len)."""
    g = torch.Generator(device="cpu").manual_seed(batch)
    if not repetitive:
        return torch.randint(0, vocab_size, (batch, prompt_len), generator=g)
    block = torch.randint(0, vocab_size, (batch, REPEAT_BLOCK), generator=g)
    return block.repeat(1, -(-prompt_len // REPEAT_BLOCK))[:, :prompt_len].contiguous()


def _state_label(ssm_dtype: torch.dtype, stochastic_rounding: bool) -> str:
    name = {v: k for k, v in DTYPES.items()}[ssm_dtype]
    return name + (" SR" if stochastic_rounding else "")


def _label_row(r: dict, batch: int, label: str, copy_gbs: float) -> dict:
    """A timed decode row's provider (its state label) and roofline columns; logs its ms/step."""
    r["provider"] = "fastmamba" if label == "fp32" else f"fastmamba [{label} state]"
    r["roofline_ms"] = 1e3 * r["step_bytes"] / (copy_gbs * 1e9)
    r["pct_roofline"] = 100 * r["roofline_ms"] / r["ms_per_step"]
    print(f"[e2e] batch {batch}, {label} state: {r['ms_per_step']:.3f} ms/step", file=sys.stderr, flush=True)
    return r


def run_batch(model, batch: int, prompt_len: int, gen_len: int, *, pdl: bool, device,
              prompts: torch.Tensor | None = None, record: bool = False, ssm_dtype: torch.dtype = torch.float32,
              stochastic_rounding: bool = False) -> dict:
    """Prefill + gen_len timed greedy decode steps of ``batch`` requests (row keys as in the table).

    prompts  [batch, prompt_len] int64 (default: ``make_prompts``)
    ssm_dtype, stochastic_rounding  the SSM state's dtype and rounding (the seeds advance in place
             before every step, inside the timed loop, as in the engine)
    record   also return "tokens": each request's greedy tokens, [batch][gen_len + 4] host ints (the
             prefill's token, 3 warm-up steps', then the timed steps': one greedy continuation)
    """
    if prompts is None:
        prompts = make_prompts(model.cfg.vocab_size, batch, prompt_len)
    from fastmamba.generation.rounding import StochasticRounding

    prompts = prompts.to(device)
    cache = model.new_cache(batch, ssm_dtype=ssm_dtype)
    slots = cache.alloc(batch)
    rounding = StochasticRounding(model.cfg.n_layer, device) if stochastic_rounding else None
    seeds = rounding.seeds if rounding else None

    def advance():
        if rounding is not None:
            rounding.advance()

    model.prefill(prompts[:, :8], cache, slots, rand_seed=seeds)  # compile and warm up, then start from zero states
    for conv, ssm in zip(cache.conv, cache.ssm):
        conv.zero_()
        ssm.zero_()
    last = {}
    advance()
    t_prefill = _timed(lambda: last.setdefault("logits", model.prefill(prompts, cache, slots, rand_seed=seeds)),
                       device)
    tokens = last["logits"].argmax(-1)  # the first token to decode
    emitted = [tokens]

    if device.type == "cuda":
        from fastmamba.generation.cuda_graphs import GraphedDecoder

        decoder = GraphedDecoder(model, cache, batch, pdl=pdl, rand_seed=seeds)

        def step(t):
            advance()
            return decoder.decode(t, slots).argmax(-1)
    else:
        def step(t):
            advance()
            return model.decode(t, cache, slots, rand_seed=seeds).argmax(-1)

    tokens = _warm_up(step, tokens, emitted)
    t_decode = _time_decode(step, tokens, gen_len, device, emitted if record else None)
    row = {
        "batch": batch,
        "prefill_s": t_prefill,
        "prefill_tok_s": batch * prompt_len / t_prefill,
        "ms_per_step": 1e3 * t_decode / gen_len,
        "decode_tok_s": batch * gen_len / t_decode,
        "step_bytes": step_bytes(model, batch, ssm_dtype),
        "ssm_dtype": _state_label(ssm_dtype, False),
        "stochastic_rounding": stochastic_rounding,
    }
    if record:
        row["tokens"] = torch.stack(emitted, dim=1).tolist()
    return row


def state_variants(dtypes: list[str], stochastic_rounding: bool, drift: int) -> list[tuple[torch.dtype, bool]]:
    """The (ssm_dtype, stochastic_rounding) runs: each listed dtype (16-bit ones with stochastic rounding
    when asked); with ``drift``, fp32 first, then every listed 16-bit dtype with and without it."""
    if drift < 0:
        raise ValueError(f"--drift expects N >= 0 tokens, got {drift}")
    half = [DTYPES[d] for d in dtypes if d != "fp32"]
    if drift:
        if not half:
            raise ValueError("--drift compares 16-bit states with fp32: list fp16 and/or bf16 in --ssm-dtype")
        return [(torch.float32, False)] + [(d, sr) for d in half for sr in (False, True)]
    if stochastic_rounding and not half:
        raise ValueError("--stochastic-rounding rounds 16-bit states: list fp16 and/or bf16 in --ssm-dtype")
    return [(DTYPES[d], stochastic_rounding and d != "fp32") for d in dtypes]


def run_drift(model, prompts: torch.Tensor, n_tokens: int, variants: list[tuple[torch.dtype, bool]], *,
              device, pdl: bool | None = None) -> list[dict]:
    """The logits' drift of 16-bit-state variants from an fp32-state run over ``n_tokens`` greedy tokens.

    prompts   [B, L] int64; every variant prefills them into its own cache, then decodes the fp32
              run's greedy tokens (teacher forced) in lockstep with it, one step at a time
    variants  (ssm_dtype, stochastic_rounding) pairs (fp32 with False gives zero drift: a check)
    Per variant: the relative error ``max|l - l_ref| / max|l_ref|`` of its logits at every request
    and step (the prefill's last-token logits are step 0), its max and mean, the first step whose
    argmax differs from the fp32 run's token (None: never) and the number of such (request, step)
    pairs. CUDA graphs on a GPU; no host sync inside the loop.
    """
    from fastmamba.generation.rounding import StochasticRounding

    prompts = prompts.to(device)
    B = prompts.shape[0]
    graphs = device.type == "cuda"

    def runner(ssm_dtype: torch.dtype, sr: bool):
        cache = model.new_cache(B, ssm_dtype=ssm_dtype)
        slots = cache.alloc(B)
        rounding = StochasticRounding(model.cfg.n_layer, device) if sr else None
        seeds = rounding.seeds if rounding else None
        decoder = None
        if graphs:
            from fastmamba.generation.cuda_graphs import GraphedDecoder

            decoder = GraphedDecoder(model, cache, B, pdl=pdl, rand_seed=seeds)

        def prefill():
            if rounding is not None:
                rounding.advance()
            return model.prefill(prompts, cache, slots, rand_seed=seeds)

        def step(tokens):
            if rounding is not None:
                rounding.advance()
            if decoder is not None:
                return decoder.decode(tokens, slots)
            return model.decode(tokens, cache, slots, rand_seed=seeds)

        return prefill, step

    ref_prefill, ref_step = runner(torch.float32, False)
    runs = [runner(d, sr) for d, sr in variants]
    errs = [[] for _ in variants]  # per variant: [B] relative errors per step
    diffs = [[] for _ in variants]  # per variant: [B] argmax != fp32 token per step

    def compare(ref: torch.Tensor, tokens: torch.Tensor, outs: list[torch.Tensor]) -> None:
        scale = ref.abs().amax(-1).clamp_min(torch.finfo(torch.float32).tiny)
        for i, out in enumerate(outs):
            errs[i].append((out - ref).abs().amax(-1) / scale)
            diffs[i].append(out.argmax(-1) != tokens)

    ref = ref_prefill()
    tokens = ref.argmax(-1)
    compare(ref, tokens, [prefill() for prefill, _ in runs])
    for _ in range(n_tokens - 1):
        ref = ref_step(tokens)
        outs = [step(tokens) for _, step in runs]  # every variant decodes the fp32 run's token
        tokens = ref.argmax(-1)
        compare(ref, tokens, outs)
    rows = []
    for (ssm_dtype, sr), e, d in zip(variants, errs, diffs):
        e, d = torch.stack(e), torch.stack(d)  # [n_tokens, B]
        steps = torch.nonzero(d.any(-1)).flatten().tolist()
        rows.append({
            "ssm_dtype": _state_label(ssm_dtype, False), "stochastic_rounding": sr, "batch": B,
            "tokens": n_tokens, "max_rel_err": float(e.max()), "mean_rel_err": float(e.mean()),
            "first_argmax_diff": steps[0] if steps else None, "argmax_diffs": int(d.sum()),
        })
    return rows


class CountingDrafter:
    """Wraps a drafter: counts propose calls (verify steps) and proposed draft tokens."""

    def __init__(self, inner):
        self.inner, self.calls, self.proposed = inner, 0, 0

    def propose(self, requests, k):
        drafts = self.inner.propose(requests, k)
        self.calls += 1
        self.proposed += sum(len(d) for d in drafts)
        return drafts

    def __getattr__(self, name):  # the rest of the drafter's interface (MTP: needs_hidden, observe, forget)
        return getattr(self.inner, name)


def make_bench_drafter(name: str, *, prompts: list[list[int]], plain_tokens: list[list[int]], draft_model,
                       batch: int, vocab_size: int, max_seq_len: int = 4096):
    """The drafter for one speculative run (``oracle`` replays ``plain_tokens``)."""
    from fastmamba.generation.drafters import ModelDrafter, NgramDrafter, OracleDrafter

    if name == "oracle":
        return OracleDrafter.from_runs(prompts, plain_tokens)
    if name == "ngram":
        return NgramDrafter()
    if name == "model":
        return ModelDrafter(draft_model, batch, target_vocab_size=vocab_size)
    if name == "mtp":  # draft_model: the target itself, which carries the MTP layer
        from fastmamba.generation.mtp_drafter import MTPDrafter

        if draft_model is None:
            raise ValueError("e2e: --drafter mtp needs a hybrid model with an MTP layer (e.g. nemotron-3-nano-mtp)")

        return MTPDrafter(draft_model, batch, max_seq_len=max_seq_len)
    raise ValueError(f"e2e: unknown drafter {name!r}; expected one of {DRAFTERS}")


def run_speculative(model, prompts: torch.Tensor, plain_tokens: list[list[int]], gen_len: int, k: int, drafter,
                    *, device, verify_path: str = "auto", pdl: bool | None = None,
                    engine_kw: dict | None = None) -> dict:
    """Speculative greedy decoding of the B prompts [B, L] until each has gen_len + 1 tokens (the
    prefill's, then gen_len decoded, as the plain run's timed steps); the decode part is timed.

    plain_tokens  the plain run's tokens per request (at least gen_len + 1 each), for the check
    Returns the row: decode tok/s, ms per verify step, acceptance, tokens per verify step, match.
    """
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams

    B = prompts.shape[0]
    rows = prompts.tolist()
    counter = CountingDrafter(drafter)
    engine = Engine(model, max_batch=B, speculate=k, drafter=counter, verify_path=verify_path, pdl=pdl,
                    **(engine_kw or {}))
    if device.type == "cuda":  # capture the verify graphs and compile, untimed
        engine.generate(rows, SamplingParams(max_new_tokens=min(gen_len + 1, 2 * (k + 1) + 1), ignore_eos=True))
    counter.calls = counter.proposed = 0
    engine.stats["steps"] = dict.fromkeys(engine.stats["steps"], 0)  # count the timed run only
    params = SamplingParams(max_new_tokens=gen_len + 1, ignore_eos=True)
    rids = [engine.add_request(p, params) for p in rows]
    engine.step()  # the prefill: every request admitted at once (max_batch = B), untimed
    if engine.waiting:
        raise RuntimeError(f"e2e: the first engine step admitted {B - len(engine.waiting)} of {B} requests")

    def loop():
        while engine.has_unfinished():
            engine.step()

    t_decode = _timed(loop, device)
    reqs = [engine.finished.pop(rid) for rid in rids]
    request_steps = sum(len(r.accepted) for r in reqs)
    accepted = sum(r.accepted_drafts for r in reqs)
    decoded = sum(len(r.output) - 1 for r in reqs)
    matches = [r.output == list(t[:gen_len + 1]) for r, t in zip(reqs, plain_tokens)]
    # where each request first left the plain run's tokens (None: never): a bf16 near-tie flips
    # one token somewhere, a wrong verify diverges at once (the prefill token is index 0)
    first_diff = [next((i for i, (a, b) in enumerate(zip(r.output, t)) if a != b), None)
                  for r, t in zip(reqs, plain_tokens)]
    return {
        "batch": B,
        "speculate": k,
        "decode_tok_s": decoded / t_decode,
        "verify_steps": counter.calls,
        "ms_per_step": 1e3 * t_decode / max(1, counter.calls),
        "drafts_proposed": counter.proposed,
        "drafts_accepted": accepted,
        "acceptance": accepted / counter.proposed if counter.proposed else 0.0,
        "tokens_per_step": decoded / max(1, request_steps),
        "tokens_match": all(matches),
        "requests_matching": sum(matches),
        "first_mismatch": first_diff,
        "verify_path": verify_path,
        "steps_by_path": dict(engine.stats["steps"]),  # the engine's per-step choice (replay / legacy / plain)
    }


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
        t_total = _timed(lambda: hf.generate(ids, **kw), device)
        t_prefill = _timed(lambda: hf(ids), device)
    t_decode = max(t_total - t_prefill, 1e-9)
    return {"batch": 1, "provider": f"transformers {transformers.__version__} (torch path)",
            "ms_per_step": 1e3 * t_decode / gen_len, "decode_tok_s": gen_len / t_decode}


def _is_hybrid_dir(name: str) -> bool:
    import os

    path = os.path.join(name, "config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        return json.load(f).get("model_type") == "nemotron_h"


def _run_hybrid(args, model, name, batches, prompt_len, gen_len, variants, copy_gbs, header, device, command) -> int:
    """The e2e table of a hybrid model: decode tok/s, ms/step, % of roofline, TTFT per batch."""
    from fastmamba.bench.peak import device_name

    cuda = device.type == "cuda"
    c = model.cfg
    print(f"# hybrid: {c.pattern.count('M')} Mamba / {c.pattern.count('*')} attention / "
          f"{c.pattern.count('-')} MLP" + (f" / {c.pattern.count('E')} MoE" if "E" in c.pattern else "")
          + f" layers, context {prompt_len}"
          + ("; roofline bytes count the routed experts each step touched (experts/layer: distinct, "
             "mean over MoE layers)" if "E" in c.pattern else ""))
    rows, spec_rows = [], []
    K = args.speculate
    for b in batches:
        prompts = make_prompts(c.vocab_size, b, prompt_len, repetitive=K > 0 and args.drafter == "ngram")
        for v, (ssm_dtype, _) in enumerate(variants):
            if _:
                print("note: --stochastic-rounding is not timed for hybrid models; round to nearest", file=sys.stderr)
            r = run_batch_hybrid(model, b, prompt_len, gen_len, pdl=args.pdl, device=device, prompts=prompts,
                                 ssm_dtype=ssm_dtype, record=bool(K) and v == 0)
            if v == 0:
                plain, plain_tokens = r, r.pop("tokens", None)
            rows.append(_label_row(r, b, _state_label(ssm_dtype, False), copy_gbs))
            if cuda:
                torch.cuda.empty_cache()
        if K:
            if args.drafter == "model":
                print("error: --drafter model is not wired for hybrid models; use oracle or ngram", file=sys.stderr)
                return 2
            drafter = make_bench_drafter(args.drafter, prompts=prompts.tolist(), plain_tokens=plain_tokens,
                                         draft_model=model if args.drafter == "mtp" else None, batch=b,
                                         vocab_size=c.vocab_size, max_seq_len=prompt_len + gen_len + 2 * K + 8)
            sr = run_speculative(model, prompts, plain_tokens, gen_len, K, drafter, device=device, pdl=args.pdl,
                                 verify_path=args.verify_path,
                                 engine_kw={"max_seq_len": prompt_len + gen_len + K + 8})
            sr.update(provider=f"fastmamba speculative K={K} ({args.drafter})", drafter=args.drafter,
                      prompt_len=prompt_len, gen_len=gen_len, plain_decode_tok_s=plain["decode_tok_s"],
                      speedup=sr["decode_tok_s"] / plain["decode_tok_s"])
            spec_rows.append(sr)
            print(f"[e2e] batch {b} speculative: {sr['decode_tok_s']:.0f} tok/s, acceptance "
                  f"{sr['acceptance']:.0%}, first token off the plain run's per request: {sr['first_mismatch'][:8]}",
                  file=sys.stderr, flush=True)
            if cuda:
                torch.cuda.empty_cache()
    if args.peer:
        peer_gen = min(gen_len, 16) if cuda else min(gen_len, 4)
        peer = run_peer_hybrid(model, prompt_len, peer_gen, device)
        if peer:
            # its timed decode steps (generate's tokens after the first) read prompt_len .. prompt_len + peer_gen - 2
            peer_context = prompt_len + max(peer_gen - 2, 0) / 2
            peer["step_bytes"] = hybrid_step_bytes(model, 1, peer_context)
            peer["roofline_ms"] = 1e3 * peer["step_bytes"] / (copy_gbs * 1e9)
            peer["pct_roofline"] = 100 * peer["roofline_ms"] / peer["ms_per_step"]
            rows.append(peer)
            ours = next((r for r in rows if r["batch"] == 1 and r["provider"] == "fastmamba"), None)
            if ours:
                peer["fastmamba_speedup"] = ours["decode_tok_s"] / peer["decode_tok_s"]
    print(f"{'provider':34} {'batch':>5} {'context':>7} {'TTFT ms':>9} {'prefill tok/s':>14} {'ms/step':>9} "
          f"{'decode tok/s':>13} {'roofline ms':>12} {'% roofline':>10}" + (" experts/layer" if moe_layers(model) else ""))
    for r in rows:
        pre = f"{r['prefill_tok_s']:14.0f}" if "prefill_tok_s" in r else f"{'—':>14}"
        experts = f" {r['experts_touched']:13.1f}" if "experts_touched" in r else ""
        print(f"{r['provider']:34} {r['batch']:5d} {r['context']:7d} {r['ttft_ms']:9.2f} {pre} "
              f"{r['ms_per_step']:9.3f} {r['decode_tok_s']:13.1f} {r['roofline_ms']:12.3f} {r['pct_roofline']:9.0f}%"
              + experts)
    peer = next((r for r in rows if "fastmamba_speedup" in r), None)
    if peer:
        print(f"fastmamba / transformers decode tok/s at batch 1: {peer['fastmamba_speedup']:.1f}x")
    if spec_rows:
        print(f"{'speculative decoding':34} {'batch':>5} {'K':>3} {'plain tok/s':>12} {'spec tok/s':>11} "
              f"{'speedup':>8} {'accepted':>9} {'tok/step':>9} {'match':>6}")
        for r in spec_rows:
            print(f"{r['provider']:34} {r['batch']:5d} {r['speculate']:3d} {r['plain_decode_tok_s']:12.1f} "
                  f"{r['decode_tok_s']:11.1f} {r['speedup']:7.2f}x {r['acceptance']:8.0%} "
                  f"{r['tokens_per_step']:9.2f} {'yes' if r['tokens_match'] else 'NO':>6}")
    if args.json:
        with open(args.json, "a") as f:
            for r in rows + spec_rows:
                f.write(json.dumps(dict(r, model=name, device=device_name(device), copy_gbs=copy_gbs,
                                        quantization=args.quantization, command=command)) + "\n")
    if args.plot:
        print("--plot: not drawn for hybrid models", file=sys.stderr)
    return 0


def run(args: argparse.Namespace, command: str) -> int:
    import fastmamba
    from fastmamba.bench.peak import device_name, measure_copy_bandwidth

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    name = args.model or ("mamba2-2.7b" if cuda else "mamba2-tiny")
    batches = args.batch or ([1, 8, 64, 256] if cuda else [1, 2])
    gen_len = args.gen_len if cuda else min(args.gen_len, 16)
    hybrid_name = name.startswith("nemotron") or _is_hybrid_dir(name)
    prompt_len = args.prompt_len or (2048 if hybrid_name else 128)
    prompt_len = prompt_len if cuda else min(prompt_len, 16)
    if hybrid_name and (args.drift or args.ablate):
        print("error: --drift and --ablate are not implemented for hybrid (Nemotron-H) models yet",
              file=sys.stderr)
        return 2
    if not cuda:
        print("no GPU: running the tiny preset eagerly on the CPU (Triton interpreter if TRITON_INTERPRET=1); "
              "these timings say nothing about GPU speed", file=sys.stderr)
    K = args.speculate
    if K < 0:
        print(f"error: --speculate expects K >= 0, got {K}", file=sys.stderr)
        return 2
    repetitive = args.repetitive_prompt if args.repetitive_prompt is not None else (K > 0 and args.drafter == "ngram")
    try:
        variants = state_variants(args.ssm_dtype, args.stochastic_rounding, args.drift)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    copy_gbs = measure_copy_bandwidth(device)
    model = fastmamba.load_model(name, device=device, dtype=DTYPES[args.dtype] if args.dtype else None,
                                 quantization=args.quantization)
    draft_model, draft_name = None, None
    if K and args.drafter == "model":
        from fastmamba.generation.drafters import check_draft_vocab

        draft_name = args.draft_model or ("mamba2-130m" if cuda else name)
        draft_model = fastmamba.load_model(draft_name, dtype=model.dtype, device=device)
        try:
            check_draft_vocab(draft_model.cfg.vocab_size, model.cfg.vocab_size)
        except ValueError as exc:
            print(f"error: --draft-model {draft_name}: {exc}", file=sys.stderr)
            return 2
    if args.pdl is None:
        from fastmamba.ops.runtime import pdl_supported

        args.pdl = cuda and pdl_supported(torch.empty(0, device=device))
    header = (f"# e2e decode: {name} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B params, "
              f"{model.dtype}{', FP8 weights' if args.quantization else ''}), {device_name(device)}, copy {copy_gbs:.0f} GB/s, prompt {prompt_len}, "
              f"gen {gen_len}, CUDA graphs {'on' if cuda else 'off'}, PDL {'on' if args.pdl else 'off'}; "
              f"command: {command}")
    if K:
        header += (f"; speculate K={K}, drafter {args.drafter}"
                   f"{f' ({draft_name})' if draft_name else ''}, {'repetitive' if repetitive else 'random'} prompts")
    print(header)
    rows, spec_rows = [], []
    if is_hybrid(model):
        return _run_hybrid(args, model, name, batches, prompt_len, gen_len, variants, copy_gbs, header, device,
                           command)
    for b in batches:
        prompts = make_prompts(model.cfg.vocab_size, b, prompt_len, repetitive=repetitive)
        for v, (ssm_dtype, rounding) in enumerate(variants):  # the first one is speculation's baseline
            rv = run_batch(model, b, prompt_len, gen_len, pdl=args.pdl, device=device, prompts=prompts,
                           record=bool(K) and v == 0, ssm_dtype=ssm_dtype, stochastic_rounding=rounding)
            rows.append(_label_row(rv, b, _state_label(ssm_dtype, rounding), copy_gbs))
            if v == 0:
                r, plain_tokens = rv, rv.pop("tokens", None)
            if cuda:
                torch.cuda.empty_cache()
        if K:
            if cuda:
                torch.cuda.empty_cache()  # the plain run's cache and graphs
            drafter = make_bench_drafter(args.drafter, prompts=prompts.tolist(), plain_tokens=plain_tokens,
                                         draft_model=draft_model, batch=b, vocab_size=model.cfg.vocab_size)
            sr = run_speculative(model, prompts, plain_tokens, gen_len, K, drafter, device=device, pdl=args.pdl,
                                 verify_path=args.verify_path)
            sr.update(provider=f"fastmamba speculative K={K} ({args.drafter})", drafter=args.drafter,
                      draft_model=draft_name, repetitive_prompt=repetitive, prompt_len=prompt_len, gen_len=gen_len,
                      plain_decode_tok_s=r["decode_tok_s"], speedup=sr["decode_tok_s"] / r["decode_tok_s"])
            spec_rows.append(sr)
            del drafter
            if cuda:
                torch.cuda.empty_cache()
            print(f"[e2e] batch {b} speculative: {sr['decode_tok_s']:.0f} tok/s, acceptance "
                  f"{sr['acceptance']:.0%}", file=sys.stderr, flush=True)
    drift_rows = []
    if args.drift:
        prompts = make_prompts(model.cfg.vocab_size, DRIFT_BATCH, prompt_len)
        drift_rows = run_drift(model, prompts, args.drift if cuda else min(args.drift, 16), variants, device=device,
                               pdl=args.pdl)
    if args.ablate:
        variants = [("all tricks on", {}, args.pdl), ("A = -exp(A_log) in PyTorch", {"A_in_kernel": False}, args.pdl),
                    ("silu(z) gate in the norm", {"gate_in_scan": False}, args.pdl),
                    ("conv update in PyTorch ops", {"fused_conv": False}, args.pdl),
                    ("projections in cuBLAS", {"triton_gemv": False}, args.pdl)]
        if cuda:  # (the CPU runs no graphs)
            variants.append(("all on, PDL off" if args.pdl else "all on, PDL on", {}, not args.pdl))
        print(f"{'ablation (batch 1)':34} {'ms/step':>9} {'tok/s':>8} {'vs all on':>10}")
        base = None
        for label, switches, pdl in variants:
            model.set_decode_tricks(**switches)
            r = run_batch(model, 1, prompt_len, gen_len, pdl=pdl, device=device)
            base = base or r["ms_per_step"]
            print(f"{label:34} {r['ms_per_step']:9.3f} {r['decode_tok_s']:8.0f} "
                  f"{100 * (r['ms_per_step'] / base - 1):+9.1f}%")
            rows.append(dict(r, provider=f"fastmamba [{label}]", roofline_ms=1e3 * r["step_bytes"] / (copy_gbs * 1e9),
                             pct_roofline=100 * r["step_bytes"] / (copy_gbs * 1e9) * 1e3 / r["ms_per_step"]))
        model.set_decode_tricks()
    if args.peer and cuda:
        peer = run_peer(model, prompt_len, min(gen_len, 64), device)
        if peer:
            peer["roofline_ms"] = 1e3 * step_bytes(model, 1) / (copy_gbs * 1e9)
            peer["pct_roofline"] = 100 * peer["roofline_ms"] / peer["ms_per_step"]
            rows.append(peer)
    print(f"{'provider':42} {'batch':>5} {'prefill tok/s':>14} {'ms/step':>9} {'decode tok/s':>13} "
          f"{'roofline ms':>12} {'% roofline':>10}")
    for r in rows:
        pre = f"{r['prefill_tok_s']:14.0f}" if "prefill_tok_s" in r else f"{'—':>14}"
        print(f"{r['provider']:42} {r['batch']:5d} {pre} {r['ms_per_step']:9.3f} {r['decode_tok_s']:13.0f} "
              f"{r['roofline_ms']:12.3f} {r['pct_roofline']:9.0f}%")
    if spec_rows:
        print(f"{'speculative decoding':42} {'batch':>5} {'K':>3} {'plain tok/s':>12} {'spec tok/s':>11} "
              f"{'speedup':>8} {'accepted':>9} {'tok/step':>9} {'ms/step':>9} {'match':>6}  steps by path")
        for r in spec_rows:
            paths = " ".join(f"{p}:{n}" for p, n in r.get("steps_by_path", {}).items() if n)
            print(f"{r['provider']:42} {r['batch']:5d} {r['speculate']:3d} {r['plain_decode_tok_s']:12.0f} "
                  f"{r['decode_tok_s']:11.0f} {r['speedup']:7.2f}x {r['acceptance']:8.0%} "
                  f"{r['tokens_per_step']:9.2f} {r['ms_per_step']:9.3f} {'yes' if r['tokens_match'] else 'NO':>6}  "
                  f"{paths} ({r.get('verify_path', 'auto')})")
    if drift_rows:
        print(f"{'logits drift from an fp32-state run':42} {'state':>8} {'requests':>8} {'tokens':>7} "
              f"{'max rel err':>12} {'mean rel err':>13} {'first argmax diff':>18} {'argmax diffs':>13}")
        for r in drift_rows:
            first = "never" if r["first_argmax_diff"] is None else str(r["first_argmax_diff"])
            print(f"{'fastmamba (teacher forced)':42} {_state_label(DTYPES[r['ssm_dtype']], r['stochastic_rounding']):>8} "
                  f"{r['batch']:8d} {r['tokens']:7d} {r['max_rel_err']:12.3e} {r['mean_rel_err']:13.3e} "
                  f"{first:>18} {r['argmax_diffs']:13d}")
            r["provider"] = "fastmamba drift"
    if args.json:
        with open(args.json, "a") as f:
            for r in rows + spec_rows + drift_rows:
                f.write(json.dumps(dict(r, model=name, device=device_name(device), copy_gbs=copy_gbs,
                                        quantization=args.quantization, command=command)) + "\n")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("--plot needs matplotlib; skipped", file=sys.stderr)
        else:
            ours = [r for r in rows if r["provider"] == "fastmamba"]
            fig, ax = plt.subplots(figsize=(6, 4))
            ax.plot([r["batch"] for r in ours], [r["decode_tok_s"] for r in ours], "o-", label="fastmamba")
            ax.plot([r["batch"] for r in ours], [r["batch"] * 1e3 / r["roofline_ms"] for r in ours], "--",
                    label="bandwidth roofline")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("batch")
            ax.set_ylabel("decode tokens / s")
            ax.set_title(f"{name}, {device_name(device)}")
            ax.legend()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
    return 0
