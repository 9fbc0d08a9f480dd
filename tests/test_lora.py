"""LoRA (tpplan/parallel/lora/adapters.py): the ``lora`` section's located errors, and adapters under
TP + SP + loss parallel + FSDP2 (+ activation checkpointing) and pp 2 × tp 2 on 4 gloo
processes against ``peft``'s own LoRA on one device (tests/lora_ranks.py)."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from helpers import ROOT, TEST_PLANS, run_main

pytest.importorskip("peft")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402
from lora_ranks import peft_reference, run_jobs  # noqa: E402

import tpplan  # noqa: E402
from tpplan.analysis.verify.comparison import rel_err  # noqa: E402
from tpplan.analysis.verify.numerics import make_batch  # noqa: E402
from tpplan.models import build_model  # noqa: E402
from tpplan.models.introspect import vocab_size  # noqa: E402

LLAMA_CONFIG = TEST_PLANS / "hf" / "llama-config.json"
ATTN_MLP = ('["model.layers.*.self_attn.{q_proj,k_proj,v_proj,o_proj}", '
            '"model.layers.*.mlp.{gate_proj,up_proj,down_proj}"')


@pytest.fixture(scope="module")
def lora_plans(tmp_path_factory) -> dict[str, str]:
    """Plans with a ``lora`` section: HF Llama 2×2 (TP + SP + loss parallel + FSDP2, full
    activation checkpointing, the head adapted too, the final norm trained whole), HF Llama
    pp 2 × tp 2 (transformers' plan), Qwen3 from import-hf with sequence parallelism, and
    HF Llama with one KV head at tp 2 (its k/v projections kv_colwise: replicated A and B)
    and the built-in Llama's plans/llama.yaml."""
    from tpplan.cli import main

    d = tmp_path_factory.mktemp("lora-plans")
    qwen_config = d / "qwen3.json"
    qwen_config.write_text(json.dumps(sweep_hf.tiny_config("qwen3", num_hidden_layers=2),
                                      default=str))
    assert main(["import-hf", str(qwen_config), "--sequence-parallel", "-o",
                 str(d / "qwen3-imported.yaml")]) == 0
    # One KV head under tp 2: k_proj and v_proj are kv_colwise (weights whole on every rank)
    kv1 = {**json.loads(LLAMA_CONFIG.read_text()), "num_key_value_heads": 1}
    (d / "llama-kv1.json").write_text(json.dumps(kv1))
    assert main(["import-hf", str(d / "llama-kv1.json"), "--tp", "2", "-o",
                 str(d / "llama-kv1-imported.yaml")]) == 0
    assert "kv_colwise" in (d / "llama-kv1-imported.yaml").read_text()
    texts = {
        "llama": f"""extends: {ROOT / 'plans' / 'hf-llama-chat.yaml'}
model: {{pretrained: null, hf_config: {LLAMA_CONFIG}}}
data: null
eval: null
activation_checkpointing: {{mode: full, blocks: "model.layers.*"}}
lora: {{targets: {ATTN_MLP}, lm_head, "!model.layers.1.mlp.up_proj"], rank: 4, alpha: 8,
        modules_to_save: [model.norm]}}
""",
        "llama_pp": f"""extends: {TEST_PLANS / 'hf' / 'llama-pp.yaml'}
model: {{hf_config: {LLAMA_CONFIG}}}
lora: {{targets: {ATTN_MLP}], rank: 4, alpha: 16, rslora: true}}
""",
        "qwen3": f"""extends: qwen3-imported.yaml
lora: {{targets: {ATTN_MLP}], rank: 2, alpha: 4}}
""",
        "llama_kv1": f"""extends: llama-kv1-imported.yaml
lora: {{targets: {ATTN_MLP}], rank: 4, alpha: 8}}
""",
        "builtin": f"""extends: {ROOT / 'plans' / 'llama.yaml'}
lora: {{targets: ["layers.*.attention.{{wq,wv,wo}}", "layers.*.feed_forward.w2", output],
        rank: 8, alpha: 16}}
""",
    }
    out = {}
    for name, text in texts.items():
        (d / f"{name}.yaml").write_text(text)
        out[name] = str(d / f"{name}.yaml")
    return out


def test_adapters_on_4_ranks_match_peft_on_one_device(lora_plans):
    """Loss and every adapter gradient within fp32 tolerance of peft's, for HF Llama and
    Qwen3 on 2×2 (TP + SP + loss parallel + FSDP2) and pp 2 × tp 2, HF Llama with KV heads
    fewer than tp (kv_colwise) on 2×2, and the built-in Llama on 2×2 (also with dropout
    0.5, in eval mode); only adapters (and modules_to_save) get gradients and AdamW state, and every
    frozen base weight is bit-identical after two optimizer steps. One spawn."""
    pp = ["mesh.pp=2", "mesh.tp=2", "mesh.dp_shard=1", "pipeline.microbatches=2"]
    cases = [("llama", [], True), ("llama_pp", [], True), ("qwen3", ["mesh.tp=2"], True),
             ("qwen3", pp, True), ("llama_kv1", [], True), ("builtin", ["mesh.tp=2"], False),
             ("builtin", ["mesh.tp=2", "lora.dropout=0.5"], False)]
    jobs, refs = [], []
    for name, overrides, hf in cases:
        plan = tpplan.load(lora_plans[name], overrides)
        vocab = vocab_size(build_model(plan.model, device="meta"))
        tokens = make_batch(vocab_size=vocab, batch=4, seq_len=16, seed=0)
        loss, grads, init = peft_reference(lora_plans[name], overrides, tokens, 0, hf)
        refs.append((name, loss, grads, init))
        jobs.append((lora_plans[name], overrides, tokens, 0, init))
    results = run_jobs(jobs, 4)
    failed = [f"{ref[0]}: {r}" for ref, r in zip(refs, results) if isinstance(r, str)]
    assert not failed, "\n".join(failed)
    for (name, loss, grads, init), ranks in zip(refs, results):
        trained = set(init)
        losses = {r["dp_rank"]: r["loss"] for r in ranks if r["loss"] is not None}
        par_loss = sum(losses.values()) / len(losses)
        assert abs(par_loss - loss) / abs(loss) < 1e-5, (name, par_loss, loss)
        par_grads = {}
        for r in ranks:
            par_grads.update(r.get("grads", {}))
            assert set(r["with_grad"]) <= trained and set(r["with_state"]) <= trained, name
            assert r["frozen_same"] and r["n_frozen"] > 0, name
        assert set(par_grads) == set(grads) == trained, (name, set(grads) ^ set(par_grads))
        worst = max((rel_err(par_grads[n], g), n) for n, g in grads.items())
        assert worst[0] < 1e-4, (name, worst)
        assert any(g.abs().max() > 1e-6 for n, g in grads.items() if "lora_A" in n), name
    # lora.dropout 0.5 (the last case): the numbers above are eval mode's, where dropout is
    # off on every rank as in peft; in train mode it is on (each forward draws new masks).
    # Which masks each rank draws is not compared: no one-device run draws the same ones.
    for r in results[-1]:
        first_eval, train_a, train_b, last_eval = r["dropout_losses"]
        assert first_eval == last_eval and len({first_eval, train_a, train_b}) == 3, r


def test_lora_mistakes_are_located_errors(write_plan, capsys):
    """The section's syntax first (rank, init, unknown keys), then against the model: a target
    matching nothing, one that is not an nn.Linear, a rank above a layer's, a packed base."""
    base = ROOT / "plans" / "llama.yaml"
    path = write_plan(f"""extends: {base}
lora:
  targets: ["layers.*.attention.wq", "!layers.0.*"]
  rank: 0
  init: gausian
  dropuot: 0.1
""")
    rc, out = run_main(capsys, "validate", "--plan", path, "--world-size", "4")
    assert rc != 0
    assert "plan.yaml:4:9: error: 'lora.rank' must be at least 1, got 0" in out
    assert "plan.yaml:5:9: error: 'lora.init' must be one of kaiming, gaussian" in out
    assert "(did you mean 'gaussian'?)" in out
    assert "plan.yaml:6:3: error: unknown key 'dropuot' in 'lora' (did you mean 'dropout'?)" in out
    path = write_plan(f"""extends: {base}
lora:
  targets: ["layers.*.attention.wq", "layers.*.attention", "layers.*.mlp.w1", "output"]
  rank: 200
  modules_to_save: [head]
""")
    rc, out = run_main(capsys, "validate", "--plan", path, "--world-size", "4")
    assert rc != 0
    assert ("plan.yaml:3:38: error: lora target 'layers.*.attention' (Attention) is not an "
            "nn.Linear") in out
    assert ("plan.yaml:3:60: error: 'lora.targets' pattern 'layers.*.mlp.w1' matches no "
            "module of the model (did you mean 'layers.*.feed_forward.w1'?)") in out
    assert ("plan.yaml:4:9: error: 'lora.rank' 200 is larger than target "
            "'layers.*.attention.wq' allows (in 128, out 128): at most 128") in out
    assert "'output' allows (in 128, out 256)" in out
    assert "plan.yaml:5:21: error: 'lora.modules_to_save' pattern 'head' matches no" in out
    assert "Traceback" not in out


def test_bare_target_names_select_what_peft_target_modules_selects(write_plan, capsys):
    """``lora.targets: [q_proj, v_proj]``: the modules PEFT's ``target_modules`` adapts on
    the same model (a path that is the name or ends with ``.`` + it); a dotted pattern still
    matches the whole path; a bare name matching nothing is located."""
    import transformers
    from peft import LoraConfig, get_peft_model

    from tpplan.parallel.lora.adapters import lora_targets

    plan = tpplan.load(write_plan(f"""extends: {ROOT / 'plans' / 'hf-llama-chat.yaml'}
model: {{pretrained: null, hf_config: {LLAMA_CONFIG}}}
lora: {{targets: [q_proj, v_proj], rank: 4}}
"""))
    model = build_model(plan.model, "meta")
    ours = lora_targets(plan.lora, [p for p, _ in model.named_modules()])
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(LLAMA_CONFIG))
    peft = get_peft_model(hf, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    theirs = [p.removeprefix("base_model.model.").removesuffix(".lora_A")
              for p, _ in peft.named_modules() if p.endswith(".lora_A")]
    assert ours and sorted(ours) == sorted(theirs), (ours, theirs)
    assert not lora_targets(tpplan.load(write_plan(
        f"extends: {ROOT / 'plans' / 'hf-llama-chat.yaml'}\nlora: {{targets: [self_attn.q_proj]}}\n",
        "dotted.yaml")).lora, ours)  # a dotted pattern is a whole path, as before
    path = write_plan(f"""extends: {ROOT / 'plans' / 'hf-llama-chat.yaml'}
model: {{pretrained: null, hf_config: {LLAMA_CONFIG}}}
lora: {{targets: [q_proj, v_prj], rank: 4}}
""", "bad.yaml")
    rc, out = run_main(capsys, "validate", "--plan", path, "--world-size", "4")
    assert rc != 0 and "bad.yaml:3:26: error: 'lora.targets' pattern 'v_prj' matches no" in out, out
    assert "(did you mean 'v_proj'?)" in out, out


def test_a_packed_base_is_refused_with_the_reason(write_plan, capsys, tmp_path):
    config = tmp_path / "phi3.json"
    config.write_text(json.dumps(sweep_hf.tiny_config("phi3", num_hidden_layers=2), default=str))
    path = write_plan(f"""mesh: {{tp: 2, dp_shard: -1}}
model: {{hf_config: {config}}}
tensor_parallel:
  "model.layers.*.self_attn.qkv_proj":
    {{style: packed_colwise, parts: [num_attention_heads, num_key_value_heads, num_key_value_heads]}}
  "model.layers.*.self_attn.o_proj": rowwise
fsdp: {{units: ["model.layers.*"]}}
lora: {{targets: ["model.layers.*.self_attn.{{qkv_proj,o_proj}}"], rank: 4}}
""")
    rc, out = run_main(capsys, "validate", "--plan", path, "--world-size", "4")
    assert rc != 0
    assert ("plan.yaml:8:18: error: lora target 'model.layers.*.self_attn.qkv_proj' is under "
            "style 'packed_colwise' (rule 'model.layers.*.self_attn.qkv_proj', line 4)") in out
    assert "leave it out with '!model.layers.*.self_attn.qkv_proj'" in out
    assert out.count("error:") == 1  # o_proj (rowwise) is followed


LORA_STEPS = 6


def lora_train(plan: str, folder, run_dir, *extra: str, nproc: int | None = None, sets=()):
    from helpers import tpplan_cli
    from trainrun import QUICK_START

    args = ["train", "--plan", plan]
    for s in [*QUICK_START, *lora_sets(folder, run_dir, sets)]:
        args += ["--set", s]
    return tpplan_cli(*args, *extra, *(["--nproc", str(nproc)] if nproc else []), timeout=240)


def lora_sets(folder, run_dir, sets=()) -> list[str]:
    return [f"model.pretrained={folder}", f"data.tokenizer={folder}",
            f"data.path={folder / 'chat.jsonl'}", "eval=null", f"train.steps={LORA_STEPS}",
            "train.seq_len=32", "train.global_batch_size=4", "train.micro_batch_size=1",
            "train.lr=0.01", "checkpoint.interval=3", "checkpoint.keep=0",
            f"metrics.run_dir={run_dir}", *sets]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_llama):
    """A LoRA fine-tune of scripts/make_tiny_hf.py's Llama on 2×2 (TP + SP + loss parallel +
    FSDP2), checkpoints at steps 3 and 6: (plan, run folder). The attention's targets are
    bare names, as PEFT users write them (``q_proj`` matches ``model.layers.0.self_attn.q_proj``)."""
    from trainrun import ok

    d = tmp_path_factory.mktemp("lora-run")
    plan = d / "lora.yaml"
    plan.write_text(f"""extends: {ROOT / 'plans' / 'hf-llama-chat.yaml'}
lora: {{targets: [q_proj, k_proj, v_proj, o_proj, "model.layers.*.mlp.{{gate_proj,up_proj,down_proj}}"],
        rank: 4, alpha: 8}}
""")
    ok(lora_train(str(plan), tiny_llama, d / "2x2", nproc=4))
    return str(plan), d / "2x2"


