"""``fastmamba serve`` / ``python -m fastmamba.serve``: load a model, start the OpenAI-compatible server.

    fastmamba serve --model DIR|PRESET [--tokenizer DIR] [--host 127.0.0.1] [--port 8000]
                    [--max-batch 64] [--max-waiting 256] [--api-key KEY] [--served-model-name NAME]
                    [--max-model-len N] [--prefill-chunk 2048] [--device cuda|cpu] [--dtype bf16|fp16|fp32]
                    [--prefix-cache-gb 4] [--prefix-block N]

Presets have random weights and no tokenizer: they serve token-id prompts (``"prompt": [1, 2, 3]``)
unless ``--tokenizer DIR`` names a directory with a tokenizer.json (and, for chat, a
tokenizer_config.json with a ``chat_template``).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

DTYPES = ("bf16", "fp16", "fp32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or preset (e.g. mamba2-2.7b)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="directory with tokenizer.json / tokenizer_config.json (default: the model directory)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=64, help="requests decoded together (state-cache slots)")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503 + Retry-After")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--served-model-name", default=None, help="the model id in /v1/models (default: --model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="refuse prompt + max_tokens above this")
    parser.add_argument("--prefill-chunk", type=int, default=2048,
                        help="prompt tokens fed per engine step (chunked prefill: running streams keep going while a "
                             "long prompt is admitted); 0 = whole prompts, one step each")
    parser.add_argument("--prefix-cache-gb", type=float, default=4.0,
                        help="memory for prefix caching of Mamba states, and of the attention layers' K/V in "
                             "hybrid models (snapshots at every --prefix-block tokens of a prompt and at the end of "
                             "every request, so the next turn of a conversation or a shared system prompt is not "
                             "prefilled again); 0 = off")
    parser.add_argument("--prefix-block", type=int, default=None,
                        help="snapshot interval in tokens, a multiple of the model's chunk size (default: ~512)")
    parser.add_argument("--device", default=None, help="default: cuda when present")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="weights and activations (default: the loader's)")
    parser.add_argument("--log-level", default="info")


def build_engine(model: str, dtype: str | None, device: str | None, engine_kwargs: dict):
    """Load ``model`` and build its ``Engine`` (runs in the engine process)."""
    import torch

    import fastmamba
    from fastmamba.generation.engine import Engine

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}.get(dtype)
    lm = fastmamba.load_model(model, dtype=torch_dtype, device=device)
    return Engine(lm, **engine_kwargs)


def build_app(args: argparse.Namespace):
    """The app with its engine process started (the model loaded): load errors surface here."""
    import functools

    from fastmamba.serve import require_serve_deps

    require_serve_deps()
    from fastmamba.serve.app import create_app
    from fastmamba.serve.engine_process import EngineProcess
    from fastmamba.serve.tokenization import Codec

    tok_dir = args.tokenizer or (args.model if os.path.isdir(args.model) else None)
    codec = Codec(tok_dir)
    if args.prefix_cache_gb < 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0, got {args.prefix_cache_gb}")
    budget = int(args.prefix_cache_gb * 2**30)
    kwargs = dict(max_batch=args.max_batch, prefill_chunk=args.prefill_chunk or None,
                  prefix_cache_bytes=budget or None, prefix_block=args.prefix_block)
    worker = EngineProcess(functools.partial(build_engine, args.model, args.dtype, args.device, kwargs),
                           max_waiting=args.max_waiting)
    try:
        worker.start()
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    return create_app(worker, model_name=args.served_model_name or args.model, codec=codec,
                      api_key=args.api_key, max_waiting=args.max_waiting, max_model_len=args.max_model_len)


def run(args: argparse.Namespace) -> int:
    from fastmamba.serve.app import serve

    app = build_app(args)
    serve(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastmamba.serve", description="OpenAI-compatible server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ImportError, ValueError, FileNotFoundError) as exc:
        print(f"fastmamba serve: error: {exc}", file=sys.stderr)
        return 2
