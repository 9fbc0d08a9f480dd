"""Every HuggingFace causal-LM family with a ``base_model_tp_plan``, end to end, one table.

For each family a tiny configuration of the architecture (no download) is written as a
``config.json``; then, as a user would:

- ``import``: ``tpplan import-hf CONFIG`` -> ``validate`` at world size 4 -> ``verify``;
- ``import+sp``: the same with ``--sequence-parallel``;
- ``suggest``: ``tpplan suggest`` with ``--sequence-parallel off`` -> validate -> verify;
- ``suggest+sp``: ``--sequence-parallel blocks``.

``--modes import+cp,import+cp-ulysses`` runs import-hf's plan at tp 2 × cp 2 with ring or
Ulysses (docs/long-context.md).

For mixtures of experts (docs/moe.md), ``--modes import+ep,import+ep+sp,import+ep4+sp,suggest+ep``
runs ``import-hf --tp 1 --ep 4``, ``import-hf --sequence-parallel --ep 2`` (and ``--ep 4``:
tp 2 × dp_shard 2 with ep 4 borrowing tp's ranks, where the MoE blocks run on the sequence
shard) and ``suggest --ep 2``; ``--families moe`` names the MoE families with their tiny
variants (``TYPE:NAME``).

verify runs every plan on 4 gloo processes (tp 2 × dp 2) against the same model on one
device: logits, loss and every gradient. All plans' parallel steps share one spawn of 4
processes, so start-up is paid once. A cell reads ``ok`` (verify within the tolerance), a
located refusal (``refused: ...``, one line, exit 1), ``WRONG`` (numbers differ) or
``TRACEBACK`` (an exception escaped a command: a bug).

    python scripts/sweep_hf.py [--families llama,qwen3] [--modes import,suggest] [--out DIR]
    python scripts/sweep_hf.py --families moe --modes import+ep,import+ep+sp,import+ep4+sp,suggest+ep
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

MODES = ("import", "import+sp", "suggest", "suggest+sp")
# Expert parallelism (docs/moe.md), for the MoE families: transformers' ep plan through
# ``import-hf --ep``: ep 4 with no tp, and ep 2 and 4 with tp 2 and sequence parallelism (the
# MoE blocks on the sequence shard where every one of them is under SP: ep borrows tp's
# ranks; else ep beside tp, and ep 4 is refused at 4 ranks); and ``suggest --ep 2`` (tp 2,
# sequence parallelism in the blocks).
EP_MODES = ("import+ep", "import+ep+sp", "import+ep4+sp", "suggest+ep")
EP_ARGS = {"import+ep": ["--tp", "1", "--ep", "4"],
           "import+ep+sp": ["--sequence-parallel", "--ep", "2"],
           "import+ep4+sp": ["--sequence-parallel", "--ep", "4"],
           "suggest+ep": ["--ep", "2", "--sequence-parallel", "blocks"]}
# Context parallelism (docs/long-context.md): import-hf's plan at tp 2 × cp 2, ring or Ulysses
# (Ulysses needs KV heads that tp and cp divide: refused, located, for the 2-KV-head configs)
CP_MODES = ("import+cp", "import+cp-ulysses")
CP_SETS = {"import+cp": ["mesh.cp=2", "context_parallel=ring"],
           "import+cp-ulysses": ["mesh.cp=2", "context_parallel=ulysses"]}
TOLERANCE = 1e-4


@dataclass
class Cell:
    family: str
    mode: str
    status: str = "ok"  # ok | refused | WRONG | TRACEBACK
    detail: str = ""
    worst: float | None = None
    plan: Path | None = None
    job: int | None = None
    comm: bool | None = None  # validate reported communication
    notes: list[str] = field(default_factory=list)


def families() -> list[str]:
    """Model types whose causal LM has a ``base_model_tp_plan`` in the installed transformers."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config_class = CONFIG_MAPPING[model_type]
        except KeyError:
            continue
        if getattr(config_class, "base_model_tp_plan", None):
            out.append(model_type)
    return out


