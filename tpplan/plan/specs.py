"""The plan as typed data: one dataclass per section, with the defaults every reader shares.

A :class:`PlanSpec` is what parsing a plan file produces (:func:`tpplan.plan.parse_plan`);
everything downstream — resolving, applying, the dry run, verify, the trainer — reads these
fields and nothing else, so a name or a default is decided once, here. Each spec keeps
where its keys stood in the file (``loc``, ``locs``) so later checks can point at them.
No torch needed: dtypes are names (:func:`torch_dtype` turns one into a ``torch.dtype``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .context import ContextParallelSpec
from .dataspec import DATA_FORMATS, TOKEN_DTYPES, DataSpec, SourceSpec, plan_relative
from .errors import Loc
from .lora_spec import LORA_INITS, LoraSpec, LoraTarget
from .sinks import MetricsSpec
from .styles import StyleSpec

__all__ = [
    "ACSpec", "AttrRule", "CheckpointSpec", "CompileSpec", "DataSpec", "DTYPES", "EvalSpec",
    "FreezeRule", "FSDPSpec", "MeshSpec", "PipelineSpec", "MetricsSpec", "ModelSpec", "PlanSpec", "Rule",
    "SourceSpec", "TrainSpec", "Unit", "DATA_FORMATS", "TOKEN_DTYPES", "DEFAULT_BLOCKS", "plan_relative", "torch_dtype",
    "LoraSpec", "LoraTarget", "LORA_INITS",
]

# Names a plan may use for a dtype -> the canonical name (also torch's attribute name).
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}
DEFAULT_BLOCKS = "layers.*"


def torch_dtype(name: str | None, default: str = "float32"):
    """The ``torch.dtype`` of a canonical dtype name (``None``: ``default``)."""
    import torch

    return getattr(torch, DTYPES[name or default])


@dataclass
class MeshSpec:
    """``mesh:`` — degrees of the named mesh, outermost ``pp`` first; ``dp_shard: -1`` takes
    the ranks left over. ``ep`` (expert parallelism) adds no ranks: it borrows them from
    ``dp_shard`` (docs/moe.md)."""

    tp: int = 1
    dp_shard: int = -1
    dp_replicate: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1  # context parallel: between dp_shard and tp (docs/long-context.md)
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class PipelineSpec:
    """``pipeline:`` — the schedule that runs ``mesh.pp`` stages (:mod:`tpplan.plan.pipeline`).

    ``split`` is ``auto`` (blocks balanced by parameters, the embedding counted on the first
    stage and the head on the last) or the module paths where stages 2, 3, ... start."""

    schedule: str = "1f1b"
    microbatches: int = 1  # per data-parallel rank per optimizer step
    stages_per_rank: int = 1  # virtual stages: 2+ for interleaved and zero-bubble schedules
    split: str | list[str] = "auto"
    split_locs: list[Loc] = field(default_factory=list)
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    @property
    def where(self) -> Loc | None:
        return self.locs.get("split", self.loc)


@dataclass
class ModelSpec:
    """``{name, config}`` for a built-in model, ``{factory, kwargs}`` for a user's own, or
    ``{hf: ClassName, config: {...}}`` / ``{hf_config: path}`` for a HuggingFace model."""

    name: str | None = None
    config: str | None = None
    factory: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    hf: str | None = None
    hf_config: str | None = None
    hf_kwargs: dict[str, Any] = field(default_factory=dict)  # the HF config's fields
    pretrained: str | None = None  # an HF checkpoint folder the weights start from
    adapter: str | None = None  # a PEFT LoRA adapter folder the `lora` adapters start from
    base_dir: str | None = None  # the plan's folder: relative hf_config paths start there
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    @property
    def is_hf(self) -> bool:
        return bool(self.hf or self.hf_config)

    def path(self, given: str) -> Path:
        """A path the model section names: relative ones next to the plan first, then from
        the working folder."""
        return Path(plan_relative(given, self.base_dir))


@dataclass
class Rule:
    """One ``pattern: style`` line of the ``tensor_parallel`` section."""

    pattern: str
    style: StyleSpec
    loc: Loc  # the pattern (the key) in the file

    def __str__(self) -> str:
        return f"'{self.pattern}' (line {self.loc.line})"


@dataclass
class AttrRule:
    """One ``divide_by_tp`` entry: a module pattern and the attribute to divide."""

    pattern: str
    attribute: str
    loc: Loc


@dataclass
class FreezeRule:
    """One ``freeze`` entry: parameters (or modules: every parameter under them) whose path
    the pattern matches stop training; ``!pattern`` trains them again. The last entry that
    matches a parameter decides."""

    pattern: str
    frozen: bool  # False for a '!pattern' exception
    loc: Loc


@dataclass
class Unit:
    """One entry of ``fsdp.units``. A pattern gives one ``fully_shard`` call per module it
    matches (``layers.*``: one unit per block); a list gives one call for every module its
    patterns match together (``[norm, output]``: one all-gather for both)."""

    patterns: list[str]
    loc: Loc
    grouped: bool = False


@dataclass
class FSDPSpec:
    """``fsdp:`` — FSDP2 units and options; dtypes are canonical names or None."""

    units: list[Unit] = field(default_factory=list)
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    loc: Loc | None = None


@dataclass
class ACSpec:
    """``activation_checkpointing:`` — ``none``, ``full`` (every block), ``selective``
    (every ``every``-th block) or ``op`` (every block, keeping the outputs of every other
    matmul, attention and reductions: tpplan.parallel.op_sac). ``every`` is 1 unless the
    mode is selective."""

    mode: str = "none"
    every: int = 1
    blocks: str = DEFAULT_BLOCKS
    loc: Loc | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass
class CompileSpec:
    """``compile:`` — ``torch.compile`` each block matched by ``blocks``. ``enabled`` None
    (the section left out): compiled on CUDA where the blocks are found, eager elsewhere
    (:meth:`on`)."""

    enabled: bool | None = None
    blocks: str = DEFAULT_BLOCKS
    fullgraph: bool = False
    loc: Loc | None = None

    def on(self, device_type: str, eager_only: bool = False) -> bool:
        """Whether blocks compile on ``device_type``: as the plan says, else on CUDA only, and
        not where ``eager_only`` (a pipeline schedule that splits backward, context
        parallelism's attention: not checked under compile)."""
        if self.enabled is not None:
            return self.enabled
        return device_type == "cuda" and not eager_only


@dataclass
class TrainSpec:
    """``train:`` — the optimization. Batch sizes count sequences of ``seq_len`` tokens."""

    steps: int = 100
    seq_len: int = 256
    # Sequences per optimizer step, over all data-parallel ranks; None when the plan gives
    # local_batch_size instead (then local × dp, known once the mesh is: plan.step_shape).
    global_batch_size: int | None = 8
    local_batch_size: int | None = None  # sequences per data-parallel rank per optimizer step
    micro_batch_size: int | None = None  # per data-parallel rank per forward; None = no accum
    seed: int = 0
    lr: float = 3e-4
    min_lr: float = 0.0  # the cosine ends here
    warmup_steps: int = 0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0  # max global L2 norm; null = no clipping
    # tokens per chunk of the chunked cross-entropy (vocabularies of 32,768 and more); 0 = off
    loss_chunk: int = 1024
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class EvalSpec:
    """``eval:`` — validation loss on a held-out ``path`` (read like ``data.path``) or the
    last ``fraction`` of the training data, every ``interval`` steps and at the end."""

    path: str | None = None
    fraction: float | None = None
    interval: int = 0  # 0: only after the last step
    batches: int | None = None  # global batches per evaluation; null: all the held-out data
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.path is not None or self.fraction is not None


@dataclass
class CheckpointSpec:
    """``checkpoint:`` — DCP checkpoints in ``<run_dir>/checkpoints`` unless ``dir`` is set."""

    enabled: bool = True
    interval: int = 0  # every N steps; 0 = only at the end
    keep: int = 2  # complete checkpoints kept (older ones deleted); 0 = keep all
    dir: str | None = None
    on_signal: bool = True  # SIGTERM/SIGINT: finish the step, save, exit 75
    verify: bool = True  # check every file's SHA-256 before resuming from a checkpoint
    loc: Loc | None = None
    locs: dict[str, Loc] = field(default_factory=dict)


@dataclass
class PlanSpec:
    """Every section of one plan, parsed and checked for syntax and types."""

    source: str
    mesh: MeshSpec
    model: ModelSpec | None
    rules: list[Rule]
    loss_parallel: bool = False
    divide_by_tp: list[AttrRule] = field(default_factory=list)
    fsdp: FSDPSpec | None = None
    activation_checkpointing: ACSpec = field(default_factory=ACSpec)
    compile: CompileSpec = field(default_factory=CompileSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    data: DataSpec = field(default_factory=DataSpec)
    eval: EvalSpec = field(default_factory=EvalSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    metrics: MetricsSpec = field(default_factory=MetricsSpec)
    freeze: list[FreezeRule] = field(default_factory=list)
    pipeline: PipelineSpec | None = None  # set exactly when mesh.pp > 1
    lora: LoraSpec | None = None
    context_parallel: ContextParallelSpec = field(default_factory=ContextParallelSpec)
    fault_tolerance: Any = None  # plan/fault_tolerance.py's FaultToleranceSpec, or None
    float8: Any = None  # plan/float8.py's Float8Spec, or None

    @property
    def uses_sequence_parallel(self) -> bool:
        return any(r.style.name == "sequence_parallel" for r in self.rules)
