"""The ``fastmamba`` command (declared in pyproject.toml as ``fastmamba = "fastmamba.cli:main"``).

    fastmamba bench kernels|prefill|tune|e2e ...     (python -m fastmamba.bench --help)
    fastmamba generate --model DIR|PRESET (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
                       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--batch B]
                       [--stop STR ...] [--stop-token-ids 1,2] [--ignore-eos]
                       [--speculate K [--drafter ngram|oracle|model [--draft-model DIR|PRESET]]]
                       [--ssm-dtype auto|fp32|fp16|bf16 [--stochastic-rounding]] [--dtype fp32|fp16|bf16]
                       [--kv-cache-dtype auto|fp8|bf16|fp16|fp32]
                       [--tp N]   (tensor parallelism: N processes, spawned or under torchrun)
    fastmamba serve --model DIR|PRESET [--port 8000] ...      (fastmamba/serve/cli.py; the serve extra)

``--speculate K`` verifies K drafted tokens per step (greedy acceptance at temperature 0, speculative
rejection sampling above). ``--drafter ngram`` (default) looks the drafts up in the prompt and the
generated text; ``--drafter oracle`` first runs plain generation with the same sampling options
(untimed) and then replays its tokens as drafts: with greedy decoding every draft is accepted, the
upper bound of speculation for this model and prompt, for benchmarking; ``--drafter model`` drafts
greedily with a smaller Mamba-2 model of the same vocabulary (``--draft-model``, loaded with the
target's dtype and device; ``ModelDrafter``).

``generate`` streams tokens as they come (text when the checkpoint has a tokenizer.json). A preset
(``mamba2-tiny`` ... ``mamba2-2.7b``) is a model of that shape with random weights, for speed
measurements: it has no tokenizer, takes ``--prompt-ids`` only and its tokens mean nothing. Text
needs a real checkpoint directory (config.json, weights, tokenizer.json):
``fastmamba generate --model DIR --prompt "..."``.

User errors (a missing checkpoint, a bad config.json, a corrupt file, bad options) print one line,
``fastmamba: error: ...``, and exit with status 2; ``--debug`` (anywhere on the line, or
``FASTMAMBA_DEBUG=1``) shows the traceback instead.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

# the parser is built from plain data: `fastmamba --help` must not import torch (seconds); the
# commands import torch, the models and the benchmarks when they run
from fastmamba import __version__
from fastmamba.presets import PRESET_NAMES, hub_id_hint, preset_lines
# what the CLI reports as ``fastmamba: error: <message>`` (exit 2) instead of a traceback: USER_ERRORS
from fastmamba.extras import EXIT_USAGE, USER_ERRORS, report_user_error as _report

# fastmamba.models.quantization.KV_CACHE_DTYPES, spelled out: the parser imports no torch
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "bf16", "fp16", "fp32")

# --dtype values, as load_model reads them (fastmamba.models.loader.parse_dtype checks them)
DTYPE_HELP = "auto (default: the checkpoint's), bfloat16 / bf16, float16 / fp16 / half, float32 / fp32"


class UsageError(Exception):
    """A command line that parses but cannot run (e.g. --prompt with a preset); reported in one line."""


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return v


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {v}")
    return v


GENERATE_EPILOG = f"""\
presets (--model NAME): the shapes of public models with RANDOM weights (fixed seed), for speed
measurements. They have no tokenizer: give the prompt as token ids (--prompt-ids 1,2,3); the tokens
they print are ids and mean nothing.
{preset_lines()}

text: --model DIR of a real checkpoint (config.json, model.safetensors or pytorch_model.bin, and
tokenizer.json; state-spaces or Hugging Face format), e.g.
  fastmamba generate --model ./mamba2-130m --prompt "The capital of France is"
a model on the Hugging Face Hub: download it first, then pass the directory:
  huggingface-cli download state-spaces/mamba2-130m --local-dir ./mamba2-130m
