"""MoE of the Nemotron-3 hybrids: the router's selection (``moe_route``) and the routed relu²
experts (``fused_moe``: routing alignment, up_proj + relu², down_proj + routing weight, k-sum).

    python -m fastmamba.bench kernels --ops moe [--batch 1,2,4,...]   (tokens; default below)

Shapes (bf16 experts, fp32 router): Nemotron-3 Nano (M=2688, F=1856, E=128, k=6) and Super's
latent MoE (M=1024, F=2688, E=512, k=22); tokens 1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096.
``nemotron-3-nano+shared`` is Nano's decode call as its layer makes it at 1, 2 and 4 tokens
(``fused_moe_gemv``: the 3712-wide shared expert read in place as S=2 more pairs of weight 1.0
beside the 6 routed ones, the k-sum in the down kernel): its GEMV grids are 8/6 of the routed-only
op's, so its launch configs have their own table key (``tune`` sweeps them; ``--cases nano``
takes both shapes). Peers run it as fused_moe over the E+S experts (the slices appended, top-k+S).
Each case routes its tokens once, on the host, with the reference router (seeded logits, a small
selection bias, scaling 2.5), so every provider and every input set runs the same routing and the
byte model knows how many distinct experts it touches. Input sets rotate x and both expert weight
tensors (cold L2); each set holds every expert.

Rows per case:
- ``moe_route``: fastmamba (one Triton program per token) vs the reference (torch ops: sigmoid,
  topk, gather; what transformers' router runs).
- ``fused_moe``: fastmamba (its config's path), fastmamba+pdl (with programmatic dependent launch, as
  in the runtime's decode graphs; GEMV-path T only), fastmamba-gemv (the GEMV path forced, T <= 64),
  torch-grouped_mm (transformers' ``grouped_mm`` experts path: sort by expert, gather, histc
  offsets, two grouped GEMMs, weights, index_add), vLLM (its Triton ``fused_moe_kernel`` for both
  GEMMs with its own tuned table when one exists for (E, N=F, GPU), else its default-config rules;
  see below), and the reference (a host loop over experts; the check's oracle, timed only on the CPU).

vLLM: its kernel file is staged from the wheel (the kernels only; nothing else of vLLM runs;
``scripts/fetch_vllm_peer.sh`` does these steps):
    python -m pip download --no-deps vllm==0.33.0 -d /tmp/vllm_whl
    unzip -q /tmp/vllm_whl/vllm-*.whl 'vllm/model_executor/layers/fused_moe/fused_moe.py' \\
        'vllm/model_executor/layers/fused_moe/configs/*' -d /tmp/vx
    mkdir -p peers/vllm_fused_moe && cp -r /tmp/vx/vllm/model_executor/layers/fused_moe/{fused_moe.py,configs} peers/vllm_fused_moe/
(``$FASTMAMBA_VLLM_FUSED_MOE`` names another folder). The ``@triton.jit`` functions of fused_moe.py
are extracted into a module of their own (its other imports need vLLM's compiled extension) and
``fused_moe_kernel`` is called by parameter name. vLLM's alignment (``moe_align_block_size``) is a
compiled CUDA op: it is replaced by fastmamba's one-launch alignment plus one kernel that writes
vLLM's layout (the pairs at their rows, the sentinel T*k in pad rows, an expert id per block, the
padded row count); relu² between the GEMMs is two in-place torch ops, the k-sum ``torch.sum`` (as vLLM's
``moe_sum``). The rows' note says which vLLM config ran.

Bytes: ``bytes.moe_bytes`` (the distinct experts the routing touched, x, out, routing) and
``bytes.moe_route_bytes``; FLOPs: ``bytes.moe_flops`` (4*T*k*M*F).

Without a GPU: M=48, F=40, E=8, k=2, fp32 (the interpreter's 16-bit tl.dot is wrong in Triton 3.6),
tokens 1 and 5, through the Triton interpreter (TRITON_INTERPRET=1).
"""
from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from fastmamba.bench import bytes as byte_models
from fastmamba.bench import peers
from fastmamba.bench.ops._base import (
    BF16_TOL,
    DTYPE_NAMES,
    Case,
    OpBench,
    Provider,
    _compare,
    _fastmamba_version,
    describe,
    fastmamba_pdl_provider,
)
from fastmamba.bench.timing import TimingConfig
from fastmamba.ops.moe.align_kernel import launch_align
from fastmamba.ops.moe.kernel_common import AlignLayout, _padded_starts, grouped_rows

