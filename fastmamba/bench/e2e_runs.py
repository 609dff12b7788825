"""The timed runs of ``bench e2e``: prompts, a batch's prefill and graphed decode steps (Mamba-2 and
hybrid models), the 16-bit state variants and their logits' drift from an fp32-state run.

Every run prefills its prompts (timed: the batch's time to first token), takes three untimed decode
steps (graph capture, compiles), then times ``gen_len`` greedy steps (CUDA-graph replays on a GPU,
argmax on the device, no host sync inside the timed loop; eager decode on the CPU).
"""
from __future__ import annotations

import statistics
import time

import torch

from fastmamba.bench.e2e_bytes import count_touched_experts, hybrid_step_bytes, moe_layers, step_bytes

REPEAT_BLOCK = 16  # repetitive prompts: a random block of this many tokens, repeated
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
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
    t_prefill = timed(lambda: last.setdefault("logits", prefill()).argmax(-1).tolist(), device)
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
        "ssm_dtype": state_label(ssm_dtype, False),
        "stochastic_rounding": False,
    }


def timed(fn, device) -> float:
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
    """Seconds for ``gen_len`` decode steps from ``tokens`` (``timed``); each step's tokens are
    appended to ``emitted`` when given (device tensors: no sync in the loop)."""
    state = {"t": tokens}

    def loop():
        t = state["t"]
        for _ in range(gen_len):
            t = step(t)
            if emitted is not None:
                emitted.append(t)
        state["t"] = t

    return timed(loop, device)


def make_prompts(vocab_size: int, batch: int, prompt_len: int, *, repetitive: bool = False) -> torch.Tensor:
    """[batch, prompt_len] int64 random token ids on the CPU, seeded by the batch size; repetitive:
    each row a random block of REPEAT_BLOCK tokens repeated (cut to prompt_len)."""
    g = torch.Generator(device="cpu").manual_seed(batch)
    if not repetitive:
        return torch.randint(0, vocab_size, (batch, prompt_len), generator=g)
    block = torch.randint(0, vocab_size, (batch, REPEAT_BLOCK), generator=g)
    return block.repeat(1, -(-prompt_len // REPEAT_BLOCK))[:, :prompt_len].contiguous()


def state_label(ssm_dtype: torch.dtype, stochastic_rounding: bool) -> str:
    """A state variant's name in rows and tables: ``fp32``, ``fp16``, ``bf16 SR`` (stochastic rounding)."""
    name = {v: k for k, v in DTYPES.items()}[ssm_dtype]
    return name + (" SR" if stochastic_rounding else "")


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
    t_prefill = timed(lambda: last.setdefault("logits", model.prefill(prompts, cache, slots, rand_seed=seeds)),
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
        "ssm_dtype": state_label(ssm_dtype, False),
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
            "ssm_dtype": state_label(ssm_dtype, False), "stochastic_rounding": sr, "batch": B,
            "tokens": n_tokens, "max_rel_err": float(e.max()), "mean_rel_err": float(e.mean()),
            "first_argmax_diff": steps[0] if steps else None, "argmax_diffs": int(d.sum()),
        })
    return rows



LOGIT_POSITIONS = 16  # the last prompt positions whose logits the FP8 / 16-bit comparison reads


@torch.no_grad()
def last_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits [B, LOGIT_POSITIONS, V] of the last prompt positions of a full forward (no cache)."""
    return model(ids)[:, -LOGIT_POSITIONS:].float()


def fp8_logit_error(fp8_logits: torch.Tensor, load_16bit, ids: torch.Tensor, device: torch.device) -> dict:
    """The FP8 model's logits (``last_logits``, taken before it was freed) against the same random
    weights in 16 bits (``load_16bit()``, loaded now): relative error in norm ``|l8 - l16| / |l16|``
    over the positions and the largest ``max|l8 - l16| / max|l16|`` of a position. A 16-bit model
    that does not fit (``check_preset_fits``: Super's 247 GB) gives a row that says so."""
    row = {"provider": "FP8 vs 16-bit logits", "batch": int(ids.shape[0]), "prompt_len": int(ids.shape[1]),
           "positions": int(fp8_logits.shape[1])}
    try:
        ref_model = load_16bit()
    except (ValueError, torch.OutOfMemoryError) as exc:
        return dict(row, skipped=f"the 16-bit model does not load here: {str(exc).splitlines()[0]}")
    ref = last_logits(ref_model, ids).to(fp8_logits.device)
    dtype_16bit = str(ref_model.dtype)  # the model's (the logits are fp32 either way)
    del ref_model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    diff = fp8_logits - ref
    per_pos = diff.abs().amax(-1) / ref.abs().amax(-1).clamp(min=1e-30)
    return dict(row, rel_err_norm=float(diff.norm() / ref.norm().clamp(min=1e-30)), rel_err_max=float(per_pos.max()),
                dtype_16bit=dtype_16bit)
