"""LoRA adapters (docs/finetune.md): placed by their base layer's tensor-parallel style.

- ``adapters``: the adapter modules, where each goes and how it is sharded, the base frozen.
- ``sizes``: the adapters' shapes from the plan alone (the dry run's figures, with or without
  the adapters in the model yet).
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "adapters": ["LoraA", "LoraB", "apply_lora", "check_lora", "freeze_base"],
    "sizes": ["adapter_shapes", "trained_names"],
})
