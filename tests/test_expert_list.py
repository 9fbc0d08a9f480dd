"""``expert_parallel`` on a list of per-expert modules (docs/moe.md, "A list of experts"): a
user's MoE (tests/moe_models.py: ``ExpertList`` of SwiGLU experts, ``experts.5.w1.weight``)
matches one device on 4 gloo processes -- logits, loss and every gradient, the routers' and
every expert's -- at two configs (4 experts top-2, 8 experts top-3) on ep 2 with the experts
FSDP-sharded over the 2 ranks left, ep 4, ep 2 under HSDP, ep 4 under activation
checkpointing, ep 2 beside tp 2, ``suggest --ep 2``'s plan (tp 2 + SP, ep 2) and ep 2 under
pipeline stages (pp 2; one spawn). A second spawn: at ep 4 each rank holds only its experts,
the gradient norm is one device's, the dry run's all-to-all count and bytes and expert memory
are what the real step issues and holds (at ep 2 × efsdp 2 too, with the experts' FSDP
traffic), and a DCP checkpoint saved at ep 4 (per-expert names of the whole model) loads at
ep 2 and ep 1 with equal state, and into a plain model in one process. ``tpplan train``
resumes ep 4 -> ep 2 -> ep 1 on one curve. The loop form (the block calls each expert of a
plain ``nn.ModuleList``) and other misfits are located errors."""

import json
from pathlib import Path

import pytest
from helpers import run_main
from test_expert_parallel import _ranks, match_one_device

FSDP = 'fsdp: {units: ["layers.*"]}'
RULE = '"layers.*.mlp.experts": expert_parallel'
# beside tp 2: attention split over tp, the experts whole on every tp rank
TP_RULES = ('tensor_parallel:\n  "layers.*.attn.{q_proj,k_proj,v_proj}": colwise\n'
            f'  "layers.*.attn.c_proj": rowwise\n  {RULE}\n')
CONFIGS = {"e4k2": "{num_experts: 4, top_k: 2}", "e8k3": "{num_experts: 8, top_k: 3}"}


def _plan(folder: Path, name: str, mesh: str, config: str = CONFIGS["e4k2"],
          factory: str = "moe_gpt", extra: str = FSDP, rules: str = f"tensor_parallel:\n  {RULE}\n") -> str:
    path = folder / f"{name}.yaml"
    path.write_text(f"mesh: {mesh}\nmodel: {{factory: 'moe_models:{factory}', kwargs: {config}}}\n"
                    f"{rules}{extra}\n")
    return str(path)


def _suggested(capsys, folder: Path) -> str:
    """``suggest --ep 2``: tp 2 with sequence parallelism, expert_parallel on the lists and no
    rule inside them."""
    model = folder / "model.yaml"
    model.write_text(f"model: {{factory: 'moe_models:moe_gpt', kwargs: {CONFIGS['e8k3']}}}\n")
    rc, out = run_main(capsys, "suggest", model, "--ep", "2", "-o", folder / "suggested.yaml")
    assert rc == 0, out
    text = (folder / "suggested.yaml").read_text()
    assert "mesh: {tp: 2, ep: 2, dp_shard: -1}" in text and f"  {RULE}\n" in text, text
    assert "sequence_parallel" in text and "mlp.experts.*" not in text, text
    return str(folder / "suggested.yaml")


