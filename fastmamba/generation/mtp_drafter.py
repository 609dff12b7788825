"""Drafting with the checkpoint's own multi-token-prediction layer (``fastmamba.models.mtp``).

``MTPDrafter(model, max_batch)`` drafts k tokens per request per step from the target's hidden
states, batched over the requests. The MTP layer at position t takes (embed(token[t+1]), h_t),
h_t the target's final-normed hidden state at t, and attends causally over its own K/V of the
request's earlier positions (as vLLM's nemotron_h_mtp and DeepSeek's MTP run it over the prompt).

The engine (``Engine(model, speculate=K, drafter="mtp")``) hands it the target's hidden states:

* after every prefill call, each fed prompt position's (``observe_prompt``; the engine's
  ``Speculator`` sets the model's ``keep_all_hidden`` for it only with this drafter: no cost for
  other engines, and drops the [T, M] buffer once handed over).
  Position t pairs with token t+1: the next prompt token (a non-final chunk's last position: the
  next chunk's first token), the prompt's last position the first sampled token. Every pair but
  the prompt's last runs through the MTP at once, eagerly (never from a graph: a prompt's row
  count is arbitrary), in pieces of at most ``prompt_rows`` rows, each piece reading the K/V the
  earlier ones wrote; the prompt's last pair waits for the next catch-up (below), whose row then
  attends over the whole prompt's MTP K/V and gives draft 1;
* after every verify or plain step, the accepted inputs' (``observe``; row b: the last emitted
  token and the n accepted drafts), each paired with the token that followed it (the accepted
  drafts and the bonus token).

Prefix-cache hits: the cached prefix's positions are not fed, so their hidden states never exist
(a snapshot keeps the SSM states and K/V of the target, not its hidden states) and the MTP does
not run over them: a request that reused a cached prefix of P tokens has an MTP context of its
prompt positions P..L-1 (a cached prefix is shorter than its prompt, P <= L-1; P = L-1: the last
position only, as before this drafter saw whole prompts), at MTP pool positions 0..L-1-P (its
attention has no position embedding: only the order matters), then its decoded positions.

``propose_device(requests, k)`` then, for all requests in one batch (``draft_counts``: which
requests get drafts, known on the host before anything runs):

1. catch-up: runs the MTP over every observed (token, hidden) pair not yet consumed, one packed
   call of R = sum of the pairs rows; its K/V land at the request's next positions of the MTP's
   own page pool (row = the request's engine slot), which keeps them: that is the MTP's context;
   each request's last row gives draft 1 (argmax of the shared ``lm_head``);
2. drafts 2..k: k-1 single-row steps, each feeding the MTP's own output hidden state and draft
   forward; their K/V are written past the committed context and dropped afterwards (the pool
   row shrinks back), so a rejected draft costs nothing to undo.

It returns the drafts on the device (int64 [B, k]) with no host read and nothing waiting for
the device (its one host-to-device copy of positions and rows is pinned and asynchronous): the
engine (``speculative.Speculator``) builds its verify inputs from them on the device and queues
the verify step behind the drafts on the same stream. ``propose`` is the host-list form (one
read), for callers that want lists. The engine's prefill runs eagerly with this drafter (the
prefill graphs do not keep the hidden states); its verify steps replay from graphs.

``cuda_graphs=True`` (GPU; the engine and the MTP benchmark use it): the whole draft, the
catch-up and drafts 2..k back to back, replays from one CUDA graph per (catch-up row bucket,
request bucket, k), buckets powers of two (pad rows and pad requests have pool row -1: they write
the scratch page and read nothing; a pad request selects catch-up row 0). The drafts are the
graph's output (where some requests draft nothing, scattered among zeros into one static buffer
[max_batch, k]). A speculative step is then two graph launches on one
stream with no host sync between them: the draft and the verify (``GraphedVerifier``); not one
(the draft's graph is picked by the catch-up's row count, which varies with the acceptance, the
verify's by the batch alone).
"""
from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import torch

