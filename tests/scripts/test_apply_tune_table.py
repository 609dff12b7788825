"""scripts/apply_tune_table.py (the GPU call's ``apply-moe`` / ``apply-gemv`` / ``apply-fp8`` steps):
the paste-ready TABLE that ``tune`` prints, written into a configs module in place of its TABLE, so
that the same call's later steps run it. Checked on a configs module of the test's own (the
repository's modules are never written): an empty table, then a table of several lines replaced,
the module's other lines kept, and the written entries read back through ``pick_config``."""
from __future__ import annotations

import importlib
import os
import sys

import torch

from fastmamba.bench import tune
from fastmamba.ops.moe import configs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import apply_tune_table  # noqa: E402  (scripts/ is no package)

KEY = ("h100", "bfloat16", 2688, 1856, 128, 6, 2, 1)  # Nano's decode call at batch 1 (S=2 shared slices)
DOT = dict(path="gemv", block_m=16, block_n_up=32, block_k_up=128, block_n_down=32, block_k_down=128, group_m=1,
           num_warps=4, num_stages=4, gemv_dot=True)
FMA = dict(DOT, block_n_up=16, block_k_up=256, block_n_down=16, block_k_down=256, num_stages=2, gemv_dot=False)


def _entries(table: dict) -> dict:
    """TABLE with every entry a MoeConfig (tune prints dicts while the real TABLE is empty, MoeConfigs after)."""
    return {k: v if isinstance(v, configs.MoeConfig) else configs.MoeConfig(**v) for k, v in table.items()}


def _tune_output(module: str, rows: list[tuple[object, list[tuple[float, dict]]]]) -> str:
    """What ``tune`` prints: a sweep's lines, then its paste-ready block (the real printer's)."""
    sweep = tune.Sweep("moe", configs=configs)
    results = [tune.CaseResult(f"fused_moe case{i} bf16 b=1", 50.0, res, key=key) for i, (key, res) in enumerate(rows)]
    block = tune.paste_ready_table(sweep, results, "tune --ops moe")
    block[0] = block[0].replace("fastmamba.ops.moe.configs", module)
    return "\n".join(["fused_moe case0 bf16 b=1 default 50.0 µs", *block, "", "done"]) + "\n"


def test_apply_writes_the_table_and_pick_config_reads_it(tmp_path, monkeypatch):
    module = tmp_path / "fake_moe_configs.py"
    module.write_text("from fastmamba.ops.moe.configs import MoeConfig\n\n"
                      "TABLE: dict[tuple[str, str, int, int, int, int, int, int], MoeConfig | dict] = {}\n\n"
                      "AFTER = 'kept'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "fake_moe_configs", raising=False)
    out = tmp_path / "tune-moe.txt"
    out.write_text(_tune_output("fake_moe_configs", [(KEY, [(40.0, FMA), (30.0, DOT)])]))
    assert apply_tune_table.main(["apply_tune_table.py", str(out)]) == 0
    fake = importlib.import_module("fake_moe_configs")
    assert _entries(fake.TABLE) == {KEY: configs.MoeConfig(**DOT)} and fake.AFTER == "kept"
    assert "TABLE: dict[tuple[str, str, int, int, int, int, int, int], MoeConfig | dict] = {" in module.read_text()
    # the written entry is what pick_config returns for that call (a dict entry becomes a MoeConfig)
    monkeypatch.setattr(configs, "TABLE", fake.TABLE)
    monkeypatch.setattr(configs, "gpu_family", lambda device: "h100")
    got = configs.pick_config(torch.device("cpu"), torch.bfloat16, 1, 2688, 1856, 128, 6, shared=2)
    assert got == configs.MoeConfig(**DOT) and got.gemv_dot
    # a second sweep's table replaces the first one (now several lines), nothing else
    other = KEY[:-1] + (2,)
    out.write_text(_tune_output("fake_moe_configs", [(KEY, [(20.0, FMA), (30.0, DOT)]), (other, [(9.0, DOT)])]))
    assert apply_tune_table.main(["apply_tune_table.py", str(out)]) == 0
    fake = importlib.reload(fake)
    assert _entries(fake.TABLE) == {KEY: configs.MoeConfig(**FMA), other: configs.MoeConfig(**DOT)}
    assert fake.AFTER == "kept"


def test_no_block_and_no_file(tmp_path, capsys):
    out = tmp_path / "tune-moe.txt"
    out.write_text("fused_moe ... Traceback: the sweep failed\n")
    assert apply_tune_table.main(["apply_tune_table.py", str(out)]) == 1
    assert "no paste-ready TABLE" in capsys.readouterr().err
    assert apply_tune_table.main(["apply_tune_table.py", str(tmp_path / "missing.txt")]) == 1
    assert "cannot read" in capsys.readouterr().err
    assert apply_tune_table.main(["apply_tune_table.py"]) == 2
