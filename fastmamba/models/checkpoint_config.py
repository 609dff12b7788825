"""Reading a checkpoint's JSON files, the rules every model family shares.

``_Fields`` reads one JSON object with typed, range-checked fields; each error names the file and
the field, e.g. ``Mamba2Config: ckpt/config.json: 'head_dim' expected an integer >= 1, got 0``.

End of sequence: ``checkpoint_eos_token_ids`` reads a checkpoint's ``eos_token_id`` (an int or a list
of ints in config.json, overridden by generation_config.json's when that file sets it, else the
tokenizer files' ``eos_token``); empty when the checkpoint names none. ``Mamba2Config.from_dir`` and
``NemotronHConfig.from_dir`` both use it.

SSM state dtype: ``ssm_cache_dtype_of`` reads config.json's ``mamba_ssm_cache_dtype`` (transformers'
and NVIDIA's Nemotron-H configs: "float32", "bfloat16", "float16"); ``ssm_state_dtype`` picks the
dtype a cache's SSM states get: the user's explicit choice, else the checkpoint's, else fp32.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

_REQUIRED = object()


def _describe(v: Any) -> str:
    return f"{v!r} ({'null' if v is None else type(v).__name__})"


class _Fields:
    """Typed reads of one JSON object; each error names the file (``source``) and the field."""

    def __init__(self, data: Any, source: str, prefix: str = "", *, who: str = "Mamba2Config"):
        self.source, self.prefix, self.who = source, prefix, who
        if not isinstance(data, dict):
            where = f"'{prefix[:-1]}'" if prefix else "the file"
            raise ValueError(f"{who}: {source}: {where} should be a JSON object, got {_describe(data)}")
        self.data = data

    def error(self, key: str, expected: str, got: Any) -> ValueError:
        field = f"'{self.prefix}{key}'"
        return ValueError(f"{self.who}: {self.source}: {field} expected {expected}, got {_describe(got)}")

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self.data:
            if default is _REQUIRED:
                raise ValueError(f"{self.who}: {self.source}: required field '{self.prefix}{key}' is missing")
            return default
        return self.data[key]

    def opt_int(self, key: str, *, minimum: int = 1) -> int | None:
        """An integer >= minimum, or None when the field is absent or null."""
        v = self.data.get(key)
        return None if v is None else self.int(key, minimum=minimum)

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise self.error(key, f"an integer >= {minimum}", v)
        return v

    def float(self, key: str, default: Any = _REQUIRED, *, positive: bool = False) -> float:
        v = _as_float(self.raw(key, default))
        if v is None or math.isnan(v) or (positive and not (0 < v < math.inf)):
            raise self.error(key, "a finite number > 0" if positive else "a number", self.data.get(key, default))
        return v

    def bool(self, key: str, default: Any = _REQUIRED) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise self.error(key, "true or false", v)
        return v

    def float_pair(self, key: str, default: tuple[float, float]) -> tuple[float, float]:
        v = self.raw(key, default)
        pair = tuple(_as_float(x) for x in v) if isinstance(v, (list, tuple)) else ()
        if len(pair) != 2 or None in pair or any(math.isnan(x) for x in pair) or not 0 <= pair[0] < pair[1]:
            raise self.error(key, "[low, high] with 0 <= low < high (high may be Infinity)", v)
        return pair

    def eos(self, key: str) -> tuple[int, ...] | None:
        """``eos_token_id``: an int, a list of ints, or null / absent (None: not set here)."""
        v = self.data.get(key)
        if v is None:
            return None
        ids = [v] if not isinstance(v, list) else v
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise self.error(key, "a token id >= 0 or a list of them", v)
        return tuple(dict.fromkeys(ids))


def _as_float(v: Any) -> float | None:
    """A float from config.json (transformers writes infinity as {"__float__": "Infinity"}), or None."""
    if isinstance(v, dict) and set(v) == {"__float__"}:
        try:
            return float(v["__float__"])
        except (TypeError, ValueError):
            return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _read_json(path: str | os.PathLike) -> Any:
    """A JSON file's content; ValueError naming the file when it is not valid JSON / UTF-8."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Mamba2Config: {os.fspath(path)} is not valid JSON: {e}") from e


def checkpoint_eos_token_ids(root: str | os.PathLike, config_eos: tuple[int, ...], vocab_size: int, *,
                             who: str = "Mamba2Config") -> tuple[int, ...]:
    """A checkpoint directory's end-of-sequence ids, the one rule for every model family.

    config_eos  what config.json's ``eos_token_id`` said (() when absent or null)
    First found wins: generation_config.json's ``eos_token_id`` (an int, a list, or null for none:
    it overrides config.json's), config.json's, else the ``eos_token`` that tokenizer_config.json or
    special_tokens_map.json name, looked up in tokenizer.json. Every id is checked against
    ``vocab_size``; errors name ``who``, the file and the field.
    """
    root = os.fspath(root)
    eos = tuple(config_eos)
    gen_path = os.path.join(root, "generation_config.json")
    if os.path.isfile(gen_path):
        gen = _Fields(_read_json(gen_path), gen_path, who=who)
        if gen.has("eos_token_id"):
            eos = gen.eos("eos_token_id") or ()
            _check_eos(gen_path, "eos_token_id", eos, vocab_size, "vocab_size of config.json", who=who)
            return eos
    if eos:
        return eos
    found = _tokenizer_eos(root, who=who)
    if found is None:
        return ()
    source, eos = found
    _check_eos(source, "eos_token", eos, vocab_size, "vocab_size of config.json", who=who)
    return eos