def test_expert_list_matches_one_device(tmp_path, capsys):
    ac = FSDP + '\nactivation_checkpointing: {mode: full, blocks: "layers.*"}'
    plans = [_plan(tmp_path, "e4k2-ep2-efsdp2", "{ep: 2, dp_shard: 4}"),
             _plan(tmp_path, "e4k2-ep4", "{ep: 4}"),
             _plan(tmp_path, "e8k3-ep4-ac", "{ep: 4}", CONFIGS["e8k3"], extra=ac),
             _plan(tmp_path, "e8k3-ep2-hsdp", "{ep: 2, dp_shard: 2, dp_replicate: 2}",
                   CONFIGS["e8k3"]),
             _plan(tmp_path, "e4k2-tp2-ep2", "{tp: 2, ep: 2, dp_shard: -1}", rules=TP_RULES,
                   extra=FSDP + '\ndivide_by_tp: ["layers.*.attn.n_head"]'),
             _suggested(capsys, tmp_path),  # e8k3 at tp 2 + SP, ep 2
             _plan(tmp_path, "e8k3-pp2-ep2", "{pp: 2, ep: 2, dp_shard: -1}",
                   "{num_experts: 8, top_k: 3, n_layer: 4}", extra=FSDP + "\npipeline: {microbatches: 2}")]
    for path, step, ref, par in match_one_device(plans):
        experts, layers = (step.plan.spec.model.kwargs.get(k, 2) for k in ("num_experts", "n_layer"))
        names = [f"layers.{i}.mlp.experts.{e}.{w}.weight" for i in range(layers)
                 for e in range(experts) for w in ("w1", "w2", "w3")]
        assert set(names) <= set(ref.grads), path  # every expert of every block compared
        assert all(par.grads[n].abs().sum() > 0 for n in names[::3]), path


def _worker(rank: int, world: int, port: int, plans: dict, out: str) -> None:
    """ep 4: one step under a collective recorder, then AdamW; this rank's expert names and
    bytes, its all-to-alls; a checkpoint of model and optimizer. Then ep 2 and ep 1 load it;
    each rank's full tensors of what it holds (the model, and the optimizer's moments)."""
    import torch

    import tpplan
    from tpplan import checkpoint as ckpt
    from tpplan.analysis.comm.counting import CollectiveRecorder
    from tpplan.analysis.verify.numerics import make_batch
    from tpplan.models import build_model
    from tpplan.parallel.experts.module_list import expert_list_groups
    from tpplan.parallel.runtime import as_spawned_rank
    from tpplan.train.optim import clip_grad_norm

    as_spawned_rank(rank, world, port)
    out = Path(out)
    report = {}

    def build(name: str):
        plan = tpplan.load(plans[name])
        torch.manual_seed(0)
        model = plan.apply(build_model(plan.model, device="cpu"), plan.build_mesh("cpu"))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    def step(name: str, model) -> None:  # recorded: the experts' all-to-all and FSDP traffic
        with CollectiveRecorder() as rec:
            logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                              tokens[:, 1:].flatten()).backward()
        experts = [(n, p) for n, p in model.named_parameters() if ".experts." in n]
        efsdp = list(range(rank % ep[name], world, ep[name]))  # this rank's efsdp group
        report[name] = {
            "names": [n for n, _ in experts],
            "all_to_all": [c.bytes for c in rec.collectives if c.kind == "all_to_all"],
            "efsdp": [(c.kind, c.bytes) for c in rec.collectives if c.kind != "all_to_all"
                      and len(efsdp) > 1 and _ranks(c.group) == efsdp],
            "bytes": sum(p.to_local().numel() * p.element_size() for _, p in experts),
            "norm": clip_grad_norm(model.parameters(), None, None, expert_list_groups([model]))}

    ep = {"ep4": 4, "ep2": 2}
    tokens = make_batch(128, 8, 16, 0).chunk(world)[rank]
    model, optimizer = build("ep4")
    step("ep4", model)
    optimizer.step()
    ckpt.save(out / "ckpt", 1, model, optimizer, {"step": 1}, keep=1)
    for name in ("ep4", "ep2", "ep1"):
        if name != "ep4":
            model, optimizer = build(name)
            ckpt.load(ckpt.latest(out / "ckpt"), model, optimizer)
        state = {n: full(p.detach()) for n, p in model.named_parameters()}
        state.update({f"{n}.exp_avg": full(optimizer.state[p]["exp_avg"])
                      for n, p in model.named_parameters()})
        torch.save(state, out / f"{name}-rank{rank}.pt")
        if name == "ep2":  # ep 2 × efsdp 2: each expert's parameters FSDP-sharded on their own
            step(name, model)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    torch.distributed.destroy_process_group()


