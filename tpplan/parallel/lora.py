"""LoRA adapters placed by their base layer's tensor-parallel style (the rule PEFT adopted).

A target ``nn.Linear`` keeps its path and its parameters (checkpoint keys, FSDP units and
plan patterns stay as they are) and gains two children, ``lora_A`` (in -> rank) and
``lora_B`` (rank -> out), and a forward hook that adds ``B(A(dropout(x))) * scaling`` to
its output. The hook runs *inside* the base's style: it sees the input after the style
prepared it and adds to the output before the style lays it out, so the adapter follows
the base's layouts (and its sequence-parallel regions) with no collective of its own:

- colwise base (input replicated, output sharded on features): A replicated, B colwise
  (``Shard(0)`` of B's weight) -- the delta comes out sharded like the base's output;
- rowwise base (input sharded on features, output a partial sum): A rowwise (``Shard(1)``),
  B replicated -- the delta is a partial sum too, reduced by the base's own all-reduce or
  reduce-scatter;
- ``kv_colwise`` base (weight replicated, each rank keeps its heads' columns after the
  projection): A and B replicated; the style slices the sum;
- no rule (or ``replicate``): A and B as the base weight is.

Packed projections, latent attention's ``kv_a_proj`` and MoE experts are refused with the
reason (their weight is not one contiguous ``out × in`` matrix split one way).

Adapters are added after tensor parallelism (a style would distribute their parameters as
its own) and before FSDP2, which then shards them over data parallel like any parameter.
The base is frozen last, as ``freeze`` is: no gradient, no optimizer state.
"""

from __future__ import annotations

import hashlib
import math

import torch
from torch import nn

from ..plan import ErrorList
from ..plan.errors import nearest
from ..plan.patterns import compile_pattern, generalize
from ..plan.specs import LoraSpec, LoraTarget

__all__ = ["LoraA", "LoraB", "FOLLOWED_STYLES", "adapter_params", "adapter_shapes",
           "adapter_tp_dim", "apply_lora", "check_lora", "freeze_base", "lora_targets",
           "checkpointed", "saved_modules", "trained_names", "same_in_every_block"]

# The styles an adapter follows, and how its A and B weights are placed on tp for each.
FOLLOWED_STYLES = {None: (None, None), "colwise": ("replicate", 0),
                   "rowwise": (1, "replicate"), "kv_colwise": ("replicate", "replicate"),
                   "replicate": ("replicate", "replicate")}
REFUSED = {
    "packed_colwise": "its weight packs several projections, each split over tp on its own; "
                      "an adapter's B would have to be packed the same way",
    "experts_colwise_rowwise": "MoE experts are not one nn.Linear",
    "mla_kv_a_proj": "latent attention's kv_a_proj splits its output in two parts",
    "sequence_parallel": "the module is a norm region, not a projection",
}


class LoraA(nn.Linear):
    """The down-projection of an adapter (``in_features -> rank``, no bias); PEFT's
    default init, kaiming-uniform with a=sqrt(5) (nn.Linear's own), or ``gaussian``:
    normal with std 1/rank."""

    is_lora_adapter = True
    init = "kaiming"

    def reset_parameters(self) -> None:
        if self.init == "gaussian":
            nn.init.normal_(self.weight, std=1.0 / self.out_features)
        else:
            nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class LoraB(nn.Linear):
    """The up-projection of an adapter (``rank -> out_features``, no bias), zeros at init:
    an adapter starts as the identity of its base."""

    is_lora_adapter = True

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)


def _last_verdict(rules: list[LoraTarget], path: str) -> bool:
    verdict = False
    for rule in rules:
        if compile_pattern(rule.pattern).fullmatch(path):
            verdict = rule.included
    return verdict


def lora_targets(spec: LoraSpec, paths) -> list[str]:
    """Module paths ``spec.targets`` selects (the last matching entry decides)."""
    return [p for p in paths if p and _last_verdict(spec.targets, p)]


def saved_modules(spec: LoraSpec, paths) -> list[str]:
    """Module paths ``spec.modules_to_save`` selects: they train whole."""
    return [p for p in paths if p and _last_verdict(spec.modules_to_save, p)]


def _style_of(path: str, rule_of: dict) -> tuple[str | None, object]:
    """The style the base at ``path`` is under: its own rule, or a whole-module style above."""
    rule = rule_of.get(path)
    if rule is not None:
        return rule.style.name, rule
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        above = rule_of.get(".".join(parts[:i]))
        if above is not None and above.style.name in ("replicate", "sequence_parallel"):
            return above.style.name, above
    return None, None