def test_lora_finetune_2x2_equals_one_process_and_resumes_at_another_tp(lora_run, tiny_llama,
                                                                         tmp_path):
    """Losses step by step equal a one-process run; checkpoints hold the adapters and their
    AdamW state only, with the base identified; resuming step 3's checkpoint at tp=1 gives
    steps 4-6 of the 2×2 run; another base is refused."""
    from trainrun import assert_same_curve, fails, metrics, ok

    from tpplan.checkpoint import read_model_state
    from tpplan.checkpoint.integrity import read_trainer_state

    plan, run = lora_run
    got = metrics(run)
    assert got[LORA_STEPS]["loss"] < got[1]["loss"]
    ok(lora_train(plan, tiny_llama, tmp_path / "one", sets=["mesh.tp=1"]))
    assert_same_curve(got, metrics(tmp_path / "one"), range(1, LORA_STEPS + 1))

    step6 = run / "checkpoints" / "step-000006"
    saved = read_model_state(step6)
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved), sorted(saved)[:4]
    assert len(saved) == 2 * 7 * 2  # 7 projections in each of 2 blocks, A and B
    base = read_trainer_state(step6)["lora_base"]
    assert base["pretrained"] == str(tiny_llama.resolve()) and len(base["sha256"]) == 64
    from tpplan.checkpoint.integrity import SafeReader

    keys = SafeReader(str(step6)).read_metadata().state_dict_metadata
    moments = [k for k in keys if k.startswith("optim.state.") and k.endswith("exp_avg")]
    assert len(moments) == len(saved) and all("lora_" in k for k in keys if k.startswith("optim.state."))

    resumed = tmp_path / "resumed"
    ok(lora_train(plan, tiny_llama, resumed, "--resume", str(run / "checkpoints" / "step-000003"),
                  sets=["mesh.tp=1"]))
    assert_same_curve(metrics(resumed), got, range(4, LORA_STEPS + 1))

    other = tmp_path / "other-base"  # another export: its index differs
    shutil.copytree(tiny_llama, other)
    index = json.loads((other / "model.safetensors.index.json").read_text())
    index.setdefault("metadata", {})["note"] = "another base"
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    fails(lora_train(plan, other, tmp_path / "refused", "--resume", str(step6),
                     sets=["mesh.tp=1"]), "holds LoRA adapters trained on", "sha256")


