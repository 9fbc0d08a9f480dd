"""``tpplan generate``: a few tokens from a trained model, on one CPU process.

The model comes from a run (its ``plan.yaml`` and newest complete checkpoint, or a named
``step-NNNNNN`` folder, checked against its manifest first) or from a HuggingFace model
folder such as ``tpplan export --format hf`` writes. The tokenizer is the one the model was
trained with: the plan's ``data.tokenizer`` or ``model.pretrained`` folder, an HF folder's
own files, else bytes (vocabulary 256: UTF-8 bytes in, bytes out, decoded with
``errors="replace"``). Decoding is greedy unless a temperature is given; then top-p
(nucleus) sampling from a seeded generator, so a command repeats its output.

No KV cache: each new token reruns the model over the sequence (the last ``max positions``
tokens of it), which is plenty for "did the fine-tune do something".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from ..api import load
from ..checkpoint import find_checkpoint
from ..models import build_model
from ..models.introspect import vocab_size
from ..plan.errors import CommandError
from .export import checked_checkpoint, find_plan, read_weights
from .tokenizer_files import has_tokenizer, plan_tokenizer

__all__ = ["Generator", "Tokenizer", "byte_tokenizer", "load_generator", "next_token",
           "sample"]


@dataclass
class Tokenizer:
    """Text <-> token ids, as generation needs them."""

    name: str
    vocab_size: int
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    eos_id: int | None = None


def byte_tokenizer() -> Tokenizer:
    """tpplan's default: one token per UTF-8 byte."""
    return Tokenizer("bytes (vocabulary 256)", 256, lambda text: list(text.encode("utf-8")),
                     lambda ids: bytes(ids).decode("utf-8", errors="replace"))


def _hf_tokenizer(source: Path) -> Tokenizer:
    """A tokenizer.json file (the ``tokenizers`` library) or an HF folder (AutoTokenizer)."""
    if source.is_file():
        from tokenizers import Tokenizer as Raw

        raw = Raw.from_file(str(source))
        return Tokenizer(str(source), raw.get_vocab_size(), lambda t: raw.encode(t).ids,
                         lambda ids: raw.decode(ids, skip_special_tokens=True))
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(source))
    return Tokenizer(str(source), len(tok), lambda t: list(tok.encode(t)),
                     lambda ids: tok.decode(ids, skip_special_tokens=True), tok.eos_token_id)


