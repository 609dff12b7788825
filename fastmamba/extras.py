"""Optional extras: which ``pip install 'fastmamba[...]'`` brings a missing module.

    hf     tokenizers, safetensors, numpy: Hugging Face checkpoints and their tokenizers
    serve  hf + transformers (chat templates) + fastapi, uvicorn, prometheus-client: the server

``install_hint(exc)`` finds the missing module behind an ImportError (its cause chain) and names
the extra, so every front end reports a missing package as one line with the command that fixes it.
"""
from __future__ import annotations

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
