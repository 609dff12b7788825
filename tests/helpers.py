"""Shared test utilities: poisoned buffers, dtype tolerances, seeded generators."""
from __future__ import annotations

import pytest
import torch

# (atol, rtol) by the lowest-precision dtype involved; the reference runs in fp32 from the same
# low-precision inputs (STYLE.md section 5).
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (5e-2, 1e-2),
}


def tol(*dtypes: torch.dtype) -> dict[str, float]:
    """assert_close kwargs for the loosest of ``dtypes``."""
    order = [torch.float32, torch.float16, torch.bfloat16]
    worst = max(dtypes, key=order.index)
    atol, rtol = TOLERANCES[worst]
    return {"atol": atol, "rtol": rtol}


def nan_like(t: torch.Tensor) -> torch.Tensor:
    """An output buffer that fails any comparison where the kernel forgot to write."""
    return torch.full_like(t, float("nan"))


def raises_now_or_at_next_call(device: torch.device, call, match: str) -> None:
    """A bad cu_seqlens or slot value given to a packed-batch op (causal_conv1d_varlen,
    ssd_scan_varlen): CPU tensors raise the ValueError at this call (host check); GPU tensors at the
    op's next call (the device check, ops/_common/varlen_checks.py: this call runs as padding)."""
    if device.type == "cuda":
        call()
        torch.cuda.synchronize()
    with pytest.raises(ValueError, match=match):
        call()


def seeded(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def scaled_tiny_model(device: torch.device | str | None = None):
    """mamba2-tiny in fp32 (exact greedy comparisons) with its mixers scaled up: the random preset's
    mixers barely move the logits (greedy then mostly repeats the input token), which would hide a
    wrong state. Default device: CUDA when available."""
    import fastmamba

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    m = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device=device)
    with torch.no_grad():
        for layer in m.backbone.layers:
            layer.mixer.in_proj.weight.mul_(10)
            layer.mixer.conv1d.weight.mul_(10)
            layer.mixer.out_proj.weight.mul_(30)
    return m


def run_to_completion(engine, prompts, params):
    """Add one request per (prompt, params) to ``engine``, step until all finish, and check every
    slot came back; returns the finished requests in prompt order."""
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished():
        engine.step()
    reqs = [engine.finished.pop(rid) for rid in rids]
    assert engine.cache.free_slots == engine.max_batch
    return reqs


class CorruptedOracle:
    """An oracle drafter's drafts with draft ``wrong_at(step)`` of every request made wrong (K or
    more: none wrong), so a step accepts exactly min(wrong_at(step), K) drafts. ``vocab``: the
    model's vocabulary size (a wrong draft is the right token + 1, wrapped)."""

    def __init__(self, oracle, wrong_at, vocab: int):
        self.oracle, self.wrong_at, self.vocab, self.step = oracle, wrong_at, vocab, 0

    def propose(self, requests, k):
        drafts = self.oracle.propose(requests, k)
        j = self.wrong_at(self.step)
        self.step += 1
        for d in drafts:
            if j < len(d):
                d[j] = (d[j] + 1) % self.vocab
        return drafts


@pytest.fixture(autouse=True, scope="module")
def runtime_reference_ops(request):
    """For the runtime test folders (imported by their conftest.py): their subject is scheduling,
    sampling, caches and bookkeeping, not kernels (tests/ops covers those), so the ops run as their
    PyTorch references (TRITON_INTERPRET=0 while a module runs, its module-scoped fixtures
    included), several times faster on a CPU than the Triton interpreter. A module that needs the
    kernels' path (the interpreter on a CPU) sets ``pytestmark = pytest.mark.kernels``."""
    if request.node.get_closest_marker("kernels") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield


