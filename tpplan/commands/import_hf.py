"""``tpplan import-hf``: turn the tp_plan transformers ships for an architecture into a plan."""

from __future__ import annotations

import argparse
import os
import sys

from ..plan.writer import relocate, render_plan
from ._common import bad_world_size, emit


def register(sub) -> None:
    p = sub.add_parser("import-hf", help="write a plan from a HuggingFace base_model_tp_plan",
                       description=__doc__)
    p.add_argument("target", metavar="ARCH_OR_CONFIG",
                   help="a transformers class (LlamaForCausalLM), a model type (llama), or a "
                        "config.json (or its folder)")
    p.add_argument("-o", "--output", help="write the plan here (default: print it)")
    p.add_argument("--tp", type=int, default=2, help="tp degree written into the plan's mesh")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="sequence parallelism inside each decoder layer")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: route experts over this many ranks with "
                        "transformers' base_model_ep_plan (docs/moe.md)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..byom.import_hf import import_hf, with_expert_parallel
    from ..models.hf import hf_config_path
    from ..plan.specs import ModelSpec

    if bad_world_size(args.tp, "--tp"):  # the generated plan is dry-run at tp ranks
        return 2
    if bad_world_size(args.ep, "--ep"):
        return 2
    imported = import_hf(args.target, args.sequence_parallel, tp=args.tp)
    if args.ep > 1:
        with_expert_parallel(imported, args.target)
    s = imported.suggestion
    header = [f"Imported from {imported.source}",
              f"by `tpplan import-hf {args.target}"
              f"{' --sequence-parallel' if args.sequence_parallel else ''}"
              f"{f' --ep {args.ep}' if args.ep > 1 else ''}`.",
              "Linear styles are transformers'; embedding, head, parent prepare_input, loss",
              "parallel and FSDP units come from the model's dataflow (as in `tpplan suggest`)."]
    model = relocate(imported.model, os.getcwd(), args.output)
    text = render_plan(header, model, s.rules, tp=args.tp, loss_parallel=s.loss_parallel,
                       divide_by_tp=s.divide_by_tp, units=s.units, notes=s.notes, ep=args.ep)
    inputs = [("the imported config", hf_config_path(ModelSpec(hf_config=args.target)))] \
        if os.path.exists(args.target) else []
    return emit(text, args.output, args.tp * args.ep, notes=s.notes, stream=sys.stderr, inputs=inputs)
