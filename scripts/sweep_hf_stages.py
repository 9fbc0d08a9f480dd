"""Which HuggingFace causal-LM families run as pipeline stages: each family's tiny
configuration (no download) split into 3 stages by tpplan's own split, the stages run one
after the other in this process, logits and every gradient against the whole model.

One process, no mesh: this checks the stage wrapper's forward (tpplan/models/hf_stages.py)
against the family's own, which is what :data:`~tpplan.models.hf_stages.VERIFIED` lists.
A cell reads ``ok``, ``layout: ...`` (the wrapper cannot hold the model: refused with that
reason), ``WRONG`` (the numbers differ) or ``TRACEBACK``. Sliding windows are made shorter
than the sequence so their masks matter.

    python scripts/sweep_hf_stages.py [--families llama,qwen3] [--stages 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep_hf  # noqa: E402

SEQ = 16
TOLERANCE = 1e-5


def _worst(a, b) -> float:
    from tpplan.analysis.verify.numerics import rel_err

    return rel_err(a, b)


def check(model_type: str, folder: Path, stages: int = 3) -> tuple[str, float | None]:
    """``(status, worst relative error)`` of ``model_type`` split into ``stages`` stages."""
    import torch

    import tpplan
    from tpplan.models import build_model
    from tpplan.models.hf_stages import enable_stages, layout_refusal
    from tpplan.parallel.pipeline.split import split_stages, stage_module

    fields = {"num_hidden_layers": 2 * stages, "tie_word_embeddings": False}
    config = sweep_hf.tiny_config(model_type, **fields)
    if config.get("sliding_window"):
        config["sliding_window"] = SEQ // 4
    for key in ("first_k_dense_replace", "moe_layer_start_index"):
        if key in config:  # dense blocks first, MoE after: both kinds in the split
            config[key] = 1
    path = folder / f"{model_type}.json"
    path.write_text(json.dumps(config, default=str))
    plan_path = folder / f"{model_type}.yaml"
    plan_path.write_text(f"model: {{hf_config: {path.name}}}\nmesh: {{pp: {stages}, tp: 1}}\n"
                         f"pipeline: {{schedule: gpipe, microbatches: {stages}}}\n")
    plan = tpplan.load(str(plan_path))
    with torch.device("meta"):
        size = sum(p.numel() for p in build_model(plan.model, device="meta").parameters())
    if size > sweep_hf.MAX_PARAMS:
        return f"too big: the tiny config has {size:,} parameters", None
    torch.manual_seed(0)
    model = build_model(plan.model, device="cpu").eval()
    why = layout_refusal(model)
    if why:
        return f"layout: {why}", None
    enable_stages(model)  # unverified families too: this is the check
    split = split_stages(model, plan.spec)
    if split.errors:
        return f"split: {split.errors[0].message}", None
    vocab = model.config.vocab_size
    tokens = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(1))
    probe = torch.randn(2, SEQ, vocab, generator=torch.Generator().manual_seed(2))
    whole = model(tokens)
    (whole * probe).sum().backward()
    h = tokens
    parts = [stage_module(model, s, split).eval() for s in split.stages]
    for part in parts:
        for p in part.parameters():
            p.grad = None
        h = part(h)
    (h * probe).sum().backward()
    worst = _worst(h.detach(), whole.detach())
    grads = {n: p.grad for part in parts for n, p in part.named_parameters()}
    for n, p in model.named_parameters():
        if p.grad is None and grads.get(n) is None:
            continue
        if grads.get(n) is None or p.grad is None:
            return f"WRONG: gradient of {n} on one side only", worst
        worst = max(worst, _worst(grads[n], p.grad))
    return ("ok" if worst < TOLERANCE else "WRONG"), worst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", help="comma-separated model types (default: all)")
    p.add_argument("--stages", type=int, default=3)
    args = p.parse_args(argv)
    names = args.families.split(",") if args.families else sweep_hf.families()
    ok = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            try:
                status, worst = check(name, Path(tmp), args.stages)
            except Exception:  # noqa: BLE001 - the sweep is there to find these
                status, worst = "TRACEBACK " + traceback.format_exc().strip().splitlines()[-1], None
            err = "" if worst is None else f"{worst:.1e}"
            print(f"{name:24s} {err:8s} {status[:150]}", flush=True)
            if status == "ok":
                ok.append(name)
    print("\nok:", ", ".join(ok))
    return 0


if __name__ == "__main__":
    sys.exit(main())
