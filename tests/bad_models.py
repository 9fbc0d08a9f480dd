"""Factories with the mistakes users make: each must become one located error."""

from __future__ import annotations

import torch.nn as nn


def raises(width: int = 8) -> nn.Module:
    raise ValueError(f"width {width} must be even")


def returns_none() -> None:
    return None


def returns_dict() -> dict:
    return {"model": nn.Linear(4, 4)}


def returns_container() -> nn.ModuleList:
    return nn.ModuleList([nn.Linear(4, 4)])


def negative_width(width: int = -1) -> nn.Module:
    return nn.Linear(4, width)


def exits(code: int = 3) -> nn.Module:
    import sys

    sys.exit(code)
