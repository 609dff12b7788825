from fastmamba.models.config import PRESETS, Mamba2Config
from fastmamba.models.loader import load_model, random_init
from fastmamba.models.mamba2_lm import Mamba2LM

__all__ = ["PRESETS", "Mamba2Config", "Mamba2LM", "load_model", "random_init"]
