"""A real tokenizer for ``data.tokenizer``: a ``tokenizer.json`` file, or a local HF model or
tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``, a chat template).

Plain text goes through the ``tokenizers`` library (fast, no transformers import); chats go
through transformers' ``apply_chat_template`` (:mod:`.chat`), which needs the folder. The
tokenizer's identity, for the token cache, is the SHA-256 of its files, not its path: the
same files anywhere give the same tokens, and an edited ``tokenizer.json`` remakes them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..models.hf import TOKENIZER_FILES  # the files that decide its tokens: hashed
from .files import file_digest
from .errors import DataError

__all__ = ["TextTokenizer", "EOS_NAMES"]

# End-of-text tokens looked for when neither data.separator nor the folder names one.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class TextTokenizer:
    """One tokenizer, loaded lazily: what the cache check needs (identity, vocabulary size)
    costs a hash and a JSON read, not a transformers import."""

    def __init__(self, path: Path):
        self.path = path
        self.folder = path if path.is_dir() else None
        if self.folder is not None:
            self.files = [path / n for n in TOKENIZER_FILES if (path / n).is_file()]
            if not self.files:
                raise DataError(f"{path} is a folder without a tokenizer (no tokenizer.json, "
                                f"tokenizer_config.json or tokenizer.model)")
        else:
            self.files = [path]
        self._fast: Any = None
        self._hf: Any = None

    def identity(self) -> str:
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0" + bytes.fromhex(file_digest(f)))
        return h.hexdigest()

    @property
    def fast(self):
        """The ``tokenizers.Tokenizer`` of ``tokenizer.json``, or None (a folder without one)."""
        file = self.folder / "tokenizer.json" if self.folder else self.path
        if self._fast is None and file.is_file():
            from tokenizers import Tokenizer

            try:
                self._fast = Tokenizer.from_file(str(file))
            except Exception as e:  # the library raises plain Exception for a bad file
                raise DataError(f"{file} is not a tokenizer.json: {str(e).splitlines()[0]}") \
                    from None
        return self._fast

    @property
    def hf(self):
        """transformers' tokenizer of the folder (chat templates, sentencepiece models)."""
        if self._hf is None:
            if self.folder is None:
                raise DataError(f"{self.path} is a tokenizer.json alone; chat data needs the "
                                f"model or tokenizer folder, with its chat template")
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise DataError("reading this tokenizer needs transformers: "
                                "pip install 'tpplan[hf]'") from None
            try:
                self._hf = AutoTokenizer.from_pretrained(str(self.folder))
            except (OSError, ValueError) as e:
                raise DataError(f"{self.folder}: transformers cannot load its tokenizer: "
                                f"{str(e).splitlines()[0]}") from None
        return self._hf

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        if self.fast is not None:
            return self.fast.get_vocab_size(with_added_tokens=True)
        return len(self.hf)

    def token_id(self, token: str) -> int | None:
        if self.fast is not None:
            return self.fast.token_to_id(token)
        tid = self.hf.convert_tokens_to_ids(token)
        return None if tid is None or tid == self.hf.unk_token_id else tid

    def separator(self, name: str | None) -> tuple[str, int]:
        """(token, id) put between packed documents: ``name`` (data.separator), else the
        folder's ``eos_token``, else the first of :data:`EOS_NAMES` the vocabulary has."""
        if name is not None:
            tid = self.token_id(name)
            if tid is None:
                raise DataError(f"data.separator '{name}' is not a token of {self.path}")
            return name, tid
        names = list(EOS_NAMES)
        config = self.folder / "tokenizer_config.json" if self.folder else None
        if config is not None and config.is_file():
            try:
                eos = json.loads(config.read_text()).get("eos_token")
            except ValueError:
                eos = None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                names.insert(0, eos)
        for n in names:
            tid = self.token_id(n)
            if tid is not None:
                return n, tid
        raise DataError(f"{self.path} has no end-of-text token ({', '.join(EOS_NAMES)}) to put "
                        f"between documents; name one with data.separator")

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (packing adds the separator)."""
        if self.fast is not None:
            return [e.ids for e in self.fast.encode_batch(texts, add_special_tokens=False)]
        return [self.hf.encode(t, add_special_tokens=False) for t in texts]
