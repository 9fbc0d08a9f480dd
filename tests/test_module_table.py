"""``validate``'s module table from the plan applied to the model's first blocks only
(tpplan.analysis.moduletable) is the table of the plan applied to the whole model, row for
row, and every analysis run beside it reads the same figures; where a block's rows cannot
stand for the others', or the cut copy cannot be applied, the whole model is."""

from __future__ import annotations

import pytest
from helpers import PLANS

from tpplan.analysis import ANALYSES, moduletable
from tpplan.analysis.dryrun import dry_run

SMALL = ["train.seq_len=16", "train.global_batch_size=16"]
TINY_LLAMA = ("model={hf: LlamaForCausalLM, config: {hidden_size: 64, intermediate_size: 128, "
              "num_hidden_layers: 5, num_attention_heads: 4, num_key_value_heads: 2, "
              "vocab_size: 256}}")

# (plan, world size, --set lines, whether the whole model must be parallelized)
CASES = [
    # Megatron TP + SP + loss parallel, FSDP2; the built-in Llama's 4 debug blocks
    ("llama.yaml", 8, ["mesh.tp=2"], False),
    # 6 blocks at tp 4, every second one recomputed: AC's period does not show in the rows
    ("llama.yaml", 8, ["mesh.tp=4", "model.kwargs={n_layers: 6, n_heads: 8, n_kv_heads: 4}",
                       "activation_checkpointing={mode: selective, every: 2}"], False),
    # LoRA adapters in every block, under TP
    ("llama.yaml", 8, ["mesh.tp=2", "lora={targets: ['layers.*.attention.{wq,wk,wv,wo}'], rank: 4}"],
     False),
    # frozen in every block alike; then in one block only: the blocks differ
    ("llama.yaml", 4, ["mesh.tp=2", "freeze=['layers.*.ffn_norm.weight']"], False),
    ("llama.yaml", 4, ["mesh.tp=2", "freeze=['layers.3.ffn_norm.weight']"], True),
    # pipeline stages (7 blocks, the table of the whole model); a split point past the cut
    ("llama-3d.yaml", 16, ["model.kwargs={n_layers: 7}"], False),
    ("llama-3d.yaml", 8, ["model.kwargs={n_layers: 7}", "pipeline.split=[layers.5]"], True),
    # MoE blocks with experts parallel beside TP; a HuggingFace model from its config
    ("moe-tp.yaml", 8, ["model.kwargs={n_layers: 5}"], False),
    ("hf-llama.yaml", 4, [TINY_LLAMA], False),
    # three blocks or fewer: nothing to save, the whole model
    ("llama.yaml", 4, ["mesh.tp=2", "model.kwargs={n_layers: 3}"], True),
]


@pytest.mark.parametrize("plan,world,sets,whole", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_the_table_from_the_first_blocks_is_the_whole_models(plan, world, sets, whole,
                                                             monkeypatch):
    sets = SMALL + sets
    cut = dry_run(str(PLANS / plan), world, sets, ANALYSES)
    assert cut.ok, (cut.errors, cut.analysis_errors)
    assert cut.parallelized is whole
    monkeypatch.setattr(moduletable, "DEPTH", 10**6)  # no model is that deep: applied whole
    full = dry_run(str(PLANS / plan), world, sets, ANALYSES)
    assert full.parallelized
    assert len(cut.report.modules) == len(full.report.modules) > 0
    # every row (path, type, rule, style, each parameter's shapes, placements and dtype),
    # in order, and every analysis's figures
    assert cut.to_json() == full.to_json()
    assert cut.report.table().row_count == full.report.table().row_count
