"""``fastmamba serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the engine.

A request's path: HTTP handler (``handlers.py``; the app itself in ``app.py``) -> validated request
(``protocol.py``'s schemas, then ``state.py``'s checks against the model, once) -> its choices
(``choices.py``) -> the serving loop's commands (``worker.py``: one loop, run in a process of its
own by ``engine_process.py`` or in a thread by ``engine_thread.py``) -> ``Engine.step`` -> tokens
back to the handler's queue -> server-sent events or one JSON body. The serving loop is the only one that touches the model.

Needs the optional extra: ``pip install 'fastmamba[serve]'``.
"""
from __future__ import annotations

EXTRA_HINT = "fastmamba serve needs the optional extra: pip install 'fastmamba[serve]' (fastapi, uvicorn, prometheus-client)"


def require_serve_deps() -> None:
    """Raise ImportError naming the extra when a serving dependency is missing, or naming the error
    when one is installed but fails to import (a broken install is not a missing extra)."""
    missing = []
    for name in ("fastapi", "uvicorn", "prometheus_client"):
        try:
            __import__(name)
        except ImportError as e:
            if e.name not in (None, name) and not (e.name or "").startswith(name + "."):
                raise ImportError(f"fastmamba serve: {name} is installed but importing it failed: {e}") from e
            missing.append(name)
    if missing:
        raise ImportError(f"{EXTRA_HINT}; missing: {', '.join(missing)}")
