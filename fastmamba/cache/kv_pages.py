"""Paged K/V pools for the attention layers of a hybrid model.

Every attention layer keeps two pools of fixed-size pages,

    k[l], v[l]   [Np + 1, PAGE, Hkv, Dh]   model dtype, or float8_e4m3fn (half the bytes: the
                                         attention layers write K / k_scale, V / v_scale and their
                                         kernels read value x scale); page Np (the last) is a
                                         scratch page that is never handed out: pad tokens write there

and all layers share one page table: request row r holds its token at position pos in page
``block_table[r, pos // PAGE]`` (row ``pos % PAGE``) of every layer's pool, and ``seq_lens[r]``
tokens are cached. Rows are the requests' cache slots (``HybridCache`` hands out one slot per
request for the Mamba states and the KV rows alike).

Pages are allocated as a request grows (``grow``) and all returned when it ends (``release``);
``truncate`` shortens a request (speculative rollback) and returns the pages it no longer needs.
The bookkeeping is on the host (a free list, each row's pages and length); the device copies
(``block_table`` [S, Pmax] int32, ``seq_lens`` [S] int32) are updated by ``grow`` / ``release`` /
``truncate`` with one small host-to-device copy each, never read back. So kernels (and CUDA graphs)
read only static device buffers, and the host never waits for the device.
"""
from __future__ import annotations

import torch

PAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)


