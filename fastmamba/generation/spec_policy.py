"""Which verification path a speculative decoding step takes, from measured crossover batches.

``fastmamba bench spec`` times, per (shape, state dtype, T = K+1 tokens per step, batch), the
replay kernels against the per-position ("legacy") path with its copy, and reports per (shape,
state dtype) a crossover table: T -> the smallest batch from which replay beat legacy at every
larger measured batch (None: it never did, legacy at every batch). ``choose_verify_path`` takes
such a table.

The measured tables live in a JSON file in this package (``verify_crossover.json``), keyed by the
shape: (heads H, head dim P, state size N, state dtype, T). ``bench spec --write-table [PATH]``
merges a run's rows into it (``write_table``); ``lookup_table`` reads the entry for a model's
shape, and ``Engine(verify_table=None)`` uses it (``Engine.verify_table_entry`` says which).

File format (``FORMAT`` 1)::

    {"format": 1, "about": "...", "sets": [
        {"gpu": "NVIDIA H100 80GB HBM3", "date": "2026-11-22", "commit": "49359f8",
         "command": "python -m fastmamba.bench spec ...", ...any other provenance...,
         "rows": [{"heads": 128, "head_dim": 64, "state_size": 128, "state_dtype": "fp32", "tokens": 2,
                   "crossover_batch": 1, "batches": [1, 8, 32, 128, 256], "shape": "nemotron-h", "groups": 8}]}]}

A set is one run (its GPU, date, commit and command); a row is one (shape, state dtype, T).
Writing a set removes the older rows it supersedes (same GPU, H, P, N, state dtype and T) and the
sets left empty.

Lookup rule for a (H, P, N, state dtype) (``lookup_table``): the rows are grouped by (GPU, H, P,
N, state dtype); the group chosen is the first by

1. the state's element size (fp32 vs 16-bit: bf16 and fp16 move the same bytes) equal to the
   one asked for,
2. the nearest state bytes per request, |log(H P N e / H' P' N' e')| with e the element size
   (within one element size: the nearest H*P*N as a ratio; an exact shape is distance 0),
3. the same state dtype (bf16 before fp16 for a bf16 state),
4. measured on the GPU asked for (``device_name``, as ``torch.cuda.get_device_name`` spells it),
5. the newest set, then the larger shape.

So an unseen shape takes the measured shape with the nearest state size per request (mamba2-2.7b,
H80 P64 N128, takes Nemotron-H's H128 P64 N128 entry until it has its own), a bf16 state the fp16
entry of its shape, and a GPU without rows the rows of another. The group's rows give T ->
crossover; ``choose_verify_path`` maps an unmeasured T to the nearest measured one.
"""
from __future__ import annotations

import copy
import datetime
import functools
import importlib.resources
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

VerifyPath = Literal["replay", "legacy", "plain"]

FORMAT = 1
TABLE_FILE = "verify_crossover.json"
STATE_DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}  # name -> bytes per element
# the shape whose table ``choose_verify_path`` uses when given none: Nemotron-H, fp32 state
DEFAULT_SHAPE = (128, 64, 128, "fp32")
ROW_KEYS = ("heads", "head_dim", "state_size", "state_dtype", "tokens")  # with the set's GPU: a row's identity
SET_FIELDS = ("gpu", "date", "commit", "command")  # provenance every set carries


def default_table_path() -> Path:
    """The package's table file (a real file for a source checkout, an editable or a wheel install)."""
    return Path(str(importlib.resources.files("fastmamba.generation").joinpath(TABLE_FILE)))


class TableEntry(NamedTuple):
    """What ``lookup_table`` found: the crossover table and where it came from."""

    table: dict[int, int | None]  # T -> crossover batch (None: legacy at every batch); {} if the file has no row
    heads: int | None  # the shape and state dtype of the rows used (None: no row)
    head_dim: int | None
    state_size: int | None
    state_dtype: str | None
    gpu: str | None  # the provenance of the newest set among those rows
    date: str | None
    commit: str | None
    command: str | None
    exact: bool  # the shape and state dtype asked for (on any GPU)
    path: str  # the table file

    def describe(self) -> str:
        """One line: which entry, measured where, when, at which commit, by which command."""
        if self.heads is None:
            return f"no measured entry in {self.path}: the placeholder rule (replay from batch 8)"
        how = "exact shape" if self.exact else "nearest measured shape"
        return (f"{how} H{self.heads} P{self.head_dim} N{self.state_size} {self.state_dtype} state, measured on "
                f"{self.gpu} {self.date} at {self.commit} ({self.command}); {self.path}")