# name -> (M, F, E, k)
GPU_SHAPES = {
    "nemotron-3-nano": (2688, 1856, 128, 6),
    "nemotron-3-super-latent": (1024, 2688, 512, 22),
}
CPU_SHAPES = {"tiny": (48, 40, 8, 2)}
# the decode call of a layer whose shared expert runs in the routed GEMVs (``fastmamba.layers.moe``'s
# ``shared_fused``): shape -> (M, F, E, k, S); only its GEMV-path token counts (T <= GEMV_MAX_TOKENS)
GPU_SHARED_SHAPES = {"nemotron-3-nano+shared": (2688, 1856, 128, 6, 2)}
CPU_SHARED_SHAPES = {"tiny+shared": (48, 40, 8, 2, 2)}
GPU_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
CPU_TOKENS = (1, 5)
GEMV_ROWS_MAX_T = 64  # the forced-GEMV provider runs up to this many tokens
ROUTE_SCALE = 2.5  # Nano's routed_scaling_factor
FP32_TOL = {"atol": 1e-4, "rtol": 1e-4}

ROUTE, EXPERTS = "moe_route", "fused_moe"
REF_SKIP_GPU = "the reference loops over experts on the host (it is the check's oracle, not timed on a GPU)"


def route_case(T: int, E: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits [T, E], bias [E], weights [T, k], ids [T, k]) on the CPU, the reference router's choice."""
    from fastmamba.ops.moe.ref import moe_route_ref

    g = torch.Generator().manual_seed(seed * 7919 + T * 31 + E)
    logits = torch.randn(T, E, generator=g)
    bias = torch.randn(E, generator=g) * 0.01
    r = moe_route_ref(logits, bias, top_k=k, routed_scaling_factor=ROUTE_SCALE)
    return logits, bias, r.weights, r.ids


