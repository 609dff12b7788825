"""Text <-> token ids and chat templates for the server, from a checkpoint directory.

``tokenizer.json`` through ``tokenizers`` (as ``fastmamba generate`` does); the chat template from
``tokenizer_config.json`` rendered by transformers' own template machinery
(``PreTrainedTokenizerFast.apply_chat_template``). A model without a tokenizer (the presets)
serves token-id prompts only; one without a chat template refuses chat requests.
"""
from __future__ import annotations

import json
import os

from fastmamba.generation.tokenizer import load_tokenizer


class Codec:
    """encode(text) -> ids, decode(ids) -> text, render_chat(messages) -> prompt text."""

    def __init__(self, directory: str | os.PathLike | None):
        self.directory = None if directory is None else str(directory)
        self.tokenizer = load_tokenizer(self.directory) if self.directory and os.path.isdir(self.directory) else None
        self.config: dict = {}
        cfg_file = os.path.join(self.directory, "tokenizer_config.json") if self.directory else ""
        if cfg_file and os.path.isfile(cfg_file):
            try:
                with open(cfg_file, encoding="utf-8") as f:
                    self.config = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"{cfg_file}: not a readable JSON file ({exc})") from exc
        self.chat_template: str | None = self.config.get("chat_template") if self.tokenizer else None
        self._hf = None

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied to ``messages`` with the assistant's turn opened."""
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            special = {k: v for k, v in self.config.items() if k in ("bos_token", "eos_token", "unk_token", "pad_token")
                       and isinstance(v, str)}
            self._hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, **special)
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            chat_template=self.chat_template)
