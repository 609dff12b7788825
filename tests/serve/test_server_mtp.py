"""``fastmamba serve --speculate K --drafter mtp`` (issue 51 point 4): greedy tokens through the real
server equal the same server's without speculation; ``/metrics`` counts drafted and accepted
tokens, verify steps, tokens per step and the policy's k; a model without an MTP layer is refused
before the port is bound."""
from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from tests.serve.conftest import Server, free_port  # noqa: E402

MODEL = "nemotron-3-tiny-mtp"
FLAGS = ["--prefill-chunk", "16", "--prefix-block", "16", "--prefix-cache-gb", "0.01"]  # chunks, snapshots
PROMPTS = [[5, 17, 60, 3, 44, 9, 2] * 6, [9, 2], [70, 71, 72, 10, 11, 12, 1, 70, 71, 72, 10, 11, 12]]


def _one(server: Server, prompt: list[int]) -> list[str]:
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 9, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _greedy(server: Server) -> list[list[str]]:
    """The first prompt alone (its chunks of 16 start at block multiples, so its prompt snapshots are
    kept; under speculation a finished request's own state is not), then the prompts of different
    lengths at once (one batch, chunked prefill; the first one a prefix-cache hit). Alone first: in a
    batch, where the chunk budget is shared, a prompt's chunks need not start at block multiples,
    and whether a snapshot was taken would depend on the arrival order."""
    from concurrent.futures import ThreadPoolExecutor

    first = _one(server, PROMPTS[0])
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        out = list(pool.map(lambda p: _one(server, p), PROMPTS))
    return [first] + out


@pytest.fixture(scope="module")
def plain_tokens(tmp_path_factory):
    s = Server(["--max-batch", "4", *FLAGS], tmp_path_factory.mktemp("plain"), model=MODEL)
    try:
        return _greedy(s)
    finally:
        assert s.terminate() == 0, s.output()


def test_mtp_speculation_through_the_server_equals_plain_greedy(plain_tokens, tmp_path):
    s = Server(["--max-batch", "4", *FLAGS, "--speculate", "3", "--drafter", "mtp"], tmp_path,
               model=MODEL)
    try:
        assert _greedy(s) == plain_tokens
        assert s.metric("fastmamba_spec_max_draft_tokens") == 3
        drafted, accepted = s.metric("fastmamba_spec_draft_tokens"), s.metric("fastmamba_spec_accepted_tokens")
        steps = s.metric("fastmamba_spec_verify_steps") + s.metric("fastmamba_spec_plain_steps")
        assert drafted > 0 and 0 <= accepted <= drafted and s.metric("fastmamba_spec_verify_steps") > 0
        # 4 requests x 9 tokens: the first of each comes from prefill, the other 8 from decode steps
        assert steps <= 4 * 8
        assert s.metric("fastmamba_spec_tokens_per_step") == pytest.approx(1 + accepted / (4 * 8 - accepted))
        assert s.metric("fastmamba_prefix_cache_hits") >= 1
        assert 0 <= s.metric("fastmamba_spec_policy_k") <= 3  # the adaptive policy's last choice
        if drafted:
            assert s.metric("fastmamba_spec_acceptance_rate") == pytest.approx(accepted / drafted)
    finally:
        assert s.terminate() == 0, s.output()


def test_plain_server_has_no_spec_series(tmp_path):
    s = Server(["--max-batch", "2", "--prefix-cache-gb", "0"], tmp_path, model="nemotron-h-tiny")
    try:
        with pytest.raises(KeyError):
            s.metric("fastmamba_spec_draft_tokens")
    finally:
        assert s.terminate() == 0, s.output()


@pytest.mark.parametrize("model, argv, message", [
    ("nemotron-3-tiny", ["--speculate", "2", "--drafter", "mtp"], "--drafter mtp: nemotron-3-tiny has no MTP layer"),
    ("nemotron-3-tiny-mtp", ["--drafter", "mtp"], "--drafter mtp: needs --speculate K"),
    ("nemotron-3-tiny-mtp", ["--speculate", "-1"], "--speculate: expected an integer >= 0"),
])
def test_bad_drafter_is_one_line_before_the_port_is_bound(model, argv, message):
    import socket

    port = free_port()
    with socket.socket() as taken:  # the port is busy: a check after binding would say so instead
        taken.bind(("127.0.0.1", port))
        r = subprocess.run([sys.executable, "-m", "fastmamba.serve", "--model", model, "--device", "cpu",
                            "--port", str(port), *argv], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fastmamba serve: error: ") and message in lines[0], r.stderr