def test_peft_and_merged_exports_give_tpplans_logits(lora_run, tiny_llama, tmp_path, capsys):
    """``--format peft`` loads in ``peft.PeftModel.from_pretrained`` and ``--merge`` in
    transformers, both with the logits of tpplan's own model of the run (base + the
    checkpoint's adapters, as ``tpplan generate`` runs it); the adapters changed them."""
    import torch
    import transformers
    from peft import PeftModel

    from tpplan.byom.generate import load_generator

    _, run = lora_run
    rc, out = run_main(capsys, "export", "--checkpoint", str(run), "--format", "peft",
                       "-o", str(tmp_path / "adapter"))
    assert rc == 0, out
    rc, out = run_main(capsys, "export", "--checkpoint", str(run), "--merge",
                       "-o", str(tmp_path / "merged"))
    assert rc == 0, out
    tokens = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))

    def hf(folder):
        return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    with torch.no_grad():
        ours = load_generator(run).model(tokens)
        peft_logits = PeftModel.from_pretrained(hf(tiny_llama), tmp_path / "adapter")(
            input_ids=tokens).logits
        merged = hf(tmp_path / "merged")(tokens).logits
        base = hf(tiny_llama)(tokens).logits
    assert rel_err(peft_logits, ours) < 1e-5 and rel_err(merged, ours) < 1e-5
    assert rel_err(base, ours) > 1e-3
    rc, out = run_main(capsys, "generate", "--checkpoint", str(run), "--prompt", "Hi",
                       "--max-new-tokens", "4")
    assert rc == 0, out
    for fmt in ("safetensors", "hf"):  # they would write the adapters alone as a model
        rc, out = run_main(capsys, "export", "--checkpoint", str(run), "--format", fmt,
                           "-o", str(tmp_path / fmt))
        assert rc != 0 and "export them with --format peft, or merged" in out, out


