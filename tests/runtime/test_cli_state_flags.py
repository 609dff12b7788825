"""``fastmamba generate --ssm-dtype ... --stochastic-rounding`` reaches the engine."""
from __future__ import annotations

import torch

from fastmamba.cli import main
from fastmamba.generation import engine as engine_mod


def test_generate_passes_the_state_flags_to_the_engine(monkeypatch, capsys):
    seen = []
    original = engine_mod.Engine.__init__

    def recording(self, model, **kw):
        seen.append(kw)
        original(self, model, **kw)

    monkeypatch.setattr(engine_mod.Engine, "__init__", recording)
    assert main(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2", "--max-new-tokens", "1",
                 "--device", "cpu", "--ssm-dtype", "bf16", "--stochastic-rounding"]) == 0
    assert seen[-1]["ssm_dtype"] == torch.bfloat16 and seen[-1]["stochastic_rounding"] is True
    capsys.readouterr()
    assert main(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2", "--device", "cpu", "--ssm-dtype", "fp32",
                 "--stochastic-rounding"]) == 2  # fp32 state: nothing to round
    assert "--stochastic-rounding rounds 16-bit states" in capsys.readouterr().err
    assert len(seen) == 1
    # --ssm-dtype auto (the default): the checkpoint's dtype, fp32 here, is known once the model is read
    assert main(["generate", "--model", "mamba2-tiny", "--prompt-ids", "1,2", "--device", "cpu",
                 "--stochastic-rounding"]) == 2
    assert "stochastic_rounding=True rounds 16-bit SSM states" in capsys.readouterr().err
    assert seen[-1]["ssm_dtype"] is None