class MoeBench(OpBench):
    key = "moe"
    title = "fused_moe / moe_route"
    out_tol = BF16_TOL
    timing = TimingConfig.prefill()  # calls of 10 µs to a few ms: a few per graph hide the launches
    quick_timing = TimingConfig.prefill_quick()

    def __init__(self, tokens: Sequence[int] | None = None):
        self.tokens = tuple(tokens) if tokens else None
        self._routing: dict[tuple[str, int], tuple] = {}  # (shape, T) -> route_case(...): CPU tensors

    def configure(self, args: object) -> "MoeBench":
        return MoeBench(getattr(args, "batch", None))

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        """Token counts: --batch when given (``configure``), else GPU_TOKENS / CPU_TOKENS (the
        target's default batches are the decode ops')."""
        return self._cases(device, self.tokens or (GPU_TOKENS if device.type == "cuda" else CPU_TOKENS))

    def _cases(self, device: torch.device, tokens: Sequence[int]) -> list[Case]:
        from fastmamba.ops.moe.configs import GEMV_MAX_TOKENS

        cuda = device.type == "cuda"
        act = torch.bfloat16 if cuda else torch.float32
        out = []
        for shape, (M, F, E, k) in (GPU_SHAPES if cuda else CPU_SHAPES).items():
            for T in tokens:
                out.append(Case(op=ROUTE, shape=shape, dims=f"E{E} k{k}", dtype="fp32", batch=T,
                                nbytes=byte_models.moe_route_bytes(T, E, k),
                                params=dict(M=M, F=F, E=E, k=k, act=act, device=str(device))))
                out.append(self._experts_case(shape, T, M, F, E, k, 0, act, device))
        for shape, (M, F, E, k, S) in (GPU_SHARED_SHAPES if cuda else CPU_SHARED_SHAPES).items():
            out += [self._experts_case(shape, T, M, F, E, k, S, act, device) for T in tokens if T <= GEMV_MAX_TOKENS]
        return out

    def _experts_case(self, shape: str, T: int, M: int, F: int, E: int, k: int, S: int, act: torch.dtype,
                      device: torch.device) -> Case:
        """The ``fused_moe`` case of T tokens routed once (kept for ``make_set``); S shared slices are read
        like S more experts (weights of S*F features each way) and add S pairs per token."""
        routing = self._routing[(shape, T)] = route_case(T, E, k)
        touched = int(routing[3].unique().numel())
        params = dict(M=M, F=F, E=E, k=k, act=act, device=str(device), touched=touched, **({"S": S} if S else {}))
        return Case(op=EXPERTS, shape=shape, batch=T, dtype=DTYPE_NAMES[act],
                    dims=f"M{M} F{F} E{E} k{k}{f' +{S} shared slices' if S else ''} ({touched} experts touched)",
                    nbytes=byte_models.moe_bytes(T, M, F, k, touched + S, act_dtype=act),
                    flops=byte_models.moe_flops(T, M, F, k + S), params=params)

    def tune_cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        """The fused_moe cases at tune's token counts (its --batch; default 1, 8, 64, 256)."""
        return [c for c in self._cases(device, batches) if c.op == EXPERTS]

    def tune_candidates(self, configs: object, case: Case) -> list[dict]:
        """The GEMV configs for T <= 2 * GEMV_MAX_TOKENS, the grouped ones whose rows per block
        fit the mean rows per expert (within 4x) for T >= GEMV_MAX_TOKENS; a +shared case (the decode
        call, always the GEMV path) the GEMV ones."""
        p, T = case.params, case.batch
        per_expert = T * p["k"] / p["E"]
        out = []
        for c in configs.CANDIDATES:
            if c["path"] == "gemv":
                if T <= 2 * configs.GEMV_MAX_TOKENS:
                    out.append(c)
            elif not p.get("S") and T >= configs.GEMV_MAX_TOKENS and c["block_m"] <= max(16, 4 * per_expert):
                out.append(c)
        return out

    def tune_table_key(self, configs: object, case: Case) -> tuple:
        p = case.params  # the case's device (a CPU case on a GPU machine: family "cpu")
        return configs.table_key(torch.device(p["device"]), p["act"], case.batch, p["M"], p["F"], p["E"], p["k"],
                                 p.get("S", 0))

    def providers(self, device: torch.device) -> list[Provider]:
        version = _fastmamba_version()
        try:
            from fastmamba.ops.moe import fused_moe, moe_route
            from fastmamba.ops.moe.api import fused_moe_gemv
            ours = Provider("fastmamba", "ours", version, fused_moe)
            gemv = Provider("fastmamba-gemv", "ours", version, fused_moe_gemv,
                            note="the GEMV path forced (reads only the chosen experts)")
            self._route = {"fastmamba": moe_route}
        except Exception as exc:  # noqa: BLE001
            ours = Provider("fastmamba", "ours", version, None, reason=describe(exc))
            gemv = Provider("fastmamba-gemv", "ours", version, None, reason=describe(exc))
            self._route = {}
        from fastmamba.ops.moe.ref import fused_moe_ref, moe_route_ref

        self._route["torch-ref"] = moe_route_ref
        ref = Provider("torch-ref", "ref", f"torch {torch.__version__}", fused_moe_ref, preflight_sync=True)
        pdl = fastmamba_pdl_provider("moe", "fused_moe", device)
        pdl.note = "programmatic dependent launch on, as in the runtime's decode graphs (the GEMV path's kernels)"
        return [ours, pdl, gemv, grouped_mm_provider(device), vllm_provider(device), ref]

    def skip_reason(self, prov: Provider, case: Case) -> str:
        if case.op == ROUTE:
            return "" if prov.name in self._route else "runs the experts only"
        if prov.name == "fastmamba-gemv" and case.params.get("S"):
            return "the decode call is the GEMV path (row fastmamba)"
        if prov.name == "fastmamba-gemv" and case.batch > GEMV_ROWS_MAX_T:
            return f"the GEMV path is for few tokens (rows up to T={GEMV_ROWS_MAX_T})"
        if prov.name == "fastmamba+pdl":
            from fastmamba.ops.moe import configs

            p = case.params
            cfg = configs.pick_config(torch.device("cuda"), p["act"], case.batch, p["M"], p["F"], p["E"], p["k"])
            if cfg.path != "gemv":
                return "PDL changes only the GEMV path (this T takes the grouped one)"
        if prov.kind == "ref" and case.params["act"] != torch.float32 and torch.cuda.is_available():
            return REF_SKIP_GPU
        return ""

    def row_note(self, prov: Provider, case: Case) -> str:
        if case.op == EXPERTS and prov.name == "vLLM":
            return vllm_config_note(case)
        return ""

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        logits, bias, weights, ids = self._routing[(case.shape, case.batch)]
        if case.op == ROUTE:
            return {"logits": logits.to(device), "bias": bias.to(device)}
        M, F, E, T, act, S = p["M"], p["F"], p["E"], case.batch, p["act"], p.get("S", 0)
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(act)

        inp = {
            "x": randn(T, M),
            "w_up": randn(E + S, F, M, scale=M ** -0.5),
            "w_down": randn(E + S, M, F, scale=F ** -0.5),
            "weights": weights.to(device),
            "ids": ids.to(device),
        }
        if S:  # experts E.. are the shared expert's slices: the peers' form, and the layer's
            inp["decode"] = dict(
                args=(inp["x"], inp["w_up"][:E], inp["w_down"][:E], inp["weights"], inp["ids"]),
                shared_up=inp["w_up"][E:].reshape(S * F, M),  # [S*F, M], a view
                shared_down=inp["w_down"][E:].permute(1, 0, 2).reshape(M, S * F),  # [M, S*F], a copy
                arrivals=torch.zeros(T * M, dtype=torch.int32, device=device))
            inp["weights"] = torch.cat([inp["weights"], inp["weights"].new_ones(T, S)], dim=1)
            inp["ids"] = torch.cat([inp["ids"], torch.arange(E, E + S, dtype=ids.dtype, device=device).expand(T, S)],
                                   dim=1)
        return inp

    def args(self, case: Case, inp: dict) -> tuple:
        """A +shared case: fused_moe's arguments over the E+S experts (the peers' and the reference's form)."""
        if case.op == ROUTE:
            return (inp["logits"], inp["bias"])
        return (inp["x"], inp["w_up"], inp["w_down"], inp["weights"], inp["ids"])

    def _call(self, prov: Provider, case: Case, inp: dict) -> Callable:
        if case.op == ROUTE:
            fn = self._route[prov.name]
            k = case.params["k"]
            return lambda logits, bias: fn(logits, bias, top_k=k, routed_scaling_factor=ROUTE_SCALE)
        if case.params.get("S") and prov.kind == "ours":
            return _decode_call(prov, inp["decode"])
        return prov.fn

    def bind(self, prov: Provider, case: Case, inp: dict) -> Callable[[], object]:
        fn = self._call(prov, case, inp)
        args = self.args(case, inp)
        return lambda: fn(*args)

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        try:
            got = self._call(prov, case, inp)(*self.args(case, inp))
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        try:
            want = self._call(ref, case, inp)(*self.args(case, inp))
        except Exception as exc:  # noqa: BLE001
            return f"ref error: {describe(exc)}"
        if case.op == ROUTE:
            if not torch.equal(got.ids.cpu().long(), want.ids.cpu().long()):
                return "FAIL ids differ from the reference"
            problem = _compare("weights", got.weights, want.weights, {"atol": 1e-6, "rtol": 1e-5})
        else:
            tol = FP32_TOL if case.params["act"] == torch.float32 else self.out_tol
            problem = _compare("y", got, want, tol)
        return "ok" if not problem else "FAIL " + problem