def test_expert_list_held_per_rank_counted_by_the_dry_run_and_resharded_by_checkpoints(tmp_path):
    import torch

    from tpplan.analysis import ANALYSES
    from tpplan.analysis.dryrun import dry_run
    from tpplan.analysis.verify.numerics import make_batch
    from tpplan.checkpoint import latest, read_model_state
    from tpplan.models import build_model
    from tpplan.parallel.runtime import spawn
    import tpplan

    config = CONFIGS["e8k3"]
    plans = {"ep4": _plan(tmp_path, "ep4", "{ep: 4}", config),
             "ep2": _plan(tmp_path, "ep2", "{ep: 2, dp_shard: 4}", config),
             "ep1": _plan(tmp_path, "ep1", "{dp_shard: 4}", config, rules="")}
    spawn(_worker, 4, plans, str(tmp_path))
    runs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name, ep in (("ep4", 4), ("ep2", 2)):
        reports = [run[name] for run in runs]
        for rank, r in enumerate(reports):  # its E/ep experts of each block, nothing else
            mine = range(rank % ep * 8 // ep, (rank % ep + 1) * 8 // ep)
            assert r["names"] == [f"layers.{i}.mlp.experts.{e}.{w}.weight" for i in range(2)
                                  for e in mine for w in ("w1", "w2", "w3")]
        predicted = dry_run(plans[name], 4, ["train.seq_len=16", "train.global_batch_size=8",
                                             "train.micro_batch_size=2"],
                            [a for a in ANALYSES if a[0] in ("comm_per_step", "memory_per_rank")])
        assert predicted.ok, (predicted.errors, predicted.analysis_errors)
        a2a = predicted.extra["comm_per_step"]["ep_all_to_all"]
        assert all(len(r["all_to_all"]) == a2a["count"] == 2 * 5 for r in reports)
        # each rank sends its own T·k rows whatever the routing: summed over ranks, as balanced
        assert sum(sum(r["all_to_all"]) for r in reports) == 4 * a2a["balanced_bytes"]
        mem = predicted.extra["memory_per_rank"]["experts"]
        assert all(r["bytes"] == mem["parameters"] for r in reports), (reports, mem)
        rows = predicted.extra["comm_per_step"]["collectives"]  # the experts' FSDP units
        want = sorted((r["kind"], r["count"], r["bytes"]) for r in rows if r["mesh_dim"] == "efsdp")
        assert bool(want) == (ep == 2)  # efsdp 2 at ep 2, nothing at ep 4
        for r in reports:
            got = {(k, sum(1 for k2, _ in r["efsdp"] if k2 == k),
                    sum(b for k2, b in r["efsdp"] if k2 == k)) for k, _ in r["efsdp"]}
            assert sorted(got) == want, (name, r["efsdp"], want)

    torch.manual_seed(0)  # the gradient norm (the trainer's clipping) is one device's
    plain = build_model(tpplan.load(plans["ep1"]).model, device="cpu")
    tokens = make_batch(128, 8, 16, 0)
    torch.nn.functional.cross_entropy(plain(tokens[:, :-1]).flatten(0, 1),
                                      tokens[:, 1:].flatten()).backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()
    assert all(abs(run["ep4"]["norm"] - norm) <= 1e-5 * norm for run in runs), (norm, runs)

    saved = read_model_state(latest(tmp_path / "ckpt"))
    plain.load_state_dict(saved)  # strict: the checkpoint holds the whole model's names
    assert sum(".experts." in n for n in saved) == 2 * 8 * 3
    unions = {}
    for name in ("ep4", "ep2", "ep1"):
        union = unions[name] = {}
        for rank in range(4):  # what each rank holds, whole; ranks holding a tensor agree
            for k, v in torch.load(tmp_path / f"{name}-rank{rank}.pt").items():
                assert k not in union or torch.equal(union[k], v), (name, k)
                union[k] = v
        params = {k: v for k, v in union.items() if not k.endswith(".exp_avg")}
        assert params.keys() == saved.keys(), name
        assert all(torch.equal(params[k], saved[k]) for k in saved), name
        assert union.keys() == unions["ep4"].keys(), name  # the moments too, resharded
        assert all(torch.equal(union[k], unions["ep4"][k]) for k in union), name


@pytest.mark.parametrize("factory, config, mesh, says", [
    ("loop_moe_gpt", CONFIGS["e4k2"], "{ep: 2, dp_shard: -1}",
     "is a list of expert modules without a forward of its own: its parent (LoopMoE) calls "
     "each expert itself (at "),
    ("mixed_moe_gpt", CONFIGS["e4k2"], "{ep: 2, dp_shard: -1}",
     "is not a list of identical experts (4 modules: SwiGLU)"),
    ("moe_gpt", "{num_experts: 6, top_k: 2}", "{ep: 4, dp_shard: -1}",
     "holds 6 experts and mesh ep=4 does not divide them"),
    ("moe_gpt", CONFIGS["e4k2"], "{tp: 2, ep: 2, dp_shard: -1}",  # at line 5: the inner rule
     "module 'layers.0.mlp.experts.0.w1' is inside 'layers.0.mlp.experts', a list of experts "
     "that expert_parallel spreads over ep: expert TP inside EP"),
])
def test_expert_list_misfits_are_located(tmp_path, capsys, factory, config, mesh, says):
    inner = "tp: 2" in mesh
    plan = _plan(tmp_path, "bad", mesh, config, factory, rules=f"tensor_parallel:\n  {RULE}\n"
                 + ('  "layers.*.mlp.experts.*.w1": colwise\n' if inner else ""))
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4")
    assert rc == 1 and "Traceback" not in out, out
    assert f"bad.yaml:{5 if inner else 4}:3: error: " in out and says in out, out


def test_a_run_with_an_expert_list_resumes_on_another_ep_along_one_curve(tmp_path):
    """``tpplan train`` on the list: ep 4 -> ep 2 -> ep 1 (resumed from each other's
    checkpoints) along the curve of one process run straight through, loss and gradient
    norm (clipped at 1.0: the norm decides the update) at every step."""
    from helpers import ROOT, tpplan_cli
    from trainrun import QUICK_START, metrics, ok

    plan = _plan(tmp_path, "train", "{ep: 4, dp_shard: -1}",  # byte tokens: vocabulary 256
                 "{num_experts: 8, top_k: 3, vocab_size: 256}", extra=FSDP + (
        "\ntrain: {steps: 3, seq_len: 32, global_batch_size: 4, lr: 3.0e-3, warmup_steps: 2, "
        "grad_clip: 1.0}\ndata: {max_bytes: 50000}\ncheckpoint: {interval: 1}"))

    def train(run, nproc: int, steps: int, ep: int, *extra: str):
        ok(tpplan_cli("train", "--plan", plan, "--nproc", nproc, "--set", f"mesh.ep={ep}",
                      "--set", f"train.steps={steps}", "--set", f"metrics.run_dir={run}",
                      *[a for s in QUICK_START for a in ("--set", s)], *extra,
                      env={"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}))  # moe_models

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    train(whole, 1, 3, 1)
    train(parts, 4, 1, 4)
    train(parts, 4, 2, 2, "--resume", "latest")
    train(parts, 2, 3, 1, "--resume", "latest")
    a, b = metrics(whole), metrics(parts)
    for step in (1, 2, 3):
        for key in ("loss", "grad_norm"):
            assert abs(a[step][key] - b[step][key]) <= 1e-4 * a[step][key], (step, key, a, b)
