"""What every op benchmark shares: cases, providers, input sets, and the correctness check.

An op module subclasses ``OpBench`` and fills in ``cases``, ``providers``, ``make_set`` and
``args``. The runner (``fastmamba.bench.kernels.run_suite``, behind the ``kernels`` and ``prefill``
targets) does the rest: it allocates the rotating input sets, times each provider on the same
tensors through the same positional call, then checks each provider once against the oracle (by
default the PyTorch reference, itself timed as a provider). A bench whose providers need different
calls, or whose oracle is not a timed provider, overrides ``bind``, ``check`` or ``oracle``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fastmamba.bench import peers
from fastmamba.bench.timing import TimingConfig

# Output tolerance for bf16 activations (STYLE.md section 5): the reference runs in fp32 from the
# same bf16 inputs. Also used for an fp32 SSM state: the check exists to catch wrong kernels, and
# the state has been through a bf16 x, B, C and dt, so the fp32 table entry would be too strict.
BF16_TOL = {"atol": 5e-2, "rtol": 1e-2}

# mamba_ssm's launchers enter torch.cuda.device(x.device.index), which fails for CPU tensors
MAMBA_SSM_CPU = "GPU only (its launchers enter torch.cuda.device)"

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True, eq=False)
class Case:
    """One (op, shape, dtypes, batch) point; ``nbytes`` is its byte model per call."""

    op: str
    shape: str  # model the shape comes from, e.g. "nemotron-h"
    dims: str  # e.g. "H128 P64 N128 G8"
    dtype: str  # e.g. "fp32/bf16" (state/activations)
    batch: int
    nbytes: int
    params: dict = field(default_factory=dict)
    flops: int = 0  # model FLOPs per call (0: no FLOP model)
    variant: str = ""  # short tag that tells apart cases of one shape (progress lines only)

    @property
    def label(self) -> str:
        tag = f" {self.variant}" if self.variant else ""
        return f"{self.op} {self.shape}{tag} {self.dtype} b={self.batch}"


@dataclass(eq=False)
class Provider:
    """An implementation to time. ``kind`` is "ours", "peer" or "ref"; ``fn`` None means skipped."""

    name: str
    kind: str
    version: str
    fn: Callable | None
    reason: str = ""  # why fn is None
    note: str = ""  # how it was loaded, when that is worth knowing (goes into the rows)
    source: str = ""  # file it came from (header only)
    preflight_sync: bool = False  # check for host syncs before attempting graph capture

    @property
    def available(self) -> bool:
        return self.fn is not None


def describe(exc: BaseException) -> str:
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _fastmamba_version() -> str:
    import fastmamba

    return getattr(fastmamba, "__version__", "?")


def load_fastmamba(subpackage: str, attr: str, module: str | None = None) -> Callable:
    """``fastmamba.ops.<attr>``, or ``fastmamba.ops.<subpackage>.<module>.<attr>`` when ``module``
    is given (the reference)."""
    name = "fastmamba.ops" if module is None else f"fastmamba.ops.{subpackage}.{module}"
    return getattr(importlib.import_module(name), attr)


class OpBench:
    """Base class; see the module docstring. Subclasses set the class attributes below."""

    key: str = ""  # name on the command line: ssu, conv, norm
    title: str = ""  # the op's public name
    mutated: tuple[str, ...] = ()  # input-set entries the op writes in place
    exact_state: bool = False  # mutated entries must match the reference bit for bit
    out_tol: dict = BF16_TOL
    state_tol: dict = BF16_TOL
    timing: TimingConfig = TimingConfig()  # decode kernels: many calls per graph
    quick_timing: TimingConfig = TimingConfig.quick()

    # --- to implement -------------------------------------------------------------------------
    def cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        raise NotImplementedError

    def providers(self, device: torch.device) -> list[Provider]:
        """fastmamba first, then peers, then the reference (whose fn is also the check's oracle)."""
        raise NotImplementedError

    def make_set(self, case: Case, device: torch.device, seed: int) -> dict[str, torch.Tensor | None]:
        raise NotImplementedError

    def args(self, case: Case, inp: dict) -> tuple:
        """Positional arguments of the call, identical for every provider."""
        raise NotImplementedError

    # --- optional -----------------------------------------------------------------------------
    def configure(self, args: object) -> "OpBench":
        """The bench for one run, given the target's parsed arguments (e.g. a ``--tokens`` list):
        by default this one. Return a new instance rather than changing the shared ``BENCH``."""
        return self

    def provider_bytes(self, prov: Provider, case: Case) -> int:
        """The byte model of ``prov`` on ``case`` (GB/s, cold-L2 test): by default ``case.nbytes``.
        Providers that do different work for the same case (verification paths) override it."""
        return case.nbytes

    def oracle(self, device: torch.device, providers: Sequence[Provider], mode: str = "auto") -> Provider | None:
        """What ``check`` compares against: by default the timed reference provider.

        ``mode`` is the target's ``--oracle`` choice ("auto" where it has none).
        """
        return next((p for p in providers if p.kind == "ref" and p.available), None)

    def skip_reason(self, prov: Provider, case: Case) -> str:
        """Why ``prov`` does not run ``case`` (e.g. a layout it does not take); '' if it does."""
        return ""

    def row_note(self, prov: Provider, case: Case) -> str:
        """A note for this provider's row of this case (how it was called, what it skipped)."""
        return ""

    def header_notes(self, device: torch.device) -> list[str]:
        """Lines for the report header: what the cases hold, beyond what the table shows."""
        return []

    def tune_cases(self, device: torch.device, batches: Sequence[int]) -> list[Case]:
        """The cases ``tune`` sweeps: by default all of them."""
        return self.cases(device, batches)

    def tune_candidates(self, configs: object, case: Case) -> list[dict]:
        """The launch configs ``tune`` tries on ``case``: the op's ``configs.CANDIDATES``."""
        return list(configs.CANDIDATES)

    # --- shared -------------------------------------------------------------------------------
    def bind(self, prov: Provider, case: Case, inp: dict) -> Callable[[], object]:
        """The timed call of ``prov`` on one input set (the same positional call for every provider)."""
        fn = prov.fn
        args = self.args(case, inp)
        return lambda: fn(*args)

    def check(self, prov: Provider, ref: Provider, case: Case, inp: dict) -> str:
        """Run ``prov`` and ``ref`` from identical copies of the mutated inputs; "ok" or "FAIL ...".

        Both start from clones of the state, so the comparison is fair whatever timing did to it.
        """
        mine = {k: (v.clone() if k in self.mutated and v is not None else v) for k, v in inp.items()}
        theirs = {k: (v.clone() if k in self.mutated and v is not None else v) for k, v in inp.items()}
        try:
            out = prov.fn(*self.args(case, mine))
        except Exception as exc:  # noqa: BLE001
            return f"FAIL raised {describe(exc)}"
        try:
            expected = ref.fn(*self.args(case, theirs))
        except Exception as exc:  # noqa: BLE001
            return f"ref error: {describe(exc)}"
        problems = [_compare("y", out, expected, self.out_tol)]
        for name in self.mutated:
            tol = {"atol": 0.0, "rtol": 0.0} if self.exact_state else self.state_tol
            problems.append(_compare(name, mine[name], theirs[name], tol))
        problems = [p for p in problems if p]
        return "ok" if not problems else "FAIL " + "; ".join(problems)



def fastmamba_provider(subpackage: str, attr: str, module: str | None = None) -> Provider:
    """``fastmamba.ops.<attr>`` (or ``fastmamba.ops.<subpackage>.<module>.<attr>``) as our provider."""
    try:
        fn = load_fastmamba(subpackage, attr, module)
    except Exception as exc:  # noqa: BLE001
        return Provider("fastmamba", "ours", _fastmamba_version(), None, reason=describe(exc))
    return Provider("fastmamba", "ours", _fastmamba_version(), fn)


def fastmamba_pdl_provider(subpackage: str, attr: str, device: torch.device, module: str | None = None) -> Provider:
    """Our op with programmatic dependent launch on (GPU, sm_90+): a graph of back-to-back calls
    then overlaps each launch with the previous kernel's tail, as a PDL decode step would."""
    base = fastmamba_provider(subpackage, attr, module)
    name = "fastmamba+pdl"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return Provider(name, "ours", base.version, None, reason="PDL needs a Hopper (sm_90) or newer GPU")
    if base.fn is None:
        return Provider(name, "ours", base.version, None, reason=base.reason)
    from fastmamba.ops.runtime import programmatic_dependent_launch

    def call(*args):
        with programmatic_dependent_launch():
            return base.fn(*args)

    return Provider(name, "ours", base.version, call)


def reference_provider(subpackage: str, attr: str) -> Provider:
    version = f"torch {torch.__version__}"
    try:
        fn = load_fastmamba(subpackage, attr, module="ref")
    except Exception as exc:  # noqa: BLE001
        return Provider("torch-ref", "ref", version, None, reason=describe(exc))
    return Provider("torch-ref", "ref", version, fn, preflight_sync=True)


def peer_provider(peer: peers.Peer, device: torch.device, cpu_reason: str) -> Provider:
    """A peer; on the CPU it is loaded (so the header shows whether it would load) but not run."""
    if peer.available and device.type != "cuda":
        return Provider(peer.name, "peer", peer.version, None, reason=f"loaded, but {cpu_reason}", source=peer.source)
    return Provider(peer.name, "peer", peer.version, peer.fn, reason=peer.reason, source=peer.source)


def adapted_peer_provider(peer: peers.Peer, device: torch.device, adapt: Callable[[Callable], Callable],
                          cpu_reason: str = "", note: str = "") -> Provider:
    """A peer whose signature differs from ours: ``adapt(peer.fn)`` is a callable taking the bench's
    positional arguments. A Triton peer (vLLM's ops) also runs on the CPU under the interpreter,
    unless ``cpu_reason`` says why it cannot."""
    if not peer.available:
        return Provider(peer.name, "peer", peer.version, None, reason=peer.reason, source=peer.source)
    if device.type != "cuda":
        from fastmamba.ops.runtime import interpreter_enabled

        why = cpu_reason or ("" if interpreter_enabled() else "its Triton kernels need TRITON_INTERPRET=1 on the CPU")
        if why:
            return Provider(peer.name, "peer", peer.version, None, reason=f"loaded, but {why}", source=peer.source)
    return Provider(peer.name, "peer", peer.version, adapt(peer.fn), note=note, source=peer.source)


_COMPARE_CHUNK = 1 << 30  # elements per torch.testing comparison


def _compare(name: str, got: object, want: object, tol: dict) -> str:
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return f"{name}: expected a tensor, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    if got.numel() > _COMPARE_CHUNK and got.dim() > 1:
        # torch.testing refuses tensors of 2^31 or more elements (legacy's per-position states at
        # batch 256, T=16 hold 4.3e9): compare slices along the first dimension
        step = max(1, _COMPARE_CHUNK // (got.numel() // got.shape[0]))
        for i in range(0, got.shape[0], step):
            problem = _compare(f"{name}[{i}:{i + step}]", got[i:i + step], want[i:i + step], tol)
            if problem:
                return problem
        return ""
    try:
        torch.testing.assert_close(got.float(), want.float(), **tol)
    except AssertionError as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        keep = [ln for ln in lines if ln.startswith(("Mismatched", "Greatest absolute"))] or lines[:1]
        return f"{name}: " + ", ".join(keep)
    return ""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| (Frobenius, in fp64); inf if ``got`` has a non-finite value."""
    g, w = got.double(), want.double()
    if not bool(torch.isfinite(g).all()):
        return float("inf")
    denom = float(torch.linalg.vector_norm(w))
    diff = float(torch.linalg.vector_norm(g - w))
    return diff / denom if denom > 0 else diff


def compare_relative(name: str, got: object, want: object, rel_tol: float) -> str:
    """'' if ``got`` is within ``rel_tol`` of ``want`` in relative error norm, else what is wrong.

    For long reductions in low precision (a scan over thousands of tokens), where an elementwise
    tolerance either fails on a few small entries or has to be loose everywhere.
    """
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return f"{name}: expected a tensor, got {type(got).__name__}"
    if got.shape != want.shape:
        return f"{name}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    err = relative_error(got, want)
    return "" if err <= rel_tol else f"{name}: relative error {err:.2e} > {rel_tol:.0e}"
