"""tpplan: tensor-parallel PyTorch training from a YAML parallel plan.

    >>> import tpplan
    >>> plan = tpplan.load("plans/llama.yaml")
    >>> mesh = plan.build_mesh()
    >>> model = plan.apply(model, mesh)
"""

from .api import Plan, load
from .plan.errors import Loc, PlanError, PlanErrors

__all__ = ["Loc", "Plan", "PlanError", "PlanErrors", "load", "__version__"]
__version__ = "0.1.0"