def _tokenizer_eos(root: str, *, who: str = "Mamba2Config") -> tuple[str, tuple[int, ...]] | None:
    """(file, (id,)) for the ``eos_token`` that tokenizer_config.json / special_tokens_map.json name,
    its id read from tokenizer.json (added tokens, then the model's vocab); None when no file names one
    or there is no tokenizer.json to map it."""
    vocab_path = os.path.join(root, "tokenizer.json")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        f = _Fields(_read_json(path), path, who=who)
        token = f.raw("eos_token", None)
        if isinstance(token, dict):  # a serialised AddedToken
            token = token.get("content")
        if token is None:
            continue
        if not isinstance(token, str):
            raise f.error("eos_token", "a token string or {\"content\": string}", f.raw("eos_token"))
        if not os.path.isfile(vocab_path):
            return None
        tj = _read_json(vocab_path)
        if not isinstance(tj, dict):
            raise ValueError(f"{who}: {vocab_path}: the file should be a JSON object, got {_describe(tj)}")
        for added in tj.get("added_tokens") or ():
            if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
                return path, (added["id"],)
        vocab = (tj.get("model") or {}).get("vocab") if isinstance(tj.get("model"), dict) else None
        if isinstance(vocab, dict) and isinstance(vocab.get(token), int):
            return path, (vocab[token],)
        raise ValueError(f"{who}: {path}: 'eos_token' {token!r} is not a token of {vocab_path}")
    return None


def _check_eos(src: str, field: str, ids: tuple[int, ...], vocab: int, vocab_name: str, *,
               who: str = "Mamba2Config") -> None:
    bad = [i for i in ids if i >= vocab]
    if bad:
        raise ValueError(f"{who}: {src}: '{field}' {bad} outside the vocabulary ({vocab_name} = {vocab})")


# Public mamba2-* shapes (state-spaces configs); vocab 50277 padded to a multiple of 16.


# config.json's mamba_ssm_cache_dtype (and the short names the CLI uses) -> fastmamba's short name
SSM_CACHE_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16",
                    "fp16": "fp16", "half": "fp16"}


def agreed_pattern(cfg: dict[str, Any], string_key: str, list_keys: tuple[str, ...], char_of: dict[str, str], *,
                   who: str = "NemotronHConfig") -> str | None:
    """A layer pattern (one character per layer) from a config.json dict: the string under
    ``string_key`` and the per-layer type lists under ``list_keys`` (mapped through ``char_of``);
    where several are present they must agree. None when none is. ValueError naming the key for a
    wrong type, a layer type ``char_of`` lacks, or a disagreement."""
    found: list[tuple[str, str]] = []
    pat = cfg.get(string_key)
    if pat is not None:
        if not isinstance(pat, str):
            raise ValueError(f"{who}: `{string_key}` expected a string, got {_describe(pat)}")
        found.append((string_key, pat))
    for key in list_keys:
        types = cfg.get(key)
        if types is None:
            continue
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"{who}: `{key}` expected a list of layer-type strings, got {types!r}")
        unknown = sorted({t for t in types if t not in char_of})
        if unknown:
            raise ValueError(f"{who}: `{key}` has unknown layer types {unknown}; expected {sorted(char_of)}")
        found.append((key, "".join(char_of[t] for t in types)))
    if not found:
        return None
    (k0, p0), *rest = found
    for k, p in rest:
        if p != p0:
            raise ValueError(f"{who}: `{k}` ({p!r} as a pattern) disagrees with `{k0}` ({p0!r})")
    return p0


def ssm_cache_dtype_of(cfg: dict, source: str = "config.json", *, who: str = "NemotronHConfig") -> str | None:
    """config.json's ``mamba_ssm_cache_dtype`` as "fp32" / "bf16" / "fp16", or None when absent or
    null; ValueError naming the file and field for another value."""
    v = cfg.get("mamba_ssm_cache_dtype")
    if v is None:
        return None
    name = SSM_CACHE_DTYPES.get(v.removeprefix("torch.") if isinstance(v, str) else None)
    if name is None:
        raise ValueError(f"{who}: {source}: 'mamba_ssm_cache_dtype' expected one of 'float32', 'bfloat16', "
                         f"'float16', got {_describe(v)}")
    return name


def ssm_state_dtype(model_cfg: Any, user: Any = None) -> tuple[Any, str]:
    """(the SSM state dtype, where it came from) for a model config and the user's choice.

    user   None: not chosen, so the checkpoint's ``mamba_ssm_cache_dtype`` (``model_cfg.ssm_cache_dtype``),
           else fp32; or a torch dtype (float32 / bfloat16 / float16) or a name ("fp32", "bf16",
           "bfloat16", ...), which wins over the checkpoint's
    Returns e.g. (torch.bfloat16, "bf16 (config.json mamba_ssm_cache_dtype)"); ValueError for a bad choice."""
    import torch

    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    names = {d: n for n, d in dtypes.items()}
    if user is not None:
        name = names.get(user) if isinstance(user, torch.dtype) else SSM_CACHE_DTYPES.get(user) \
            if isinstance(user, str) else None
        if name is None:
            raise ValueError(f"ssm_dtype: expected torch.float32, torch.bfloat16 or torch.float16 (or 'fp32', 'bf16', "
                             f"'fp16'), got {user!r}")
        return dtypes[name], f"{name} (chosen)"
    ckpt = getattr(model_cfg, "ssm_cache_dtype", None)
    if ckpt is not None:
        return dtypes[ckpt], f"{ckpt} (config.json mamba_ssm_cache_dtype)"
    return torch.float32, "fp32 (default)"
