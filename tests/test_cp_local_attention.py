"""Context parallelism on local attention (docs/long-context.md): HuggingFace families whose
layers see a sliding window (per layer, as ``layer_types`` says), chunks of the sequence
(Llama 4), attention sinks (GPT-OSS) or soft-capped scores (Gemma 2), each with windows
shorter than the 32-token sequence, in two tiny configs per family (window sizes, layer
mixes), under tp 2 × cp 2 with ring and with Ulysses, packed documents in one of the two
per config (so each method meets them in each family): logits, loss and every gradient equal
one device. The plan is ``tpplan import-hf``'s, as a user would get it. One spawn of 4 gloo
processes for every case."""

import json
import sys

import pytest
from helpers import ROOT, run_main
from test_context_parallel import _check, packed_positions

pytest.importorskip("transformers")
sys.path.insert(0, str(ROOT / "scripts"))

import sweep_hf  # noqa: E402

from tpplan.analysis.verify.numerics import parallel_steps, reference_step, verify_step  # noqa: E402

# heads 8 / KV 4: after tp 2, cp 2 divides both (Ulysses); windows and chunks shorter than 32
WIDE = {"num_attention_heads": 8, "num_key_value_heads": 4, "hidden_size": 64, "head_dim": 8}
SLIDING, FULL = "sliding_attention", "full_attention"
CONFIGS = {
    "mistral:w8": {"sliding_window": 8},
    "mistral:w5": {"sliding_window": 5},
    "gemma2:w8-capped": {"sliding_window": 8, "attn_logit_softcapping": 0.5, "layer_types": [SLIDING, FULL]},
    "gemma2:w3-full-first": {"sliding_window": 3, "attn_logit_softcapping": 1.0, "layer_types": [FULL, SLIDING]},
    "gemma3_text:w6": {"sliding_window": 6, "layer_types": [SLIDING, SLIDING]},
    "gemma3_text:w8-mixed": {"sliding_window": 8, "layer_types": [SLIDING, FULL]},
    "cohere2:w8-mixed": {"sliding_window": 8, "layer_types": [SLIDING, FULL]},
    "cohere2:w4": {"sliding_window": 4, "layer_types": [SLIDING, SLIDING]},
    "phi3:w8": {"sliding_window": 8},
    "phi3:w12": {"sliding_window": 12},
    "exaone4:w8-mixed": {"sliding_window": 8, "layer_types": [SLIDING, FULL]},
    "exaone4:w3": {"sliding_window": 3, "layer_types": [SLIDING, SLIDING]},
    "gpt_oss:w8-sinks": {"sliding_window": 8, "layer_types": [SLIDING, FULL]},
    "llama4_text:chunk8": {"attention_chunk_size": 8, "attn_temperature_tuning": False},
}


def _plan(tmp_path, capsys, name: str, fields: dict) -> str:
    """``tpplan import-hf`` of the tiny config (tp 2, transformers' tp plan)."""
    folder = tmp_path / name.replace(":", "-")
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(json.dumps(sweep_hf.tiny_config(name.partition(":")[0], **WIDE, **fields), default=str))
    plan = folder / "plan.yaml"
    rc, out = run_main(capsys, "import-hf", str(config), "-o", str(plan))
    assert rc == 0, (name, out)
    return str(plan)


def test_local_attention_under_ring_and_ulysses_matches_one_device(tmp_path, capsys):
    jobs, refs, names = [], [], []
    positions = packed_positions(2, 33, seed=1)
    for i, (name, fields) in enumerate(CONFIGS.items()):
        plan = _plan(tmp_path, capsys, name, fields)
        for j, method in enumerate(("ring", "ulysses")):
            # GPT-OSS's own masks ignore position ids (transformers 5.x): one device does
            # not keep its packed documents apart, so neither is cp asked to
            packed = positions if (i + j) % 2 and not name.startswith("gpt_oss") else None
            step = verify_step(plan, 4, ["mesh.cp=2", f"context_parallel={method}"], seq_len=32,
                               shrink=False)
            assert step.plan.parallel_dims(4).as_dict()["cp"] == 2
            refs.append(reference_step(step.plan, step.tokens, 0, positions=packed))
            jobs.append((plan, step.overrides, step.tokens, 0, packed))
            names.append(f"{name} {method}{' packed' if packed is not None else ''}")
    # the window is real: without it the same model and tokens give other logits
    plan = _plan(tmp_path, capsys, "mistral:nowindow", {"sliding_window": None})
    step = verify_step(plan, 4, ["mesh.cp=2"], seq_len=32, shrink=False)
    unwindowed = reference_step(step.plan, step.tokens, 0)
    assert (unwindowed.logits - refs[2].logits).abs().max() > 1e-2 * refs[2].logits.abs().max()
    for name, ref, par in zip(names, refs, parallel_steps(jobs, 4)):
        _check(ref, par, name)


def test_fit_and_search_take_local_attention_with_cp(tmp_path, capsys):
    """``validate --device`` and ``search`` size a sliding-window, soft-capped model (Gemma 2)
    under cp as they do a plain causal one: the cp layout is checked, not refused."""
    from tpplan.analysis.search.candidates import Options
    from tpplan.analysis.search.ranking import search
    from tpplan.plan.devices import DEVICES

    plan = _plan(tmp_path, capsys, "gemma2:w8-capped", CONFIGS["gemma2:w8-capped"])
    rc, out = run_main(capsys, "validate", "--plan", plan, "--world-size", "8", "--device", "h100",
                       "--set", "mesh.cp=2", "--set", "train.seq_len=64", "--json")
    assert rc == 0, out
    data = json.loads(out)
    assert data["mesh"]["cp"] == 2 and data["fit"]["fits"] and not data.get("analysis_errors"), data.get("fit")
    found = search(plan, 8, DEVICES["h100"], ["train.seq_len=64"], top=10,
                   options=Options(max_tp=2, schedules=(), cp=(2,), ac_every=()))
    reasons = " ".join(d["reason"] for d in found["dropped"])
    assert "sliding" not in reasons and "local attention" not in reasons, reasons
    assert all("pipeline" in d["reason"] for d in found["dropped"]), found["dropped"]
    assert any("cp: 2" in r["sets"][0] for r in found["ranked"]), [r["sets"][0] for r in found["ranked"]]
