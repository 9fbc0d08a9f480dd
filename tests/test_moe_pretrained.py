"""Pretrained mixtures of experts (docs/moe.md, "Fine-tuning a pretrained MoE"): HF folders
with experts per expert (``experts.N.gate_proj.weight``, as ``save_pretrained`` and the Hub
hold them; Mixtral's ``block_sparse_moe.experts.N.w1``) or fused (``experts.gate_up_proj``)
load into ep, expert-FSDP and expert-TP meshes with transformers' logits, each rank reading
only the slices of the experts it holds; a fine-tune on 4 ranks with ep follows one process
step by step; its HF export is in the layout loaded and gives tpplan's logits in transformers.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import tpplan_cli
from trainrun import QUICK_START, metrics, ok

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

EP_PLAN = """\
mesh: {mesh}
model: {{pretrained: {folder}}}
tensor_parallel:
  {rules}
fsdp: {{units: [model.embed_tokens, "model.layers.*", [model.norm, lm_head]]}}
"""
EP_RULE = '"model.layers.*.mlp.experts": expert_parallel'
# expert TP without ep: every rank holds a slice of every expert's rows (packed parameters)
ETP_RULE = '"model.layers.*.mlp.experts": experts_colwise_rowwise'
CHAT = Path(__file__).resolve().parents[1] / "plans" / "qwen3-moe-chat.yaml"


@pytest.fixture(scope="module")
def fused_qwen3_moe(tiny_hf, tmp_path_factory) -> Path:
    """The tiny Qwen3-MoE's weights with the experts fused, [experts, ...] under the model's
    own names (transformers loads both layouts)."""
    from safetensors.torch import save_file

    per_expert = tiny_hf("qwen3_moe")
    out = tmp_path_factory.mktemp("fused")
    model = transformers.AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text((per_expert / "config.json").read_text())
    return out


def _reads_worker(rank: int, world: int, port: int, cases: list, tokens, out: str) -> None:
    """Each case: the model built on meta, parallelized, pretrained weights read while
    every slice read is counted by checkpoint name; logits of ``tokens`` saved per dp rank."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import DTensor

    import tpplan
    from tpplan.models import build_model, materialize
    from tpplan.parallel.mesh import dp_rank
    from tpplan.parallel.runtime import as_spawned_rank
    from tpplan.train.pretrained import check, load

    as_spawned_rank(rank, world, port)
    reads: Counter = Counter()
    original = HuggingFaceStorageReader._process_read_request

    def counted(self, f, req, planner):
        reads[req.storage_index.fqn] += torch.Size(req.lengths).numel()
        return original(self, f, req, planner)

    HuggingFaceStorageReader._process_read_request = counted
    try:
        for name, plan_path in cases:
            reads.clear()
            plan = tpplan.load(plan_path)
            model = build_model(plan.require_model(), device="meta", real_buffers=True)
            source = check(plan.model, model)
            mesh = plan.build_mesh("cpu")
            model = plan.apply(model, mesh)
            materialize(model, "cpu")
            load(source, model)
            with torch.no_grad(), plan.loss_context():
                logits = model.eval()(tokens.chunk(plan.parallel_dims(world).dp)[dp_rank(mesh)])
            logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
            torch.save({"reads": dict(reads), "logits": logits, "dp": dp_rank(mesh),
                        "tp": mesh["tp"].get_local_rank()}, Path(out) / f"{name}-{rank}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _sizes(folder: Path) -> dict[str, int]:
    from tpplan.checkpoint.hf_weights import read_index

    return {n: torch.Size(i.shape).numel() for n, i in read_index(folder)[0].items()}


def test_moe_folders_load_into_ep_meshes_each_rank_reading_its_own_experts(
        tiny_hf, fused_qwen3_moe, tmp_path, capsys):
    from test_expert_parallel import _sp_plan

    from tpplan.parallel.runtime import spawn

    qwen, mixtral = tiny_hf("qwen3_moe"), tiny_hf("mixtral")
    cases = {  # name: (folder, mesh, rule, experts of a layer each rank reads from)
        "qwen-ep4": (qwen, "{ep: 4, dp_shard: -1}", EP_RULE, 2),
        # import-hf's tp 2 + SP plan with ep 2: the MoE blocks on the sequence shard, ep
        # borrowing tp's ranks, the experts FSDP-sharded over dp_shard 2 (one copy)
        "qwen-tp2-ep2": (qwen, None, None, 2),
        # the same with the sequence gathered: the experts whole on each tp rank (read twice)
        "qwen-tp2-ep2-gathered": (qwen, None, None, 4),
        "qwen-ep2-efsdp2": (qwen, "{ep: 2, dp_shard: 4}", EP_RULE, 2),
        # expert TP: half of each expert's rows on each tp rank, half the experts on each
        # dp rank (FSDP)
        "qwen-etp2": (qwen, "{tp: 2, dp_shard: -1}", ETP_RULE, 4),
        "fused-ep2-efsdp2": (fused_qwen3_moe, "{ep: 2, dp_shard: 4}", EP_RULE, None),
        "mixtral-ep4": (mixtral, "{ep: 4, dp_shard: -1}", EP_RULE, 2),
    }
    jobs = []
    for name, (folder, mesh, rule, _) in cases.items():
        path = tmp_path / f"{name}.yaml"
        sp = mesh or _sp_plan(capsys, tmp_path, "qwen3_moe", folder / "config.json",
                              gathered="gathered" in name)
        path.write_text(EP_PLAN.format(mesh=mesh, folder=folder, rules=rule) if mesh else
                        f"extends: {sp}\nmodel: {{hf_config: null, pretrained: {folder}}}\n")
        jobs.append((name, str(path)))
    tokens = torch.randint(0, 512, (4, 16), generator=torch.Generator().manual_seed(0))
    spawn(_reads_worker, 4, jobs, tokens, str(tmp_path))
    for name, (folder, _, _, held) in cases.items():
        ranks = [torch.load(tmp_path / f"{name}-{r}.pt") for r in range(4)]
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            want = theirs.eval()(tokens).logits
        got = torch.cat([r["logits"] for r in sorted(ranks, key=lambda r: r["dp"])
                         if r["tp"] == 0])
        assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5, name
        sizes = _sizes(folder)
        experts = {n for n in sizes if ".experts." in n}
        per_expert = folder != fused_qwen3_moe
        assert len(experts) == (2 * 8 * 3 if per_expert else 2 * 2), name
        # every element of every expert tensor read by exactly the ranks holding it (one;
        # the two tp ranks beside ep), a quarter of them on each (a half beside tp): no rank
        # reads a full copy, nor what it does not hold
        copies = 2 if "gathered" in name else 1
        total = sum(sizes[n] for n in experts)
        for n in experts:
            assert sum(r["reads"].get(n, 0) for r in ranks) == copies * sizes[n], (name, n)
        for r in ranks:
            mine = sum(v for n, v in r["reads"].items() if n in experts)
            assert mine == copies * total // 4, name
            if held is not None:
                ids = {n.split(".experts.")[1].split(".")[0] for n in r["reads"] if n in experts}
                assert len(ids) == held, (name, ids)


def _train(run_dir: Path, folder: Path, nproc: int, *sets: str):
    args = ["train", "--plan", CHAT, "--nproc", nproc]
    for s in [f"model.pretrained={folder}", f"data.tokenizer={folder}",
              f"data.path={folder / 'chat.jsonl'}", "eval=null", "train.steps=3",
              "train.global_batch_size=4", "train.seq_len=32", f"metrics.run_dir={run_dir}",
              # the model's own loss, its load-balancing term included (per micro-batch:
              # the same sequences in each forward on every mesh)
              "model.config.output_router_logits=true", "train.micro_batch_size=1",
              *QUICK_START, *sets]:
        args += ["--set", s]
    return tpplan_cli(*args, timeout=240)


def test_moe_finetune_with_ep_follows_one_process_and_exports_in_the_layout_loaded(
        tiny_hf, fused_qwen3_moe, tmp_path):
    from safetensors import safe_open

    folder = tiny_hf("qwen3_moe")
    one, ep4, ep2 = tmp_path / "one", tmp_path / "ep4", tmp_path / "ep2"
    ok(_train(one, folder, 1, "mesh.ep=1"))
    run = _train(ep4, folder, 4)
    ok(run)
    assert "experts one tensor each)" in run.stdout + run.stderr
    ok(_train(ep2, folder, 4, "mesh.ep=2"))  # the experts FSDP-sharded over 2 ranks too
    a = metrics(one)
    for other in (ep4, ep2):
        b = metrics(other)
        for step in (1, 2, 3):
            assert b[step]["loss"] == pytest.approx(a[step]["loss"], rel=1e-5), (other, step)
            assert b[step]["grad_norm"] == pytest.approx(a[step]["grad_norm"], rel=1e-4)
    assert a[3]["loss"] < a[1]["loss"]

    from test_export_hf import logits, reloaded  # the same reload, the same comparison

    ours = reloaded(ep4)
    tokens = torch.randint(0, 512, (2, 16))
    for layout, source in (("per-expert", folder), ("fused", fused_qwen3_moe)):
        plan = tmp_path / f"{layout}.yaml"  # the run's plan, loaded from this folder
        plan.write_text((ep4 / "plan.yaml").read_text().replace(str(folder), str(source)))
        out = tmp_path / layout
        tpplan_cli("export", "--format", "hf", "--checkpoint", ep4, "--plan", plan, "-o", out,
                   "--tokenizer", folder, check=True)
        with safe_open(out / "model.safetensors", "pt") as f:
            names = set(f.keys())
        assert names == set(_sizes(source)), layout
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        torch.testing.assert_close(logits(hf, tokens), logits(ours, tokens), rtol=1e-5,
                                   atol=1e-5)
        assert hf.config.num_experts == 8


def test_aux_loss_under_ep_matches_one_device_router_gradient_included(tmp_path, capsys):
    """Configs that set ``output_router_logits``: the loss is the model's own (cross-entropy
    + router_aux_loss_coef × the load-balancing loss of each forward's batch), and with ep 4,
    ep 2 over expert FSDP 2, tp 2 + SP with the MoE blocks on the sequence shard (ep 2
    borrowing tp: the routers' logits gathered over tp for the term) and with the sequence
    gathered before them (ep 2 beside tp) its value and every gradient -- the router's,
    which the aux loss pulls on directly -- equal one device's."""
    from test_expert_parallel import _plan, _sp_plan, match_one_device, sweep_hf

    plans = []
    for family, fields in (("qwen3_moe", {}), ("mixtral", {"num_local_experts": 8})):
        config = tmp_path / f"{family}.json"
        config.write_text(json.dumps(sweep_hf.tiny_config(
            family, output_router_logits=True, router_aux_loss_coef=0.5, **fields)))
        plans += [_plan(tmp_path, f"{family}-ep4", config, "{ep: 4, dp_shard: -1}"),
                  _plan(tmp_path, f"{family}-ep2-efsdp2", config, "{ep: 2, dp_shard: 4}"),
                  _sp_plan(capsys, tmp_path, family, config),
                  _sp_plan(capsys, tmp_path, family, config, gathered=True)]
    for path, step, ref, _ in match_one_device(plans):
        ce = torch.nn.functional.cross_entropy(ref.logits.flatten(0, 1),
                                               step.tokens[:, 1:].flatten()).item()
        assert ref.loss - ce > 0.1, (path, ref.loss, ce)  # 0.5 × aux (about top-k) in it


def test_validate_with_the_aux_loss_on_and_where_it_would_be_wrong(tmp_path, capsys):
    """The dry run (every analysis) runs with the aux loss on; under pipeline stages it is
    a located error at mesh.pp."""
    from helpers import run_main
    from test_expert_parallel import sweep_hf

    config = tmp_path / "qwen3_moe.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("qwen3_moe", output_router_logits=True)))
    ep = tmp_path / "ep.yaml"
    ep.write_text(EP_PLAN.format(mesh="{ep: 4}", rules=EP_RULE, folder="x").replace(
        "{pretrained: x}", f"{{hf_config: {config}}}"))
    rc, out = run_main(capsys, "validate", "--plan", ep, "--world-size", "4")
    assert rc == 0 and "could not" not in out and "experts' all-to-all: 10 per step" in out, out
    plan = tmp_path / "pp.yaml"
    plan.write_text(f"mesh: {{pp: 2, dp_shard: -1}}\nmodel:\n  hf_config: {config}\n"
                    "pipeline: {microbatches: 2}\n"
                    'fsdp: {units: ["model.layers.*"]}\n')
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4")
    assert rc == 1 and "Traceback" not in out, out
    assert f"{plan}:1:" in out and "mesh pp=2: the model computes its load-balancing" in out
    # the MoE blocks on the sequence shard: the routers' logits gathered for the term
    from test_expert_parallel import _sp_plan

    rc, out = run_main(capsys, "validate", "--plan", _sp_plan(capsys, tmp_path, "qwen3_moe", config),
                       "--world-size", "4")
    assert rc == 0 and "could not" not in out and "experts' all-to-all" in out, out


def test_a_per_expert_folder_missing_an_expert_is_a_located_error(tiny_hf, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tpplan.train.pretrained import plan_problems

    folder = tmp_path / "broken"
    shutil.copytree(tiny_hf("qwen3_moe"), folder)
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(shard)
        if tensors.pop("model.layers.1.mlp.experts.5.up_proj.weight", None) is not None:
            save_file(tensors, shard, metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    index.write_text(index.read_text().replace(
        '"model.layers.1.mlp.experts.5.up_proj.weight"', '"unused"'))
    plan = tmp_path / "plan.yaml"
    plan.write_text(EP_PLAN.format(mesh="{ep: 4, dp_shard: -1}", folder=folder, rules=EP_RULE))
    errors = plan_problems(str(plan), [])  # what validate and train report, before launch
    assert [str(e.loc).rsplit(":", 1)[0] for e in errors] == [f"{plan}:2"], errors
    assert str(errors[0]).endswith(
        "model.layers.1.mlp.experts.gate_up_proj cannot be made from the checkpoint's "
        "per-expert tensors: 'mlp.experts.*.up_proj.weight' has experts [0, 1, 2, 3, 4, 6, 7], "
        "not every one of 0..7")
