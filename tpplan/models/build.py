"""Building the plan's model: built-in models by name and size, a user's factory function,
or a HuggingFace configuration; on the meta device or for real."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import re
import sysconfig
import traceback
from typing import Any, Callable

import torch
import torch.nn as nn

from .._torch.nn import parameters_on_meta
from ..plan.errors import ErrorList, PlanError, PlanErrors, nearest
from ..plan.specs import ModelSpec
from . import llama, moe

__all__ = ["BUILTIN", "build_model"]

# name -> (builder(config, **kwargs), the named sizes)
BUILTIN: dict[str, tuple[Callable[..., nn.Module], dict[str, Any]]] = {
    "llama3": (llama.build, llama.CONFIGS),
    "moe": (moe.build, moe.CONFIGS),  # the Llama with MoE blocks (docs/moe.md)
}


def _factory(spec: ModelSpec) -> Callable[..., nn.Module]:
    module_name, _, fn_name = spec.factory.partition(":")
    loc = spec.locs.get("factory", spec.loc)
    try:
        module = importlib.import_module(module_name)
    except SyntaxError as e:  # the user's source does not parse: say where, as Python would
        where = f"{_short(e.filename)}:{e.lineno}:{e.offset}" if e.filename else "?"
        raise PlanErrors([PlanError(f"model.factory: cannot import '{module_name}': {e.msg} at "
                                    f"{where}", loc)]) from None
    except ImportError as e:
        raise PlanErrors([PlanError(f"model.factory: cannot import '{module_name}': {e}"
                                    f"{_user_frame(e)}", loc)]) from None
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the module's own code failed on import
        raise PlanErrors([PlanError(f"model.factory: importing '{module_name}' "
                                    f"{_raised(e)}{_user_frame(e)}", loc)]) from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        raise PlanErrors([PlanError(f"model.factory: '{module_name}' has no function "
                                    f"'{fn_name}'{nearest(fn_name, names)}", loc)])
    return fn


def _short(path: str) -> str:
    """``path`` relative to the working folder when it is under it."""
    rel = os.path.relpath(path) if os.path.isabs(path) else path
    return path if rel.startswith("..") else rel


def _one_line(e: BaseException) -> str:
    """``ValueError: first line of the message`` (at most 300 characters)."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _raised(e: BaseException) -> str:
    """``raised ValueError: ...``, or ``called sys.exit(3)``: a user's code that exits the
    process is a mistake to report at the plan's line, not a way out of the command."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({'' if e.code is None else repr(e.code)})"
    return f"raised {_one_line(e)}"


def _user_frame(e: BaseException) -> str:
    """`` (at file:line)``: the innermost frame of the traceback in the user's own code, not
    in tpplan, the standard library or an installed package (torch, transformers); empty
    when there is none."""
    skip = (os.path.dirname(os.path.dirname(__file__)), sysconfig.get_paths()["stdlib"], "<")
    installed = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(skip) and not any(d in f.filename for d in installed)]
    return f" (at {_short(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""


def _builtin_kwargs(spec: ModelSpec, name: str, sizes: dict[str, Any]) -> None:
    """Every ``model.kwargs`` key a field of the built-in's configuration, every size valid:
    located errors, before building."""
    base = sizes[spec.config or "debug"]
    fields = [f.name for f in dataclasses.fields(base)]
    errs = ErrorList()
    for key in spec.kwargs:
        if key not in fields:
            errs.add(f"unknown key '{key}' in 'model.kwargs' for {name}{nearest(key, fields)}; "
                     f"its fields: {', '.join(fields)}", spec.locs.get(f"kwargs.{key}", spec.loc))
    errs.raise_if_any()
    for at_fault, reason in dataclasses.replace(base, **spec.kwargs).problems():
        given = [f for f in at_fault if f in spec.kwargs]
        loc = spec.locs.get(f"kwargs.{given[0]}") if given else None
        what = f"'model.kwargs.{at_fault[0]}' " if len(at_fault) == 1 else f"{name}: "
        errs.add(f"{what}{reason}", loc or spec.locs.get("config", spec.loc))
    errs.raise_if_any()


def _build_failed(spec: ModelSpec, e: BaseException) -> PlanError:
    """A builder's exception as an error at the plan line that chose the builder (an
    unexpected keyword argument: at that kwarg)."""
    if spec.factory:
        what, loc = f"model.factory '{spec.factory}'", spec.locs.get("factory")
    elif spec.is_hf:
        what = f"building transformers' {spec.hf or 'model'}"
        loc = spec.locs.get("config") or spec.locs.get("hf") or spec.locs.get("hf_config")
    else:
        what = f"building {spec.name} (config {spec.config or 'debug'})"
        loc = spec.locs.get("kwargs") or spec.locs.get("config") or spec.locs.get("name")
    bad = re.search(r"unexpected keyword argument '(\w+)'", str(e)) if isinstance(e, TypeError) else None
    if bad and f"kwargs.{bad.group(1)}" in spec.locs:
        loc = spec.locs[f"kwargs.{bad.group(1)}"]
    return PlanError(f"{what} {_raised(e)}{_user_frame(e)}", loc or spec.loc)


def _check_built(spec: ModelSpec, model: Any) -> nn.Module:
    what = f"model.factory '{spec.factory}'" if spec.factory else f"the {spec.name} builder"
    loc = spec.locs.get("factory", spec.loc)
    if not isinstance(model, nn.Module):
        kind = type(model).__name__
        got = "None" if model is None else \
            f"{'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind} ({model!r:.60})"
        raise PlanErrors([PlanError(f"{what} returned {got}, not a torch.nn.Module", loc)])
    if type(model).forward is nn.Module.forward:
        raise PlanErrors([PlanError(f"{what} returned a {type(model).__name__}, which has no "
                                    "forward of its own; return the model that runs it", loc)])
    return model


# Tensor methods that only write values into their tensor (initializers and the arithmetic
# they do on it with Python numbers): on a meta tensor there are no values, so they change
# nothing, yet each costs a dispatch. A 405B model calls them thousands of times.
_VALUE_WRITES = frozenset({
    "uniform_", "normal_", "fill_", "zero_", "random_", "exponential_", "bernoulli_",
    "log_normal_", "cauchy_", "geometric_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_",
    "mul_", "add_", "sub_", "div_", "fmod_", "abs_", "neg_", "sqrt_", "exp_", "log_",
})


class _SkipValueWritesOnMeta(torch.overrides.TorchFunctionMode):
    """Construction on meta without the initializers' dispatches: an ``nn.init`` function,
    or a value write whose only tensor is its target, on a meta tensor returns the target, as
    the meta kernels would. (``nn.init``'s functions are caught whole: the writes inside the
    ones that hand themselves to this mode run with the mode off.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # ``nn.init``'s functions hand their tensor over as a keyword (``tensor=``).
        target = args[0] if args else kwargs.get("tensor")
        if isinstance(target, torch.Tensor) and target.is_meta:
            if getattr(func, "__module__", None) == "torch.nn.init" or (
                    args and getattr(func, "__name__", None) in _VALUE_WRITES and
                    not any(isinstance(a, torch.Tensor) for a in (*args[1:], *kwargs.values()))):
                return target
        return func(*args, **kwargs)


def build_model(spec: ModelSpec | None, device: str | torch.device = "meta", real_buffers: bool = False) -> nn.Module:
    """Construct the plan's model on ``device`` (``meta``: shapes only, no memory).

    ``real_buffers`` (with ``device="meta"``): parameters on meta, buffers computed for
    real on the CPU. Buffers such as rotary tables are small and derived from the config;
    a trainer that materializes the parameters with ``to_empty`` keeps them, and so needs
    no model-specific code to recompute them.

    Mistakes in the ``model`` section raise :class:`PlanErrors` located in the plan: so does
    anything a factory or builder raises (at the ``factory`` line, the kwarg it rejects, or
    ``model.config``), and a factory that returns no runnable ``nn.Module``.
    """
    if real_buffers and str(device) == "meta":
        with parameters_on_meta():
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
        _builtin_kwargs(spec, spec.name, sizes)
        fn, kwargs = builder, {"config": config, **spec.kwargs}
        if spec.pretrained and spec.name == "llama3":  # HF Llama weights: the folder's shapes
            from .pretrained import builtin_llama

            fn, kwargs = llama.Transformer, {"cfg": builtin_llama(spec)}
    try:
        skip = _SkipValueWritesOnMeta() if torch.device(device).type == "meta" else \
            contextlib.nullcontext()
        with torch.device(device), skip:
            model = fn(**kwargs)
    except PlanErrors:
        raise
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's code or sizes: located
        raise PlanErrors([_build_failed(spec, e)]) from None
    return _check_built(spec, model)
