"""Checks of the token ids and index tensors the LMs' public methods take (issue 48), made before
the cache moves: a bad call leaves every length, page and state as it was.

Kinds are checked on every call (no device read). Values are read only where the call reads the
host anyway: the token ids' min and max ride in the same device-to-host copy as the slots or
cu_seqlens the call reads (``host_metadata``), so a checked call costs no extra synchronize, and a
call that reads nothing (host lists given, ``grow=False``, a CUDA-graph replay) reads nothing more.
Where no read happens, the embedding lookup runs before the cache grows (``embed``): on a CPU an
id outside the vocabulary then fails there, as a ValueError naming the argument; on a GPU such a
call's caller vouches for its ids (the engine checks every prompt as it enters).
"""
from __future__ import annotations

import torch
from torch import nn

INDEX_DTYPES = (torch.int32, torch.int64)


def check_index_tensor(who: str, name: str, t: object, what: str) -> None:
    """TypeError unless ``t`` is an int32 / int64 tensor (``what`` says what its values are)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{who}: `{name}` expected an int32 or int64 tensor of {what}, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{who}: `{name}` expected an int32 or int64 tensor of {what}, got dtype "
                        f"{str(t.dtype).replace('torch.', '')}")


def token_range(ids: torch.Tensor) -> torch.Tensor:
    """[2] int64 (min, max) of ``ids`` on their device; (0, 0) when there are none."""
    if ids.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=ids.device)
    lo, hi = torch.aminmax(ids.reshape(-1))
    return torch.stack([lo, hi]).long()


def check_token_range(who: str, name: str, lo: int, hi: int, vocab_size: int) -> None:
    """ValueError naming ``name`` unless min ``lo`` and max ``hi`` of the ids lie in [0, vocab_size)."""
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{who}: `{name}` values must lie in [0, vocab_size={vocab_size}) (token ids); "
                         f"got {lo if lo < 0 else hi}")


def host_metadata(who: str, ids_name: str, ids: torch.Tensor, vocab_size: int,
                  tensors: list[torch.Tensor]) -> list[list[int]]:
    """The values of ``tensors`` (1-D index tensors) as host lists, read in ONE device-to-host copy
    together with the min / max of ``ids``, which are checked against the vocabulary."""
    dev = ids.device
    parts = [t.to(dev).long().reshape(-1) for t in tensors] + [token_range(ids)]
    values = torch.cat(parts).tolist()
    out, o = [], 0
    for t in tensors:
        out.append(values[o:o + t.numel()])
        o += t.numel()
    check_token_range(who, ids_name, values[-2], values[-1], vocab_size)
    return out


def embed(embeddings: nn.Embedding, ids: torch.Tensor, who: str, name: str) -> torch.Tensor:
    """``embeddings(ids)``, an id outside the table (raised by PyTorch on a CPU) as a ValueError
    naming ``name``."""
    try:
        return embeddings(ids)
    except IndexError as e:
        vocab = getattr(embeddings, "num_embeddings", None)  # (a tensor-parallel table may not say)
        raise ValueError(f"{who}: `{name}` values must lie in [0, vocab_size={vocab}) (token ids)") from e


def check_rand_seed(rand_seed: torch.Tensor | None, n_layer: int, device: torch.device, who: str) -> None:
    """ValueError / TypeError unless ``rand_seed`` is None or an int64 tensor of n_layer elements on ``device``."""
    if rand_seed is None:
        return
    if not isinstance(rand_seed, torch.Tensor):
        raise TypeError(f"{who}: `rand_seed` expected an int64 tensor of shape ({n_layer},) (one seed per layer, "
                        f"fastmamba.generation.rounding.StochasticRounding.seeds) or None, got {type(rand_seed).__name__}")
    if rand_seed.dtype != torch.int64 or tuple(rand_seed.shape) != (n_layer,):
        raise ValueError(f"{who}: `rand_seed` expected an int64 tensor of shape ({n_layer},) (one seed per layer), "
                         f"got {rand_seed.dtype} of shape {tuple(rand_seed.shape)}")
    if rand_seed.device != device:
        raise ValueError(f"{who}: `rand_seed` is on {rand_seed.device}, the model on {device}")
