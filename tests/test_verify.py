"""``tpplan verify``: every shipped plan matches one device; a wrong plan fails loudly."""

from __future__ import annotations

import pytest
from helpers import PLANS, TEST_PLANS

import tpplan
from tpplan.cli import main


# The shipped plans' numerics at their own sizes are tests/test_numerics.py's; here the
# command itself, with its shrinking: the 2x2 plan, the 3-D one, and a wasteful plan (above
# the communication minimum, yet correct).
@pytest.mark.parametrize("plan, nproc", [("llama.yaml", 4), ("llama-hsdp-tp.yaml", 8),
                                         ("../tests/plans/wasteful-siblings.yaml", 4),
                                         ("llama-long.yaml", 4),  # context parallel, cp 4
                                         ("../tests/plans/hf/qwen3-cp.yaml", 4)])
def test_shipped_plans_match_one_device(plan, nproc, capsys):
    code = main(["verify", "--plan", str(PLANS / plan), "--nproc", str(nproc)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "numerics match" in out


def test_a_plan_that_runs_but_computes_the_wrong_thing_fails_with_a_table(capsys):
    code = main(["verify", "--plan", str(TEST_PLANS / "wrong-layout.yaml"),
                 "--nproc", "4"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "numerics differ" in out
    assert "grad layers.*.attention.wo.weight" in out  # rows collapsed over layers


def test_shrunk_config_keeps_every_split_divisible():
    from tpplan.models import build_model
    from tpplan.models.introspect import shrink_overrides

    for tp in (1, 2, 4, 8):
        plan = tpplan.load(PLANS / "llama.yaml", [f"mesh.tp={tp}", "model.config=405b"])
        plan = tpplan.load(PLANS / "llama.yaml", [f"mesh.tp={tp}", "model.config=405b"] +
                           shrink_overrides(plan.model, tp, 2, 16))
        model = build_model(plan.model, device="meta")
        res = plan.resolve(model, tp * 2)
        assert res.ok, res.errors
        assert len(model.layers) == 2 and model.config.dim <= 128


def test_a_nan_anywhere_fails_and_shows_in_the_table():
    """A NaN gradient among many of one group (``max`` keeps whichever comes first when NaN
    is involved) still fails the comparison and shows as the group's worst error."""
    import math

    import torch

    from tpplan.analysis.verify.numerics import StepResult, compare
    from tpplan.commands.verify import group_rows

    grads = {f"layers.{i}.w": torch.ones(3) for i in range(3)}
    bad = dict(grads, **{"layers.1.w": torch.tensor([1.0, math.nan, 1.0])})
    ref = StepResult(torch.zeros(1, 2, 4), 2.0, grads)
    for par in (StepResult(torch.zeros(1, 2, 4), 2.0, bad),
                StepResult(torch.zeros(1, 2, 4), math.nan, grads)):
        result = compare(ref, par)
        assert not result.ok and len(result.failures) == 1
        assert any(err == math.inf for _, _, err in group_rows(result.rows))
    assert compare(ref, StepResult(torch.zeros(1, 2, 4), 2.0, grads)).ok
