"""Engine bookkeeping with a stand-in model: request intake checks, stop conditions (end of
sequence, stop ids, stop strings), failed steps, finished requests handed out once.

``CounterModel`` replaces Mamba2LM (no Triton, so these tests are cheap under the interpreter) but
keeps a real ``StateCache``: each slot holds a recurrent state, s <- (3 s + token) mod V, in
``ssm[0][slot, 0, 0, 0]``, and the next token is (5 s + 1) mod V. A request therefore gets
``chain(prompt, n)`` only if its slot is its own from prefill to the end: a leaked, shared or
stale slot changes the tokens. The real model is covered in test_engine_stop.py.
"""
from __future__ import annotations

import copy
import dataclasses
import sys

import numpy as np
import pytest
import torch

from fastmamba.cache.state_cache import StateCache
from fastmamba.generation.engine import Engine, StepOutput
from fastmamba.generation.sampling import SamplingParams
from fastmamba.models.config import PRESETS

V = 61  # prime: the state map s -> 8 s + 1 is a bijection, so the tokens cycle with period 20


def _next(s: int) -> int:
    return (5 * s + 1) % V


def _advance(s: int, tok: int) -> int:
    return (3 * s + tok) % V


def chain(prompt: list[int], n: int) -> list[int]:
    """The stand-in model's greedy tokens after ``prompt``: the definition."""
    s = 0
    for t in prompt:
        s = _advance(s, t)
    out = []
    for _ in range(n):
        out.append(_next(s))
        s = _advance(s, out[-1])
    return out


class CounterModel(torch.nn.Module):
    """Stand-in for Mamba2LM (see the module docstring); counts its calls."""

    def __init__(self, eos_token_ids: tuple[int, ...] | None = None):
        super().__init__()
        cfg = dataclasses.replace(PRESETS["mamba2-tiny"], vocab_size=V)
        if eos_token_ids is not None:  # works before and after config.py grows the field
            object.__setattr__(cfg, "eos_token_ids", eos_token_ids)
        self.cfg = cfg
        self.lm_head = torch.nn.Linear(1, V, bias=False)
        self.calls = {"prefill": 0, "decode": 0}

    def new_cache(self, num_slots, *, ssm_dtype=torch.float32, speculate=0):
        return StateCache(self.cfg, num_slots, device="cpu", conv_dtype=torch.float32, ssm_dtype=ssm_dtype,
                          speculate=speculate)

    def _logits(self, states: list[int]) -> torch.Tensor:
        logits = torch.full((len(states), V + 3), -1.0)  # 3 padded vocabulary columns, never sampled
        logits[torch.arange(len(states)), torch.tensor([_next(s) for s in states])] = 4.0
        return logits

    def prefill_varlen(self, ids, cu_seqlens, cache, slots, has_initial_state=True, **kw):
        # kw: the real model's keywords (rand_seed, cu_seqlens_host, slots_host), which change nothing here
        self.calls["prefill"] += 1
        ids, cu = ids.tolist(), cu_seqlens.tolist()
        states = []
        for b, slot in enumerate(slots.tolist()):
            cont = has_initial_state is True or (isinstance(has_initial_state, torch.Tensor) and bool(has_initial_state[b]))
            s = int(cache.ssm[0][slot, 0, 0, 0]) if cont else 0
            for t in ids[cu[b]:cu[b + 1]]:
                s = _advance(s, t)
            cache.ssm[0][slot, 0, 0, 0] = s
            states.append(s)
        return self._logits(states)

    def decode(self, tokens, cache, slots, **kw):
        self.calls["decode"] += 1
        states = []
        for tok, slot in zip(tokens.tolist(), slots.tolist()):
            s = _advance(int(cache.ssm[0][slot, 0, 0, 0]), tok)
            cache.ssm[0][slot, 0, 0, 0] = s
            states.append(s)
        return self._logits(states)


class CharTokenizer:
    """Token i decodes to "<i>" (a real ``tokenizers`` WordLevel model with a Fuse decoder)."""

    def __new__(cls):
        from tokenizers import Tokenizer, decoders, models

        tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(V)}, unk_token="<0>"))
        tok.decoder = decoders.Fuse()
        return tok


def text(ids: list[int]) -> str:
    return "".join(f"<{t}>" for t in ids)


PROMPT = [3, 1, 4, 1, 5]
REF = chain(PROMPT, 12)


def first_new(ref: list[int], start: int = 1) -> int:
    """The first position >= start whose token did not occur before it."""
    return next(i for i in range(start, len(ref)) if ref[i] not in ref[:i])


def drive(engine: Engine) -> list[StepOutput]:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def assert_note(exc: BaseException, text: str) -> None:
    if sys.version_info >= (3, 11):
        assert any(text in note for note in exc.__notes__), exc.__notes__