# --- reading and writing the file ---------------------------------------------------------------
def _fail(path: object, what: str) -> ValueError:
    return ValueError(f"spec_policy: verify table file {path}: {what}")


def _check_int(path: object, where: str, name: str, value: object, *, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(path, f"{where}: {name} expected an int >= {low}, got {value!r}")
    return value


def validate(doc: object, path: object = "<table>") -> list[dict]:
    """The sets of a parsed table file, checked field by field (``ValueError`` naming the file,
    the set / row and the field otherwise)."""
    if not isinstance(doc, dict):
        raise _fail(path, f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        raise _fail(path, f"format expected {FORMAT}, got {doc.get('format')!r}")
    sets = doc.get("sets")
    if not isinstance(sets, list):
        raise _fail(path, f"sets expected a list, got {type(sets).__name__}")
    for i, s in enumerate(sets):
        if not isinstance(s, dict):
            raise _fail(path, f"sets[{i}] expected an object, got {type(s).__name__}")
        for name in SET_FIELDS:
            if not isinstance(s.get(name), str) or not s[name]:
                raise _fail(path, f"sets[{i}]: {name} expected a non-empty string, got {s.get(name)!r}")
        if not isinstance(s.get("rows"), list):
            raise _fail(path, f"sets[{i}]: rows expected a list, got {type(s.get('rows')).__name__}")
        for j, row in enumerate(s["rows"]):
            where = f"sets[{i}].rows[{j}]"
            if not isinstance(row, dict):
                raise _fail(path, f"{where} expected an object, got {type(row).__name__}")
            for name in ("heads", "head_dim", "state_size", "tokens"):
                _check_int(path, where, name, row.get(name))
            if row.get("state_dtype") not in STATE_DTYPES:
                raise _fail(path, f"{where}: state_dtype expected one of {tuple(STATE_DTYPES)}, got {row.get('state_dtype')!r}")
            if "crossover_batch" not in row:
                raise _fail(path, f"{where}: crossover_batch missing (an int >= 1, or null: legacy at every batch)")
            if row["crossover_batch"] is not None:
                _check_int(path, where, "crossover_batch", row["crossover_batch"])
    return sets


@functools.lru_cache(maxsize=8)
def _read_cached(path: str, mtime_ns: int, size: int) -> tuple[dict, ...]:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise _fail(path, f"not valid JSON ({exc})") from None
    return tuple(validate(doc, path))


def read_table(path: str | os.PathLike | None = None) -> list[dict]:
    """The sets of the table file at ``path`` (default: the package's), validated; cached until
    the file changes. A missing file raises ``FileNotFoundError`` naming it."""
    path = Path(path) if path is not None else default_table_path()
    try:
        st = path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"spec_policy: verify table file {path} does not exist") from None
    return copy.deepcopy(list(_read_cached(str(path), st.st_mtime_ns, st.st_size)))


def _row_key(gpu: str, row: Mapping) -> tuple:
    return (gpu, *(row[k] for k in ROW_KEYS))


def merge_sets(sets: Sequence[dict], new: dict) -> list[dict]:
    """``sets`` with ``new`` appended: older rows with the same (GPU, H, P, N, state dtype, T) as
    one of ``new``'s are dropped, and so are the sets left with no row."""
    validate({"format": FORMAT, "sets": [new]}, "<new set>")
    replaced = {_row_key(new["gpu"], r) for r in new["rows"]}
    out = []
    for s in sets:
        rows = [r for r in s["rows"] if _row_key(s["gpu"], r) not in replaced]
        if rows:
            out.append({**s, "rows": rows})
    return [*out, new]


def _dumps(doc: dict) -> str:
    """Indented JSON, one row per line (diffs stay readable)."""
    lines = ["{", f'  "format": {json.dumps(doc["format"])},', f'  "about": {json.dumps(doc.get("about", ""))},',
             '  "sets": [']
    for i, s in enumerate(doc["sets"]):
        lines.append("    {")
        for name, value in s.items():
            if name != "rows":
                lines.append(f"      {json.dumps(name)}: {json.dumps(value)},")
        lines.append('      "rows": [')
        rows = [f"        {json.dumps(r)}" for r in s["rows"]]
        lines.append(",\n".join(rows))
        lines.append("      ]")
        lines.append("    }" + ("," if i < len(doc["sets"]) - 1 else ""))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


ABOUT = ("Verify-path crossover batches for fastmamba.generation.spec_policy (read its docstring): per (heads, "
         "head_dim, state_size, state_dtype, tokens T = K+1) the smallest measured batch from which replay (op + "
         "commit) beat legacy (per-position states + the copy) at every larger measured batch; null: replay never "
         "did (legacy at every batch). Merged by `python -m fastmamba.bench spec --write-table`, one set per run.")


def write_table(new: dict, path: str | os.PathLike | None = None) -> Path:
    """Merge the set ``new`` (provenance fields + ``rows``, see the module docstring) into the
    table file at ``path`` (default: the package's; created when missing) and return its path.
    The file is replaced atomically."""
    path = Path(path) if path is not None else default_table_path()
    sets = read_table(path) if path.exists() else []
    doc = {"format": FORMAT, "about": ABOUT, "sets": merge_sets(sets, new)}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(_dumps(doc))
    os.replace(tmp, path)
    return path


def new_set(rows: Sequence[Mapping], *, gpu: str, commit: str, command: str, date: str | None = None,
            **provenance: object) -> dict:
    """A set for ``write_table``: ``rows`` (each with ``ROW_KEYS``, ``crossover_batch`` and
    optionally ``batches``, ``shape``, ``groups``) and the run's provenance; ``date`` defaults to
    today (UTC, ISO)."""
    date = date or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
    return {"gpu": gpu, "date": date, "commit": commit or "unknown", "command": command, **provenance,
            "rows": [dict(r) for r in rows]}


# --- lookup -------------------------------------------------------------------------------------
def _state_name(state_dtype: object) -> str:
    name = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}.get(str(state_dtype).removeprefix("torch."),
                                                                         str(state_dtype))
    if name not in STATE_DTYPES:
        raise ValueError(f"spec_policy: state_dtype expected one of {tuple(STATE_DTYPES)} (or the torch dtype), "
                         f"got {state_dtype!r}")
    return name


