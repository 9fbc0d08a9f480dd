"""Building the plan's model: built-in models by name and size, a user's factory function,
or a HuggingFace configuration; on the meta device or for real."""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from ..plan.errors import PlanError, PlanErrors, nearest
from ..plan.specs import ModelSpec
from . import llama

__all__ = ["BUILTIN", "build_model"]

# name -> (builder(config, **kwargs), the named sizes)
BUILTIN: dict[str, tuple[Callable[..., nn.Module], dict[str, Any]]] = {
    "llama3": (llama.build, llama.CONFIGS),
}


def _factory(spec: ModelSpec) -> Callable[..., nn.Module]:
    module_name, _, fn_name = spec.factory.partition(":")
    loc = spec.locs.get("factory", spec.loc)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise PlanErrors([PlanError(f"model.factory: cannot import '{module_name}': {e}", loc)]) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise PlanErrors([PlanError(f"model.factory: '{module_name}' has no function "
                                    f"'{fn_name}'{nearest(fn_name, names)}", loc)])
    return fn


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Every parameter created inside goes to the meta device; buffers stay real."""
    original = nn.Module.register_parameter

    def register(self, name, param):
        original(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"),
                                                  requires_grad=param.requires_grad)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def build_model(spec: ModelSpec | None, device: str | torch.device = "meta", real_buffers: bool = False) -> nn.Module:
    """Construct the plan's model on ``device`` (``meta``: shapes only, no memory).

    ``real_buffers`` (with ``device="meta"``): parameters on meta, buffers computed for
    real on the CPU. Buffers such as rotary tables are small and derived from the config;
    a trainer that materializes the parameters with ``to_empty`` keeps them, and so needs
    no model-specific code to recompute them.

    Mistakes in the ``model`` section raise :class:`PlanErrors` located in the plan.
    """
    if real_buffers and str(device) == "meta":
        with _parameters_on_meta():
            return build_model(spec, "cpu")
    if spec is None:
        raise PlanErrors([PlanError("the plan has no 'model' section", None)])
    if spec.is_hf:
        from .hf import build_hf

        fn, kwargs = build_hf, {"spec": spec}
    elif spec.factory:
        fn, kwargs = _factory(spec), dict(spec.kwargs)
    else:
        if spec.name not in BUILTIN:
            raise PlanErrors([PlanError(f"unknown model '{spec.name}'{nearest(spec.name, BUILTIN)};"
                                        f" built-in models: {', '.join(BUILTIN)}",
                                        spec.locs.get("name", spec.loc))])
        builder, sizes = BUILTIN[spec.name]
        config = spec.config or "debug"
        if config not in sizes:
            raise PlanErrors([PlanError(f"unknown config '{config}' for {spec.name}"
                                        f"{nearest(config, sizes)}; sizes: {', '.join(sizes)}",
                                        spec.locs.get("config", spec.loc))])
        fn, kwargs = builder, {"config": config, **spec.kwargs}
    try:
        with torch.device(device):
            return fn(**kwargs)
    except TypeError as e:
        raise PlanErrors([PlanError(f"model: building the model failed: {e}",
                                    spec.locs.get("kwargs", spec.loc))]) from None
