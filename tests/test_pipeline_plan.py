"""The ``pipeline`` section and ``mesh.pp``: located errors, and the stage split the runtime
and the dry run share (on a meta model, no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tpplan
from tpplan.models import build_model
from tpplan.models.introspect import find_blocks
from tpplan.parallel.lora.sizes import same_in_every_block
from tpplan.parallel.pipeline.split import (StageBlocks, StageBuilder, split_stages, stage_module, stage_ranks,
                                      stage_view)
from tpplan.plan import PlanErrors

PLAN_3D = "plans/llama-3d.yaml"
BASE = """\
extends: {root}/plans/llama-3d.yaml
model: {{name: llama3, config: debug, kwargs: {{n_layers: 8}}}}
"""


def load_errors(path: str, overrides=()) -> list:
    with pytest.raises(PlanErrors) as e:
        tpplan.load(path, overrides)
    return e.value.errors


def resolve_errors(path: str, world: int, overrides=()) -> list:
    plan = tpplan.load(path, overrides)
    return plan.resolve(build_model(plan.model, device="meta"), world).errors


@pytest.fixture
def plan3d(write_plan, root):
    return write_plan(BASE.format(root=root) + "pipeline:\n  schedule: 1f1b\n  microbatches: 4\n"
                      "  split: [layers.3]\n")


def test_pp_without_pipeline_section_and_the_reverse(write_plan, root):
    path = write_plan(f"extends: {root}/plans/llama.yaml\nmesh: {{pp: 2, tp: 2}}\n")
    [e] = load_errors(path)
    assert "mesh.pp=2 splits the model into pipeline stages, but the plan has no 'pipeline'" \
        in e.message and (e.loc.line, e.loc.column) == (2, 12)
    [e] = load_errors(str(root / PLAN_3D), ["mesh.pp=1"])
    assert "has a 'pipeline' section but mesh.pp is 1" in e.message and e.loc.line == 8


def test_unknown_schedule_suggests_nearest(root):
    [e] = load_errors(str(root / PLAN_3D), ["pipeline.schedule=interleaved_1fb1"])
    assert "unknown pipeline schedule 'interleaved_1fb1'" in e.message
    assert "did you mean 'interleaved_1f1b'" in e.message and e.loc.file.startswith("--set")


@pytest.mark.parametrize("sets, message", [
    (["pipeline.schedule=interleaved_1f1b", "pipeline.stages_per_rank=1"],
     "stages_per_rank must be at least 2"),
    (["pipeline.schedule=1f1b", "pipeline.stages_per_rank=2"],
     "runs one stage per rank, got stages_per_rank=2"),
    (["pipeline.schedule=zbv", "pipeline.stages_per_rank=3"], "exactly 2 stages on each rank"),
    (["pipeline.microbatches=1"], "schedule 1f1b needs at least as many micro-batches as stages (2)"),
    (["pipeline.schedule=interleaved_1f1b", "pipeline.microbatches=5"],
     "microbatches must be a multiple of 2, got 5"),
    (["pipeline.schedule=zbv", "compile=true"], "torch.compile'd blocks do not support"),
    (["pipeline.split=[layers.1, layers.2]"], "2 stages (mesh.pp × stages_per_rank) need 1 split"),
])
def test_schedule_constraints_are_located(root, sets, message):
    errors = load_errors(str(root / PLAN_3D), sets)
    assert any(message in e.message for e in errors), [str(e) for e in errors]
    assert all(e.loc.line >= 1 for e in errors)


def test_microbatches_must_divide_the_rank_batch(root):
    plan = tpplan.load(str(root / PLAN_3D), ["pipeline.microbatches=3"])
    with pytest.raises(PlanErrors) as e:
        plan.step_shape(4)  # 16 sequences over dp=1: not 3 equal micro-batches
    assert "pipeline.microbatches=3 does not divide the 16 sequences" in str(e.value)
    # pp 2 × dp 2 × tp 2: 16 sequences per dp rank (local_batch_size), pp = 2 micro-batches
    shape = tpplan.load(str(root / PLAN_3D)).step_shape(8)
    assert (shape.global_batch, shape.micro_batch, shape.grad_accum) == (32, 8, 2)


@pytest.mark.parametrize("split, message, column", [
    ("[layers.30]", "split point 'layers.30' is not a block of the model", 11),
    ("[layres.3]", "did you mean 'layers.3'", 11),
    ("[layers.0]", "is the first block: the first stage would hold no block", 11),
])
def test_split_points_are_checked_against_the_model(write_plan, root, split, message, column):
    path = write_plan(BASE.format(root=root) + f"pipeline:\n  split: {split}\n")
    [e] = resolve_errors(path, 8)
    assert message in e.message and (e.loc.line, e.loc.column) == (4, column)


def test_split_points_out_of_order_and_empty_stages(write_plan, root):
    path = write_plan(BASE.format(root=root) + "mesh: {pp: 4, tp: 2}\npipeline:\n"
                      "  split: [layers.4, layers.2, layers.2]\n")
    messages = [e.message for e in resolve_errors(path, 8)]
    assert any("must be in the model's order: 'layers.2' comes before 'layers.4'" in m
               for m in messages)
    assert any("named twice: the stage between would be empty" in m for m in messages)


def test_more_stages_than_blocks(root):
    errors = resolve_errors(str(root / PLAN_3D), 8, ["mesh.pp=4", "model.kwargs.n_layers=2",
                                                     "pipeline.microbatches=4"])
    assert any("4 pipeline stages (mesh.pp=4 × stages_per_rank=1) but the model has 2 blocks"
               in e.message for e in errors)


def test_auto_split_balances_parameters_with_embedding_and_head(root):
    """Llama-3 405B's layout: 126 blocks on 16 stages; the embedding and head weigh about
    two thirds of a block, so the first and last stages hold one block fewer."""
    plan = tpplan.load(str(root / PLAN_3D), ["model.config=405b", "mesh.pp=16",
                                             "pipeline.microbatches=16"])
    split = split_stages(build_model(plan.model, device="meta"), plan.spec)
    assert not split.errors
    counts = [len(s.blocks) for s in split.stages]
    assert sum(counts) == 126 and counts[0] == counts[-1] == 7 and min(counts[1:-1]) == 8
    assert split.stages[0].extras == ("tok_embeddings",)
    assert split.stages[-1].extras == ("norm", "output")
    heaviest, lightest = max(s.params for s in split.stages), min(s.params for s in split.stages)
    assert heaviest / lightest < 1.2


def test_stage_ranks_loop_and_v():
    assert stage_ranks(4, 2, v_shape=False) == [0, 1, 0, 1]
    assert stage_ranks(4, 2, v_shape=True) == [0, 1, 1, 0]


def test_stage_module_keeps_whole_model_names_on_meta(root):
    plan = tpplan.load(str(root / PLAN_3D), ["model.kwargs.n_layers=4",
                                             "pipeline.schedule=interleaved_1f1b"])
    model = build_model(plan.model, device="meta")
    whole = {n for n, _ in model.named_parameters()}
    split = split_stages(model, plan.spec)
    assert [s.rank for s in split.stages] == [0, 1, 0, 1]
    seen = set()
    for stage in split.stages:
        part = stage_module(model, stage, split)
        names = {n for n, _ in part.named_parameters()}
        assert names <= whole and not names & seen
        seen |= names
        assert isinstance(part.layers, StageBlocks) and len(part.layers) == 1
        assert (part.tok_embeddings is None) == (stage.index != 0)
        assert (part.output is None) == (stage.index != 3)
    assert seen == whole
    assert {n for n, _ in model.named_parameters()} == whole  # the whole model is left whole


class _KeyedBlocks(nn.Module):
    """Blocks in a ModuleDict under their own keys, between an embedding and a head."""

    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.layers = nn.ModuleDict({f"b{i}": nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
                                     for i in range(6)})
        self.output = nn.Linear(8, 16, bias=False)


def _structure(module: nn.Module) -> list:
    """Every module below the root (a copy's root may be a ``stage_forward`` class), with
    its own parameters' names, shapes and dtypes, in order."""
    return [(n, type(m).__name__, [(k, tuple(p.shape), p.dtype)
                                   for k, p in m.named_parameters(recurse=False)])
            for n, m in module.named_modules() if n]


LORA_SOME = 'lora={targets: ["layers.0.attention.{wq,wv}", "model.layers.0.self_attn.q_proj"], rank: 4}'


@pytest.mark.parametrize("which", ["llama", "hf", "keyed"])
def test_a_stage_view_reads_what_the_stage_copy_holds(root, which):
    """``stage_view`` (what the dry run and ``search`` read a stage's blocks, cache key and
    LoRA choice from, without a copy) holds the modules, parameters and blocks of
    :func:`stage_module`'s copy of each stage, cut (``keep``) or not, LoRA on the first
    block alike; and the whole model is put back as it was, also when the reader raises."""
    overrides = ["model.kwargs.n_layers=6", LORA_SOME]
    if which == "hf":
        pytest.importorskip("transformers")
        plan = tpplan.load(str(root / "tests/plans/hf/llama-pp.yaml"),
                           ["model.config.num_hidden_layers=6", LORA_SOME])
    else:
        plan = tpplan.load(str(root / PLAN_3D), overrides)
    model = _KeyedBlocks() if which == "keyed" else build_model(plan.model, device="meta")
    before = [(n, id(m)) for n, m in model.named_modules()]
    split = split_stages(model, plan.spec, 2)
    assert not split.errors and len(split.stages) >= 2
    alike = []
    for stage in split.stages:
        for keep in (None, 1):
            part = stage_module(model, stage, split, keep)
            with stage_view(model, stage, split, keep) as view:
                assert _structure(view) == _structure(part)
                assert find_blocks(view) == find_blocks(part)
            assert [(n, id(m)) for n, m in model.named_modules()] == before
        build = StageBuilder(model, stage, split)
        alike.append(same_in_every_block(plan.spec, build))
        assert alike[-1] == same_in_every_block(plan.spec, stage_module(model, stage, split))
        with pytest.raises(KeyError):
            build.read(lambda m: m.get_submodule(split.blocks_path)["nothing"])
        assert [(n, id(m)) for n, m in model.named_modules()] == before
    if which != "keyed":  # LoRA on the first block only: its stage's blocks are not alike
        assert alike[0] is False and alike[-1] is True


def test_a_stage_runs_the_model_forward_unchanged():
    """A middle stage takes activations and returns activations; the pieces chained give the
    whole model's logits."""
    plan = tpplan.load("plans/llama-3d.yaml", ["model.kwargs.n_layers=4", "mesh.tp=1",
                                               "mesh.pp=4"])
    torch.manual_seed(0)
    model = build_model(plan.model, device="cpu")
    split = split_stages(model, plan.spec)
    tokens = torch.randint(0, 256, (2, 8))
    h = tokens
    for stage in split.stages:
        h = stage_module(model, stage, split)(h)
    torch.testing.assert_close(h, model(tokens))
