"""Tokenizer of a checkpoint directory (``tokenizer.json`` through the ``tokenizers`` package)."""
from __future__ import annotations

import os


def load_tokenizer(path: str | os.PathLike):
    """The directory's ``tokenizer.json`` as a ``tokenizers.Tokenizer``, or None when there is none
    (presets, or directories without one): prompts are then given as token ids."""
    file = os.path.join(str(path), "tokenizer.json")
    if not os.path.isfile(file):
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:
        raise ImportError(f"{file} needs the `tokenizers` package: pip install tokenizers") from exc
    return Tokenizer.from_file(file)
