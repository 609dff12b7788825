#!/usr/bin/env bash
# Extract vLLM's Triton mamba ops into the git-ignored peers/vllm_mamba_ops/ (the bench's vLLM peer:
# fastmamba/bench/peers.py loads them with stand-in vllm.* modules) and its fused-MoE kernel file with
# its tuned configs into peers/vllm_fused_moe/ (the MoE bench's peer: fastmamba/bench/ops/moe.py).
# Needs pip and unzip; ~2 MB.
#   scripts/fetch_vllm_peer.sh [version]     (default 0.33.0, the version peers.VLLM_VERSION names)
set -euo pipefail
version="${1:-0.33.0}"
root="$(cd "$(dirname "$0")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python -m pip download --no-deps "vllm==${version}" -d "$tmp" >/dev/null
unzip -q "$tmp"/vllm-*.whl 'vllm/model_executor/layers/mamba/ops/*' -d "$tmp/x"
rm -rf "$root/peers/vllm_mamba_ops"
mkdir -p "$root/peers"
cp -r "$tmp/x/vllm/model_executor/layers/mamba/ops" "$root/peers/vllm_mamba_ops"
# not used by the bench (CuTe-DSL GDN kernels, the CPU ops' GDN attention)
rm -rf "$root/peers/vllm_mamba_ops/gdn_chunk_cutedsl" "$root/peers/vllm_mamba_ops/cpu/gdn_attention.py"
unzip -q "$tmp"/vllm-*.whl 'vllm/model_executor/layers/fused_moe/fused_moe.py' \
    'vllm/model_executor/layers/fused_moe/configs/*' -d "$tmp/m"
rm -rf "$root/peers/vllm_fused_moe"
mkdir -p "$root/peers/vllm_fused_moe"
cp -r "$tmp/m/vllm/model_executor/layers/fused_moe/"{fused_moe.py,configs} "$root/peers/vllm_fused_moe/"
echo "vLLM ${version} mamba ops -> $root/peers/vllm_mamba_ops ($(du -sh "$root/peers/vllm_mamba_ops" | cut -f1))"
echo "vLLM ${version} fused_moe -> $root/peers/vllm_fused_moe ($(du -sh "$root/peers/vllm_fused_moe" | cut -f1))"
