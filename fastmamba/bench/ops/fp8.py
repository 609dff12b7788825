"""FP8 (e4m3) W8A8 projections and MoE experts beside their bf16 forms (issue 52).

    python -m fastmamba.bench fp8 [--ops linear,moe] [--batch 1,8,64,256,2048]

``linear``: one projection of nemotron-3-nano (Mamba in_proj / out_proj, the shared expert's up
projection) at T rows. Providers: fastmamba ``fp8_linear`` (Triton GEMV up to 16 rows,
``torch._scaled_mm`` above), fastmamba ``fp8_gemv`` (rows <= 16 only; "-2launch": quantisation in
its own kernel first instead of inside the GEMV), ``torch._scaled_mm`` called
directly on pre-quantised activations (cuBLASLt's floor: no quantisation kernel), bf16
``F.linear`` (cuBLAS, the 16-bit baseline) and the reference (oracle). Bytes: the weight (1 byte
an element for FP8, 2 for bf16), x and y in bf16, the scales.

``moe``: nemotron-3-nano's routed experts (E 128, top-6, F 1856, M 2688) at T tokens, routing from
random logits. Providers: fastmamba ``fp8_moe`` (GPU: a dense per-expert loop, no grouped FP8 kernel
yet, so it reads every expert) and bf16 ``fused_moe`` (the Triton grouped kernel). Bytes: the
distinct experts the routing touches, at the provider's bytes per weight.

The bf16 providers are checked against the FP8 reference by relative error (they compute the
unquantised product: <= 2^-3, the activation and weight rounding); the FP8 ones elementwise.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fastmamba.bench.ops._base import BF16_TOL, Case, OpBench, Provider, compare_relative, describe

# name -> (N, K): nemotron-3-nano (d_model 2688, Mamba 64 heads x 64, 8 groups x 128 state)
LINEARS = {"nano-in_proj": (4096 + 4096 + 2 * 8 * 128 + 64, 2688), "nano-out_proj": (2688, 4096),
           "nano-shared-up": (3712, 2688)}
CPU_LINEARS = {"tiny": (96, 64)}
MOE = {"nano-experts": (128, 6, 1856, 2688)}   # E, k, F, M
CPU_MOE = {"tiny": (8, 2, 32, 64)}
DTYPE = torch.bfloat16
BF16_REL = 2 ** -3


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


class FP8Bench(OpBench):
    key = "fp8"
    title = "fp8_linear / fp8_moe"
    out_tol = BF16_TOL

    def __init__(self, kinds: Sequence[str] = ("linear", "moe")):
        self.kinds = tuple(kinds)

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
                                    params=dict(kind="linear", N=N, K=K)))
        if "moe" in self.kinds:
            for shape, (E, k, F_, M) in (MOE if cuda else CPU_MOE).items():
                for T in batches:
                    touched = min(E, T * k)  # distinct experts at most (random routing touches about that many)
                    out.append(Case(op="fp8-moe", shape=shape, dims=f"E{E} k{k} F{F_} M{M}", dtype="e4m3/bf16",
                                    batch=T, nbytes=touched * 2 * F_ * M + 4 * T * M, flops=2 * 2 * T * k * F_ * M,
                                    params=dict(kind="moe", E=E, k=k, F=F_, M=M, touched=touched)))
        return out

    def providers(self, device: torch.device) -> list[Provider]:
        from fastmamba.ops.fp8 import fp8_gemv, fp8_linear, fp8_moe, quantize_per_token, scaled_mm_supported
        from fastmamba.ops.fp8.ref import fp8_linear_ref, fp8_moe_ref
        from fastmamba.ops.moe import fused_moe

        provs = [
            _fastmamba("fastmamba-fp8", lambda c, i: (fp8_linear(i["x"], i["w8"], i["sw"]) if c == "linear" else
                                                      fp8_moe(i["x"], i["up8"], i["su"], i["down8"], i["sd"],
                                                              i["wts"], i["ids"]))),
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
        else:
            provs.append(Provider("torch._scaled_mm", "peer", f"torch {torch.__version__}", None,
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
            return "a single GEMM, not the MoE"
        if prov.name == "torch-ref" and kind == "moe" and case.batch > 256:
            return "reference loop too slow at this size"
        return ""

    def provider_bytes(self, prov: Provider, case: Case) -> int:
        p = case.params
        if prov.name != "bf16":
            return case.nbytes
        if p["kind"] == "linear":
            return case.nbytes + p["N"] * p["K"]   # 2 bytes a weight
        return case.nbytes + p["touched"] * 2 * p["F"] * p["M"]

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        from fastmamba.ops.fp8 import quantize_per_token
        from fastmamba.ops.fp8.ref import quantize_weight_ref
        from fastmamba.ops.moe import moe_route

        p = case.params
        g = torch.Generator(device=device).manual_seed(seed)
        T = case.batch
        if p["kind"] == "linear":
            N, K = p["N"], p["K"]
            x = torch.randn(T, K, generator=g, device=device).to(DTYPE)
            w16 = (0.02 * torch.randn(N, K, generator=g, device=device)).to(DTYPE)
            w8, sw = quantize_weight_ref(w16)
            xq, sx = quantize_per_token(x)
            return {"x": x, "w16": w16, "w8": w8, "sw": sw, "xq": xq, "sx": sx}
        E, k, F_, M = p["E"], p["k"], p["F"], p["M"]
        x = torch.randn(T, M, generator=g, device=device).to(DTYPE)
        up16 = (0.02 * torch.randn(E, F_, M, generator=g, device=device)).to(DTYPE)
        down16 = (0.02 * torch.randn(E, M, F_, generator=g, device=device)).to(DTYPE)
        up8, su = quantize_weight_ref(up16.view(E * F_, M))
        down8, sd = quantize_weight_ref(down16.view(E * M, F_))
        routing = moe_route(torch.randn(T, E, generator=g, device=device), None, top_k=k)
        return {"x": x, "up16": up16, "down16": down16, "up8": up8.view(E, F_, M), "su": su.view(E, F_),
                "down8": down8.view(E, M, F_), "sd": sd.view(E, M), "wts": routing.weights, "ids": routing.ids}

    def args(self, case: Case, inp: dict) -> tuple:
        return (case.params["kind"], inp)

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        if prov.name != "bf16":
            return super().check(prov, ref, case, inp)
        try:
            got, want = prov.fn(*self.args(case, inp)), ref.fn(*self.args(case, inp))
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        problem = compare_relative("y", got.float(), want.float(), BF16_REL)
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
