"""One language model over a layer pattern: embeddings -> blocks -> norm_f -> lm_head.

``cfg.pattern`` picks each layer's kind (``fastmamba.models.blocks``: M Mamba-2, * attention,
- MLP, E MoE); a Mamba-2 LM is the pattern of n_layer x M (``Mamba2Config.pattern``), a Nemotron-H
hybrid its ``hybrid_override_pattern``. Module names follow transformers (``backbone.embeddings``,
``backbone.layers.{i}.norm|mixer``, ``backbone.norm_f``, ``lm_head``, tied to the embeddings when
``cfg.tie_embeddings``). The per-family files (``models/mamba2_lm.py``, ``models/nemotron_h.py``)
hold configs, presets and tensor names; ``Mamba2LM`` and ``NemotronHLM`` are this class by their
old names.

    forward(ids [B, L])                           -> logits [B, L, V] fp32, nothing cached
    new_cache(max_batch, ...)                     the model's cache (``cache.paged``: per-slot
                                                  lengths and, with attention layers, K/V pages)
    prefill_varlen(ids [T], cu_seqlens, cache, slots)  -> last-token logits [B, V]
    prefill(ids [B, L], cache, slots)             its equal-length form
    decode(ids [B], cache, slots) (= step)        -> next-token logits [B, V]
    verify(ids [B, T], cache, slots) / commit     speculative decoding (replay, legacy, plain)

Each block boundary is one fused kernel (residual += previous output, then the next RMSNorm:
``add_rmsnorm``). In a prefill, a Mamba block whose gated norm can wait (``defers_norm``) leaves
it to that kernel: its rows are scaled there by the 1 / rms its scan summed. 16-bit SSM states
round stochastically when a call gets ``rand_seed`` (int64 [n_layer] on the device: the j-th
Mamba layer uses element j; ``fastmamba.generation.rounding.StochasticRounding`` keeps it).

Nothing derived from the weights is cached (the kernels read ``A_log`` and compute -exp in fp32),
so an in-place weight change is seen by the next eager call and the next CUDA-graph replay alike,
and every method runs under ``torch.inference_mode()`` as outside it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from fastmamba.cache.hybrid_cache import HybridCache
from fastmamba.cache.prefix_cache import DeviceSnapshots, SnapshotPlan, device_layer_snapshots, layer_snapshots
from fastmamba.layers.attention import KVBatch, StagedPrefill, kv_cache_dtype_of
from fastmamba.layers.mamba2 import DecodeTricks
from fastmamba.models.blocks import Batch, RMSNorm, SpecBatch, build_blocks
from fastmamba.models.inputs import check_index_tensor, check_rand_seed, embed, host_metadata
from fastmamba.ops import add_rmsnorm
from fastmamba.ops.attention import PrefillWork, prefill_block_tokens, prefill_kv_values
from fastmamba.ops.runtime import check_host_copies, host_list, host_reads_allowed, long_prefill_kernels, trusted_inputs

PATHS = ("replay", "legacy", "plain")


def _check_slot_range(who: str, live: Sequence[int], num_slots: int) -> None:
    """ValueError unless every non-pad slot (``live``, host values) lies in [0, num_slots)."""
    bad = [v for v in live if not 0 <= v < num_slots]
    if bad:
        raise ValueError(f"{who}: `slots` values must lie in [0, {num_slots}) (the cache's slots) or "
                         f"be -1 (padding); got {bad[:4]}")


class Backbone(nn.Module):
    def __init__(self, cfg, device=None, dtype=None):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model, device=device, dtype=dtype)
        self.layers = build_blocks(cfg, device=device, dtype=dtype)
        self.norm_f = RMSNorm(cfg.d_model, cfg.norm_eps, device=device, dtype=dtype)


class HybridLM(nn.Module):
    """``forward(input_ids [B, L]) -> logits [B, L, V]`` (fp32); ``prefill_varlen`` / ``decode`` /
    ``verify`` with the cache of ``new_cache``. ``cfg``: any config with a ``pattern`` (a
    ``Mamba2Config`` or a ``NemotronHConfig``)."""

    def __init__(self, cfg, device=None, dtype=None):
        super().__init__()
        self.cfg = cfg
        self.backbone = Backbone(cfg, device=device, dtype=dtype)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False, device=device, dtype=dtype)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight
        self.keep_hidden = False  # True: _run keeps the lm_head input in last_hidden (an MTP drafter reads it)
        self.last_hidden: torch.Tensor | None = None
        # True (with keep_hidden): a prefill also keeps every position's lm_head input in all_hidden
        # [T, M] (its final norm then runs over all T positions, not only the B last ones)
        self.keep_all_hidden = False
        self.all_hidden: torch.Tensor | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def _who(self, method: str) -> str:
        return f"{type(self).__name__}.{method}"

    def _run(self, input_ids: torch.Tensor, mix, *, rows: torch.Tensor | None = None,
             hidden: torch.Tensor | None = None, defer_norm: bool = False, who: str = "",
             ids_name: str = "input_ids") -> torch.Tensor:
        """Embeddings (or ``hidden``, looked up by the caller before the cache moved) -> blocks ->
        final norm -> fp32 logits (of the leading-dim ``rows`` only, if given). ``mix(block,
        normed)`` runs one block; with ``defer_norm`` (prefill), ``mix(block, normed, norm_sumsq)``
        for a block that ``defers_norm(tokens)``, whose pending norm the next boundary applies."""
        rdtype = torch.float32 if self.cfg.residual_in_fp32 else self.dtype
        out = (embed(self.backbone.embeddings, input_ids, who or self._who("forward"), ids_name)
               if hidden is None else hidden)
        residual = pending = None
        for block in self.backbone.layers:
            normed, residual = add_rmsnorm(out, residual, block.norm.weight, block.norm.eps, residual_dtype=rdtype,
                                           pending_norm=pending)
            if defer_norm and block.defers_norm(normed.shape[0]):
                sumsq = block.mixer.new_norm_sumsq(normed.shape[0], normed.device)
                out, pending = mix(block, normed, sumsq), block.mixer.pending_norm(sumsq)
            else:
                out, pending = mix(block, normed), None
        keep_all = rows is not None and self.keep_hidden and self.keep_all_hidden
        if rows is not None and not keep_all:
            out, residual = out[rows], residual[rows]
            pending = None if pending is None else pending._replace(sumsq=pending.sumsq[rows])
        norm_f = self.backbone.norm_f
        normed, _ = add_rmsnorm(out, residual, norm_f.weight, norm_f.eps, residual_dtype=rdtype, pending_norm=pending)
        if keep_all:  # every position's final norm (row-wise: the ``rows`` of it equal a norm of those rows)
            self.all_hidden = normed
            normed = normed[rows]
        if self.keep_hidden:
            self.last_hidden = normed
        return self.lm_head(normed).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, L] int64 -> logits [B, L, V] fp32; every row starts fresh, nothing is cached."""
        who = self._who("forward")
        check_index_tensor(who, "input_ids", input_ids, "token ids")
        if input_ids.dim() != 2:
            raise ValueError(f"{who}: `input_ids` expected shape (B, L), got {tuple(input_ids.shape)}")
        return self._run(input_ids, lambda block, h: block(h), who=who)

    def set_decode_tricks(self, **switches: bool) -> None:
        """Turn the Mamba mixers' decode optimisations on or off (see ``DecodeTricks``); for ablations."""
        for block in self.backbone.layers:
            if block.kind == "M":
                block.mixer.tricks = DecodeTricks(**switches)

    def new_cache(self, max_batch: int, *, max_seq_len: int = 4096, page_size: int = 16, num_pages: int | None = None,
                  kv_budget_bytes: int | None = None, ssm_dtype: torch.dtype = torch.float32,
                  speculate: int = 0, kv_dtype: torch.dtype | None = None) -> HybridCache:
        """The cache for ``max_batch`` requests: Mamba slot pools (``ssm_dtype`` SSM states;
        ``speculate=K``: what ``verify`` with T = K+1 needs) and, for a hybrid (``cfg.paged_cache``),
        per-slot lengths and the attention layers' paged K/V (pages of ``page_size`` tokens:
        ``num_pages``, or as many as ``kv_budget_bytes`` holds, or enough for every request at
        ``max_seq_len``; ``kv_dtype`` their dtype, None: what the attention layers ask for,
        ``kv_cache_dtype_of``: float8 for a checkpoint with K/V scales, else the model's). A pure
        Mamba-2 LM's cache has an empty attention part and no lengths (``paged=False``; the K/V
        arguments are not used)."""
        c, dev = self.cfg, self.lm_head.weight.device
        if not c.paged_cache:
            return HybridCache(max_batch, mamba_cfg=c.mamba, n_attn_layers=0, device=dev, dtype=self.dtype,
                               ssm_dtype=ssm_dtype, speculate=speculate, paged=False)
        return HybridCache(
            max_batch, mamba_cfg=c.mamba if "M" in c.pattern else None, n_attn_layers=c.pattern.count("*"),
            n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, max_seq_len=max_seq_len, page_size=page_size,
            num_pages=num_pages, kv_budget_bytes=kv_budget_bytes, device=dev, dtype=self.dtype, ssm_dtype=ssm_dtype,
            speculate=speculate, kv_dtype=kv_dtype or kv_cache_dtype_of(self),
        )

    def prefill_block_tokens(self) -> int:
        """Query tokens per work item of the attention prefill kernel (``PrefillWork.block_m``) for
        this model's heads, dtype and device."""
        c = self.cfg
        return prefill_block_tokens(c.n_heads, c.n_kv_heads, c.head_dim, self.dtype, self.lm_head.weight.device)

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor, cache, slots: torch.Tensor, *,
                rand_seed: torch.Tensor | None = None) -> torch.Tensor:
        """Run B prompts of equal length [B, L] from their slots' states; returns the last logits [B, V].
        The packed call of ``prefill_varlen`` with ``cu_seqlens = [0, L, 2L, ...]``."""
        who = self._who("prefill")
        check_index_tensor(who, "input_ids", input_ids, "token ids")
        if input_ids.dim() != 2 or input_ids.shape[1] < 1:
            raise ValueError(f"{who}: `input_ids` expected shape (B, L) with L >= 1, got {tuple(input_ids.shape)}")
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
        cache,
        slots: torch.Tensor,
        has_initial_state: torch.Tensor | bool | None = None,
        *,
        rand_seed: torch.Tensor | None = None,
        cu_seqlens_host: Sequence[int] | None = None,
        slots_host: Sequence[int] | None = None,
        snapshots: SnapshotPlan | DeviceSnapshots | None = None,
        live_seqs: int | None = None,
        staged: StagedPrefill | None = None,
    ) -> torch.Tensor:
        """Run B prompts of any lengths packed into one call; returns each one's last-token logits [B, V] fp32.

        input_ids   [T] int64: the prompts back to back
        cu_seqlens  [B+1] int32/int64: prompt b is input_ids[cu_seqlens[b]:cu_seqlens[b+1]]; starts
                    at 0, ends at T, every prompt at least one token
        slots       [B] int32/int64: prompt b's row in every Mamba layer's pools (mutated in place
                    to the states after the prompt), distinct. A paged cache (``cache.paged``)
                    wants allocated slots (``cache.alloc``): a slot that has consumed tokens
                    continues from its states and attends to its cached K/V (chunked prefill);
                    an unpaged one takes any slot in [0, S) or -1 (padding)
        has_initial_state  unpaged cache: True or None (default): every prompt continues from its
                    slot's states (a fresh slot holds zeros); False: every prompt starts from zeros
                    and the old contents are not read; or a [B] bool tensor per prompt. Paged
                    cache: the cache's lengths decide (False while a slot holds tokens:
                    ValueError); with ``staged``, the [B] bool tensor that is used
        rand_seed   int64 [n_layer] device tensor or None: stochastic rounding of 16-bit SSM states
        cu_seqlens_host, slots_host  the values of ``cu_seqlens`` and ``slots`` as the host already
                    holds them (the engine does), or None: read from the tensors, in one
                    device-to-host copy with the token ids' range (none when both are given).
                    The metadata is validated once, here, from host values; every layer's ops
                    then run inside ``trusted_inputs()``: no per-layer host read or synchronize
        snapshots   a ``fastmamba.cache.prefix_cache.SnapshotPlan`` or None: also copy the Mamba
                    states of some prompts after some of their chunks (prefix caching) into its
                    pools, taken from the chunked scan's per-chunk states as it runs (K/V of those
                    positions stay in the slots' pages); or a ``DeviceSnapshots`` whose indices the
                    caller checked against this call and holds on the device (a CUDA graph's buffers)
        live_seqs   prompts that are not padding, for the short-prompt scan's tiles, or None:
                    counted from the slots (a graph capture passes its batch's count to its
                    all-padding warm-up too, so both run the same kernels)
        staged      (paged cache) None: the cache grows here (``HybridCache.grow``: K/V pages for the
                    new tokens) and the attention metadata go down in one copy. Or a
                    ``StagedPrefill``: the caller grew the cache and holds the metadata on the
                    device (``GraphedPrefill``'s static inputs); nothing is grown, uploaded or read
        With a speculative cache the slots are left ready for ``verify`` (``mark_prefilled``).
        """
        who = self._who("prefill_varlen")
        check_index_tensor(who, "input_ids", input_ids, "token ids")
        check_index_tensor(who, "cu_seqlens", cu_seqlens, "prompt offsets")
        check_index_tensor(who, "slots", slots, "cache slots")
        if input_ids.dim() != 1:
            raise ValueError(f"{who}: `input_ids` expected shape (T,), got {tuple(input_ids.shape)}")
        if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 2:
            raise ValueError(f"{who}: `cu_seqlens` expected shape (B+1,) with B >= 1, got {tuple(cu_seqlens.shape)}")
        nseq, T = cu_seqlens.shape[0] - 1, input_ids.shape[0]
        if tuple(slots.shape) != (nseq,):
            raise ValueError(f"{who}: `slots` expected shape (B,)=({nseq},), got {tuple(slots.shape)}")
        check_host_copies(who, (("cu_seqlens_host", cu_seqlens_host, cu_seqlens), ("slots_host", slots_host, slots)))
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, who)
        reads = [t for t, host in ((cu_seqlens, cu_seqlens_host), (slots, slots_host)) if host is None]
        if reads and not host_reads_allowed(cu_seqlens):
            raise ValueError(f"{who}: cu_seqlens and slots cannot be read on the host here (CUDA-graph capture, "
                             "torch.compile tracing or trusted_inputs()); pass `cu_seqlens_host` and `slots_host`")
        # (the token ids' range rides in that one read; without one, they meet the embedding first)
        read = host_metadata(who, "input_ids", input_ids, self.cfg.vocab_size, reads) if reads else []
        cu = [int(v) for v in cu_seqlens_host] if cu_seqlens_host is not None else read.pop(0)
        sl = [int(v) for v in slots_host] if slots_host is not None else read.pop(0)
        if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
            shown = cu if len(cu) <= 10 else cu[:5] + ["..."] + cu[-3:]
            raise ValueError(f"{who}: `cu_seqlens` must start at 0, never decrease and end at T={T} (input_ids' "
                             f"tokens); got {shown}")
        empty = [b for b in range(nseq) if cu[b + 1] <= cu[b]]
        if empty:
            raise ValueError(f"{who}: every prompt needs at least one token; prompts {empty[:8]} have none "
                             f"(cu_seqlens of length {nseq + 1})")
        live = [s for s in sl if s != -1]
        if cache.paged:
            if len(set(live)) != len(live) or (staged is None and len(live) != len(sl)):
                raise ValueError(f"{who}: `slots` must be distinct allocated slots, got {sl[:16]}")
        else:
            _check_slot_range(who, live, cache.num_slots)
            if len(set(live)) != len(live):
                dup = sorted({v for v in live if live.count(v) > 1})
                raise ValueError(f"{who}: two prompts must not share a slot; slots {dup[:4]} appear more than once")
            if staged is not None:
                raise ValueError(f"{who}: `staged` needs a paged cache (a model with a HybridCache)")
        if live_seqs is not None and not (isinstance(live_seqs, int) and not isinstance(live_seqs, bool)
                                          and 0 <= live_seqs <= nseq):
            raise ValueError(f"{who}: `live_seqs` expected an int in [0, B={nseq}] or None, got {live_seqs!r}")
        lens = [cu[b + 1] - cu[b] for b in range(nseq)]
        dev, hidden, kv = input_ids.device, None, None
        if staged is not None:
            flags, kv, snap = self._staged_inputs(staged, has_initial_state, snapshots, cache, slots, cu_seqlens,
                                                  cu, sl, nseq, T)
        else:
            snap = self._snapshots(snapshots, cache, cu, dev, who)
            if cache.paged:
                if has_initial_state is False and any(cache.length(s) for s in sl):
                    held = [s for s in sl if cache.length(s)]
                    raise ValueError(f"{who}: has_initial_state=False but slots {held[:8]} hold tokens already (their "
                                     "K/V are cached): free them, or let the prompt continue")
                hidden = embed(self.backbone.embeddings, input_ids, who, "input_ids")  # before the cache moves
                ctx = cache.grow(sl, lens)  # raises before anything is touched if a slot is not allocated
                flags, kv = self._upload_inputs(cache, slots, cu_seqlens, cu, sl, ctx, lens, dev)
            elif has_initial_state is None or has_initial_state is True:
                flags = torch.ones(nseq, dtype=torch.bool, device=dev)
            else:  # False: the ops start every prompt from zeros without reading its slot
                flags = None if has_initial_state is False else has_initial_state
        batch = Batch(slots, cu_seqlens, flags, kv, rand_seed, snapshot=snap, max_seqlen=max(lens),
                      live_seqs=len(live) if live_seqs is None else live_seqs)
        # the longest prompt picks the scan's path (fused when short) and its tiles, also while a
        # graph is captured (its warm-up then runs the same kernels). Validated above: the layers'
        # ops read nothing back; a long prompt's scans take the Hopper kernel, whose launch cost
        # hides behind the queued layers
        with trusted_inputs(), long_prefill_kernels(T):
            logits = self._run(input_ids, lambda block, h, sumsq=None: block.prefill(h, cache, batch, sumsq),
                               rows=cu_seqlens[1:].long() - 1, hidden=hidden, defer_norm=True, who=who)
            if cache.speculate:
                cache.mark_prefilled(slots)
        return logits

    def _snapshots(self, snapshots, cache, cu, dev, who):
        """The per-Mamba-layer snapshot function of an eager call (checked before the cache grows)."""
        if snapshots is None:
            return None
        if "M" not in self.cfg.pattern:
            raise ValueError(f"{who}: `snapshots` needs Mamba layers; this model has none")
        if isinstance(snapshots, DeviceSnapshots) and not cache.paged:
            return device_layer_snapshots(snapshots, self.cfg.mamba, dev)
        if not isinstance(snapshots, SnapshotPlan):
            raise TypeError(f"{who}: `snapshots` expected a SnapshotPlan (a DeviceSnapshots goes with `staged`), "
                            f"got {type(snapshots).__name__}")
        return layer_snapshots(snapshots, cu, cache.conv[0].shape[-1], self.cfg.mamba, dev, who)

    def _upload_inputs(self, cache, slots, cu_seqlens, cu, sl, ctx, lens, dev):
        """(has_initial_state [B] bool, KVBatch or None) of an eager paged call: the flags and, with
        attention layers, each token's position and request, ctx_lens and the attention kernel's
        work table, from the host's lists in one host-to-device copy (from pinned memory on a GPU:
        nothing waits for the device)."""
        nseq, T = len(sl), cu[-1]
        values = [int(c > 0) for c in ctx]
        if cache.kv is not None:
            block_m = self.prefill_block_tokens()
            kv_values = prefill_kv_values(ctx, lens, cu, block_m)
            values += kv_values["positions"] + kv_values["token_rows"] + kv_values["ctx"] + kv_values["work"]
        packed = torch.tensor(values, dtype=torch.int64)
        packed = packed.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else packed.to(dev)
        if cache.kv is None:
            return packed[:nseq] != 0, None
        o = nseq + 2 * T + nseq
        positions, token_rows = packed[nseq:nseq + T], packed[nseq + T:nseq + 2 * T]
        # no slots_host: the slots were checked (prefill_varlen, cache.grow) and the attention op's
        # kernels do not need their host copy, which the op would check again in every layer
        kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, positions, token_rows, cu_seqlens, ctx,
                     cu_host=cu, ctx_dev=packed[nseq + 2 * T:o], work=PrefillWork(packed[o:].view(-1, 2), block_m))
        return packed[:nseq] != 0, kv

    def _staged_inputs(self, staged, flags, snapshots, cache, slots, cu_seqlens, cu, sl, nseq, T):
        """(has_initial_state, KVBatch or None, snapshot function or None) of a call whose metadata
        the caller staged on the device (``StagedPrefill``), checked for shape and kind."""
        who = self._who("prefill_varlen")
        if not isinstance(staged, StagedPrefill):
            raise TypeError(f"{who}: `staged` expected a StagedPrefill or None, got {type(staged).__name__}")
        if not (isinstance(flags, torch.Tensor) and flags.dtype == torch.bool and tuple(flags.shape) == (nseq,)):
            raise ValueError(f"{who}: with `staged`, `has_initial_state` must be a [B]=[{nseq}] bool tensor")
        snap = None
        if snapshots is not None:
            if not isinstance(snapshots, DeviceSnapshots) or "M" not in self.cfg.pattern:
                raise TypeError(f"{who}: with `staged`, `snapshots` must be a DeviceSnapshots (and the model needs "
                                f"Mamba layers), got {type(snapshots).__name__}")
            snap = device_layer_snapshots(snapshots, self.cfg.mamba, cu_seqlens.device)
        if cache.kv is None:
            return flags, None, snap
        for name, t, n in (("positions", staged.positions, T), ("token_rows", staged.token_rows, T),
                           ("ctx_lens", staged.ctx_lens, nseq)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (n,):
                raise ValueError(f"{who}: `staged.{name}` expected a tensor of shape ({n},), got "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if not isinstance(staged.work, PrefillWork) or staged.work.block_m != self.prefill_block_tokens():
            raise ValueError(f"{who}: `staged.work` expected a PrefillWork for blocks of {self.prefill_block_tokens()} "
                             "query tokens (prefill_block_tokens)")
        kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, staged.positions, staged.token_rows, cu_seqlens,
                     None, cu_host=cu, slots_host=sl, ctx_dev=staged.ctx_lens, work=staged.work)
        return flags, kv, snap

    def _grow(self, who, token_ids, slots, cache, ntok, grow):
        """With ``grow``: one host read of the slots (which checks the token ids' range too); a paged
        cache then looks the embeddings up and runs ``cache.grow(slots, [ntok] * B)`` (which checks
        that the slots are allocated), an unpaged one checks the slots' range. Returns the embeddings,
        or None. Without ``grow`` the caller grew the cache or checked the slots (the engine, a
        CUDA-graph replay): nothing is read. Either way the layers' ops then trust the slots."""
        # an unpaged cache reads nothing while a graph is captured, traced or the inputs are trusted
        if not grow or not (cache.paged or host_reads_allowed(slots)):
            return None
        (sl,) = host_metadata(who, "token_ids", token_ids, self.cfg.vocab_size, [slots])
        if not cache.paged:
            _check_slot_range(who, [s for s in sl if s != -1], cache.num_slots)
            return None
        hidden = embed(self.backbone.embeddings, token_ids.reshape(-1), who, "token_ids")
        cache.grow(sl, [ntok] * slots.shape[0])
        return hidden

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, cache, slots: torch.Tensor, *,
               rand_seed: torch.Tensor | None = None, grow: bool = True) -> torch.Tensor:
        """One token per request [B] -> next-token logits [B, V] fp32; states (and K/V) advance in place.

        token_ids  [B] int32/int64 in [0, V) (a paged cache with ``grow``: checked in the slots'
                   host read, before any length, page or state moves)
        slots      [B] int32/int64; -1 marks a pad row (no state touched, its K/V go to the scratch page)
        grow       True: one host read checks the slots and token ids, and a paged cache is grown
                   (``cache.grow(slots, [1] * B)``); the layers' ops then trust the slots. False:
                   the caller grew the cache or checked the slots (the engine; a CUDA-graph
                   replay, whose positions come from ``cache.kv.seq_lens``): nothing is read.
        rand_seed  int64 [n_layer] device tensor or None: stochastic rounding of 16-bit SSM states
        """
        who = self._who("decode")
        check_index_tensor(who, "token_ids", token_ids, "token ids")
        check_index_tensor(who, "slots", slots, "cache slots")
        if token_ids.dim() != 1 or tuple(slots.shape) != tuple(token_ids.shape):
            raise ValueError(f"{who}: `token_ids` and `slots` expected shape (B,), got "
                             f"{tuple(token_ids.shape)} and {tuple(slots.shape)}")
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, who)
        hidden = self._grow(who, token_ids, slots, cache, 1, grow)
        kv = None
        if cache.kv is not None:
            positions = cache.kv.seq_lens[slots.long().clamp(min=0)].long() - 1
            kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, positions)
        batch = Batch(slots, kv=kv, rand_seed=rand_seed)
        with trusted_inputs():  # the slots were checked once (_grow or the caller): not per layer
            return self._run(token_ids, lambda block, h: block.decode(h, cache, batch), hidden=hidden, who=who,
                             ids_name="token_ids")

    step = decode

    @torch.inference_mode()
    def verify(self, token_ids: torch.Tensor, cache, slots: torch.Tensor, *, path: str = "replay",
               rand_seed: torch.Tensor | None = None, grow: bool = True) -> torch.Tensor:
        """Score T tokens per request (speculative decoding): token_ids [B, T] -> logits [B, T, V] fp32.

        token_ids  row b: [the request's last emitted token, its K drafts]; logits[b, t] predicts
                   the token after token_ids[b, t]
        cache      built with ``speculate=K``; T = K+1 (T = 1 on the plain path)
        slots      [B] int32/int64, one per request; -1 marks a padding row (no state touched)
        path       "replay" (default): the replay op (rollback by replaying the accepted history);
                   "legacy": a state per position into the cache's legacy buffers (B <=
                   ``cache.legacy_max_batch``); "plain": T = 1, one decode step. Legacy and plain
                   read the slots' SSM states directly: their replay histories must be empty
                   (after prefill, a legacy or plain commit, or ``cache.flush(slots)``)
        rand_seed  int64 [n_layer] device tensor or None: stochastic rounding of the 16-bit states
        grow       True: one host read checks the slots and token ids, and a paged cache is grown
                   (``cache.grow(slots, [T] * B)``); False: the caller grew it or checked the slots
                   (the engine, a CUDA-graph replay): nothing is read
        Attention layers write the T tokens' K/V at positions ctx .. ctx+T-1 and token t attends to
        its first ctx + t + 1 tokens. Call ``commit`` with the same path and the accepted counts
        before the next verify on these slots.
        """
        who = self._who("verify")
        check_index_tensor(who, "token_ids", token_ids, "token ids")
        check_index_tensor(who, "slots", slots, "cache slots")
        if not cache.speculate:
            raise ValueError(f"{who}: the cache was built without speculation; use new_cache(..., speculate=K)")
        if path not in PATHS:
            raise ValueError(f'{who}: `path` expected "replay", "legacy" or "plain", got {path!r}')
        ntok_expected = 1 if path == "plain" else cache.tokens_per_step
        if token_ids.dim() != 2 or token_ids.shape[1] != ntok_expected:
            what = "T = 1 on the plain path" if path == "plain" else f"T = K+1 = {cache.tokens_per_step}"
            raise ValueError(f"{who}: `token_ids` expected shape (B, T) with {what}, got {tuple(token_ids.shape)}")
        nreq, ntok = token_ids.shape
        if tuple(slots.shape) != (nreq,):
            raise ValueError(f"{who}: `slots` expected shape (B,)=({nreq},), got {tuple(slots.shape)}")
        check_rand_seed(rand_seed, self.cfg.n_layer, self.lm_head.weight.device, who)
        hidden = self._grow(who, token_ids, slots, cache, ntok, grow)
        sl = slots.long()
        inter = cache.legacy_intermediate(nreq) if path == "legacy" else [None] * self.cfg.pattern.count("M")
        no_dst = cache.legacy_no_dst(nreq) if path == "legacy" else None
        kv = kv_read = None
        if cache.kv is not None:
            dev = token_ids.device
            base = cache.kv.seq_lens[sl.clamp(min=0)].long() - ntok  # each request's length before this step
            positions = (base[:, None] + torch.arange(ntok, device=dev)).reshape(-1)
            token_rows = torch.arange(nreq, device=dev).repeat_interleave(ntok)
            kv = KVBatch(cache.kv.block_table, cache.kv.seq_lens, slots, positions, token_rows)
            live = (sl >= 0).repeat_interleave(ntok)
            rows = torch.where(live, torch.arange(nreq * ntok, device=dev), -1).to(torch.int32)
            table = cache.kv.block_table[sl.clamp(min=0)].repeat_interleave(ntok, dim=0)
            kv_read = KVBatch(table, (positions + 1).to(torch.int32), rows, positions)
        spec = SpecBatch(ntok, path, cache.conv_accepted[sl], inter, no_dst, kv_read)
        batch = Batch(slots, kv=kv, rand_seed=rand_seed, spec=spec)
        with trusted_inputs():  # the slots were checked once (_grow or the caller): not per layer
            return self._run(token_ids.reshape(-1), lambda block, h: block.verify(h, cache, batch), hidden=hidden,
                             who=who, ids_name="token_ids").view(nreq, ntok, -1)

    def commit(self, cache, slots: torch.Tensor, accepted: torch.Tensor, *, path: str = "replay",
               rollback: bool = True) -> None:
        """After ``verify`` on ``path``: request b keeps its first ``accepted[b]`` inputs (1..T: the
        last emitted token plus the accepted drafts; 1 on the plain path). The Mamba pools:
        "replay" ``commit``, "legacy" ``commit_legacy`` (copies the accepted position's state into
        the slot), "plain" ``commit_plain``. A paged cache with ``rollback`` then drops the
        rejected tokens (``cache.rollback``; reads slots and accepted on the host); False: the
        caller does it (after a CUDA-graph replay of the rest)."""
        cache.commit_path(slots, accepted, path, self._who("commit"))
        if cache.paged and rollback:
            ntok = 1 if path == "plain" else cache.tokens_per_step
            live = [(s, ntok - a) for s, a in zip(host_list(slots), host_list(accepted)) if s != -1]
            cache.rollback([s for s, _ in live], [d for _, d in live])
