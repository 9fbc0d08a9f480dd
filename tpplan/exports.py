"""Lazy re-exports for a package's ``__init__``: its public names, imported on first use.

A package ``__init__`` that imported its modules eagerly would import all of them whenever
any one is imported, and the axes' modules import each other's layers (``resolve`` reads the
styles, the styles' checks read ``resolve``): an eager re-export would close those loops
into import cycles. ``__getattr__`` (PEP 562) resolves a name only when it is asked for.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any, Callable

__all__ = ["lazy_exports"]


def lazy_exports(package: str, modules: dict[str, list[str]]) -> tuple[list[str], Callable[[str], Any]]:
    """``modules``: module name (relative to ``package``) -> the public names it gives.
    Returns ``__all__`` and a module ``__getattr__`` that imports a name's module on first use.

        __all__, __getattr__ = lazy_exports(__name__, {"styles": ["build_style"]})
    """
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{where[name]}"), name)

    return list(where), __getattr__
