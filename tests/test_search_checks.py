"""``tpplan search``'s checks of its candidates, cached by part (tpplan/analysis/search/check_cache.py:
the plan's sections by the ``--set`` lines that touch them, a resolution's parts by the
degrees they read): every candidate of a small search gets exactly the errors (messages and
places) or the resolution and step of a fresh ``dry_run`` of the plan with its lines, on a
dense Llama with and without a pipeline, a Qwen3-MoE with expert parallelism and a Llama
under context parallelism."""

from __future__ import annotations

import pytest
from helpers import PLANS

from tpplan.analysis.search.candidates import Options, candidates
from tpplan.analysis.dryrun import dry_run
from tpplan.analysis.search.trace_cache import Evaluator
from tpplan.models.introspect import find_blocks


def _summary(r) -> dict:
    """What a check finds: its errors where they are, or the resolution and the step."""
    if r.errors:
        return dict(errors=[(e.message, str(e.loc)) for e in r.errors])
    res, split = r.resolution, r.resolution.pipeline
    return dict(dims=res.dims, rules=res.rules, rule_of=res.rule_of, attrs=res.attrs,
                units=res.units, ac=res.ac_blocks, compile=res.compile_blocks, stage=res.stage,
                split=split and (split.stages, split.first, split.last, split.pp,
                                 split.blocks_path, list(map(str, split.errors))),
                step=r.step, spec=r.plan.spec)


CASES = {  # plan, world, overrides, every how many-th candidate checked against dry_run
    "llama": ("llama.yaml", 16, ["model.kwargs.n_layers=4", "train.seq_len=32",
                                 "train.global_batch_size=16"], 3),
    "moe-ep": ("qwen3-moe-ep-tiny.yaml", 8, [], 2),
    "cp": ("llama-long.yaml", 8, ["model.kwargs.n_layers=2", "train.seq_len=1024",
                                  "train.global_batch_size=4"], 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_cached_checks_equal_fresh_dry_runs(case):
    plan, world, overrides, step = CASES[case]
    path = str(PLANS / plan)
    ev = Evaluator(path, overrides, world)
    blocks = find_blocks(ev.model)
    cands = candidates(ev.base, world, Options(max_tp=4), blocks and f"{blocks}.*")
    first = [_summary(ev.check(c.sets)) for c in cands]
    # Each again, in the other order (search checks a popped candidate again): from the cache.
    assert [_summary(ev.check(c.sets)) for c in reversed(cands)] == first[::-1]
    fresh = [_summary(dry_run(path, world, overrides + c.sets, apply=False))
             for c in cands[::step]]
    assert first[::step] == fresh
    # The space has both kinds (a candidate refused, one that passes), and the cache worked:
    # fewer resolutions than candidates, the rules matched once a tp, a section parsed once
    # for each text of it.
    passed = [s for s in first if "errors" not in s]
    assert passed and len(passed) < len(first)
    assert ev.traces["resolutions"] < len(cands) / 2
    assert ev.parts.counts["check_rules"] == len({c.tp for c in cands})
    assert ev.parts.counts["check_section"] < len(cands)
    if case == "llama":
        assert any(s["split"] for s in passed) and any(not s["split"] for s in passed)
    if case == "moe-ep":
        assert any(s["dims"].ep > 1 for s in passed)
    if case == "cp":
        assert any(s["dims"].cp > 1 for s in passed)