def _decode_call(prov: Provider, decode: dict) -> Callable:
    """Ours on a +shared case, whatever the peers' arguments: the layer's decode call
    (``fused_moe_gemv`` on the routed experts, the shared slices read in place, the k-sum by the
    down kernel's arrival counters), under programmatic dependent launch for fastmamba+pdl (the
    other rows keep the caller's setting: ``tune --pdl`` turns it on around them)."""
    import contextlib

    from fastmamba.ops.moe.api import fused_moe_gemv
    from fastmamba.ops.runtime import programmatic_dependent_launch

    args = decode["args"]
    kwargs = dict(shared_up=decode["shared_up"], shared_down=decode["shared_down"], arrivals=decode["arrivals"])
    pdl = prov.name == "fastmamba+pdl"

    def call(*_peer_args):
        with programmatic_dependent_launch() if pdl else contextlib.nullcontext():
            return fused_moe_gemv(*args, **kwargs)

    return call


# --- torch._grouped_mm: transformers' grouped_mm experts path -----------------------------------------
def _grouped_mm_fn() -> Callable | None:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_experts(x, w_up, w_down, topk_weights, topk_ids):
    """The routed experts as transformers' ``grouped_mm`` implementation runs them: the token-expert
    pairs sorted by expert, x gathered in that order, per-expert offsets from a histogram (graph-safe,
    no host read), one grouped GEMM per projection over all experts (empty groups cost nothing),
    relu², the routing weights, and an index_add back to the tokens."""
    mm = _grouped_mm_fn()
    T, k = topk_ids.shape
    E = w_up.shape[0]
    experts, order = torch.sort(topk_ids.reshape(-1))
    token = order // k
    hist_in = experts.int() if experts.is_cuda else experts.float()  # histc: int on CUDA, float on CPU
    offsets = torch.cumsum(torch.histc(hist_in, bins=E, min=0, max=E - 1), dim=0, dtype=torch.int32)
    h = mm(x[token], w_up.transpose(-2, -1), offs=offsets)
    h = torch.relu(h).square()
    y = mm(h, w_down.transpose(-2, -1), offs=offsets)
    y = y * topk_weights.reshape(-1)[order].unsqueeze(-1).to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def grouped_mm_provider(device: torch.device) -> Provider:
    version = f"torch {torch.__version__}"
    if _grouped_mm_fn() is None:
        return Provider("torch-grouped_mm", "peer", version, None, reason="this torch has no grouped_mm")
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return Provider("torch-grouped_mm", "peer", version, None, reason="grouped_mm needs sm_90+ here")
    return Provider("torch-grouped_mm", "peer", version, grouped_mm_experts,
                    note="transformers' grouped_mm experts path (sort, gather, histc, 2 grouped GEMMs, index_add)")


