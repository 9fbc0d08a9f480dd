"""Parameters shared by several modules (tied input and output embeddings), kept shared.

PyTorch's parallel styles and ``to_empty`` replace a module's parameter object by a new
one, module by module: a weight two modules share comes out as two weights (the output
head and the embedding then train separately, silently). tpplan records the sharing before
and restores it after: the first owner's new parameter is given to the others. Sharing a
weight is only possible where every owner shards it the same way (a vocabulary-sharded
embedding, ``rowwise``, and a ``colwise`` head both split dimension 0): :func:`tie_errors`
checks that when the plan is resolved.
"""

from __future__ import annotations

import torch.nn as nn

from ..._torch.modules import own_parameters, set_parameters

__all__ = ["tied_groups", "retie", "check_tied_across_stages"]

Owner = tuple[str, str]  # (module path, parameter attribute)


def tied_groups(model: nn.Module) -> list[list[Owner]]:
    """Every parameter held by more than one module: its owners, in module order."""
    owners: dict[int, list[Owner]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, p in own_parameters(module).items():
            if p is not None and (path, name) not in owners.get(id(p), []):
                owners.setdefault(id(p), []).append((path, name))
    return [group for group in owners.values() if len(group) > 1]


def retie(model: nn.Module, groups: list[list[Owner]]) -> None:
    """Give every owner in each group the first owner's (possibly new) parameter."""
    for (path, name), *others in groups:
        param = own_parameters(model.get_submodule(path))[name]
        for other, attr in others:
            set_parameters(model.get_submodule(other), {attr: param})


def check_tied_across_stages(split, model: nn.Module, loc, errs) -> None:
    """A weight shared by modules on different stages would become two weights, one per
    stage, trained apart: refused (sharing it needs its gradient summed between stages)."""
    if split.errors:
        return
    for group in tied_groups(model):
        stages = {p: split.stage_of(p) for p, _ in group}
        if len({s.index for s in stages.values() if s is not None}) > 1:
            where = ", ".join(f"'{p}' on stage {s.index}" for p, s in stages.items() if s)
            errs.add(f"{' and '.join(repr(p + '.' + a) for p, a in group)} are one tied weight "
                     f"split over pipeline stages ({where}): tied weights across stages are "
                     "not supported; untie them in the model or do not use pipeline stages",
                     loc)
