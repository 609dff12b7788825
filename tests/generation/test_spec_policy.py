"""The verify-path crossover table file (fastmamba.generation.spec_policy): write / read round
trip, merging, validation, lookup by exact shape and the fallback for unseen shapes, the package's
file, and the engine's pick for its model's shape."""
from __future__ import annotations

import json

import pytest
import torch

import fastmamba
from fastmamba.generation import spec_policy
from fastmamba.generation.engine import Engine
from fastmamba.generation.spec_policy import lookup_table, new_set, read_table, write_table

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


def _rows(H: int, P: int, N: int, state: str, table: dict[int, int | None], **extra) -> list[dict]:
    return [dict(heads=H, head_dim=P, state_size=N, state_dtype=state, tokens=T, crossover_batch=c, **extra)
            for T, c in table.items()]


def _set(rows, gpu=H100, commit="abc1234", date="2026-11-20", command="python -m fastmamba.bench spec x", **extra):
    return new_set(rows, gpu=gpu, commit=commit, command=command, date=date, **extra)


# --- the file -------------------------------------------------------------------------------------
def test_write_read_round_trip(tmp_path):
    path = tmp_path / "sub" / "table.json"
    path.parent.mkdir()
    rows = _rows(80, 64, 128, "fp32", {2: 8, 6: None}, batches=[1, 8, 32], shape="mamba2-2.7b", groups=1)
    first = _set(rows, triton="3.6.0")
    assert write_table(first, path) == path
    assert read_table(path) == [first]
    doc = json.loads(path.read_text())  # plain JSON, one row per line
    assert doc["format"] == spec_policy.FORMAT and doc["sets"] == [first]
    assert path.read_text().count('{"heads": 80') == 2
    # a second run on another GPU and a new shape: appended, the first set kept
    second = _set(_rows(16, 64, 128, "fp16", {2: 1}), gpu=H200, date="2026-11-24")
    write_table(second, path)
    assert read_table(path) == [first, second]
    # a re-measure of (H100, H80 P64 N128 fp32, T=2) replaces that row only; T=6 stays in the old set
    third = _set(_rows(80, 64, 128, "fp32", {2: 4}), commit="def5678", date="2026-11-25")
    write_table(third, path)
    sets = read_table(path)
    assert [s["commit"] for s in sets] == ["abc1234", "abc1234", "def5678"]
    assert [(r["tokens"], r["crossover_batch"]) for r in sets[0]["rows"]] == [(6, None)]
    # replacing every row of a set drops the set
    write_table(_set(_rows(80, 64, 128, "fp32", {6: 2}), commit="0a0a0a0", date="2026-11-26"), path)
    assert [s["commit"] for s in read_table(path)] == ["abc1234", "def5678", "0a0a0a0"]
    assert not list(tmp_path.glob("sub/*.tmp"))


