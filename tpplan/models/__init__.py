"""The models layer: building the plan's model, initializing it, and reading its structure.

``build`` (built-in, factory and HuggingFace models, on meta or for real), ``llama`` (the
reference Llama-3), ``hf`` (transformers causal LMs from a config), ``init`` (allocating
meta parameters and seeded, shard-local initialization), ``introspect`` (repeated blocks,
norms, vocabulary, tiny configs of the same architecture) and ``dataflow`` (which module
hands which tensor to which). Imports only the plan layer.

    >>> from tpplan.models import build_model, materialize, init_weights
"""

from .build import BUILTIN, build_model
from .init import init_weights, materialize, param_seed

__all__ = ["BUILTIN", "build_model", "init_weights", "materialize", "param_seed"]
