"""Capacity planning: how many requests (Mamba slots) and K/V pages fit beside the weights.

A hybrid model holds per request one Mamba slot (every Mamba layer's conv and SSM state, plus the
speculative buffers when ``speculate=K``: one slot per request whatever K is) and, for its
attention layers, pages of K/V that grow with its length. The planner sizes both from the memory
left after the weights, before any weight reaches the GPU:

    budget      = gpu_memory_utilization * device memory - weights - reserve - other
    max_batch   = the user's, or the most requests that fit at ``max_seq_len`` each (at most 256)
    kv pages    = what is left after ``max_batch`` slots, up to every request at ``max_seq_len``

and refuses a ``max_batch`` whose slots alone (plus one request's pages at ``max_seq_len``) do not
fit, naming the numbers. Pages are shared, so a pool smaller than ``max_batch`` full-length requests
makes requests wait for pages (the engine's admission), never run out of memory mid-run.

Bytes are counted, not modelled: the model is built on the ``meta`` device (no memory) and its
``new_cache`` allocates on ``meta`` too, so the plan follows whatever the caches really hold.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

import torch
from torch import nn

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_MAX_BATCH = 256
DEVICE_MEMORY_ENV = "FASTMAMBA_DEVICE_MEMORY_GIB"  # plan against this many GiB instead of the device's


class CapacityError(ValueError):
    """The requested configuration cannot fit; the message names the numbers."""


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """What fits on the device.

    device_bytes   the device's memory;  utilization  the fraction the engine may use
    weight_bytes   parameters and buffers of the model (each shared tensor once)
    reserve_bytes  activations, logits, CUDA graphs (an estimate, see ``reserve_estimate``)
    other_bytes    what the caller holds beside the caches (a prefix cache's budget)
    slot_bytes     one request's Mamba states (and speculative buffers)
    page_bytes     one K/V page across all attention layers (0 without attention)
    max_batch      requests held at once;  kv_pages  pages in the pool (0 without attention)
    max_seq_len    tokens one request may reach;  page_size  tokens per page
    """

    device_bytes: int
    utilization: float
    weight_bytes: int
    reserve_bytes: int
    slot_bytes: int
    page_bytes: int
    max_batch: int
    kv_pages: int
    max_seq_len: int
    page_size: int
    other_bytes: int = 0

    @property
    def budget_bytes(self) -> int:
        return int(self.utilization * self.device_bytes) - self.weight_bytes - self.reserve_bytes - self.other_bytes

    @property
    def cache_bytes(self) -> int:
        return self.max_batch * self.slot_bytes + self.kv_pages * self.page_bytes

    @property
    def full_length_requests(self) -> int:
        """Requests the K/V pool holds at ``max_seq_len`` each (max_batch without attention)."""
        if not self.page_bytes:
            return self.max_batch
        return min(self.max_batch, self.kv_pages // pages_for(self.max_seq_len, self.page_size))

    def summary(self) -> str:
        kv = (f", {self.kv_pages} K/V pages of {self.page_size} tokens ({self.kv_pages * self.page_bytes / GiB:.2f} GiB; "
              f"{self.full_length_requests} requests at {self.max_seq_len} tokens)" if self.page_bytes else "")
        other = f", prefix cache {self.other_bytes / GiB:.2f} GiB" if self.other_bytes else ""
        return (f"capacity: {self.max_batch} slots x {self.slot_bytes / MiB:.1f} MiB "
                f"({self.max_batch * self.slot_bytes / GiB:.2f} GiB){kv}; weights {self.weight_bytes / GiB:.2f} GiB, "
                f"reserve {self.reserve_bytes / GiB:.2f} GiB{other}, device {self.device_bytes / GiB:.1f} GiB x {self.utilization:g}")


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def tensor_bytes(obj, *, _seen: set[int] | None = None) -> int:
    """Bytes of every base tensor reachable from ``obj`` (attributes, lists, tuples, dicts); a view
    counts through its base, so ``cache.conv[j]`` over ``conv_stack`` is counted once."""
    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        base = obj if obj._base is None else obj._base
        if base is not obj:
            return tensor_bytes(base, _seen=seen)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(tensor_bytes(v, _seen=seen) for v in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, _seen=seen) for v in obj.values())
    if isinstance(obj, (str, bytes, int, float, bool, type(None), torch.device, torch.dtype)):
        return 0
    attrs = getattr(obj, "__dict__", None)
    return sum(tensor_bytes(v, _seen=seen) for v in attrs.values()) if attrs else 0


def weight_bytes(model: nn.Module) -> int:
    """Parameters and buffers of ``model``, each shared tensor (tied embeddings) once. Views of one
    storage at other offsets (attention's Q/K/V weights, aliased in one buffer) each count."""
    seen: set[tuple] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (id(t),) if t.device.type == "meta" else (t.data_ptr(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def _cache_builder(model: nn.Module, *, ssm_dtype: torch.dtype, speculate: int, page_size: int,
                   max_seq_len: int) -> tuple[Callable[[int, int], object], bool]:
    """new_cache(slots, pages) for either cache form, and whether the model has attention pages."""
    if not model.cfg.paged_cache:  # a Mamba-only cache: slots only
        return (lambda b, p: model.new_cache(b, ssm_dtype=ssm_dtype, speculate=speculate)), False
    has_kv = "*" in model.cfg.pattern
    return (lambda b, p: model.new_cache(b, max_seq_len=max_seq_len, page_size=page_size, num_pages=p,
                                         ssm_dtype=ssm_dtype, speculate=speculate)), has_kv


def per_request_bytes(model: nn.Module, *, ssm_dtype: torch.dtype = torch.float32, speculate: int = 0,
                      page_size: int = 16, max_seq_len: int = 4096) -> tuple[int, int]:
    """(slot_bytes, page_bytes) of ``model``'s cache, counted on a meta-device model's caches.

    ``model`` must live on the meta device (``build_on_meta``): nothing is allocated."""
    build, has_kv = _cache_builder(model, ssm_dtype=ssm_dtype, speculate=speculate, page_size=page_size,
                                   max_seq_len=max_seq_len)
    one = tensor_bytes(build(1, 1))
    slot = tensor_bytes(build(2, 1)) - one
    page = tensor_bytes(build(1, 2)) - one if has_kv else 0
    return slot, page


def mtp_drafter_bytes(model: nn.Module, *, max_seq_len: int, speculate: int, page_size: int = 16) -> int:
    """One request's share of an MTP drafter's own K/V (``MTPDrafter`` holds every request's pages at
    ``max_seq_len + K`` tokens for its attention layer); 0 for a model without an MTP layer."""
    mtp = getattr(model, "mtp", None)
    if mtp is None:
        return 0
    from fastmamba.cache.kv_pages import KVPages

    cfg = model.cfg
    page = KVPages.page_bytes(max(1, mtp.n_attn_layers), page_size, cfg.n_kv_heads, cfg.head_dim,
                              model.lm_head.weight.dtype)
    per_row = pages_for(max_seq_len + speculate, page_size)
    return per_row * page + 4 * (per_row + 1)  # its pages, its int32 block-table row and length


def reserve_estimate(model: nn.Module, *, max_batch: int, prefill_tokens: int = 2048, speculate: int = 0) -> int:
    """Memory kept free for what is not weights or caches: the widest layer's activations for a
    prefill chunk (x8 for the in/out projections' and the scan's intermediates), the logits and
    sampling buffers of a decode / verify step, and 1 GiB for CUDA graphs, the allocator and the
    CUDA context's growth. An estimate that errs on the safe side."""
    vocab = getattr(model.cfg, "vocab_size", 0)
    # the LM head's [tokens, vocab] output exists only for the last token of each request: the logits term
    widest = max((m.weight.shape[0] for m in model.modules()
                  if isinstance(m, nn.Linear) and m.weight.shape[0] != vocab), default=0)
    elt = next(model.parameters()).element_size()
    activations = 8 * prefill_tokens * widest * elt
    logits = 4 * max_batch * (speculate + 1) * vocab * 4
    return GiB + activations + logits


def plan_capacity(model: nn.Module, *, device_bytes: int, gpu_memory_utilization: float = 0.9,
                  max_batch: int | None = None, max_seq_len: int = 4096, page_size: int = 16,
                  ssm_dtype: torch.dtype = torch.float32, speculate: int = 0, prefill_tokens: int = 2048,
                  reserve_bytes: int | None = None, other_bytes: int = 0, drafter: str | None = None) -> CapacityPlan:
    """Size the slots and K/V pages of ``model`` (built on the meta device) for a device of
    ``device_bytes``; raises CapacityError naming the numbers when ``max_batch`` cannot fit.
    ``other_bytes``: memory the caller holds beside weights and caches (a prefix cache's budget).
    ``drafter="mtp"``: each slot also holds its share of the MTP drafter's K/V (``mtp_drafter_bytes``)."""
    check_utilization(gpu_memory_utilization)
    if max_batch is not None and not (isinstance(max_batch, int) and not isinstance(max_batch, bool) and max_batch >= 1):
        raise CapacityError(f"max_batch: expected a positive integer, got {max_batch!r}")
    if not (isinstance(max_seq_len, int) and max_seq_len >= 1):
        raise CapacityError(f"max_seq_len: expected a positive integer, got {max_seq_len!r}")
    weights = weight_bytes(model)
    slot, page = per_request_bytes(model, ssm_dtype=ssm_dtype, speculate=speculate, page_size=page_size,
                                   max_seq_len=max_seq_len)
    if drafter == "mtp":
        slot += mtp_drafter_bytes(model, max_seq_len=max_seq_len, speculate=speculate, page_size=page_size)
    reserve = reserve_bytes if reserve_bytes is not None else reserve_estimate(
        model, max_batch=max_batch or DEFAULT_MAX_BATCH, prefill_tokens=prefill_tokens, speculate=speculate)
    if not (isinstance(other_bytes, int) and other_bytes >= 0):
        raise CapacityError(f"other_bytes: expected an int >= 0, got {other_bytes!r}")
    budget = int(gpu_memory_utilization * device_bytes) - weights - reserve - other_bytes
    full = pages_for(max_seq_len, page_size) * page  # one request's K/V at max_seq_len
    where = (f"{device_bytes / GiB:.1f} GiB x {gpu_memory_utilization:g} - {weights / GiB:.2f} GiB of weights "
             f"- {reserve / GiB:.2f} GiB reserve" + (f" - {other_bytes / GiB:.2f} GiB prefix cache" if other_bytes else ""))
    if budget < slot + full:
        raise CapacityError(f"the model does not fit: {budget / GiB:.2f} GiB are left for caches ({where}), one "
                            f"request needs {(slot + full) / GiB:.3f} GiB at max_seq_len {max_seq_len}; "
                            f"raise gpu_memory_utilization, lower max_seq_len, or use a GPU with more memory")
    most = (budget - full) // slot  # slots alone, with one full-length request's pages
    if max_batch is None:
        max_batch = int(min(DEFAULT_MAX_BATCH, budget // (slot + full)))
    elif max_batch > most:
        raise CapacityError(
            f"max_batch={max_batch} does not fit: {max_batch} slots x {slot / MiB:.1f} MiB of Mamba state "
            f"= {max_batch * slot / GiB:.2f} GiB plus {full / GiB:.3f} GiB of K/V for one request at "
            f"{max_seq_len} tokens, but {budget / GiB:.2f} GiB are left ({where}); the most that fits is {most}")
    pages = 0
    if page:
        pages = int(min((budget - max_batch * slot) // page, max_batch * pages_for(max_seq_len, page_size)))
    return CapacityPlan(device_bytes=device_bytes, utilization=float(gpu_memory_utilization), weight_bytes=weights,
                        reserve_bytes=reserve, slot_bytes=slot, page_bytes=page, max_batch=max_batch, kv_pages=pages,
                        max_seq_len=max_seq_len, page_size=page_size, other_bytes=other_bytes)


def meta_twin(model: nn.Module) -> nn.Module:
    """A copy of a loaded model's structure on the meta device (no memory, no weights), with its
    K/V page dtype (float8 pages: half the bytes a page costs)."""
    from fastmamba.layers.attention import Attention, kv_cache_dtype_of

    twin = type(model)(model.cfg, device="meta", dtype=model.dtype)
    kv = kv_cache_dtype_of(model)
    for m in twin.modules():
        if isinstance(m, Attention):
            m.kv_dtype = kv
    return twin


def meta_model(path_or_preset: str, dtype: torch.dtype | str | None = None, *,
               quantization: str | None = None) -> nn.Module:
    """The model a checkpoint directory or preset describes, built on the meta device from its
    ``config.json`` alone (no weight is read): what ``plan_capacity`` needs before loading.
    dtype: default the config's ``torch_dtype`` / ``dtype``, else bfloat16. An FP8 checkpoint (its
    quantisation config) or ``quantization="fp8"`` gives the FP8 modules it will hold
    (``fastmamba.models.quantization.fp8_twin``); an unsupported scheme raises here, before loading."""
    import os

    from fastmamba.models import NEMOTRON_H_PRESETS, PRESETS, Mamba2Config, Mamba2LM, NemotronHConfig, NemotronHLM
    from fastmamba.models.checkpoint_config import _read_json
    from fastmamba.models.loader import parse_dtype
    from fastmamba.models.quant_config import check_quantization_arg, on_load_config, read_quant_config
    from fastmamba.models.quantization import fp8_twin

    dtype = parse_dtype(dtype, where="meta_model")
    on_load = on_load_config() if check_quantization_arg(quantization, "meta_model") else None
    key = os.fspath(path_or_preset)
    if key in PRESETS or key in NEMOTRON_H_PRESETS:
        lm, presets = (Mamba2LM, PRESETS) if key in PRESETS else (NemotronHLM, NEMOTRON_H_PRESETS)
        model = lm(presets[key], device="meta", dtype=dtype or torch.bfloat16)
        return fp8_twin(model, on_load) if on_load else model
    config_path = os.path.join(key, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"meta_model: {key!r} is neither a preset nor a directory with config.json")
    raw = _read_json(config_path)  # ValueError naming the file when it is not valid JSON
    dtype = dtype or _config_dtype(raw, config_path)
    if raw.get("model_type") == "nemotron_h":
        model = NemotronHLM(NemotronHConfig.from_dir(key), device="meta", dtype=dtype)
    else:
        model = Mamba2LM(Mamba2Config.from_dir(key), device="meta", dtype=dtype)
    fp8 = read_quant_config(key, raw) or on_load
    return fp8_twin(model, fp8) if fp8 else model


def _config_dtype(raw: dict, config_path: str) -> torch.dtype:
    """The weights' dtype a config.json (``raw``, read from ``config_path``) names as ``torch_dtype`` /
    ``dtype``, else bfloat16."""
    from fastmamba.models.loader import parse_dtype

    named = raw.get("torch_dtype") or raw.get("dtype")
    return (parse_dtype(named, where=f"{config_path}: torch_dtype") if isinstance(named, str) else None) \
        or torch.bfloat16


def default_dtype(path_or_preset: str) -> torch.dtype:
    """The dtype ``meta_model`` builds ``path_or_preset`` in when none is given: a preset's bfloat16, a
    checkpoint directory's config.json ``torch_dtype`` (else bfloat16). Reads config.json only."""
    from fastmamba.models import NEMOTRON_H_PRESETS, PRESETS
    from fastmamba.models.checkpoint_config import _read_json

    key = os.fspath(path_or_preset)
    config_path = os.path.join(key, "config.json")
    if key in PRESETS or key in NEMOTRON_H_PRESETS or not os.path.isfile(config_path):
        return torch.bfloat16
    return _config_dtype(_read_json(config_path), config_path)


def device_memory_bytes(device: torch.device | str | None = None) -> int | None:
    """The memory a plan is made against: ``FASTMAMBA_DEVICE_MEMORY_GIB`` when set (tests, and
    planning for a card other than this one), else a CUDA device's total memory, else None (a CPU:
    nothing to plan). ValueError for an override that is not a positive number of GiB."""
    override = os.environ.get(DEVICE_MEMORY_ENV)
    if override not in (None, ""):
        try:
            gib = float(override)
        except ValueError:
            gib = math.nan
        if not (math.isfinite(gib) and gib > 0):
            raise ValueError(f"{DEVICE_MEMORY_ENV}: expected a positive number of GiB, got {override!r}")
        return int(gib * GiB)
    device = torch.device(device) if device is not None else None
    if device is not None and device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    return None


def check_utilization(gpu_memory_utilization) -> None:
    """A fraction of the device's memory in (0, 1]; anything else is a CapacityError naming it."""
    if not (isinstance(gpu_memory_utilization, float | int) and 0 < gpu_memory_utilization <= 1):
        raise CapacityError(f"gpu_memory_utilization: expected a number in (0, 1], got {gpu_memory_utilization!r}")


def engine_plan(model: nn.Module, *, gpu_memory_utilization: float, max_batch: int, max_seq_len: int | None,
                page_size: int | None, ssm_dtype: torch.dtype, speculate: int, prefill_tokens: int | None,
                other_bytes: int = 0, drafter: str | None = None) -> CapacityPlan:
    """``Engine(gpu_memory_utilization=F)``'s plan for a loaded ``model`` (its meta twin is planned):
    against its CUDA device's total memory, or ``FASTMAMBA_DEVICE_MEMORY_GIB``; a CPU model without
    the override is a ValueError (there is no device memory to divide)."""
    check_utilization(gpu_memory_utilization)  # a bad value is named first, whatever the device
    device = next(model.parameters()).device
    total = device_memory_bytes(device)
    if total is None:
        raise ValueError(f"Engine: gpu_memory_utilization plans against a CUDA device's memory; the model is on "
                         f"{device} (set {DEVICE_MEMORY_ENV} to plan for a given size, or pass None)")
    return plan_capacity(meta_twin(model), device_bytes=total, gpu_memory_utilization=gpu_memory_utilization,
                         max_batch=max_batch, max_seq_len=max_seq_len or 4096, page_size=page_size or 16,
                         ssm_dtype=ssm_dtype, speculate=speculate, prefill_tokens=prefill_tokens or 2048,
                         other_bytes=other_bytes, drafter=drafter)
