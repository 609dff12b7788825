"""The MoE layer's decode path (T <= GEMV_MAX_TOKENS): the router and routing in one launch, the
shared expert inside the routed experts' GEMVs where it fits (``MoE.shared_fused``), the k-sum in
the down kernel: three kernels at T=1 and no other device op, the same map as the layer's
definition (transformers' NemotronHMoE) for every T. CPU: the Triton interpreter (or the ops'
references without it)."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastmamba.layers.moe import MoE, MoEConfig
from fastmamba.ops._common.dispatch import interpreter_enabled
from fastmamba.ops.moe import align_kernel, gemv_kernel, kernel as moe_kernel, router_kernel
from fastmamba.ops.moe.configs import GEMV_MAX_TOKENS
from fastmamba.ops.moe.ref import moe_route_ref
from tests.helpers import seeded, tol

MOE_KERNEL_MODULES = (router_kernel, align_kernel, moe_kernel, gemv_kernel)
INTERPRETER_AT_START = interpreter_enabled()  # Triton reads TRITON_INTERPRET once, at import
BASE = dict(d_model=48, n_experts=8, top_k=2, expert_width=20, shared_width=40, n_group=2, topk_group=1,
            routed_scaling_factor=2.5)
LAYERS = {  # id: MoEConfig fields over BASE
    "shared-2-slices": {},
    "shared-1-slice": dict(shared_width=20, top_k=3, n_group=1),
    "shared-not-a-multiple": dict(shared_width=28),
    "latent": dict(latent=24),
    "bias": dict(bias=True),
}


def make_layer(dtype=torch.float32, seed=6, **fields) -> MoE:
    layer = MoE(MoEConfig(**{**BASE, **fields}), dtype=dtype)
    g = seeded(seed)
    with torch.no_grad():  # outputs O(1): each matrix scaled by its fan-in
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
        layer.gate.e_score_correction_bias.copy_(torch.randn(layer.cfg.n_experts, generator=g) * 0.1)
    return layer


def layer_ref(layer: MoE, u: torch.Tensor) -> torch.Tensor:
    """transformers' NemotronHMoE in fp32 from the layer's weights: fp32 router, selection, relu²
    experts (in the latent width when there is one), the shared MLP."""
    c = layer.cfg
    x = u.float()
    r = moe_route_ref(x @ layer.gate.weight.float().t(), layer.gate.e_score_correction_bias, top_k=c.top_k,
                      n_group=c.n_group, topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                      routed_scaling_factor=c.routed_scaling_factor)
    lin = (lambda m, v: v @ m.weight.float().t() + (m.bias.float() if m.bias is not None else 0))
    h = x if layer.fc1_latent_proj is None else lin(layer.fc1_latent_proj, x)
    up, down = layer.experts.up_proj, layer.experts.down_proj
    y = torch.zeros_like(h)
    for t in range(x.shape[0]):
        for j in range(c.top_k):
            e = int(r.ids[t, j])
            y[t] += r.weights[t, j] * (down[e].float() @ torch.relu(up[e].float() @ h[t]).square())
    if layer.fc2_latent_proj is not None:
        y = lin(layer.fc2_latent_proj, y)
    sh = layer.shared_experts
    return y + lin(sh.down_proj, torch.relu(lin(sh.up_proj, x)).square())


def test_shared_fused_where_it_fits():
    """S = Fs / F where the shared expert sees the routed experts' input and weights' kind; 0
    otherwise (its own MLP): latent, biases, a width that is not a multiple, FP8 experts, TP."""
    from fastmamba.layers.fp8_linear import FP8Experts

    assert make_layer().shared_fused == 2
    assert make_layer(dtype=torch.bfloat16, shared_width=20).shared_fused == 1
    for fields in (dict(shared_width=28), dict(latent=24), dict(bias=True)):
        assert make_layer(**fields).shared_fused == 0, fields
    layer = make_layer()
    layer.reduce = lambda y: y
    assert layer.shared_fused == 0
    layer = make_layer(dtype=torch.bfloat16)
    layer.experts = FP8Experts.from_experts(layer.experts)
    assert layer.shared_fused == 0


@pytest.mark.parametrize("T", [1, 3, GEMV_MAX_TOKENS, GEMV_MAX_TOKENS + 1], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_equals_its_definition(name, dtype, T, monkeypatch):
    """Decode-sized calls (the fused path) and a prefill-sized one (T = GEMV_MAX_TOKENS + 1: router
    GEMM, moe_route, fused_moe, the shared MLP) against the fp32 definition; u a strided view. With
    the interpreter on, the ops' references must not run."""
    layer = make_layer(dtype, **LAYERS[name])
    wide = torch.randn(T, 2 * layer.cfg.d_model, generator=seeded(T)).to(dtype)
    u = wide[:, ::2]
    if INTERPRETER_AT_START:
        for ref in ("fused_moe_ref", "moe_route_ref", "moe_gate_ref"):
            monkeypatch.setattr(f"fastmamba.ops.moe.api.{ref}", lambda *a, **k: pytest.fail("a reference ran"))
    got = layer(u)
    assert got.shape == u.shape and got.dtype == dtype
    want = layer_ref(layer, u)
    t = tol(dtype)
    if dtype != torch.float32:  # the layer rounds what the fp32 definition keeps (latent h, relu² rows,
        t["atol"] *= max(1.0, float(want.abs().max()))  # contributions): its error grows with the output
    torch.testing.assert_close(got.float(), want, **t)
    assert not layer.decode_arrivals.any()


