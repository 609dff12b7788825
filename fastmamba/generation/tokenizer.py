"""Tokenizer of a checkpoint directory (``tokenizer.json`` through the ``tokenizers`` package)."""
from __future__ import annotations

import os


def load_tokenizer(path: str | os.PathLike):
    """The directory's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None when there is none
    (presets, or directories without one): prompts are then given as token ids.

    Raises ImportError when the file exists but ``tokenizers`` is not installed, ValueError naming
    the file when it is not a tokenizer ``tokenizers`` can read (corrupt JSON, another format).
    """
    file = os.path.join(os.fspath(path), "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(f"load_tokenizer: {file} needs the `tokenizers` package: pip install tokenizers") from exc
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises a bare Exception with serde's message
        if isinstance(exc, OSError) and exc.filename:  # permission denied ...: names the file already
            raise
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"load_tokenizer: {file} is not a valid tokenizer.json: {reason}") from exc
