"""FP8 (e4m3) W8A8 projections and MoE experts beside their bf16 forms (issue 52).

    python -m fastmamba.bench fp8 [--kinds linear,moe] [--batch 1,8,16,17,64,256,2048]

``linear``: one projection of nemotron-3-nano (Mamba in_proj / out_proj, the shared expert's up
projection) at T rows. Providers: fastmamba ``fp8_linear`` (Triton GEMV up to 16 rows,
``torch._scaled_mm`` above), fastmamba ``fp8_gemv`` (rows <= 16 only; "-2launch": quantisation in
its own kernel first instead of inside the GEMV), ``torch._scaled_mm`` called
directly on pre-quantised activations (cuBLASLt's floor: no quantisation kernel), bf16
``F.linear`` (cuBLAS, the 16-bit baseline) and the reference (oracle). Bytes: the weight (1 byte
an element for FP8, 2 for bf16), x and y in bf16, the scales.

``moe``: nemotron-3-nano's routed experts (E 128, top-6, F 1856, M 2688) at T tokens, routing from
``bench.ops.moe.route_case`` (the reference router on random logits, fixed per (T, E)). Providers:
fastmamba ``fp8_moe`` (pair GEMV up to 16 tokens, the grouped W8A8 kernel above), fastmamba
``fp8_moe_grouped`` (the grouped kernel at every T), ``torch._scaled_mm`` per expert (one cuBLASLt
GEMM pair per touched expert on its tokens, activations quantised per token by our kernel; the
grouping of the tokens by expert is done beforehand and not timed, so this is cuBLASLt's floor
for a host-looped MoE), bf16 ``fused_moe`` (the Triton grouped kernel on 16-bit experts) and the
reference. Bytes: the weights of the distinct experts the routing touches (counted from the
routing), at the provider's bytes per weight, their scales, x and out in bf16, the routing.

The bf16 providers are checked against the FP8 reference by relative error (they compute the
unquantised product: <= 2^-3, the activation and weight rounding), so is the per-expert _scaled_mm
baseline (its relu² rows are rounded to bf16 before e4m3: <= 2^-5); the FP8 ones elementwise.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmamba.bench.ops._base import BF16_TOL, Case, OpBench, Provider, compare_relative, describe
from fastmamba.bench.ops.moe import route_case

# name -> (N, K): nemotron-3-nano (d_model 2688, Mamba 64 heads x 64, 8 groups x 128 state)
LINEARS = {"nano-in_proj": (4096 + 4096 + 2 * 8 * 128 + 64, 2688), "nano-out_proj": (2688, 4096),
           "nano-shared-up": (3712, 2688), "nano-shared-down": (2688, 3712)}
CPU_LINEARS = {"tiny": (96, 64)}
MOE = {"nano-experts": (128, 6, 1856, 2688)}   # E, k, F, M
CPU_MOE = {"tiny": (8, 2, 32, 64)}
DTYPE = torch.bfloat16
BF16_REL = 2 ** -3
# the per-expert _scaled_mm baseline's relu² rows pass through bf16 (row-wise scaled _scaled_mm writes
# bf16 only) before their e4m3 quantisation: about 2^-8 / 2^-4 = 1/16 of them land on the neighbouring
# e4m3 value (a step of <= 2^-3), so <= 2^-5 in norm (CPU tiny case: 2^-6.4)
SCALED_MM_EXPERTS_REL = 2 ** -5


def _fastmamba(name: str, fn) -> Provider:
    import fastmamba

    return Provider(name, "ours", getattr(fastmamba, "__version__", "?"), fn)


def _two_launch_gemv(c, i):
    """fp8_gemv with the activation quantised by its own kernel first (kernel.FUSE_QUANT off): what
    fusing the quantisation into the GEMV saves."""
    from fastmamba.ops.fp8 import fp8_gemv, kernel

    kernel.FUSE_QUANT = False
    try:
        return fp8_gemv(i["x"], i["w8"], i["sw"])
    finally:
        kernel.FUSE_QUANT = True


def moe_fp8_bytes(T: int, M: int, F: int, k: int, touched: int, *, weight_bytes: int = 1) -> int:
    """The routed experts' bytes per call: the weights of the ``touched`` distinct experts (up [F, M]
    and down [M, F], ``weight_bytes`` each: 1 for e4m3, 2 for bf16) read once, their per-channel fp32
    scales (FP8 only), x read and out written in bf16, the routing (fp32 weights, int32 ids).
    Intermediates are not counted: a fused kernel need not move them."""
    scales = 4 * touched * (F + M) if weight_bytes == 1 else 0
    return 2 * touched * M * F * weight_bytes + scales + 2 * T * M * 2 + T * k * 8


def _scaled_mm_experts(inp: dict) -> torch.Tensor:
    """The routed experts as one ``torch._scaled_mm`` pair per touched expert (cuBLASLt, row-wise
    scales), each on the tokens that chose it: gather, quantise per token, up, relu², quantise, down,
    weight, add. The token groups come from ``make_set`` (host lists, not timed)."""
    from fastmamba.ops.fp8 import quantize_per_token

    x = inp["x"]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e, tok, w in inp["groups"]:
        q, s = quantize_per_token(x.index_select(0, tok))
        h = torch._scaled_mm(q, inp["up8"][e].t(), scale_a=s.view(-1, 1), scale_b=inp["su"][e].view(1, -1),
                             out_dtype=torch.bfloat16)
        hq, sh = quantize_per_token(torch.relu(h).square())
        y = torch._scaled_mm(hq, inp["down8"][e].t(), scale_a=sh.view(-1, 1), scale_b=inp["sd"][e].view(1, -1),
                             out_dtype=torch.bfloat16)
        out.index_add_(0, tok, y.float() * w)
    return out.to(x.dtype)


class FP8Bench(OpBench):
    key = "fp8"
    title = "fp8_linear / fp8_moe"
    out_tol = BF16_TOL

    def __init__(self, kinds: Sequence[str] = ("linear", "moe")):
        self.kinds = tuple(kinds)
        self._routing: dict[tuple[str, int], tuple] = {}  # (shape, T) -> route_case(...): CPU tensors

    def configure(self, args: object) -> "FP8Bench":
        return FP8Bench(getattr(args, "kinds", None) or self.kinds)

    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        cuda = device.type == "cuda"
        out = []
        if "linear" in self.kinds:
            for shape, (N, K) in (LINEARS if cuda else CPU_LINEARS).items():
                for T in batches:
                    out.append(Case(op="fp8-linear", shape=shape, dims=f"N{N} K{K}", dtype="e4m3/bf16", batch=T,
                                    nbytes=N * K + 2 * T * (K + N) + 4 * (N + T), flops=2 * T * N * K,
                                    params=dict(kind="linear", N=N, K=K, device=str(device))))
        if "moe" in self.kinds:
            for shape, (E, k, F_, M) in (MOE if cuda else CPU_MOE).items():
                for T in batches:
                    routing = self._routing[(shape, T)] = route_case(T, E, k)
                    touched = int(routing[3].unique().numel())
                    out.append(Case(op="fp8-moe", shape=shape, dims=f"E{E} k{k} F{F_} M{M} ({touched} experts touched)",
                                    dtype="e4m3/bf16", batch=T, nbytes=moe_fp8_bytes(T, M, F_, k, touched),
                                    flops=2 * 2 * T * k * F_ * M,
                                    params=dict(kind="moe", E=E, k=k, F=F_, M=M, touched=touched,
                                                device=str(device))))
        return out

    # --- ``tune --ops fp8``: the decode GEMVs' configs (fastmamba.ops.fp8.configs) ---------------------
    def tune_cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        """The linear cases at tune's row counts up to 16 (its default for fp8: 1 and 8, the FMA and
        the tensor-core path) and the MoE cases at 1 token (the pair GEMV: one path at every count)."""
        rows = [b for b in batches if b <= 16]
        return [c for c in self.cases(device, sorted(set(rows) | {1}))
                if (c.params["kind"] == "linear" and c.batch in rows) or (c.params["kind"] == "moe" and c.batch == 1)]

    def tune_candidates(self, configs: object, case: Case) -> list[dict]:
        """The pair GEMV (MoE, one row per pair) and a linear of 1-2 rows: the FMA tiles whose partial
        sums fit in registers (``configs.fma_fits``) and every dot tile; a linear of 3-16 rows: the dot tiles."""
        rows = 1 if case.params["kind"] == "moe" else case.batch
        fma = [c for c in configs.CANDIDATES
               if not c["use_dot"] and configs.fma_fits(rows, c["block_n"], c["block_k"], c["num_warps"])]
        dot = [c for c in configs.CANDIDATES if c["use_dot"]]
        return fma + dot if rows <= configs.FMA_MAX_ROWS else dot

    def tune_table_key(self, configs: object, case: Case) -> tuple:
        p = case.params
        dev = torch.device(p["device"])
        if p["kind"] == "moe":
            return configs.table_key(dev, "moe", 1, p["F"], p["M"])
        return configs.table_key(dev, "linear", case.batch, p["N"], p["K"])

    def providers(self, device: torch.device) -> list[Provider]:
        from fastmamba.ops.fp8 import (
            fp8_gemv,
            fp8_linear,
            fp8_moe,
            fp8_moe_grouped,
            quantize_per_token,
            scaled_mm_supported,
        )
        from fastmamba.ops.fp8.ref import fp8_linear_ref, fp8_moe_ref
        from fastmamba.ops.moe import fused_moe

        provs = [
            _fastmamba("fastmamba-fp8", lambda c, i: (fp8_linear(i["x"], i["w8"], i["sw"]) if c == "linear" else
                                                      fp8_moe(i["x"], i["up8"], i["su"], i["down8"], i["sd"],
                                                              i["wts"], i["ids"]))),
            _fastmamba("fastmamba-fp8-grouped", lambda c, i: fp8_moe_grouped(i["x"], i["up8"], i["su"], i["down8"],
                                                                              i["sd"], i["wts"], i["ids"])),
            _fastmamba("fastmamba-fp8-gemv", lambda c, i: fp8_gemv(i["x"], i["w8"], i["sw"])),
            _fastmamba("fastmamba-fp8-gemv-2launch", _two_launch_gemv),
        ]
        if device.type == "cuda" and scaled_mm_supported(device):
            def scaled_mm(c, i):
                T = i["xq"].shape[0]
                return torch._scaled_mm(i["xq"], i["w8"].t(), scale_a=i["sx"].view(T, 1),
                                        scale_b=i["sw"].view(1, -1), out_dtype=torch.bfloat16)
            provs.append(Provider("torch._scaled_mm", "peer", f"torch {torch.__version__}", scaled_mm,
                                  note="activations quantised beforehand (not timed)"))
            provs.append(Provider("torch._scaled_mm-experts", "peer", f"torch {torch.__version__}",
                                  lambda c, i: _scaled_mm_experts(i),
                                  note="one GEMM pair per touched expert; tokens grouped by expert beforehand (not timed)"))
        else:
            for name in ("torch._scaled_mm", "torch._scaled_mm-experts"):
                provs.append(Provider(name, "peer", f"torch {torch.__version__}", None,
                                      reason="needs a GPU with FP8 tensor cores (sm89+)"))
        provs.append(Provider("bf16", "peer", f"torch {torch.__version__}",
                              lambda c, i: (F.linear(i["x"], i["w16"]) if c == "linear" else
                                            fused_moe(i["x"], i["up16"], i["down16"], i["wts"], i["ids"])),
                              note="F.linear (cuBLAS) / fused_moe (Triton) on bf16 weights"))
        provs.append(Provider("torch-ref", "ref", f"torch {torch.__version__}",
                              lambda c, i: (fp8_linear_ref(i["x"], i["w8"], i["sw"]) if c == "linear" else
                                            fp8_moe_ref(i["x"], i["up8"], i["su"], i["down8"], i["sd"],
                                                        i["wts"], i["ids"]))))
        _ = quantize_per_token  # make_set uses it (imported here so a broken op shows as a skipped provider)
        return provs

    def skip_reason(self, prov: Provider, case: Case) -> str:
        kind = case.params["kind"]
        if prov.name.startswith("fastmamba-fp8-gemv") and (kind != "linear" or case.batch > 16):
            return "GEMV: linear layers of at most 16 rows"
        if prov.name == "torch._scaled_mm" and kind != "linear":
            return "a single GEMM, not the MoE (see torch._scaled_mm-experts)"
        if prov.name in ("fastmamba-fp8-grouped", "torch._scaled_mm-experts") and kind != "moe":
            return "MoE experts only"
        if prov.name == "torch-ref" and kind == "moe" and case.batch > 256:
            return "reference loop too slow at this size"
        return ""

    def provider_bytes(self, prov: Provider, case: Case) -> int:
        p = case.params
        if prov.name != "bf16":
            return case.nbytes
        if p["kind"] == "linear":
            return case.nbytes + p["N"] * p["K"]   # 2 bytes a weight
        return moe_fp8_bytes(case.batch, p["M"], p["F"], p["k"], p["touched"], weight_bytes=2)

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        from fastmamba.ops.fp8 import quantize_per_token
        from fastmamba.ops.fp8.ref import quantize_weight_ref

        p = case.params
        g = torch.Generator(device=device).manual_seed(seed)
        T = case.batch
        if p["kind"] == "linear":
            N, K = p["N"], p["K"]
            x = torch.randn(T, K, generator=g, device=device).to(DTYPE)
            w16 = (torch.randn(N, K, generator=g, device=device) * K ** -0.5).to(DTYPE)  # y ~ 1: the check's atol bites
            w8, sw = quantize_weight_ref(w16)
            xq, sx = quantize_per_token(x)
            return {"x": x, "w16": w16, "w8": w8, "sw": sw, "xq": xq, "sx": sx}
        E, F_, M = p["E"], p["F"], p["M"]
        x = torch.randn(T, M, generator=g, device=device).to(DTYPE)
        # 1/sqrt(fan-in) (nano: 0.019): outputs of order 1, so the check's bf16 atol (5e-2) bites at every width
        up16 = (torch.randn(E, F_, M, generator=g, device=device) * M ** -0.5).to(DTYPE)
        down16 = (torch.randn(E, M, F_, generator=g, device=device) * F_ ** -0.5).to(DTYPE)
        up8, su = quantize_weight_ref(up16.view(E * F_, M))
        down8, sd = quantize_weight_ref(down16.view(E * M, F_))
        _, _, wts, ids = self._routing[(case.shape, T)]
        groups = []  # (expert, its tokens [n] int64, their routing weights [n, 1] fp32) per touched expert
        for e in ids.unique().tolist():
            tok, j = torch.where(ids == e)
            groups.append((e, tok.to(device), wts[tok, j].float().view(-1, 1).to(device)))
        return {"x": x, "up16": up16, "down16": down16, "up8": up8.view(E, F_, M), "su": su.view(E, F_),
                "down8": down8.view(E, M, F_), "sd": sd.view(E, M), "wts": wts.to(device), "ids": ids.to(device),
                "groups": groups}

    def args(self, case: Case, inp: dict) -> tuple:
        return (case.params["kind"], inp)

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        rel = {"bf16": BF16_REL, "torch._scaled_mm-experts": SCALED_MM_EXPERTS_REL}.get(prov.name)
        if rel is None:
            return super().check(prov, ref, case, inp)
        try:
            got, want = prov.fn(*self.args(case, inp)), ref.fn(*self.args(case, inp))
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        problem = compare_relative("y", got.float(), want.float(), rel)
        return "ok" if not problem else "FAIL " + problem


BENCH = FP8Bench()


# --- the `fp8` target ---------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from fastmamba.bench.kernels import _int_list, add_device_arguments

    parser.add_argument("--kinds", type=lambda s: [t for t in s.split(",") if t], default=["linear", "moe"],
                        help="comma-separated subset of linear,moe (default both)")
    parser.add_argument("--batch", type=_int_list, default=None,
                        help="rows (tokens); default 1,8,16,64,256,2048 on a GPU, 1,3 on the CPU")
    add_device_arguments(parser, "fp8")


def run(args: argparse.Namespace, command: str) -> int:
    from fastmamba.bench.kernels import Suite, run_suite

    bad = [k for k in args.kinds if k not in ("linear", "moe")]
    if bad:
        raise SystemExit(f"fp8: unknown --kinds {bad}; choose from linear,moe")
    suite = Suite("fp8", "fastmamba FP8 benchmark", {"fp8": __name__}, (1, 8, 16, 64, 256, 2048), (1, 3),
                  matmul=True)
    args.ops = ["fp8"]
    return run_suite(suite, args, command)