from fastmamba.cache.kv_pages import KVPages
from fastmamba.generation.cuda_graphs import CaptureClock, warm_up_padded
from fastmamba.ops.runtime import graph_capture, next_power_of_2, trusted_inputs


def require_mtp(model) -> None:
    """ValueError unless ``model`` carries an MTP layer (``model.mtp``)."""
    if getattr(model, "mtp", None) is None and getattr(model.cfg, "mtp_absent", False):
        raise ValueError("drafter='mtp': the checkpoint's config.json names an MTP layer (num_nextn_predict_layers: 1) "
                         "but the checkpoint holds no mtp.* tensors (transformers' save_pretrained drops them), so "
                         "the model was loaded without it; use the original checkpoint, or another drafter (ngram, model)")
    if getattr(model, "mtp", None) is None:
        raise ValueError(f"drafter='mtp': {type(model).__name__} has no multi-token-prediction layer (its "
                         "config.json has no `num_nextn_predict_layers: 1` with `mtp_hybrid_override_pattern`, "
                         "and the checkpoint no mtp.* tensors); use a checkpoint that ships one (Nemotron-3 Super, "
                         "Ultra, Nano 3.5 Lightning) or another drafter (ngram, model)")


def _check_k(k) -> None:
    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise ValueError(f"MTPDrafter.propose: k must be an int >= 1, got {k!r}")


@dataclasses.dataclass
class _Track:
    request: object  # held, so that id(request) cannot be reused while tracked
    row: int
    hidden: list = dataclasses.field(default_factory=list)  # [n, M] tensors not yet run through the MTP
    tokens: list = dataclasses.field(default_factory=list)  # the token after each of those positions


def _record(run, pool):
    """``run()`` captured in a CUDA graph: (the graph, run's outputs, which every replay rewrites)."""
    graph = torch.cuda.CUDAGraph()
    with graph_capture(graph, pool=pool):
        out = run()
    return graph, out


def _fill(st: dict, tok: torch.Tensor, hidden: torch.Tensor, rows: torch.Tensor, pos: torch.Tensor) -> None:
    """Copy one step's inputs (tok [R], hidden [R, M], rows [R], pos [R]) into a graph's static
    buffers of its bucket b >= R; the pad rows get token 0, zero hidden states, row -1 (K/V to the
    scratch page, nothing read) and position 0."""
    R = tok.shape[0]
    st["tok"][:R].copy_(tok)
    st["tok"][R:].zero_()
    st["hid"][:R].copy_(hidden)
    st["hid"][R:].zero_()
    st["rows"][:R].copy_(rows)
    st["rows"][R:].fill_(-1)
    st["pos"][:R].copy_(pos)
    st["pos"][R:].zero_()