def assert_idle(engine: Engine) -> None:
    assert not engine.has_unfinished() and not engine.running and not engine.waiting
    assert engine.cache.free_slots == engine.max_batch


# ----------------------------------------------------------------------------- end of sequence, stops


def test_chain_reference_has_variety():
    assert len(set(REF)) >= 6, REF  # otherwise the stop tests below prove little


def test_stops_at_the_models_eos_by_default():
    i = first_new(REF, 2)
    engine = Engine(CounterModel(eos_token_ids=(REF[i], 60)), max_batch=2)
    assert engine.eos_token_ids == (REF[i], 60)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=12))
    outs = drive(engine)
    assert [o.token for o in outs] == REF[:i + 1]  # the EOS token is kept
    assert [o.finished for o in outs] == [False] * i + [True]
    last = outs[-1]
    assert last.finish_reason == "eos" and last.request.rid == rid and last.request.output == REF[:i + 1]
    assert last.request.stop_reason == REF[i]
    assert_idle(engine)


def test_ignore_eos_runs_on_and_stop_ids_still_apply():
    i = first_new(REF, 2)
    engine = Engine(CounterModel(eos_token_ids=(REF[i],)), max_batch=2)
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=10, ignore_eos=True)) == [REF[:10]]
    j = first_new(REF, i + 1)
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True, stop_token_ids=(REF[j],))
    rid = engine.add_request(PROMPT, sp)
    outs = drive(engine)
    assert [o.token for o in outs] == REF[:j + 1]
    assert outs[-1].finish_reason == "stop" and engine.pop_finished(rid).stop_reason == REF[j]
    assert_idle(engine)


def test_no_eos_known_runs_to_length():
    engine = Engine(CounterModel(), max_batch=1)  # cfg without eos_token_ids at all
    assert engine.eos_token_ids == ()
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=7))
    outs = drive(engine)
    assert [o.token for o in outs] == REF[:7] and outs[-1].finish_reason == "length"
    assert engine.pop_finished(rid).stop_reason is None


def test_stop_strings_across_tokens():
    tok = CharTokenizer()
    assert tok.decode(REF[:3]) == text(REF[:3])
    i = first_new(REF, 2)
    stop = f"{REF[i - 1]}><{REF[i]}"  # spans two tokens: completed by token i
    assert stop not in text(REF[:i])
    engine = Engine(CounterModel(eos_token_ids=(60,)), max_batch=2, tokenizer=tok)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=12, stop=["never", stop], ignore_eos=True))
    rid2 = engine.add_request([7, 7], SamplingParams(max_new_tokens=5, stop="no such text"))
    drive(engine)
    req, req2 = engine.pop_finished(rid), engine.pop_finished(rid2)
    assert req.output == REF[:i + 1] and req.finish_reason == "stop" and req.stop_reason == stop
    assert req2.output == chain([7, 7], 5) and req2.finish_reason == "length"
    # a stop string completed inside a token: the whole token is kept
    part = f"<{REF[i]}"[:2]
    k = next(n for n in range(1, 13) if part in text(REF[:n]))
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=12, stop=part)) == [REF[:k]]
    assert_idle(engine)


def test_stop_strings_need_a_tokenizer():
    engine = Engine(CounterModel(), max_batch=1)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request(PROMPT, SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match=r"params\[1\].*tokenizer"):
        engine.generate([PROMPT, PROMPT], [SamplingParams(), SamplingParams(stop="x")])
    assert_idle(engine)
    with pytest.raises(TypeError, match="decode"):
        Engine(CounterModel(), tokenizer=object())


# ------------------------------------------------------------------------------------ request intake


