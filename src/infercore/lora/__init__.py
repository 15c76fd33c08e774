"""Multi-LoRA serving: PEFT adapters loaded into slots beside the base weights, one adapter per request."""

from .adapter import TARGETS, LoRAAdapter, adapter_from_state_dict, load_lora_adapter
from .layers import LoRALinear, LoRAManager, enable_lora_

__all__ = ["TARGETS", "LoRAAdapter", "LoRALinear", "LoRAManager", "adapter_from_state_dict", "enable_lora_",
           "load_lora_adapter"]
