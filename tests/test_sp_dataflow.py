"""What ``tpplan suggest`` reads from a model's dataflow beyond its module calls, and the
rules it makes of it, on a toy decoder built to hold each case once:

- a module that routes tokens reached from code, not from a norm (Qwen4-exp's
  hyper-connections, Llama 4's MoE after the residual): the whole sequence under SP, and
  ``flat_tokens`` where it returns its tokens flattened (Llama 4);
- a post-norm whose output the block's code also reads (MiniMax): a local shard;
- a block input shaped like the hidden states that the block's code reads (Gemma 4's
  ``per_layer_input``): sharded with them;
- a projection pair whose intermediate meets a whole tensor element by element (Gemma 4's
  per-layer gate), or whose output is modified in place (Llama 4's ``out.add_``): replicated;
- a norm on a rowwise output (Gemma 3n's LAuReL): no per-head rule;
- hidden states without the sequence on dimension 1 (Gemma 3n's AltUp): SP refused.

And ``prepare_input_output`` on 2 gloo processes: flattened tokens and a one-tuple output
come back as this rank's sequence shard, in the layout the caller expects."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tpplan.byom.suggest import analyse
from tpplan.models.dataflow import trace_forward
from tpplan.parallel.runtime import spawn
from tpplan.plan.errors import PlanErrors

H, P, V = 16, 8, 32


class Mix(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down, self.post_norm = nn.Linear(H, 32), nn.Linear(32, H), nn.RMSNorm(H)

    def forward(self, x):
        return self.post_norm(self.down(torch.relu(self.up(x))))


class Shared(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(H, 32), nn.Linear(32, H)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.shared = nn.Parameter(torch.randn(4, H)), Shared()

    def forward(self, x):
        flat = x.reshape(-1, H)
        logits = flat @ self.router.T
        out = self.shared(flat)
        out.add_(flat * logits.softmax(-1)[:, :1])  # Llama 4's shared expert output
        return out, logits


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.mix, self.moe = nn.RMSNorm(H), Mix(), MoE()
        self.gate, self.proj = nn.Linear(H, P), nn.Linear(P, H)

    def forward(self, h, extra):
        x = self.norm(h)
        h = x + self.mix(x)  # post-norm: the code reads the norm's output
        h = h + self.moe(h * 1.0)[0].view(h.shape)
        return h + self.proj(self.gate(h) * extra)


class Toy(nn.Module):
    def __init__(self, stacked: bool = False):
        super().__init__()
        self.stacked = stacked
        self.embed, self.per_layer = nn.Embedding(V, H), nn.Embedding(V, P)
        self.layers = nn.ModuleList([Block(), Block()])
        self.final_norm, self.head = nn.RMSNorm(H), nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        h, extra = self.embed(tokens), self.per_layer(tokens)
        if self.stacked:  # AltUp: several residual streams stacked first
            h = h.unsqueeze(0).expand(2, -1, -1, -1)
        for layer in self.layers:
            h = layer(h, extra)
        return self.head(self.final_norm(h[0] if self.stacked else h))


def _suggest(sp: str, stacked: bool = False):
    torch.manual_seed(0)
    model = Toy(stacked)
    s = analyse(model, trace_forward(model, torch.randint(0, V, (2, 16))), "layers", sp)
    return {p: st for p, st, _ in s.rules}, " ".join(s.notes)


def test_the_dataflow_decides_what_is_sharded_whole_or_a_shard():
    rules, notes = _suggest("blocks")
    assert rules["layers.*"]["input_layouts"] == ["replicate", "replicate"]  # extra too
    assert rules["layers.*.norm"] == {"style": "sequence_parallel", "use_local_output": True}
    moe = rules["layers.*.moe"]
    assert moe["style"] == "prepare_input_output" and moe["desired_input_layouts"] == "replicate"
    assert moe["flat_tokens"] is True and moe["desired_output_layouts"][0] == "shard(1)"
    assert "layers.*.mix.post_norm" not in rules  # on the rowwise output: whole
    assert rules["layers.*.mix.down"] == {"style": "rowwise", "output_layouts": "shard(1)"}

    rules, notes = _suggest("off")
    assert rules["layers.*.mix.up"] == "colwise" and "layers.*.mix.post_norm" not in rules
    assert not any(p.startswith(("layers.*.gate", "layers.*.proj")) for p in rules)
    assert "element by element" in notes
    assert "layers.*.moe.shared.down" not in rules and "in place" in notes


def test_sequence_parallelism_is_refused_where_the_sequence_is_not_dimension_1():
    with pytest.raises(PlanErrors, match="not dimension 1"):
        _suggest("blocks", stacked=True)


class _Flat(nn.Module):
    def forward(self, x):
        return (x * 3).reshape(-1, x.shape[-1]), x.sum()


class _One(nn.Module):
    def forward(self, x):
        return (x * 2,)


def _worker(rank, world, port):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tpplan.parallel.tp.prepare_io import PrepareInputOutput
    from tpplan.parallel.runtime import as_spawned_rank

    as_spawned_rank(rank, world, port)
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (world,))
        x = torch.arange(2 * 8 * 4, dtype=torch.float).reshape(2, 8, 4)
        mine = x.chunk(world, dim=1)[rank].clone()
        flat = parallelize_module(_Flat(), mesh, PrepareInputOutput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
            output_layouts=(Replicate(), None), desired_output_layouts=(Shard(1), None),
            use_local_output=True, flat_tokens=True))
        out, total = flat(mine)
        assert torch.equal(out, (mine * 3).reshape(-1, 4)), out
        assert total.item() == x.sum().item()  # the module saw the whole sequence
        one = parallelize_module(_One(), mesh, PrepareInputOutput(
            input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
            output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
        got = one(mine)
        assert isinstance(got, tuple) and len(got) == 1 and torch.equal(got[0], mine * 2)
        _raising_forwards_give_back_what_they_swapped(mesh, mine)
    finally:
        dist.destroy_process_group()


class _Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.fail = False

    def forward(self, x):
        y = self.lin(x)
        if self.fail:
            raise RuntimeError("halfway")
        return y


def _raising_forwards_give_back_what_they_swapped(mesh, mine):
    """``sequence_local``'s hooks and a list of experts' local call swap parameters or
    children in for the length of a forward: one that raises halfway puts them back."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from tpplan.parallel.experts.module_list import local_experts_call
    from tpplan.parallel.experts.sequence_local import SequenceLocal

    block = parallelize_module(_Raises(), mesh, SequenceLocal())
    x = DTensor.from_local(mine, mesh, [Shard(1)])
    ok = block(x)
    block.fail = True
    with pytest.raises(RuntimeError, match="halfway"):
        block(x)
    assert all(isinstance(p, DTensor) for p in block.parameters())
    block.fail = False
    assert torch.equal(block(x), ok)  # and it runs as before

    experts = nn.ModuleList(nn.Linear(2, 2) for _ in range(4))
    experts._modules.pop("0")  # global indices 1..3 left, as an ep rank keeps its own
    held = dict(experts._modules)

    def boom():
        assert list(experts._modules) == ["0", "1", "2"]  # seen from 0 inside the call
        raise RuntimeError("halfway")
    with pytest.raises(RuntimeError, match="halfway"):
        local_experts_call(experts, boom)
    assert experts._modules == held


def test_whole_sequence_modules_hand_back_flattened_tokens_and_one_tuples_as_shards():
    """(And a forward that raises halfway gives back what ``sequence_local`` and a list of
    experts swapped in for it.)"""
    spawn(_worker, 2)
