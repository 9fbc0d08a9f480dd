"""A model written the ordinary way starts from the weights its constructor writes
(docs/byom.md, "How the weights start"): grouped experts ``nn.Parameter(torch.randn(E, d, h)
* 0.02)`` and a hand-written RMSNorm's ``torch.ones(d)``, neither with ``reset_parameters``,
equal the plain CPU build under ``train.seed`` tensor by tensor, at 1 and at 4 ranks; a
rotary table computed in ``__init__`` is kept; what cannot be replayed is refused before
launch; experts called ``(x, idx, w)`` run under ep 2; a first loss that is not finite is
not blamed on the learning rate (tests/init_models.py)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import ROOT, run_main, tpplan_cli
from trainrun import metrics, ok

import init_models
from tpplan.models import build_model
from tpplan.models.init import init_weights, materialize
from tpplan.plan.specs import ModelSpec

ENV = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}  # init_models importable in the workers
SEED = 5
PLAN = f"""mesh: {{tp: 2, ep: 2, dp_shard: -1}}
model: {{factory: "init_models:{{factory}}", kwargs: {{vocab: 256}}}}
tensor_parallel:
  "layers.*.attn.{{q_proj,k_proj,v_proj}}": colwise
  "layers.*.attn.o_proj": rowwise
  "layers.*.mlp.experts": expert_parallel
fsdp: {{units: ["layers.*"]}}
# lr 1e-30: step 1's update changes no float32 weight, so its checkpoint holds the start
train: {{steps: 2, seq_len: 16, global_batch_size: 4, lr: 1.0e-30, min_lr: 0, warmup_steps: 0,
         weight_decay: 0, seed: {SEED}}}
data: {{max_bytes: 50000}}
checkpoint: {{interval: 1}}
"""
WRITTEN = ("attn_norm.weight", "mlp_norm.weight", "mlp.experts.w_in", "mlp.experts.w_out")
# nanoGPT's way: its own apply(_init_weights) over Linear / Embedding (tied), c_proj rescaled
NANO = """mesh: {tp: 2, dp_shard: -1}
model: {factory: "init_models:nano_gpt", kwargs: {vocab: 256}}
tensor_parallel:
  "transformer.h.*.attn.c_attn": {style: packed_colwise, parts: 3}
  "transformer.h.*.{attn,mlp}.c_proj": rowwise
  "transformer.h.*.mlp.c_fc": colwise
