"""``tpplan suggest``: infer a Megatron-style plan from the model itself."""

from __future__ import annotations

import argparse
import os
import sys

from ..plan import ErrorList, read_document
from ..plan.sections import parse_model
from ..plan.writer import relocate, render_plan
from ..plan.yamlio import plain
from ._common import bad_world_size, emit


def register(sub) -> None:
    p = sub.add_parser("suggest", help="infer a plan from a model's dataflow",
                       description=__doc__)
    p.add_argument("model", help="a YAML file with a 'model:' section (any plan works)")
    p.add_argument("-o", "--output", help="write the plan here (default: print it)")
    p.add_argument("--tp", type=int, default=2, help="tp degree written into the plan's mesh")
    p.add_argument("--ep", type=int, default=1,
                   help="expert parallelism: spread the experts modules over this many ranks "
                        "(docs/moe.md)")
    p.add_argument("--sequence-parallel", choices=("auto", "blocks", "off"), default="auto",
                   help="auto: end to end where the model allows it; blocks: inside each block "
                        "only; off: none")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..byom.outputs import model_inputs
    from ..byom.suggest import suggest_plan

    if bad_world_size(args.tp, "--tp") or bad_world_size(args.ep, "--ep"):
        return 2  # the generated plan is dry-run at tp × ep ranks
    doc = read_document(args.model)
    errs = ErrorList()
    spec = parse_model(doc, errs)
    if spec is None:
        errs.add("the file has no 'model:' section to suggest a plan for", doc.loc)
    errs.raise_if_any()
    s = suggest_plan(spec, args.sequence_parallel, tp=args.tp)
    if args.ep > 1:
        from ..byom.ep_rules import with_ep

        with_ep(s, spec)
    header = [f"Suggested by `tpplan suggest {args.model}` from the model's dataflow.",
              "Review it: every rule says why it is there; what was not decided is at the end."]
    model = relocate(plain(doc["model"]), os.path.dirname(os.path.abspath(args.model)),
                     args.output)
    text = render_plan(header, model, s.rules, tp=args.tp,
                       loss_parallel=s.loss_parallel, divide_by_tp=s.divide_by_tp, units=s.units,
                       notes=s.notes, ep=args.ep)
    return emit(text, args.output, args.tp * args.ep, notes=s.notes, stream=sys.stderr,
                inputs=model_inputs(doc, spec))