class _Ops(TorchDispatchMode):
    """The ATen ops a call dispatches (names), views and allocations included, outside the Triton
    launches (the interpreter's own tensor copies are not the layer's ops)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def count_kernels(monkeypatch, ops: _Ops) -> list[int]:
    """[n]: the launches through ``lean`` of the ops.moe kernel modules from now on; ``ops`` records
    nothing inside them."""
    count = [0]
    real = moe_kernel.lean  # the one ``fastmamba.ops._common.launch.lean`` every module imports

    def counting(fn):
        k = real(fn)

        class Counted:
            def __getitem__(self, grid):
                launch = k[grid]

                def run(*args, **kwargs):
                    count[0] += 1
                    ops.paused = True
                    try:
                        return launch(*args, **kwargs)
                    finally:
                        ops.paused = False
                return run
        return Counted()

    for module in MOE_KERNEL_MODULES:
        monkeypatch.setattr(module, "lean", counting)
    return count


# ops that launch no device kernel: allocations, views and metadata
NO_KERNEL = {"empty", "empty_strided", "view", "_unsafe_view", "reshape", "slice", "as_strided", "alias", "detach",
             "t", "transpose", "expand", "select", "unsqueeze", "squeeze", "permute",
             "min", "max", "_local_scalar_dense"}  # fused_moe's id range check, on CPU tensors only (not on a GPU)


@pytest.mark.skipif(not INTERPRETER_AT_START, reason="counts the Triton launches: needs TRITON_INTERPRET=1 before "
                    "Python starts (the GPU runs the same code)")
@pytest.mark.parametrize("name,kernels,has_torch_ops", [("shared-2-slices", 3, False), ("shared-not-a-multiple", 3, True),
                                                         ("latent", 3, True)])
def test_decode_step_kernels(name, kernels, has_torch_ops, monkeypatch):
    """One token through the layer: moe_gate, the up GEMV, the down GEMV (with the k-sum), and,
    where the shared expert is fused, no other op that launches a kernel (no fp32 copy of u, no
    router GEMV, no MLP, no add). Before this change: 11 (cast, router GEMV, route, up, down, sum,
    shared up, relu, square, shared down, add)."""
    layer = make_layer(torch.bfloat16, **LAYERS[name])
    u = torch.randn(1, layer.cfg.d_model).to(torch.bfloat16)
    ops = _Ops()
    launches = count_kernels(monkeypatch, ops)
    with ops:
        layer(u)
    assert launches[0] == kernels
    torch_ops = [n for n in ops.names if n not in NO_KERNEL]
    assert bool(torch_ops) == has_torch_ops, torch_ops


def test_state_dict_is_the_checkpoints():
    """The fused decode reads the shared expert in place: the layer's state dict keeps the
    checkpoint's names and shapes, and the arrival counters are not in it."""
    layer = make_layer()
    sd = layer.state_dict()
    assert set(sd) == {"gate.weight", "gate.e_score_correction_bias", "experts.up_proj", "experts.down_proj",
                       "shared_experts.up_proj.weight", "shared_experts.down_proj.weight"}
    assert sd["experts.up_proj"].shape == (8, 20, 48) and sd["shared_experts.down_proj.weight"].shape == (48, 40)