"""


def build_parser(command: str | None = None) -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its sub-command parsers by name.

    ``command``: the sub-command about to run. The benchmark targets' options are added only for
    ``bench`` (building them imports torch and every benchmark); for anything else ``bench`` is
    listed with its help line and nothing heavier is imported.
    """
    parser = argparse.ArgumentParser(prog="fastmamba", description="fastmamba: Mamba-2 inference kernels and runtime")
    parser.add_argument("--version", action="version", version=f"fastmamba {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback on errors (also accepted after the sub-command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench_help = "run a benchmark (same as python -m fastmamba.bench)"
    if command == "bench":
        from fastmamba.bench import targets as bench_targets

        bench = sub.add_parser("bench", help=bench_help, description="fastmamba benchmarks")
        bench_targets.configure(bench)
    else:
        bench = sub.add_parser("bench", help=bench_help, add_help=False)
        bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(_handler=_bench)
    gen = sub.add_parser(
        "generate", help="generate text (real checkpoint) or token ids (random-weight preset), streaming",
        description="Generate from a prompt, streaming the tokens as they come.",
        epilog=GENERATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("--model", required=True, metavar="DIR|PRESET",
                     help=f"checkpoint directory, or a preset with random weights: {', '.join(PRESET_NAMES)}")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT",
                     help="prompt text, encoded with the tokenizer's special tokens (its BOS) as transformers and "
                          "vLLM do; needs a checkpoint directory with tokenizer.json (not a preset)")
    src.add_argument("--prompt-ids", metavar="IDS", help="prompt as comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], metavar="STR",
                     help="stop once the generated text contains STR (repeatable; needs the checkpoint's tokenizer)")
    gen.add_argument("--stop-token-ids", default=None, metavar="IDS",
                     help="comma-separated token ids that end generation (the stop token is printed)")
    gen.add_argument("--ignore-eos", action="store_true",
                     help="run on past the checkpoint's end-of-sequence token(s) (default: stop there)")
    gen.add_argument("--batch", type=_positive_int, default=1, metavar="B",
                     help="run the prompt as B parallel requests; streams the first")
    gen.add_argument("--device", default=None, help="default: cuda when present")
    gen.add_argument("--dtype", default=None, metavar="DTYPE", help=f"weights' dtype: {DTYPE_HELP}; presets: bf16 on "
                                                                     "a GPU, fp32 on a CPU")
    gen.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                     help="tensor parallelism over N GPUs (N processes: spawned here, or joined under torchrun "
                          "--nproc-per-node N); the heads of every layer are split across them")
    gen.add_argument("--speculate", type=_non_negative_int, default=0, metavar="K",
                     help="speculative decoding with K drafts per step (0 = off)")
    gen.add_argument("--drafter", choices=("ngram", "oracle", "model", "mtp"), default="ngram",
                     help="draft source with --speculate: ngram = prompt lookup (default); oracle = replay "
                          "a plain greedy run made first, untimed (every draft accepted: for benchmarks); "
                          "model = greedy drafts of --draft-model; mtp = the checkpoint's own MTP layer "
                          "(Nemotron-3 checkpoints with num_nextn_predict_layers: 1)")
    gen.add_argument("--draft-model", metavar="DIR|PRESET", default=None,
                     help="with --drafter model: the draft model (same vocabulary as --model), e.g. mamba2-130m")
    gen.add_argument("--quantization", choices=("fp8",), default=None,
                     help="fp8: quantise a 16-bit checkpoint on load (e4m3 weights per channel, activations per "
                          "token; attention and lm_head stay 16-bit). FP8 checkpoints load as FP8 without it")
    gen.add_argument("--ssm-dtype", choices=("auto", "fp32", "fp16", "bf16"), default="auto",
                     help="SSM state dtype (default auto: the checkpoint's mamba_ssm_cache_dtype, else fp32; "
                          "fp16/bf16 halve the state traffic)")
    gen.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                     help="K/V page dtype of attention layers (default: fp8 e4m3 when the checkpoint ships "
                          "k_scale / v_scale, else the model's dtype); fp8: e4m3 pages (scale 1.0 without "
                          "checkpoint scales), half the K/V bytes; bf16/fp16/fp32: the model's dtype")
    gen.add_argument("--stochastic-rounding", action="store_true",
                     help="with --ssm-dtype fp16|bf16: store the states with stochastic rounding (unbiased)")
    gen.set_defaults(_handler=_generate)
    from fastmamba.serve import cli as serve_cli  # plain argparse: no torch, no fastapi

    srv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (needs the serve extra: pip install 'fastmamba[serve]')",
        description=serve_cli.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve_cli.add_arguments(srv)
    srv.set_defaults(_handler=lambda args, argv: serve_cli.run(args))
    return parser, {"bench": bench, "generate": gen, "serve": srv}


