"""The pipeline stage contract (docs/pipeline.md, "The stage contract for a model"), checked
by running it: every stage's module forward on the meta device, in pipeline order, each
stage fed what the one before returned, before any process group.

A model that breaks the contract used to fail on a rank, mid-schedule, with ``TypeError:
'NoneType' object is not callable``. Here the failure becomes one error at the plan's
``pipeline`` line naming the stage, the module whose code failed (and the line of the
user's source), and the rule it breaks. When a stage fails, the whole model runs too: if it
fails unsplit, the fault is not the split's, and the other checks and analyses report it.
"""

from __future__ import annotations

import copy
import os
import sysconfig
import traceback
from typing import Any

import torch
import torch.nn as nn

from ...plan.errors import PlanError
from ...plan.specs import PlanSpec
from ..meta_kernel_cache import MetaCacheMode
from .split import PipelineSplit, Stage, stage_module

__all__ = ["stage_contract"]

RULE_NONE = ("rule 3: a model's forward tolerates the parts a stage does not own, which are "
             "None on that stage")
RULE_INDEX = ("rule 3: the blocks container holds only the stage's blocks: iterate it, never "
              "index it (self.layers[i])")
RULE_INPUT = ("rule 3: a stage other than the first receives the previous stage's output (a "
              "tensor) in place of the model's input")
RULE_OUTPUT = "rule 3: a stage other than the last returns the activations"
RULE_ONE_TENSOR = "rule 4: the activation passed between stages is one tensor"

_DONE: dict[tuple, list[str]] = {}  # the same model and split, checked once a process


def _key(spec: PlanSpec, split: PipelineSplit, seq_len: int) -> tuple:
    m = spec.model
    model = None if m is None else (m.name, m.config, m.factory, repr(sorted(m.kwargs.items())),
                                    m.hf, m.hf_config, repr(sorted(m.hf_kwargs.items())))
    return model, tuple((s.blocks, s.extras) for s in split.stages), seq_len


def _user_frame(e: BaseException) -> str:
    """`` (at file:line)``: the innermost frame outside torch, tpplan and installed packages."""
    skip = (os.path.dirname(os.path.dirname(__file__)), sysconfig.get_paths()["stdlib"], "<")
    installed = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith(skip) and not any(d in f.filename for d in installed)]
    if not frames:
        return ""
    rel = os.path.relpath(frames[-1].filename)
    return f" (at {frames[-1].filename if rel.startswith('..') else rel}:{frames[-1].lineno})"


def _rule(e: BaseException, stage: Stage, last: bool) -> str:
    text = str(e)
    if "'NoneType' object" in text:
        return RULE_NONE
    if isinstance(e, (IndexError, KeyError)) or "not subscriptable" in text:
        return RULE_INDEX
    if stage.index > 0:
        return RULE_INPUT
    return RULE_OUTPUT if not last else RULE_NONE


def _run(module: nn.Module, x: torch.Tensor) -> tuple[Any, BaseException | None, str]:
    """``module(x)`` under no_grad: (output, the exception, the innermost module running when
    it was raised: ``''`` for the root's own forward)."""
    stack: list[str] = []
    handles = []

    def leave(_m, _a, _o) -> None:  # returns None: the module's output stays its own
        stack.pop()

    for path, m in module.named_modules():
        handles.append(m.register_forward_pre_hook(lambda _m, _a, p=path: stack.append(p)))
        handles.append(m.register_forward_hook(leave))
    try:
        with torch.no_grad(), MetaCacheMode():
            return module(x), None, ""
    except Exception as e:  # noqa: BLE001 - the model's own code: reported with its place
        return None, e, stack[-1] if stack else ""
    finally:
        for h in handles:
            h.remove()


def stage_contract(model: nn.Module, split: PipelineSplit, spec: PlanSpec) -> list[PlanError]:
    """Run each stage of ``split`` forward on meta (``model`` is left whole); a stage that
    fails, or passes on something other than one tensor, is an error at the plan's
    ``pipeline`` line naming the stage, the module, and the rule of docs/pipeline.md."""
    if split.errors or not split.stages or spec.pipeline is None:
        return []
    seq = spec.train.seq_len
    key = _key(spec, split, seq)
    if key in _DONE:  # the messages; the place is this plan's
        return [PlanError(m, spec.pipeline.loc) for m in _DONE[key]]
    tokens = torch.zeros(1, seq, dtype=torch.long, device="meta")
    # Each stage runs on its own copy (stage_module's), so a model all on meta is read as it
    # is; a trainer's keeps real buffers, copied to meta first.
    on_meta = all(t.is_meta for t in (*model.parameters(), *model.buffers()))
    whole = model if on_meta else copy.deepcopy(model).to("meta")
    x: Any = tokens
    errors: list[PlanError] = []
    for stage in split.stages:
        last = stage.index == len(split.stages) - 1
        module = stage_module(whole, stage, split)
        blocks = f"{stage.blocks[0]} ... {stage.blocks[-1]}" if len(stage.blocks) > 1 \
            else stage.blocks[0]
        owns = [*stage.extras, blocks] if stage.index == 0 else [blocks, *stage.extras]
        what = f"pipeline stage {stage.index} ({', '.join(owns)})"
        out, e, path = _run(module, x)
        if e is not None:
            where = f"'{path}' ({type(module.get_submodule(path)).__name__})" if path else \
                f"the model's forward ({type(model).__name__}.forward)"
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            errors.append(PlanError(
                f"{what} fails run alone: {reason} in {where}{_user_frame(e)}; the model breaks "
                f"the stage contract, {_rule(e, stage, last)} (docs/pipeline.md)",
                spec.pipeline.loc))
            break
        if not last and not isinstance(out, torch.Tensor):
            errors.append(PlanError(
                f"{what} returns a {type(out).__name__}, not a tensor; the model breaks the "
                f"stage contract, {RULE_ONE_TENSOR} (docs/pipeline.md)", spec.pipeline.loc))
            break
        x = out
    if errors and _run(copy.deepcopy(whole) if on_meta else whole, tokens)[1] is not None:
        errors = []  # unsplit it fails too: not the split's fault, the analyses say what it is
    _DONE[key] = [e.message for e in errors]
    return errors