def test_route_is_the_one_place_experts_are_picked(monkeypatch):
    """``MoE.route`` (what a benchmark wraps to count the experts a step reads) sees every call, on
    both paths, with the routed experts only (no shared slice ids)."""
    layer = make_layer()
    seen = []
    route = MoE.route

    def counting(self, x):
        r = route(self, x)
        seen.append(r.ids.clone())
        return r

    monkeypatch.setattr(MoE, "route", counting)
    for T in (1, GEMV_MAX_TOKENS + 2):
        layer(torch.randn(T, 48))
    assert [tuple(s.shape) for s in seen] == [(1, 2), (GEMV_MAX_TOKENS + 2, 2)]
    assert all(int(s.max()) < 8 for s in seen)


def test_loaded_models_fuse_their_shared_experts():
    """The tiny presets (shared width 64 = 2 x 32): every MoE layer, the MTP layer's too, runs its
    shared expert inside the routed call at decode."""
    from fastmamba.models import load_model

    model = load_model("nemotron-3-tiny-mtp", device="cpu")
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 3 and all(m.shared_fused == 2 for m in layers)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 2, 4])
def test_gpu_nano_layer_decode_in_a_graph(T):
    """Nano's MoE layer (M=2688, 128 experts of 1856, top-6, shared 3712 = 2 slices) in bf16: the
    decode path against the fp32 definition, then 200 replays of a CUDA graph captured under PDL
    on new inputs, each equal bit for bit to an eager call (the arrival counters reset every time).
    Inside the graph the layer's input is written by the kernel just before the router, as in a
    model (the up kernel's shared-slice programs read it without waiting for the router)."""
    from fastmamba.ops._common.pdl import programmatic_dependent_launch

    dev = torch.device("cuda")
    cfg = MoEConfig(d_model=2688, n_experts=128, top_k=6, expert_width=1856, shared_width=3712,
                    routed_scaling_factor=2.5)
    layer = MoE(cfg, device=dev, dtype=torch.bfloat16)
    g = torch.Generator(device=dev).manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5, generator=g)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.01, generator=g)
    assert layer.shared_fused == 2
    u = torch.randn(T, 2688, device=dev, generator=g).to(torch.bfloat16)
    t = tol(torch.bfloat16)
    want = layer_ref(layer, u)
    t["atol"] *= max(1.0, float(want.abs().max()))
    torch.testing.assert_close(layer(u).float(), want, **t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(u * 1)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with programmatic_dependent_launch(True), torch.cuda.graph(graph):
        captured = layer(u * 1)
    for i in range(200):
        u.copy_(torch.randn(T, 2688, device=dev, generator=g).to(torch.bfloat16))
        graph.replay()
        assert torch.equal(captured, layer(u)), i
    assert not layer.decode_arrivals.any()


@pytest.mark.parametrize("T", [1, 4, 20], ids=["gemv-1", "gemv-4", "unfused-20"])
def test_fp8_mlp_takes_relu2_and_the_sum_into_its_down_gemv(T, device):
    """An MLP whose down projection is an ``FP8Linear`` hands it relu² and the residual sum (one
    launch at decode sizes): bit-equal to relu², the FP8 projection and ``+`` as separate ops, at
    GEMV sizes and above them (where fp8_linear applies them around cuBLASLt / the reference)."""
    from fastmamba.layers.fp8_linear import FP8Linear
    from fastmamba.layers.mlp import MLP

    g = torch.Generator().manual_seed(T)
    mlp = MLP(40, 56, dtype=torch.bfloat16)
    with torch.no_grad():
        for lin in (mlp.up_proj, mlp.down_proj):
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
    mlp.up_proj, mlp.down_proj = FP8Linear.from_linear(mlp.up_proj), FP8Linear.from_linear(mlp.down_proj)
    mlp = mlp.to(device)
    u = torch.randn(T, 40, generator=g).to(device, torch.bfloat16)
    add = torch.randn(T, 40, generator=g).to(device, torch.bfloat16)
    with torch.no_grad():
        plain = mlp.down_proj(torch.relu(mlp.up_proj(u)).square())
        assert torch.equal(mlp(u), plain)
        assert torch.equal(mlp(u, add=add), plain + add)
