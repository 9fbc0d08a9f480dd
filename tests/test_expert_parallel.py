"""Expert parallelism (docs/moe.md): ``mesh.ep`` and the ``expert_parallel`` style on two tiny
HF mixtures of experts (Qwen3-MoE: 4 experts, top-2; Mixtral: 8 experts, top-3) match one
device on 4 gloo processes -- logits, loss and every gradient, the router's included -- at
ep 4 (also under full activation checkpointing), ep 2 with the experts FSDP-sharded over the
2 ranks left, ep 2 under HSDP, ep 2 beside tp 2 with sequence parallelism, ep 2 under
pipeline stages (pp 2: 1F1B, interleaved 1F1B), ep borrowing context-parallel ranks (ep 2
and 4 over dp_shard 2 × cp 2, ring and Ulysses) and all three (pp 2 × cp 2 × ep 2); one
spawn. Experts sharded without dispatch fail ``tpplan verify``; plan mistakes are located
errors before any process starts; the dry run's all-to-all is what a real run issues; a run
resumes on another ep and pp."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest
from helpers import ROOT, run_main
from hooked import NO_DISPATCH, install

from tpplan.analysis.verify.numerics import compare, parallel_steps, reference_step, verify_step

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402

FSDP = 'fsdp: {units: [model.embed_tokens, "model.layers.*", [model.norm, lm_head]]}'
RULE = '"model.layers.*.mlp.experts": expert_parallel'


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Two tiny MoE configs with different expert counts and top-k, and Llama 4's (every
    token to every expert)."""
    folder = tmp_path_factory.mktemp("moe")
    out = {}
    for family, fields in (("qwen3_moe", {}),
                           ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 3}),
                           ("llama4_text", {})):
        path = folder / f"{family}.json"
        path.write_text(json.dumps(sweep_hf.tiny_config(family, **fields)))
        out[family] = path
    return out


def _plan(folder, name: str, config, mesh: str, rules: str = RULE, extra: str = FSDP,
          layers: int | None = None) -> str:
    path = folder / f"{name}.yaml"
    model = f"hf_config: {config}" + (f", config: {{num_hidden_layers: {layers}}}" if layers else "")
    path.write_text(f"mesh: {mesh}\nmodel: {{{model}}}\n"
                    f"tensor_parallel:\n  {rules}\n{extra}\n")
    return str(path)


GATHERED = ('"model.layers.*.mlp": {style: prepare_input_output, input_layouts: shard(1), '
            'desired_input_layouts: replicate, use_local_input: true, output_layouts: replicate, '
            'desired_output_layouts: shard(1), use_local_output: true}')


def _sp_plan(capsys, folder, family: str, config, ep: int = 2, gathered: bool = False) -> str:
    """import-hf's tp 2 + SP plan with ``ep``: transformers' ep plan routes the experts, the
    MoE blocks run on the sequence shard and ep borrows tp's ranks (docs/moe.md); with
    ``gathered``, the same plan with the sequence gathered before the MoE blocks instead
    (the form before sequence_local: ep beside tp, over dp_shard only)."""
    path = folder / f"{family}-sp-ep{ep}{'-gathered' * gathered}.yaml"
    rc, out = run_main(capsys, "import-hf", config, "--sequence-parallel", "--ep", str(ep),
                       "-o", path)
    assert rc == 0, out
    text = path.read_text()
    assert f"mesh: {{tp: 2, ep: {ep}, dp_shard: -1}}" in text
    assert '"model.layers.*.mlp.experts": expert_parallel' in text
    assert "experts_colwise_rowwise\n" not in text
    if gathered:  # (import-hf gathers it itself for a model with a load-balancing loss)
        path.write_text(text.replace('"model.layers.*.mlp": sequence_local', GATHERED))
    else:
        assert '"model.layers.*.mlp": sequence_local\n' in text
    return str(path)


