"""``tpplan verify``: run a plan for real on N CPU processes and compare with one device.

The plan's model is shrunk to a tiny config of the same architecture (for built-in models;
a factory model is run as its ``model.kwargs`` say, so pass small sizes with ``--set``),
the plan's mesh is solved at N, and logits, loss and every parameter's gradient are
compared with the same model and batch on one device. Exit 1 above ``--tolerance``.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from ..cli import add_plan_args

__all__ = ["register", "shrink_overrides", "group_rows"]


def register(sub) -> None:
    p = sub.add_parser("verify", help="check a plan's numerics on an N-process gloo CPU mesh",
                       description=__doc__)
    add_plan_args(p)
    p.add_argument("--nproc", type=int, required=True, help="number of CPU processes (ranks)")
    p.add_argument("--tolerance", type=float, default=1e-4,
                   help="worst relative error allowed (default 1e-4)")
    p.add_argument("--layers", type=int, default=2, help="blocks of the shrunk model (default 2)")
    p.add_argument("--seq-len", type=int, default=16, help="tokens per sequence (default 16)")
    p.add_argument("--batch-per-rank", type=int, default=2,
                   help="sequences per data-parallel rank (default 2)")
    p.add_argument("--no-shrink", action="store_true",
                   help="run the model at the size the plan names (only for small models)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(run=run)


def shrink_overrides(plan, tp: int, layers: int, seq_len: int) -> list[str]:
    """``--set`` lines that shrink a built-in Llama while keeping every split divisible:
    ``tp`` kv heads, twice as many query heads of width 8, widths in multiples of 32·tp."""
    spec = plan.model
    if spec is not None and (spec.hf or spec.hf_config):
        return _shrink_hf(spec, tp, layers, seq_len)
    if spec is None or spec.factory or spec.name != "llama3":
        return [f"train.seq_len={seq_len}"]
    kv = max(tp, 2)
    heads = 2 * kv
    return [f"model.kwargs.n_layers={layers}", f"model.kwargs.n_heads={heads}",
            f"model.kwargs.n_kv_heads={kv}", f"model.kwargs.dim={heads * 8}",
            f"model.kwargs.multiple_of={32 * tp}", "model.kwargs.ffn_dim_multiplier=null",
            f"model.kwargs.vocab_size={64 * tp}", f"model.kwargs.max_seq_len={seq_len}",
            f"train.seq_len={seq_len}"]


def _shrink_hf(spec, tp: int, layers: int, seq_len: int) -> list[str]:
    """The same for a HuggingFace config: only the fields this architecture has."""
    from ..models.hf import hf_config

    config = hf_config(spec, Path(spec.base_dir) if spec.base_dir else None)
    kv = max(tp, 2)
    heads = 2 * kv
    small = {"num_hidden_layers": layers, "num_attention_heads": heads,
             "num_key_value_heads": kv, "hidden_size": heads * 8, "head_dim": 8,
             "intermediate_size": 64 * tp, "ffn_dim": 64 * tp, "word_embed_proj_dim": heads * 8,
             "vocab_size": 64 * tp}
    out = [f"model.config.{k}={v}" for k, v in small.items() if hasattr(config, k)]
    return out + [f"train.seq_len={seq_len}"]


def group_rows(rows: list[tuple[str, float]]) -> list[tuple[str, int, float]]:
    """Collapse per-layer rows (``layers.3.attention.wq``) into ``layers.*`` with the worst."""
    groups: dict[str, list] = {}
    for what, err in rows:
        key = re.sub(r"\.\d+(?=\.|$)", ".*", what)
        g = groups.setdefault(key, [0, 0.0])
        g[0] += 1
        g[1] = max(g[1], err)
    return [(k, n, e) for k, (n, e) in groups.items()]


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ..models import build_model
    from ..plan import load
    from ..verify import compare, make_batch, parallel_step, reference_step

    if args.nproc < 1:
        print("error: --nproc must be at least 1", file=sys.stderr)
        return 2
    start = time.perf_counter()
    plan = load(args.plan, args.overrides)
    dims = plan.parallel_dims(args.nproc)  # PlanErrors (exit 1) if the mesh does not fit
    shrink = [] if args.no_shrink else shrink_overrides(plan, dims.tp, args.layers, args.seq_len)
    overrides = shrink + list(args.overrides)  # the user's --set wins
    plan = load(args.plan, overrides)
    model = build_model(plan.model, device="meta")
    plan.check(model, args.nproc)
    vocab = next(m.num_embeddings for m in model.modules() if hasattr(m, "num_embeddings"))
    tokens = make_batch(vocab, args.batch_per_rank * dims.dp, args.seq_len, args.seed)
    ref = reference_step(plan, tokens, args.seed)
    par = parallel_step(args.plan, overrides, args.nproc, tokens, args.seed)
    result = compare(ref, par, args.tolerance)

    console = Console()
    if not console.is_terminal:
        console.width = 120
    t = Table(title=f"{args.plan} on {args.nproc} gloo ranks ({dims}) vs one device",
              header_style="bold")
    for col in ("compared", "×", "worst relative error", ""):
        t.add_column(col, justify="right" if col.startswith(("×", "worst")) else "left")
    for what, n, err in group_rows(result.rows):
        ok = err <= args.tolerance
        t.add_row(what, str(n), f"{err:.2e}", "[green]ok[/green]" if ok else "[red]FAIL[/red]")
    console.print(t)
    took = time.perf_counter() - start
    if result.ok:
        console.print(f"[green]numerics match[/green] within {args.tolerance:g} ({took:.1f} s)")
        return 0
    console.print(f"[red]numerics differ[/red]: {len(result.failures)} of {len(result.rows)} "
                  f"above {args.tolerance:g} ({took:.1f} s)")
    return 1