# --- vLLM's Triton fused_moe_kernel ------------------------------------------------------------------
VLLM_FOLDER_ENV = "FASTMAMBA_VLLM_FUSED_MOE"


def vllm_moe_dir() -> str | None:
    """``peers/vllm_fused_moe`` beside the package (or $FASTMAMBA_VLLM_FUSED_MOE), if it holds fused_moe.py."""
    path = os.environ.get(VLLM_FOLDER_ENV) or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
        "peers", "vllm_fused_moe")
    return path if os.path.isfile(os.path.join(path, "fused_moe.py")) else None


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


@functools.lru_cache(maxsize=None)
def vllm_kernel_module(folder: str):
    """The ``@triton.jit`` functions of ``folder``/fused_moe.py, written to a module of their own
    (Triton reads a kernel's source from its file) with only triton, tl and torch imported."""
    path = os.path.join(folder, "fused_moe.py")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tree = ast.parse(text)
    parts = ["import torch\nimport triton\nimport triton.language as tl\n"]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
                "triton.jit" in (ast.get_source_segment(text, d) or "") for d in node.decorator_list):
            start = min(d.lineno for d in node.decorator_list) - 1
            lines = text.splitlines()[start:node.end_lineno]
            parts.append("\n".join(lines) + "\n")
    source = "\n\n".join(parts)
    # one folder per extracted source (Triton reads the kernels from it while they run), reused by later
    # runs instead of a new temporary folder each time
    out_dir = os.path.join(tempfile.gettempdir(), "fastmamba_vllm_moe_" + hashlib.sha256(source.encode()).hexdigest()[:16])
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "vllm_fused_moe_kernels.py")
    if not os.path.isfile(out) or _read(out) != source:
        tmp = f"{out}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(source)
        os.replace(tmp, out)  # atomic: a concurrent run never reads a half-written file
    spec = importlib.util.spec_from_file_location("fastmamba_vllm_fused_moe_kernels", out)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    if not hasattr(module, "fused_moe_kernel"):
        raise ImportError(f"no @triton.jit fused_moe_kernel in {path}")
    return module


def _vllm_device_name() -> str:
    name = torch.cuda.get_device_name().replace(" ", "_").replace("/", "_")
    return "NVIDIA_H200" if "H200" in name.split("_") else name


def vllm_table(folder: str, E: int, N: int) -> tuple[dict[int, dict], str]:
    """vLLM's tuned table for (E, N = expert width, this GPU), bf16, and its file name; ({}, '') if none."""
    if not torch.cuda.is_available():
        return {}, ""
    name = f"E={E},N={N},device_name={_vllm_device_name()}.json"
    path = os.path.join(folder, "configs", name)
    if not os.path.isfile(path):
        return {}, ""
    with open(path, encoding="utf-8") as f:
        raw = json.load(f)
    return {int(key): cfg for key, cfg in raw.items() if key.isdigit()}, name