@pytest.mark.parametrize(
    "prompt, params, err, match",
    [
        (PROMPT, object(), TypeError, "params must be a SamplingParams, got object"),
        (PROMPT, {"temperature": 0.0}, TypeError, "params must be a SamplingParams, got dict"),
        ("3 1 4", SamplingParams(), TypeError, "got a str"),
        ([3, "1", 4], SamplingParams(), TypeError, r"prompt\[1\] must be an int token id, got str '1'"),
        ([3, 1.0], SamplingParams(), TypeError, r"prompt\[1\] must be an int token id, got float 1.0"),
        ([True, 2], SamplingParams(), TypeError, r"prompt\[0\] must be an int token id, got bool"),
        ([3, None], SamplingParams(), TypeError, r"prompt\[1\]"),
        (torch.tensor([3.0, 1.0]), SamplingParams(), TypeError, "dtype torch.float32"),
        (torch.tensor([True]), SamplingParams(), TypeError, "dtype torch.bool"),
        (torch.tensor([[3, 1]]), SamplingParams(), ValueError, r"1-D \[L\], got shape \(1, 2\)"),
        (5, SamplingParams(), TypeError, "got int"),
        ([], SamplingParams(), ValueError, "empty"),
        ([3, V, -1], SamplingParams(), ValueError, rf"\[0, {V}\).*prompt\[1\]={V}, prompt\[2\]=-1"),
    ],
    ids=["params-object", "params-dict", "str-prompt", "str-id", "float-id", "bool-id", "none-id",
         "float-tensor", "bool-tensor", "2d-tensor", "int-prompt", "empty", "out-of-range"],
)
def test_bad_requests_are_refused_before_anything_is_taken(prompt, params, err, match):
    model = CounterModel()
    engine = Engine(model, max_batch=2)
    with pytest.raises(err, match=match):
        engine.add_request(prompt, params)
    assert_idle(engine)
    assert engine.step() == [] and model.calls == {"prefill": 0, "decode": 0}
    assert engine.generate([PROMPT], SamplingParams(max_new_tokens=4)) == [REF[:4]]  # still serving
    assert_idle(engine)


def test_integer_prompts_of_every_kind():
    engine = Engine(CounterModel(), max_batch=4)
    prompts = [PROMPT, np.array(PROMPT), torch.tensor(PROMPT, dtype=torch.int32), list(torch.tensor(PROMPT)),
               [np.int64(t) for t in PROMPT], tuple(PROMPT)]
    assert engine.generate(prompts, SamplingParams(max_new_tokens=3)) == [REF[:3]] * len(prompts)
    assert_idle(engine)


def test_validated_requests_run_like_checked_ones():
    """``add_validated_request`` (the server's path: the prompt and its length were checked where the
    request entered, and are not checked again) gives the same tokens as ``add_request``, and still
    refuses params that are not a SamplingParams or need what the engine lacks."""
    engine = Engine(CounterModel(), max_batch=4)
    params = SamplingParams(max_new_tokens=5)
    rids = [engine.add_validated_request(list(PROMPT), params), engine.add_request(PROMPT, params)]
    while engine.has_unfinished():
        engine.step()
    assert [engine.pop_finished(r).output for r in rids] == [REF[:5], REF[:5]]
    for ids, p, match in ((list(PROMPT), {"max_new_tokens": 2}, "params must be a SamplingParams, got dict"),
                          (list(PROMPT), SamplingParams(stop="x"), "need a tokenizer")):
        with pytest.raises((TypeError, ValueError), match=match):
            engine.add_validated_request(ids, p)
    assert_idle(engine)


# ------------------------------------------------------------------------------------- failed steps


def test_failed_prefill_fails_its_requests_only(monkeypatch):
    model = CounterModel()
    engine = Engine(model, max_batch=3)
    a = engine.add_request(PROMPT, SamplingParams(max_new_tokens=6))
    outs = engine.step()  # a's prefill: it is running
    assert [o.token for o in outs] == REF[:1]
    real = model.prefill_varlen
    boom = RuntimeError("prefill exploded")

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(model, "prefill_varlen", real)
        raise boom

    monkeypatch.setattr(model, "prefill_varlen", fail_once)
    b = engine.add_request([9, 9, 9], SamplingParams(max_new_tokens=4))
    c = engine.add_request([2], SamplingParams(max_new_tokens=4))
    with pytest.raises(RuntimeError, match="prefill exploded") as info:
        engine.step()
    assert info.value is boom  # propagates unchanged, with a note naming the failed requests
    assert_note(info.value, f"prefill failed; requests {[b, c]} are finished")
    for rid in (b, c):
        req = engine.pop_finished(rid)
        assert req.finished and req.finish_reason == "error" and req.error is boom and req.slot == -1
    assert engine.cache.free_slots == 2 and [r.rid for r in engine.running] == [a]
    # the engine keeps serving: a goes on untouched, new requests get their own tokens
    d = engine.add_request([9, 9, 9], SamplingParams(max_new_tokens=4))
    drive(engine)
    assert engine.pop_finished(a).output == REF[:6]
    assert engine.pop_finished(d).output == chain([9, 9, 9], 4)
    assert_idle(engine)


def test_failed_decode_fails_the_batch_and_frees_every_slot(monkeypatch):
    model = CounterModel()
    engine = Engine(model, max_batch=2)
    rids = [engine.add_request(p, SamplingParams(max_new_tokens=5)) for p in (PROMPT, [8])]
    engine.step()
    real = model.decode

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(model, "decode", real)
        raise ValueError("decode exploded")

    monkeypatch.setattr(model, "decode", fail_once)
    with pytest.raises(ValueError, match="decode exploded") as info:
        engine.step()
    assert_note(info.value, f"decode step failed; requests {rids} are finished")
    assert [engine.pop_finished(r).output for r in rids] == [REF[:1], chain([8], 1)]  # the prefill's token only
    assert_idle(engine)
    assert engine.generate([[8], PROMPT], SamplingParams(max_new_tokens=5)) == [chain([8], 5), REF[:5]]
    assert_idle(engine)