def test_expert_parallel_matches_one_device(configs, tmp_path, capsys):
    plans = []
    for family in ("qwen3_moe", "mixtral"):  # (Llama 4's dense form: the family sweep's)
        config = configs[family]
        plans += [_plan(tmp_path, f"{family}-ep4", config, "{ep: 4, dp_shard: -1}"),
                  _plan(tmp_path, f"{family}-ep2-efsdp2", config, "{ep: 2, dp_shard: 4}"),
                  # tp 2 + SP, the MoE blocks on the sequence shard: ep 2 borrows tp's ranks
                  # (the experts FSDP-sharded over dp_shard 2), ep 4 borrows tp × dp_shard
                  _sp_plan(capsys, tmp_path, family, config),
                  _sp_plan(capsys, tmp_path, family, config, ep=4)]
    # the sequence gathered before the MoE blocks instead: ep 2 beside tp, over dp_shard
    plans.append(_sp_plan(capsys, tmp_path, "qwen3_moe", configs["qwen3_moe"], gathered=True))
    plans.append(_plan(tmp_path, "qwen3_moe-hsdp", configs["qwen3_moe"],
                       "{ep: 2, dp_shard: 2, dp_replicate: 2}"))
    plans.append(_plan(tmp_path, "qwen3_moe-ep4-ac", configs["qwen3_moe"], "{ep: 4}",
                       extra=FSDP + '\nactivation_checkpointing: {mode: full, blocks: "model.layers.*"}'))
    # pipeline stages: each stage's experts over the ep ranks of its pp slice
    plans.append(_plan(tmp_path, "qwen3_moe-pp2-ep2", configs["qwen3_moe"],
                       "{pp: 2, ep: 2, dp_shard: -1}", extra=FSDP + "\npipeline: {microbatches: 2}"))
    plans.append(_plan(tmp_path, "mixtral-pp2-ep2-interleaved", configs["mixtral"],
                       "{pp: 2, ep: 2, dp_shard: -1}", layers=4,
                       extra=FSDP + "\npipeline: {schedule: interleaved_1f1b}"))
    # ep borrowing context-parallel ranks (their tokens differ too), under a pipeline as well
    plans.append(_plan(tmp_path, "qwen3_moe-cp2-ep2", configs["qwen3_moe"],
                       "{cp: 2, ep: 2, dp_shard: -1}", extra=FSDP + "\ncontext_parallel: ring"))
    plans.append(_plan(tmp_path, "mixtral-cp2-ep4", configs["mixtral"],
                       "{cp: 2, ep: 4, dp_shard: -1}",
                       extra=FSDP + "\ncontext_parallel: {method: ulysses, load_balance: false}"))
    plans.append(_plan(tmp_path, "qwen3_moe-pp2-cp2-ep2", configs["qwen3_moe"],
                       "{pp: 2, cp: 2, ep: 2, dp_shard: -1}",
                       extra=FSDP + "\ncontext_parallel: ring\npipeline: {schedule: gpipe, microbatches: 2}"))
    for path, step, ref, _ in match_one_device(plans):
        routers = [n for n in ref.grads if n.endswith("mlp.gate.weight")]
        experts = [n for n in ref.grads if n.endswith("mlp.experts.down_proj")]
        layers = step.plan.spec.model.hf_kwargs.get("num_hidden_layers", 2)
        assert len(routers) == len(experts) == layers, path  # every MoE block compared
        dims = step.plan.parallel_dims(4)  # which ranks ep took: tp's under sequence_local
        assert dims.ep_borrows_tp == ("-sp-ep" in path and "gathered" not in path), path


def match_one_device(plans: list[str]) -> list:
    """Each plan's step on 4 gloo processes (one spawn for all) against one device: logits,
    loss and every gradient equal, each router's gradient non-zero (the router learns
    through the dispatch). (plan, its VerifyStep, the reference, the parallel result) each."""
    steps = [verify_step(p, 4, shrink=False) for p in plans]
    jobs = [(p, s.overrides, s.tokens, 0) for p, s in zip(plans, steps)]
    out = []
    for path, step, par in zip(plans, steps, parallel_steps(jobs, 4)):
        assert not isinstance(par, str), f"{path}: {par}"
        ref = reference_step(step.plan, step.tokens, 0)
        cmp = compare(ref, par)
        assert cmp.ok, (path, cmp.failures)
        for name in [n for n in ref.grads if n.endswith("mlp.gate.weight")]:
            assert par.grads[name].abs().sum() > 0, (path, name)
        out.append((path, step, ref, par))
    return out


def test_experts_sharded_without_dispatch_fail_verify(configs, tmp_path, capsys, monkeypatch):
    plan = _plan(tmp_path, "ep2", configs["qwen3_moe"], "{ep: 2, dp_shard: -1}")
    install({NO_DISPATCH: "1"}, monkeypatch.setattr)  # in the ranks verify spawns too
    rc, out = run_main(capsys, "verify", "--plan", plan, "--nproc", "2", "--no-shrink")
    assert rc == 1, out
    assert "numerics differ" in out and "FAIL" in out
    monkeypatch.undo()
    rc, out = run_main(capsys, "verify", "--plan", plan, "--nproc", "2", "--no-shrink")
    assert rc == 0, out


