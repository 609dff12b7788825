"""A request's path (issue 49): one HTTP completion on the tiny hybrid, traced from the request
entering the app to its response (``sys.setprofile`` in this thread, ``threading.setprofile`` in the
test client's and the engine's threads), names the package files it enters, and counts the checks of
its values: ``max_tokens``, the prompt's ids and the slots are each checked once, where they enter
(the server's ``ServerState`` checks; a model step's slots as the cache grows), never again inside.

The app runs in-process over an ``Engine`` (the thread form of the serving loop: the same loop,
checks and handlers as ``fastmamba serve``'s engine process), warmed up as the server warms it. The
ops run their Triton kernels (under the CPU interpreter here), as on a GPU: the bodies of
``@triton.jit`` functions are left out of the trace, since on a GPU they are compiled code, not Python.
"""
from __future__ import annotations

import collections
import os
import sys
import threading

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from fastmamba.ops._common.dispatch import interpreter_enabled  # noqa: E402

INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import

MODEL = "nemotron-h-tiny"
PROMPT, MAX_TOKENS = [5, 9, 13], 4
MAX_FILES = 25  # issue 49's bound on the package files one completion enters
MAX_RUNTIME_FILES = 23  # of them outside fastmamba/ops (serve 7, generation 5, models 4, cache 4, layers 3):
#                         today's count, a ratchet (19 before the engine and the server were split by job)

# the functions that check each value (by name, wherever the engine's rooms put them)
MAX_TOKENS_CHECKS = {"check_max_tokens", "check_fits"}  # ServerState; the engine's KV fit (Engine.add_request)
PROMPT_CHECKS = {"check_ids", "prompt_ids", "check_token_range"}  # ServerState; Engine.add_request; the model's
OPS_SLOT_CHECKS = {"check_index_values", "check_slots_on_device"}  # the ops' own, per layer
MODEL_STEPS = {"prefill_varlen", "decode", "verify"}


def _jit_bodies() -> set:
    """(file, name) of every ``@triton.jit`` function fastmamba has loaded (by name: the interpreter
    runs a recompiled copy of each, another code object)."""
    from triton.runtime import KernelInterface

    codes = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("fastmamba.") or module is None:
            continue
        for obj in list(vars(module).values()):
            if isinstance(obj, KernelInterface):
                while not hasattr(obj, "__code__") and hasattr(obj, "fn"):
                    obj = obj.fn
                if hasattr(obj, "__code__"):
                    codes.add((obj.__code__.co_filename, obj.__code__.co_name))
    return codes


class Tracer:
    """Counts, while ``active``, the calls into each fastmamba file and each (file, function)."""

    def __init__(self, root: str, skip: set):
        self.root, self.skip, self.active = root, skip, False
        self.files: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()
        self.prompt_params: list[str] = []

    def __call__(self, frame, event, arg):
        if not self.active or event != "call":
            return
        code = frame.f_code
        if not code.co_filename.startswith(self.root) or (code.co_filename, code.co_name) in self.skip:
            return
        rel = os.path.relpath(code.co_filename, self.root)
        self.files[rel] += 1
        self.calls[rel, code.co_name] += 1
        if code.co_name == "check_ids":
            self.prompt_params.append(frame.f_locals.get("param"))

    def count(self, names: set, where: str | None = None) -> int:
        return sum(n for (f, c), n in self.calls.items() if c in names and (where is None or f.startswith(where)))


def trace_one_completion(device: str = "cpu") -> Tracer:
    """Build and warm the engine on ``device`` (a GPU: CUDA graphs captured by the warm-up), start the
    app, and trace one completion (prints the files)."""
    import fastmamba
    from fastapi.testclient import TestClient
    from fastmamba.serve.app import create_app
    from fastmamba.serve.cli import build_engine

    if device == "cpu" and not INTERPRETER_AT_START:
        pytest.skip("traces the kernels' path (as on a GPU): needs TRITON_INTERPRET=1 before Python starts")
    mp = pytest.MonkeyPatch()
    if device == "cpu":
        mp.setenv("TRITON_INTERPRET", "1")  # (an earlier test's reference_ops may have set it to 0)
    try:
        # as ``fastmamba serve`` builds it (prefix cache on), with a short chunk: a cheap warm-up
        engine = build_engine(MODEL, "fp32", device, dict(max_batch=4, prefill_chunk=16,
                                                           prefix_cache_bytes=64 << 20, prefix_block=None))
        engine.warm_up()
        tracer = Tracer(os.path.dirname(fastmamba.__file__) + os.sep, _jit_bodies())
        app = create_app(engine, model_name="tiny")
        threading.setprofile(tracer)  # the test client's portal thread and the engine thread start below
        sys.setprofile(tracer)
        try:
            with TestClient(app) as client:
                tracer.active = True
                r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True})
                tracer.active = False
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
    finally:
        mp.undo()
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["token_ids"]) == MAX_TOKENS and choice["finish_reason"] == "length"
    assert engine.cache.free_slots == 4  # the request gave its slot back
    print(f"\none completion on {MODEL} ({device}) entered {len(tracer.files)} package files:")
    for f, n in sorted(tracer.files.items()):
        print(f"  {n:6d} calls  {f}")
    return tracer


@pytest.fixture(scope="module")
def traced():
    return trace_one_completion()


def test_each_value_is_checked_once(traced):
    calls = {k: v for k, v in traced.calls.items() if k[1] in MAX_TOKENS_CHECKS | PROMPT_CHECKS | OPS_SLOT_CHECKS}
    assert traced.count(MAX_TOKENS_CHECKS) == 1, calls
    assert traced.count(PROMPT_CHECKS) == 1 and traced.prompt_params == ["prompt"], (calls, traced.prompt_params)
    # slots: each model step's are checked as the cache grows (allocated, in range), once, and the
    # layers' ops do not check them again
    steps = traced.count(MODEL_STEPS, "models/lm.py")
    assert steps == 1 + MAX_TOKENS - 1, traced.calls  # one prefill (its logits give the first token), 3 decodes
    assert traced.calls["cache/hybrid_cache.py", "grow"] == steps, traced.calls
    assert traced.count(OPS_SLOT_CHECKS) == 0, calls


def test_runtime_files_on_the_path(traced):
    runtime = sorted(f for f in traced.files if not f.startswith("ops" + os.sep))
    assert len(runtime) <= MAX_RUNTIME_FILES, runtime


@pytest.mark.xfail(strict=True, reason="issue 49: on the CPU every step runs the ops' Python (api, launchers, "
                                       "configs, ops/_common): 36 of 59 files; the bound is checked where steps replay "
                                       "CUDA graphs (test_at_most_25_package_files_on_a_gpu)")
def test_at_most_25_package_files(traced):
    assert len(traced.files) <= MAX_FILES, sorted(traced.files)


@pytest.mark.gpu
def test_at_most_25_package_files_on_a_gpu():
    """On a GPU the warm-up captures the decode (and prefill) steps in CUDA graphs, so a completion's
    steps replay them instead of entering the ops' Python: the path the issue's bound is about.
    max_tokens and the prompt are still checked once."""
    traced = trace_one_completion("cuda")
    assert traced.count(MAX_TOKENS_CHECKS) == 1 and traced.count(PROMPT_CHECKS) == 1, traced.calls
    assert len(traced.files) <= MAX_FILES, sorted(traced.files)
