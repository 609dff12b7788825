"""An FP8 checkpoint with tensor parallelism > 1 is refused from its config.json alone (issue 52):
the FP8 weights and their scales are not sliced, and casting them would be silently wrong."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")


def test_fp8_checkpoint_with_tp2_is_refused_before_any_weight_is_read(tmp_path):
    from fastmamba.distributed.loading import check_tp_source
    from tests.distributed._checkpoints import save_nemotron_h

    root = tmp_path / "fp8"
    save_nemotron_h(root)
    assert check_tp_source(str(root), 2).n_layer == 4  # the 16-bit checkpoint shards
    config = json.loads((root / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
                                     "exclude_modules": ["lm_head"]}
    (root / "config.json").write_text(json.dumps(config))
    (root / "model.safetensors").write_bytes(b"not a safetensors file")  # refused before it is opened
    with pytest.raises(ValueError, match=r"is an FP8 checkpoint .*quantization_config.*tensor parallelism "
                                         r"\(tp=2\) does not shard FP8 weights"):
        check_tp_source(str(root), 2, who="--tensor-parallel-size")
    assert check_tp_source(str(root), 1).n_layer == 4  # one rank: load_model reads it whole
