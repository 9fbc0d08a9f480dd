"""``tpplan generate``: continue a prompt with a trained model, on one CPU process -- greedy,
or top-p sampling with ``--temperature`` -- to see what a run (or an HF export) learned."""

from __future__ import annotations

import argparse
import sys

from ..plan.errors import CommandError


def register(sub) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a run's checkpoint or an HF folder",
                       description=__doc__)
    p.add_argument("--checkpoint", required=True,
                   help="a run folder (its newest complete checkpoint), a step-NNNNNN folder, or "
                   "a HuggingFace model folder")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--max-new-tokens", type=int, default=32, metavar="N",
                   help="tokens to generate at most (default 32; fewer at the end token)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="0: greedy (the default); above 0: sample, logits divided by T "
                   "(1.0 when only --top-p is given)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="sample from the most likely tokens whose probabilities add up to P "
                   "(default 1.0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    p.add_argument("--plan", help="the plan the run used (default: the run folder's plan.yaml)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..byom.generate import load_generator

    temperature = args.temperature if args.temperature is not None else \
        1.0 if args.top_p is not None else 0.0
    top_p = 1.0 if args.top_p is None else args.top_p
    if args.max_new_tokens < 1:
        raise CommandError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if temperature < 0:
        raise CommandError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    if not 0 < top_p <= 1:
        raise CommandError(f"--top-p must be in (0, 1], got {top_p}")
    if not args.prompt:
        raise CommandError("--prompt is empty: give the text to continue")
    gen = load_generator(args.checkpoint, args.plan)
    new = gen.generate(args.prompt, args.max_new_tokens, temperature, top_p, args.seed)
    how = "greedy" if temperature == 0 else f"top-p {top_p}, temperature {temperature}, seed {args.seed}"
    print(f"{gen.source}: {len(new)} tokens, {how}, tokenizer {gen.tokenizer.name}", file=sys.stderr)
    print(gen.tokenizer.decode(new))
    return 0
