"""Mamba-2 language model for inference: embeddings -> N x (RMSNorm -> mixer -> residual) -> norm -> lm_head.

Module names follow Hugging Face's ``Mamba2ForCausalLM`` (``backbone.embeddings``,
``backbone.layers.{i}.norm|mixer``, ``backbone.norm_f``, ``lm_head``).

With a ``StateCache``: ``prefill_varlen`` runs B prompts of any lengths packed into one call
(``cu_seqlens``) and returns each prompt's last-token logits; ``prefill`` is its equal-length
[B, L] form; ``decode`` advances every request by one token. With a speculative cache
(``new_cache(..., speculate=K)``), ``verify`` scores T = K+1 tokens per request and
``commit`` keeps each request's accepted prefix, on one of three paths per step: "replay"
(replay-based rollback: nothing is copied), "legacy" (a state per position, then a copy of the
accepted one) or "plain" (one token per request, nothing drafted).

16-bit SSM states (``new_cache(..., ssm_dtype=torch.float16 | torch.bfloat16)``) are stored with
round to nearest, or stochastically when ``prefill_varlen`` / ``prefill`` / ``decode`` / ``verify``
get ``rand_seed``: an int64 [n_layer] device tensor, layer i rounding with element i
(``fastmamba.generation.rounding.StochasticRounding`` keeps and advances it).

Nothing derived from the weights is cached (the kernels read ``A_log`` and compute -exp in fp32), so
an in-place weight change is seen by the next eager call and the next CUDA-graph replay alike, and
every method runs under ``torch.inference_mode()`` as outside it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastmamba.cache.prefix_cache import DeviceSnapshots, SnapshotPlan, device_layer_snapshots, layer_snapshots
from fastmamba.cache.state_cache import StateCache
from fastmamba.generation.rounding import check_rand_seed
from fastmamba.layers.mamba2 import DecodeTricks, Mamba2Mixer
from fastmamba.models.config import Mamba2Config
from fastmamba.models.inputs import check_index_tensor, embed, host_metadata
from fastmamba.ops import add_rmsnorm
from fastmamba.ops.runtime import check_host_copies, host_reads_allowed, long_prefill_kernels, trusted_inputs


class RMSNorm(nn.Module):
    """RMSNorm weights of a block boundary; the LM applies them with the fused ``add_rmsnorm``."""

    def __init__(self, d: int, eps: float, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d, device=device, dtype=dtype))


class Mamba2Block(nn.Module):
    """norm + mixer; the residual add lives in the next boundary's fused add + RMSNorm."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)
        self.mixer = Mamba2Mixer(cfg, device=device, dtype=dtype)


class Mamba2Backbone(nn.Module):
    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = nn.ModuleList(Mamba2Block(cfg, device=device, dtype=dtype) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)