@pytest.mark.parametrize("mesh, rule, line, col, says", [
    # ep borrows dp_shard's ranks: 3 does not divide the 4 there
    ("{ep: 3, dp_shard: -1}", RULE, 1, 12, "mesh ep=3 must divide the data-parallel ranks it "
     "borrows: dp_shard=4"),
    # tp's ranks hold the same tokens: not borrowed, and the message says so
    ("{tp: 2, ep: 4, dp_shard: -1}", RULE, 1, 19, "ep does not borrow them unless the MoE "
     "blocks run on the sequence shard"),
    # on the sequence shard ep borrows dp_shard × tp, and must divide that
    ("{tp: 2, ep: 3, dp_shard: -1}", RULE + '\n  "model.layers.*.mlp": sequence_local', 1, 19,
     "mesh ep=3 must divide the ranks it borrows: dp_shard=2 × tp=2 = 4"),
    # a block on the sequence shard replicates what is inside it: no tp rule there
    ("{tp: 2, ep: 2, dp_shard: -1}", RULE + '\n  "model.layers.*.mlp": sequence_local\n  '
     '"model.layers.*.mlp.gate": colwise', 6, 3, "cannot shard it there"),
    # one MoE block on the shard, the other gathered: ep would take tp's ranks for both
    ("{tp: 2, ep: 2, dp_shard: -1}", RULE + '\n  "model.layers.0.mlp": sequence_local', 4, 3,
     "outside any sequence_local block"),
    # 4 experts over ep 4 fit; over a dp_shard of 8 with ep 8 they do not
    ("{ep: 8, dp_shard: -1}", RULE, 4, 3, "holds 4 experts and mesh ep=8 does not divide them"),
    ("{ep: 2, dp_shard: -1}", '"model.layers.*.mlp.expert": expert_parallel', 4, 3,
     "matches no module of the model"),
    ("{ep: 2, dp_shard: -1}", '"model.layers.*.mlp": expert_parallel', 4, 3,
     "is not an experts container"),
    ("{ep: 2, dp_shard: -1}", '"model.layers.*.mlp.gate": expert_parallel', 4, 3,
     "is not an experts container"),
    ("{ep: 2, dp_shard: -1}", '"model.layers.*.self_attn": replicate', 1, 12,
     "no rule uses the 'expert_parallel' style"),
    # under context parallelism ep borrows dp_shard × cp
    ("{ep: 3, cp: 2, dp_shard: -1}", RULE, 1, 12,
     "mesh ep=3 must divide the data-parallel ranks it borrows: dp_shard=2 × cp=2 = 4"),
    # expert TP inside EP: the experts stay whole on each tp rank, one rule per module
    ("{tp: 2, ep: 2, dp_shard: -1}", RULE + '\n  "model.layers.{0,1}.mlp.experts": '
     "experts_colwise_rowwise", 5, 3, "expert TP inside EP (the experts split over tp too) is "
     "not supported"),
])
def test_expert_parallel_mistakes_are_located(configs, tmp_path, capsys, mesh, rule, line, col,
                                              says):
    world = 8 if "ep: 8" in mesh else 4
    plan = _plan(tmp_path, "bad", configs["qwen3_moe"], mesh, rule)
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", str(world))
    assert rc == 1 and "Traceback" not in out, out
    assert f"bad.yaml:{line}:{col}: error: " in out and says in out, out