def vllm_default_config(T: int, E: int) -> dict:
    """The tile rules vLLM 0.33 applies to bf16 experts without a tuned table (its
    ``get_default_config``, restated): row blocks of 16 / 32 / 64 / 128 up to 32 / 96 / 512 tokens,
    64-wide column tiles up to 64 tokens (then 128), K tiles of 128 up to 64 tokens (then 64),
    L2 groups of 16 row blocks beyond 128 tokens per expert, 4 warps up to 128 tokens (then 8),
    4 stages up to 32 tokens (then 3)."""
    bm = 16 if T <= 32 else 32 if T <= 96 else 64 if T <= 512 else 128
    return {"BLOCK_SIZE_M": bm, "BLOCK_SIZE_N": 64 if T <= 64 else 128, "BLOCK_SIZE_K": 128 if T <= 64 else 64,
            "GROUP_SIZE_M": 16 if T // max(E, 1) > 128 else 1, "num_warps": 4 if T <= 128 else 8,
            "num_stages": 4 if T <= 32 else 3}


def vllm_config(folder: str, T: int, E: int, F: int) -> tuple[dict, str]:
    """The config vLLM picks for T tokens: its table's nearest token key, else its defaults."""
    table, name = vllm_table(folder, E, F)
    if table:
        key = min(table, key=lambda n: abs(n - T))
        return dict(table[key]), f"vLLM table {name} [{key}]"
    return vllm_default_config(T, E), "vLLM default config (no tuned table for this E, N, GPU)"


def vllm_config_note(case: Case) -> str:
    folder = vllm_moe_dir()
    if folder is None:
        return ""
    p = case.params
    return vllm_config(folder, case.batch, p["E"] + p.get("S", 0), p["F"])[1]  # (+shared: E+S experts)


