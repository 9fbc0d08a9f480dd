"""``tpplan export``: a sharded checkpoint as one safetensors file (the default, for small
models), or with ``--format hf`` as a HuggingFace model folder (sharded safetensors, config,
tokenizer) streamed one tensor at a time; a LoRA run's adapters as PEFT's folder
(``--format peft``) or merged into its base (``--merge``); on one CPU process."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("export", help="a DCP checkpoint as model.safetensors, or an HF model folder",
                       description=__doc__)
    p.add_argument("--checkpoint", required=True,
                   help="a step-NNNNNN checkpoint folder, or a run folder (its latest checkpoint)")
    p.add_argument("-o", "--output", required=True, help="folder to write (--format hf: new or "
                   "empty)")
    p.add_argument("--plan", help="the plan the run used (default: the run folder's plan.yaml)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="cast floating-point tensors (default: as trained)")
    p.add_argument("--format", choices=("safetensors", "hf", "peft"), default="safetensors",
                   help="safetensors: one model.safetensors (the whole model in memory); hf: "
                   "a HuggingFace model folder, written tensor by tensor; peft: a LoRA run's "
                   "adapters as PEFT's folder (adapter_config.json, adapter_model.safetensors)")
    p.add_argument("--merge", action="store_true",
                   help="a LoRA run: a whole HuggingFace folder, the adapters merged into the "
                   "base's weights (model.pretrained)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="--format hf: the largest safetensors shard (5GB, 500MB, 2GiB; "
                   "default 5GB)")
    p.add_argument("--tokenizer", help="--format hf: a tokenizer.json or HF folder to copy "
                   "(default: the plan's data.tokenizer, else its model.pretrained folder)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.merge or args.format == "peft":
        return _run_lora(args)
    if args.format == "hf":
        return _run_hf(args)
    from ..byom.export import export_checkpoint
    from ..plan.errors import CommandError

    if args.tokenizer or args.max_shard_size != "5GB":
        raise CommandError("--tokenizer and --max-shard-size go with --format hf")
    summary = export_checkpoint(args.checkpoint, args.output, args.plan, args.dtype)
    print(f"exported {summary['checkpoint']}: {summary['tensors']} tensors, "
          f"{summary['parameters']:,} parameters -> {summary['out']}/model.safetensors")
    return 0


def _run_hf(args: argparse.Namespace) -> int:
    from ..byom.export_hf import export_hf

    s = export_hf(args.checkpoint, args.output, args.plan, args.dtype, args.max_shard_size,
                  args.tokenizer)
    shards = [f for f in s["files"] if f.endswith(".safetensors")]
    print(f"exported {s['checkpoint']}: {s['tensors']} tensors, {s['parameters']:,} parameters "
          f"({s['dtype']}) in {len(shards)} safetensors file(s) -> {s['out']}")
    if s["tokenizer"]:
        print(f"tokenizer from {s['tokenizer']}: {', '.join(s['tokenizer_files'])}")
    else:
        print("no tokenizer written: the plan names none (data.tokenizer or model.pretrained), "
              "so the run trained on bytes; pass --tokenizer to add one")
    return 0


def _run_lora(args: argparse.Namespace) -> int:
    from ..byom.export_peft import export_merged, export_peft
    from ..plan.errors import CommandError

    if args.tokenizer or args.max_shard_size != "5GB":
        raise CommandError("--tokenizer and --max-shard-size go with --format hf; --merge "
                           "copies the base's shards and tokenizer")
    if args.merge:
        if args.format == "peft" or args.dtype:
            raise CommandError("--merge writes a HuggingFace folder in the base's dtype; "
                               "leave out --format peft and --dtype")
        s = export_merged(args.checkpoint, args.output, args.plan)
        print(f"exported {s['checkpoint']}: {s['merged']} LoRA adapters merged into "
              f"{s['base']}" + (f", {s['saved']} trained tensors" if s["saved"] else "")
              + f" -> {s['out']}")
        return 0
    s = export_peft(args.checkpoint, args.output, args.plan, args.dtype)
    print(f"exported {s['checkpoint']}: LoRA adapters of {s['targets']} modules, "
          f"{s['parameters']:,} parameters in {s['tensors']} tensors -> {s['out']} "
          "(adapter_config.json, adapter_model.safetensors)")
    return 0
