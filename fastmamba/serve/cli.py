"""``fastmamba serve`` / ``python -m fastmamba.serve``: load a model, start the OpenAI-compatible server.

    fastmamba serve --model DIR|PRESET [--tokenizer DIR] [--chat-template FILE] [--host 127.0.0.1]
                    [--port 8000] [--max-batch 64] [--max-waiting 256] [--api-key KEY]
                    [--served-model-name NAME [NAME ...]] [--max-model-len N] [--prefill-chunk 2048]
                    [--device cuda|cpu] [--dtype auto|bfloat16|bf16|float16|fp16|float32|fp32]
                    [--prefix-cache-gb 4] [--prefix-block N] [--num-kv-pages N] [--shutdown-timeout 30]
                    [--gpu-memory-utilization 0.9] [--speculate K [--drafter ngram|mtp]]

Presets have random weights and no tokenizer: they serve token-id prompts (``"prompt": [1, 2, 3]``)
unless ``--tokenizer DIR`` names a directory with a tokenizer.json. Chat needs a template: the
tokenizer directory's ``chat_template.jinja`` / ``chat_template.json`` / ``tokenizer_config.json``,
or ``--chat-template FILE``.

``--max-model-len`` bounds prompt + max_tokens of every request and, for a model with attention
layers, sizes its K/V cache (default: the checkpoint's ``max_position_embeddings``, else 4096),
clamped to what fits in memory.

Capacity (``fastmamba.generation.capacity``): on a CUDA device the server plans before any weight
is read, from the checkpoint's config.json alone: ``--gpu-memory-utilization`` x the card's memory,
less the weights, a reserve for activations and graphs, and the prefix cache, holds ``--max-batch``
Mamba slots (one per request, speculative buffers included) and the K/V pages. An ``--max-batch``
that does not fit is refused with the numbers; without one the plan's (every request at
``--max-model-len``, at most 256) is taken; the K/V pool gets the plan's pages (requests then wait
for pages, never run out mid-run). ``FASTMAMBA_DEVICE_MEMORY_GIB`` (or the hidden
``--device-memory-gib``) plans against a given size, on any device (tests plan on the CPU so). Under
``--tensor-parallel-size N`` each GPU is planned for rank 0's share (``distributed.loading.tp_meta_model``:
1/N of the heads, channels and vocabulary; the largest share). The start-up log prints the plan and the
time to load and warm up (graph capture included).

``--speculate K`` verifies K drafts per request per step; ``--drafter mtp`` drafts with the
checkpoint's multi-token-prediction layer (refused for a model without one), ``ngram`` (default)
by prompt lookup; ``/metrics`` then counts drafted and accepted tokens, verify steps, tokens per
step and the policy's current k. Every flag is checked before the port is bound and the model
loads; a bad one ends the command with one line, ``fastmamba serve: error: ...``, and status 2.
SIGTERM drains: the requests already admitted get ``--shutdown-timeout`` seconds to finish, the
rest are aborted (503), and the process exits 0.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Sequence

DTYPES = ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32", "float")
DEFAULT_KV_LEN = 4096  # a hybrid's K/V per request when neither --max-model-len nor the checkpoint says
KV_MEMORY_FRACTION = 0.8  # without a capacity plan (a CPU): of the memory free after the weights, for the K/V pool
DEFAULT_MAX_BATCH = 64  # without a capacity plan
DRAFTERS = ("ngram", "mtp")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bf16", "fp16", "fp32")  # models.quantization's (no torch here)
PREFIX = "fastmamba serve"
log = logging.getLogger("fastmamba.serve")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="checkpoint directory or preset (e.g. mamba2-2.7b)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="directory with tokenizer.json (default: the model directory, when it has one)")
    parser.add_argument("--chat-template", default=None, metavar="FILE",
                        help="chat template (.jinja, or .json with a chat_template field) instead of the tokenizer's")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-batch", type=int, default=None,
                        help="requests decoded together (state-cache slots; default: on a GPU the capacity plan's, "
                             f"at most 256, else {DEFAULT_MAX_BATCH}); one that does not fit is refused")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="the fraction of the GPU's memory for weights, caches and activations, in (0, 1] "
                             "(default 0.9); the Mamba slots and K/V pages are planned from what is left")
    parser.add_argument("--device-memory-gib", type=float, default=None, help=argparse.SUPPRESS)  # tests: plan
    # against this many GiB on any device (as FASTMAMBA_DEVICE_MEMORY_GIB)
    parser.add_argument("--speculate", type=int, default=0, metavar="K",
                        help="speculative decoding: verify K drafts per request per step (0 = off)")
    parser.add_argument("--drafter", choices=DRAFTERS, default=None,
                        help="with --speculate: ngram = prompt lookup (default), mtp = the checkpoint's "
                             "multi-token-prediction layer (Nemotron-3 with num_nextn_predict_layers: 1)")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued requests before 503 + Retry-After")
    parser.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the model's name(s) in /v1/models and the `model` field (default: --model)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="the most prompt + max_tokens of one request; sizes a hybrid model's K/V cache "
                             "(default: the checkpoint's max_position_embeddings)")
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
    parser.add_argument("--num-kv-pages", type=int, default=None,
                        help="K/V pages (16 tokens each) of a hybrid model's pool (default: every slot at "
                             "--max-model-len, as memory allows); fewer make requests wait for pages")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds that admitted requests may run on after SIGTERM before they are aborted")
    parser.add_argument("--device", default=None, help="default: cuda when present")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, metavar="N",
                        help="split the model over N ranks (N GPUs, or N CPU processes with --device cpu); the "
                             "engine process is rank 0 and starts the others (fastmamba/distributed/serve_workers.py)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                        help="K/V page dtype (default: fp8 e4m3 when the checkpoint ships k_scale / v_scale, else "
                             "the model's dtype); fp8: e4m3 pages, scale 1.0 without checkpoint scales")
    parser.add_argument("--dtype", default=None, metavar="|".join(DTYPES[:3]) + "|...",
                        help="weights and activations, as load_model names them (default auto: the checkpoint's)")
    parser.add_argument("--quantization", choices=("fp8",), default=None,
                        help="fp8: quantise a 16-bit checkpoint or preset on load, block by block (e4m3 weights per "
                             "channel, activations per token; attention and lm_head stay 16-bit). FP8 checkpoints "
                             "load as FP8 without it")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"))


# ------------------------------------------------------------------------------------------ checks


def _int_at_least(args, name: str, low: int, *, optional: bool = False) -> None:
    v = getattr(args, name.lstrip("-").replace("-", "_"))
    if v is None and optional:
        return
    if v is None or v < low:
        raise ValueError(f"{name}: expected an integer >= {low}, got {v}")


def check_host(host: str) -> None:
    """ValueError unless ``host`` is an IPv4 / IPv6 address or a host name this machine resolves."""
    if not host or not isinstance(host, str):
        raise ValueError(f"--host: expected an IP address or a host name, got {host!r}")
    if re.fullmatch(r"[0-9.]+", host) or ":" in host:
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise ValueError(f"--host: {host!r} is not a valid IP address") from None
        return
    if not re.fullmatch(r"[A-Za-z0-9]([A-Za-z0-9-]{0,62})(\.[A-Za-z0-9]([A-Za-z0-9-]{0,62}))*\.?", host):
        raise ValueError(f"--host: {host!r} is not a valid host name or IP address")
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--host: cannot resolve {host!r} ({exc.strerror or exc})") from None


def check_args(args: argparse.Namespace) -> None:
    """Every flag checked before anything is bound, spawned or loaded: ValueError / FileNotFoundError
    naming the flag, what was expected and what came."""
    if not 1 <= args.port <= 65535:
        raise ValueError(f"--port: expected a port number in 1..65535, got {args.port}")
    check_host(args.host)
    _int_at_least(args, "--max-batch", 1, optional=True)
    u = args.gpu_memory_utilization
    if not (math.isfinite(u) and 0 < u <= 1):
        raise ValueError(f"--gpu-memory-utilization: expected a fraction in (0, 1], got {u}")
    if args.device_memory_gib is not None and not (math.isfinite(args.device_memory_gib)
                                                   and args.device_memory_gib > 0):
        raise ValueError(f"--device-memory-gib: expected a positive number of GiB, got {args.device_memory_gib}")
    _int_at_least(args, "--speculate", 0)
    if args.drafter is not None and not args.speculate:
        raise ValueError(f"--drafter {args.drafter}: needs --speculate K with K >= 1")
    _int_at_least(args, "--max-waiting", 1)
    _int_at_least(args, "--max-model-len", 1, optional=True)
    _int_at_least(args, "--prefill-chunk", 0)
    _int_at_least(args, "--prefix-block", 1, optional=True)
    _int_at_least(args, "--num-kv-pages", 1, optional=True)
    if args.tensor_parallel_size != 1:  # the device and the model's shapes, before anything starts
        from fastmamba.distributed.serve_workers import check_serve_tp

        check_serve_tp(args.model, args.tensor_parallel_size, args.device)
    gb = args.prefix_cache_gb
    if not (math.isfinite(gb) and gb >= 0):
        raise ValueError(f"--prefix-cache-gb: expected a finite number of GiB >= 0 (0 = off), got {gb}")
    t = args.shutdown_timeout
    if not (math.isfinite(t) and t >= 0):
        raise ValueError(f"--shutdown-timeout: expected a finite number of seconds >= 0, got {t}")
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key: expected a non-empty key (omit the flag to serve without authentication)")
    if args.served_model_name is not None and not all(n.strip() for n in args.served_model_name):
        raise ValueError(f"--served-model-name: expected non-empty names, got {args.served_model_name}")
    if args.dtype is not None and args.dtype.strip().lower().removeprefix("torch.") not in DTYPES:
        raise ValueError(f"--dtype: expected one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.drafter == "mtp" and args.tensor_parallel_size > 1:
        raise ValueError(f"--drafter mtp with --tensor-parallel-size {args.tensor_parallel_size}: tensor parallelism "
                         "does not shard the MTP layer (a rank's model has none); use --drafter ngram, or tp=1")
    if args.quantization and args.tensor_parallel_size > 1:
        raise ValueError(f"--quantization {args.quantization} with --tensor-parallel-size {args.tensor_parallel_size}: "
                         "tensor parallelism does not shard FP8 weights and their scales yet (use one of the two)")
    if args.tokenizer is not None:
        if os.path.isfile(args.tokenizer):
            raise ValueError(f"--tokenizer: {args.tokenizer!r} is a file; pass the directory that holds tokenizer.json")
        if not os.path.isdir(args.tokenizer):
            raise ValueError(f"--tokenizer: {args.tokenizer!r} is not a directory")
        if not os.path.isfile(os.path.join(args.tokenizer, "tokenizer.json")):
            raise ValueError(f"--tokenizer: {args.tokenizer!r} has no tokenizer.json")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise ValueError(f"--chat-template: {args.chat_template!r} is not a file")


def _load_dtype(args: argparse.Namespace, device):
    """The dtype ``load_model`` will give the weights: --dtype, else a directory's own (None here:
    ``meta_model`` reads it), else a preset's default (bf16 on a GPU, fp32 on a CPU)."""
    import torch

    if args.dtype not in (None, "auto"):
        return args.dtype
    if os.path.isdir(args.model):
        return None
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _cuda_total_bytes(device) -> int:
    """The CUDA device's total memory, asked in a short-lived child process: a CUDA context in this
    (the HTTP) process would hold GPU memory for its whole life, beside the engine process's."""
    import subprocess

    import torch

    index = device.index if device.index is not None else 0
    code = "import sys, torch; print(torch.cuda.mem_get_info(int(sys.argv[1]))[1])"
    try:
        out = subprocess.run([sys.executable, "-c", code, str(index)], capture_output=True, text=True, timeout=120,
                             check=True).stdout
        return int(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return torch.cuda.mem_get_info(device)[1]  # in this process after all


def plan_serving(args: argparse.Namespace):
    """Before the port is bound and any weight is read: ``--drafter mtp`` needs an MTP layer, and on
    a CUDA device (or with a device-memory override) the capacity plan from the checkpoint's config
    alone. Sets ``args.max_batch`` (the plan's when not given, else DEFAULT_MAX_BATCH without a
    plan) and returns the ``CapacityPlan`` or None; CapacityError (a ValueError) names the numbers.
    Sets ``args.card_memory_query_s``: the seconds the card's memory took to ask (None where not asked)."""
    from fastmamba.generation.capacity import GiB, device_memory_bytes, meta_model, plan_capacity
    from fastmamba.models.checkpoint_config import ssm_state_dtype
    from fastmamba.models.defaults import default_device

    device = default_device(args.device, where="--device")  # (no CUDA GPU for 'cuda': one line, not a traceback)
    args.card_memory_query_s = None
    if args.device_memory_gib is not None:
        total = int(args.device_memory_gib * GiB)
    else:  # FASTMAMBA_DEVICE_MEMORY_GIB, else a CUDA device's total, else (a CPU) no plan
        total = device_memory_bytes("cpu")
        if total is None and device.type == "cuda":
            t_ask = time.perf_counter()
            total = _cuda_total_bytes(device)
            args.card_memory_query_s = time.perf_counter() - t_ask
    if args.tensor_parallel_size > 1 and total is not None:  # each GPU holds rank 0's share (the largest)
        from fastmamba.distributed.loading import tp_meta_model

        meta = tp_meta_model(args.model, args.tensor_parallel_size, _load_dtype(args, device))
    else:
        meta = (meta_model(args.model, _load_dtype(args, device), quantization=args.quantization)
                if total is not None or args.drafter == "mtp" else None)
    if args.drafter == "mtp" and getattr(meta, "mtp", None) is None:
        raise ValueError(f"--drafter mtp: {args.model} has no MTP layer (its config names none: "
                         "num_nextn_predict_layers); use --drafter ngram")
    if total is None:
        args.max_batch = args.max_batch or DEFAULT_MAX_BATCH
        return None
    from fastmamba.models.quantization import plan_kv_cache_dtype

    plan_kv_cache_dtype(meta, args.model, getattr(args, "kv_cache_dtype", None))  # float8 pages: half the bytes
    length = args.max_model_len or getattr(meta.cfg, "max_position_embeddings", None) or DEFAULT_KV_LEN
    plan = plan_capacity(meta, device_bytes=total, gpu_memory_utilization=args.gpu_memory_utilization,
                         max_batch=args.max_batch, max_seq_len=length, ssm_dtype=ssm_state_dtype(meta.cfg)[0],
                         speculate=args.speculate, prefill_tokens=args.prefill_chunk or 2048,
                         other_bytes=int(args.prefix_cache_gb * GiB), drafter=args.drafter if args.speculate else None)
    args.max_batch = plan.max_batch
    return plan


def plan_timing_line(seconds: float, card_memory_query_s: float | None) -> str:
    """The log line of how long ``plan_serving`` took (torch's import included) and its memory query."""
    asked = ("" if card_memory_query_s is None
             else f"; the card's memory asked in a child process in {card_memory_query_s:.1f} s")
    return f"{PREFIX}: capacity plan made in {seconds:.1f} s (torch's import included{asked})"


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), not yet listening (uvicorn listens once the app is up)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        info = socket.getaddrinfo(host.strip("[]"), port, family=family, type=socket.SOCK_STREAM)
        sock = socket.socket(info[0][0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[0][4])
    except OSError as exc:
        raise ValueError(f"--host/--port: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


# ------------------------------------------------------------------------------------------ the engine


def _free_bytes(device) -> int:
    if device.type == "cuda":
        from fastmamba.models.building import cuda_free_bytes

        return cuda_free_bytes(device)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def kv_options(lm, max_batch: int, max_model_len: int | None, num_kv_pages: int | None,
               prefix_cache_bytes: int) -> dict:
    """The Engine's K/V options for a model with attention layers ({} for others): max_seq_len from
    ``max_model_len``, else the checkpoint's ``max_position_embeddings``, else ``DEFAULT_KV_LEN``;
    a pool of every slot at that length while it fits in ``KV_MEMORY_FRACTION`` of the free memory
    (less the prefix cache), else as many pages as fit (requests then wait for pages); a default
    length is clamped to the pool, an explicit one that not even one request fits is an error."""
    import inspect

    from fastmamba.cache.kv_pages import KVPages

    cfg = lm.cfg
    if "max_seq_len" not in inspect.signature(lm.new_cache).parameters or "*" not in getattr(cfg, "pattern", ""):
        return {}
    page = 16
    length = max_model_len or getattr(cfg, "max_position_embeddings", None) or DEFAULT_KV_LEN
    weight = lm.lm_head.weight
    page_bytes = KVPages.page_bytes(cfg.pattern.count("*"), page, cfg.n_kv_heads, cfg.head_dim, weight.dtype)
    per_request = -(-length // page)
    if num_kv_pages is not None:
        pages = num_kv_pages
    else:
        room = int(KV_MEMORY_FRACTION * _free_bytes(weight.device)) - prefix_cache_bytes
        pages = min(max_batch * per_request, max(room // page_bytes, 0))
    if pages < per_request:
        if max_model_len is not None and num_kv_pages is None:
            raise ValueError(f"--max-model-len {max_model_len}: one request's K/V needs {per_request * page_bytes / 2**30:.2f}"
                             f" GiB, and only {pages * page_bytes / 2**30:.2f} GiB of memory are free for it")
        if pages < 1:
            raise ValueError("the K/V cache does not fit in memory: not even one page is free")
        length = min(length, pages * page)
    return {"max_seq_len": length, "kv_page_size": page, "kv_num_pages": pages}


def build_engine(model: str, dtype: str | None, device: str | None, engine_kwargs: dict,
                 max_model_len: int | None = None, num_kv_pages: int | None = None, quantization: str | None = None):
    """Load ``model`` (``quantization``: as ``load_model``) and build its ``Engine`` (runs in the
    engine process). With a capacity plan the caller passes its length and pages (``max_model_len``,
    ``num_kv_pages``)."""
    import fastmamba
    from fastmamba.generation.engine import Engine

    lm = fastmamba.load_model(model, dtype=dtype, device=device, quantization=quantization)
    kwargs = dict(engine_kwargs)
    kwargs.update(kv_options(lm, kwargs["max_batch"], max_model_len, num_kv_pages,
                             kwargs.get("prefix_cache_bytes") or 0))
    return Engine(lm, **kwargs)


def _kv_options_of(engine_kwargs: dict, max_model_len: int | None, num_kv_pages: int | None, lm) -> dict:
    """``kv_options`` of a loaded model with the engine's options (a tensor-parallel rank 0's shard)."""
    return kv_options(lm, engine_kwargs["max_batch"], max_model_len, num_kv_pages,
                      engine_kwargs.get("prefix_cache_bytes") or 0)


def build_app(args: argparse.Namespace, plan=None):
    """The app with its engine process started (the model loaded and warm): load errors surface here.
    ``plan``: ``plan_serving``'s CapacityPlan (its K/V pages and length size the pool), or None."""
    import functools

    from fastmamba.serve import require_serve_deps

    t_http = time.perf_counter()
    require_serve_deps()
    from fastmamba.serve.app import create_app
    from fastmamba.serve.engine_process import EngineProcess
    from fastmamba.serve.tokenization import Codec
    from fastmamba.serve.worker import log_lines

    if args.tokenizer is not None:
        codec = Codec(args.tokenizer, chat_template=args.chat_template, required=True)
    else:
        codec = Codec(args.model if os.path.isdir(args.model) else None, chat_template=args.chat_template)
    budget = int(args.prefix_cache_gb * 2**30)
    kwargs = dict(max_batch=args.max_batch, prefill_chunk=args.prefill_chunk or None,
                  prefix_cache_bytes=budget or None, prefix_block=args.prefix_block,
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", None))
    if args.speculate:  # a string crosses the process boundary; the engine builds the drafter
        kwargs.update(speculate=args.speculate, drafter="mtp" if args.drafter == "mtp" else None)
    max_model_len, num_kv_pages = args.max_model_len, args.num_kv_pages
    if plan is not None:
        tp = args.tensor_parallel_size
        log.info(f"{PREFIX}: {plan.summary()}" + (f" (per GPU: rank 0's share of {tp})" if tp > 1 else ""))
        if plan.page_bytes:  # the plan's pages (unless --num-kv-pages says) at the length it planned
            max_model_len = plan.max_seq_len if max_model_len is None else max_model_len
            num_kv_pages = plan.kv_pages if num_kv_pages is None else num_kv_pages
    dtype = None if args.dtype in (None, "auto") else args.dtype
    names = args.served_model_name or [args.model]
    log.info(f"{PREFIX}: starting the engine process for {args.model} (dtype {args.dtype or 'auto'}"
             f"{', FP8 weights' if args.quantization else ''}, device {args.device or 'auto'}; the HTTP side's "
             f"imports and tokenizer took {time.perf_counter() - t_http:.1f} s)")
    factory = functools.partial(build_engine, args.model, dtype, args.device, kwargs, max_model_len, num_kv_pages,
                                quantization=args.quantization)
    if args.tensor_parallel_size > 1:  # the engine process becomes rank 0 of N (the same engine, SPMD)
        from fastmamba.distributed.serve_workers import build_tp_engine

        factory = functools.partial(build_tp_engine, args.tensor_parallel_size, args.model, dtype, args.device,
                                    kwargs, functools.partial(_kv_options_of, kwargs, max_model_len, num_kv_pages))
    worker = EngineProcess(factory,
                           max_waiting=args.max_waiting, on_log=lambda line: log.info(f"{PREFIX}: {line}"))
    t0 = time.perf_counter()
    try:
        worker.start()
    except RuntimeError as exc:
        raise ValueError(str(exc)) from None
    info = worker.info
    started, warm = time.perf_counter() - t0, info.get("warm_up_s", 0)
    log.info(f"{PREFIX}: {log_lines(info, args.model)}; start-up took {started:.1f} s: load + build "
             f"{max(started - warm, 0):.1f} s, warm-up took {warm:.1f} s (graph capture included); "
             f"serving as {', '.join(names)}; tokenizer {'yes' if codec.has_text else 'none (token ids only)'}, "
             f"chat template {'yes' if codec.chat_template else 'none'}")
    max_model_len = args.max_model_len or info.get("max_position_embeddings")
    return create_app(worker, model_name=names, codec=codec, api_key=args.api_key, max_waiting=args.max_waiting,
                      max_model_len=max_model_len, shutdown_timeout=args.shutdown_timeout)


def _setup_logging(level: str) -> None:
    numeric = logging.DEBUG if level == "trace" else getattr(logging, level.upper())
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
    log.handlers[:] = [handler]
    log.setLevel(numeric)
    log.propagate = False


def _exit_quietly(signum, frame) -> None:
    print(f"{PREFIX}: stopped while starting (signal {signum})", file=sys.stderr)
    raise SystemExit(0)


def run(args: argparse.Namespace) -> int:
    """Check the flags, bind the port, start the engine, serve; user errors: one line and status 2."""
    debug = os.environ.get("FASTMAMBA_DEBUG", "0") not in ("", "0")
    try:
        check_args(args)
        _setup_logging(args.log_level)
        given = args.max_batch
        t_plan = time.perf_counter()
        plan = plan_serving(args)  # before the port is bound and any weight is read
        t_plan = time.perf_counter() - t_plan
        sock = bind(args.host, args.port)
        if plan is not None:  # logged once the port is bound: a taken port is one line
            log.info(plan_timing_line(t_plan, args.card_memory_query_s))
            if given is None:
                log.info(f"{PREFIX}: --max-batch not given: {plan.max_batch}, what the capacity plan holds"
                         f"{' (at most 256)' if plan.max_batch == 256 else ''}")
        # SIGTERM while the model loads: nothing to drain, leave quietly (uvicorn handles it from then on)
        signal.signal(signal.SIGTERM, _exit_quietly)
        try:
            app = build_app(args, plan)
        except BaseException:
            sock.close()
            raise
    except (ImportError, ValueError, TypeError, OSError) as exc:
        if debug:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{PREFIX}: error: {message}", file=sys.stderr)
        return 2
    from fastmamba.serve.app import serve

    serve(app, host=args.host, port=args.port, log_level=args.log_level, sock=sock)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastmamba.serve", description="OpenAI-compatible server")
    add_arguments(parser)
    args = parser.parse_args(argv)
    return run(args)
