"""infercore: composable LLM-inference building blocks.

Layers (imports point left): devices <- ops <- kv, quant <- models <- engine <- cli.
"""

from . import devices, ops
from .engine import ClassificationOutput, Engine, EngineConfig, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["ClassificationOutput", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "devices", "ops",
           "__version__"]
