"""A real tokenizer for ``data.tokenizer``: moved to :mod:`tpplan.data.tokenizer` (``tpplan
data prepare`` tokenizes with it too); kept here under its old name."""

from ..data.tokenizer import EOS_NAMES, TextTokenizer

__all__ = ["EOS_NAMES", "TextTokenizer"]