def check_lora(spec: LoraSpec | None, modules: dict[str, nn.Module], rule_of: dict,
               stage: bool, errs: ErrorList) -> None:
    """Targets that match nothing or something other than an nn.Linear, a base style the
    adapter cannot follow, a rank larger than a layer: errors located in the plan."""
    if spec is None:
        return
    paths = list(modules)
    linears = sorted({generalize(p) for p, m in modules.items() if p and isinstance(m, nn.Linear)})
    for rule in spec.targets + spec.modules_to_save:
        key = "targets" if rule in spec.targets else "modules_to_save"
        hits = [p for p in paths if p and compile_pattern(rule.pattern).fullmatch(p)]
        if not hits and rule.included and not stage:
            shown = linears if key == "targets" else sorted({generalize(p) for p in paths if p})
            errs.add(f"'lora.{key}' pattern '{rule.pattern}' matches no module of the model"
                     f"{nearest(rule.pattern, shown, 0.5)} ({'linear layers' if key == 'targets' else 'modules'} "
                     f"such as: {', '.join(shown[:8])})", rule.loc)
    seen = set()  # one error per generalized target, not one per block
    for path in lora_targets(spec, paths):
        module, general = modules[path], generalize(path)
        if general in seen:
            continue
        seen.add(general)
        loc = next(r.loc for r in reversed(spec.targets)
                   if compile_pattern(r.pattern).fullmatch(path))
        if not isinstance(module, nn.Linear) or isinstance(module, (LoraA, LoraB)):
            errs.add(f"lora target '{general}' ({type(module).__name__}) is not an nn.Linear: "
                     "LoRA adapts linear layers; name the projections inside it", loc)
            continue
        style, rule = _style_of(path, rule_of)
        if style not in FOLLOWED_STYLES:
            why = REFUSED.get(style, "the adapter follows colwise, rowwise, kv_colwise and "
                                     "replicate bases only")
            where = f" (rule '{rule.pattern}', line {rule.loc.line})" if rule else ""
            errs.add(f"lora target '{general}' is under style '{style}'{where}, which a LoRA "
                     f"adapter cannot follow: {why}; leave it out with '!{general}'", loc)
        limit = min(module.in_features, module.out_features)
        if spec.rank > limit:
            errs.add(f"'lora.rank' {spec.rank} is larger than target '{general}' allows "
                     f"(in {module.in_features}, out {module.out_features}): at most {limit}",
                     spec.locs.get("rank", spec.loc))


def _seed(seed: int, name: str) -> int:
    # The same seed models.init.param_seed gives the module: init_weights redraws the same.
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _placed(layer: nn.Linear, place, tp_mesh, path: str, seed: int) -> None:
    """Draw ``layer``'s weight on CPU (seeded by its path, so every rank draws the same
    numbers and a one-device run too) unless on meta, then keep this rank's part."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    w = layer.weight
    if w.device.type != "meta":
        cpu = type(layer)(layer.in_features, layer.out_features, bias=False)
        cpu.init = getattr(layer, "init", "kaiming")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_seed(seed, path))
            cpu.reset_parameters()
        w = cpu.weight.detach().to(device=w.device, dtype=w.dtype)
    if place is not None and tp_mesh is not None:
        placement = Replicate() if place == "replicate" else Shard(place)
        w = distribute_tensor(w, tp_mesh, [placement], src_data_rank=None)  # local slicing
    layer.weight = nn.Parameter(w)


def _add_delta(module: nn.Module, args: tuple, output):
    x = module.lora_dropout(args[0])
    return output + module.lora_B(module.lora_A(x)) * module.lora_scaling


def apply_lora(spec: LoraSpec, model: nn.Module, tp_mesh, rule_of: dict, seed: int) -> int:
    """Add an adapter to every target (after TP, before FSDP2); returns how many."""
    modules = dict(model.named_modules())
    targets = lora_targets(spec, list(modules))
    for path in targets:
        base = modules[path]
        a_place, b_place = FOLLOWED_STYLES[_style_of(path, rule_of)[0]]
        w = base.weight
        device = "meta" if w.device.type == "meta" else w.device
        dtype = w.dtype
        a = LoraA(base.in_features, spec.rank, bias=False, device=device, dtype=dtype)
        a.init = spec.init
        b = LoraB(spec.rank, base.out_features, bias=False, device=device, dtype=dtype)
        _placed(a, a_place, tp_mesh, f"{path}.lora_A", seed)
        _placed(b, b_place, tp_mesh, f"{path}.lora_B", seed)
        base.lora_A, base.lora_B = a, b
        base.lora_dropout = nn.Dropout(spec.dropout) if spec.dropout else nn.Identity()
        for added in (a, b, base.lora_dropout):  # a model put in eval mode before stays in it
            added.train(base.training)
        base.lora_scaling = spec.scaling
        # First among the forward hooks: before the style's output hook lays the output out.
        base.register_forward_hook(_add_delta, prepend=True)
    return len(targets)


def adapter_params(model: nn.Module) -> list[str]:
    """Names of the adapters' parameters."""
    return [n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n
            or n.startswith(("lora_A.", "lora_B."))]


