"""The auxiliary loss a mixture of experts' own forward computes, kept for the trainer.

transformers' MoE causal LMs (Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE, gpt-oss, ...) whose config
sets ``output_router_logits`` return ``aux_loss`` -- Switch Transformer's load-balancing loss
over the batch the forward saw -- and their own ``loss`` adds ``router_aux_loss_coef ×
aux_loss`` to the cross-entropy. tpplan's models return logits only (``models/hf.py``'s hook),
so the hook keeps that term for the model and :func:`aux_loss` hands it to whoever computes
the loss (the trainer's step, verify's both sides): the model's own loss, with the term its
config asks for. It is per forward, i.e. per micro-batch: see docs/moe.md ("Auxiliary loss").
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["aux_loss", "keep_aux_loss", "keep_aux_term", "micro_batch_aux", "with_aux_loss",
           "aux_over_shards", "gather_router_logits"]

# By model: its last forward's term (taken by aux_loss), and the tp mesh whose sequence shards
# its routers see (handed over by gather_router_logits). Weak: they go with the model.
_KEPT: weakref.WeakKeyDictionary[nn.Module, torch.Tensor | None] = weakref.WeakKeyDictionary()
_ROUTER_SHARDS: weakref.WeakKeyDictionary[nn.Module, Any] = weakref.WeakKeyDictionary()


def gather_router_logits(model: nn.Module, router_shards: Any) -> None:
    """From now on, take ``model``'s load-balancing loss over the whole micro-batch from its
    routers' logits gathered over ``router_shards`` (:func:`aux_over_shards`), or not (None).

    Whoever applies a plan hands this on: the apply step knows (``ApplyReport.router_shards``,
    the tp mesh when ``sequence_local`` blocks run the routers on sequence shards) and the
    parallel layer does not import the models'. ``tpplan.Plan.apply`` does it."""
    if router_shards is None:
        _ROUTER_SHARDS.pop(model, None)
    else:
        _ROUTER_SHARDS[model] = router_shards


def aux_over_shards(model: nn.Module, router_logits, tp_mesh) -> torch.Tensor:
    """The model's own load-balancing loss (its module's ``load_balancing_loss_func``, as its
    forward calls it) over the whole micro-batch, from each layer's router logits of this
    rank's shard gathered over tp. The term is not additive over shards (``f_e · P_e``), so
    every tp rank computes the whole one; the gather is a DTensor redistribute
    (``Shard(0)`` to ``Replicate``), whose backward hands each rank its own rows' gradient,
    so the replicated term's gradient is not counted tp times. The token order of the
    gathered logits differs from the sequence's; the term does not depend on it."""
    import sys

    from torch.distributed.tensor import DTensor, Replicate, Shard

    # the model's own class (FSDP2 wraps it in a class of its own module)
    fn = next((f for c in type(model).__mro__ if (f := getattr(
        sys.modules.get(c.__module__), "load_balancing_loss_func", None)) is not None), None)
    if fn is None or not router_logits:
        raise ValueError(f"{type(model).__name__}: its routers saw sequence shards, but its "
                         "module has no load_balancing_loss_func or its output no router_logits "
                         "to take the load-balancing loss over the whole micro-batch")
    whole = tuple(DTensor.from_local(x, tp_mesh, [Shard(0)], run_check=False)
                  .redistribute(placements=[Replicate()]).to_local() for x in router_logits)
    return fn(whole, model.num_experts, model.num_experts_per_tok, None)


def keep_aux_loss(module: nn.Module, output: Any) -> None:
    """Keep ``router_aux_loss_coef × output.aux_loss`` of this forward on ``module`` (or
    nothing: no aux loss asked for, or a coefficient of 0); over the whole micro-batch when
    the routers saw sequence shards (``sequence_local`` blocks: :func:`aux_over_shards`)."""
    aux = getattr(output, "aux_loss", None)
    mesh = _ROUTER_SHARDS.get(module)
    if mesh is not None and isinstance(aux, torch.Tensor) and getattr(
            module, "router_aux_loss_coef", None):
        aux = aux_over_shards(module, getattr(output, "router_logits", None), mesh)
    keep_aux_term(module, aux)


def keep_aux_term(module: nn.Module, aux: torch.Tensor | None) -> None:
    """Keep ``router_aux_loss_coef × aux`` on ``module`` (the built-in MoE's own term, or
    an HF output's ``aux_loss``); nothing when there is none or the coefficient is 0."""
    coef = getattr(module, "router_aux_loss_coef", None)
    _KEPT[module] = coef * aux if isinstance(aux, torch.Tensor) and coef else None


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The auxiliary loss term of ``model``'s last forward (taken: a second call gives None)."""
    return _KEPT.pop(model, None)


def micro_batch_aux(model: nn.Module, forward: Callable, tokens: torch.Tensor,
                    positions: torch.Tensor | None, micro: int | None) -> torch.Tensor | None:
    """The aux term of a one-device reference that has just run ``model`` on the whole
    batch, as data-parallel ranks compute it: the mean over ``forward(model, tokens,
    positions)`` of every ``micro`` sequences (the batch's own when ``micro`` is None or all)."""
    whole = aux_loss(model)
    if whole is None or not micro or micro >= len(tokens):
        return whole
    chunks = tokens.split(micro)
    where = positions.split(micro) if positions is not None else [None] * len(chunks)
    terms = []
    for t, p in zip(chunks, where):
        forward(model, t, p)
        terms.append(aux_loss(model))
    return sum(terms) / len(terms)


def with_aux_loss(loss: torch.Tensor, aux: torch.Tensor | None, scale: float = 1.0):
    """``loss + scale × aux``; under loss parallelism (a replicated DTensor loss) the aux
    term, the same on every tp rank (the routers saw the same tokens, or their shards'
    logits were gathered), joins it replicated."""
    if aux is None:
        return loss
    from torch.distributed.tensor import DTensor

    aux = aux * scale
    if isinstance(loss, DTensor) and not isinstance(aux, DTensor):
        aux = DTensor.from_local(aux.to(loss.dtype), loss.device_mesh, loss.placements)
    return loss + aux
