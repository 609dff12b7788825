"""Text <-> token ids for every front end (``fastmamba generate``, ``LLM``, the server): one module,
one rule.

``load_tokenizer(dir)``   the directory's ``tokenizer.json`` through the ``tokenizers`` package
``Codec(dir)``            the tokenizer with its special tokens and chat template:
    encode_prompt(text)         completion prompts: the tokenizer's own special-token
                                post-processing (``add_special_tokens=True``: the BOS a Llama- or
                                Mamba-style tokenizer puts in front), as ``transformers``'
                                ``tokenizer(text)`` and vLLM's completions endpoint apply it
    encode_chat(messages)       chat prompts: the chat template rendered, then encoded WITHOUT
                                adding special tokens again (the template writes the BOS itself), as
                                ``apply_chat_template(..., tokenize=True)`` does
    render_chat(messages)       the template's text (assistant turn opened)
    decode(ids)                 text, special tokens skipped
    stream()                    an ``IncrementalDecoder`` for printing tokens as they come
``normalize_messages(msgs)``    OpenAI-style messages with string content (text parts joined)

Chat templates, first found wins: ``Codec(dir, chat_template=FILE_OR_TEXT)``; ``chat_template.jinja``;
``chat_template.json`` (``{"chat_template": ...}``); ``tokenizer_config.json``'s ``chat_template``
(a string, or named templates of which ``default`` is taken). The template is rendered by
transformers' own machinery (``apply_chat_template``), so it needs ``transformers`` (the ``serve``
extra); everything else needs only ``tokenizers`` (the ``hf`` extra).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence

HF_EXTRA = "pip install 'fastmamba[hf]'"
CHAT_EXTRA = "pip install 'fastmamba[serve]'"
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_REPLACEMENT = "\ufffd"  # what a decoder writes for an incomplete UTF-8 sequence


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
        raise ImportError(f"load_tokenizer: {file} needs the `tokenizers` package: {HF_EXTRA}") from exc
    try:
        return Tokenizer.from_file(file)
    except Exception as exc:  # tokenizers raises a bare Exception with serde's message
        if isinstance(exc, OSError) and exc.filename:  # permission denied ...: names the file already
            raise
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise ValueError(f"load_tokenizer: {file} is not a valid tokenizer.json: {reason}") from exc


def _read_json(file: str) -> dict:
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _pick_template(value: object, source: str) -> str:
    """A ``chat_template`` field: a string, or named templates ([{"name", "template"}] or a dict)."""
    if isinstance(value, list):
        try:
            value = {t["name"]: t["template"] for t in value}
        except (TypeError, KeyError):
            raise ValueError(f"{source}: `chat_template` list entries need 'name' and 'template'") from None
    if isinstance(value, dict):
        if "default" not in value:
            raise ValueError(f"{source}: named chat templates {sorted(value)} have no 'default'; pass one "
                             "with chat_template= (--chat-template FILE)")
        value = value["default"]
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{source}: `chat_template` must be a non-empty string, got {value!r:.60}")
    return value


def read_chat_template(source: str | os.PathLike) -> str:
    """An explicit template: a file (``.jinja`` text, or ``.json`` with a ``chat_template`` field) or
    the template text itself (anything with a Jinja ``{{`` or ``{%``). Raises FileNotFoundError for
    a path that does not exist, ValueError for an empty or unreadable file."""
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(f"chat_template: expected a file path or the template text, got {type(source).__name__}")
    text = os.fspath(source)
    if os.path.isfile(text):
        if text.endswith(".json"):
            return _pick_template(_read_json(text).get("chat_template"), text)
        try:
            with open(text, encoding="utf-8") as f:
                return _pick_template(f.read(), text)
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"chat_template: cannot read {text}: {exc}") from exc
    if "{{" in text or "{%" in text:
        return text
    raise FileNotFoundError(f"chat_template: {text!r} is neither a file nor a Jinja template (no '{{{{' or '{{%')")


def _template_in(directory: str, config: dict) -> str | None:
    """The directory's own template, by transformers' file order (None when it has none)."""
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja):
        return read_chat_template(jinja)
    as_json = os.path.join(directory, "chat_template.json")
    if os.path.isfile(as_json):
        return read_chat_template(as_json)
    if config.get("chat_template") is not None:
        return _pick_template(config["chat_template"], os.path.join(directory, "tokenizer_config.json"))
    return None


def _text_of(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping):
                raise TypeError(f"{where}.content[{j}]: expected a content part object, got {type(part).__name__}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"{where}.content[{j}]: content parts of type {kind!r} are not supported (this "
                                 "model reads text: parts of type 'text' only)")
            if not isinstance(part.get("text"), str):
                raise TypeError(f"{where}.content[{j}].text: expected a string, got "
                                f"{type(part.get('text')).__name__}")
            texts.append(part["text"])
        return "\n".join(texts)  # as vLLM joins text parts for a template that reads strings
    raise TypeError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")


def normalize_messages(messages: object) -> list[dict]:
    """``messages`` as a list of plain dicts whose ``content`` is a string.

    Each message is a mapping (or a pydantic model) with a string ``role``; ``content`` is a string,
    None (""), or a list of parts ``{"type": "text", "text": ...}`` (joined with newlines). Other
    keys (``name``, ``tool_calls`` ...) are kept for the template. Raises TypeError / ValueError
    naming ``messages[i]`` and the part: another part type (``image_url`` ...) is refused by name.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(f"messages: expected a list of message objects, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages: the conversation is empty")
    out = []
    for i, m in enumerate(messages):
        if hasattr(m, "model_dump"):
            m = m.model_dump(exclude_none=True)
        if not isinstance(m, Mapping):
            raise TypeError(f"messages[{i}]: expected a message object with 'role' and 'content', got "
                            f"{type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise TypeError(f"messages[{i}].role: expected a string, got {type(m.get('role')).__name__}")
        out.append({**m, "content": _text_of(m.get("content"), f"messages[{i}]")})
    return out


class IncrementalDecoder:
    """Text of a growing token list, piece by piece, without breaking characters that span tokens.

    ``push(token)`` returns the new text (possibly ""): the decoded tokens since the last piece,
    held back while they end in an incomplete character (U+FFFD). A window of the last printed
    tokens is decoded, not the whole list, so each push costs O(1) (vLLM's / TGI's method).
    ``flush()`` returns what is still held back (an incomplete character at the end, as U+FFFD).
    """

    def __init__(self, decode):
        self._decode = decode
        self.ids: list[int] = []
        self._prefix = 0  # tokens before this index were printed and are left out of the window
        self._read = 0  # tokens before this index were printed

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) > len(before) and not now.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return now[len(before):]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return now[len(before):]


class Codec:
    """A checkpoint's tokenizer, special tokens and chat template (see the module docstring).

    directory      None (no tokenizer: token-id prompts only), or a directory holding tokenizer.json
                   (and maybe tokenizer_config.json, chat_template.jinja / .json)
    chat_template  None (the directory's), or a file / the template text (``--chat-template``)
    required       True: a directory without tokenizer.json is an error (an explicit ``tokenizer=``
                   or ``--tokenizer``); False: it gives a Codec without text (a model directory)
    tokenizer      an already loaded ``tokenizers.Tokenizer`` (then tokenizer.json is not read)

    Raises TypeError for a ``directory`` that is not a path, FileNotFoundError for one that does not
    exist (or, with ``required``, lacks tokenizer.json), NotADirectoryError for a file, ValueError
    for unreadable files or a chat template without a tokenizer.
    """

    def __init__(self, directory: str | os.PathLike | None = None, *, chat_template: str | os.PathLike | None = None,
                 required: bool = False, tokenizer=None):
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise TypeError(f"tokenizer: expected a directory path (str or os.PathLike) holding tokenizer.json, "
                            f"got {type(directory).__name__}")
        self.directory = None if directory is None else os.fspath(directory)
        if self.directory is not None and tokenizer is None:
            if os.path.isfile(self.directory):
                raise NotADirectoryError(f"tokenizer: {self.directory!r} is a file; pass the directory that holds "
                                         "tokenizer.json")
            if not os.path.isdir(self.directory):
                raise FileNotFoundError(f"tokenizer: {self.directory!r} is not a directory")
            tokenizer = load_tokenizer(self.directory)
            if tokenizer is None and required:
                raise FileNotFoundError(f"tokenizer: {self.directory!r} has no tokenizer.json")
        self.tokenizer = tokenizer
        self.config: dict = {}
        if tokenizer is not None and self.directory is not None and os.path.isdir(self.directory):
            cfg_file = os.path.join(self.directory, "tokenizer_config.json")
            if os.path.isfile(cfg_file):
                self.config = _read_json(cfg_file)
        if chat_template is not None:
            if tokenizer is None:
                raise ValueError("chat_template: a chat template needs a tokenizer (tokenizer.json) to encode "
                                 "what it renders")
            self.chat_template: str | None = read_chat_template(chat_template)
        else:
            self.chat_template = _template_in(self.directory, self.config) \
                if tokenizer is not None and self.directory is not None else None
        self.special_tokens = {k: self._token_text(self.config.get(k)) for k in _SPECIAL_KEYS
                               if self._token_text(self.config.get(k))}
        self._hf = None  # transformers' tokenizer over ours, built on the first chat

    @staticmethod
    def _token_text(value: object) -> str | None:
        if isinstance(value, Mapping):  # an AddedToken written out as {"content": ...}
            value = value.get("content")
        return value if isinstance(value, str) and value else None

    @property
    def has_text(self) -> bool:
        return self.tokenizer is not None

    def _need_text(self, what: str) -> None:
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer (tokenizer.json); this model has none: give token ids")

    def encode_prompt(self, text: str) -> list[int]:
        """A completion prompt's ids: the tokenizer's special-token post-processing applied (its BOS)."""
        self._need_text("a text prompt")
        if not isinstance(text, str):
            raise TypeError(f"encode_prompt: expected a string, got {type(text).__name__}")
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    encode = encode_prompt  # the one rule for text prompts

    def render_chat(self, messages, *, add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (``normalize_messages``), the assistant's turn opened."""
        self._need_text("a chat")
        if not self.chat_template:
            where = self.directory or "the tokenizer"
            raise ValueError(f"this model has no chat template ({where}: no chat_template.jinja, chat_template.json "
                             "or tokenizer_config.json `chat_template`); pass one with chat_template= "
                             "(--chat-template FILE) or send plain prompts")
        messages = normalize_messages(messages)
        if self._hf is None:
            try:
                from transformers import PreTrainedTokenizerFast
            except ImportError as exc:
                raise ImportError(f"chat templates are rendered by transformers: {CHAT_EXTRA}") from exc
            self._hf = PreTrainedTokenizerFast(tokenizer_object=self.tokenizer, **self.special_tokens)
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            chat_template=self.chat_template)

    def encode_chat(self, messages, *, add_generation_prompt: bool = True) -> list[int]:
        """A chat prompt's ids: the rendered template encoded without adding special tokens again."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens skipped ("" without a tokenizer)."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True) if self.tokenizer is not None else ""

    def stream(self) -> IncrementalDecoder:
        """A fresh ``IncrementalDecoder`` over this codec's ``decode``."""
        self._need_text("streamed text")
        return IncrementalDecoder(self.decode)
