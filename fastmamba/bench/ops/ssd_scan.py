"""The chunked SSD scan of Mamba-2 prefill: ``mamba_chunk_scan_combined`` and ``ssd_scan_varlen``.

Inputs as a Mamba-2 layer passes them: chunk 256, bf16 x, B, C and z; fp32 dt (raw, softplus'd
with dt_bias inside), A, D and dt_bias per head; state fp32 or bf16. Two modes per (shape, L):

- dense: B=1 request of L tokens through ``mamba_chunk_scan_combined`` with initial_states (in
  the state dtype), ``state_dtype`` (the precision of the chunk states between its kernels) and
  ``return_final_states=True`` (final states come back in fp32, as mamba_ssm returns them);
- varlen: L tokens as 8 sequences of fixed seeded random lengths (most not multiples of 256)
  through ``ssd_scan_varlen`` into a cache of 16 slots (random ``cache_indices``), sequences 0, 2,
  4, 6 starting from their cached state (``has_initial_state``).

mamba_ssm's ``mamba_chunk_scan_combined`` runs the same tokens: dense as is (it has no
``state_dtype`` argument in the versions we know; it is passed where its signature has one);
varlen as one batch-1 call with ``seq_idx``, ``cu_seqlens`` and ``return_varlen_states``. It has
no per-sequence initial states, so its varlen rows start every sequence from zero (their note says
so) and are checked against a zero-initial-state oracle.

FLOPs: ``bytes.ssd_flops`` (2*T*(G*Q*N + H*Q*P + 2*H*P*N)); bytes: ``bytes.ssd_bytes``.

Without a GPU: H2 P8 N8 G1, L=40, chunk 16, 3 sequences, and fp32 activations (the interpreter's
bf16 tl.dot is wrong in Triton 3.6), through the Triton interpreter.

Check: output and final states, relative error norm ||got - want|| / ||want|| <= 1e-2 (bf16
inputs, reductions over thousands of tokens: an elementwise bf16 tolerance is the wrong tool);
untouched cache slots must be bit-identical. The oracle on a GPU is ``ssd_chunked_fp32`` below,
the chunked SSD computed in fp32 PyTorch from the same inputs (the op's reference loops over
tokens in Python, seconds per case at L=8192); on the CPU, where the shapes are small, it is the
op's own reference (``--oracle ref|fp32`` overrides). tests/bench/test_bench_prefill_cpu.py
checks the fp32 oracle against a token-by-token recurrence and against the reference.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fastmamba.bench import bytes as byte_models
from fastmamba.bench import peers
from fastmamba.bench.ops._base import (
    DTYPE_NAMES,
    MAMBA_SSM_CPU,
    Case,
    OpBench,
    Provider,
    _fastmamba_version,
    compare_relative,
    describe,
    load_fastmamba,
    peer_provider,
)
from fastmamba.bench.timing import TimingConfig

# name -> (H, P, N, G)
GPU_SHAPES = {
    "mamba2-2.7b": (80, 64, 128, 1),
    "nemotron-h": (128, 64, 128, 8),
}
CPU_SHAPES = {"tiny": (2, 8, 8, 1)}
GPU_LENGTHS = (2048, 8192)
CPU_LENGTHS = (40,)
GPU_CHUNK = 256
CPU_CHUNK = 16
GPU_SEQS = 8  # sequences in a varlen row
CPU_SEQS = 3
STATE_DTYPES = (torch.float32, torch.bfloat16)
ACT_DTYPE = torch.bfloat16
# Triton 3.6's interpreter returns garbage for a bf16 tl.dot (a bf16 load and convert is fine),
# so the CPU rows run fp32 activations; tests/ops/ssd_scan skips bf16 there for the same reason.
CPU_ACT_DTYPE = torch.float32
DT_DTYPE = torch.float32
REL_TOL = 1e-2
LENGTHS_SEED = 0  # the varlen mix is the same in every run and every input set


# --- the fp32 oracle --------------------------------------------------------------------------------
def _dt_softplus(dt, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _chunked_scan(x, dt, A, B, C, chunk_size, h0) -> tuple[torch.Tensor, torch.Tensor]:
    """y = C h (no D, no gate) and the final state, chunk by chunk, all fp32.

    x [b, L, H, P], dt [b, L, H] (after softplus), A [H], B, C [b, L, G, N], h0 [b, H, P, N].
    Inside a chunk, with a_i = sum_{k<=i} dt_k A (from the chunk start):
        y_i = sum_{j<=i} exp(a_i - a_j) (C_i . B_j) dt_j x_j  +  exp(a_i) C_i . h_prev
        h   = exp(a_last) h_prev + sum_j exp(a_last - a_j) dt_j x_j B_j^T
    """
    b, L, H, P = x.shape
    rep = H // B.shape[2]
    y = torch.empty_like(x)
    h = h0
    for s in range(0, L, chunk_size):
        e = min(s + chunk_size, L)
        xc, dtc = x[:, s:e], dt[:, s:e]
        Bc = B[:, s:e].repeat_interleave(rep, dim=2)  # [b, q, H, N]
        Cc = C[:, s:e].repeat_interleave(rep, dim=2)
        a = torch.cumsum(dtc * A, dim=1)  # [b, q, H], <= 0
        at = a.transpose(1, 2)  # [b, H, q]
        causal = torch.ones(e - s, e - s, dtype=torch.bool, device=x.device).tril()
        decay = torch.exp((at[..., :, None] - at[..., None, :]).masked_fill(~causal, float("-inf")))
        scores = torch.einsum("bihn,bjhn->bhij", Cc, Bc) * decay * dtc.transpose(1, 2)[:, :, None, :]
        y[:, s:e] = torch.einsum("bhij,bjhp->bihp", scores, xc)
        y[:, s:e] += torch.einsum("bihn,bhpn->bihp", Cc, h) * torch.exp(a)[..., None]
        w = torch.exp(a[:, -1:] - a) * dtc  # [b, q, H]
        h = h * torch.exp(a[:, -1])[..., None, None] + torch.einsum("bjh,bjhp,bjhn->bhpn", w, xc, Bc)
    return y, h


def _skip_and_gate(y, x, D, z) -> torch.Tensor:
    if D is not None:
        y = y + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
    if z is not None:
        y = y * F.silu(z.float())
    return y


def ssd_chunked_fp32(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False,
    return_varlen_states=False, state_dtype=None,
):
    """Oracle for ``mamba_chunk_scan_combined`` (same signature; no seq_idx / cu_seqlens): the
    chunked SSD in fp32 from the given inputs. Returns out [B, L, H, P] fp32, and the final
    states [B, H, P, N] fp32 when ``return_final_states``."""
    if seq_idx is not None or cu_seqlens is not None or return_varlen_states:
        raise NotImplementedError("ssd_chunked_fp32 covers one sequence per batch row (no seq_idx / cu_seqlens)")
    Bsz, L, H, P = x.shape
    N = B.shape[-1]
    dtp = _dt_softplus(dt, dt_bias, dt_softplus, dt_limit)
    h0 = (initial_states.float() if initial_states is not None
          else torch.zeros(Bsz, H, P, N, device=x.device, dtype=torch.float32))
    y, h = _chunked_scan(x.float(), dtp, A.float(), B.float(), C.float(), chunk_size, h0)
    out = _skip_and_gate(y, x, D, z)
    return (out, h) if return_final_states else out


def ssd_varlen_chunked_fp32(
    x, dt, A, B, C, ssm_states, cu_seqlens, *, chunk_size=256, D=None, z=None, dt_bias=None,
    dt_softplus=True, dt_limit=(0.0, float("inf")), cache_indices=None, has_initial_state=None,
    pad_slot_id=-1, out=None, chunk_states_out=None,
):
    """Oracle for ``ssd_scan_varlen`` (same signature): each sequence through ``ssd_chunked_fp32``
    from its cached state (if has_initial_state) or zero; its final state is written to its slot
    of ``ssm_states`` in the cache dtype (mutated, like the op). Returns out [T, H, P] fp32."""
    if out is not None or chunk_states_out is not None:
        raise NotImplementedError("ssd_varlen_chunked_fp32 allocates its own output")
    T, H, P = x.shape
    bounds = cu_seqlens.tolist()
    n = len(bounds) - 1
    slots = cache_indices.tolist() if cache_indices is not None else list(range(n))
    has_init = has_initial_state.tolist() if has_initial_state is not None else [False] * n
    y = torch.zeros(T, H, P, device=x.device, dtype=torch.float32)
    for i in range(n):
        s, e, slot = bounds[i], bounds[i + 1], slots[i]
        if slot == pad_slot_id:
            continue
        init = ssm_states[slot : slot + 1] if has_init[i] else None
        yi, h = ssd_chunked_fp32(
            x[None, s:e], dt[None, s:e], A, B[None, s:e], C[None, s:e], chunk_size, D=D,
            z=z[None, s:e] if z is not None else None, dt_bias=dt_bias, initial_states=init,
            dt_softplus=dt_softplus, dt_limit=dt_limit, return_final_states=True,
        )
        y[s:e] = yi[0]
        if e > s:
            ssm_states[slot] = h[0].to(ssm_states.dtype)
    return y


# --- providers: two entry points each ---------------------------------------------------------------
@dataclass(frozen=True)
class ScanFns:
    """One implementation of the scan: its dense and varlen entry points and how they are called.

    ``style`` "fastmamba": our signatures (also the references and the oracle); "mamba_ssm": its
    ``mamba_chunk_scan_combined`` for both, varlen as one batch-1 call with seq_idx and cu_seqlens.
    """

    dense: Callable | None
    varlen: Callable | None
    style: str = "fastmamba"
    state_dtype_arg: bool = True  # the dense entry takes state_dtype=
    missing: dict = field(default_factory=dict)  # "dense" / "varlen" -> why that entry is None


def _ours(device: torch.device) -> Provider:
    fns, missing = {}, {}
    for mode, attr in (("dense", "mamba_chunk_scan_combined"), ("varlen", "ssd_scan_varlen")):
        try:
            fns[mode] = load_fastmamba("ssd_scan", attr)
        except Exception as exc:  # noqa: BLE001
            fns[mode], missing[mode] = None, f"{attr}: {describe(exc)}"
    version = _fastmamba_version()
    if fns["dense"] is None and fns["varlen"] is None:
        return Provider("fastmamba", "ours", version, None, reason=missing["dense"])
    return Provider("fastmamba", "ours", version, ScanFns(fns["dense"], fns["varlen"], missing=missing))


def _mamba_ssm(device: torch.device) -> Provider:
    prov = peer_provider(peers.mamba_ssm_chunk_scan_combined(), device, MAMBA_SSM_CPU)
    if not prov.available:
        return prov
    fn = prov.fn
    try:
        takes_state_dtype = "state_dtype" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_state_dtype = False
    prov.fn = ScanFns(fn, fn, style="mamba_ssm", state_dtype_arg=takes_state_dtype)
    return prov


def _vllm(device: torch.device) -> Provider:
    peer = peers.vllm_chunk_scan_combined()
    if not peer.available:
        return Provider(peer.name, "peer", peer.version, None, reason=peer.reason, source=peer.source)
    if device.type != "cuda":
        from fastmamba.ops.runtime import interpreter_enabled

        if not interpreter_enabled():
            return Provider(peer.name, "peer", peer.version, None, source=peer.source,
                            reason="loaded, but its Triton kernels need TRITON_INTERPRET=1 on the CPU")
    return Provider(peer.name, "peer", peer.version, ScanFns(peer.fn, peer.fn, style="vllm"), source=peer.source)


def _fp32_oracle(note: str) -> Provider:
    return Provider("fp32 ssd", "ref", f"torch {torch.__version__}",
                    ScanFns(ssd_chunked_fp32, ssd_varlen_chunked_fp32), note=note)


def varlen_lengths(total: int, n: int, seed: int = LENGTHS_SEED) -> list[int]:
    """``n`` positive lengths summing to ``total``: n-1 distinct cut points drawn uniformly from
    a seeded generator, so the mix is the same in every run."""
    g = torch.Generator().manual_seed(seed + total)
    cuts = sorted((torch.randperm(total - 1, generator=g)[: n - 1] + 1).tolist())
    bounds = [0, *cuts, total]
    return [b - a for a, b in zip(bounds, bounds[1:])]


class SsdScanBench(OpBench):
    key = "ssd"
    title = "mamba_chunk_scan_combined"
    mutated = ("ssm_states",)
    timing = TimingConfig.prefill()
    quick_timing = TimingConfig.prefill_quick()

    def cases(self, device: torch.device, batches: Sequence[int] | None = None) -> list[Case]:
        """``batches`` is ignored: dense rows are B=1, varlen rows a fixed mix of sequences."""
        cuda = device.type == "cuda"
        shapes = GPU_SHAPES if cuda else CPU_SHAPES
        chunk = GPU_CHUNK if cuda else CPU_CHUNK
        n_seqs = GPU_SEQS if cuda else CPU_SEQS
        act = ACT_DTYPE if cuda else CPU_ACT_DTYPE
        out = []
        for shape, (H, P, N, G) in shapes.items():
            for varlen in (False, True):
                for L in GPU_LENGTHS if cuda else CPU_LENGTHS:
                    for state_dtype in STATE_DTYPES:
                        out.append(self._case(shape, H, P, N, G, L, chunk, state_dtype, act, n_seqs if varlen else 0))
        return out

    def _case(self, shape, H, P, N, G, L, chunk, state_dtype, act, n_seqs) -> Case:
        varlen = n_seqs > 0
        lengths = varlen_lengths(L, n_seqs) if varlen else [L]
        has_init = [i % 2 == 0 for i in range(len(lengths))] if varlen else [True]
        nbytes = byte_models.ssd_bytes(
            L, H, P, N, G, act_dtype=act, dt_dtype=DT_DTYPE, state_dtype=state_dtype,
            states_read=sum(has_init), states_written=len(lengths), n_seqs=n_seqs, has_indices=varlen,
            final_dtype=state_dtype if varlen else torch.float32,  # dense: final states come back in fp32
        )
        return Case(
            op=self.key,
            shape=shape,
            dims=f"H{H} P{P} N{N} G{G} " + (f"T{L} varlen" if varlen else f"L{L}"),
            dtype=f"{DTYPE_NAMES[state_dtype]}/{DTYPE_NAMES[act]}",
            batch=len(lengths),
            nbytes=nbytes,
            flops=byte_models.ssd_flops(L, H, P, N, G, chunk),
            params=dict(H=H, P=P, N=N, G=G, L=L, chunk_size=chunk, varlen=varlen, lengths=lengths,
                        has_initial_state=has_init, S=2 * len(lengths), state_dtype=state_dtype, act_dtype=act),
            variant=f"T{L} varlen" if varlen else f"L{L}",
        )

    def tune_cases(self, device: torch.device, batches: Sequence[int] | None = None) -> list[Case]:
        """The longest prompts only (the configs depend on H, P, N and dtype, not on L): 8 cases."""
        longest = max(GPU_LENGTHS if device.type == "cuda" else CPU_LENGTHS)
        return [c for c in self.cases(device) if c.params["L"] == longest]

    def providers(self, device: torch.device) -> list[Provider]:
        return [_ours(device), _mamba_ssm(device), _vllm(device)]

    def oracle(self, device: torch.device, providers: Sequence[Provider], mode: str = "auto") -> Provider | None:
        """auto: the op's references on the CPU (small shapes), the fp32 chunked scan on a GPU."""
        rule = f"relative error norm <= {REL_TOL:.0e}, untouched cache slots bit-exact"
        if mode == "fp32" or (mode == "auto" and device.type == "cuda"):
            return _fp32_oracle(f"chunked SSD in fp32 PyTorch, fastmamba/bench/ops/ssd_scan.py; {rule}")
        try:
            dense = load_fastmamba("ssd_scan", "mamba_chunk_scan_combined_ref", module="ref")
            varlen = load_fastmamba("ssd_scan", "ssd_scan_varlen_ref", module="ref")
        except Exception as exc:  # noqa: BLE001
            if mode == "ref":
                return Provider("torch-ref", "ref", f"torch {torch.__version__}", None, reason=describe(exc))
            return _fp32_oracle(f"the op's reference is not importable ({describe(exc)}); chunked fp32 SSD instead; {rule}")
        return Provider("torch-ref", "ref", f"torch {torch.__version__}", ScanFns(dense, varlen),
                        note=f"fastmamba.ops.ssd_scan.ref; {rule}")

    def skip_reason(self, prov: Provider, case: Case) -> str:
        mode = "varlen" if case.params["varlen"] else "dense"
        return prov.fn.missing.get(mode, "") if isinstance(prov.fn, ScanFns) else ""

    def row_note(self, prov: Provider, case: Case) -> str:
        if isinstance(prov.fn, ScanFns) and prov.fn.style == "vllm":
            return ("mamba_chunk_scan_combined_varlen, chunk metadata precomputed (once per batch, as vLLM's builder); "
                    "timed call: out allocation, initial states gathered from the cache (torch.where, as vLLM's "
                    "layer does), scan, final states written into the slots"
                    + ("" if case.params["varlen"] else "; dense: one sequence, final states returned"))
        if not isinstance(prov.fn, ScanFns) or prov.fn.style != "mamba_ssm":
            return ""
        if case.params["varlen"]:
            return ("batch 1 with seq_idx + cu_seqlens, return_varlen_states; it takes no per-sequence initial "
                    "states, so every sequence starts from zero (checked against a zero-initial-state oracle)")
        if not prov.fn.state_dtype_arg and case.params["state_dtype"] != torch.float32:
            return "no state_dtype argument: the same call as the fp32 row, from bf16 initial states"
        return ""

    def header_notes(self, device: torch.device) -> list[str]:
        cuda = device.type == "cuda"
        n = GPU_SEQS if cuda else CPU_SEQS
        mixes = "; ".join(f"T={L}: {varlen_lengths(L, n)}" for L in (GPU_LENGTHS if cuda else CPU_LENGTHS))
        chunk = GPU_CHUNK if cuda else CPU_CHUNK
        act = ("bf16 x/B/C/z" if cuda else
               "fp32 x/B/C/z (not bf16: Triton 3.6's interpreter computes a bf16 tl.dot wrong)")
        return [
            f"cases [ssd]: chunk {chunk}, {act}, fp32 dt/A/D/dt_bias, dt_softplus, with D and z; dense: "
            "B=1 from initial_states (state dtype) with return_final_states; varlen: ssd_scan_varlen over "
            f"{n} sequences ({mixes}) into a cache of {2 * n} slots, every other sequence from its cached state",
            "TFLOP/s [ssd] counts model FLOPs (fastmamba/bench/bytes.py ssd_flops): 2*T*(G*Q*N + H*Q*P + 2*H*P*N) "
            "for T tokens, chunk size Q (full Q x Q blocks); GB/s its minimum bytes (ssd_bytes)",
        ]

    # --- inputs and calls -----------------------------------------------------------------------
    def make_set(self, case: Case, device: torch.device, seed: int) -> dict:
        p = case.params
        H, P, N, G, L, act, sdt = p["H"], p["P"], p["N"], p["G"], p["L"], p["act_dtype"], p["state_dtype"]
        g = torch.Generator(device=device).manual_seed(seed)
        cpu_g = torch.Generator().manual_seed(seed)

        def randn(*shape, dtype=torch.float32, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        lead = (L,) if p["varlen"] else (1, L)
        dt0 = torch.rand(H, generator=g, device=device) * (0.1 - 0.001) + 0.001  # softplus(dt_bias) in [1e-3, 1e-1]
        inp = {
            "x": randn(*lead, H, P, dtype=act),
            "dt": randn(*lead, H, scale=0.5),
            "A": -(1.0 + 15.0 * torch.rand(H, generator=g, device=device)),  # -exp(A_log), A_log = log U(1, 16)
            "B": randn(*lead, G, N, dtype=act),
            "C": randn(*lead, G, N, dtype=act),
            "D": 1.0 + 0.1 * randn(H),
            "z": randn(*lead, H, P, dtype=act),
            "dt_bias": dt0 + torch.log(-torch.expm1(-dt0)),  # inverse softplus, as Mamba-2 initialises it
        }
        if not p["varlen"]:
            inp["initial_states"] = randn(1, H, P, N, dtype=sdt, scale=0.5)
            return inp
        lengths = torch.tensor(p["lengths"])
        n, S = len(p["lengths"]), p["S"]
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(lengths, 0)
        inp.update(
            ssm_states=randn(S, H, P, N, dtype=sdt, scale=0.5),
            cu_seqlens=cu.to(device),
            cache_indices=torch.randperm(S, generator=cpu_g)[:n].to(device=device, dtype=torch.int32),
            has_initial_state=torch.tensor(p["has_initial_state"], dtype=torch.bool, device=device),
            seq_idx=torch.repeat_interleave(torch.arange(n, dtype=torch.int32), lengths)[None].to(device),
        )
        return inp

    def bind(self, prov: Provider, case: Case, inp: dict) -> Callable[[], object]:
        fns: ScanFns = prov.fn
        p = case.params
        i = inp
        common = dict(D=i["D"], z=i["z"], dt_bias=i["dt_bias"], dt_softplus=True)
        if fns.style == "vllm":
            return self._bind_vllm(fns.dense, case, inp)
        if p["varlen"] and fns.style == "mamba_ssm":
            fn = fns.dense
            args = (i["x"][None], i["dt"][None], i["A"], i["B"][None], i["C"][None], p["chunk_size"])
            kwargs = dict(common, z=i["z"][None], seq_idx=i["seq_idx"], cu_seqlens=i["cu_seqlens"],
                          return_varlen_states=True)
        elif p["varlen"]:
            fn = fns.varlen
            args = (i["x"], i["dt"], i["A"], i["B"], i["C"], i["ssm_states"], i["cu_seqlens"])
            kwargs = dict(common, chunk_size=p["chunk_size"], cache_indices=i["cache_indices"],
                          has_initial_state=i["has_initial_state"])
        else:
            fn = fns.dense
            args = (i["x"], i["dt"], i["A"], i["B"], i["C"], p["chunk_size"])
            kwargs = dict(common, initial_states=i["initial_states"], return_final_states=True)
            if fns.state_dtype_arg:
                kwargs["state_dtype"] = p["state_dtype"]
        return lambda: fn(*args, **kwargs)

    def _bind_vllm(self, fn: Callable, case: Case, inp: dict) -> Callable[[], object]:
        """vLLM's mamba_chunk_scan_combined_varlen on the case: packed [T, ...] tensors, chunk
        metadata computed here (not timed), per-sequence initial states gathered from the cache in
        the call. Varlen: final states go into the slots (final_states_out); returns out [T, H, P].
        Dense: one sequence from ``initial_states``; returns (out [1, L, H, P], final [1, H, P, N])."""
        p, i = case.params, inp
        varlen = p["varlen"]
        lead = (lambda t: t) if varlen else (lambda t: t[0])
        x, dt, B, C, z = (lead(i[k]) for k in ("x", "dt", "B", "C", "z"))
        meta = peers.vllm_chunk_metadata(p["lengths"], p["chunk_size"], x.device)
        chunks = (p["chunk_size"], meta["cu_seqlens"], meta["cu_chunk_seqlens"], meta["last_chunk_indices"],
                  meta["seq_idx"])
        common = dict(D=i["D"], z=z, dt_bias=i["dt_bias"], dt_softplus=True)
        if varlen:
            states, slots = i["ssm_states"], i["cache_indices"]
            rows, has_init = slots.long(), i["has_initial_state"][:, None, None, None]

            def call():
                out = torch.empty_like(x)
                init = torch.where(has_init, states[rows], 0)
                fn(x, dt, i["A"], B, C, *chunks, out, initial_states=init, final_states_out=states,
                   final_state_indices=slots, **common)
                return out

            return call

        def call_dense():
            out = torch.empty_like(x)
            final = fn(x, dt, i["A"], B, C, *chunks, out, initial_states=i["initial_states"], **common)
            return out[None], final

        return call_dense

    def results(self, prov: Provider, case: Case, inp: dict) -> dict[str, object]:
        """Call ``prov`` once on ``inp`` (which it may mutate: pass clones) and name what it produced:
        out, and the final states (dense) or the sequences' cache rows, in sequence order (varlen)."""
        fns: ScanFns = prov.fn
        output = self.bind(prov, case, inp)()
        if not case.params["varlen"]:
            out, final = output if isinstance(output, tuple) else (output, None)
            return {"out": out, "final_states": final}
        if fns.style == "mamba_ssm":
            out, states = output
            return {"out": out[0], "states": states}
        return {"out": output, "states": inp["ssm_states"][inp["cache_indices"].long()]}

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        """Output and final states against ``ref`` in relative error norm; untouched slots exact."""
        varlen = case.params["varlen"]
        mine = {k: (v.clone() if k in self.mutated else v) for k, v in inp.items()}
        theirs = {k: (v.clone() if k in self.mutated else v) for k, v in inp.items()}
        if varlen and prov.fn.style == "mamba_ssm":  # it starts every sequence from zero
            theirs["has_initial_state"] = torch.zeros_like(inp["has_initial_state"])
        try:
            got = self.results(prov, case, mine)
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        try:
            want = self.results(ref, case, theirs)
        except Exception as exc:  # noqa: BLE001
            return f"ref error: {describe(exc)}"
        problems = [compare_relative(name, got[name], want[name], REL_TOL) for name in want]
        if varlen and prov.fn.style in ("fastmamba", "vllm"):
            used = set(inp["cache_indices"].tolist())
            untouched = [s for s in range(inp["ssm_states"].shape[0]) if s not in used]
            if not torch.equal(mine["ssm_states"][untouched], inp["ssm_states"][untouched]):
                problems.append("ssm_states: a slot outside cache_indices changed")
        problems = [p for p in problems if p]
        return "ok" if not problems else "FAIL " + "; ".join(problems)


BENCH = SsdScanBench()
