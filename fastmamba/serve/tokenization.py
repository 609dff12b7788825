"""The server's text <-> token ids: ``Codec`` lives in ``fastmamba.generation.tokenizer`` (one
tokenizer module for the CLI, ``LLM`` and the server); re-exported here for the server's imports."""
from fastmamba.generation.tokenizer import Codec, IncrementalDecoder, load_tokenizer, normalize_messages

__all__ = ["Codec", "IncrementalDecoder", "load_tokenizer", "normalize_messages"]
