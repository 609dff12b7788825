from fastmamba.models.lm import HybridLM
from fastmamba.models.loader import load_model, random_init
from fastmamba.models.mamba2 import PRESETS, Mamba2Config
from fastmamba.models.mamba2_lm import Mamba2LM
from fastmamba.models.nemotron_h import PRESETS as NEMOTRON_H_PRESETS, NemotronHConfig, NemotronHLM

__all__ = ["NEMOTRON_H_PRESETS", "PRESETS", "HybridLM", "Mamba2Config", "Mamba2LM", "NemotronHConfig", "NemotronHLM",
           "load_model", "random_init"]
