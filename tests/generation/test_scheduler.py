"""``Scheduler`` on its own (no engine, no model call): who is admitted, how a chunk is planned,
who waits for K/V pages and who is failed when none can advance, from host counts only."""
from __future__ import annotations

import pytest
import torch

import fastmamba
from fastmamba.generation.engine_config import EngineConfig
from fastmamba.generation.requests import Request
from fastmamba.generation.sampling import SamplingParams
from fastmamba.generation.scheduler import Scheduler

PAGE = 4


@pytest.fixture(scope="module")
def hybrid():
    return fastmamba.load_model("nemotron-h-tiny", dtype=torch.float32, device="cpu")


def scheduler_of(model, pages: int, **options) -> Scheduler:
    config = EngineConfig(kv_page_size=PAGE, kv_num_pages=pages, max_seq_len=64, **options)
    cache = model.new_cache(config.max_batch, speculate=0, **config.kv_options())
    return Scheduler(cache, config, model.cfg.chunk_size)


def queue(s: Scheduler, *lengths: int) -> list[Request]:
    reqs = [Request(i, list(range(1, n + 1)), SamplingParams(max_new_tokens=4)) for i, n in enumerate(lengths)]
    for r in reqs:
        s.add(r)
    return reqs


def test_admission_counts_whole_prompts_against_free_pages(hybrid):
    s = scheduler_of(hybrid, pages=5, max_batch=4)
    queue(s, 8, 8, 3)  # 2 + 2 + 1 pages of 4 tokens
    assert s.admissible() == 3
    a, b = s.admit(2)
    assert min(a.slot, b.slot) >= 0 and a.slot != b.slot and len(s.waiting) == 1
    s.cache.grow([a.slot, b.slot], [8, 8])
    s.start_running([a, b])
    assert s.admissible() == 0  # 1 page free, and each running request keeps one in reserve


def test_a_chunk_feeds_partly_fed_prompts_first_within_its_budget(hybrid):
    s = scheduler_of(hybrid, pages=32, max_batch=3, prefill_chunk=6)
    long, short = queue(s, 10, 3)
    reqs, chunks = s.plan_chunk()
    assert reqs == [long] and chunks == [long.prompt[:6]] and s.prefilling == [long]
    s.cache.grow([long.slot], [6])
    long.prefilled = 6
    reqs, chunks = s.plan_chunk()  # the rest of the long prompt, then the short one within 6 tokens
    assert reqs == [long, short] and chunks == [long.prompt[6:], short.prompt[:2]]
    assert not s.waiting and s.prefilling == [long, short]


def test_decode_waits_for_pages_and_names_the_newest_to_fail(hybrid):
    s = scheduler_of(hybrid, pages=2, max_batch=2)
    a, b = queue(s, 4, 4)
    s.admit(2)
    s.cache.grow([a.slot, b.slot], [4, 4])  # both pages full: a next token needs a page of its own
    s.start_running([a, b])
    assert s.decode_ready() == []
    victim, error = s.eviction()
    assert victim is b and "out of pages" in str(error) and "request 1, the newest" in str(error)
    victim.finished, victim.finish_reason = True, "error"
    s.release(victim)
    s.drop_finished()
    assert s.running == [a] and victim.slot == -1 and s.cache.free_pages == 1
    assert s.decode_ready() == [a] and s.cache.length(a.slot) == 5  # grown by its next token


def test_requests_that_can_never_fit_are_refused(hybrid):
    s = scheduler_of(hybrid, pages=4, max_batch=1)
    assert s.max_request_tokens == 16
    s.check_fits(list(range(13)), SamplingParams(max_new_tokens=4), "")  # 13 + 4 - 1 = 16 positions
    with pytest.raises(ValueError, match="needs 17 KV positions, more than one request can hold: 16"):
        s.check_fits(list(range(14)), SamplingParams(max_new_tokens=4), "")
