"""Write fastmamba's ops as a `kernels` noarch build: ``build/torch-<backend>/`` per backend with
``metadata.json``, the kernel package (``torch-ext/``) and a copy of the fastmamba sources it needs
(``_vendor/fastmamba``: ops and integrations, pure Python + Triton).

    python kernels_build/fastmamba_kernels/build.py [--out DIR] [--backends cuda,cpu]

Run by scripts/build_kernels_noarch.sh. The build id names the backend and a digest of every
file, so a changed source gives a new id (kernels imports one build per id).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NAME = "fastmamba"
BACKENDS = ("cuda", "cpu")  # cpu: the ops' PyTorch references (or the Triton interpreter)
VENDORED = ("fastmamba/__init__.py", "fastmamba/ops", "fastmamba/integrations")


def sources() -> dict[str, bytes]:
    """Relative path in a variant -> content: the kernel package, then the vendored fastmamba."""
    files = {p.name: p.read_bytes() for p in sorted((HERE / "torch-ext").glob("*.py"))}
    for item in VENDORED:
        src = REPO / item
        paths = [src] if src.is_file() else sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)
        for p in paths:
            files[f"_vendor/{p.relative_to(REPO).as_posix()}"] = p.read_bytes()
    return files


def license_name() -> str:
    for line in (REPO / "pyproject.toml").read_text().splitlines():
        if line.startswith("license ="):
            return line.split("=", 1)[1].strip().strip('"')
    raise ValueError("pyproject.toml: no `license = ...` line")


def build(out: Path, backends: tuple[str, ...] = BACKENDS) -> list[Path]:
    files = sources()
    digest = hashlib.sha256()
    for rel in sorted(files):
        digest.update(rel.encode() + b"\0" + files[rel] + b"\0")
    written = []
    for backend in backends:
        variant = out / f"torch-{backend}"
        if variant.exists():
            shutil.rmtree(variant)
        for rel, data in files.items():
            (variant / rel).parent.mkdir(parents=True, exist_ok=True)
            (variant / rel).write_bytes(data)
        metadata = {
            "id": f"_{NAME}_{backend}_{digest.hexdigest()[:12]}",
            "name": NAME,
            "version": 1,
            "license": license_name(),
            "python-depends": [],  # torch and triton only (triton ships with torch's CUDA wheels)
            "backend": {"type": backend},
        }
        (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
        written.append(variant)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "build", help="the build directory (default: %(default)s)")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated (default: %(default)s)")
    args = ap.parse_args()
    backends = tuple(b for b in args.backends.split(",") if b)
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        ap.error(f"--backends: unknown {bad}; expected some of {list(BACKENDS)}")
    for v in build(args.out, backends):
        print(v)


if __name__ == "__main__":
    main()
