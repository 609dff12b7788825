"""CUDA graphs of transformers' one-token decode step, for models under fastmamba's provider.

transformers' ``generate`` runs every decode step as Python: a 64-layer Mamba-2 launches some
twenty kernels per layer from the host, so at batch 1 the step is bound by the host, with or without
fastmamba's kernels. From transformers 5.25 a Mamba layer's decode step touches its cache only
through tensors (the conv and recurrent states are written in place, the token count is a tensor
``add_``), so the step can be captured once and replayed.

The decoder blocks are cut into **runs**: maximal stretches of consecutive blocks whose decode step
is graph-safe (Mamba-2 blocks; Nemotron-H's Mamba, MLP and MoE blocks when fastmamba runs the
experts). Attention blocks stay eager between runs (transformers' default cache grows their K/V
with ``torch.cat``). The first block of a run replays the run's graph and returns the run's output;
the other blocks of the run see that very tensor come in and pass it on.

A model whose blocks sit on several devices (``device_map``) or carry accelerate's offload hooks
gets no runs. A block call is replayed only when all of these hold (otherwise every block runs as
transformers wrote it):
  * one token per sequence (``hidden_states [B, 1, D]``) on the run's CUDA device, eval mode,
    gradients off, no graph capture already under way on the stream, no hidden states / attentions
    being collected;
  * a transformers 5.25+ cache whose Mamba layers of the run hold a previous state and do not
    record past states (assisted decoding);
  * every other argument a tensor (copied into the graph's input buffers each step) or a plain
    value (None, bool, int, float, str: part of the graph's key).
A graph's key also holds the addresses of the run's cache tensors, so a new cache (the next
``generate``) captures anew (the first step of a shape ever seen runs eagerly, to compile and tune
the kernels before capture); at most ``max_graphs`` graphs are kept per run, the oldest dropped. A
cache whose tensors keep moving (beam search reorders them each step) runs eagerly after
``MAX_CAPTURES_PER_CACHE`` captures.
"""
from __future__ import annotations

import collections
import threading
import weakref
from dataclasses import dataclass, field

import torch

from fastmamba.ops.runtime import graph_capture

_PLAIN = (type(None), bool, int, float, str)
_CACHE_KEYS = ("cache", "cache_params", "past_key_values")
_BLOCKS = ("Mamba2Block", "NemotronHBlock")
MAX_CAPTURES_PER_CACHE = 2


@dataclass
class Stats:
    """Counts since ``use``: graphs captured, steps replayed, steps run eagerly (by why)."""

    captures: int = 0
    replays: int = 0
    eager: collections.Counter = field(default_factory=collections.Counter)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # the run's input buffer
    tensors: dict[str, torch.Tensor]  # the other tensor arguments' buffers
    out: torch.Tensor  # the run's output, written by each replay


class Run:
    """One run of consecutive graph-safe blocks (``blocks``: transformers' decoder blocks, in order)
    and its graphs."""

    def __init__(self, owner: "DecodeGraphs", blocks: list[torch.nn.Module]):
        self.owner, self.blocks = owner, blocks
        # the cache layers the run's blocks read (Mamba layers): their index in the cache
        self.cache_layers = [b.layer_idx for b in blocks if _is_mamba(b)]
        self.graphs: collections.OrderedDict[tuple, _Graph] = collections.OrderedDict()
        # the run's output of this step, passed on by the other blocks (per thread: a model may serve two)
        self._local = threading.local()
        self._weight = next(blocks[0].parameters())  # its device is the run's (read per call: the model may move)
        self.warm: set = set()  # call shapes this run has run eagerly once (kernels compiled and tuned)
        # captures per cache object: a cache whose tensors move between steps (beam search reorders them
        # with index_select) would be captured again every step, slower than running it; after
        # MAX_CAPTURES_PER_CACHE captures such a cache runs eagerly
        self.captures_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def head(self, block, hidden_states, *args, **kwargs):
        """The run's first block: the whole run, replayed from a graph where the call allows."""
        self._local.passing = None
        why, key, cache = self._check(hidden_states, args, kwargs)
        if why is not None:
            self.owner.stats.eager[why] += 1
            return type(block).forward(block, hidden_states, *args, **kwargs)
        out = self._replay(key, hidden_states, kwargs, cache)
        self._local.passing = out
        return out

    def tail(self, block, hidden_states, *args, **kwargs):
        """A later block of the run: passes the run's output on when the head replayed the run."""
        passing = getattr(self._local, "passing", None)
        if passing is not None and hidden_states is passing:
            return hidden_states
        return type(block).forward(block, hidden_states, *args, **kwargs)

    # --- which calls replay ---

    def _check(self, x: torch.Tensor, args: tuple, kwargs: dict):
        """(None, key, cache) when the call can replay, else (reason, None, None)."""
        if args:
            return "positional arguments", None, None
        if x.dim() != 3 or x.shape[1] != 1:
            return "not one token", None, None
        if (x.device.type != "cuda" or torch.is_grad_enabled() or torch.cuda.is_current_stream_capturing()
                or self.blocks[0].training):
            return "not a CUDA inference step", None, None
        if x.device != self._weight.device:
            return "input on another device than the run's weights", None, None
        if _collecting_outputs():
            return "collecting outputs", None, None
        cache = next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), None)
        ptrs = _state_pointers(cache, self.cache_layers)
        if ptrs is None:
            return "cache", None, None
        spec = []
        for name, value in sorted(kwargs.items()):
            if value is cache:
                spec.append((name, "cache"))
            elif isinstance(value, torch.Tensor):
                spec.append((name, tuple(value.shape), tuple(value.stride()), value.dtype, value.device))
            elif isinstance(value, _PLAIN):
                spec.append((name, value))
            else:
                return f"argument {name}", None, None
        shape = (tuple(x.shape), tuple(x.stride()), x.dtype, x.device, tuple(spec))
        return None, (shape, id(cache), ptrs), cache

    # --- capture and replay ---

    def _eager(self, hidden, kwargs):
        for b in self.blocks:
            hidden = type(b).forward(b, hidden, **kwargs)
        return hidden

    def _replay(self, key, x: torch.Tensor, kwargs: dict, cache) -> torch.Tensor:
        g = self.graphs.get(key)
        if g is None:
            shape = key[0]
            if shape not in self.warm:  # first sight of this shape: compile and tune the kernels eagerly
                self.warm.add(shape)
                self.owner.stats.eager["warm-up"] += 1
                return self._eager(x, kwargs)
            if not self._may_capture(cache):
                self.owner.stats.eager["cache tensors move"] += 1
                return self._eager(x, kwargs)
            g = self._capture(x, kwargs)
            self.graphs[key] = g
            while len(self.graphs) > self.owner.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        g.hidden.copy_(x)
        for name, buf in g.tensors.items():
            buf.copy_(kwargs[name])
        g.graph.replay()
        self.owner.stats.replays += 1
        return g.out.clone()

    def _may_capture(self, cache) -> bool:
        """Whether ``cache`` may be captured once more (counts the capture)."""
        try:
            n = self.captures_of.get(cache, 0)
            if n >= MAX_CAPTURES_PER_CACHE:
                return False
            self.captures_of[cache] = n + 1
        except TypeError:  # a cache object without weak references or hashing: no limit kept
            pass
        return True

    def _capture(self, x: torch.Tensor, kwargs: dict) -> _Graph:
        hidden = _buffer_of(x)
        tensors = {name: _buffer_of(v) for name, v in kwargs.items() if isinstance(v, torch.Tensor)}
        call = {**kwargs, **tensors}
        graph = torch.cuda.CUDAGraph()
        if self.owner.pool is None:
            self.owner.pool = torch.cuda.graph_pool_handle()
        torch.cuda.synchronize(x.device)
        with graph_capture(graph, pool=self.owner.pool):  # records only: the step runs at the replay
            out = self._eager(hidden, call)
        self.owner.stats.captures += 1
        return _Graph(graph, hidden, tensors, out)