fsdp: {units: ["transformer.h.*"]}
""" + PLAN[PLAN.index("# lr 1e-30"):]


def _plan(write_plan, factory: str = "moe_gpt", extra: str = "") -> str:
    return write_plan(PLAN.replace("{factory}", factory) + extra)


def _plain(factory=init_models.moe_gpt) -> torch.nn.Module:
    torch.manual_seed(SEED)
    return factory(vocab=256)


def _constructor_written(name: str) -> bool:
    return name == "norm.weight" or name.endswith(WRITTEN)


def test_init_weights_replays_the_constructor_and_keeps_its_buffers():
    """In process: parameters without reset_parameters equal the plain build's (the Linear
    and Embedding draws before them replayed too), rotary tables computed in ``__init__``
    kept through ``to_empty``; the random state of the caller untouched."""
    spec = ModelSpec(factory="init_models:moe_gpt", kwargs={"vocab": 256})
    model = build_model(spec, "meta", real_buffers=True)
    materialize(model, "cpu")
    state = torch.get_rng_state()
    assert init_weights(model, SEED, "cpu", spec) == "reset_parameters and constructor"
    assert torch.equal(torch.get_rng_state(), state)
    plain = _plain()
    ref = dict(plain.named_parameters())
    written = [n for n, _ in model.named_parameters() if _constructor_written(n)]
    assert len(written) == 9
    for name in written:
        assert torch.equal(dict(model.named_parameters())[name], ref[name]), name
    for name, buf in plain.named_buffers():
        assert torch.equal(dict(model.named_buffers())[name], buf), name
    with pytest.raises(ValueError, match="layers.0.attn_norm.weight.*reset_parameters"):
        init_weights(model, SEED, "cpu")  # without the spec, said, never left as memory held


@pytest.mark.parametrize("factory", ["nano_gpt", "nano_gpt_data"])
def test_writes_after_a_module_is_complete_are_replayed(factory):
    """nanoGPT's ``self.apply(self._init_weights)`` (N(0, 0.02) into every Linear and the tied
    Embedding, zeros into biases) and its c_proj rescale loop, through ``nn.init`` or through
    ``.data``: every parameter equals the plain CPU build's, although Linear and Embedding
    have a ``reset_parameters()`` of their own (which used to win: kaiming, a first loss above
    ln(vocab)); the two ways of writing give the same numbers."""
    spec = ModelSpec(factory=f"init_models:{factory}", kwargs={"vocab": 256})
    model = build_model(spec, "meta", real_buffers=True)
    materialize(model, "cpu")
    assert init_weights(model, SEED, "cpu", spec) == "reset_parameters and constructor"
    plain = _plain(getattr(init_models, factory))
    ref = dict(plain.named_parameters())
    assert model.transformer.wte.weight is model.lm_head.weight
    for name, p in model.named_parameters():
        assert torch.equal(p, ref[name]), name
    for name, p in _plain(init_models.nano_gpt).named_parameters():
        assert torch.equal(p, ref[name]), name


def test_train_on_1_and_4_ranks_starts_from_the_constructors_weights(write_plan, tmp_path):
    """``tpplan train`` alone and on tp 2 × ep 2 (FSDP2): step 1's checkpoint (lr 1e-30)
    holds exactly the constructor's tensors, the same at both sizes; the losses agree."""
    from tpplan.checkpoint import read_model_state

    plan = _plan(write_plan)
    runs = {1: tmp_path / "one", 4: tmp_path / "four"}
    ok(tpplan_cli("train", "--plan", plan, "--set", "mesh.tp=1", "--set", "mesh.ep=1",
                  "--set", f"metrics.run_dir={runs[1]}", env=ENV))
    ok(tpplan_cli("train", "--plan", plan, "--nproc", 4, "--set", f"metrics.run_dir={runs[4]}",
                  env=ENV))
    one, four = (read_model_state(runs[n] / "checkpoints" / "step-000001") for n in (1, 4))
    ref = dict(_plain().named_parameters())
    assert one.keys() == four.keys() == ref.keys()
    for name in one:
        assert torch.equal(one[name], four[name]), name  # every parameter, any mesh
        if _constructor_written(name):
            assert torch.equal(one[name], ref[name]), name
    a, b = metrics(runs[1]), metrics(runs[4])
    for step in (1, 2):
        assert math.isclose(a[step]["loss"], b[step]["loss"], rel_tol=1e-5), (step, a, b)
    _nano_on_1_and_4_ranks(write_plan, tmp_path)


def _nano_on_1_and_4_ranks(write_plan, tmp_path):
    """nanoGPT's writes after its modules were complete: ``nano_gpt`` alone, ``nano_gpt_data``
    (the same numbers written through ``.data``) on tp 2 (c_attn packed) × dp_shard 2 with
    FSDP2 and tied embeddings; both start from the plain build, the first loss near ln(256)."""
    from tpplan.checkpoint import read_model_state

    plan = write_plan(NANO, "nano.yaml")
    runs = {1: tmp_path / "nano_one", 4: tmp_path / "nano_four"}
    ok(tpplan_cli("train", "--plan", plan, "--set", "mesh.tp=1", "--set", f"metrics.run_dir={runs[1]}",
                  env=ENV))
    ok(tpplan_cli("train", "--plan", plan, "--nproc", 4, "--set", "model.factory=init_models:nano_gpt_data",
                  "--set", f"metrics.run_dir={runs[4]}", env=ENV))
    one, four = (read_model_state(runs[n] / "checkpoints" / "step-000001") for n in (1, 4))
    ref = _plain(init_models.nano_gpt).state_dict()  # the tied weight under both names
    assert one.keys() == four.keys() == ref.keys()
    for name in one:  # exact but for the zeros (biases), which step 1 moves by 1e-30
        for got in (one[name], four[name]):
            assert (got - ref[name]).abs().max() <= 1e-29, name
    a, b = metrics(runs[1]), metrics(runs[4])
    assert abs(a[1]["loss"] - math.log(256)) < 0.05, a[1]  # N(0, 0.02) weights: logits near 0
    for step in (1, 2):
        assert math.isclose(a[step]["loss"], b[step]["loss"], rel_tol=1e-5), (step, a, b)


