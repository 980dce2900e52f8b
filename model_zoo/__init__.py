"""Single-device reference models that expose an ordered layer list (single-device: no process groups)."""
from model_zoo.gpt import GPT, PRESETS, GPTConfig, get_config

__all__ = ["GPT", "GPTConfig", "PRESETS", "get_config"]