class Mamba2LM(nn.Module):
    """``forward(input_ids [B, L]) -> logits [B, L, V]`` (fp32); ``prefill`` / ``decode`` with a StateCache."""

    def __init__(self, cfg: Mamba2Config, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = Mamba2Backbone(cfg, device=device, dtype=dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _seed(self, rand_seed: torch.Tensor | None, who: str):
        """Layer i's one-element view of ``rand_seed`` (checked), as a function of i."""
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, who)
        return (lambda i: None) if rand_seed is None else (lambda i: rand_seed[i:i + 1])

    def _run(self, input_ids: torch.Tensor, mix, *, rows: torch.Tensor | None = None,
             defer_norm: bool = False, who: tuple[str, str] = ("Mamba2LM.forward", "input_ids")) -> torch.Tensor:
        """Embeddings -> blocks -> final norm -> fp32 logits (of the leading-dim ``rows`` only, if
        given); ``mix(i, mixer, normed)`` runs layer i's mixer, or ``mix(i, mixer, normed,
        norm_sumsq)`` with ``defer_norm`` (a prefill's ``forward_varlen``).

        Each block boundary is one fused kernel: residual += previous output, then RMSNorm. With
        ``defer_norm``, a mixer that ``defers_norm(tokens)`` leaves its own norm to that kernel: its
        output rows are scaled there by the 1 / rms its scan summed (``add_rmsnorm``'s
        ``pending_norm``), which saves the norm's pass over [T, d_inner].
        """
        rdtype = torch.float32 if self.cfg.residual_in_fp32 else self.dtype
        # the embedding runs first: an id outside the vocabulary fails before any state moves
        out, residual, pending = embed(self.backbone.embeddings, input_ids, *who), None, None
        for i, layer in enumerate(self.backbone.layers):
            mixer = layer.mixer
            normed, residual = add_rmsnorm(out, residual, layer.norm.weight, layer.norm.eps, residual_dtype=rdtype,
                                           pending_norm=pending)
            if defer_norm and mixer.defers_norm(normed.shape[0]):
                sumsq = mixer.new_norm_sumsq(normed.shape[0], normed.device)
                out, pending = mix(i, mixer, normed, sumsq), mixer.pending_norm(sumsq)
            else:
                out, pending = mix(i, mixer, normed), None
        if rows is not None:
            out, residual = out[rows], residual[rows]
            pending = None if pending is None else pending._replace(sumsq=pending.sumsq[rows])
        norm_f = self.backbone.norm_f
        normed, _ = add_rmsnorm(out, residual, norm_f.weight, norm_f.eps, residual_dtype=rdtype, pending_norm=pending)
        return self.lm_head(normed).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        check_index_tensor("Mamba2LM.forward", "input_ids", input_ids, "token ids")
        return self._run(input_ids, lambda i, mixer, h: mixer(h))

    def set_decode_tricks(self, **switches: bool) -> None:
        """Turn the mixers' decode optimisations on or off (see ``DecodeTricks``); for ablations."""
        for layer in self.backbone.layers:
            layer.mixer.tricks = DecodeTricks(**switches)

    def new_cache(self, num_slots: int, *, ssm_dtype: torch.dtype = torch.float32, speculate: int = 0) -> StateCache:
        """A slot pool for this model; ``speculate=K`` adds what ``verify`` with T = K+1 needs."""
        return StateCache(self.cfg, num_slots, device=self.lm_head.weight.device, conv_dtype=self.dtype,
                          ssm_dtype=ssm_dtype, speculate=speculate)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor, *,
                rand_seed: torch.Tensor | None = None) -> torch.Tensor:
        """Run B prompts of equal length [B, L] from their slots' states; returns the last logits [B, V].

        The packed call of ``prefill_varlen`` with ``cu_seqlens = [0, L, 2L, ...]``.
        """
        check_index_tensor("Mamba2LM.prefill", "input_ids", input_ids, "token ids")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"Mamba2LM.prefill: `input_ids` expected shape (B, L) with L >= 1, "
                             f"got {tuple(input_ids.shape)}")
        nreq, L = input_ids.shape
        cu_host = list(range(0, nreq * L + 1, L))
        cu_seqlens = torch.tensor(cu_host, dtype=torch.int32).to(input_ids.device, non_blocking=True)
        return self.prefill_varlen(input_ids.reshape(-1), cu_seqlens, cache, slots, rand_seed=rand_seed,
                                   cu_seqlens_host=cu_host)

    @torch.inference_mode()
    def prefill_varlen(
        self,
        input_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        cache: StateCache,
        slots: torch.Tensor,
        has_initial_state: torch.Tensor | bool = True,
        *,
        rand_seed: torch.Tensor | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        slots_host: Sequence[int] | None = None,
        snapshots: SnapshotPlan | DeviceSnapshots | None = None,
        live_seqs: int | None = None,
    ) -> torch.Tensor:
        """Run B prompts of any lengths packed into one call; returns each one's last-token logits [B, V] fp32.

        input_ids   [T] int64: the prompts back to back
        cu_seqlens  [B+1] int32/int64: prompt b is input_ids[cu_seqlens[b]:cu_seqlens[b+1]]; starts
                    at 0, ends at T, every prompt at least one token
        slots       [B] int32/int64: prompt b's row in every layer's conv and SSM pools, whose
                    states are mutated in place to the states after the prompt
        has_initial_state  True (default): every prompt continues from its slot's states (as
                    ``prefill``; a freshly allocated slot holds zeros); False: every prompt starts
                    from zeros and the old contents are not read; or a [B] bool tensor per prompt
        rand_seed   int64 [n_layer] device tensor or None: stochastic rounding of 16-bit states
        cu_seqlens_host, slots_host  the values of ``cu_seqlens`` and ``slots`` as the host already
                    holds them (the engine does), or None: then they are read from the tensors
        The batch's metadata is validated once, here, from host values: cu_seqlens starts at 0,
        never decreases, ends at T and leaves no prompt empty; every slot lies in [0, S) or is -1
        (padding), no two prompts share one. Tensors are read in one device-to-host copy (none
        when both host lists are given), and every layer's ops then run inside
        ``trusted_inputs()``: no per-layer host read or synchronize.
        snapshots   a ``fastmamba.cache.prefix_cache.SnapshotPlan`` or None: also copy the states
                    of some prompts after some of their chunks (prefix caching) into its pools,
                    taken from the chunked scan's per-chunk states as it runs; or a
                    ``DeviceSnapshots`` whose indices the caller checked against this call
                    (``snapshot_indices``) and holds on the device (a CUDA graph's static buffers)
        live_seqs   int or None: how many prompts are not padding, for the short-prompt scan's
                    tiles (None: counted from the slots); a graph capture passes its batch's count
                    to its all-padding warm-up too, so both run the same kernels
        With a speculative cache, the slots are left ready for ``verify`` (``StateCache.mark_prefilled``);
        a prompt may then continue from a slot's state only if no verify step ran on it since
        its last prefill (after one, the conv history is not right-aligned and the SSM state
        lags by the uncommitted replay).
        """
        check_index_tensor("Mamba2LM.prefill_varlen", "input_ids", input_ids, "token ids")
        if input_ids.dim() != 1:
            raise ValueError(f"Mamba2LM.prefill_varlen: `input_ids` expected shape (T,), got {tuple(input_ids.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"Mamba2LM.prefill_varlen: `cu_seqlens` expected shape (B+1,) with B >= 1, "
                             f"got {tuple(cu_seqlens.shape)}")
        nseq = cu_seqlens.shape[0] - 1
        if tuple(slots.shape) != (nseq,):
            raise ValueError(f"Mamba2LM.prefill_varlen: `slots` expected shape (B,)=({nseq},), "
                             f"got {tuple(slots.shape)}")
        cu, slot_values = self._host_metadata(cu_seqlens, slots, cu_seqlens_host, slots_host, input_ids)
        empty = [b for b in range(nseq) if cu[b + 1] <= cu[b]]
        T = input_ids.shape[0]
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            shown = cu if len(cu) <= 10 else cu[:5] + ["..."] + cu[-3:]
            raise ValueError(f"Mamba2LM.prefill_varlen: `cu_seqlens` must start at 0, never decrease and end at "
                             f"T={T} (input_ids' tokens); got {shown}")
        if empty:
            raise ValueError(f"Mamba2LM.prefill_varlen: every prompt needs at least one token; prompts {empty[:8]} "
                             f"have none (cu_seqlens of length {nseq + 1})")
        S = cache.num_slots
        bad = [v for v in slot_values if v != -1 and not 0 <= v < S]
        if bad:
            raise ValueError(f"Mamba2LM.prefill_varlen: `slots` values must lie in [0, {S}) (the cache's slots) or "
                             f"be -1 (padding); got {bad[:4]}")
        live = [v for v in slot_values if v != -1]
        if len(set(live)) != len(live):
            dup = sorted({v for v in live if live.count(v) > 1})
            raise ValueError(f"Mamba2LM.prefill_varlen: two prompts must not share a slot; slots {dup[:4]} appear "
                             "more than once")
        if live_seqs is not None and not (isinstance(live_seqs, int) and not isinstance(live_seqs, bool)
                                          and 0 <= live_seqs <= nseq):
            raise ValueError(f"Mamba2LM.prefill_varlen: `live_seqs` expected an int in [0, B={nseq}] or None, "
                             f"got {live_seqs!r}")
        if has_initial_state is True:
            flags = torch.ones(nseq, dtype=torch.bool, device=input_ids.device)
        elif has_initial_state is False:
            flags = None  # the ops then start every prompt from zeros without reading its slot
        else:
            flags = has_initial_state
        seed = self._seed(rand_seed, "Mamba2LM.prefill_varlen")
        snap = ((lambda i: None) if snapshots is None
                else device_layer_snapshots(snapshots, self.cfg, input_ids.device)
                if isinstance(snapshots, DeviceSnapshots)
                else layer_snapshots(snapshots, cu, cache.conv[0].shape[-1], self.cfg, input_ids.device,
                                     "Mamba2LM.prefill_varlen"))
        last = cu_seqlens[1:] - 1
        # the longest prompt picks the scan's path (fused when short) and its tiles. Also while a
        # CUDA graph is captured: the warm-up before capture then runs the same kernels (nothing
        # compiles inside the capture); replays with other lengths of the bucket stay correct (both
        # paths take any length), with the capture batch's choice
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if live_seqs is None:  # the prompts that are not padding: the short-prompt scan's tiles are sized for them
            live_seqs = len(live)
        # validated above: the layers' ops read nothing on the host; a long prompt's scans take the
        # Hopper kernel (ops/ssd_scan/hopper.py), whose launch cost hides behind the queued layers
        with trusted_inputs(), long_prefill_kernels(T):
            logits = self._run(
                input_ids,
                lambda i, mixer, h, norm_sumsq=None: mixer.forward_varlen(
                    h, cu_seqlens, cache.conv[i], cache.ssm[i], slots, flags, rand_seed=seed(i), snapshot=snap(i),
                    max_seqlen=longest, live_seqs=live_seqs, norm_sumsq=norm_sumsq),
                rows=last, defer_norm=True, who=("Mamba2LM.prefill_varlen", "input_ids"),
            )
            if cache.speculate:
                cache.mark_prefilled(slots)
        return logits

    def _host_metadata(self, cu_seqlens: torch.Tensor, slots: torch.Tensor, cu_host: Sequence[int] | None,
                       slots_host: Sequence[int] | None, input_ids: torch.Tensor) -> tuple[list[int], list[int]]:
        """(cu_seqlens, slots) as host int lists: the given host copies, else one read of both tensors
        (which checks the token ids' range too: ``fastmamba.models.inputs.host_metadata``)."""
        who = "Mamba2LM.prefill_varlen"
        for name, t in (("cu_seqlens", cu_seqlens), ("slots", slots)):
            if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int32, torch.int64):
                raise TypeError(f"{who}: `{name}` expected an int32 or int64 tensor, got "
                                f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        check_host_copies(who, (("cu_seqlens_host", cu_host, cu_seqlens), ("slots_host", slots_host, slots)))
        if cu_host is not None and slots_host is not None:
            return [int(v) for v in cu_host], [int(v) for v in slots_host]
        if not host_reads_allowed(cu_seqlens):
            raise ValueError(f"{who}: cu_seqlens and slots cannot be read on the host here (CUDA-graph capture, "
                             "torch.compile tracing or trusted_inputs()); pass `cu_seqlens_host` and `slots_host`")
        cu, sl = host_metadata(who, "input_ids", input_ids, self.cfg.vocab_size, [cu_seqlens, slots])  # one read
        cu = [int(v) for v in cu_host] if cu_host is not None else cu
        return cu, [int(v) for v in slots_host] if slots_host is not None else sl

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor, *,
               rand_seed: torch.Tensor | None = None) -> torch.Tensor:
        """One token per request [B] -> next-token logits [B, V]; the slots' states advance in place.
        rand_seed: int64 [n_layer] device tensor or None (stochastic rounding of 16-bit states)."""
        check_index_tensor("Mamba2LM.decode", "token_ids", token_ids, "token ids")
        check_index_tensor("Mamba2LM.decode", "slots", slots, "cache slots")
        seed = self._seed(rand_seed, "Mamba2LM.decode")
        return self._run(token_ids,
                         lambda i, mixer, h: mixer.step(h, cache.conv[i], cache.ssm[i], slots, rand_seed=seed(i)),
                         who=("Mamba2LM.decode", "token_ids"))

    @torch.inference_mode()
    def verify(self, token_ids: torch.Tensor, cache: StateCache, slots: torch.Tensor, *,
               path: str = "replay", rand_seed: torch.Tensor | None = None) -> torch.Tensor:
        """Score T tokens per request: token_ids [B, T] int64 -> logits [B, T, V] fp32.

        token_ids  row b: [the request's last emitted token, its K drafts]; logits[b, t] predicts
                   the token after token_ids[b, t]
        cache      built with ``speculate=K``; T = K+1 (T = 1 on the plain path)
        slots      [B] int32/int64, one per request; -1 marks a padding row (zero logits' input,
                   no state touched: the CUDA-graph buckets)
        path       "replay" (default): the replay op (rollback by replaying the accepted history);
                   "legacy": the per-position path, a state per position into the cache's legacy
                   buffers (B <= ``cache.legacy_max_batch``); "plain": T = 1, one decode step.
                   Legacy and plain read the slots' SSM states directly: their replay histories
                   must be empty (after prefill, after a legacy or plain commit, or after
                   ``cache.flush(slots)``). See ``Mamba2Mixer.verify``.
        rand_seed  int64 [n_layer] device tensor or None: stochastic rounding of the 16-bit states
                   the step stores (replay checkpoints, the plain path's state)
        Call ``commit`` with the same path and the accepted counts before the next verify on these
        slots. No host sync of its own (the ops' index checks read the slots once, except while
        a CUDA graph is being captured).
        """
        check_index_tensor("Mamba2LM.verify", "token_ids", token_ids, "token ids")
        check_index_tensor("Mamba2LM.verify", "slots", slots, "cache slots")
        if not cache.speculate:
            raise ValueError("Mamba2LM.verify: the cache was built without speculation; use new_cache(..., speculate=K)")
        if path not in ("replay", "legacy", "plain"):
            raise ValueError(f'Mamba2LM.verify: `path` expected "replay", "legacy" or "plain", got {path!r}')
        ntok_expected = 1 if path == "plain" else cache.tokens_per_step
        if token_ids.dim() != 2 or token_ids.shape[1] != ntok_expected:
            what = "T = 1 on the plain path" if path == "plain" else f"T = K+1 = {cache.tokens_per_step}"
            raise ValueError(f"Mamba2LM.verify: `token_ids` expected shape (B, T) with {what}, "
                             f"got {tuple(token_ids.shape)}")
        nreq, ntok = token_ids.shape
        if tuple(slots.shape) != (nreq,):
            raise ValueError(f"Mamba2LM.verify: `slots` expected shape (B,)=({nreq},), got {tuple(slots.shape)}")
        conv_accepted = cache.conv_accepted[slots.long()]
        inter = cache.legacy_intermediate(nreq) if path == "legacy" else [None] * self.cfg.n_layer
        no_dst = cache.legacy_no_dst(nreq) if path == "legacy" else None
        seed = self._seed(rand_seed, "Mamba2LM.verify")

        def mix(i, mixer, h):
            out = mixer.verify(h.view(nreq, ntok, -1), cache.conv[i], cache.replay[i], slots, conv_accepted,
                               path=path, intermediate_states=inter[i], no_dst=no_dst, rand_seed=seed(i))
            return out.view(nreq * ntok, -1)

        return self._run(token_ids.reshape(-1), mix, who=("Mamba2LM.verify", "token_ids")).view(nreq, ntok, -1)

    def commit(self, cache: StateCache, slots: torch.Tensor, accepted: torch.Tensor, *, path: str = "replay") -> None:
        """After ``verify`` on ``path``: request b keeps its first ``accepted[b]`` inputs (1..T: the
        last emitted token plus the accepted drafts; 1 on the plain path). "replay":
        ``StateCache.commit``; "legacy": ``StateCache.commit_legacy`` (copies the accepted
        position's state into the slot); "plain": ``StateCache.commit_plain``."""
        cache.commit_path(slots, accepted, path, "Mamba2LM.commit")
