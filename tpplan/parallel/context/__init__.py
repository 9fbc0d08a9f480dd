"""Context parallelism (docs/long-context.md): each ``cp`` rank holds part of every sequence.

- ``sequence``: the sequence layout (load-balanced chunks), :func:`shard_batch`, the attention
  seams of a model wrapped, and the checks a plan's ``context_parallel`` section gets.
- ``attention``: ring (K/V all-gathered) and Ulysses (heads all-to-all) attention over
  differentiable collectives, with document and causal masks.
- ``local``: sliding windows and chunks over global indices (the keys ring can skip).
- ``hf``: a transformers model's attention routed through cp (its own kernel, our mask).
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "attention": ["ring_attention", "ulysses_attention"],
    "sequence": ["ContextParallel", "apply_context_parallel", "check_context_parallel", "shard_batch"],
})
