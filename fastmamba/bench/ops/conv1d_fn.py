"""causal_conv1d_fn, prefill: width 4, SiLU, bias, bf16, no initial or final states.

Conv dims of the two model shapes (E = D + 2*G*N: 5376 for mamba2-2.7b, 10240 for Nemotron-H),
B x L in {1x2048, 1x8192, 8x2048, 8x8192}, x channel-first ((B, D, L), stride(2) == 1) or
channel-last (a (B, L, D) buffer seen through ``transpose(1, 2)``, as a Mamba-2 layer hands it
over after in_proj). Bytes: x read once, out written once, weight and bias
(``bytes.conv_fn_bytes``).

Providers: fastmamba, fastmamba+pdl (the same op under programmatic dependent launch, sm_90+: each
call's launch overlaps the previous call's last programs, as in a prefill step where the conv
follows in_proj), Dao-AILab causal-conv1d's CUDA ``causal_conv1d_fn`` (when its extension
imports), and ``torch``: ``F.conv1d`` (depthwise, padding W-1) + SiLU, for orientation, on
channel-first inputs only (it would copy a channel-last x first).

Check oracle: on a GPU every case is checked against ``causal_conv1d_fp32`` below: the
definition (a sum over the W taps of shifted x) computed in fp32 from the same bf16 inputs,
fast at every size. The op's own reference (``fastmamba.ops.conv1d_fn.ref.causal_conv1d_fn_ref``,
explicit loops) is the oracle on the CPU, where the shapes are small (``--oracle ref|fp32``
overrides); tests/bench/test_bench_prefill_cpu.py checks that the two agree. Tolerance: bf16
(atol 5e-2, rtol 1e-2), elementwise: each output is a 4-term sum, no long reduction.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmamba.bench import bytes as byte_models
from fastmamba.bench import peers
from fastmamba.bench.ops._base import (
    DTYPE_NAMES,
    Case,
    OpBench,
    Provider,
    adapted_peer_provider,
    describe,
    fastmamba_pdl_provider,
    fastmamba_provider,
    load_fastmamba,
    peer_provider,
)
from fastmamba.bench.timing import TimingConfig

# (B, L)
GPU_SIZES = ((1, 2048), (1, 8192), (8, 2048), (8, 8192))
GPU_DIMS = (5376, 10240)
CPU_SIZES = ((1, 32), (2, 32))
CPU_DIMS = (64,)
LAYOUTS = ("channel-first", "channel-last")
WIDTH = 4
DTYPE = torch.bfloat16
ACTIVATION = "silu"


def causal_conv1d_fp32(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """The check oracle: out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (W-1) + k]),
    x zero before t = 0, computed in fp32 from the given (bf16) tensors; returned in fp32.

    Same signature as ``causal_conv1d_fn`` so it takes the benchmark's call; only the arguments
    the benchmark uses are supported. One request at a time keeps the fp32 temporaries small.
    """
    if seq_idx is not None or initial_states is not None or return_final_states or final_states_out is not None:
        raise NotImplementedError("causal_conv1d_fp32 covers x, weight, bias and activation only")
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    B, D, L = x.shape
    W = weight.shape[1]
    w = weight.float()
    out = torch.empty(B, D, L, device=x.device, dtype=torch.float32)
    for b in range(B):
        xp = F.pad(x[b].float(), (W - 1, 0))  # (D, W-1+L)
        acc = bias.float()[:, None].expand(D, L).clone() if bias is not None else torch.zeros(D, L, device=x.device)
        for k in range(W):
            acc += w[:, k : k + 1] * xp[:, k : k + L]
        out[b] = F.silu(acc) if activation is not None else acc
    return out


def torch_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    seq_idx: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
    final_states_out: torch.Tensor | None = None,
    activation: str | None = None,
) -> torch.Tensor:
    """What a PyTorch user would write: depthwise ``F.conv1d`` padded by W-1, cut to L, then SiLU."""
    L, W = x.shape[-1], weight.shape[1]
    y = F.conv1d(x, weight.unsqueeze(1), bias, padding=W - 1, groups=x.shape[1])[..., :L]
    return F.silu(y) if activation is not None else y


class ConvFnBench(OpBench):
    key = "conv_fn"
    title = "causal_conv1d_fn"
    timing = TimingConfig.prefill()
    quick_timing = TimingConfig.prefill_quick()

    def cases(self, device: torch.device, batches: Sequence[int] | None = None) -> list[Case]:
        """``batches`` is ignored: the (B, L) pairs are fixed (GPU_SIZES, CPU_SIZES)."""
        cuda = device.type == "cuda"
        out = []
        for D in GPU_DIMS if cuda else CPU_DIMS:
            for B, L in GPU_SIZES if cuda else CPU_SIZES:
                for layout in LAYOUTS:
                    out.append(
                        Case(
                            op=self.key,
                            shape=f"D{D}",
                            dims=f"L{L} W{WIDTH} {layout}",
                            dtype=DTYPE_NAMES[DTYPE],
                            batch=B,
                            nbytes=byte_models.conv_fn_bytes(B, L, D, WIDTH, act_dtype=DTYPE),
                            params=dict(D=D, L=L, W=WIDTH, layout=layout, dtype=DTYPE, activation=ACTIVATION),
                            variant=f"L{L} {layout}",
                        )
                    )
        return out

    def providers(self, device: torch.device) -> list[Provider]:
        return [
            fastmamba_provider("conv1d_fn", "causal_conv1d_fn"),
            fastmamba_pdl_provider("conv1d_fn", "causal_conv1d_fn", device),
            peer_provider(peers.causal_conv1d_fn(), device, "a CUDA extension has no CPU path"),
            adapted_peer_provider(peers.vllm_causal_conv1d_fn(), device, vllm_adapter, cpu_reason=VLLM_CPU,
                                  note="the B rows as B packed sequences with precomputed metadata (as vLLM's "
                                  "builder makes once per batch), final states into a slot cache; "
                                  "null_block_id = our pad id -1"),
            Provider("torch", "ref", f"torch {torch.__version__}", torch_conv1d, note="F.conv1d + silu"),
        ]

    def oracle(self, device: torch.device, providers: Sequence[Provider], mode: str = "auto") -> Provider | None:
        """auto: the op's reference on the CPU (small shapes), the fp32 definition on a GPU."""
        if mode == "fp32" or (mode == "auto" and device.type == "cuda"):
            return Provider("fp32 conv", "ref", f"torch {torch.__version__}", causal_conv1d_fp32,
                            note="sum over W shifted taps in fp32, fastmamba/bench/ops/conv1d_fn.py; bf16 tolerance")
        version = f"torch {torch.__version__}"
        try:
            fn = load_fastmamba("conv1d_fn", "causal_conv1d_fn_ref", module="ref")
        except Exception as exc:  # noqa: BLE001
            if mode == "ref":
                return Provider("torch-ref", "ref", version, None, reason=describe(exc))
            return Provider("fp32 conv", "ref", version, causal_conv1d_fp32,
                            note=f"the op's reference is not importable ({describe(exc)}); fp32 definition instead")
        return Provider("torch-ref", "ref", version, fn, note="fastmamba.ops.conv1d_fn.ref.causal_conv1d_fn_ref; bf16 tolerance")

    def skip_reason(self, prov: Provider, case: Case) -> str:
        if prov.name == "torch" and case.params["layout"] != "channel-first":
            return "channel-first only (F.conv1d would copy a channel-last x)"
        if prov.name == "vLLM" and case.params["layout"] != "channel-last":
            return "channel-last only (its x is [D, T] with stride 1 over D)"
        return ""

    def tune_cases(self, device: torch.device, batches: Sequence[int] | None = None) -> list[Case]:
        """The smallest and largest prefill (1 x 2048, 8 x 8192), both dims and layouts: 8 cases,
        so a sweep of every candidate fits a few minutes."""
        keep = {GPU_SIZES[0], GPU_SIZES[-1]} if device.type == "cuda" else set(CPU_SIZES)
        return [c for c in self.cases(device) if (c.batch, c.params["L"]) in keep]

    def tune_candidates(self, configs: object, case: Case) -> list[dict]:
        """Channel-first x runs the column kernel, which has its own candidate list."""
        if case.params["layout"] == "channel-first" and hasattr(configs, "CANDIDATES_CHANNEL_FIRST"):
            return list(configs.CANDIDATES_CHANNEL_FIRST)
        return list(configs.CANDIDATES)

    def header_notes(self, device: torch.device) -> list[str]:
        return [
            f"cases [conv_fn]: width {WIDTH}, {ACTIVATION}, bias, bf16 x/weight/bias, no initial or final states; "
            "channel-last x is a (B, L, D) buffer seen as (B, D, L)"
        ]

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        B, D, L, W, dtype = case.batch, p["D"], p["L"], p["W"], p["dtype"]
        g = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        if p["layout"] == "channel-first":
            x = randn(B, D, L)
        else:
            x = randn(B, L, D).transpose(1, 2)  # (B, D, L) view, stride(1) == 1
        return {"x": x, "weight": randn(D, W, scale=0.5), "bias": randn(D, scale=0.1)}

    def args(self, case: Case, inp: dict) -> tuple:
        # causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation)
        return (inp["x"], inp["weight"], inp["bias"], None, None, False, None, case.params["activation"])