@pytest.mark.parametrize("factory", ["scaled_after", "scaled_after_data"])
def test_a_constructor_that_cannot_be_replayed_is_refused_before_launch(write_plan, capsys, factory):
    """A parent scaling its experts' weights (``mul_``, reading what they held) after they were
    built, on the parameter or through ``.data``: refused at the factory's line before torchrun
    starts, each parameter named with the fix."""
    plan = _plan(write_plan, factory)
    rc, out = run_main(capsys, "train", "--plan", plan, "--nproc", "4")
    assert rc == 1, out
    assert "plan.yaml:2:" in out and "cannot initialize the model as its constructor does" in out
    for i in (0, 1):
        assert f"'layers.{i}.mlp.experts.w_out' is changed after its module was complete" in out
    assert "give the module a reset_parameters()" in out
    assert "did not finish" not in out and "Traceback" not in out


def test_a_bad_lora_target_is_reported_before_launch(write_plan, capsys):
    plan = _plan(write_plan, extra="lora: {targets: [q_prj, v_proj], rank: 2}\n")
    rc, out = run_main(capsys, "train", "--plan", plan, "--nproc", "4")
    assert rc == 1, out
    assert "plan.yaml:13:18: error: 'lora.targets' pattern 'q_prj' matches no module" in out, out
    assert "did not finish" not in out and "Traceback" not in out


def test_experts_called_x_idx_w_verify_under_ep_2(write_plan, capsys):
    """The contract is positional: ``forward(self, x, idx, w)`` is routed by expert_parallel
    and matches one device (logits, loss, every gradient)."""
    from tpplan.parallel.experts.forms import call_form

    assert call_form(init_models.GroupedExperts(2, 4, 4)) == "routed"
    plan = write_plan(PLAN.replace("{factory}", "moe_gpt").replace("tp: 2, ep: 2", "ep: 2"))
    rc, out = run_main(capsys, "verify", "--plan", plan, "--nproc", "2", "--no-shrink")
    assert rc == 0 and "numerics differ" not in out, out


def test_a_first_loss_not_finite_names_the_parameters_not_the_learning_rate(write_plan, tmp_path):
    """A run whose constructor writes a NaN stops at step 1 naming it, without blaming the
    learning rate; after an update, a non-finite loss is divergence as before."""
    from trainrun import fails

    from tpplan.train.failures import not_finite

    plan = _plan(write_plan, "nan_norm")
    out = fails(tpplan_cli("train", "--plan", plan, "--set", "mesh.tp=1", "--set", "mesh.ep=1",
                           "--set", f"metrics.run_dir={tmp_path / 'run'}", env=ENV),
                "error: step 1: loss nan", "before any update (not a learning-rate problem)",
                "1 parameters are not finite before any update: norm.weight")
    assert "train.lr" not in out

    model = _plain()
    with torch.no_grad():
        model.layers[1].mlp.experts.w_in[0, 0, 0] = float("nan")
    optimizer = torch.optim.AdamW(model.parameters())
    said = str(not_finite(1, math.nan, math.nan, [model], [optimizer], None))
    assert "before any update (not a learning-rate problem)" in said
    assert "layers.1.mlp.experts.w_in" in said and "train.lr" not in said
    model.layers[1].mlp.experts.w_in.grad = torch.zeros_like(model.layers[1].mlp.experts.w_in)
    optimizer.step()  # after an update: divergence, as before
    assert "Lower train.lr" in str(not_finite(2, math.inf, 1.0, [model], [optimizer], None))
