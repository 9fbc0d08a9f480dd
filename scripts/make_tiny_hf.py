"""Make a small HuggingFace model folder locally, with no download.

    python scripts/make_tiny_hf.py --family llama --out tiny-llama
    python scripts/make_tiny_hf.py --family qwen2 --out tiny-qwen2
    python scripts/make_tiny_hf.py --family qwen3_moe --out tiny-qwen3-moe
    python scripts/make_tiny_hf.py --family llama --size 1b --dtype bfloat16 --no-data --out llama-1b

writes what ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``
load: ``config.json``, the weights (random init, seeded) as several ``*.safetensors`` shards
with ``model.safetensors.index.json``, and a byte-level BPE tokenizer trained with
``tokenizers`` on the Python standard library's sources, with a ChatML chat template whose
assistant turns are marked for masking (``{% generation %}``). Unless ``--no-data``, also a
small chat dataset next to them: ``chat.jsonl`` (and ``chat-eval.jsonl``), one conversation per
line -- a question about a standard-library module and, as the answer, the first paragraph of
that module's own docstring -- so chat fine-tuning has real text to learn.

Sizes: ``tiny`` (width 64, 2 layers, 8 query heads, 4 KV heads: tp up to 4, vocabulary 512; a few hundred
KB) or ``1b`` (the Llama 3.2 1B shape of tpplan's built-in ``llama3`` ``1b`` config, random
weights; for load benchmarks). ``--family qwen3_moe`` / ``mixtral``: tiny, 8 experts, top-2,
the experts saved one tensor per expert as ``save_pretrained`` writes them (``MOE`` below).
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML, as Qwen2 uses it; {% generation %} marks the tokens the loss is taken on.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SIZES = {
    # vocab_size is the tokenizer's for tiny (rounded up so every tp up to 8 divides it)
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=128, vocab_size=512,
                 max_position_embeddings=512, rope_theta=10000.0),
    # tpplan's llama3 "1b": dim 2048, 16 layers, 32/8 heads, SwiGLU hidden 8192
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
               max_position_embeddings=8192, rope_theta=500000.0),
}

# Mixtures of experts (tiny only): 8 experts, top-2. ``save_pretrained`` writes their experts
# one tensor per expert (``experts.N.gate_proj.weight``; Mixtral's ``experts.N.w1.weight``),
# as the Hub's MoE checkpoints hold them, not transformers' fused [experts, ...] parameters.
MOE = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
}
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3_moe": "Qwen3MoeConfig",
           "mixtral": "MixtralConfig"}

SKIP = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"}


def stdlib_sources(limit_bytes: int = 8 << 20) -> list[Path]:
    """The standard library's modules (packages' too, tests left out), up to ``limit_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if SKIP & set(path.relative_to(root).parts):
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return files


def train_tokenizer(vocab_size: int, files: list[Path]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train([str(f) for f in files], trainer)
    return tok


def hf_tokenizer(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        bos_token=None, model_max_length=model_max_length, chat_template=CHAT_TEMPLATE)


def conversations(files: list[Path], seed: int) -> list[dict]:
    """One chat per standard-library module with a docstring: its first paragraph is the
    answer to a question about the module."""
    rng = random.Random(seed)
    questions = ["What is the Python module `{}` for?", "Explain what `{}` does.",
                 "In one paragraph: the standard library module `{}`?"]
    chats = []
    for path in files:
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if not doc:
            continue
        answer = " ".join(doc.strip().split("\n\n")[0].split())[:400]
        if len(answer) < 20:
            continue
        name = path.parent.name if path.stem == "__init__" else path.stem
        messages = [{"role": "user", "content": rng.choice(questions).format(name)},
                    {"role": "assistant", "content": answer}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "You answer questions about Python."})
        chats.append({"messages": messages})
    return chats


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=list(CONFIGS), default="llama")
    ap.add_argument("--size", choices=sorted(SIZES), default="tiny")
    ap.add_argument("--out", required=True, help="folder to write (created)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument("--max-shard-size", default=None,
                    help="largest safetensors shard, e.g. 100KB or 1GB (default: 100KB for "
                         "tiny, so even it has several shards; 1GB for 1b)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tie-word-embeddings", action="store_true")
    ap.add_argument("--no-data", action="store_true", help="skip chat.jsonl")
    args = ap.parse_args(argv)

    import torch
    import transformers

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = dict(SIZES[args.size])
    if args.family in MOE:
        if args.size != "tiny":
            ap.error(f"--family {args.family} comes in --size tiny only")
        sizes.update(MOE[args.family])
    files = stdlib_sources()
    tok = train_tokenizer(sizes["vocab_size"] if args.size == "tiny" else 4096, files)
    config_cls = getattr(transformers, CONFIGS[args.family])
    config = config_cls(**sizes, rms_norm_eps=1e-5, tie_word_embeddings=args.tie_word_embeddings,
                        eos_token_id=tok.token_to_id("<|im_end|>"),
                        pad_token_id=tok.token_to_id("<|endoftext|>"),
                        bos_token_id=None)
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(getattr(torch, args.dtype))
    shard = args.max_shard_size or ("100KB" if args.size == "tiny" else "1GB")
    model.save_pretrained(out, max_shard_size=shard)
    hf_tokenizer(tok, sizes["max_position_embeddings"]).save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    print(f"{out}: {args.family} {args.size}, {n_params / 1e6:.2f}M parameters ({args.dtype}) "
          f"in {len(shards)} safetensors file(s); tokenizer vocabulary {tok.get_vocab_size()}")
    if not args.no_data:
        chats = conversations(files, args.seed)
        n_eval = max(1, len(chats) // 10)
        write_jsonl(out / "chat.jsonl", chats[n_eval:])
        write_jsonl(out / "chat-eval.jsonl", chats[:n_eval])
        print(f"{out / 'chat.jsonl'}: {len(chats) - n_eval} conversations; "
              f"{out / 'chat-eval.jsonl'}: {n_eval}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