def compile_in_subprocess(script: str, name: str, root: str):
    """Run ``python script name`` (an sm_90 compile test's own ``__main__``) without TRITON_INTERPRET,
    which Triton reads at import, and return the JSON value its last line prints. Skips where Triton's
    NVIDIA backend has no ptxas or Triton has no Gluon; a failed compile is an AssertionError."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # a Triton cache of its own: the tests read each kernel's PTX, which a cache hit need not carry
    # (scripts/gpu_session.sh brings a cache of cubins only)
    with tempfile.TemporaryDirectory(prefix="fastmamba-sm90-") as cache_dir:
        env["TRITON_CACHE_DIR"] = cache_dir
        done = subprocess.run([sys.executable, script, name], cwd=root, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    if done.returncode != 0:
        if "ptxas" in done.stderr and ("not found" in done.stderr or "No such file" in done.stderr):
            pytest.skip("Triton's NVIDIA backend has no ptxas here")
        if "No module named 'triton.experimental.gluon'" in done.stderr:
            pytest.skip("this Triton has no Gluon")
        raise AssertionError(f"sm_90 compile failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def compile_triton_sm90(kernel, consts: dict, types: dict, **options):
    """Compile a ``triton.jit`` kernel for sm_90 without a GPU (Triton's compiler and ptxas):
    ``consts`` are its constexpr (or constant) arguments by name, ``types`` the Triton types of
    the others by name (default i32); pointers and ``stride*`` arguments are marked 16-divisible,
    as a launch specialises them. Returns the CompiledKernel (``.asm``, ``.metadata``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = kernel.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
               if sig[n].startswith("*") or n.startswith("stride")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def ptxas_report(ptx: str, name: str) -> str:
    """``ptxas -arch=sm_90a -v`` (Triton's own) on ``ptx``: its report (registers, spills, ...).
    RuntimeError with ptxas's output when it fails (once, inside a full GPU suite run, it exited
    255 for every variant of a compile test with nothing captured)."""
    import os
    import subprocess

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fastmamba_{name}_{os.getpid()}.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    try:
        done = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True)
    finally:
        os.remove(path)
    if done.returncode != 0:
        raise RuntimeError(f"ptxas exited {done.returncode}:\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return done.stderr


def spill_lines(report: str) -> list[str]:
    """ptxas's spill lines of a ``ptxas_report`` (one per function)."""
    return [line.strip() for line in report.splitlines() if "spill" in line]


def count_launches(monkeypatch, module) -> list[int]:
    """[n]: how many kernel launches go through ``module.lean`` from now on (they still run)."""
    count = [0]
    real = module.lean

    def counting(fn):
        k = real(fn)

        class Counted:
            def __getitem__(self, grid):
                count[0] += 1
                return k[grid]
        return Counted()

    monkeypatch.setattr(module, "lean", counting)
    return count


def hf_gated_norm_is_grouped(mixer: torch.nn.Module, d_inner: int, groups: int) -> bool:
    """Whether a transformers Mamba-2 mixer's gated RMSNorm (``mixer.norm``) normalises each of its
    ``groups`` groups of ``d_inner`` channels on its own, as mamba_ssm and fastmamba do. transformers
    up to 5.17 normalised over all of d_inner; the class has been renamed between releases
    (``MambaRMSNormGated`` -> ``Mamba2RMSNormGated``), so it is found by its role and checked by its
    output rather than by a name: group 0 is scaled by 1 and group 1 by 100, with unit weights a
    grouped norm gives both groups a root mean square of 1."""
    norm = mixer.norm
    x = torch.ones(1, 1, d_inner)
    x[..., d_inner // groups:] = 100.0
    with torch.no_grad():
        if getattr(norm, "weight", None) is not None:
            norm.weight.fill_(1.0)
        y = norm(x, torch.full_like(x, 30.0)).float()  # the gate multiplies before the norm: it cancels
    rms = y.reshape(groups, -1).pow(2).mean(-1).sqrt()
    return bool(torch.allclose(rms, torch.ones_like(rms), rtol=1e-3))


def spread_moe_weights(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """A random hybrid's mixer weights made large enough that every layer, and each token's choice
    of experts, moves the logits: mixer matrices x3, MoE routers N(0, 0.5), selection biases
    N(0, 0.1) (a generator seeded with ``seed``). In place; returns the model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.backbone.layers:
            for name, p in block.mixer.named_parameters():
                if name == "gate.weight":
                    p.normal_(0.0, 0.5, generator=g)
                elif p.dim() >= 2:
                    p.mul_(3)
            for name, b in block.mixer.named_buffers():
                if name == "gate.e_score_correction_bias":
                    b.normal_(0.0, 0.1, generator=g)
    return model
