"""The offline one-call API: LLM(model).generate(prompts, params) equals the engine it wraps."""
from __future__ import annotations

import pytest
import torch

from fastmamba.generation.engine import Engine
from fastmamba.generation.sampling import SamplingParams
from fastmamba.llm import LLM


def test_llm_generate_equals_engine(tokenizer_dir, reference_ops):
    llm = LLM("mamba2-tiny", tokenizer=tokenizer_dir, dtype=torch.float32, device="cpu", max_batch=4)
    params = SamplingParams(max_new_tokens=5)
    outs = llm.generate(["w1 w2 w3", [7, 8, 9]], params)
    ids = [llm.codec.encode("w1 w2 w3"), [7, 8, 9]]
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
