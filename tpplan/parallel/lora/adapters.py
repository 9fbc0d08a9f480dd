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

from ...plan import ErrorList
from ...plan.errors import nearest
from ...plan.patterns import generalize
from ...plan.specs import LoraSpec, LoraTarget

__all__ = ["LoraA", "LoraB", "FOLLOWED_STYLES", "adapter_params", "apply_lora", "check_lora",
           "freeze_base", "lora_targets", "saved_modules"]

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
    "sequence_local": "the block runs on each rank's sequence shard, its weights replicated "
                      "with gradients summed over tp, which adapters added after it would miss",
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
        if rule.matches(path):
            verdict = rule.included
    return verdict


def lora_targets(spec: LoraSpec, paths) -> list[str]:
    """Module paths ``spec.targets`` selects (the last matching entry decides)."""
    return [p for p in paths if p and _last_verdict(spec.targets, p)]


def saved_modules(spec: LoraSpec, paths) -> list[str]:
    """Module paths ``spec.modules_to_save`` selects: they train whole."""
    return [p for p in paths if p and _last_verdict(spec.modules_to_save, p)]


def style_of(path: str, rule_of: dict) -> tuple[str | None, object]:
    """The style the base at ``path`` is under: its own rule, or a whole-module style above."""
    rule = rule_of.get(path)
    if rule is not None:
        return rule.style.name, rule
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        above = rule_of.get(".".join(parts[:i]))
        if above is not None and above.style.name in ("replicate", "sequence_parallel",
                                                       "sequence_local"):
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
        hits = [p for p in paths if p and rule.matches(p)]
        if not hits and rule.included and not stage:
            shown = linears if key == "targets" else sorted({generalize(p) for p in paths if p})
            if "." not in rule.pattern:  # a bare name (PEFT's spelling): the names to compare
                shown = sorted({p.rsplit(".", 1)[-1] for p in shown})
            errs.add(f"'lora.{key}' pattern '{rule.pattern}' matches no module of the model"
                     f"{nearest(rule.pattern, shown, 0.5)} ({'linear layers' if key == 'targets' else 'modules'} "
                     f"such as: {', '.join(shown[:8])})", rule.loc)
    seen = set()  # one error per generalized target, not one per block
    for path in lora_targets(spec, paths):
        module, general = modules[path], generalize(path)
        if general in seen:
            continue
        seen.add(general)
        loc = next(r.loc for r in reversed(spec.targets) if r.matches(path))
        if not isinstance(module, nn.Linear) or isinstance(module, (LoraA, LoraB)):
            errs.add(f"lora target '{general}' ({type(module).__name__}) is not an nn.Linear: "
                     "LoRA adapts linear layers; name the projections inside it", loc)
            continue
        style, rule = style_of(path, rule_of)
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
        a_place, b_place = FOLLOWED_STYLES[style_of(path, rule_of)[0]]
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