class DecodeGraphs:
    """The runs of one model (``model``: transformers' Mamba2 / NemotronH model or causal LM) and
    what they share: the graphs' memory pool and the counts."""

    def __init__(self, model: torch.nn.Module, moe_graph_safe: bool, max_graphs: int = 8):
        self.max_graphs = max_graphs
        self.pool = None
        self.stats = Stats()
        self.runs: list[Run] = []
        for blocks in _layer_lists(model):
            run: list[torch.nn.Module] = []
            devices = {p.device for p in blocks.parameters()}
            for b in list(blocks) + [None]:
                if b is not None and len(devices) == 1 and _graph_safe(b, moe_graph_safe):
                    run.append(b)
                    continue
                if run:
                    self.runs.append(Run(self, run))
                run = []

    def install(self, set_forward) -> None:
        """Route each run's blocks through it: ``set_forward(module, fn)`` sets an instance forward
        (the provider's, which records what to restore)."""
        for run in self.runs:
            set_forward(run.blocks[0], run.head)  # bound to the block: run.head(block, hidden_states, ...)
            for b in run.blocks[1:]:
                set_forward(b, run.tail)


def _buffer_of(t: torch.Tensor) -> torch.Tensor:
    """A graph's input buffer: a copy of ``t`` with its shape, strides, dtype and device, allocated
    outside the graph's pool (the caller copies each step's value into it)."""
    buf = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return buf.copy_(t)


def _layer_lists(model: torch.nn.Module):
    """The ModuleLists of transformers' decoder blocks inside ``model``."""
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) and all(type(b).__name__ in _BLOCKS for b in m):
            yield m


def _is_mamba(block) -> bool:
    return type(block).__name__ == "Mamba2Block" or getattr(block, "block_type", None) in ("linear_attention", "mamba")


def _graph_safe(block, moe_graph_safe: bool) -> bool:
    if any(hasattr(m, "_hf_hook") for m in block.modules()):  # accelerate's offload hooks move weights per call
        return False
    kind = getattr(block, "block_type", None)
    if _is_mamba(block) or kind == "mlp":
        return True
    return kind == "moe" and moe_graph_safe  # transformers' own experts loop reads the routing on the host


def _state_pointers(cache, layer_ids: list[int]) -> tuple | None:
    """The addresses of the cache tensors the run's Mamba layers read and write (conv and recurrent
    states, the token count), or None where the cache is not a 5.25+ cache in a decode state."""
    layers = getattr(cache, "layers", None)
    if layers is None or not callable(getattr(cache, "is_recording_past", None)):
        return None
    ptrs = []
    try:
        for i in layer_ids:
            layer = layers[i]
            if getattr(layer, "record_past", True) or not all(layer.has_previous_state.values()):
                return None
            for states in (layer.conv_states, layer.recurrent_states):
                for t in states.values():
                    if t is not None:
                        ptrs.append(t.data_ptr())
            ptrs.append(layer.cumulative_length_linear.data_ptr())
    except (AttributeError, IndexError, TypeError):
        return None
    return tuple(ptrs)


def _collecting_outputs() -> bool:
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # no collector in this release: outputs are not collected through hooks
        return False
    return bool(_active_collector.get())