def _prompt_ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` as a list of ints >= 0 (the engine checks them against the vocabulary)."""
    parts = [t.strip() for t in text.split(",") if t.strip()]
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        raise UsageError(f"--prompt-ids expects comma-separated integers, got {text!r}") from None
    if not ids:
        raise UsageError(f"--prompt-ids holds no token ids: {text!r}")
    if any(t < 0 for t in ids):
        raise UsageError(f"--prompt-ids expects token ids >= 0, got {text!r}")
    return ids


def preset_notice(name: str) -> str:
    """What the CLI and the demo say when a preset runs: random weights, token ids, how to get text."""
    return (f"[{name} is a preset: random weights (fixed seed) for speed measurements, no tokenizer; the "
            "tokens below are ids and mean nothing. For text, run a real checkpoint directory: "
            'fastmamba generate --model DIR --prompt "..."]')


_TP_GROUP = None  # the tensor-parallel group while ``_generate`` runs on one of --tp N ranks
_QUIET_RANK_WAIT_S = 30.0  # how long a rank other than 0 waits for rank 0 to report a launch error


def _generate_on_rank(tp, args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``_generate`` on one rank of ``--tp N`` (SPMD: every rank runs it; only rank 0 prints)."""
    global _TP_GROUP
    _TP_GROUP = tp
    quiet = open(os.devnull, "w") if tp.rank else None  # noqa: SIM115 - closed below
    saved = sys.stdout, sys.stderr
    if quiet is not None:
        sys.stdout = sys.stderr = quiet
    try:
        return _generate(args, argv)
    finally:
        sys.stdout, sys.stderr = saved
        _TP_GROUP = None
        if quiet is not None:
            quiet.close()


def _generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    for flag, name in (("--model", args.model), ("--draft-model", args.draft_model)):
        hint = hub_id_hint(name, then=f"{flag} DIR") if name not in PRESET_NAMES else None
        if hint:
            raise UsageError(hint)
    if _TP_GROUP is None and (getattr(args, "tp", 1) > 1 or "WORLD_SIZE" in os.environ):
        from fastmamba.distributed.launch import launch_rank, torchrun_world_size

        if args.tp > 1 or torchrun_world_size() > 1:
            from fastmamba.distributed import check_tp_source
            from fastmamba.distributed.launch import check_launch, run_tp

            try:  # before any process starts or joins: torchrun's world size, --device, the shapes
                if args.speculate and args.drafter == "mtp":
                    raise ValueError(f"--drafter mtp with --tp {args.tp}: tensor parallelism does not shard the "
                                     "MTP layer (a rank's model has none); use --drafter ngram, or --tp 1")
                device = check_launch(args.tp, args.device, who="fastmamba generate")
                check_tp_source(args.model, args.tp, who="fastmamba generate --tp")
            except (ValueError, OSError):
                if launch_rank() != 0:  # under torchrun every rank fails alike: rank 0 alone says why,
                    # and the others wait for it (torchrun ends them when rank 0 exits): a rank that exited
                    # first made torchrun end rank 0 before it had printed, on a loaded machine
                    time.sleep(_QUIET_RANK_WAIT_S)
                    return EXIT_USAGE
                raise
            return run_tp(_generate_on_rank, args.tp, args, list(argv), device=device)

    import fastmamba
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams
    from fastmamba.generation import tokenizer as tokenizer_module

    # everything the command line alone decides is checked before the (possibly long) model load
    is_preset = args.model in PRESET_NAMES
    if args.prompt is not None and is_preset:
        raise UsageError(f"--prompt needs a checkpoint with a tokenizer.json, but {args.model} is a preset "
                         "(random weights, no tokenizer): pass token ids (--prompt-ids 1,2,3), or --model DIR "
                         "of a real checkpoint for text")
    if args.prompt is not None and os.path.isdir(args.model) \
            and not os.path.isfile(os.path.join(args.model, "tokenizer.json")):
        raise UsageError(f"--prompt needs {os.path.join(args.model, 'tokenizer.json')}, which does not exist; "
                         "pass --prompt-ids instead")
    ids = _prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    if (args.draft_model is not None) != (args.speculate > 0 and args.drafter == "model"):
        raise UsageError("--draft-model goes with --speculate K --drafter model (and that drafter needs it)")
    import torch

    ssm_dtype = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[args.ssm_dtype]
    if args.stochastic_rounding and args.ssm_dtype == "fp32":
        raise UsageError("--stochastic-rounding rounds 16-bit states; it needs --ssm-dtype fp16 or bf16 (or a "
                         "checkpoint whose mamba_ssm_cache_dtype is one)")
    state_kw = dict(ssm_dtype=ssm_dtype, stochastic_rounding=args.stochastic_rounding,
                    kv_cache_dtype=args.kv_cache_dtype)
    try:
        stop_ids = [int(t) for t in (args.stop_token_ids or "").split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--stop-token-ids expects comma-separated integers, got {args.stop_token_ids!r}") from None
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids, stop=args.stop,
                            ignore_eos=args.ignore_eos)

    # the tokenizer before the model: a bad tokenizer.json fails fast
    tok = tokenizer_module.load_tokenizer(args.model)  # None for a preset or a directory without tokenizer.json
    codec = tokenizer_module.Codec(args.model if os.path.isdir(args.model) else None, tokenizer=tok)
    text_tok = codec if tok is not None else None  # the engine decodes for stop strings
    if _TP_GROUP is not None:
        from fastmamba.distributed import load_tp_model

        model = load_tp_model(args.model, _TP_GROUP, dtype=getattr(args, "dtype", None))
    else:
        model = fastmamba.load_model(args.model, dtype=getattr(args, "dtype", None), device=args.device,
                                     quantization=getattr(args, "quantization", None))
    if args.prompt is not None:
        ids = codec.encode_prompt(args.prompt)  # the one rule of the CLI, LLM and the server
        if not ids:
            raise UsageError(f"--prompt {args.prompt!r} encodes to no tokens")
    if args.stop and tok is None:
        raise UsageError(f"--stop needs {args.model}'s tokenizer.json to decode the output (use --stop-token-ids)")
    if is_preset:
        print(preset_notice(args.model), file=sys.stderr)
    if args.speculate:
        from fastmamba.generation.drafters import ModelDrafter, NgramDrafter, OracleDrafter

        batch = args.batch
        if args.drafter == "oracle":
            reference = Engine(model, max_batch=1, tokenizer=text_tok).generate([ids], params)[0]
            drafter = OracleDrafter.from_runs([ids], [reference])
        elif args.drafter == "model":
            draft = fastmamba.load_model(args.draft_model, dtype=model.dtype, device=model.lm_head.weight.device)
            try:
                drafter = ModelDrafter(draft, batch, target_vocab_size=model.cfg.vocab_size)
            except ValueError as exc:
                raise UsageError(f"--draft-model {args.draft_model}: {exc}") from exc
        elif args.drafter == "mtp":
            drafter = "mtp"  # the engine builds the MTPDrafter over the model's MTP layer
        else:
            drafter = NgramDrafter()
        engine = Engine(model, max_batch=batch, speculate=args.speculate, drafter=drafter, tokenizer=text_tok,
                        **state_kw)
    else:
        engine = Engine(model, max_batch=args.batch, tokenizer=text_tok, **state_kw)
    if _TP_GROUP is not None:  # every rank draws unseeded samples from one seed (or the ranks diverge)
        from fastmamba.distributed.runtime import share_sampling_seed

        share_sampling_seed(_TP_GROUP, engine)
    print(f"[SSM states {engine.ssm_dtype_source}; K/V pages {engine.kv_cache_note}]", file=sys.stderr)
    rids = [engine.add_request(ids, params) for _ in range(args.batch)]
    shown: list[int] = []
    text = codec.stream() if tok is not None else None  # prints a character once all its tokens came
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.rid != rids[0]:
                continue
            shown.append(out.token)
            sys.stdout.write(text.push(out.token) if text is not None else f"{out.token} ")
            sys.stdout.flush()
    sys.stdout.write((text.flush() if text is not None else "") + "\n")
    sys.stdout.flush()
    dt = time.perf_counter() - t0
    if _TP_GROUP is not None:
        from fastmamba.distributed.runtime import check_ranks_agree

        check_ranks_agree(_TP_GROUP, [shown], who="fastmamba generate --tp")
    n = len(shown) * len(rids)
    where = f"{model.lm_head.weight.device}" + (f", tp {_TP_GROUP.world_size}" if _TP_GROUP is not None else "")
    print(f"[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s, batch {len(rids)}, prompt {len(ids)} tokens, {where}]",
          file=sys.stderr)
    if args.speculate:
        req = engine.finished[rids[0]]
        steps, acc = len(req.accepted), req.accepted_drafts
        rate = acc / (steps * args.speculate) if steps else 0.0
        print(f"[speculate K={args.speculate} ({args.drafter}): {steps} verify steps, {acc} of "
              f"{steps * args.speculate} drafts accepted ({rate:.0%}), "
              f"{(len(shown) - 1) / max(1, steps):.2f} tokens per verify step]", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from fastmamba.bench import targets as bench_targets

    return bench_targets.dispatch(args, bench_targets.command_line("fastmamba", argv))


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default: sys.argv[1:]); returns the exit status.

    User errors (``USER_ERRORS``, ``UsageError``) print ``fastmamba: error: <message>`` on stderr and
    return 2; with ``--debug`` anywhere in ``argv`` (or FASTMAMBA_DEBUG=1) they raise instead, with
    the traceback. argparse's own errors print the usage line and exit 2 as usual.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("FASTMAMBA_DEBUG", "0") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    command = next((a for a in argv if not a.startswith("-")), None)
    parser, commands = build_parser(command)
    if command == "bench":
        from fastmamba.bench import targets as bench_targets

        bench_targets.check_planned(commands["bench"], argv[argv.index("bench") + 1:])
    args = parser.parse_args(argv)
    try:
        return args._handler(args, argv)
    except (UsageError, *USER_ERRORS) as exc:
        if debug:
            raise
        return _report(exc)
    except RuntimeError as exc:
        if debug or type(exc).__name__ != "OutOfMemoryError":  # torch.cuda.OutOfMemoryError: a user limit
            raise
        return _report(RuntimeError(f"{' '.join(str(exc).split())[:300]} (try a smaller --batch or a smaller model)"))
    except KeyboardInterrupt:
        if debug:
            raise
        print("\nfastmamba: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
