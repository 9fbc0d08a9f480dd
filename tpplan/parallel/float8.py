"""torchao's float8 training on the linears the plan's ``float8`` section names (CUDA only).

The linears become torchao ``Float8Linear`` s before any other step of apply (torchtitan's
order: convert, then parallelize). ``tensorwise`` scaling turns on FSDP2's float8 all-gather
(the weights travel and are gathered in float8: half of bf16's bytes); ``rowwise`` gathers
in the parameter dtype. Refused, each at the section's line, before any process group starts
(:func:`float8_problems`): on a CPU, on a GPU below compute capability 8.9 (no float8 tensor
cores: Ada and Hopper have them), and without torchao (``pip install 'tpplan[gpu]'``).

Under tensor parallelism (torchtitan's composition) a ``colwise`` or ``rowwise`` rule on a
converted linear becomes torchao's ``Float8ColwiseParallel`` / ``Float8RowwiseParallel`` with
the rule's layouts where the scaling is ``tensorwise`` (:func:`float8_style`): the linear's
input is cast to float8 before its tp redistribution, so that redistribution moves float8, and
its output gradient is cast to float8 in backward. ``rowwise`` scaling keeps PyTorch's styles
(torchao's float8 TP styles scale per tensor only); the ``Float8Linear`` casts its DTensor
input itself. ``prepare_input`` rules stay PyTorch's: the block's input is gathered in the
parameter dtype, then each float8 linear casts it.
"""

from __future__ import annotations

import importlib.util

import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..plan.errors import ErrorList
from ..plan.patterns import matches

__all__ = ["apply_float8", "cuda_capability", "float8_problems", "float8_style", "gathers_float8"]


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
    return errs


def gathers_float8(spec, dims) -> bool:
    """Whether FSDP2 all-gathers the float8 linears' weights in float8 (half of bf16's bytes):
    tensorwise scaling, and FSDP2 sharding over more than one rank (``dp_shard`` × ``cp``);
    on one rank there is nothing to gather, and the cast would only change the numerics.
    Under tp > 1 each tp shard of a weight then has its own scale (torchao reduces the amax
    over the FSDP ranks only)."""
    f8 = spec.float8
    return (f8 is not None and f8.scaling == "tensorwise" and spec.fsdp is not None
            and dims.dp_shard * dims.cp > 1)


def apply_float8(model: nn.Module, spec, fsdp: bool, emulate: bool = False) -> int:
    """The plan's ``float8`` linears converted in place (``fsdp``: FSDP2 gathers their weights
    in float8, :func:`gathers_float8`); how many. ``emulate``: torchao's emulated float8 matmul (the
    same casts and scales, the product in the parameter dtype), which runs on a CPU: the tests'
    way to check the float8 plan on a gloo mesh; the trainer never sets it."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    f8 = spec.float8
    if f8.scaling == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp, emulate=emulate)
    else:
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(f8.scaling), emulate=emulate)
    chosen = [path for path, m in model.named_modules() if isinstance(m, nn.Linear)
              and any(matches(p, path) for p in f8.linears)]
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn in chosen)
    return len(chosen)


def _tensorwise_float8(module: nn.Module) -> bool:
    if type(module).__name__ != "Float8Linear":  # torchao is imported only where it converted
        return False
    from torchao.float8.config import ScalingGranularity

    c = module.config
    return all(cc.scaling_granularity is ScalingGranularity.TENSORWISE
               for cc in (c.cast_config_input, c.cast_config_weight, c.cast_config_grad_output))


def float8_style(style: ParallelStyle, module: nn.Module) -> ParallelStyle:
    """``style`` for ``module``: torchao's float8 counterpart, with the same layouts, where
    ``style`` is exactly PyTorch's ``ColwiseParallel`` or ``RowwiseParallel`` and ``module`` a
    ``Float8Linear`` with tensorwise scaling; else ``style`` itself."""
    if type(style) not in (ColwiseParallel, RowwiseParallel) or not _tensorwise_float8(module):
        return style
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    cls = Float8ColwiseParallel if type(style) is ColwiseParallel else Float8RowwiseParallel
    out = cls(input_layouts=style.input_layouts[0], output_layouts=style.output_layouts[0],
              use_local_output=style.use_local_output)
    out.src_data_rank = style.src_data_rank
    return out