@triton.jit
def _vllm_layout_kernel(counts_ptr, lists_ptr, sorted_ptr, expert_ids_ptr, padded_ptr, E, P,
                        BM: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program per row block: its expert id, its rows' pairs from that expert's list (the sentinel
    # P in pad rows), and (program 0) the padded row count: vLLM's moe_align_block_size layout
    b = tl.program_id(0)
    offs_e, c, start, end = _padded_starts(counts_ptr, E, BM, BLOCK_E)
    row0 = b * BM
    e = tl.sum(((end <= row0) & (offs_e < E)).to(tl.int32), axis=0)
    tl.store(expert_ids_ptr + b, tl.minimum(e, E - 1))
    e_start = tl.sum(tl.where(offs_e == e, start, 0), axis=0)
    e_count = tl.sum(tl.where(offs_e == e, c, 0), axis=0)
    offs_r = row0 + tl.arange(0, BM)
    real = (offs_r - e_start) < e_count
    pair = tl.load(lists_ptr + e.to(tl.int64) * P + (offs_r - e_start), mask=real, other=0)
    tl.store(sorted_ptr + offs_r, tl.where(real, pair, P))
    if b == 0:
        tl.store(padded_ptr, tl.max(end, axis=0))


def vllm_align(ids: torch.Tensor, E: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_token_ids, expert_ids, num_tokens_post_padded) as vLLM's moe_align_block_size returns
    them, from fastmamba's one-launch alignment (per-expert lists) plus ``_vllm_layout_kernel``: two
    launches, no host read."""
    T, k = ids.shape
    P = T * k
    rows = grouped_rows(P, E, block_m)
    layout = AlignLayout(True, E * P, P)  # per-expert lists whatever the size
    counts = torch.empty(2 * E, dtype=torch.int32, device=ids.device)
    lists = torch.empty(layout.entries, dtype=torch.int32, device=ids.device)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
    padded = torch.empty(1, dtype=torch.int32, device=ids.device)
    launch_align(ids, counts[:E], counts[E:], lists, E=E, block_m=block_m, layout=layout)
    _vllm_layout_kernel[(rows // block_m,)](counts, lists, sorted_ids, expert_ids, padded, E, P, BM=block_m,
                                            BLOCK_E=max(16, triton.next_power_of_2(E)))
    return sorted_ids, expert_ids, padded


_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _vllm_gemm(kernel, A, B, C, topk_weights, sorted_ids, expert_ids, padded, *, mul_weight: bool, top_k: int,
               config: dict) -> None:
    """One ``fused_moe_kernel`` launch: C [pairs, N] = A[rows // top_k] @ B[e]^T (x weight), by parameter name."""
    cfg = dict(config)
    bm, bn, bk = cfg.pop("BLOCK_SIZE_M"), cfg.pop("BLOCK_SIZE_N"), cfg.pop("BLOCK_SIZE_K")
    group_m = cfg.pop("GROUP_SIZE_M", 1)
    num_warps, num_stages = cfg.pop("num_warps", 4), cfg.pop("num_stages", 3)
    N, K = B.shape[1], B.shape[2]
    EM = sorted_ids.shape[0]
    known = dict(
        a_ptr=A, b_ptr=B, c_ptr=C, b_bias_ptr=None, a_scale_ptr=None, b_scale_ptr=None,
        topk_weights_ptr=topk_weights, sorted_token_ids_ptr=sorted_ids, expert_ids_ptr=expert_ids,
        num_tokens_post_padded_ptr=padded, N=N, K=K, EM=EM, num_valid_tokens=A.shape[0] * top_k,
        stride_am=A.stride(0), stride_ak=A.stride(1), stride_be=B.stride(0), stride_bk=B.stride(2),
        stride_bn=B.stride(1), stride_cm=C.stride(0), stride_cn=C.stride(1),
        group_n=0, group_k=0, naive_block_assignment=False, BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk,
        GROUP_SIZE_M=group_m, SPLIT_K=1, MUL_ROUTED_WEIGHT=mul_weight, top_k=top_k,
        compute_type=_TL_DTYPES[A.dtype], per_channel_quant=False, HAS_BIAS=False, SWAP_AB=False, USE_TD=False,
    )
    kwargs = {}
    for name, p in inspect.signature(kernel.fn).parameters.items():  # kernel.fn: compiled or interpreted
        if name in known:
            kwargs[name] = known[name]
        elif name.startswith("stride_"):
            kwargs[name] = 0  # strides of the quantisation scales and the bias: unused
        elif name.startswith(("use_", "HAS_", "has_", "FUSE_", "PAIR_", "DIRECT_")):
            kwargs[name] = False
        elif p.default is not inspect.Parameter.empty:
            continue
        else:
            raise TypeError(f"vLLM's fused_moe_kernel takes an unknown parameter `{name}`")
    grid = (triton.cdiv(EM, bm) * triton.cdiv(N, bn),)
    kernel[grid](**kwargs, num_warps=num_warps, num_stages=num_stages)


def vllm_experts(module, folder: str) -> Callable:
    """fused_moe's positional call on vLLM's kernel: align, GEMM (up_proj), relu², GEMM (down_proj,
    routing weight), k-sum."""
    kernel = module.fused_moe_kernel

    def call(x, w_up, w_down, topk_weights, topk_ids):
        T, M = x.shape
        E, F, _ = w_up.shape
        k = topk_ids.shape[1]
        config, _ = vllm_config(folder, T, E, F)
        sorted_ids, expert_ids, padded = vllm_align(topk_ids, E, config["BLOCK_SIZE_M"])
        h = torch.empty(T * k, F, dtype=x.dtype, device=x.device)
        _vllm_gemm(kernel, x, w_up, h, topk_weights, sorted_ids, expert_ids, padded, mul_weight=False, top_k=k,
                   config=config)
        torch.relu_(h).square_()
        y = torch.empty(T * k, M, dtype=x.dtype, device=x.device)
        _vllm_gemm(kernel, h, w_down, y, topk_weights, sorted_ids, expert_ids, padded, mul_weight=True, top_k=1,
                   config=config)
        return y.view(T, k, M).sum(dim=1)

    return call


def vllm_provider(device: torch.device) -> Provider:
    version = peers.VLLM_VERSION
    folder = vllm_moe_dir()
    if folder is None:
        return Provider("vLLM", "peer", version, None,
                        reason="peers/vllm_fused_moe/ not staged (see fastmamba/bench/ops/moe.py)")
    try:
        module = vllm_kernel_module(folder)
    except Exception as exc:  # noqa: BLE001
        return Provider("vLLM", "peer", version, None, reason=describe(exc), source=folder)
    if device.type != "cuda":
        from fastmamba.ops.runtime import interpreter_enabled

        if not interpreter_enabled():
            return Provider("vLLM", "peer", version, None, source=folder,
                            reason="loaded, but its Triton kernel needs TRITON_INTERPRET=1 on the CPU")
    return Provider("vLLM", "peer", version, vllm_experts(module, folder), source=os.path.join(folder, "fused_moe.py"),
                    note="fastmamba's alignment kernels in vLLM's layout (its moe_align_block_size is a compiled op)")


BENCH = MoeBench()