class MTPDrafter:
    """Greedy drafts from ``model.mtp`` (see the module docstring).

    model        a ``NemotronHLM`` with an MTP layer (else ValueError); its ``keep_hidden`` is set
    max_batch    the engine's slots: requests' ``slot`` values lie in [0, max_batch)
    max_seq_len  the most positions one request's MTP context holds (its prompt and output, plus K)
    page_size / num_pages  the MTP's K/V pool (one layer per attention block of the MTP pattern);
                 num_pages None: enough for every row at max_seq_len (never runs out)
    max_catch_up the most observed positions a request keeps for its next catch-up: while the
                 engine's policy has speculation off, only the newest ones are run through the MTP
                 (its context then skips the older ones; prompt positions are not held back)
    prompt_rows  the most prompt positions one eager MTP call of ``observe_prompt`` runs
    cuda_graphs  MTP steps from CUDA graphs (see the module docstring)
    """

    needs_hidden = True

    def __init__(self, model, max_batch: int, *, max_seq_len: int = 4096, page_size: int = 16,
                 num_pages: int | None = None, max_catch_up: int = 16, prompt_rows: int = 512,
                 cuda_graphs: bool = False):
        require_mtp(model)
        for name, v in (("max_batch", max_batch), ("max_seq_len", max_seq_len), ("max_catch_up", max_catch_up),
                        ("prompt_rows", prompt_rows)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MTPDrafter: {name} must be an int >= 1, got {v!r}")
        self.model = model
        self.mtp = model.mtp
        model.keep_hidden = True
        cfg = model.cfg
        w = model.lm_head.weight
        self.device = w.device
        per_row = -(-max_seq_len // page_size)
        self.pages = KVPages(max(1, self.mtp.n_attn_layers), num_pages or max_batch * per_row, max_batch, per_row,
                             page_size=page_size, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                             device=self.device, dtype=w.dtype)
        self.max_batch = max_batch
        self.max_catch_up = max_catch_up
        self.prompt_rows = prompt_rows
        self._tracks: dict[int, _Track] = {}
        self.stats = {"calls": 0, "rows": 0, "prompt_rows": 0}
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("MTPDrafter: cuda_graphs=True needs the model on a CUDA device")
        # with graphs: one per (catch-up row bucket, request bucket, k), and the static drafts buffer
        self.graphs: dict[tuple[int, int, int], dict] | None = {} if cuda_graphs else None
        self._drafts: torch.Tensor | None = None
        self.captured = CaptureClock()  # graphs captured (the engine's ``graph_captures`` counts them)
        self.pool = torch.cuda.graph_pool_handle() if cuda_graphs else None

    @property
    def tracked(self) -> int:
        return len(self._tracks)

    @property
    def pages_in_use(self) -> int:
        return self.pages.num_pages - self.pages.free_pages

    # -- what the engine tells it ------------------------------------------------------------------

    def observe(self, requests: Sequence, hidden: torch.Tensor, counts: Sequence[int]) -> None:
        """After a step: request i consumed ``counts[i]`` positions whose target hidden states are
        ``hidden[i, :counts[i]]`` (hidden [B, T, M], or [B, M] for one each) and whose following
        tokens are the last ``counts[i]`` of its output. Finished requests are skipped (forgotten)."""
        if hidden.dim() == 2:
            hidden = hidden[:, None]
        hidden = hidden.detach().clone()  # one copy for the batch (the caller's buffer is reused); rows are views
        if hidden.shape[0] != len(requests) or len(counts) != len(requests):
            raise ValueError(f"MTPDrafter.observe: {len(requests)} requests, {hidden.shape[0]} hidden rows and "
                             f"{len(counts)} counts")
        for i, (r, c) in enumerate(zip(requests, counts)):
            if r.finished:
                self.forget(r)
                continue
            if not 1 <= c <= hidden.shape[1] or len(r.output) < c:
                raise ValueError(f"MTPDrafter.observe: request {getattr(r, 'rid', '?')}: count {c} outside "
                                 f"[1, {hidden.shape[1]}] or longer than its output ({len(r.output)})")
            t = self._tracks.get(id(r))
            if t is None:
                if not 0 <= r.slot < self.max_batch:
                    raise ValueError(f"MTPDrafter.observe: request slot {r.slot} outside [0, {self.max_batch})")
                self.pages.release([r.slot])  # a fresh request in a reused slot: empty context
                t = self._tracks[id(r)] = _Track(r, r.slot)
            t.hidden.append(hidden[i, :c])
            t.tokens += list(r.output[-c:])
            if len(t.tokens) > self.max_catch_up:
                t.hidden = [torch.cat(t.hidden)[-self.max_catch_up:]]
                t.tokens = t.tokens[-self.max_catch_up:]

    @torch.no_grad()
    def observe_prompt(self, requests: Sequence, hidden: torch.Tensor, lengths: Sequence[int]) -> None:
        """After a prefill call: request i fed the ``lengths[i]`` prompt positions that end at its
        ``prefilled`` (already advanced), whose target hidden states are its rows of ``hidden``
        [T, M] (the call's chunks back to back, T = sum(lengths): the model's ``all_hidden``).

        Position t pairs with token t+1: the next prompt token (inside a chunk, and for a chunk's
        last position the next chunk's first token, known from the prompt), or for the prompt's
        last position the first sampled token (``output[0]``: the call that completes a prompt is
        observed after its first token is emitted). Every pair but the prompt's last runs through
        the MTP now, eagerly, in pieces of at most ``prompt_rows`` rows (causal: each piece reads
        the K/V the pieces before it wrote), so the MTP's K/V cover the prompt; the last pair waits
        for the next catch-up, whose row gives draft 1. Finished requests are skipped (forgotten)."""
        if hidden.dim() != 2 or len(lengths) != len(requests) or hidden.shape[0] != sum(lengths):
            raise ValueError(f"MTPDrafter.observe_prompt: {len(requests)} requests, {len(lengths)} lengths summing "
                             f"to {sum(lengths)} and hidden of shape {tuple(hidden.shape)} (expected [T, M], T the "
                             "lengths' sum)")
        plan, cu = [], 0  # (request, track, hidden start, prompt start, pairs to run now, prompt complete)
        for r, n in zip(requests, lengths):
            start, cu = cu, cu + n
            if r.finished:
                self.forget(r)
                continue
            L, end = len(r.prompt), r.prefilled
            if not (isinstance(n, int) and 1 <= n <= end <= L) or (end == L and not r.output):
                raise ValueError(f"MTPDrafter.observe_prompt: request {getattr(r, 'rid', '?')}: {n} positions "
                                 f"ending at prefilled={end} of a {L}-token prompt with {len(r.output)} output "
                                 "tokens (a completed prompt needs its first sampled token)")
            t = self._tracks.get(id(r))
            if t is None:
                if not 0 <= r.slot < self.max_batch:
                    raise ValueError(f"MTPDrafter.observe_prompt: request slot {r.slot} outside [0, {self.max_batch})")
            plan.append((r, t, start, end - n, n - (end == L), end == L))
        fresh = [r for r, t, *_ in plan if t is None]
        if fresh:  # fresh requests in reused slots: empty contexts
            self.pages.release([r.slot for r in fresh])
        toks, row_of, pos, parts = [], [], [], []
        grow = [(r, t, start, p0, m) for r, t, start, p0, m, _ in plan if m]
        base = self.pages.grow([(t.row if t is not None else r.slot) for r, t, *_ in grow], [g[-1] for g in grow])
        for (r, t, start, p0, m), b in zip(grow, base):
            toks += r.prompt[p0 + 1:p0 + 1 + m]
            row_of += [t.row if t is not None else r.slot] * m
            pos += range(b, b + m)
            parts.append(hidden[start:start + m])
        for r, t, start, p0, m, last in plan:
            if t is None:
                t = self._tracks[id(r)] = _Track(r, r.slot)
            if last:  # the prompt's last position: waits for the next catch-up
                t.hidden.append(hidden[start + m:start + m + 1].clone())
                t.tokens.append(r.output[0])
        if not toks:
            return
        h_all = torch.cat(parts)
        R, P = len(toks), self.prompt_rows
        meta = torch.tensor(toks + row_of + pos, dtype=torch.int64)
        meta = meta.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else meta
        tok_d, row_d, pos_d = meta[:R], meta[R:2 * R].to(torch.int32), meta[2 * R:]
        with trusted_inputs():  # the host built rows and positions: no per-op read back
            for a in range(0, R, P):
                self.mtp.forward_rows(self.model.backbone.embeddings(tok_d[a:a + P]), h_all[a:a + P], self.pages,
                                      row_d[a:a + P], pos_d[a:a + P])
        self.stats["prompt_rows"] += R

    def forget(self, request) -> None:
        """Drop a finished or aborted request: its MTP pages go back to the pool."""
        t = self._tracks.pop(id(request), None)
        if t is not None:
            self.pages.release([t.row])

    # -- drafting ------------------------------------------------------------------------------------

    def draft_counts(self, requests: Sequence, k: int) -> list[int]:
        """The drafts each request gets from the next ``propose`` / ``propose_device`` call: k where
        positions were observed for it since its last call, else 0. Host bookkeeping only (nothing
        runs): the engine picks its verify path and grows its cache from this before drafting."""
        tracks = (self._tracks.get(id(r)) for r in requests)
        return [k if t is not None and t.tokens else 0 for t in tracks]

    @torch.no_grad()
    def propose(self, requests: Sequence, k: int) -> list[list[int]]:
        """The drafts as host lists (``draft_counts`` each): ``propose_device`` and one read."""
        _check_k(k)
        counts = self.draft_counts(requests, k)
        if not any(counts):
            return [[] for _ in requests]
        return [row[:n] for row, n in zip(self.propose_device(requests, k).tolist(), counts)]

    @torch.no_grad()
    def propose_device(self, requests: Sequence, k: int) -> torch.Tensor:
        """The drafts of ``requests`` without a host read: int64 [B, k] on the model's device (row i:
        request i's k greedy drafts; a request with ``draft_counts`` 0 gets a row of zeros, which
        are no drafts). Every id lies in [0, vocab_size) (argmax over the shared ``lm_head``). The
        kernels are queued on the current stream and nothing waits for them: the caller can queue
        its verify step behind them. With ``cuda_graphs`` the result is a view of a static buffer,
        valid until the next call."""
        _check_k(k)
        tracks = [self._tracks.get(id(r)) for r in requests]
        live = [i for i, t in enumerate(tracks) if t is not None and t.tokens]
        if not live:
            return torch.zeros(len(requests), k, dtype=torch.int64, device=self.device)
        ts = [tracks[i] for i in live]
        rows = [t.row for t in ts]
        counts = [len(t.tokens) for t in ts]
        base = self.pages.grow(rows, [c + k - 1 for c in counts])  # committed context lengths
        try:
            drafts = self._draft(ts, rows, counts, base, k, live, len(requests))
        finally:  # the speculative drafts' K/V go; the catch-up's stay (the MTP's context)
            self.pages.shrink(rows, [b + c for b, c in zip(base, counts)])
        for t in ts:
            t.hidden.clear()
            t.tokens.clear()
        self.stats["calls"] += 1
        self.stats["rows"] += sum(counts) + (k - 1) * len(ts)
        return drafts

    def _out(self, n: int, k: int) -> torch.Tensor:
        """The drafts' output buffer [n, k] (static with CUDA graphs: no allocation per call)."""
        if self.graphs is None:
            return torch.empty(n, k, dtype=torch.int64, device=self.device)
        buf = self._drafts
        if buf is None or buf.shape[1] < k:
            buf = self._drafts = torch.empty(self.max_batch, k, dtype=torch.int64, device=self.device)
        return buf[:n, :k]

    def _draft(self, ts: list[_Track], rows: list[int], counts: list[int], base: list[int], k: int,
               live: list[int], n_req: int) -> torch.Tensor:
        dev, B = self.device, len(ts)
        # one host-to-device copy (pinned, asynchronous on a GPU): catch-up tokens, their rows and
        # positions, each request's last row, the requests' rows, the position their next draft
        # token takes, and where each drafting request sits among the caller's requests
        toks = [tok for t in ts for tok in t.tokens]
        row_of = [r for r, c in zip(rows, counts) for _ in range(c)]
        pos = [b + j for b, c in zip(base, counts) for j in range(c)]
        last = [end - 1 for end in itertools.accumulate(counts)]
        R = len(toks)
        meta = torch.tensor(toks + row_of + pos + last + rows + [b + c for b, c in zip(base, counts)] + live,
                            dtype=torch.int64)
        meta = meta.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else meta.to(dev)
        tok_d, row_d, pos_d = meta[:R], meta[R:2 * R].to(torch.int32), meta[2 * R:3 * R]
        last_d = meta[3 * R:3 * R + B]
        req_rows = meta[3 * R + B:3 * R + 2 * B].to(torch.int32)
        next_pos = meta[3 * R + 2 * B:3 * R + 3 * B]
        live_d = meta[3 * R + 3 * B:]
        hidden = torch.cat([h for t in ts for h in t.hidden], dim=0)  # [R, M]
        if self.graphs is not None:  # catch-up and drafts 2..k from one graph
            drafts = self._graphed(tok_d, hidden, row_d, pos_d, last_d, req_rows, next_pos, k)  # [B, k]
        else:
            drafts = torch.empty(B, k, dtype=torch.int64, device=dev)
            h, draft = self._step(tok_d, hidden, row_d, pos_d, select=last_d)  # [B, M], [B]
            drafts[:, 0].copy_(draft)
            for j in range(1, k):
                h, draft = self._step(drafts[:, j - 1], h, req_rows, next_pos + (j - 1))
                drafts[:, j].copy_(draft)
        if B == n_req:
            return drafts
        out = self._out(n_req, k)  # the drafting requests' rows among zeros
        out.zero_()
        out.index_copy_(0, live_d, drafts)
        return out

    def _step(self, tok, hidden, rows, pos, select=None):
        """One eager MTP step over R rows -> (hidden [R'], greedy draft [R']) of the rows ``select`` (all: None)."""
        with trusted_inputs():  # the host built rows and positions: no per-op read back
            h = self.mtp.forward_rows(self.model.backbone.embeddings(tok), hidden, self.pages, rows, pos)
            h = h if select is None else h[select]
            return h, self.model.lm_head(h).argmax(-1)

    def _graphed(self, tok, hidden, rows, pos, last, req_rows, next_pos, k: int) -> torch.Tensor:
        """The eager path's steps (a catch-up over R rows, then k-1 single-row steps per request) from
        one CUDA graph per (row bucket, request bucket, k); returns the drafts [B, k] (a view of the
        graph's output, valid until its next replay)."""
        R, B = tok.shape[0], last.shape[0]
        key = (next_power_of_2(R), next_power_of_2(B), k)  # R, B >= 1
        st = self.graphs.get(key)
        if st is None:
            st = self.graphs[key] = {**self._static(key[0]), **self._static_requests(key[1])}
        _fill(st, tok, hidden, rows, pos)
        st["last"][:B].copy_(last)
        st["last"][B:].zero_()  # pad requests select row 0 and write only the scratch page
        st["req_rows"][:B].copy_(req_rows)
        st["req_rows"][B:].fill_(-1)
        st["next_pos"][:B].copy_(next_pos)
        st["next_pos"][B:].zero_()
        if "graph" not in st:
            with self.captured.timing():
                self._capture(st, k)
        st["graph"].replay()
        return st["drafts"][:B]

    def _static(self, b: int) -> dict:
        M, dev, dt = self.model.cfg.d_model, self.device, self.model.lm_head.weight.dtype
        return {"tok": torch.zeros(b, dtype=torch.int64, device=dev), "hid": torch.zeros(b, M, dtype=dt, device=dev),
                "rows": torch.full((b,), -1, dtype=torch.int32, device=dev),
                "pos": torch.zeros(b, dtype=torch.int64, device=dev)}

    def _static_requests(self, b: int) -> dict:
        dev = self.device
        return {"last": torch.zeros(b, dtype=torch.int64, device=dev),
                "req_rows": torch.full((b,), -1, dtype=torch.int32, device=dev),
                "next_pos": torch.zeros(b, dtype=torch.int64, device=dev)}

    def _capture(self, st: dict, k: int) -> None:
        def run():
            with trusted_inputs():
                h = self.mtp.forward_rows(self.model.backbone.embeddings(st["tok"]), st["hid"], self.pages,
                                          st["rows"], st["pos"])[st["last"]]
                t = self.model.lm_head(h).argmax(-1)
                drafts = [t]
                for j in range(1, k):
                    h = self.mtp.forward_rows(self.model.backbone.embeddings(t), h, self.pages, st["req_rows"],
                                              st["next_pos"] + (j - 1))
                    t = self.model.lm_head(h).argmax(-1)
                    drafts.append(t)
                return torch.stack(drafts, dim=1)

        saved = st["req_rows"].clone()
        st["req_rows"].fill_(-1)  # the warm-up writes only the scratch page (its catch-up rows too)
        warm_up_padded(run, st["rows"])
        st["req_rows"].copy_(saved)
        st["graph"], st["drafts"] = _record(run, self.pool)