class KVPages:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        num_rows: int,
        max_pages_per_row: int,
        *,
        page_size: int = 16,
        n_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.bfloat16,
    ):
        for name, v in (("num_layers", num_layers), ("num_pages", num_pages), ("num_rows", num_rows),
                        ("max_pages_per_row", max_pages_per_row), ("n_kv_heads", n_kv_heads),
                        ("head_dim", head_dim)):
            if not (isinstance(v, int) and v >= 1):
                raise ValueError(f"KVPages: `{name}` expected a positive integer, got {v!r}")
        if not (isinstance(page_size, int) and page_size >= 1 and page_size & (page_size - 1) == 0):
            raise ValueError(f"KVPages: `page_size` expected a power of two, got {page_size!r}")
        if dtype not in PAGE_DTYPES:
            raise ValueError(f"KVPages: `dtype` expected one of {', '.join(str(d) for d in PAGE_DTYPES)}, got {dtype}")
        self.dtype = dtype
        self.num_pages = num_pages
        self.num_rows = num_rows
        self.page_size = page_size
        self.max_pages_per_row = max_pages_per_row
        shape = (num_pages + 1, page_size, n_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.block_table = torch.full((num_rows, max_pages_per_row), -1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(num_rows, dtype=torch.int32, device=device)
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ...
        self._pages: list[list[int]] = [[] for _ in range(num_rows)]
        self._len = [0] * num_rows

    @staticmethod
    def page_bytes(num_layers: int, page_size: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes one page costs across all layers' K and V pools."""
        return 2 * num_layers * page_size * n_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def max_len(self) -> int:
        """The most tokens one row can hold."""
        return self.max_pages_per_row * self.page_size

    def length(self, row: int) -> int:
        return self._len[row]

    def pages_of(self, row: int) -> list[int]:
        """The pages row ``row`` holds, in position order (a copy)."""
        return list(self._pages[row])

    def pages_needed(self, rows: list[int], new_tokens: list[int]) -> int:
        """How many free pages ``grow(rows, new_tokens)`` would take."""
        P = self.page_size
        return sum(max(0, -(-(self._len[r] + n) // P) - len(self._pages[r])) for r, n in zip(rows, new_tokens))

    def grow(self, rows: list[int], new_tokens: list[int]) -> list[int]:
        """Make room for ``new_tokens[i]`` more tokens in row ``rows[i]``; returns each row's length
        before (the position of its first new token). Pages come from the free list; the device
        block table and lengths are updated. Raises (before changing anything) when a row is
        listed twice, a row would exceed ``max_len`` or the pool has too few free pages."""
        if len(rows) != len(new_tokens):
            raise ValueError(f"KVPages.grow: {len(rows)} rows but {len(new_tokens)} token counts")
        if len(set(rows)) != len(rows):
            raise ValueError(f"KVPages.grow: a row is listed twice in {rows[:16]}")
        for r, n in zip(rows, new_tokens):
            if not 0 <= r < self.num_rows:
                raise ValueError(f"KVPages.grow: row {r} outside [0, {self.num_rows})")
            if n < 0:
                raise ValueError(f"KVPages.grow: row {r}: negative token count {n}")
            if self._len[r] + n > self.max_len:
                raise ValueError(f"KVPages.grow: row {r} would hold {self._len[r] + n} tokens, more than "
                                 f"max_len={self.max_len} ({self.max_pages_per_row} pages of {self.page_size})")
        need = self.pages_needed(rows, new_tokens)
        if need > len(self._free):
            raise RuntimeError(f"KVPages.grow: {need} pages needed, {len(self._free)} of {self.num_pages} free")
        before = [self._len[r] for r in rows]
        P = self.page_size
        bt_rows, bt_cols, bt_pages = [], [], []
        for r, n in zip(rows, new_tokens):
            self._len[r] += n
            while len(self._pages[r]) * P < self._len[r]:
                page = self._free.pop()
                bt_rows.append(r)
                bt_cols.append(len(self._pages[r]))
                bt_pages.append(page)
                self._pages[r].append(page)
        self._sync(rows, bt_rows, bt_cols, bt_pages)
        return before

    def shrink(self, rows: list[int], new_lens: list[int]) -> None:
        """``truncate`` for several rows with one device update (speculative rollback of a batch)."""
        for r, n in zip(rows, new_lens):
            if not 0 <= r < self.num_rows or not 0 <= n <= self._len[r]:
                raise ValueError(f"KVPages.shrink: row {r} holds {self._len[r] if 0 <= r < self.num_rows else '?'} "
                                 f"tokens, cannot shrink to {n}")
        bt_rows, bt_cols = [], []
        for r, n in zip(rows, new_lens):
            keep = -(-n // self.page_size)
            dropped = self._pages[r][keep:]
            del self._pages[r][keep:]
            self._free.extend(reversed(dropped))
            bt_rows += [r] * len(dropped)
            bt_cols += list(range(keep, keep + len(dropped)))
            self._len[r] = n
        self._sync(list(rows), bt_rows, bt_cols, [-1] * len(bt_rows))

    def truncate(self, row: int, new_len: int) -> None:
        """Shorten row ``row`` to ``new_len`` tokens, returning the pages past it to the pool."""
        if not 0 <= new_len <= self._len[row]:
            raise ValueError(f"KVPages.truncate: row {row} holds {self._len[row]} tokens, cannot truncate to {new_len}")
        keep = -(-new_len // self.page_size)
        dropped = self._pages[row][keep:]
        del self._pages[row][keep:]
        self._free.extend(reversed(dropped))
        self._len[row] = new_len
        self._sync([row], [row] * len(dropped), list(range(keep, keep + len(dropped))), [-1] * len(dropped))

    def release(self, rows: list[int]) -> None:
        """Return every page of ``rows`` to the pool and set their lengths to zero."""
        for r in rows:
            if not 0 <= r < self.num_rows:
                raise ValueError(f"KVPages.release: row {r} outside [0, {self.num_rows})")
        for r in rows:
            self.truncate(r, 0)

    def _sync(self, len_rows: list[int], bt_rows: list[int], bt_cols: list[int], bt_pages: list[int]) -> None:
        """Write the changed block-table entries and lengths to the device copies: one host-to-device
        copy of all the values (from pinned memory, not waiting for the device, on a GPU), then two
        index writes on the current stream."""
        if not len_rows and not bt_rows:
            return
        nb, nl = len(bt_rows), len(len_rows)
        vals = torch.tensor(bt_rows + bt_cols + bt_pages + len_rows + [self._len[r] for r in len_rows],
                            dtype=torch.int64)
        dev = self.seq_lens.device
        vals = vals.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else vals.to(dev)
        if nb:
            self.block_table[vals[:nb], vals[nb:2 * nb]] = vals[2 * nb:3 * nb].to(torch.int32)
        if nl:
            o = 3 * nb
            self.seq_lens[vals[o:o + nl]] = vals[o + nl:o + 2 * nl].to(torch.int32)

    def check(self) -> None:
        """Bookkeeping invariants (for tests): no page both free and held, none held twice, none
        lost; every row holds exactly the pages its length needs; the device copies agree."""
        held = [p for pages in self._pages for p in pages]
        everything = held + self._free
        if len(set(everything)) != len(everything) or set(everything) != set(range(self.num_pages)):
            raise AssertionError("KVPages: a page is shared, lost or both held and free")
        P = self.page_size
        for r in range(self.num_rows):
            if len(self._pages[r]) != -(-self._len[r] // P):
                raise AssertionError(f"KVPages: row {r} holds {len(self._pages[r])} pages for {self._len[r]} tokens")
        bt = self.block_table.cpu()
        for r in range(self.num_rows):
            n = len(self._pages[r])
            if bt[r, :n].tolist() != self._pages[r] or bool((bt[r, n:] != -1).any()):
                raise AssertionError(f"KVPages: device block table row {r} disagrees with the host")
        if self.seq_lens.cpu().tolist() != self._len:
            raise AssertionError("KVPages: device seq_lens disagree with the host")
