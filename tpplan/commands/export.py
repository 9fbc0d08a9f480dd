"""``tpplan export``: a sharded training checkpoint as one safetensors file, on one CPU process."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("export", help="consolidate a DCP checkpoint into model.safetensors",
                       description=__doc__)
    p.add_argument("--checkpoint", required=True,
                   help="a step-NNNNNN checkpoint folder, or a run folder (its latest checkpoint)")
    p.add_argument("-o", "--output", required=True, help="folder to write model.safetensors to")
    p.add_argument("--plan", help="the plan the run used (default: the run folder's plan.yaml)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast floating-point tensors (default: as trained)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..byom.export import export_checkpoint

    summary = export_checkpoint(args.checkpoint, args.output, args.plan, args.dtype)
    print(f"exported {summary['checkpoint']}: {summary['tensors']} tensors, "
          f"{summary['parameters']:,} parameters -> {summary['out']}/model.safetensors")
    return 0
