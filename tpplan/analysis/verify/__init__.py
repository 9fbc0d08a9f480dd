"""``tpplan verify``: a plan's numerics against one device, on a real gloo mesh.

- ``numerics``: the reference step and the parallel step, logits, loss and every gradient.
- ``comparison``: the worst relative error of each, with a floor on the denominator.
"""

from ...exports import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "comparison": ["Comparison", "compare", "rel_err"],
    "numerics": ["verify_step"],
})
