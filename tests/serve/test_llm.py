"""The offline one-call API: LLM(model).generate(prompts, params) equals the engine it wraps; LLM.chat
renders the chat template; bad arguments get one clear error (issue 48's probes)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fastmamba import LLM, SamplingParams
from fastmamba.generation.engine import Engine


@pytest.fixture
def llm(tokenizer_dir, reference_ops):
    return LLM("mamba2-tiny", tokenizer=tokenizer_dir, dtype=torch.float32, device="cpu", max_batch=4)


def test_llm_generate_equals_engine(llm):
    params = SamplingParams(max_new_tokens=5)
    outs = llm.generate(["w1 w2 w3", [7, 8, 9]], params)
    ids = [llm.codec.encode_prompt("w1 w2 w3"), [7, 8, 9]]
    want = Engine(llm.model, max_batch=4).generate(ids, params)
    assert [o.prompt_token_ids for o in outs] == ids
    assert [o.token_ids for o in outs] == want
    assert outs[0].text == llm.codec.decode(want[0]) and outs[0].finish_reason == "length"
    single = llm.generate([7, 8, 9], params)  # one prompt of ids
    assert len(single) == 1 and single[0].token_ids == want[1]


def test_llm_text_needs_a_tokenizer(reference_ops):
    llm = LLM("mamba2-tiny", dtype=torch.float32, device="cpu", max_batch=2)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("hello")


# ---------------------------------------------------------------------------------------------
# prompts as numpy arrays, numpy ints, tuples


def test_prompt_forms_equal_a_list_of_ints(llm):
    params = SamplingParams(max_new_tokens=3)
    want = llm.generate([[7, 8, 9]], params)[0].token_ids
    forms = [(7, 8, 9), np.array([7, 8, 9]), np.array([7, 8, 9], dtype=np.int32), [np.int64(7), np.int64(8), 9],
             torch.tensor([7, 8, 9])]
    for form in forms:
        out = llm.generate(form, params)
        assert len(out) == 1 and out[0].token_ids == want and out[0].prompt_token_ids == [7, 8, 9], form
    outs = llm.generate(np.array([[7, 8, 9], [7, 8, 9]]), params)  # 2-D: a batch of prompts
    assert [o.token_ids for o in outs] == [want, want]
    outs = llm.generate([np.array([7, 8, 9]), (7, 8, 9)], params)
    assert [o.token_ids for o in outs] == [want, want]


@pytest.mark.parametrize("prompts,error,match", [
    (1, TypeError, "prompts expected a string, token ids, or a list of those, got int"),
    (None, TypeError, "prompts expected a string, token ids, or a list of those, got NoneType"),
    ([], ValueError, "no prompts"),
    (np.array([7.0, 8.0]), TypeError, r"prompts\[0\]: token ids must be integers, got an array of float64"),
    ([[7, 8.5]], TypeError, r"prompts\[0\]\[1\]: token ids must be ints, got float 8.5"),
    ([[7, True]], TypeError, r"prompts\[0\]\[1\]: token ids must be ints, got bool"),
    ([None], TypeError, r"prompts\[0\]: expected a string or a sequence of int token ids, got NoneType"),
    (np.zeros((1, 1, 2), dtype=np.int64), TypeError, "got ndarray"),
], ids=["int", "None", "empty", "float-array", "float-id", "bool-id", "None-prompt", "3-D"])
def test_bad_prompts_are_named(llm, prompts, error, match):
    with pytest.raises(error, match=match):
        llm.generate(prompts)
    assert not llm.engine.has_unfinished()


def test_a_bad_prompt_leaves_the_engine_clean(llm):
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 256\)"):
        llm.generate([[1, 2], [999]])  # the first was queued when the second was refused
    assert not llm.engine.has_unfinished() and not llm.engine.finished
    assert len(llm.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0].token_ids) == 2  # and still serves


def test_bad_params(llm):
    with pytest.raises(TypeError, match="params must be a SamplingParams or a list of them, got dict"):
        llm.generate([1, 2], {"max_tokens": 3})
    with pytest.raises(ValueError, match="2 prompts but 1 SamplingParams"):
        llm.generate([[1], [2]], [SamplingParams()])


# ---------------------------------------------------------------------------------------------
# finish reasons are the engine's; stop strings use the tokenizer


@pytest.fixture
def scaled_llm(tokenizer_dir, reference_ops):
    """The tiny preset with its mixers scaled up: greedy decoding emits distinct tokens."""
    from tests.helpers import scaled_tiny_model

    return LLM(scaled_tiny_model("cpu"), tokenizer=tokenizer_dir, max_batch=2)


def test_finish_reason_is_the_engines(scaled_llm, monkeypatch):
    llm, params = scaled_llm, SamplingParams(max_new_tokens=3)
    ref = llm.generate([[7, 8, 9]], params)[0].token_ids
    assert len(set(ref)) == 3, ref  # distinct: each stop below is sharp
    # the last allowed token is a stop token: "stop" (lengths alone would say "length")
    out = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3, stop_token_ids=[ref[2]]))[0]
    assert out.token_ids == ref and out.finish_reason == "stop" and out.stop_reason == ref[2]
    # the model's end of sequence: "stop", as OpenAI / vLLM say it
    monkeypatch.setattr(llm.engine, "eos_token_ids", (ref[0],))
    out = llm.generate([[7, 8, 9]], params)[0]
    assert out.token_ids == ref[:1] and out.finish_reason == "stop" and out.stop_reason == ref[0]
    assert llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].finish_reason == "length"


def test_stop_strings_with_the_llms_tokenizer(scaled_llm):
    llm = scaled_llm
    ref = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3))[0]
    word = llm.codec.decode(ref.token_ids[1:2])
    out = llm.generate([[7, 8, 9]], SamplingParams(max_new_tokens=3, stop=[word]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == word
    assert out.token_ids == ref.token_ids[:2] and word in out.text


# ---------------------------------------------------------------------------------------------
# chat


def test_chat_renders_the_template(llm):
    from tests.serve.conftest import CHAT_TEMPLATE

    messages = [{"role": "user", "content": "w1 w2"}]
    assert llm.codec.chat_template == CHAT_TEMPLATE
    params = SamplingParams(max_new_tokens=3)
    out = llm.chat(messages, params)
    ids = llm.codec.encode_chat(messages)
    assert ids == llm.codec.encode_prompt("<|user|> w1 w2 <|end|> <|assistant|>")
    assert len(out) == 1 and out[0].prompt_token_ids == ids
    assert out[0].token_ids == Engine(llm.model, max_batch=1).generate([ids], params)[0]
    parts = [{"role": "user", "content": [{"type": "text", "text": "w1 w2"}]}]
    two = llm.chat([messages, parts], params)  # a list of conversations
    assert [o.token_ids for o in two] == [out[0].token_ids] * 2


@pytest.mark.parametrize("messages,error,match", [
    ("hi", TypeError, "expected a conversation"),
    ([], TypeError, r"got list \(empty\)"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], ValueError, "'image_url'"),
], ids=["str", "empty", "image"])
def test_chat_refuses_bad_messages(llm, messages, error, match):
    with pytest.raises(error, match=match):
        llm.chat(messages)


def test_chat_without_a_template(tmp_path, reference_ops):
    from tests.serve.conftest import build_tokenizer

    build_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    llm = LLM("mamba2-tiny", tokenizer=tmp_path, dtype=torch.float32, device="cpu", max_batch=1)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "w1"}])
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }} {% endfor %}")
    llm = LLM("mamba2-tiny", tokenizer=tmp_path, chat_template=template, dtype=torch.float32, device="cpu",
              max_batch=1)
    assert llm.chat([{"role": "user", "content": "w1"}], SamplingParams(max_new_tokens=1))[0].prompt_token_ids == \
        llm.codec.encode_prompt("w1")


# ---------------------------------------------------------------------------------------------
# constructor probes (issue 48)


@pytest.mark.parametrize("model,match", [(123, "got int"), (None, "got NoneType"), ([1], "got list")],
                         ids=["int", "None", "list"])
def test_model_of_the_wrong_type(model, match):
    with pytest.raises(TypeError, match=f"LLM: model expected a checkpoint directory, a preset name or a loaded "
                                        f"model .*{match}"):
        LLM(model)


def test_tokenizer_arguments(tmp_path, monkeypatch):
    import fastmamba

    def refuse(*a, **k):
        raise AssertionError("the model was loaded before the tokenizer argument was checked")

    monkeypatch.setattr(fastmamba, "load_model", refuse)
    with pytest.raises(FileNotFoundError, match="'/nonexistent' is not a directory"):
        LLM("mamba2-tiny", tokenizer="/nonexistent")
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json"):
        LLM("mamba2-tiny", tokenizer=tmp_path)
    with pytest.raises(TypeError, match="tokenizer: expected a directory path .* got int"):
        LLM("mamba2-tiny", tokenizer=123)
    with pytest.raises(FileNotFoundError, match="looks like a Hugging Face Hub id.*huggingface-cli download"):
        LLM("state-spaces/mamba2-130m")


def test_loaded_model_with_other_dtype_or_device():
    import fastmamba

    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="dtype=torch.float16 but the loaded model is torch.float32"):
        LLM(model, dtype=torch.float16)
    with pytest.raises(ValueError, match="device='cuda' but the loaded model is on cpu"):
        LLM(model, device="cuda")
    llm = LLM(model, dtype="fp32", device="cpu", max_batch=1)  # what it has: fine
    assert llm.model is model


@pytest.mark.parametrize("max_batch,error", [(2.5, TypeError), ("4", TypeError), (0, ValueError), (True, TypeError)],
                         ids=["float", "str", "zero", "bool"])
def test_engine_max_batch(max_batch, error):
    import fastmamba

    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    with pytest.raises(error, match="Engine: max_batch must be an int >= 1"):
        Engine(model, max_batch=max_batch)
    with pytest.raises(error, match="Engine: max_batch must be an int >= 1"):
        LLM(model, max_batch=max_batch)
    assert Engine(model, max_batch=np.int64(2)).max_batch == 2
