"""Speculative decoding in ``bench e2e --speculate K``: the drafters and the engine's timed run against
the plain graphed loop's tokens."""
from __future__ import annotations

import torch

from fastmamba.bench.e2e_runs import timed

DRAFTERS = ("oracle", "ngram", "model", "mtp")


class CountingDrafter:
    """Wraps a drafter: counts propose calls (verify steps) and proposed draft tokens."""

    def __init__(self, inner):
        self.inner, self.calls, self.proposed = inner, 0, 0
        if callable(getattr(inner, "propose_device", None)):  # MTP: drafts on the device, counted on the host
            self.propose_device = self._propose_device

    def _propose_device(self, requests, k):
        n = self.inner.draft_counts(requests, k)
        drafts = self.inner.propose_device(requests, k)
        self.calls += 1
        self.proposed += sum(n)
        return drafts

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

    t_decode = timed(loop, device)
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

