"""A module's parameters or children swapped for a call (``tpplan._torch.modules``): in place
for the call, and the module intact afterwards, also when its forward raises halfway."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tpplan._torch.modules import (own_children, own_parameters, set_children, set_parameters, shell_copy,
                                   swap_around_forward, swapped)


class Halfway(nn.Module):
    """Two linear layers and a parameter of its own; ``fail`` raises between the layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.second = nn.Linear(3, 3, bias=False)
        self.scale = nn.Parameter(torch.ones(3))
        self.fail = False
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x) * self.scale
        self.seen.append((self.scale, self.first, self.first.weight))
        if self.fail:
            raise RuntimeError("halfway")
        return self.second(x)


def _state(module: nn.Module) -> tuple:
    """What "intact" means: the same objects, under the same names, in the same order."""
    return ([(n, id(p)) for n, p in module.named_parameters()],
            [(n, id(m)) for n, m in module.named_modules()],
            {id(m): ([(n, id(p)) for n, p in own_parameters(m).items()],
                     [(n, id(c)) for n, c in own_children(m).items()]) for m in module.modules()})


def test_parameters_swapped_for_the_call_and_put_back_when_the_forward_raises():
    torch.manual_seed(0)
    model, x = Halfway(), torch.randn(2, 3)
    before, want = _state(model), model(x)
    other, weight = torch.full((3,), 2.0), torch.zeros(3, 3)
    with swapped(model, parameters={"scale": other, "first.weight": weight}) as same:
        assert same is model and model.scale is other and model.first.weight is weight
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in before[0]]  # order kept
        got = model(x)
    assert not torch.equal(got, want) and _state(model) == before and torch.equal(model(x), want)
    model.fail = True
    with pytest.raises(RuntimeError, match="halfway"):
        with swapped(model, parameters={"scale": other, "first.weight": weight}):
            model(x)
    assert model.seen[-1][0] is other and model.seen[-1][2] is weight  # it ran swapped
    assert _state(model) == before


def test_a_name_the_module_did_not_have_is_gone_afterwards():
    model = Halfway()
    before = _state(model)
    with swapped(model, parameters={"extra": torch.ones(1)}, children={"third": nn.ReLU()}):
        assert "extra" in own_parameters(model) and isinstance(model.third, nn.ReLU)
    assert _state(model) == before and not hasattr(model, "extra")


def test_children_swapped_for_the_call_and_put_back_when_the_forward_raises():
    torch.manual_seed(0)
    model, x = Halfway(), torch.randn(2, 3)
    before, want = _state(model), model(x)
    other = nn.Linear(3, 3)
    with swapped(model, children={"first": other}):
        assert model.first is other and list(own_children(model)) == ["first", "second"]
        model(x)
    assert model.seen[-1][1] is other and _state(model) == before and torch.equal(model(x), want)
    model.fail = True
    with pytest.raises(RuntimeError, match="halfway"):
        with swapped(model, children={"first": other}):
            model(x)
    assert model.seen[-1][1] is other and _state(model) == before


def test_all_children_seen_from_zero_and_the_list_intact_after_a_raise():
    experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    set_children(experts, {k: m for k, m in own_children(experts).items() if k != "0"})  # an ep rank's 1..3
    before, held = _state(experts), own_children(experts)
    assert list(held) == ["1", "2", "3"]
    with pytest.raises(RuntimeError, match="halfway"):
        with swapped(experts, children={str(j): m for j, m in enumerate(held.values())}, all_children=True):
            assert list(own_children(experts)) == ["0", "1", "2"] and experts[0] is held["1"]
            raise RuntimeError("halfway")
    assert _state(experts) == before and own_children(experts) == held


def test_swap_around_forward_puts_back_after_a_forward_that_raises():
    """The forward-hook form: the swap is made when the call starts, put back after it,
    also when the forward raises (an always-called hook) -- and the next call is as before."""
    torch.manual_seed(0)
    model, x = Halfway(), torch.randn(2, 3)
    plain = model(x)
    doubled = {}

    def double(mod: nn.Module) -> dict[str, torch.Tensor]:
        doubled["scale"] = own_parameters(mod)["scale"] * 2
        return {"scale": doubled["scale"], "first.weight": mod.first.weight.detach() * 0}

    swap_around_forward(model, double)
    before = _state(model)
    got = model(x)
    assert model.seen[-1][0] is doubled["scale"] and not torch.equal(got, plain) and _state(model) == before
    model.fail = True
    with pytest.raises(RuntimeError, match="halfway"):
        model(x)
    assert model.seen[-1][0] is doubled["scale"]  # it ran swapped, and raised halfway
    assert _state(model) == before
    model.fail = False
    assert torch.equal(model(x), got)


def test_a_swap_that_fails_halfway_puts_back_what_it_wrote():
    model = Halfway()
    before = _state(model)
    with pytest.raises(AttributeError):
        with swapped(model, parameters={"scale": torch.zeros(3), "nowhere.weight": torch.zeros(1)}):
            pass
    assert _state(model) == before


def test_set_parameters_and_set_children_are_for_good():
    model = Halfway()
    shared = model.first.weight
    set_parameters(model, {"second.weight": shared})
    assert model.second.weight is shared and "second.weight" not in dict(model.named_parameters())
    copy = shell_copy(model)
    assert type(copy) is Halfway and own_children(copy) == {} and own_parameters(copy) == {}
    set_children(copy, {"first": model.first})
    assert copy.first is model.first and list(own_children(model)) == ["first", "second"]
    linear = shell_copy(nn.Linear(2, 2, bias=False))
    assert own_parameters(linear) == {"bias": None}  # the None entry reset_parameters reads
