"""``freeze``: which parameters stop training, decided after the whole plan is applied.

After, because PyTorch's ``SequenceParallel`` style sets ``requires_grad`` on the norm
weights it distributes: a freeze applied before TP would be silently undone. FSDP2 creates
its unsharded parameters lazily, at the first all-gather, with the sharded parameter's
``requires_grad``, so freezing the (sharded) parameters here is what the first step sees.
The optimizer, the trainer's gradient clipping and the dry run's gradient and optimizer
memory all follow ``requires_grad``.
"""

from __future__ import annotations

from torch import nn

from ..plan import ErrorList
from ..plan.patterns import compile_pattern, generalize
from ..plan.specs import FreezeRule

__all__ = ["apply_freeze", "check_freeze", "frozen_names"]


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _hits(rule: FreezeRule, name: str) -> bool:
    rx = compile_pattern(rule.pattern)
    return any(rx.fullmatch(p) for p in _prefixes(name))


def frozen_names(rules: list[FreezeRule], names) -> set[str]:
    """The parameter names ``rules`` freeze (the last matching rule decides)."""
    out = set()
    for name in names:
        verdict = False
        for rule in rules:
            if _hits(rule, name):
                verdict = rule.frozen
        if verdict:
            out.add(name)
    return out


def check_freeze(rules: list[FreezeRule], model: nn.Module, errs: ErrorList) -> None:
    """A rule that matches no parameter, and a plan that freezes everything: located errors."""
    names = [n for n, _ in model.named_parameters()]
    for rule in rules:
        if not any(_hits(rule, n) for n in names):
            shown = sorted({generalize(n.rpartition(".")[0]) for n in names} - {""})[:8]
            errs.add(f"freeze pattern '{rule.pattern}' matches no parameter or module of the "
                     f"model (modules such as: {', '.join(shown)})", rule.loc)
    if rules and names and len(frozen_names(rules, names)) == len(names):
        errs.add("'freeze' freezes every parameter: nothing would train; exempt some with "
                 "'!pattern'", rules[0].loc)


def apply_freeze(rules: list[FreezeRule], model: nn.Module) -> int:
    """Set ``requires_grad=False`` on the frozen parameters; returns how many."""
    names = frozen_names(rules, [n for n, _ in model.named_parameters()])
    for name, p in model.named_parameters():
        if name in names:
            p.requires_grad_(False)
    return len(names)