def test_read_table_is_a_copy(tmp_path):
    path = tmp_path / "t.json"
    write_table(_set(_rows(8, 16, 16, "fp32", {2: 3})), path)
    read_table(path)[0]["rows"][0]["crossover_batch"] = 99
    assert read_table(path)[0]["rows"][0]["crossover_batch"] == 3


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format=2), "format expected 1, got 2"),
    (lambda d: d.update(sets={}), "sets expected a list, got dict"),
    (lambda d: d["sets"][0].pop("commit"), "sets[0]: commit expected a non-empty string, got None"),
    (lambda d: d["sets"][0].update(rows=None), "sets[0]: rows expected a list, got NoneType"),
    (lambda d: d["sets"][0]["rows"][1].update(heads=0), "sets[0].rows[1]: heads expected an int >= 1, got 0"),
    (lambda d: d["sets"][0]["rows"][0].update(tokens=2.0), "sets[0].rows[0]: tokens expected an int >= 1, got 2.0"),
    (lambda d: d["sets"][0]["rows"][0].update(state_dtype="fp8"), "state_dtype expected one of ('fp32', 'fp16', 'bf16')"),
    (lambda d: d["sets"][0]["rows"][0].pop("crossover_batch"), "sets[0].rows[0]: crossover_batch missing"),
    (lambda d: d["sets"][0]["rows"][0].update(crossover_batch=True), "crossover_batch expected an int >= 1, got True"),
], ids=["format", "sets", "commit", "rows", "heads", "tokens", "state", "crossover-missing", "crossover-bool"])
def test_bad_files_name_the_file_and_field(tmp_path, mutate, message):
    path = tmp_path / "t.json"
    write_table(_set(_rows(8, 16, 16, "fp32", {2: 3, 4: None})), path)
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="verify table file") as info:
        read_table(path)
    assert str(path) in str(info.value) and message in str(info.value)
    # a write never replaces a file it cannot read
    before = path.read_text()
    with pytest.raises(ValueError):
        write_table(_set(_rows(8, 16, 16, "fp32", {2: 1})), path)
    assert path.read_text() == before


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.json does not exist"):
        read_table(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        lookup_table(8, 16, 16, path=tmp_path / "bad.json")
    with pytest.raises(ValueError, match="<new set>: sets\\[0\\].rows\\[0\\]: head_dim expected an int >= 1"):
        write_table(_set([dict(heads=8, head_dim=-1, state_size=16, state_dtype="fp32", tokens=2,
                               crossover_batch=1)]), tmp_path / "new.json")
    assert not (tmp_path / "new.json").exists()
    with pytest.raises(ValueError, match="lookup_table: heads expected an int >= 1, got 0"):
        lookup_table(0, 16, 16, path=tmp_path / "bad.json")
    with pytest.raises(ValueError, match="state_dtype expected one of"):
        lookup_table(8, 16, 16, "int8", path=tmp_path / "bad.json")


# --- lookup ---------------------------------------------------------------------------------------
@pytest.fixture
def table_file(tmp_path):
    """Two H100 shapes (H128 and H16, P64 N128) in fp32 and fp16, and one H200 row for H128 fp32."""
    path = tmp_path / "table.json"
    rows = _rows(128, 64, 128, "fp32", {2: 1, 8: 1}) + _rows(128, 64, 128, "fp16", {2: 2, 8: 1})
    rows += _rows(16, 64, 128, "fp32", {2: 8, 8: 4}) + _rows(16, 64, 128, "fp16", {2: 16, 8: None})
    write_table(_set(rows, commit="1111111", date="2026-11-22"), path)
    write_table(_set(_rows(128, 64, 128, "fp32", {2: 32}), gpu=H200, commit="2222222", date="2026-11-24"), path)
    return path


def test_lookup_exact_shape(table_file):
    e = lookup_table(16, 64, 128, "fp32", device_name=H100, path=table_file)
    assert e.table == {2: 8, 8: 4} and e.exact and (e.heads, e.head_dim, e.state_size, e.state_dtype) == (
        16, 64, 128, "fp32")
    assert (e.gpu, e.date, e.commit, e.command) == (H100, "2026-11-22", "1111111", "python -m fastmamba.bench spec x")
    assert "exact shape H16 P64 N128 fp32 state, measured on NVIDIA H100 80GB HBM3 2026-11-22 at 1111111" in e.describe()
    assert lookup_table(16, 64, 128, torch.float16, path=table_file).table == {2: 16, 8: None}
    # this GPU's rows first: on the H200 its own row, on the H100 (or unknown: the newest) the other
    assert lookup_table(128, 64, 128, "fp32", device_name=H200, path=table_file).table == {2: 32}
    assert lookup_table(128, 64, 128, "fp32", device_name=H100, path=table_file).table == {2: 1, 8: 1}
    assert lookup_table(128, 64, 128, "fp32", path=table_file).gpu == H200  # newest
    assert lookup_table(128, 64, 128, "fp32", device_name="NVIDIA A100", path=table_file).gpu == H200


def test_lookup_fallback_for_unseen_shapes(table_file):
    # mamba2-2.7b (H80: 655k state elements per request) is nearer Nemotron-H's 1M than the TP=8 slice's 131k
    e = lookup_table(80, 64, 128, "fp32", device_name=H100, path=table_file)
    assert (e.heads, e.exact, e.table) == (128, False, {2: 1, 8: 1}) and "nearest measured shape" in e.describe()
    # a shape is a whole: H128 P16 N16 has the state size per request of H8 P64 N128, nearest the H16 slice
    assert lookup_table(128, 16, 16, "fp32", device_name=H100, path=table_file).heads == 16
    assert lookup_table(45, 64, 128, "fp32", path=table_file).heads == 16  # 45/16 = 2.81 < 128/45 = 2.84
    assert lookup_table(46, 64, 128, "fp32", path=table_file).heads == 128  # 46/16 = 2.88 > 128/46 = 2.78
    # a tie in the ratio (H8 is 2x from H4 and from H16): the larger shape
    tie = table_file.with_name("tie.json")
    write_table(_set(_rows(4, 64, 128, "fp32", {2: 2}) + _rows(16, 64, 128, "fp32", {2: 8})), tie)
    assert lookup_table(8, 64, 128, "fp32", path=tie).heads == 16
    # a bf16 state: the fp16 entry of the same shape (same bytes), not the fp32 one
    e = lookup_table(16, 64, 128, "bf16", path=table_file)
    assert (e.state_dtype, e.exact, e.table) == ("fp16", False, {2: 16, 8: None})
    # an fp16 state with only fp32 rows measured: the nearest state bytes per request across dtypes
    only32 = table_file.with_name("only32.json")
    write_table(_set(_rows(128, 64, 128, "fp32", {2: 1}) + _rows(16, 64, 128, "fp32", {2: 8})), only32)
    assert lookup_table(32, 64, 128, "fp16", path=only32).heads == 16  # 32 x 2 bytes = 16 x 4 bytes
    assert lookup_table(256, 64, 128, "fp16", path=only32).heads == 128  # 256 x 2 = 128 x 4


def test_lookup_in_an_empty_file_gives_the_placeholder(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({"format": 1, "sets": []}))
    e = lookup_table(8, 16, 16, path=path)
    assert e.table == {} and e.heads is None and "placeholder" in e.describe()
    assert spec_policy.choose_verify_path(1, 4, e.table) == "legacy"
    assert spec_policy.choose_verify_path(8, 4, e.table) == "replay"


def test_newer_set_wins_per_T(tmp_path):
    path = tmp_path / "t.json"
    write_table(_set(_rows(8, 16, 16, "fp32", {2: 4, 4: 2}), commit="old", date="2026-11-01"), path)
    write_table(_set(_rows(8, 16, 16, "fp32", {4: 1, 6: None}), gpu=H200, commit="new", date="2026-11-02"), path)
    e = lookup_table(8, 16, 16, path=path)  # no GPU named: the newest group, the H200's
    assert e.table == {4: 1, 6: None} and e.commit == "new"
    assert lookup_table(8, 16, 16, device_name=H100, path=path).table == {2: 4, 4: 2}


# --- the package's file ---------------------------------------------------------------------------
OLD_MEASURED = {  # spec_policy.MEASURED_TABLES before the file (H100, 2026-11-22, commits 49359f8 / 90652e8)
    (128, "fp32"): {2: 1, 4: 1, 6: 1, 8: 1, 16: 1},
    (128, "fp16"): {2: 1, 4: 1, 6: 1, 8: 1, 16: 1},
    (16, "fp32"): {2: 8, 4: 1, 6: 1, 8: 1, 16: 1},
    (16, "fp16"): {2: 1, 4: 1, 6: 1, 8: 1, 16: 1},
}


def test_package_file():
    path = spec_policy.default_table_path()
    assert path.name == spec_policy.TABLE_FILE and path.parent.name == "generation"
    sets = read_table()
    assert sets and all(s["gpu"] and s["date"] and s["commit"] and s["command"] for s in sets)
    # the measured shapes have their own entries, fp32 and fp16 state, T 2 to 16
    for H in (128, 16):
        for state in ("fp32", "fp16"):
            e = lookup_table(H, 64, 128, state)
            assert e.exact and set(e.table) >= {2, 4, 6, 8, 16}, e.describe()
    # rows still from the old H100 runs keep the old values (their sets are marked "older kernels")
    for s in sets:
        if s["commit"] in ("49359f8", "90652e8"):
            assert s["gpu"] == H100 and "older kernels" in s["note"]
            for r in s["rows"]:
                assert (r["head_dim"], r["state_size"]) == (64, 128)
                assert OLD_MEASURED[(r["heads"], r["state_dtype"])][r["tokens"]] == r["crossover_batch"]


# --- the engine -----------------------------------------------------------------------------------
K = 3  # drafts per step: T = 4


@pytest.fixture(scope="module")
def tiny():
    model = fastmamba.load_model("mamba2-tiny", dtype=torch.float32, device="cpu")
    cfg = model.cfg
    assert (cfg.nheads, cfg.headdim, cfg.d_state) == (8, 16, 16)  # neither Nemotron-H's 128 heads nor the slice's 16
    return model


def test_engine_picks_the_entry_for_its_shape(tiny, tmp_path):
    path = tmp_path / "table.json"
    write_table(_set(_rows(16, 64, 128, "fp32", {K + 1: 1}) + _rows(128, 64, 128, "fp32", {K + 1: 1})), path)
    # not measured: the nearest shape (H16 P64 N128)
    engine = Engine(tiny, max_batch=4, speculate=K, verify_table=path, cuda_graphs=False)
    assert engine.verify_table == {K + 1: 1} and engine.legacy_max_batch == 0
    assert engine.verify_table_entry.heads == 16 and not engine.verify_table_entry.exact
    # its own entry, once present, fp32 and fp16 state
    write_table(_set(_rows(8, 16, 16, "fp32", {K + 1: 3}) + _rows(8, 16, 16, "fp16", {K + 1: None}),
                     commit="7777777", date="2026-11-25"), path)
    engine = Engine(tiny, max_batch=4, speculate=K, verify_table=str(path), cuda_graphs=False)
    entry = engine.verify_table_entry
    assert engine.verify_table == {K + 1: 3} and entry.exact and entry.commit == "7777777"
    assert (entry.heads, entry.head_dim, entry.state_size, entry.state_dtype) == (8, 16, 16, "fp32")
    assert engine.legacy_max_batch == 2  # legacy below the crossover batch 3
    assert [engine.spec.table_path(b) for b in (1, 2, 3, 4)] == ["legacy", "legacy", "replay", "replay"]
    engine = Engine(tiny, max_batch=4, speculate=K, verify_table=path, ssm_dtype=torch.float16, cuda_graphs=False)
    assert engine.verify_table == {K + 1: None} and engine.verify_table_entry.state_dtype == "fp16"
    assert engine.legacy_max_batch == 4  # replay never won


def test_engine_default_and_explicit_tables(tiny):
    engine = Engine(tiny, max_batch=2, speculate=K, cuda_graphs=False)  # the package's file
    entry = engine.verify_table_entry
    assert entry.path == str(spec_policy.default_table_path())
    assert engine.verify_table == lookup_table(8, 16, 16, "fp32").table == entry.table
    engine = Engine(tiny, max_batch=2, speculate=K, verify_table={K + 1: 2}, cuda_graphs=False)
    assert engine.verify_table == {K + 1: 2} and engine.verify_table_entry is None
    assert Engine(tiny, max_batch=2, cuda_graphs=False).verify_table_entry is None  # no speculation: no lookup


def test_engine_missing_table_file(tiny, tmp_path):
    with pytest.raises(FileNotFoundError, match="verify table file .*missing.json does not exist"):
        Engine(tiny, max_batch=2, speculate=K, verify_table=tmp_path / "missing.json", cuda_graphs=False)