def freeze_base(spec: LoraSpec, model: nn.Module) -> int:
    """Everything but the adapters and ``modules_to_save`` stops training; returns how
    many parameters train."""
    keep = set(adapter_params(model))
    for path in saved_modules(spec, [p for p, _ in model.named_modules()]):
        keep |= {f"{path}.{n}" for n, _ in model.get_submodule(path).named_parameters()}
    for name, p in model.named_parameters():
        p.requires_grad_(name in keep)
    return len(keep)


def adapter_shapes(spec: LoraSpec, model: nn.Module) -> dict[str, tuple[int, int]]:
    """The global shape of every adapter weight :func:`apply_lora` adds to ``model``, by
    parameter name, read from a model with or without them (the dry run's arithmetic on a
    model not yet parallelized: FSDP unit sizes, checkpoint size)."""
    modules = dict(model.named_modules())
    out = {}
    for path in lora_targets(spec, [p for p in modules if not p.endswith((".lora_A", ".lora_B"))]):
        base = modules[path]
        if not isinstance(base, nn.Linear):  # check_lora's error
            continue
        out[f"{path}.lora_A.weight"] = (spec.rank, base.in_features)
        out[f"{path}.lora_B.weight"] = (base.out_features, spec.rank)
    return out


def adapter_tp_dim(name: str, rule_of: dict) -> int | None:
    """The dimension tp splits adapter weight ``name`` along (its base's style decides:
    :data:`FOLLOWED_STYLES`); None when replicated, or when ``name`` is no adapter's."""
    for part, which in ((".lora_A.", 0), (".lora_B.", 1)):
        base, found, _ = name.partition(part)
        if found:
            style = _style_of(base, rule_of)[0]
            place = FOLLOWED_STYLES.get(style, (None, None))[which]
            return place if isinstance(place, int) else None
    return None


def trained_names(spec: LoraSpec, model: nn.Module) -> set[str]:
    """The parameters that train under ``spec`` (the adapters' and ``modules_to_save``'s),
    with or without the adapters in ``model`` yet, as :func:`freeze_base` leaves them."""
    out = set(adapter_shapes(spec, model))
    for path in saved_modules(spec, [p for p, _ in model.named_modules()]):
        out |= {f"{path}.{n}" for n, _ in model.get_submodule(path).named_parameters()}
    return out


def same_in_every_block(plan, model: nn.Module) -> bool:
    """Whether ``plan``'s ``lora`` and ``freeze`` choose alike in every repeated block (a
    block's parameter is chosen iff its kin in every other block is), as the dry run's
    shallow traces assume when they extrapolate from a model's first blocks."""
    from .freeze import frozen_names

    if plan.lora is None and not plan.freeze:
        return True
    names = [n for n, _ in model.named_parameters()]
    paths = [p for p, _ in model.named_modules()]
    universe = set(names) | set(paths)
    chosen = []
    if plan.lora is not None:  # the targets (modules) and what trains whole (parameters)
        chosen.append(set(lora_targets(plan.lora, paths)) |
                      (trained_names(plan.lora, model) & set(names)))
    if plan.freeze:
        chosen.append(frozen_names(plan.freeze, names))
    for picked in chosen:
        general = {generalize(n) for n in picked}
        if picked != {n for n in universe if generalize(n) in general}:
            return False
    return True


def checkpointed(spec: LoraSpec | None, model: nn.Module) -> list[tuple[int, int]] | None:
    """(elements, bytes per element) of each parameter a LoRA run's checkpoint holds (what
    trains: the adapters, ``modules_to_save``), from a model with or without its adapters;
    None without ``lora`` (a checkpoint holds every parameter)."""
    if spec is None:
        return None
    params = dict(model.named_parameters())
    shapes = adapter_shapes(spec, model)
    out = []
    for name in sorted(trained_names(spec, model)):
        if name in params:
            out.append((params[name].numel(), params[name].element_size()))
        else:  # an adapter not added yet: its base's dtype
            base = params[name.rsplit(".lora_", 1)[0] + ".weight"]
            out.append((math.prod(shapes[name]), base.element_size()))
    return out