def lookup_table(heads: int, head_dim: int, state_size: int, state_dtype: object = "fp32", *,
                 device_name: str | None = None, path: str | os.PathLike | None = None) -> TableEntry:
    """The crossover table measured for the shape (H ``heads``, P ``head_dim``, N ``state_size``)
    and state dtype ("fp32", "fp16", "bf16" or the torch dtype), or for the nearest measured one
    (the rule is in the module docstring), preferring rows measured on ``device_name``.
    ``path``: the table file (default: the package's). ``TableEntry.describe()`` names the entry.
    """
    for name, v in (("heads", heads), ("head_dim", head_dim), ("state_size", state_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"spec_policy.lookup_table: {name} expected an int >= 1, got {v!r}")
    state = _state_name(state_dtype)
    path = Path(path) if path is not None else default_table_path()
    groups: dict[tuple, list[tuple[dict, dict]]] = {}
    for s in read_table(path):
        for row in s["rows"]:
            key = (s["gpu"], row["heads"], row["head_dim"], row["state_size"], row["state_dtype"])
            groups.setdefault(key, []).append((s, row))
    if not groups:
        return TableEntry({}, None, None, None, None, None, None, None, None, False, str(path))
    size = STATE_DTYPES[state]
    want = math.log(heads * head_dim * state_size * size)
    have = {k: k[1] * k[2] * k[3] * STATE_DTYPES[k[4]] for k in groups}
    newest = {k: max((s for s, _ in rows), key=lambda s: s["date"]) for k, rows in groups.items()}

    def rank(key: tuple) -> tuple:  # rules 1-4; min() keeps the first of equals: newest, then larger
        gpu, _, _, _, sdt = key
        return (STATE_DTYPES[sdt] != size, round(abs(math.log(have[key]) - want), 12), sdt != state,
                gpu != device_name)

    best = min(sorted(groups, key=lambda k: (newest[k]["date"], have[k]), reverse=True), key=rank)
    gpu, H, P, N, sdt = best
    table: dict[int, int | None] = {}
    for _, row in sorted(groups[best], key=lambda sr: sr[0]["date"]):  # a newer set's T wins
        table[row["tokens"]] = row["crossover_batch"]
    latest = newest[best]
    return TableEntry(dict(sorted(table.items())), H, P, N, sdt, gpu, latest["date"], latest["commit"],
                      latest["command"], (H, P, N, sdt) == (heads, head_dim, state_size, state), str(path))


def default_table(nheads: int, state_dtype: object = "fp32", *, head_dim: int = 64, state_size: int = 128,
                  device_name: str | None = None, path: str | os.PathLike | None = None) -> dict[int, int | None]:
    """``lookup_table(...).table`` (kept for callers that know only the head count: P 64, N 128)."""
    return lookup_table(nheads, head_dim, state_size, state_dtype, device_name=device_name, path=path).table


# Crossover for an empty table (see choose_verify_path).
PLACEHOLDER_CROSSOVER_BATCH = 8


def choose_verify_path(batch: int, tokens: int, table: Mapping[int | str, int | None] | None = None) -> VerifyPath:
    """The verification path for a step of ``batch`` requests verifying ``tokens`` (T = K+1) each.

    batch   requests in the step (>= 1)
    tokens  T: 1 means nothing was drafted -> "plain" (single-token decode)
    table   T -> crossover batch (replay from that batch up, legacy below; None: legacy at every
            batch), as ``fastmamba bench spec`` reports it (keys may be strings, as JSON has them);
            a T that is not in the table uses the nearest T that is (the larger on a tie).
            None: the package table's entry for ``DEFAULT_SHAPE`` (Nemotron-H, fp32 state).

    An empty table ({}) means "replay" for batch >= 8 and "legacy" below (a conservative guess
    for a GPU that was not measured).

    >>> choose_verify_path(1, 6, {6: 1}), choose_verify_path(8, 6, {6: None}), choose_verify_path(64, 1)
    ('replay', 'legacy', 'plain')
    >>> choose_verify_path(1, 6, {}), choose_verify_path(8, 6, {})
    ('legacy', 'replay')
    >>> choose_verify_path(4, 6, {2: 16, 6: 4, 16: None}), choose_verify_path(4, 5, {2: 16, 6: 4, 16: None})
    ('replay', 'replay')
    """
    if batch < 1 or tokens < 1:
        raise ValueError(f"choose_verify_path: batch and tokens must be >= 1, got batch={batch}, tokens={tokens}")
    if tokens == 1:
        return "plain"
    table = lookup_table(*DEFAULT_SHAPE).table if table is None else table
    if not table:
        return "replay" if batch >= PLACEHOLDER_CROSSOVER_BATCH else "legacy"
    entries = {int(t): crossover for t, crossover in table.items()}
    nearest = min(entries, key=lambda t: (abs(t - tokens), -t))
    crossover = entries[nearest]
    return "replay" if crossover is not None and batch >= crossover else "legacy"


def expected_tokens_per_step(tokens: int, accept_rate: float) -> float:
    """Tokens a step of T = K+1 yields on average when each draft is accepted with probability
    ``accept_rate`` independently (the first rejection ends the run; the target's own token always
    counts): sum_{i=0..K} rate^i.

    >>> expected_tokens_per_step(1, 0.6), round(expected_tokens_per_step(3, 0.5), 3)
    (1.0, 1.75)
    """
    if not 0.0 <= accept_rate <= 1.0:
        raise ValueError(f"expected_tokens_per_step: accept_rate must lie in [0, 1], got {accept_rate}")
    return sum(accept_rate**i for i in range(tokens))


# --- how many drafts per step -----------------------------------------------------------------
class SpeculationPolicy:
    """Speculate with k drafts per request (1..K) or not at all (k = 0: a plain step), per batch,
    where it pays: the k of the highest expected tokens per second,

        expected_tokens_per_step(k + 1, a) / cost(batch, k)

    a    the per-draft acceptance seen so far: accepted / proposed drafts, an exponential moving
         average over the speculative steps (``ema`` weight of each step), ``prior_accept`` before any;
    cost seconds of one engine step of ``batch`` requests with k drafts (drafting, verifying,
         committing; k = 0 a plain step). ``cost=None``: measured, the moving average of the
         engine's step times per (batch bucket: the power of two at or above the batch, k); a k not
         yet timed twice at a bucket is tried (explore) before choosing, and its first time is
         dropped (it pays CUDA-graph captures and compiles). A function ``cost(batch, k)``:
         a model or synthetic costs (tests, benchmarks); nothing is measured then.

    Speculation switched off (k = 0) stops refreshing the acceptance, so every ``probe_every``-th
    plain step of a bucket runs K drafts once more (``probe``): where acceptance has risen, the
    policy switches back on. ``candidates``: the k values weighed (default 0..K).
    ``report()`` says the last choice and how often each k was chosen (the engine puts it in
    ``stats["policy"]``).
    """

    def __init__(self, max_k: int, *, cost=None, prior_accept: float = 0.7, ema: float = 0.2,
                 probe_every: int = 32, candidates: Sequence[int] | None = None):
        if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
            raise ValueError(f"SpeculationPolicy: max_k must be an int >= 1, got {max_k!r}")
        if not 0.0 <= prior_accept <= 1.0 or not 0.0 < ema <= 1.0:
            raise ValueError(f"SpeculationPolicy: prior_accept must lie in [0, 1] and ema in (0, 1], got "
                             f"{prior_accept!r}, {ema!r}")
        if not (isinstance(probe_every, int) and probe_every >= 1):
            raise ValueError(f"SpeculationPolicy: probe_every must be an int >= 1, got {probe_every!r}")
        cands = sorted(set(range(max_k + 1) if candidates is None else candidates))
        if not cands or any(not isinstance(k, int) or not 0 <= k <= max_k for k in cands):
            raise ValueError(f"SpeculationPolicy: candidates must be ints in [0, max_k={max_k}], got {candidates!r}")
        if cost is not None and not callable(cost):
            raise ValueError(f"SpeculationPolicy: cost must be None or a function cost(batch, k), got {cost!r}")
        self.max_k, self.cost, self.ema, self.probe_every = max_k, cost, ema, probe_every
        self.candidates = cands
        self.accept_rate = prior_accept
        self._times: dict[tuple[int, int], float] = {}  # (bucket, k) -> seconds per step (EMA)
        self._samples: dict[tuple[int, int], int] = {}  # (bucket, k) -> steps timed
        self._off_steps: dict[int, int] = {}  # bucket -> plain steps chosen since the last speculative one
        self.chosen: dict[int, int] = {k: 0 for k in cands}
        self.last: dict | None = None

    @staticmethod
    def bucket(batch: int) -> int:
        return 1 << max(0, (batch - 1).bit_length())

    def step_cost(self, batch: int, k: int) -> float | None:
        if self.cost is not None:
            return float(self.cost(batch, k))
        key = (self.bucket(batch), k)
        return self._times.get(key) if self._samples.get(key, 0) >= 2 else None

    def choose(self, batch: int) -> int:
        """The number of drafts for a step of ``batch`` requests."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"SpeculationPolicy.choose: batch must be an int >= 1, got {batch!r}")
        b = self.bucket(batch)
        costs = {k: self.step_cost(batch, k) for k in self.candidates}
        untimed = [k for k, c in costs.items() if c is None]
        if untimed:  # measure before weighing: the largest k first
            k, why = max(untimed), "explore"
        else:
            rate = {k: expected_tokens_per_step(k + 1, self.accept_rate) / max(c, 1e-12) for k, c in costs.items()}
            k = max(rate, key=lambda j: (rate[j], -j))  # the fewer drafts on a tie
            why = "best"
            if k == 0 and self.max_k in self.candidates:
                self._off_steps[b] = self._off_steps.get(b, 0) + 1
                if self._off_steps[b] >= self.probe_every:
                    k, why = self.max_k, "probe"
        if k:
            self._off_steps[b] = 0
        self.chosen[k] = self.chosen.get(k, 0) + 1
        self.last = {"batch": batch, "k": k, "why": why, "accept_rate": round(self.accept_rate, 4)}
        return k

    def record(self, batch: int, k: int, seconds: float, proposed: int, accepted: int) -> None:
        """What a step of ``batch`` requests with ``k`` drafts cost and how many drafts it accepted."""
        if proposed > 0:
            self.accept_rate += self.ema * (accepted / proposed - self.accept_rate)
        if self.cost is None and seconds > 0:
            key = (self.bucket(batch), k)
            n = self._samples[key] = self._samples.get(key, 0) + 1
            old = self._times.get(key)
            # the first step of a (bucket, k) is a warm-up: the second one replaces it
            self._times[key] = seconds if n <= 2 else old + self.ema * (seconds - old)

    def report(self) -> dict:
        return {"last": self.last, "chosen": dict(self.chosen), "accept_rate": round(self.accept_rate, 4)}
