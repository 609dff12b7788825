"""Read Mamba-2 checkpoints from a local directory and copy them into a model in place.

    sd = normalize_names(read_checkpoint("path/to/mamba2-130m"))
    load_into(model, sd)            # every problem reported in one ValueError, before any copy

Tensor names follow Hugging Face's ``Mamba2ForCausalLM`` (letters as in STYLE.md; V vocab rows,
M = d_model, D = H*P, E = D + 2*G*N conv channels, W conv width):

    backbone.embeddings.weight                 [V, M]
    backbone.layers.{i}.norm.weight            [M]
    backbone.layers.{i}.mixer.in_proj.weight   [D + E + H, M]   (+ .bias when use_bias)
    backbone.layers.{i}.mixer.conv1d.weight    [E, 1, W]        (+ .bias when use_conv_bias)
    backbone.layers.{i}.mixer.dt_bias          [H]
    backbone.layers.{i}.mixer.A_log            [H]
    backbone.layers.{i}.mixer.D                [H]
    backbone.layers.{i}.mixer.norm.weight      [D]
    backbone.layers.{i}.mixer.out_proj.weight  [M, D]           (+ .bias when use_bias)
    backbone.norm_f.weight                     [M]
    lm_head.weight                             [V, M]   the embeddings themselves when tied

state-spaces checkpoints (mamba_ssm's ``MambaLMHeadModel``) differ only in
``backbone.embedding.weight``; normalize_names() renames it.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from torch import nn

from fastmamba.utils.progress import Progress

__all__ = ["read_checkpoint", "normalize_names", "load_into", "check_finite", "stack_experts", "WEIGHT_FILES"]

# Looked for in this order: safetensors wins when a directory holds both formats.
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFETENSORS_FILE, SAFETENSORS_INDEX, BIN_FILE, BIN_INDEX)

# state-spaces name -> Hugging Face name; every other name is shared by the two schemes
_STATE_SPACES_RENAMES = {"backbone.embedding.weight": "backbone.embeddings.weight"}

_MAX_LISTED = 20  # per problem kind in load_into's error


# ---------------------------------------------------------------------------------------------
# reading


def read_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read every tensor of the checkpoint in directory ``path`` onto the CPU.

    path     a directory holding one of (first found wins, so safetensors beats .bin):
               model.safetensors
               model.safetensors.index.json + the shards its ``weight_map`` names
               pytorch_model.bin             (torch.load(weights_only=True): no code runs)
               pytorch_model.bin.index.json + its shards
    Returns  {name: tensor} in the checkpoint's own names and dtypes, CPU tensors, unchanged
             (pass it through normalize_names() for state-spaces checkpoints).

    Raises FileNotFoundError when the directory, every weight file, or a shard named by an index
    is missing (all missing shards are listed); NotADirectoryError when ``path`` is a file;
    ValueError naming the file for a corrupt or truncated weight file, an unreadable index, a name
    the index places in a shard that does not hold it, a name held by two shards, or a .bin that is
    not a flat {name: tensor} dict.
    A progress bar (fastmamba.utils.Progress) runs over the tensors (over shards for .bin).
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"read_checkpoint: checkpoint directory {str(root)!r} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(
            f"read_checkpoint: expected a checkpoint directory, got the file {str(root)!r}; "
            f"pass the directory that holds it ({str(root.parent)!r})"
        )
    if (root / SAFETENSORS_FILE).is_file():
        return _read_safetensors(root, [root / SAFETENSORS_FILE], None)
    if (root / SAFETENSORS_INDEX).is_file():
        shards, weight_map = _read_index(root / SAFETENSORS_INDEX)
        return _read_safetensors(root, shards, weight_map)
    if (root / BIN_FILE).is_file():
        return _read_bins(root, [root / BIN_FILE], None)
    if (root / BIN_INDEX).is_file():
        shards, weight_map = _read_index(root / BIN_INDEX)
        return _read_bins(root, shards, weight_map)
    present = sorted(p.name + ("/" if p.is_dir() else "") for p in root.iterdir())
    raise FileNotFoundError(
        f"read_checkpoint: no weights in {str(root)!r}: expected one of {', '.join(WEIGHT_FILES)}; "
        f"the directory holds: {', '.join(present) if present else '(nothing)'}"
    )


def _read_index(index: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files an index names (in first-mention order, all checked to exist) and its weight_map."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"read_checkpoint: {str(index)!r} is not valid JSON: {e}") from e
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ValueError(
            f"read_checkpoint: {str(index)!r} should hold {{'weight_map': {{tensor name: shard file}}}}, "
            f"got {type(weight_map).__name__ if isinstance(data, dict) else type(data).__name__} "
            f"for {'weight_map' if isinstance(data, dict) else 'the whole file'}"
        )
    names = list(dict.fromkeys(weight_map.values()))
    shards = [index.parent / name for name in names]
    missing = [f"{name!r} (holding e.g. {next(k for k, v in weight_map.items() if v == name)!r})"
               for name, shard in zip(names, shards) if not shard.is_file()]
    if missing:
        raise FileNotFoundError(
            f"read_checkpoint: {str(index)!r} names {len(missing)} shard(s) that do not exist in "
            f"{str(index.parent)!r}: {', '.join(missing)}"
        )
    return shards, weight_map


def _read_safetensors(root: Path, shards: list[Path], weight_map: dict[str, str] | None) -> dict[str, torch.Tensor]:
    try:
        from safetensors import safe_open
    except ImportError as e:  # a test dependency, not a core one
        raise ImportError(
            f"read_checkpoint: {str(root)!r} holds safetensors weights; reading them needs the "
            "`safetensors` package (the hf extra: pip install 'fastmamba[hf]')"
        ) from e
    keys_per_shard = []
    for shard in shards:  # headers only: learn the total for the progress bar
        try:
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                keys_per_shard.append(list(f.keys()))
        except Exception as e:  # safetensors' SafetensorError: a corrupt or truncated file
            if isinstance(e, OSError) and e.filename:  # permission denied ...: names the file already
                raise
            raise _unreadable(shard, "safetensors file", e, tool="safetensors") from e
    out: dict[str, torch.Tensor] = {}
    total = sum(len(k) for k in keys_per_shard)
    with Progress(total, f"reading {root.name}", unit="tensors") as bar:
        for shard, keys in zip(shards, keys_per_shard):
            with safe_open(str(shard), framework="pt", device="cpu") as f:
                for name in keys:
                    try:
                        t = f.get_tensor(name)
                    except Exception as e:  # e.g. a dtype torch lacks, a file changed while reading
                        if isinstance(e, OSError) and e.filename:  # permission denied ...: names the file already
                            raise
                        raise _unreadable(shard, f"safetensors file (tensor {name!r})", e, tool="safetensors") from e
                    _add(out, name, t, shard)
                    bar.update(nbytes=t.nbytes)
    _check_weight_map(out, weight_map, shards)
    return out


def _read_bins(root: Path, shards: list[Path], weight_map: dict[str, str] | None) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    with Progress(len(shards), f"reading {root.name}", unit="shards") as bar:
        for shard in shards:
            try:
                sd = torch.load(shard, map_location="cpu", weights_only=True)
            except Exception as e:  # UnpicklingError, EOFError, RuntimeError (zip archive) ...
                if isinstance(e, OSError) and e.filename:  # permission denied ...: names the file already
                    raise
                raise _unreadable(shard, "PyTorch checkpoint", e, tool="torch.load") from e
            if not isinstance(sd, Mapping):
                raise ValueError(
                    f"read_checkpoint: {str(shard)!r} should hold a {{name: tensor}} dict, got {type(sd).__name__}"
                )
            nbytes = 0
            for name, t in sd.items():
                if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                    raise ValueError(
                        f"read_checkpoint: {str(shard)!r} should hold a flat {{name: tensor}} dict, "
                        f"got {name!r}: {type(t).__name__}"
                    )
                _add(out, name, t, shard)
                nbytes += t.nbytes
            bar.update(nbytes=nbytes)
    _check_weight_map(out, weight_map, shards)
    return out


def _unreadable(file: Path, kind: str, e: Exception, *, tool: str) -> ValueError:
    """A corrupt weight file: the file, what it should be and the library's reason in one line."""
    msg = str(e)
    unpickler = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", msg, re.S)
    if unpickler:  # torch.load(weights_only=True)'s long message: keep the reason only
        reason = unpickler.group(1).split(" Please use")[0].strip()
        if "Unsupported global" in reason:
            reason = ("it holds Python objects besides tensors, which are not unpickled (no code from a "
                      f"checkpoint runs): {reason} Re-save it as a flat {{name: tensor}} dict or as safetensors")
    else:
        reason = f"{tool}: {' '.join(msg.split()) or type(e).__name__}"
        if isinstance(e, EOFError):
            reason = "the file ends early (empty or truncated)"
    if len(reason) > 300:
        reason = reason[:300] + " ..."
    return ValueError(f"read_checkpoint: {str(file)!r} is not a readable {kind}: {reason}")


