"""The ``fastmamba`` command (declared in pyproject.toml as ``fastmamba = "fastmamba.cli:main"``).

    fastmamba bench kernels|prefill|tune|e2e ...     (python -m fastmamba.bench --help)
    fastmamba generate --model DIR|PRESET (--prompt TEXT | --prompt-ids 1,2,3) [--max-new-tokens N]
                       [--temperature T] [--top-k K] [--top-p P] [--seed S] [--batch B]
                       [--stop STR ...] [--stop-token-ids 1,2] [--ignore-eos]
                       [--speculate K [--drafter ngram|oracle|model [--draft-model DIR|PRESET]]]

``--speculate K`` verifies K drafted tokens per step (greedy acceptance at temperature 0, speculative
rejection sampling above). ``--drafter ngram`` (default) looks the drafts up in the prompt and the
generated text; ``--drafter oracle`` first runs plain generation with the same sampling options
(untimed) and then replays its tokens as drafts: with greedy decoding every draft is accepted, the
upper bound of speculation for this model and prompt, for benchmarking; ``--drafter model`` drafts
greedily with a smaller Mamba-2 model of the same vocabulary (``--draft-model``, loaded with the
target's dtype and device; ``ModelDrafter``).

``generate`` streams tokens as they come (text when the checkpoint has a tokenizer.json).
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastmamba.bench import targets as bench_targets


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and its sub-command parsers by name."""
    parser = argparse.ArgumentParser(prog="fastmamba", description="fastmamba: Mamba-2 inference kernels and runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = sub.add_parser(
        "bench", help="run a benchmark (same as python -m fastmamba.bench)", description="fastmamba benchmarks"
    )
    bench_targets.configure(bench)
    bench.set_defaults(_handler=_bench)
    gen = sub.add_parser("generate", help="generate text or token ids with a model, streaming")
    gen.add_argument("--model", required=True, help="checkpoint directory or preset (e.g. mamba2-130m)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer.json)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    gen.add_argument("--max-new-tokens", type=int, default=64)
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
    gen.add_argument("--batch", type=int, default=1, help="run the prompt as B parallel requests; streams the first")
    gen.add_argument("--device", default=None, help="default: cuda when present")
    gen.add_argument("--speculate", type=int, default=0, metavar="K",
                     help="speculative decoding with K drafts per step (0 = off)")
    gen.add_argument("--drafter", choices=("ngram", "oracle", "model"), default="ngram",
                     help="draft source with --speculate: ngram = prompt lookup (default); oracle = replay "
                          "a plain greedy run made first, untimed (every draft accepted: for benchmarks); "
                          "model = greedy drafts of --draft-model")
    gen.add_argument("--draft-model", metavar="DIR|PRESET", default=None,
                     help="with --drafter model: the draft model (same vocabulary as --model), e.g. mamba2-130m")
    gen.set_defaults(_handler=_generate)
    return parser, {"bench": bench, "generate": gen}


def _generate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    import time

    import fastmamba
    from fastmamba.generation.engine import Engine
    from fastmamba.generation.sampling import SamplingParams
    from fastmamba.generation.tokenizer import load_tokenizer

    model = fastmamba.load_model(args.model, device=args.device)
    tok = load_tokenizer(args.model)
    if args.prompt is not None:
        if tok is None:
            print(f"error: {args.model} has no tokenizer.json; pass --prompt-ids instead", file=sys.stderr)
            return 2
        ids = tok.encode(args.prompt).ids
    else:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            print(f"error: --prompt-ids expects comma-separated integers, got {args.prompt_ids!r}", file=sys.stderr)
            return 2
    try:
        stop_ids = [int(t) for t in (args.stop_token_ids or "").split(",") if t.strip()]
    except ValueError:
        print(f"error: --stop-token-ids expects comma-separated integers, got {args.stop_token_ids!r}", file=sys.stderr)
        return 2
    if args.stop and tok is None:
        print(f"error: --stop needs the checkpoint's tokenizer.json to decode the output; {args.model} has none "
              "(use --stop-token-ids)", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop_token_ids=stop_ids, stop=args.stop,
                            ignore_eos=args.ignore_eos)
    if args.speculate < 0:
        print(f"error: --speculate expects K >= 0, got {args.speculate}", file=sys.stderr)
        return 2
    if (args.draft_model is not None) != (args.speculate > 0 and args.drafter == "model"):
        print("error: --draft-model goes with --speculate K --drafter model (and that drafter needs it)",
              file=sys.stderr)
        return 2
    if args.speculate:
        from fastmamba.generation.drafters import ModelDrafter, NgramDrafter, OracleDrafter

        batch = max(1, args.batch)
        if args.drafter == "oracle":
            reference = Engine(model, max_batch=1, tokenizer=tok).generate([ids], params)[0]
            drafter = OracleDrafter.from_runs([ids], [reference])
        elif args.drafter == "model":
            draft = fastmamba.load_model(args.draft_model, dtype=model.dtype, device=model.lm_head.weight.device)
            try:
                drafter = ModelDrafter(draft, batch, target_vocab_size=model.cfg.vocab_size)
            except ValueError as exc:
                print(f"error: --draft-model {args.draft_model}: {exc}", file=sys.stderr)
                return 2
        else:
            drafter = NgramDrafter()
        engine = Engine(model, max_batch=batch, speculate=args.speculate, drafter=drafter, tokenizer=tok)
    else:
        engine = Engine(model, max_batch=max(1, args.batch), tokenizer=tok)
    rids = [engine.add_request(ids, params) for _ in range(max(1, args.batch))]
    shown: list[int] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.rid != rids[0]:
                continue
            shown.append(out.token)
            piece = tok.decode(shown) if tok is not None else None
            if tok is not None:  # print only the new text
                prev = tok.decode(shown[:-1])
                sys.stdout.write(piece[len(prev):])
            else:
                sys.stdout.write(f"{out.token} ")
            sys.stdout.flush()
    dt = time.perf_counter() - t0
    n = len(shown) * len(rids)
    print(f"\n[{n} tokens in {dt:.2f} s: {n / dt:.1f} tok/s, batch {len(rids)}, {model.lm_head.weight.device}]",
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
    return bench_targets.dispatch(args, bench_targets.command_line("fastmamba", argv))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, commands = build_parser()
    if argv[:1] == ["bench"]:
        bench_targets.check_planned(commands["bench"], argv[1:])
    args = parser.parse_args(argv)
    return args._handler(args, argv)


if __name__ == "__main__":
    sys.exit(main())
