"""Optional extras: which ``pip install 'fastmamba[...]'`` brings a missing module.

    hf     tokenizers, safetensors, numpy: Hugging Face checkpoints and their tokenizers
    serve  hf + transformers (chat templates) + fastapi, uvicorn, prometheus-client: the server

``install_hint(exc)`` finds the missing module behind an ImportError (its cause chain) and names
the extra, so every front end reports a missing package as one line with the command that fixes it:
``report_user_error`` is that line for the command-line entry points (``fastmamba ...`` and
``python -m fastmamba.bench ...``), for every error in ``USER_ERRORS``.
"""
from __future__ import annotations

import sys

EXIT_USAGE = 2  # argparse's status for a bad command line; ours for every user error

# what the entry points report in one line (exit 2) instead of a traceback: a missing or unreadable
# path, a bad config / weight / tokenizer file, a bad option value, a missing package
USER_ERRORS = (OSError, ValueError, TypeError, ImportError, NotImplementedError)

EXTRA_OF = {
    "tokenizers": "hf", "safetensors": "hf", "numpy": "hf",
    "transformers": "serve", "jinja2": "serve", "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve",
}


def install_hint(exc: BaseException) -> str | None:
    """``pip install 'fastmamba[EXTRA]'`` for the optional module whose absence raised ``exc``, else None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        name = getattr(exc, "name", None) if isinstance(exc, ImportError) else None
        extra = EXTRA_OF.get((name or "").split(".")[0])
        if extra:
            return f"pip install 'fastmamba[{extra}]'"
        exc = exc.__cause__ or exc.__context__
    return None


def report_user_error(exc: BaseException, prog: str = "fastmamba") -> int:
    """``<prog>: error: <message>`` on stderr, in one line (the message as raised: it names the file or
    option; a missing optional package gets its install hint); returns EXIT_USAGE."""
    msg = str(exc) if str(exc) else type(exc).__name__
    if isinstance(exc, OSError) and exc.filename and exc.strerror and str(exc.filename) not in msg:
        msg = f"{exc.strerror}: {exc.filename}"
    hint = install_hint(exc) if isinstance(exc, ImportError) else None
    if hint and hint not in msg:
        msg = f"{msg}; install the extra: {hint}"
    msg = " ".join(msg.split())  # one line
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return EXIT_USAGE