def _add(out: dict[str, torch.Tensor], name: str, t: torch.Tensor, shard: Path) -> None:
    if name in out:
        raise ValueError(f"read_checkpoint: tensor {name!r} appears twice (again in {str(shard)!r})")
    out[name] = t


def _check_weight_map(out: dict[str, torch.Tensor], weight_map: dict[str, str] | None, shards: list[Path]) -> None:
    """Every name the index promises was read (from whichever shard: _add forbids duplicates)."""
    if weight_map is None:
        return
    absent = [f"{k!r} (in {v!r})" for k, v in weight_map.items() if k not in out]
    if absent:
        raise ValueError(
            f"read_checkpoint: the index in {str(shards[0].parent)!r} lists {len(absent)} tensor(s) its "
            f"shards do not hold: {_clip(absent, ', ')}"
        )


# ---------------------------------------------------------------------------------------------
# naming


def normalize_names(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename state-spaces (mamba_ssm ``MambaLMHeadModel``) tensor names to the Hugging Face ones.

    state_dict  {name: tensor} in either scheme; not modified
    Returns     a new dict, same order and same tensor objects, with ``backbone.embedding.weight``
                renamed to ``backbone.embeddings.weight``. All other names are shared by both schemes
                and kept; unknown names are kept too, so load_into() reports them as unexpected.
    Raises ValueError if a dict holds both spellings of the same tensor.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        new = _STATE_SPACES_RENAMES.get(name, name)
        if new in out or (new != name and new in state_dict):
            raise ValueError(
                f"normalize_names: the checkpoint holds both {name!r} (state-spaces) and {new!r} "
                "(Hugging Face); expected one naming scheme"
            )
        out[new] = t
    return out


def check_finite(state_dict: Mapping[str, torch.Tensor], *, where: str = "load_model") -> None:
    """ValueError naming every floating tensor that holds NaN or +-inf (at most 20, plus a count), with
    how many of its values are bad; a model built from it would put out NaN logits. One pass over
    the weights (they are in host memory here, read once more)."""
    bad = []
    for name, t in state_dict.items():
        # FP8 tensors (1 byte): torch has no isfinite for them; fastmamba.models.quantization checks their NaN bytes
        if t.is_floating_point() and t.element_size() > 1 and t.numel() and not bool(torch.isfinite(t).all()):
            n = int((~torch.isfinite(t)).sum())
            kinds = [k for k, f in (("NaN", torch.isnan), ("inf", torch.isinf)) if bool(f(t).any())]
            bad.append(f"{name}: {n} of {t.numel()} values are {' or '.join(kinds)}")
    if bad:
        raise ValueError(f"{where}: the checkpoint's weights are not all finite ({len(bad)} tensor(s); nothing "
                         f"was loaded):\n" + _clip(bad, "\n", indent="    "))


def stack_experts(state_dict: dict[str, torch.Tensor], layers: Iterable[int], n_experts: int, *,
                  prefix: str = "backbone.layers.{i}.mixer.experts.",
                  members: dict[str, list[str]] | None = None) -> dict[str, torch.Tensor]:
    """Per-expert MoE tensors stacked into the fused 3-D form the model holds.

    NVIDIA's released Nemotron-3 checkpoints store each routed expert on its own
    (``{prefix}{e}.up_proj.weight`` [F, M'], ``{prefix}{e}.down_proj.weight`` [M', F]); transformers'
    ``save_pretrained`` writes ``{prefix}up_proj`` [E, F, M'] and ``{prefix}down_proj`` [E, M', F].
    For each MoE layer i in ``layers`` whose experts come one by one, they are stacked under the
    fused names **in ``state_dict`` itself** (each layer's per-expert tensors removed as it is stacked,
    so the host holds one extra layer, not a second copy of every expert); returns ``state_dict``.
    A layer in the fused form passes through (``load_into`` checks its shape). ``members``, if given,
    gets {fused name: the per-expert names stacked into it, in expert order}.

    Raises ValueError listing every problem before anything is stacked: a layer holding both forms,
    an expert missing (e not present for some e < n_experts), an expert id >= n_experts, and a
    per-expert tensor whose shape differs from expert 0's (naming the tensor and both shapes).
    """
    out = state_dict
    problems: list[str] = []
    per_expert = re.compile(r"(\d+)\.(up_proj|down_proj)\.weight$")
    for i in layers:
        base = prefix.format(i=i)
        found: dict[str, dict[int, str]] = {"up_proj": {}, "down_proj": {}}
        for name in list(state_dict):
            if name.startswith(base):
                m = per_expert.fullmatch(name[len(base):])
                if m:
                    found[m.group(2)][int(m.group(1))] = name
        if not any(found.values()):
            continue
        for proj, by_id in found.items():
            fused = base + proj
            if fused in state_dict:
                problems.append(f"{fused}: the checkpoint holds it both fused and per expert "
                                f"({by_id[min(by_id)]!r} ...)" if by_id else f"{fused}: fused, but the other "
                                "projection comes per expert")
                continue
            missing = [base + f"{e}.{proj}.weight" for e in range(n_experts) if e not in by_id]
            extra = [by_id[e] for e in sorted(by_id) if e >= n_experts]
            problems += [f"{n}: missing (n_routed_experts={n_experts})" for n in missing]
            problems += [f"{n}: unexpected, expert id >= n_routed_experts={n_experts}" for n in extra]
            if missing or extra:
                continue
            first = state_dict[by_id[0]]
            shapes = [f"{by_id[e]}: expected {_shape(first.shape)} (as expert 0), got "
                      f"{_shape(state_dict[by_id[e]].shape)}" for e in range(n_experts)
                      if tuple(state_dict[by_id[e]].shape) != tuple(first.shape)]
            if first.dim() != 2:
                shapes.insert(0, f"{by_id[0]}: expected a 2-D matrix, got {_shape(first.shape)}")
            if shapes:
                problems += shapes
                continue
            out[fused] = torch.stack([state_dict[by_id[e]] for e in range(n_experts)])
            if members is not None:
                members[fused] = [by_id[e] for e in range(n_experts)]
            for e in range(n_experts):
                del out[by_id[e]]
    if problems:
        raise ValueError(f"load_into: the checkpoint's per-expert MoE tensors do not fit ({len(problems)} "
                         "problem(s); nothing was copied)\n" + _clip(problems, "\n", indent="    "))
    return out


# ---------------------------------------------------------------------------------------------
# loading


def load_into(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True) -> None:
    """Copy ``state_dict`` into ``model``'s parameters and persistent buffers in place.

    model       any nn.Module; its state_dict() names are the expected names. Tensors are written
                with ``target.data.copy_(src)`` under no_grad, so Parameter objects (and anything
                holding them: optimizers, CUDA graphs, tied modules) stay the same objects; each
                source is cast to its target's dtype and device.
    state_dict  {name: tensor}, e.g. normalize_names(read_checkpoint(dir)); not modified
    strict      False: missing and unexpected names are skipped silently (shape and tie
                problems still raise)

    Tied tensors: names that are one object in the model (``lm_head.weight`` is
    ``backbone.embeddings.weight`` when embeddings are tied) need only one of them in the
    checkpoint. When the checkpoint holds several, they must be equal after casting to the model's
    dtype, else the checkpoint has an untied lm_head that the model's config would silently drop.

    Raises ValueError, before anything is copied, listing every problem at once: missing names,
    unexpected names, shape mismatches (``name: expected (..), got (..)``) and tied tensors that
    differ, at most 20 of each plus a count of the rest.
    A progress bar (fastmamba.utils.Progress) runs over the tensors copied.
    """
    targets = model.state_dict(keep_vars=True)  # name -> the Parameter / buffer object itself
    # names that are one tensor object (tied weights), in model order: {id(tensor): [names]}
    groups: dict[int, list[str]] = {}
    for name, t in targets.items():
        groups.setdefault(id(t), []).append(name)

    missing: list[str] = []
    mismatched: list[str] = []
    tie_conflicts: list[str] = []
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []  # (target, source)
    for names in groups.values():
        target = targets[names[0]]
        present = [n for n in names if n in state_dict]
        if not present:
            missing.append(" = ".join(names) if len(names) > 1 else names[0])
            continue
        bad_shape = False
        for n in present:
            src = state_dict[n]
            if tuple(src.shape) != tuple(target.shape):
                mismatched.append(f"{n}: expected {_shape(target.shape)}, got {_shape(src.shape)}")
                bad_shape = True
        if bad_shape:
            continue
        first = state_dict[present[0]]
        for n in present[1:]:
            if not torch.equal(first.to(target.dtype), state_dict[n].to(device=first.device, dtype=target.dtype)):
                tie_conflicts.append(_tie_message(present[0], n))
        plan.append((target, first))
    unexpected = [n for n in state_dict if n not in targets]

    sections = [
        ("missing from the checkpoint", missing if strict else []),
        ("unexpected in the checkpoint (not in the model)", unexpected if strict else []),
        ("shape mismatches", mismatched),
        ("tied in the model but different in the checkpoint", tie_conflicts),
    ]
    count = sum(len(lines) for _, lines in sections)
    if count:
        hint = ""
        if strict and any(n in _STATE_SPACES_RENAMES for n in unexpected):
            hint = "\nhint: state-spaces names found; pass the checkpoint through normalize_names() first"
        raise ValueError(
            f"load_into: checkpoint does not fit {type(model).__name__} ({count} problem(s); nothing was copied)\n"
            + "\n".join(_section(title, lines) for title, lines in sections if lines) + hint
        )

    with torch.no_grad(), Progress(len(plan), "loading weights", unit="tensors") as bar:
        for target, src in plan:
            target.data.copy_(src)
            bar.update(nbytes=src.nbytes)


def _shape(shape: Iterable[int]) -> str:
    return str(tuple(shape))


def _tie_message(kept: str, other: str) -> str:
    pair = {kept, other}
    if pair == {"backbone.embeddings.weight", "lm_head.weight"}:
        return (
            "lm_head.weight differs from backbone.embeddings.weight: the checkpoint has its own "
            "lm_head but the config ties it to the embeddings (tie_embeddings / tie_word_embeddings); "
            "build the model untied to keep both"
        )
    return f"{other} differs from {kept}, but the model holds them as one tensor"


def _section(title: str, lines: list[str]) -> str:
    return f"  {title} ({len(lines)}):\n" + _clip(lines, "\n", indent="    ")


def _clip(items: list[str], sep: str, *, indent: str = "") -> str:
    shown = [indent + s for s in items[:_MAX_LISTED]]
    if len(items) > _MAX_LISTED:
        shown.append(f"{indent}... and {len(items) - _MAX_LISTED} more")
    return sep.join(shown)
