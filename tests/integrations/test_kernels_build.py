"""The `kernels` noarch build of fastmamba's ops (scripts/build_kernels_noarch.sh): its layout and
metadata, loaded from a local directory by the kernels package's loader and by transformers'
``KernelConfig(..., use_local_kernel=True)``; transformers' greedy tokens and logits with it equal
those without it, and fastmamba's ops are the ones that ran.
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import fastmamba.ops as fops
from tests.integrations import tiny_hf

transformers = pytest.importorskip("transformers")
kernels = pytest.importorskip("kernels")
from transformers.utils import import_utils  # noqa: E402

if not import_utils.is_kernels_available():
    pytest.skip(f"transformers {transformers.__version__} does not accept kernels {kernels.__version__} (it needs "
                f"{import_utils.KERNELS_MIN_VERSION} <= version < {import_utils.KERNELS_MAX_VERSION}): no kernel "
                "hooks to load the build into", allow_module_level=True)

REPO = Path(__file__).resolve().parents[2]
HOOKED = ("causal_conv1d_fn", "causal_conv1d_update", "mamba_chunk_scan_combined", "selective_state_update")
FP32 = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def build_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kernels_build") / "fastmamba_kernels"
    r = subprocess.run(["bash", str(REPO / "scripts/build_kernels_noarch.sh"), "--out", str(out / "build")],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return tiny_hf.build("nemotron-h", tmp_path_factory.mktemp("nemotron_h") / "ckpt")


@pytest.fixture
def calls(monkeypatch):
    counts = collections.Counter()
    for name in HOOKED:
        fn = getattr(fops, name)
        monkeypatch.setattr(fops, name, (lambda fn, name: lambda *a, **k: (counts.update([name]), fn(*a, **k))[1])(
            fn, name))
    return counts


@pytest.fixture(autouse=True)
def references(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the ops' PyTorch references: a generate loop


def test_layout_and_metadata(build_dir):
    variants = sorted(p.name for p in (build_dir / "build").iterdir())
    assert variants == ["torch-cpu", "torch-cuda"]
    ids = set()
    for v in variants:
        path = build_dir / "build" / v
        meta = kernels.Metadata.read_from_file(path / "metadata.json")
        raw = json.loads((path / "metadata.json").read_text())
        assert str(meta.name) == "fastmamba" and meta.version == 1 and meta.python_depends == []
        assert raw["backend"] == {"type": v.removeprefix("torch-")} and raw["license"] == "Apache-2.0"
        ids.add(meta.id)
        assert (path / "__init__.py").is_file() and (path / "layers.py").is_file()
        # every fastmamba op and integration source travels with the build
        for src in [*(REPO / "fastmamba/ops").rglob("*.py"), *(REPO / "fastmamba/integrations").rglob("*.py")]:
            if "__pycache__" not in src.parts:
                assert (path / "_vendor" / src.relative_to(REPO)).read_bytes() == src.read_bytes()
    assert len(ids) == 2  # one id per variant


def generate(model):
    ids, mask = tiny_hf.prompts(3)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, do_sample=False,
                             return_dict_in_generate=True, output_logits=True)
    return out.sequences, torch.stack(out.logits, 1)


def hook_layers(build_dir: Path) -> dict[str, str]:
    return kernels.get_local_kernel(build_dir, check_arch=False).layers.HOOK_LAYERS


def test_kernels_local_repository_runs_fastmamba(build_dir, checkpoint, calls):
    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    model = tiny_hf.load(checkpoint, use_kernels=False)
    ref_tokens, ref_logits = generate(model)
    mapping = {hook: {"cpu": LocalLayerRepository(repo_path=build_dir, layer_name=layer)}
               for hook, layer in hook_layers(build_dir).items()}
    with use_kernel_mapping(mapping, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    tokens, logits = generate(model)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **FP32)
    assert all(calls[n] > 0 for n in HOOKED), calls

    # an empty mapping puts transformers' own code back
    with use_kernel_mapping({}, inherit_mapping=False):
        kernelize(model, mode=Mode.INFERENCE, device="cpu")
    n = sum(calls.values())
    assert torch.equal(generate(model)[0], ref_tokens) and sum(calls.values()) == n


def test_transformers_kernel_config_use_local_kernel(build_dir, checkpoint, calls, monkeypatch):
    """transformers' own path: ``set_use_kernels(True, KernelConfig(mapping, use_local_kernel=True))``.
    transformers lists only accelerator devices for kernel mappings; CPU is added here so the path
    runs in CPU CI (the GPU test below needs no such change)."""
    from transformers import KernelConfig
    from transformers.utils import kernel_config

    monkeypatch.setattr(kernel_config, "KERNELS_SUPPORTED_DEVICE_TYPES", [*kernel_config.KERNELS_SUPPORTED_DEVICE_TYPES,
                                                                         "cpu"])
    model = tiny_hf.load(checkpoint, use_kernels=False)
    ref_tokens, ref_logits = generate(model)
    mapping = {hook: f"{build_dir}:{layer}" for hook, layer in hook_layers(build_dir).items()}
    model.set_use_kernels(True, KernelConfig(kernel_mapping=mapping, use_local_kernel=True))
    tokens, logits = generate(model)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, **FP32)
    assert all(calls[n] > 0 for n in HOOKED), calls
    model.reset_kernels()
    n = sum(calls.values())
    assert torch.equal(generate(model)[0], ref_tokens) and sum(calls.values()) == n


def test_build_runs_without_an_installed_fastmamba(build_dir, tmp_path):
    """Where fastmamba is not importable, the build imports its own copy (_vendor/)."""
    code = textwrap.dedent(f"""
        import sys
        sys.meta_path = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")
                         and "editable" not in type(f).__module__]
        sys.path = [p for p in sys.path if p not in ("", {str(REPO)!r})]
        import importlib.util
        assert importlib.util.find_spec("fastmamba") is None, "fastmamba is still importable"
        import torch
        from pathlib import Path
        from kernels import get_local_kernel
        k = get_local_kernel(Path({str(build_dir)!r}), check_arch=False)
        import fastmamba
        assert fastmamba.__file__.startswith({str(build_dir)!r}), fastmamba.__file__
        x = torch.randn(2, 8, 5)
        y = k.causal_conv1d_fn(x, torch.randn(8, 4), None, activation="silu")
        assert y.shape == x.shape and torch.isfinite(y).all()
        print("OK", sorted(k.layers.HOOK_LAYERS))
    """)
    # PYTHONPATH may hold where the other packages are (the GPU machine installs kernels, transformers
    # there); only the repository's own entry is dropped, as above
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() != REPO and not (Path(p) / "fastmamba").is_dir()]
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={"TRITON_INTERPRET": "0", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                            "PYTHONPATH": os.pathsep.join(keep)})
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
def test_kernel_config_on_gpu_bf16(build_dir, checkpoint):
    """From a bf16 checkpoint on the GPU: KernelConfig(use_local_kernel=True) gives transformers'
    logits within bf16 noise. (from_pretrained(use_kernels=True, kernel_config=...) with a local
    mapping fails inside transformers 5.25, which rewrites the mapping to tuples that its local
    path then splits as strings; set_use_kernels after loading avoids it.)"""
    from transformers import KernelConfig

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map="cuda",
                                                              use_kernels=False).eval()
    ids, mask = (t.cuda() for t in tiny_hf.prompts(3))
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
        mapping = {hook: f"{build_dir}:{layer}" for hook, layer in hook_layers(build_dir).items()}
        model.set_use_kernels(True, KernelConfig(kernel_mapping=mapping, use_local_kernel=True))
        got = model(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(got[real].float(), ref[real].float(), atol=5e-2, rtol=1e-2)
