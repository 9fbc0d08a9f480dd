"""torchao's float8 training on the linears the plan's ``float8`` section names (CUDA only).

The linears become torchao ``Float8Linear`` s before any other step of apply (torchtitan's
order: convert, then parallelize). ``tensorwise`` scaling turns on FSDP2's float8 all-gather
(the weights travel and are gathered in float8: half of bf16's bytes); ``rowwise`` gathers
in the parameter dtype. Refused, each at the section's line, before any process group starts
(:func:`float8_problems`): on a CPU, on a GPU below compute capability 8.9 (no float8 tensor
cores: Ada and Hopper have them), without torchao (``pip install 'tpplan[gpu]'``), and with
tensor parallelism (torchao's float8 TP styles are not wired to the plan's yet).
"""

from __future__ import annotations

import importlib.util

import torch.nn as nn

from ..plan.errors import ErrorList
from ..plan.patterns import matches

__all__ = ["apply_float8", "cuda_capability", "float8_problems"]


def cuda_capability(device_type: str) -> tuple[tuple[int, int] | None, str]:
    """(compute capability, name) of this process's GPU where ``device_type`` is cuda."""
    if device_type != "cuda":
        return None, ""
    import torch

    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()


def float8_problems(spec, device_type: str, capability: tuple[int, int] | None = None,
                    name: str = "") -> ErrorList:
    """What stops the plan's ``float8`` on ``device_type`` (a GPU of ``capability``, named
    ``name``): one located error, or none (also where the plan has no ``float8``)."""
    errs = ErrorList()
    f8 = spec.float8
    if f8 is None:
        return errs
    if device_type != "cuda":
        errs.add(f"'float8' trains the named linears in float8, which needs a CUDA GPU of compute "
                 f"capability 8.9 or more (Ada, Hopper); this run is on {device_type}: remove the "
                 "'float8' section to train in the plan's dtype here", f8.loc)
    elif capability is not None and tuple(capability) < (8, 9):
        errs.add(f"'float8' needs compute capability 8.9 or more (Ada, Hopper: float8 tensor "
                 f"cores); {name or 'this GPU'} has {capability[0]}.{capability[1]}", f8.loc)
    elif importlib.util.find_spec("torchao") is None:
        errs.add("'float8' runs torchao's float8 training, and torchao is not installed: "
                 "pip install 'tpplan[gpu]'", f8.loc)
    elif spec.mesh.tp > 1:
        errs.add(f"'float8' with tensor parallelism (tp {spec.mesh.tp}) is not built yet: torchao's "
                 "float8 TP styles are not wired to the plan's; use tp 1 (FSDP2 composes)", f8.loc)
    return errs


def apply_float8(model: nn.Module, spec, fsdp: bool) -> int:
    """The plan's ``float8`` linears converted in place (``fsdp``: FSDP2 follows, so tensorwise
    scaling gathers in float8); how many."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    f8 = spec.float8
    if f8.scaling == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp)
    else:
        config = Float8LinearConfig.from_recipe_name(f8.scaling)
    chosen = [path for path, m in model.named_modules() if isinstance(m, nn.Linear)
              and any(matches(p, path) for p in f8.linears)]
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    return len(chosen)