@dataclass
class Generator:
    """A model ready to continue text: its weights, tokenizer, and where they came from."""

    model: nn.Module
    tokenizer: Tokenizer
    source: str
    vocab_size: int  # the model's
    max_positions: int | None = None

    def logits(self, ids: list[int]) -> torch.Tensor:
        """The next-token logits after ``ids`` (the last ``max_positions`` of them)."""
        window = ids[-self.max_positions:] if self.max_positions else ids
        with torch.no_grad():
            out = self.model(torch.tensor([window]))
        return getattr(out, "logits", out)[0, -1].float()

    def encode(self, prompt: str) -> list[int]:
        """The prompt's token ids; an empty prompt or an id the model has no row for is a
        :class:`CommandError`."""
        if not prompt:
            raise CommandError("--prompt is empty: give the text to continue")
        ids = self.tokenizer.encode(prompt)
        if not ids:
            raise CommandError(f"--prompt {prompt!r} encodes to no tokens with {self.tokenizer.name}")
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise CommandError(f"the prompt's token id {bad[0]} is beyond the model's vocabulary "
                               f"({self.vocab_size} tokens): the tokenizer {self.tokenizer.name} "
                               "does not fit this model")
        return ids

    def generate(self, prompt: str, max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> list[int]:
        """The new token ids after ``prompt`` (stopping early at the tokenizer's end token)."""
        ids = self.encode(prompt)
        rng = torch.Generator().manual_seed(seed)
        allowed = min(self.vocab_size, self.tokenizer.vocab_size)  # ids the tokenizer can decode
        new: list[int] = []
        for _ in range(max_new_tokens):
            token = next_token(self.logits(ids + new)[:allowed], temperature, top_p, rng)
            if token == self.tokenizer.eos_id:
                break
            new.append(token)
        return new


def next_token(logits: torch.Tensor, temperature: float = 0.0, top_p: float = 1.0,
               rng: torch.Generator | None = None) -> int:
    """Greedy (``temperature`` 0), else a sample from the smallest set of most likely tokens
    whose probabilities add up to ``top_p``."""
    if temperature <= 0:
        return int(logits.argmax())
    return sample(torch.softmax(logits / temperature, dim=-1), top_p, rng)


def sample(probs: torch.Tensor, top_p: float, rng: torch.Generator | None = None) -> int:
    ordered, order = probs.sort(descending=True)
    keep = ordered.cumsum(0) - ordered < top_p  # the most likely one always stays
    ordered = ordered * keep
    choice = torch.multinomial(ordered / ordered.sum(), 1, generator=rng)
    return int(order[choice])


def _embedding_rows(model: nn.Module) -> int:
    rows = vocab_size(model)
    if rows is not None:
        return rows
    raise CommandError(f"the model ({type(model).__name__}) has no token embedding to generate with")


def _from_hf_folder(folder: Path) -> Generator:
    try:
        import transformers
    except ImportError:
        raise CommandError(f"'{folder}' is a HuggingFace model folder; reading it needs "
                           "transformers: pip install 'tpplan[hf]'") from None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise CommandError(f"'{folder}' does not load as a HuggingFace model: "
                           f"{str(e).strip().splitlines()[0]}") from None
    tok = _hf_tokenizer(folder) if has_tokenizer(folder) else byte_tokenizer()
    return Generator(model.eval(), tok, str(folder), _embedding_rows(model),
                     getattr(model.config, "max_position_embeddings", None))


def _from_run(checkpoint: Path, plan_path: Path | None) -> Generator:
    checkpoint = checked_checkpoint(checkpoint)
    plan_file = Path(plan_path or find_plan(checkpoint))
    plan = load(plan_file)
    if plan.lora is not None:  # the checkpoint holds the adapters: the base as the run had it
        from .lora_model import lora_model

        model = lora_model(plan, read_weights(checkpoint), checkpoint)
    else:
        model = build_model(plan.require_model(), "meta", real_buffers=True)
    try:
        if plan.lora is None:
            model.load_state_dict(read_weights(checkpoint), strict=False, assign=True)
    except RuntimeError as e:  # a shape that does not fit
        raise CommandError(f"checkpoint {checkpoint} does not fit the plan's model: "
                           f"{str(e).strip().splitlines()[-1].strip()}") from None
    if hasattr(model, "tie_weights"):  # an HF model whose head shares the embedding
        model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise CommandError(f"checkpoint {checkpoint} does not fit the plan's model: it lacks "
                           f"{len(left)} of its tensors ({', '.join(left[:3])})")
    source = plan_tokenizer(plan, plan_file)
    tok = _hf_tokenizer(source) if source is not None else byte_tokenizer()
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "max_seq_len", None) or getattr(cfg, "max_position_embeddings", None)
    return Generator(model.eval(), tok, str(checkpoint), _embedding_rows(model), window)


def load_generator(path: str | Path, plan_path: str | Path | None = None) -> Generator:
    """The model at ``path``: a run folder (its newest complete checkpoint), a step folder,
    or a HuggingFace model folder; with its tokenizer."""
    path = Path(path)
    if find_checkpoint(path) is not None:
        return _from_run(path, Path(plan_path) if plan_path else None)
    if (path / "config.json").is_file():
        return _from_hf_folder(path)
    raise CommandError(f"no checkpoint at '{path}': name a run folder, a step-NNNNNN checkpoint "
                       "folder, or a HuggingFace model folder (config.json and *.safetensors)")
