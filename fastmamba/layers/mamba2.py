"""Mamba-2 mixer: ``forward_varlen`` runs packed prompts (prefill), ``step`` one token per request
(decode), ``verify`` T = K+1 tokens per request (speculative decoding: replay, legacy or plain path).

Parameter names follow Hugging Face's ``Mamba2Mixer`` (and mamba_ssm's ``Mamba2``), so both
checkpoint formats load without renaming inside a layer:

    in_proj   [d_in_proj, d_model]   -> z [d_inner] | xBC [E] | dt [H]      (E = d_inner + 2 G N)
    conv1d    weight [E, 1, W], bias [E]  depthwise causal conv + silu over xBC
    dt_bias, A_log, D   [H]
    norm      gated RMSNorm over d_inner in G groups: norm(y * silu(z))  (norm_before_gate=False)
    out_proj  [d_model, d_inner]

Prefill packs B prompts of any lengths into T tokens (``cu_seqlens`` [B+1]): one in_proj over all
of them, ``causal_conv1d_varlen`` on the xBC columns of its output (read in place, no copy) and
``ssd_scan_varlen`` (the chunked scan, ``cfg.chunk_size`` tokens per chunk); both continue from
and write back each prompt's cache slot. ``forward`` (equal lengths [B, L], with or without a
cache) packs its batch and runs the same path.

The decode step uses fastmamba's kernels with the tricks of the decode-kernel issue: the kernels
read ``A_log`` itself and compute A = -exp(A_log) in fp32 where they load it (``A_is_log=True``; a
stride-0 [H, P, N] view of A_log where the op wants that shape), the silu(z) gate runs inside
``selective_state_update`` so the norm takes its z=None path, the conv window stays in registers
(``causal_conv1d_update``), and a step of at most 16 requests runs in_proj and out_proj as
fastmamba's ``gemv`` (it can start under PDL before the kernel ahead of it ends; cuBLAS cannot).
The first two apply to prefill and verification as well (the scan gates inside).

Nothing derived from the weights is cached: a CUDA graph captured before an in-place weight change
(``A_log.sub_()``, ``load_state_dict``, ``param.data.mul_()``) reads the new values at its next
replay, and the layer runs the same under ``torch.inference_mode()`` and ``torch.compile``.

16-bit SSM states: ``step``, ``verify`` and ``forward_varlen`` take ``rand_seed`` (a one-element
int64 device tensor, or None for round to nearest) and hand it to every op that stores the state;
``fastmamba.generation.rounding`` keeps one per layer and advances it between steps.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fastmamba.ops import PendingNorm, RMSNormGated, causal_conv1d_update, causal_conv1d_varlen, selective_state_update
from fastmamba.ops.gemv import gemv, gemv_covers
from fastmamba.ops.replay import ReplayCache, replay_selective_state_update
from fastmamba.ops.snapshot_copy import copy_snapshots
from fastmamba.ops.ssd_scan import ssd_scan_varlen
from fastmamba.ops.runtime import NORM_SPAN

if TYPE_CHECKING:  # (``snapshot``: a fastmamba.cache.prefix_cache.LayerSnapshot; the cache room sits above this one)
    LayerSnapshot = object


class MambaSizes:
    """The sizes a Mamba-2 layer derives from ``d_inner`` (D), ``headdim`` (P), ``ngroups`` (G) and
    ``d_state`` (N): shared by ``MambaLayerConfig`` and the model configs that hold those fields."""

    @property
    def nheads(self) -> int:  # H
        return self.d_inner // self.headdim

    @property
    def conv_dim(self) -> int:  # E = d_inner + 2 G N: the channels the conv sees (x, B, C)
        return self.d_inner + 2 * self.ngroups * self.d_state

    @property
    def d_in_proj(self) -> int:  # z, xBC, dt
        return self.d_inner + self.conv_dim + self.nheads


@dataclasses.dataclass(frozen=True)
class MambaLayerConfig(MambaSizes):
    """What one ``Mamba2Mixer`` and the Mamba slot pools (``fastmamba.cache.StateCache``) read.

    The model configs build it (``Mamba2Config.mamba``, ``NemotronHConfig.mamba``); letters as in
    STYLE.md: D = d_inner = H*P, G groups, N state, W conv width, E = D + 2 G N conv channels.
    ``n_layer`` counts the model's Mamba layers (the cache's pools), not all of its layers.
    """

    d_model: int
    d_inner: int                      # D (Mamba-2: expand * d_model; Nemotron-H: heads * head dim)
    n_layer: int = 1                  # Mamba layers in the model
    d_state: int = 128                # N
    d_conv: int = 4                   # W
    headdim: int = 64                 # P
    ngroups: int = 1                  # G
    chunk_size: int = 256
    norm_eps: float = 1e-5
    conv_bias: bool = True
    proj_bias: bool = False           # in_proj / out_proj bias
    norm_before_gate: bool = False    # Mamba-2's gated norm gates first: norm(y * silu(z))
    dt_limit: tuple[float, float] = (0.0, math.inf)


@dataclasses.dataclass(frozen=True)
class DecodeTricks:
    """Switches for the decode step's optimisations, so a benchmark can show each one's effect.

    A_in_kernel    the kernels compute A = -exp(A_log) from A_log where they load it (off: PyTorch
                   computes it every layer, every step, and the kernels read A)
    gate_in_scan   silu(z) applied inside the state update, norm without z (off: gate in the norm);
                   prefill follows both switches (its scan takes the same A and gates the same way)
    fused_conv     conv window kept in registers by causal_conv1d_update (off: PyTorch ops that
                   shift the state in memory and re-read it, as a plain implementation does)
    triton_gemv    the projections (GEMV_PROJECTIONS) of a decode or verify step, or a prefill, of
                   at most 16 rows (tokens) run as fastmamba's ``gemv``, which can start under PDL
                   before the kernel ahead of it ends (off: ``nn.Linear``, i.e. cuBLAS, which
                   never overlaps)
    norm_in_scan   prefill of at least DEFER_NORM_MIN_TOKENS packed tokens through ``Mamba2LM``
                   (where ``defers_norm``): the mixer's norm is
                   deferred, the scan writing y * norm_weight and each token's sums of y^2, and
                   the next block boundary (``add_rmsnorm``'s ``pending_norm``) scaling out_proj's
                   rows by 1 / rms (off: the norm's own pass, a read and a write of y [T, d_inner])
    """

    A_in_kernel: bool = True
    gate_in_scan: bool = True
    fused_conv: bool = True
    triton_gemv: bool = True
    norm_in_scan: bool = True


GEMV_PROJECTIONS = ("in_proj", "out_proj")  # which projections ``triton_gemv`` covers
# ``norm_in_scan`` defers the norm of prefills of at least this many packed tokens. Measured on an
# H200 (bench ttft, mamba2-2.7b bf16, deferred vs the norm's own pass, same job): graphed 1 x 16
# 3.08-3.20 vs 2.53-2.63 ms, 1 x 64 3.26-3.38 vs 3.23, 1 x 128 3.74 vs 3.70, 1 x 512 7.82 vs 8.03;
# eager 8 x 2048 189.9 vs 194.4, 32 x 512 191.3 vs 194.5. Short prompts lose (under PDL the chain
# without the norm kernel ran slower; not understood), long ones save the norm's pass over y.
DEFER_NORM_MIN_TOKENS = 256


def _conv_update_torch(x, conv_state, weight, bias, slots):
    """The unfused decode conv: gather, shift in memory, write back, then a separate conv and silu."""
    rows = slots.long()
    window = torch.cat([conv_state[rows, :, 1:], x.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    conv_state[rows] = window
    return F.silu((window * weight).sum(-1) + (bias if bias is not None else 0)).to(x.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: MambaLayerConfig, device=None, dtype=None):
        super().__init__()
        self.tricks = DecodeTricks()
        if tuple(cfg.dt_limit) != (0.0, math.inf):
            raise NotImplementedError(f"Mamba2Mixer: dt_limit={cfg.dt_limit} is not supported (only (0, inf))")
        self.cfg = cfg
        kw = dict(device=device, dtype=dtype)
        E, H = cfg.conv_dim, cfg.nheads
        self.in_proj = nn.Linear(cfg.d_model, cfg.d_in_proj, bias=cfg.proj_bias, **kw)
        self.conv1d = nn.Conv1d(E, E, kernel_size=cfg.d_conv, groups=E, padding=cfg.d_conv - 1, bias=cfg.conv_bias, **kw)
        self.dt_bias = nn.Parameter(torch.empty(H, device=device, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(H, device=device, dtype=torch.float32))
        self.D = nn.Parameter(torch.empty(H, device=device, dtype=torch.float32))
        self.norm = RMSNormGated(cfg.d_inner, eps=cfg.norm_eps, group_size=cfg.d_inner // cfg.ngroups,
                                 norm_before_gate=cfg.norm_before_gate, **kw)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.proj_bias, **kw)

    @torch.no_grad()
    def reset_ssm_parameters(self, generator: torch.Generator | None = None) -> None:
        """Mamba-2's initialisation of A_log, dt_bias and D (used by the random presets)."""
        H = self.cfg.nheads
        dev = self.A_log.device
        self.A_log.copy_(torch.log(torch.empty(H).uniform_(1, 16, generator=generator)).to(dev))
        dt = torch.exp(torch.rand(H, generator=generator) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        dt = dt.clamp(min=1e-4)
        self.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(dev))  # inverse softplus
        self.D.fill_(1.0)

    def _split(self, zxbcdt: torch.Tensor):
        c = self.cfg
        return torch.split(zxbcdt, [c.d_inner, c.conv_dim, c.nheads], dim=-1)

    def _split_xbc(self, xbc: torch.Tensor):
        c = self.cfg
        return torch.split(xbc, [c.d_inner, c.ngroups * c.d_state, c.ngroups * c.d_state], dim=-1)

    def _project(self, name: str, u: torch.Tensor) -> torch.Tensor:
        """self.<name>(u) for the rows [..., K] of a decode or verify step or a prefill: ``gemv``
        when ``triton_gemv`` covers it (CUDA, 16-bit, at most 16 rows), else the nn.Linear (cuBLAS).
        A layer with ``reduce_output`` (``fastmamba.distributed.layers.RowParallelLinear``) gets its
        partial product summed over the tensor-parallel ranks after ``gemv`` too."""
        layer = getattr(self, name)
        if self.tricks.triton_gemv and name in GEMV_PROJECTIONS and gemv_covers(u, layer.weight):
            out = gemv(u, layer.weight, layer.bias)
            reduce = getattr(layer, "reduce_output", None)  # tensor parallel: a row-parallel out_proj's all-reduce
            return out if reduce is None else reduce(out)
        return layer(u)

    def defers_norm(self, tokens: int) -> bool:
        """Whether a prefill of ``tokens`` packed tokens may leave the norm to the next block
        boundary (``norm_in_scan``, from DEFER_NORM_MIN_TOKENS tokens on): the norm is one group
        over d_inner with no bias, gated in the scan (then 1 / rms is a per-token scale that
        commutes with out_proj), the head dim a multiple of 16, and out_proj not row-parallel
        (tensor parallel: the rms would need every rank's sums)."""
        c, n = self.cfg, self.norm
        return (self.tricks.norm_in_scan and tokens >= DEFER_NORM_MIN_TOKENS and self._gate_in_scan()
                and getattr(self.out_proj, "reduce_output", None) is None and type(n) is RMSNormGated
                and getattr(n, "bias", None) is None and n.group_size == c.d_inner
                and c.headdim % NORM_SPAN.value == 0)

    def new_norm_sumsq(self, tokens: int, device: torch.device) -> torch.Tensor:
        """An uninitialised [tokens, d_inner / 16] fp32 buffer for ``forward_varlen``'s ``norm_sumsq``."""
        return torch.empty(tokens, self.cfg.d_inner // NORM_SPAN.value, dtype=torch.float32, device=device)

    def pending_norm(self, norm_sumsq: torch.Tensor) -> PendingNorm:
        """The deferred norm of a ``forward_varlen(..., norm_sumsq=...)`` call, for ``add_rmsnorm``."""
        return PendingNorm(norm_sumsq, self.cfg.d_inner, self.norm.eps)

    def _gate_in_scan(self) -> bool:
        # silu(z) can run inside the state update only when the norm gates before normalising
        return self.tricks.gate_in_scan and not self.cfg.norm_before_gate

    def _A_heads(self) -> tuple[torch.Tensor, bool]:
        """(A, A_is_log) per head for the ops: ``A_log`` [H] itself, the kernels computing -exp in
        fp32 (``A_in_kernel``), or -exp(A_log) [H] fp32 computed now. Never cached: a weight
        changed in place (eagerly, or between CUDA-graph replays) is read afresh."""
        if self.tricks.A_in_kernel:
            return self.A_log, True
        return -torch.exp(self.A_log.float()), False

    def _A(self) -> tuple[torch.Tensor, bool]:
        """``_A_heads`` as the [H, P, N] stride-0 view that ``selective_state_update`` takes."""
        c = self.cfg
        A, is_log = self._A_heads()
        return A[:, None, None].expand(c.nheads, c.headdim, c.d_state), is_log

    def forward(
        self,
        u: torch.Tensor,
        conv_state: torch.Tensor | None = None,
        ssm_state: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill of B prompts of equal length: u [B, L, d_model] -> [B, L, d_model].

        With a cache, ``conv_state`` [S, E, W] and ``ssm_state`` [S, H, P, N] hold each request's
        state in row ``slots[b]`` (int32 [B]); the prompt continues from it and the final states
        are written back in place. Without one, every request starts from zeros (scratch states).
        Packs the batch into B*L tokens and runs ``forward_varlen``.
        """
        c = self.cfg
        nreq, L, d_model = u.shape
        if (conv_state is None) != (ssm_state is None):
            raise ValueError("Mamba2Mixer.forward: pass both conv_state and ssm_state (a cache) or neither")
        cu_seqlens = torch.arange(0, nreq * L + 1, L, dtype=torch.int32, device=u.device)
        if conv_state is None:
            conv_state = u.new_empty(nreq, c.conv_dim, c.d_conv - 1)  # not read: no initial state
            ssm_state = torch.empty(nreq, c.nheads, c.headdim, c.d_state, device=u.device, dtype=torch.float32)
            slots, has_initial_state = None, None
        else:
            if slots is None:
                raise ValueError("Mamba2Mixer.forward: a cache needs `slots`")
            has_initial_state = torch.ones(nreq, dtype=torch.bool, device=u.device)
        out = self.forward_varlen(u.reshape(nreq * L, d_model), cu_seqlens, conv_state, ssm_state, slots,
                                  has_initial_state)
        return out.view(nreq, L, -1)

    def forward_varlen(
        self,
        u: torch.Tensor,
        cu_seqlens: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        slots: torch.Tensor | None = None,
        has_initial_state: torch.Tensor | None = None,
        *,
        rand_seed: torch.Tensor | None = None,
        snapshot: LayerSnapshot | None = None,
        max_seqlen: int | None = None,
        live_seqs: int | None = None,
        norm_sumsq: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill of B packed prompts of any lengths: u [T, d_model] -> [T, d_model].

        cu_seqlens  [B+1] int32/int64: prompt b is tokens cu_seqlens[b] .. cu_seqlens[b+1]-1
        conv_state  [S, E, W]      rows slots[b] mutated in place: the prompt's last W conv inputs
                                   (older history kept for prompts shorter than W)
        ssm_state   [S, H, P, N]   rows slots[b] mutated in place: the state after the prompt
        slots       [B] int32/int64 or None (prompt b uses row b); -1 marks a padding prompt
                    (zero output, no state touched)
        has_initial_state [B] bool or None (all False): prompt b continues from its rows' states;
                    otherwise it starts from zeros and the old contents are not read
        rand_seed   one-element int64 device tensor or None: with a 16-bit ``ssm_state``, the final
                    states are rounded stochastically with it (None: round to nearest)
        snapshot    ``fastmamba.cache.prefix_cache.LayerSnapshot`` or None: also copy the states at
                    chunk ends it names into its pools (prefix caching), from the scan's chunk states
        max_seqlen  int or None: the longest prompt, when the caller knows it on the host; lets the
                    scan pick its short-prompt path without reading cu_seqlens (ssd_scan_varlen)
        live_seqs   int or None: how many prompts are not padding (slot -1), when the caller knows;
                    sizes the short-prompt scan's tiles for them (ssd_scan_varlen)
        norm_sumsq  [T, d_inner / 16] fp32 or None (only where ``defers_norm(T)``): the norm is left
                    to the caller: the result is out_proj(y * norm.weight), its rows not yet divided
                    by rms(y), and norm_sumsq receives the sums that the caller's next
                    ``add_rmsnorm`` takes as ``pending_norm=self.pending_norm(norm_sumsq)``
        The ops read cu_seqlens and slots on the host for their checks (see their docstrings),
        except inside ``fastmamba.ops._common.host_values.trusted_inputs()``.
        """
        c = self.cfg
        T = u.shape[0]
        H, P, N, G = c.nheads, c.headdim, c.d_state, c.ngroups
        if norm_sumsq is not None and not self.defers_norm(T):
            raise ValueError("Mamba2Mixer.forward_varlen: `norm_sumsq` given but this mixer cannot defer its norm "
                             "(see defers_norm: the norm_in_scan switch, enough tokens, one norm group, no norm bias, "
                             "gate in the scan, head dim a multiple of 16, no tensor-parallel out_proj)")
        z, xbc_in, dt = self._split(self._project("in_proj", u))  # column views of one [T, d_in_proj] buffer
        xbc = causal_conv1d_varlen(xbc_in, self.conv1d.weight.squeeze(1), self.conv1d.bias, conv_state, cu_seqlens,
                                   slots, has_initial_state, "silu")
        x, B, C = self._split_xbc(xbc)
        gate = z.reshape(T, H, P) if self._gate_in_scan() else None
        A, A_is_log = self._A_heads()
        y = ssd_scan_varlen(
            x.reshape(T, H, P), dt, A, B.reshape(T, G, N), C.reshape(T, G, N), ssm_state, cu_seqlens,
            chunk_size=c.chunk_size, D=self.D, z=gate, dt_bias=self.dt_bias, dt_softplus=True,
            cache_indices=slots, has_initial_state=has_initial_state, A_is_log=A_is_log, rand_seed=rand_seed,
            chunk_states_out=None if snapshot is None else snapshot.chunk_states, max_seqlen=max_seqlen,
            live_seqs=live_seqs, norm_weight=None if norm_sumsq is None else self.norm.weight, norm_sumsq=norm_sumsq,
        )
        if snapshot is not None:  # the states at the snapshot points: the conv's inputs there, the scan's chunk states
            copy_snapshots(snapshot.conv, snapshot.ssm, snapshot.rows, xbc_in, snapshot.conv_tokens,
                           snapshot.chunk_states, snapshot.chunk_rows)
        if norm_sumsq is None:
            y = self.norm(y.reshape(T, c.d_inner), None if self._gate_in_scan() else z)
        return self._project("out_proj", y.reshape(T, c.d_inner))

    def step(self, u: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor, slots: torch.Tensor, *,
             rand_seed: torch.Tensor | None = None) -> torch.Tensor:
        """Decode one token per request: u [B, d_model] -> [B, d_model]; states advance in place.

        rand_seed: one-element int64 device tensor or None; with a 16-bit ``ssm_state`` the new
        state is rounded stochastically with it (advance it between steps). No host read besides
        the ops' slot checks (skipped under CUDA-graph capture, torch.compile and trusted_inputs())."""
        c = self.cfg
        nreq = u.shape[0]
        H, P, N, G = c.nheads, c.headdim, c.d_state, c.ngroups
        z, xbc, dt = self._split(self._project("in_proj", u))
        if self.tricks.fused_conv:
            xbc = causal_conv1d_update(xbc, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, "silu",
                                       conv_state_indices=slots)
        else:
            xbc = _conv_update_torch(xbc, conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias, slots)
        x, B, C = self._split_xbc(xbc)
        gate = z.reshape(nreq, H, P) if self._gate_in_scan() else None
        A, A_is_log = self._A()
        y = selective_state_update(
            ssm_state, x.reshape(nreq, H, P), dt, A,
            B.reshape(nreq, G, N), C.reshape(nreq, G, N), self.D, gate, self.dt_bias, True, slots,
            A_is_log=A_is_log, rand_seed=rand_seed,
        )
        y = self.norm(y.reshape(nreq, c.d_inner), None if self._gate_in_scan() else z)
        return self._project("out_proj", y)

    def verify(
        self,
        u: torch.Tensor,
        conv_state: torch.Tensor,
        replay: ReplayCache,
        slots: torch.Tensor,
        conv_accepted: torch.Tensor,
        *,
        path: str = "replay",
        intermediate_states: torch.Tensor | None = None,
        no_dst: torch.Tensor | None = None,
        rand_seed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Speculative verification of T tokens per request: u [B, T, d_model] -> [B, T, d_model].

        conv_state     [S, E, W-1+K]  rows slots[b] mutated: the T new inputs are appended after
                       the history that ends ``conv_accepted[b]`` inputs into the previous step
                       (``causal_conv1d_update`` with ``num_accepted_tokens``; no copy on rollback)
        replay         the layer's ReplayCache; ``replay.state`` is the layer's SSM state pool
        slots          [B] int32/int64; pad rows (-1) get zero output and touch nothing
        conv_accepted  [B] int32/int64 in 1..T: tokens accepted by each request's previous step
                       (T right after prefill or a plain step)
        path           how the SSM part runs (the conv part is the same for all three):
          "replay"  ``replay_selective_state_update``: the accepted history is replayed onto the
                    stored state, this step's inputs appended to it (no per-token state)
          "legacy"  multi-token ``selective_state_update`` from ``replay.state`` writing the state
                    after every position into ``intermediate_states`` [B, T, H, P, N] (state
                    dtype); ``no_dst`` [B] int32 of -1 (``StateCache.legacy_no_dst``) or None:
                    with it the final state is not written to the slot (the commit copies the
                    accepted position's state there, ``StateCache.commit_legacy``)
          "plain"   T = 1: single-token ``selective_state_update`` on ``replay.state`` in place
                    (``StateCache.commit_plain`` afterwards)
        rand_seed      one-element int64 device tensor or None: a 16-bit state stored by the step
                       (replay: at its checkpoints; plain: in place) is rounded stochastically
                       with it. The legacy path's per-position states are rounded to nearest
                       (``selective_state_update`` rounds only the state it stores in the pool).
                    Legacy and plain read ``replay.state`` as the state after the last accepted
                    token: the slots' replay histories must be empty (``StateCache.flush``).
        Output t depends on inputs 0..t only. Nothing is committed here: the caller commits the
        accepted counts (``StateCache.commit`` / ``commit_legacy`` / ``commit_plain``) before the
        next verify on these slots.
        """
        c = self.cfg
        nreq, ntok, _ = u.shape
        H, P, N, G, E = c.nheads, c.headdim, c.d_state, c.ngroups, c.conv_dim
        if path not in ("replay", "legacy", "plain"):
            raise ValueError(f'Mamba2Mixer.verify: `path` expected "replay", "legacy" or "plain", got {path!r}')
        if path == "plain" and ntok != 1:
            raise ValueError(f"Mamba2Mixer.verify: the plain path takes one token per request, got u of shape "
                             f"{tuple(u.shape)}")
        if path == "legacy" and intermediate_states is None:
            raise ValueError("Mamba2Mixer.verify: the legacy path needs `intermediate_states` [B, T, H, P, N]")
        z, xbc, dt = self._split(self._project("in_proj", u))  # [B, T, *] column views
        # the conv works on [B, E, T]: transposed views in and out, so xbc stays [B, T, E] contiguous
        conv_out = u.new_empty(nreq, ntok, E)
        causal_conv1d_update(xbc.transpose(1, 2), conv_state, self.conv1d.weight.squeeze(1), self.conv1d.bias,
                             "silu", conv_state_indices=slots, num_accepted_tokens=conv_accepted,
                             out=conv_out.transpose(1, 2))
        x, B, C = self._split_xbc(conv_out)
        gate = z.reshape(nreq, ntok, H, P) if self._gate_in_scan() else None
        x, B, C = x.reshape(nreq, ntok, H, P), B.reshape(nreq, ntok, G, N), C.reshape(nreq, ntok, G, N)
        if path == "replay":
            A, A_is_log = self._A_heads()
            y = replay_selective_state_update(
                *replay, x, dt, A, B, C, self.D, gate, self.dt_bias, True, slots,
                A_is_log=A_is_log, rand_seed=rand_seed,
            )
        elif path == "legacy":
            A, A_is_log = self._A()
            y = selective_state_update(
                replay.state, x, dt, A, B, C, self.D, gate, self.dt_bias, True, slots,
                dst_state_batch_indices=no_dst, intermediate_states=intermediate_states,
                A_is_log=A_is_log, rand_seed=rand_seed,
            )
        else:
            A, A_is_log = self._A()
            y = selective_state_update(
                replay.state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], self.D,
                None if gate is None else gate[:, 0], self.dt_bias, True, slots,
                A_is_log=A_is_log, rand_seed=rand_seed,
            )
        y = self.norm(y.reshape(nreq * ntok, c.d_inner), None if self._gate_in_scan() else z.reshape(-1, c.d_inner))
        return self._project("out_proj", y).view(nreq, ntok, -1)