def test_a_peft_adapter_written_by_peft_starts_a_run_and_continues(lora_run, tiny_llama,
                                                                    tmp_path):
    """``model.adapter``: a folder ``peft`` itself saved (targets as PEFT users write them,
    suffixes) starts the 2×2 run: step 1's loss is peft's own on the same batch; the run
    trains on from there; a folder of another rank is a located error."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model
    from trainrun import fails, metrics, ok

    from tpplan.train.corpora import load_corpora
    from tpplan.train.data import document_positions, step_batch
    from tpplan.train.evaluate import summed_loss

    plan_path, _ = lora_run
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, config).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0.0, 0.05, generator=g)
    model.save_pretrained(tmp_path / "adapter")

    run = tmp_path / "from-adapter"
    ok(lora_train(plan_path, tiny_llama, run, nproc=4,
                  sets=[f"model.adapter={tmp_path / 'adapter'}", "train.steps=2"]))
    plan = tpplan.load(plan_path, [f"data.tokenizer={tiny_llama}",
                                   f"data.path={tiny_llama / 'chat.jsonl'}", "eval=null"])
    data = load_corpora(plan.data, plan.eval, run, base.config.vocab_size, 32)
    batch = step_batch(data.train, 0, 1, 4, 32, 0, 1)
    # packed chats attend within themselves (data.document_mask): transformers takes that as
    # positions restarting at each document
    positions = document_positions(batch.tokens, data.train.separator)
    with torch.no_grad():
        logits = model(input_ids=batch.tokens[:, :-1], position_ids=positions[:, :-1],
                       use_cache=False).logits  # no cache: transformers masks packed positions
    loss = summed_loss(logits, batch.tokens, batch.mask).item() / batch.count
    got = metrics(run)
    assert got[1]["loss"] == pytest.approx(loss, rel=1e-5)
    assert sorted(got) == [1, 2]

    config.r = 2
    other = get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tiny_llama), config)
    other.save_pretrained(tmp_path / "rank2")
    fails(lora_train(plan_path, tiny_llama, tmp_path / "refused",
                     sets=[f"model.adapter={tmp_path / 'rank2'}", "mesh.tp=1"]),
          "model.adapter:", "has r 2 but the plan's lora section says 4")


def test_the_dry_run_counts_gradients_and_adamw_state_for_the_adapters_only(capsys, monkeypatch):
    """The same apply on fake tensors: gradients are the adapters' local elements (fp32),
    AdamW two moments of them and a step counter each; ``--device`` proposes LoRA (with the
    rank it assumed) among its checked changes when a full fine-tune does not fit."""
    from torch.distributed.tensor import DTensor

    from tpplan.analysis import ANALYSES, moduletable
    from tpplan.analysis.dryrun import dry_run
    from tpplan.analysis.memory.fit import LORA_RANK, needed

    memory = [a for a in ANALYSES if a[0] == "memory_per_rank"]
    plan = str(ROOT / "plans" / "llama.yaml")
    small = ["train.seq_len=64", "train.global_batch_size=8"]
    lora = ['lora={targets: ["layers.*.attention.{wq,wv,wo}", "layers.*.feed_forward.w2"], '
            'rank: 8}']
    # The plan applied to the whole model (not only to the first blocks for the module
    # table, tpplan.analysis.moduletable): its adapters are what the figures are held to.
    monkeypatch.setattr(moduletable, "DEPTH", 10**6)
    r = dry_run(plan, 4, small + lora, memory)
    assert r.parallelized
    monkeypatch.undo()
    trained = [(n, p) for n, p in r.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n, _ in trained)
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for _, p in trained)
    m = r.extra["memory_per_rank"]
    assert m["gradients"] == 4 * local
    assert m["optimizer"] == 2 * 4 * local + 4 * len(trained)
    full = dry_run(plan, 4, small, memory).extra["memory_per_rank"]
    assert m["parameters"] > full["parameters"] and m["optimizer"] < full["optimizer"] / 10

    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "4",
                       *sum((["--set", s] for s in small), []), "--device-memory",
                       str(needed(full["peak"]) - 1), "--json")
    assert rc == 0, out
    changes = {c["change"]: c for c in json.loads(out)["fit"]["changes"]}
    proposed = [c for what, c in changes.items() if what.startswith(f"LoRA rank {LORA_RANK} ")]
    assert len(proposed) == 1 and proposed[0]["error"] is None, changes.keys()
    assert proposed[0]["peak"] < full["peak"] and f"rank: {LORA_RANK}" in proposed[0]["set"][0]