def test_generate_aborts_its_other_requests_when_a_step_fails(monkeypatch):
    model = CounterModel()
    engine = Engine(model, max_batch=1)  # the second prompt waits while the first runs

    def fail(*args, **kwargs):
        raise RuntimeError("decode exploded")

    monkeypatch.setattr(model, "decode", fail)
    with pytest.raises(RuntimeError, match="decode exploded"):
        engine.generate([PROMPT, [8]], SamplingParams(max_new_tokens=3))
    assert_idle(engine)
    assert not engine.finished  # generate collects (or drops) its own requests
    monkeypatch.undo()
    assert engine.generate([[8]], SamplingParams(max_new_tokens=3)) == [chain([8], 3)]


# ---------------------------------------------------------------------------------- finished requests


def test_finished_requests_are_handed_out_once_and_do_not_accumulate():
    engine = Engine(CounterModel(), max_batch=2, max_finished=3)
    prompts = [[t, t + 1] for t in range(10)]
    want = {}
    for i, p in enumerate(prompts):
        want[engine.add_request(p, SamplingParams(max_new_tokens=1 + i % 3))] = chain(p, 1 + i % 3)
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                assert out.rid not in got and out.request.rid == out.rid
                got[out.rid] = out.request.output
            else:
                assert out.request is None and out.finish_reason is None
        assert len(engine.finished) <= 3
    assert got == want
    assert list(engine.finished) == list(got)[-3:]  # the three that finished last, uncollected
    reqs = engine.pop_finished()
    assert [r.output for r in reqs] == [want[r.rid] for r in reqs] and not engine.finished
    with pytest.raises(ValueError, match="max_finished"):
        Engine(CounterModel(), max_finished=-1)


def test_generate_leaves_nothing_behind_and_keeps_queued_requests():
    engine = Engine(CounterModel(), max_batch=2)
    queued = engine.add_request([8], SamplingParams(max_new_tokens=2))
    for _ in range(3):
        assert engine.generate([PROMPT], SamplingParams(max_new_tokens=4)) == [REF[:4]]
    assert list(engine.finished) == [queued]  # ran alongside; kept for its caller
    assert engine.pop_finished(queued).output == chain([8], 2)
    assert_idle(engine)


def test_abort_frees_the_slot():
    engine = Engine(CounterModel(), max_batch=2)
    a = engine.add_request(PROMPT, SamplingParams(max_new_tokens=8))
    b = engine.add_request([8], SamplingParams(max_new_tokens=8))
    engine.step()
    w = engine.add_request([9], SamplingParams(max_new_tokens=8))
    assert engine.abort(a) and engine.abort(w) and not engine.abort(a) and not engine.abort(12345)
    assert engine.cache.free_slots == 1
    assert engine.pop_finished(a).finish_reason == "abort" and engine.pop_finished(w).output == []
    drive(engine)
    assert engine.pop_finished(b).output == chain([8], 8)
    assert_idle(engine)


def test_stand_in_model_is_not_shared(monkeypatch):
    """The tests above mutate copies only: the preset config keeps no eos attribute of theirs."""
    CounterModel(eos_token_ids=(5,))
    assert getattr(PRESETS["mamba2-tiny"], "eos_token_ids", ()) in ((), None)
    assert copy.copy(PRESETS["mamba2-tiny"]) == PRESETS["mamba2-tiny"]


def test_generate_checks_every_request_before_queueing_any():
    model = CounterModel()
    engine = Engine(model, max_batch=2)
    with pytest.raises(TypeError, match=r"Engine.generate: prompts\[1\]: prompt\[2\] must be an int token id"):
        engine.generate([PROMPT, [1, 2, 2.5]], SamplingParams(max_new_tokens=2))
    with pytest.raises(TypeError, match=r"params\[0\] must be a SamplingParams, got NoneType"):
        engine.generate([PROMPT], [None])
    assert_idle(engine)
    assert model.calls == {"prefill": 0, "decode": 0}


def test_interrupted_step_frees_its_slots(monkeypatch):
    """A KeyboardInterrupt inside a step propagates as it is, after the same bookkeeping."""
    model = CounterModel()
    engine = Engine(model, max_batch=2)
    rid = engine.add_request(PROMPT, SamplingParams(max_new_tokens=5))
    engine.step()

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model, "decode", interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    assert engine.pop_finished(rid).finish_reason == "error"
    assert_idle(engine)
