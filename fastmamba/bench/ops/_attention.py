"""What the two attention benchmarks share (``paged_attention``: decode, ``prefill_attention``):
a paged K/V pool with its pages handed out in a random order and the same cache gathered into
contiguous tensors for the dense peer, and the providers' layout: ours, PyTorch's SDPA on the
gathered cache (also the check's oracle: fp32 softmax, every size), the reference."""
from __future__ import annotations

from collections.abc import Callable

import torch

from fastmamba.bench.ops._base import OpBench, Provider, _fastmamba_version, describe


def paged_pool(B: int, L: int, Hkv: int, Dh: int, page: int, dtype: torch.dtype, g: torch.Generator,
               device: torch.device) -> dict:
    """B requests of L cached tokens each in pages of ``page`` tokens handed out in a random order (a
    fragmented pool, as after churn), plus the scratch page: k_pages, v_pages [Np, page, Hkv, Dh],
    block_table [B, ceil(L / page)] int32, and k_dense, v_dense [B, Hkv, L, Dh] (contiguous) gathered
    from them."""
    per = -(-L // page)
    Np = B * per + 1  # + the scratch page
    k_pages = torch.randn(Np, page, Hkv, Dh, generator=g, device=device).to(dtype)
    v_pages = torch.randn(Np, page, Hkv, Dh, generator=g, device=device).to(dtype)
    block_table = torch.randperm(B * per, generator=g, device=device).view(B, per).to(torch.int32)
    rows = block_table.long()
    k_dense = k_pages[rows].reshape(B, per * page, Hkv, Dh)[:, :L].transpose(1, 2).contiguous()
    v_dense = v_pages[rows].reshape(B, per * page, Hkv, Dh)[:, :L].transpose(1, 2).contiguous()
    return {"k_pages": k_pages, "v_pages": v_pages, "block_table": block_table, "k_dense": k_dense,
            "v_dense": v_dense}


class AttentionBench(OpBench):
    """An attention op against SDPA on the gathered cache. Subclasses set ``op_name`` (the public op
    ``providers`` checks imports) and the three call adapters ``ours``, ``sdpa`` and ``ref``."""

    op_name: str = ""
    sdpa_note: str = ""
    ours: Callable
    sdpa: Callable
    ref: Callable

    def providers(self, device: torch.device) -> list[Provider]:
        version = f"torch {torch.__version__}"
        try:
            import fastmamba.ops.attention as attention_ops

            getattr(attention_ops, self.op_name)
            ours = Provider("fastmamba", "ours", _fastmamba_version(), type(self).ours)
        except Exception as exc:  # noqa: BLE001
            ours = Provider("fastmamba", "ours", _fastmamba_version(), None, reason=describe(exc))
        return [
            ours,
            Provider("sdpa (gathered)", "peer", version, type(self).sdpa, note=self.sdpa_note),
            Provider("torch-ref", "ref", version, type(self).ref, preflight_sync=True),
        ]

    def oracle(self, device, providers, mode="auto"):
        # the gathered SDPA: fp32 softmax on a GPU too, and it runs at every size
        sdpa = next((p for p in providers if p.kind == "peer" and p.available), None)
        return sdpa or super().oracle(device, providers, mode)
