"""The built-in mixture of experts (``model: {name: moe}``, tpplan/models/moe.py; docs/moe.md,
"Built-in MoE model") under expert parallelism on 4 gloo processes against one device --
logits, loss (its load-balancing term included) and every gradient, the routers' checked
non-zero -- on two configs (8 experts, top-2, MoE in every block; 4 experts, top-1 unnormalized,
MoE every second block, a shared expert): ep 4, ep 2 with the experts FSDP-sharded over the 2
ranks left, ep 2 beside tp 2 + SP (plans/moe-tp.yaml) and ep 2 under pp 2, in one spawn;
``tpplan verify`` shrinking a realistic config; the dry run's all-to-all against a real run;
training resumed on another ep along one process's curve; its config mistakes located."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import PLANS, run_main

from tpplan.models.moe import Experts

PLAN = str(PLANS / "moe.yaml")
TP_PLAN = str(PLANS / "moe-tp.yaml")
TINY = ["model.kwargs.n_layers=2", "model.kwargs.dim=64", "model.kwargs.n_heads=4",
        "model.kwargs.n_kv_heads=2", "model.kwargs.moe_hidden=32", "model.kwargs.vocab_size=128"]
# 8 experts, top-2 (renormalized), MoE in every block, the load-balancing term on
WIDE = [*TINY, "model.kwargs.router_aux_loss_coef=0.1"]
# 4 experts, top-1 (its softmax probability as the weight), MoE in blocks 1 and 3, a shared
# expert beside the routed ones
SPARSE = [*TINY, "model.kwargs.n_layers=4", "model.kwargs.num_experts=4", "model.kwargs.top_k=1",
          "model.kwargs.norm_topk_prob=false", "model.kwargs.moe_every=2",
          "model.kwargs.shared_hidden=48"]
PP = ["mesh.pp=2", "pipeline={microbatches: 2}"]


def test_builtin_moe_matches_one_device():
    from tpplan.analysis.verify.numerics import compare, parallel_steps, reference_step, verify_step

    cases = []
    for name, config in (("wide", WIDE), ("sparse", SPARSE)):
        cases += [(f"{name} ep 4", PLAN, [*config, "mesh.ep=4"]),
                  (f"{name} ep 2 efsdp 2", PLAN, config),
                  (f"{name} tp 2 + SP, ep 2", TP_PLAN, config)]
    cases += [("wide pp 2, ep 2", PLAN, [*TINY, *PP]),  # the aux term is refused under pp
              ("sparse pp 2, ep 2", PLAN, [*SPARSE, *PP])]
    steps = [verify_step(plan, 4, sets, shrink=False) for _, plan, sets in cases]
    jobs = [(plan, s.overrides, s.tokens, 0) for (_, plan, _), s in zip(cases, steps)]
    for (name, _, sets), step, par in zip(cases, steps, parallel_steps(jobs, 4)):
        assert not isinstance(par, str), f"{name}: {par}"
        ref = reference_step(step.plan, step.tokens, 0)
        cmp = compare(ref, par)
        assert cmp.ok, (name, cmp.failures)
        routers = [n for n in ref.grads if n.endswith("feed_forward.router.weight")]
        experts = [n for n in ref.grads if n.endswith("feed_forward.experts.down_proj")]
        assert len(routers) == len(experts) == 2, name  # every MoE block compared
        for n in routers:
            assert par.grads[n].abs().sum() > 0, (name, n)
        if "sparse" in name:  # the shared expert and the dense blocks are compared too
            assert "layers.1.feed_forward.shared_expert.w2.weight" in par.grads, name
            assert "layers.0.feed_forward.w2.weight" in par.grads, name
        ce = F.cross_entropy(ref.logits.flatten(0, 1), step.tokens[:, 1:].flatten()).item()
        aux = "router_aux_loss_coef=0.1" in " ".join(sets) and "pp" not in name
        # the reference's loss holds the load-balancing term (0.1 × about k per MoE block)
        # where it is on, and the parallel side's matched it
        assert (ref.loss - ce > 0.1) == aux, (name, ref.loss, ce)


def test_verify_shrinks_a_realistic_config(capsys):
    """Llama 4 Maverick's shapes (128 experts, top-1, MoE every second block, a shared
    expert) shrunk by verify to a tiny model that keeps them, on ep 2 × efsdp 2."""
    rc, out = run_main(capsys, "verify", "--plan", PLAN, "--nproc", "4",
                       "--set", "model.config=llama4-maverick")
    assert rc == 0, out
    assert "numerics match" in out and "grad layers.*.feed_forward.router.weight" in out, out
    assert "feed_forward.shared_expert.w2.weight" in out and "feed_forward.w2.weight" in out


def test_dry_run_all_to_all_is_what_a_real_run_issues(tmp_path):
    from test_expert_parallel import all_to_all_as_predicted

    plan = tmp_path / "moe-a2a.yaml"
    plan.write_text(f"extends: {PLAN}\n")
    sets = [*TINY, "model.kwargs.top_k=3", "train.seq_len=16", "train.global_batch_size=8",
            "train.micro_batch_size=2"]
    all_to_all_as_predicted([(str(plan), sets, tmp_path / "out", True)])


def test_a_run_on_ep_4_resumes_on_ep_2_along_one_curve(tmp_path):
    """plans/moe.yaml trains with its load-balancing term on (micro-batches of one sequence,
    so the term is the same on every mesh); its checkpoint holds the whole model's experts
    and resumes on another ep, along the curve of one process run straight through."""
    from trainrun import assert_same_curve, metrics, ok, tpplan_train

    from tpplan.checkpoint import latest, read_model_state

    sets = ["train.steps=3", "checkpoint.interval=1", "train.global_batch_size=4",
            "model.kwargs.router_aux_loss_coef=0.01"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(tpplan_train(whole, plan=PLAN, sets=[*sets, "mesh.ep=1"]))
    ok(tpplan_train(parts, nproc=4, plan=PLAN, sets=[*sets, "train.steps=2", "mesh.ep=4"]))
    ok(tpplan_train(parts, "--resume", "latest", nproc=2, plan=PLAN, sets=[*sets, "mesh.ep=2"]))
    assert_same_curve(metrics(parts), metrics(whole), (1, 2, 3))  # loss and gradient norm
    state = read_model_state(latest(parts / "checkpoints"))
    assert tuple(state["layers.0.feed_forward.experts.gate_up_proj"].shape) == (8, 256, 64)


def test_a_profiled_step_names_the_experts_groups_as_the_dry_run_does(tmp_path):
    """``--profile`` under ep 2 of dp_shard 4: every collective of the profiled step under
    the mesh dimension the dry run counts it on, the experts' all-to-all on ``ep`` and their
    FSDP2 on ``efsdp`` (groups that ``expert_meshes`` makes, by the dimension DeviceMesh
    made them for, not by their ranks), as many as the dry run counts, on every rank."""
    from trainrun import TINY as RUN, ok, tpplan_train

    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    sets = ["train.steps=3", "checkpoint.enabled=false"]
    ok(tpplan_train(tmp_path, "--profile", "2:2", nproc=4, plan=PLAN, sets=sets))
    predicted = dry_run(PLAN, 4, [*RUN, *sets],  # the sizes the run trains at
                        [a for a in ANALYSES if a[0] == "comm_per_step"])
    expected: dict[str, int] = {}
    for r in predicted.extra["comm_per_step"]["collectives"]:
        key = f"{r['mesh_dim']} {r['kind']}"
        expected[key] = expected.get(key, 0) + r["count"]
    assert expected["ep all_to_all"] > 0 and expected["efsdp all_gather"] > 0
    for rank in range(4):
        summary = json.loads((tmp_path / "profile" / f"summary-rank{rank}.json").read_text())
        assert summary["steps"][0]["collectives"] == expected, rank


def test_experts_match_a_loop_over_tokens():
    """Each token's output is the weighted sum of its chosen experts' SwiGLU; an id equal
    to num_experts adds nothing; with no row for any expert the output still depends on
    the hidden states (under ep the dispatch's backward then runs on every rank)."""
    torch.manual_seed(0)
    experts = Experts(4, 8, 6)
    x = torch.randn(5, 8, requires_grad=True)
    ids = torch.tensor([[0, 3], [3, 1], [2, 2], [1, 4], [4, 4]])  # 4: no expert
    weights = torch.rand(5, 2)
    want = torch.zeros(5, 8)
    for t in range(5):
        for j in range(2):
            e = int(ids[t, j])
            if e < 4:
                gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
                want[t] += weights[t, j] * (experts.down_proj[e] @ (F.silu(gate) * up))
    assert torch.allclose(experts(x, ids, weights), want, atol=1e-6)
    nothing = experts(x, torch.full((5, 2), 4), weights)
    assert not nothing.any()
    (grad,) = torch.autograd.grad(nothing.sum(), x)
    assert not grad.any()


@pytest.mark.parametrize("sets, line, says", [
    (["model.kwargs.top_k=9"], "--set model.kwargs.top_k=9:1:",
     "top_k=9 chooses more experts than num_experts=8"),
    (["model.kwargs.moe_every=0"], "--set model.kwargs.moe_every=0:1:",
     "'model.kwargs.moe_every' must be a positive integer, got 0"),
    (["model.config=mixtral"], "--set model.config=mixtral:1:",
     "unknown config 'mixtral' for moe (did you mean 'mixtral-8x7b'?)"),
    (["model.kwargs.router_aux_loss_coef=0.1", *PP], "--set mesh.pp=2:1:",
     "the model computes its load-balancing loss"),
    (["model.kwargs.num_experts=6", "mesh.ep=4"], "moe.yaml:16:3:",
     "holds 6 experts and mesh ep=4 does not divide them"),
])
def test_builtin_moe_mistakes_are_located(capsys, sets, line, says):
    args = [a for s in sets for a in ("--set", s)]
    rc, out = run_main(capsys, "validate", "--plan", PLAN, "--world-size", "4", *args)
    assert rc == 1 and "Traceback" not in out, out
    assert line in out and says in out, out