# What a released checkpoint's config.json sets and the config class's defaults leave out
# (those defaults do not build a model): MoE sizes of dots.llm1, LFM2-MoE's layer pattern,
# Cohere Compass's rotary parameters per layer type.
FIXUPS = {
    "dots1": {"n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
              "first_k_dense_replace": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "cohere_compass_text": {"rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0}
        for t in ("full_attention", "sliding_attention")}},
}


# More than one tiny config per MoE family (``--families deepseek_v3:dense1``): layer mixes,
# head and expert counts, top-k. Fields on top of the shrunk defaults; verify then runs the
# config as written (its own shrinking would reset the expert counts).
VARIANTS = {
    "mixtral:e8k3": {"num_local_experts": 8, "num_experts_per_tok": 3,
                     "num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64},
    "qwen3_moe:e8k1": {"num_experts": 8, "num_experts_per_tok": 1, "mlp_only_layers": [0]},
    "qwen3_moe:step2": {"decoder_sparse_step": 2, "num_experts_per_tok": 4,
                        "norm_topk_prob": True},
    "olmoe:e8k3": {"num_experts": 8, "num_experts_per_tok": 3, "num_attention_heads": 4,
                   "num_key_value_heads": 4, "hidden_size": 32},
    "deepseek_v3:dense1": {"first_k_dense_replace": 1},
    "deepseek_v3:groups": {"first_k_dense_replace": 0, "n_routed_experts": 8, "n_group": 2,
                           "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 2},
    "deepseek_v3:kv2": {"first_k_dense_replace": 1, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "hidden_size": 32},
    "llama4_text:step2": {"interleave_moe_layer_step": 2, "num_local_experts": 8,
                          "num_experts_per_tok": 1},
    "gpt_oss:e8k4": {"num_local_experts": 8, "num_experts_per_tok": 4,
                     "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64},
    "qwen3_next:full2": {"full_attention_interval": 2, "num_experts": 8,
                         "num_experts_per_tok": 2, "mlp_only_layers": [0]},
    "qwen3_next:heads8": {"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 64,
                          "full_attention_interval": 2, "linear_num_value_heads": 8,
                          "linear_num_key_heads": 4},
    "qwen3_next:fullfirst": {"layer_types": ["full_attention", "linear_attention"]},
    "qwen3_next:dense2": {"mlp_only_layers": [1]},
    "qwen3_next:step2": {"decoder_sparse_step": 2, "full_attention_interval": 1},
    "minicpm3:kv1": {"num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 32},
}
# The MoE families of issue 23 with their variants: what ``--families moe`` runs.
MOE = ["mixtral", "mixtral:e8k3", "qwen3_moe", "qwen3_moe:e8k1", "qwen3_moe:step2", "olmoe",
       "olmoe:e8k3", "deepseek_v3:dense1", "deepseek_v3:groups", "deepseek_v3:kv2",
       "llama4_text", "llama4_text:step2", "gpt_oss", "gpt_oss:e8k4", "qwen3_next",
       "qwen3_next:full2"]


def tiny_config(model_type: str, tp: int = 2, **fields) -> dict:
    """A tiny configuration of ``model_type`` (tpplan's verify shrinking), as a dict."""
    from transformers import AutoConfig

    from tpplan.models.introspect import small_hf_fields

    model_type, _, variant = model_type.partition(":")
    if variant:
        fields = {**VARIANTS[f"{model_type}:{variant}"], **fields}
    config = AutoConfig.for_model(model_type)
    small = {**small_hf_fields(config, tp), **FIXUPS.get(model_type, {}), **fields}
    if "layer_types" not in {**FIXUPS.get(model_type, {}), **fields}:
        small.pop("layer_types", None)  # derived from the layer count by the config itself
    data = type(config)(**small).to_dict()
    data["model_type"] = model_type
    return data


def _cli(*args: str) -> tuple[int, str]:
    """``tpplan ARGS`` in this process: exit code and stderr; an escaping exception is a
    TRACEBACK (what a user would see)."""
    from tpplan.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = main(list(args))
        except SystemExit as e:
            rc = int(e.code or 0)
        except Exception:  # noqa: BLE001 - the point of the sweep is to find these
            return -1, traceback.format_exc()
    return rc, err.getvalue()


def _first_error(text: str) -> str:
    lines = [x for x in text.splitlines() if "error" in x]
    return (lines[0] if lines else text.strip().splitlines()[-1] if text.strip() else "").strip()


def make_plan(cell: Cell, config: Path, folder: Path) -> None:
    plan = folder / f"{cell.mode.replace('+', '-')}.yaml"
    if cell.mode.startswith("import"):
        args = ["import-hf", str(config), "-o", str(plan)]
        if cell.mode in EP_ARGS:
            args += EP_ARGS[cell.mode]
        elif cell.mode.endswith("+sp"):
            args.append("--sequence-parallel")
    else:
        model = folder / "model.yaml"
        model.write_text(f"model: {{hf_config: {config.name}}}\n")
        args = ["suggest", str(model), "-o", str(plan), *EP_ARGS.get(cell.mode, [
            "--sequence-parallel", "blocks" if cell.mode.endswith("+sp") else "off"])]
    rc, err = _cli(*args)
    if rc == -1:
        cell.status, cell.detail = "TRACEBACK", err.strip().splitlines()[-1]
    elif rc != 0:
        cell.status, cell.detail = "refused", _first_error(err)
    else:
        cell.plan = plan


def validate(cell: Cell, world: int) -> None:
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    try:
        result = dry_run(str(cell.plan), world, CP_SETS.get(cell.mode, []), ANALYSES)
    except Exception:  # noqa: BLE001
        cell.status, cell.detail = "TRACEBACK", traceback.format_exc().strip().splitlines()[-1]
        return
    if result.errors:
        cell.status, cell.detail = "refused", f"validate: {result.errors[0].message}"
        return
    cell.comm = "comm_per_step" in result.extra and "error" not in result.extra["comm_per_step"]
    for e in result.analysis_errors:
        cell.notes.append(f"validate: {e.analysis} failed: {e.message}")


def run(names: list[str], modes: list[str], out: Path, world: int = 4, log=print,
        chunk: int = 8) -> list[Cell]:
    """Every (family, mode) cell through plan, validate and verify, ``chunk`` families per
    spawn (memory stays bounded: the references of one chunk at a time)."""
    cells: list[Cell] = []
    for i in range(0, len(names), chunk):
        cells += _run(names[i:i + chunk], modes, out, world, log)
    return cells


class TooBig(Exception):
    pass


MAX_PARAMS = 20_000_000  # a "tiny" config past this left a size field unshrunk


def _run(names: list[str], modes: list[str], out: Path, world: int, log) -> list[Cell]:
    from tpplan.analysis.verify.numerics import (compare, parallel_steps, reference_step,
                                          verify_step)
    from tpplan.plan.errors import PlanError, PlanErrors

    cells, jobs, refs = [], [], []
    for name in names:
        folder = out / name.replace(":", "-")
        folder.mkdir(parents=True, exist_ok=True)
        try:
            config = folder / "config.json"
            config.write_text(json.dumps(tiny_config(name), default=str))
        except Exception as e:  # noqa: BLE001 - a family transformers cannot configure
            cells += [Cell(name, m, "refused", f"no tiny config: {e}".splitlines()[0])
                      for m in modes]
            continue
        for mode in modes:
            cell = Cell(name, mode)
            cells.append(cell)
            start = time.perf_counter()
            make_plan(cell, config, folder)
            if cell.plan is not None:
                validate(cell, world)
            if cell.status == "ok":
                try:
                    step = verify_step(str(cell.plan), world, CP_SETS.get(cell.mode, []),
                                       shrink=name not in VARIANTS)
                    size = _params(step.plan)
                    if size > MAX_PARAMS:
                        raise TooBig(f"verify: the shrunk model still has {size:,} parameters "
                                     "(a size field of this family is not shrunk)")
                    refs.append(reference_step(step.plan, step.tokens, 0))
                    cell.job = len(jobs)
                    jobs.append((str(cell.plan), step.overrides, step.tokens, 0))
                except TooBig as e:
                    cell.status, cell.detail = "refused", str(e)
                except (PlanErrors, PlanError) as e:
                    errs = e.errors if isinstance(e, PlanErrors) else [e]
                    cell.status, cell.detail = "refused", f"verify: {errs[0].message}"
                except Exception:  # noqa: BLE001
                    cell.status = "TRACEBACK"
                    cell.detail = traceback.format_exc().strip().splitlines()[-1]
            log(f"{name:24s} {mode:11s} {cell.status:9s} {time.perf_counter() - start:5.1f} s "
                f"{cell.detail[:100]}")
    if jobs:
        start = time.perf_counter()
        results = parallel_steps(jobs, world)
        log(f"{len(jobs)} parallel steps on {world} processes: "
            f"{time.perf_counter() - start:.1f} s")
        for cell in cells:
            if cell.job is None:
                continue
            got = results[cell.job]
            if isinstance(got, str):
                cell.status, cell.detail = "TRACEBACK", f"verify: {got}"
                continue
            result = compare(refs[cell.job], got, TOLERANCE)
            cell.worst = max(err for _, err in result.rows)
            if not result.ok:
                what, err = max(result.failures, key=lambda f: f[1])
                cell.status, cell.detail = "WRONG", f"{what}: {err:.2e}"
    return cells


def _params(plan) -> int:
    from tpplan.models import build_model

    return sum(p.numel() for p in build_model(plan.model, device="meta").parameters())


def table(cells: list[Cell], modes: list[str], header: bool = True) -> str:
    """Markdown: one row per family, one column per mode, the worst error, the reasons."""
    rows = ["| family | " + " | ".join(modes) + " | worst error | not supported / notes |",
            "|---" * (len(modes) + 3) + "|"] if header else []
    by_family: dict[str, list[Cell]] = {}
    for c in cells:
        by_family.setdefault(c.family, []).append(c)
    for name, cs in by_family.items():
        marks = [c.status if c.status != "refused" else "refused" for c in cs]
        worst = max((c.worst for c in cs if c.worst is not None), default=None)
        why = sorted({f"{c.mode}: {c.detail}" for c in cs if c.detail} |
                     {n for c in cs for n in c.notes})
        rows.append(f"| {name} | " + " | ".join(marks) +
                    f" | {'' if worst is None else f'{worst:.1e}'} | "
                    + "<br>".join(w.replace("|", "/") for w in why) + " |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    import logging
    import warnings

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", help="comma-separated model types, a variant as "
                   "TYPE:NAME (VARIANTS), 'moe' for the MoE families (default: all)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--out", help="folder for configs and plans (default: a temp folder)")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    logging.getLogger("tpplan").setLevel(logging.ERROR)
    names = args.families.split(",") if args.families else families()
    names = [n for name in names for n in (MOE if name == "moe" else [name])]
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="tpplan-sweep-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        start = time.perf_counter()
        cells: list[Cell] = []
        print(table([], modes), flush=True)
        for i in range(0, len(names), 8):  # rows as each chunk ends
            chunk = run(names[i:i + 8], modes, out,
                        log=lambda s: print(s, file=sys.stderr, flush=True))
            print(table(chunk, modes, header=False), flush=True)
            cells += chunk
        passed = sum(all(c.status == "ok" for c in cells if c.family == n) for n in names)
        print(f"\n{passed} of {len(names)} families pass all of {', '.join(modes)} "
              f"({time.perf_counter() - start:.0f} s)")
    return 0 if all(c.status in ("ok", "refused") for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