# its launch grid callback rewrites a tensor argument, which the interpreter does not allow
VLLM_CPU = "its launch grid rewrites a kernel argument, which the Triton interpreter cannot run"


def vllm_adapter(fn):
    """vLLM's causal_conv1d_fn (the packed varlen conv) with causal_conv1d_fn's positional signature,
    for a channel-last x [B, D, L] without initial or final states: the B rows become B packed
    sequences of L tokens ([D, B*L], a view of the same buffer), each with its own slot of a conv
    cache the call writes (allocated once per shape, with vLLM's per-batch metadata, outside the
    timed call as vLLM's metadata builder does once per batch). Returns y [B, D, L] (a view).

    Slots are 0..B-1 with ``null_block_id=-1`` (our pad id, as the other vLLM adapters pass it):
    vLLM's default null block is slot 0, and a sequence whose slot is the null block is skipped
    (its y left unwritten), so with the default the first row was never computed."""
    cache: dict = {}

    def call(x, weight, bias, seq_idx, initial_states, return_final_states, final_states_out, activation):
        if seq_idx is not None or initial_states is not None or return_final_states or final_states_out is not None:
            raise NotImplementedError("the vLLM adapter covers the bench's calls (no seq_idx, no initial/final states)")
        B, D, L = x.shape
        key = (B, D, L, weight.shape[1], x.dtype, x.device)
        setup = cache.get(key)
        if setup is None:
            dev = x.device
            setup = cache[key] = (
                torch.zeros(B, weight.shape[1] - 1, D, dtype=x.dtype, device=dev).transpose(1, 2),
                torch.arange(0, B * L + 1, L, dtype=torch.int32, device=dev),
                torch.arange(B, dtype=torch.int32, device=dev),
                torch.zeros(B, dtype=torch.bool, device=dev),
                peers.vllm_conv_metadata([L] * B, dev),
            )
        states, query_start_loc, slots, has_initial_state, metadata = setup
        xt = x.transpose(1, 2).reshape(B * L, D).t()  # [D, T], stride 1 over D: a view for channel-last x
        y = fn(xt, weight, bias, states, query_start_loc, slots, has_initial_state, activation,
               pad_slot_id=-1, null_block_id=-1, metadata=metadata)
        return y.t().reshape(B, L, D).transpose(1, 2)

    return call


BENCH = ConvFnBench()