def _ranks(group: str) -> list[int]:
    """The global ranks of the process group named ``group``."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    return dist.get_process_group_ranks(_resolve_process_group(group))


def _a2a_worker(rank: int, world: int, port: int, jobs: list) -> None:
    """:func:`_a2a_run` for each ``(plan, overrides, out)`` of ``jobs``, in one process group."""
    import torch

    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    for plan_path, overrides, out in jobs:
        _a2a_run(rank, world, plan_path, overrides, out)
    torch.distributed.destroy_process_group()


def _a2a_run(rank: int, world: int, plan_path: str, overrides: list, out: str) -> None:
    """One forward and backward of the plan under a collective recorder, then an AdamW
    step; each rank saves its all-to-alls on the ep group as (count, bytes), its experts'
    FSDP traffic, its experts' parameter, gradient and AdamW bytes, and, in a second forward
    whose router picks experts 0..k-1 for every token (all on the first ep rank, or as many
    as it holds; Llama 4's router is left alone: its experts take every token), the rows
    each of its dispatches received."""
    import torch
    import tpplan._torch.collectives as fc  # the door the experts' all-to-all goes through

    import tpplan
    from tpplan.analysis.comm.counting import CollectiveRecorder
    from tpplan.analysis.verify.numerics import make_batch
    from tpplan.models import build_model
    from tpplan.parallel.mesh import dp_rank

    plan = tpplan.load(plan_path, overrides)
    shape = plan.step_shape(world)
    torch.manual_seed(0)
    model = build_model(plan.model, device="cpu")
    mesh = plan.build_mesh("cpu")
    model = plan.apply(model, mesh)
    tokens = make_batch(128, shape.global_batch, shape.seq_len, 0).chunk(
        plan.parallel_dims(world).dp)[dp_rank(mesh)]

    def loss():
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    with CollectiveRecorder() as rec, plan.loss_context():  # vocabulary-sharded logits under tp
        loss().backward()
    a2a = [c for c in rec.collectives if c.kind == "all_to_all"]
    experts = [p for n, p in model.named_parameters() if ".experts." in n]
    spmd = experts[0].device_mesh  # FSDP2's (efsdp, ep): dp_shard's ranks may be efsdp's too
    group = spmd.get_group(spmd.mesh_dim_names.index("efsdp")).group_name
    efsdp = [(c.kind, c.bytes) for c in rec.collectives if c.kind != "all_to_all" and
             c.group == group]
    optimizer = torch.optim.AdamW(experts)
    optimizer.step()

    def nbytes(ts):  # the local shards' own bytes (FSDP2's gradients view one flat buffer)
        return sum(t.to_local().numel() * t.element_size() for t in ts)

    memory = [nbytes(experts), nbytes(p.grad for p in experts),
              nbytes(v for p in experts for k, v in optimizer.state[p].items() if k != "step")]
    for m in model.modules():  # every token picks experts 0..k-1
        if type(m).__name__.endswith("TopKRouter"):
            def pick(mod, args, out):
                logits, weights, ids = out
                return logits, weights, torch.arange(ids.shape[-1]).expand_as(ids).contiguous()
            m.register_forward_hook(pick)
    received, real = [], fc.all_to_all_single_autograd

    def recording(x, output_split_sizes, input_split_sizes, group):
        y = real(x, output_split_sizes, input_split_sizes, group)
        received.append(y.numel() * y.element_size())
        return y

    fc.all_to_all_single_autograd = recording
    with torch.no_grad(), plan.loss_context():
        loss()
    fc.all_to_all_single_autograd = real
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(
        [len(a2a), sum(c.bytes for c in a2a), len({c.group for c in a2a}), efsdp, memory,
         received[::2]]))  # dispatch, combine, dispatch, ...: the dispatches


def test_dry_run_all_to_all_is_what_a_real_run_issues(configs, tmp_path, capsys):
    """Counts per rank equal; bytes summed over the ranks equal too (each rank's dispatch
    sends its tokens × top-k rows whatever the routing, and what one rank receives another
    sent), while the dry run assumes balanced routing for each rank's own figure. The
    experts' FSDP traffic over efsdp, their parameters, gradients and AdamW state: per rank.
    The worst case: with every token routed to experts 0..k-1, the busiest rank's step
    (its dispatches as received, each data all-to-all's buffer that size: the combine sends
    back what arrived, backward transposes both) is the dry run's bound, exactly. Llama 4's
    experts take every token for every expert (the dense form): no counts exchanged, every
    rank sends its whole ``[E·T, H]`` input in each data all-to-all, the dry run's figure on
    every rank (and its worst case). Under tp 2 + SP with the MoE blocks on the sequence
    shard (ep 2 borrowing tp's ranks) each rank routes its shard: half the rows of the
    gathered form's, counted as issued."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run

    cases = []
    for family, mesh, rule in (
            ("qwen3_moe", "{ep: 2, dp_shard: 4}", RULE),
            ("mixtral", "{ep: 4}", RULE),
            ("llama4_text", "{ep: 4}", RULE.replace("mlp", "feed_forward")),  # no counts
            ("qwen3_moe", None, None)):  # tp 2 + SP, the MoE blocks on the sequence shard
        plan = _plan(tmp_path, f"{family}-a2a", configs[family], mesh, rule) if mesh else \
            _sp_plan(capsys, tmp_path, family, configs[family])
        batch = 8 if mesh else 4  # one micro-batch of 2 sequences per data-parallel rank
        overrides = ["train.seq_len=16", f"train.global_batch_size={batch}",
                     "train.micro_batch_size=2"]
        # efsdp 2 at ep 2 over dp_shard 4 and over tp 2 × dp_shard 2, 1 (no experts' FSDP
        # traffic) at ep 4
        cases.append((plan, overrides, tmp_path / f"{family}-{bool(mesh)}",
                      family == "qwen3_moe"))
    # the tp 2 + SP plan in a spawn of its own: its efsdp group has dp_shard's ranks, told
    # apart by the process group FSDP2 was given, which a first plan's meshes would shadow
    results = all_to_all_as_predicted(cases[:3]) + all_to_all_as_predicted(cases[3:])
    assert [ep["dense_modules"] for _, ep in results] == [0, 0, 2, 0]
    (plan, overrides, *_), (predicted, ep) = cases[-1], results[-1]
    comm = [a for a in ANALYSES if a[0] == "comm_per_step"]
    gathered = dry_run(_sp_plan(capsys, tmp_path, "qwen3_moe", configs["qwen3_moe"],
                                gathered=True), 4, overrides, comm)
    gathered = gathered.extra["comm_per_step"]["ep_all_to_all"]
    counts = _counts_bytes(predicted.model)  # a rank routes its shard: half the rows
    assert 2 * (ep["balanced_bytes"] - counts) == gathered["balanced_bytes"] - counts, \
        (ep, gathered)


def _counts_bytes(model) -> int:
    """The bytes of the counts exchanged before each routed dispatch, one per expert."""
    from tpplan.analysis.comm.experts import COUNT_BYTES
    from tpplan.parallel.experts.forms import call_form
    from tpplan.parallel.experts.style import expert_count

    return sum(COUNT_BYTES * m.num_experts for m in model.modules()
               if expert_count(m) and call_form(m) != "dense")


def all_to_all_as_predicted(cases: list) -> list:
    """The dry run's experts' all-to-all, memory and efsdp traffic against a real gloo run's
    on 4 ranks (:func:`_a2a_worker`, one spawn for every case; the docstring above says what
    is held equal), for each ``(plan, overrides, out, efsdp)`` of ``cases`` (``efsdp``:
    whether the experts have FSDP units of their own, efsdp > 1). Returns each case's dry
    run and its all-to-all figures."""
    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.analysis.comm.experts import ep_figures
    from tpplan.parallel.experts.forms import call_form
    from tpplan.parallel.experts.style import expert_count
    from tpplan.parallel.runtime import spawn

    comm = [a for a in ANALYSES if a[0] == "comm_per_step"]
    checked = []
    for plan, overrides, out, _ in cases:
        predicted = dry_run(plan, 4, overrides, comm)
        assert predicted.ok, (predicted.errors, predicted.analysis_errors)
        ep = predicted.extra["comm_per_step"]["ep_all_to_all"]
        forms = [call_form(m) for m in predicted.model.modules() if expert_count(m)]
        # per routed block: counts, dispatch, combine; 2 in backward (the dense form: no counts)
        assert ep["count"] == sum(4 if f == "dense" else 5 for f in forms)
        traced = [r for r in predicted.extra["comm_per_step"]["collectives"]
                  if r["mesh_dim"] == "ep"]  # the arithmetic is the trace, row for row
        assert (ep["count"], ep["balanced_bytes"], ep["balanced_wire_bytes"]) == (
            sum(r["count"] for r in traced), sum(r["bytes"] for r in traced),
            sum(r["wire_bytes"] for r in traced))
        figures = ep_figures(predicted.model, predicted.resolved, predicted.resolved.dims,
                             predicted.step, 4)
        assert figures["all_to_all"] == ep
        out.mkdir()
        checked.append((predicted, ep, figures))
    spawn(_a2a_worker, 4, [(plan, overrides, str(out)) for plan, overrides, out, _ in cases])
    for (plan, _, out, efsdp), (predicted, ep, figures) in zip(cases, checked):
        real = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
        assert all(count == ep["count"] and groups == 1 for count, _, groups, *_ in real), real
        assert sum(r[1] for r in real) == 4 * ep["balanced_bytes"], (real, ep)
        if ep["dense_modules"]:  # equal splits of every row: each rank's bytes are the figure
            assert [r[1] for r in real] == [ep["balanced_bytes"]] * 4, (real, ep)
        mem = figures["memory"]
        for *_, memory, _ in real:
            assert memory == [mem["parameters"], mem["gradients"], mem["optimizer"]], (memory, mem)
        busiest = max(real, key=lambda r: sum(r[-1]))[-1]
        assert _counts_bytes(predicted.model) + 4 * sum(busiest) == ep["worst_case_bytes"], \
            (busiest, ep)
        # the experts' own FSDP units: over the efsdp ranks, at their ep-local sizes
        rows = predicted.extra["comm_per_step"]["collectives"]
        want = {(r["kind"], r["count"], r["bytes"]) for r in rows if r["mesh_dim"] == "efsdp"}
        assert bool(want) == efsdp, (plan, want)
        for _, _, _, efsdp_rows, *_ in real:
            got = Counter(k for k, _ in efsdp_rows)
            nbytes = Counter()
            for k, b in efsdp_rows:
                nbytes[k] += b
            assert {(k, got[k], nbytes[k]) for k in got} == want, (plan, efsdp_rows, want)
    return [(predicted, ep) for predicted, ep, _ in checked]


def test_a_run_on_ep_4_resumes_on_pp_2_ep_2_then_ep_1_along_one_curve(tmp_path):
    """The shipped tiny EP plan trains; its checkpoints hold the whole model's experts under
    their own names, so it resumes on another ep and pp (ep 4 -> pp 2 × ep 2 -> ep 1) along
    the curve of one process run straight through."""
    from trainrun import assert_same_curve, metrics, ok, tpplan_train

    from tpplan.checkpoint import latest, read_model_state

    plan = str(ROOT / "plans" / "qwen3-moe-ep-tiny.yaml")
    sets = ["train.steps=3", "checkpoint.interval=1", "data.max_bytes=50000",
            "train.global_batch_size=4"]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    ok(tpplan_train(whole, plan=plan, sets=[*sets, "mesh.ep=1"]))
    ok(tpplan_train(parts, nproc=4, plan=plan, sets=[*sets, "train.steps=1"]))
    ok(tpplan_train(parts, "--resume", "latest", nproc=4, plan=plan,  # ep 2 under pp 2
                    sets=[*sets, "train.steps=2", "mesh.ep=2", "mesh.pp=2",
                          "pipeline={microbatches: 2}"]))
    ok(tpplan_train(parts, "--resume", "latest", nproc=2, plan=plan, sets=[*sets, "mesh.ep=1"]))
    assert_same_curve(metrics(parts), metrics(whole), (1, 2, 3))  # loss and gradient norm
    state = read_model_state(latest(parts / "checkpoints"))
    assert tuple(state["model.layers.0.mlp.experts.gate_up_proj"].shape) == (8, 128, 64)


def test_expert_ids_out_of_range_refused_and_every_local_expert_has_a_gradient():
    """The range check rides on the dispatch's bincount: ids above and below the range are
    named, never dropped. The local experts' one autograd node scales their gradient by 1/ep
    (against plain autograd on the same parameters) and gives an expert the forward did not
    use a zero gradient; with no row at all, the tie does."""
    import torch

    from tpplan.parallel.experts.forms import tie_experts, using_local_experts
    from tpplan.parallel.experts.style import dispatch_counts

    ids = torch.tensor([[0, 3], [3, 1]])
    assert dispatch_counts(ids, 4).tolist() == [1, 1, 0, 2]
    for bad in (4, 9, -1):
        with pytest.raises(ValueError, match=f"chose expert {bad}, outside \\[0, 4\\)"):
            dispatch_counts(torch.tensor([[0, bad], [2, 1]]), 4)

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.register_parameter("w", torch.nn.Parameter(torch.randn(2, 3, 3)))
    module.register_parameter("b", torch.nn.Parameter(torch.randn(2, 3)))
    module.register_parameter("frozen", torch.nn.Parameter(torch.randn(2, 3), requires_grad=False))
    module._tpplan_ep_params = ("w", "b", "frozen")
    x = torch.randn(5, 3)
    ref = torch.nn.Parameter(module.w.detach().clone())
    (x @ ref[1]).square().sum().backward()
    for rows in (x, x[:0]):
        with using_local_experts(module, module._tpplan_ep_params, ep=4):
            assert not module._parameters["frozen"].requires_grad
            out = tie_experts(module, rows @ module._parameters["w"][1])  # "b" unused
        out.square().sum().backward()
        want = ref.grad / 4 if len(rows) else torch.zeros_like(ref)
        assert torch.allclose(module.w.grad, want) and module.b.grad is not None
        assert not module.b.grad.any() and module.frozen.grad is None
        module.zero_grad(set_to_none=True)
