"""Measuring one training step's memory for real: the trainer's step on a gloo CPU mesh,
followed by PyTorch's own ``FSDPMemTracker`` (peak, activations, unsharded parameters and
gradients; FSDP2's group hooks kept, see :func:`_group_aware_tracker`) and by plain sums
of the live tensors (parameters, gradients, optimizer state)."""

from __future__ import annotations

import json
import os
import weakref
from pathlib import Path


SMALL = ["train.seq_len=32", "train.micro_batch_size=2"]
HF_SMALL = ["model.config.num_hidden_layers=4", "model.config.num_attention_heads=4",
            "model.config.num_key_value_heads=2", "model.config.hidden_size=32",
            "model.config.head_dim=8", "model.config.intermediate_size=128",
            "model.config.vocab_size=128"]
LORA_R16 = ('lora={targets: ["layers.*.attention.{wq,wk,wv,wo}", '
            '"layers.*.feed_forward.{w1,w2,w3}"], rank: 16}')
# name -> (plan, world size, overrides): every case is 2 micro-batches of accumulation.
CASES: dict[str, tuple[str, int, list[str]]] = {
    "2x2, 16 blocks (extrapolated)": ("llama.yaml", 4, SMALL + [
        "train.global_batch_size=8", "model.kwargs.n_layers=16"]),
    "2x2, full checkpointing": ("llama.yaml", 4, SMALL + [
        "train.global_batch_size=8", "activation_checkpointing={mode: full}"]),
    "2x2, selective every 2": ("llama.yaml", 4, SMALL + [
        "train.global_batch_size=8", "activation_checkpointing={mode: selective, every: 2}"]),
    "2x2, bf16 mixed precision": ("llama.yaml", 4, SMALL + [
        "train.global_batch_size=8",
        "fsdp.mixed_precision={param_dtype: bfloat16, reduce_dtype: float32}"]),
    "tp 4 (llama-tp)": ("llama-tp.yaml", 4, SMALL + ["train.global_batch_size=4"]),
    "fsdp 4 (llama-fsdp)": ("llama-fsdp.yaml", 4, SMALL + ["train.global_batch_size=16"]),
    "HF Llama 2x2": ("hf-llama.yaml", 4, SMALL + ["train.global_batch_size=8"] + HF_SMALL),
    "2x2, LoRA rank 16 (base frozen)": ("llama.yaml", 4, SMALL + [
        "train.global_batch_size=8", LORA_R16]),
    # experts over ep 2, FSDP-sharded over the efsdp 2 left; transformers' grouped_mm
    # experts (the dry run: the same forward on shapes, models/hf_experts.py), routed for real
    "HF Qwen3-MoE ep 2 x efsdp 2": ("qwen3-moe-ep-tiny.yaml", 4, SMALL + [
        "train.global_batch_size=16", "mesh.ep=2"]),
}
# The Llama 3.2 1B shape (width 2,048, GQA 32/8 heads, vocabulary 128,256, untied head) cut
# to 1 block so 4 CPU ranks hold it (~18 GiB together): a full fine-tune against LoRA rank 16, one micro-batch
# of 32 tokens per rank (scripts/memory_agreement.py --1b; docs/benchmarks.md). Not a test.
SHAPE_1B = ["model.config=1b", "model.kwargs={n_layers: 1}", "train.seq_len=32",
            "train.micro_batch_size=1", "train.global_batch_size=2"]
CASES_1B: dict[str, tuple[str, int, list[str]]] = {
    "1b (1 block), full fine-tune": ("llama.yaml", 4, SHAPE_1B),
    "1b (1 block), LoRA rank 16": ("llama.yaml", 4, SHAPE_1B + [LORA_R16]),
}


def _ratio(predicted: int, measured: int) -> float:
    if measured == 0:
        return 1.0 if predicted == 0 else float("inf")
    return predicted / measured


def compare(predicted: dict, measured: dict) -> list[dict]:
    """Rows of (part, predicted, measured, ratio) for every part measured."""
    accum = len(measured["end_backward"])
    pairs = {
        "parameters": (predicted["parameters"], measured["parameters"]),
        "buffers": (predicted["buffers"],  # rotary tables and the batch: steady
                    measured["peak"]["Buffer"] + measured["peak"]["Inputs"]),
        "optimizer": (predicted["optimizer"], measured["optimizer"]),
        "gradients": (predicted["gradients"], measured["gradients"]),
        # FSDP2's own state: every unit gathered and not yet resharded, the prefetched one
        # included (PyTorch's tracker files that one's buffer under "All Gather").
        "fsdp_unsharded": (predicted["fsdp_unsharded"], measured["fsdp_state_max"]),
        # What a micro-batch with gradient sync off leaves behind (its logits replace the
        # previous step's, the same size): the live total after its backward, less before.
        "accumulated_gradients": (predicted["accumulated_gradients"], max(
            [s["Total"] - measured["start"]["Total"] for s in measured["end_backward"][:accum - 1]],
            default=0)),
        "activations": (predicted["activations"],
                        max(s["Activation"] for s in measured["end_forward"])),
        "peak": (predicted["peak"], measured["peak"]["Total"]),
    }
    if not measured["checkpointing"]:  # checkpointed blocks save through their own hooks
        pairs["activations (saved_tensors_hooks)"] = (predicted["activations"],
                                                      max(measured["saved"]))
    return [dict(part=k, predicted=p, measured=m, ratio=_ratio(p, m))
            for k, (p, m) in pairs.items()]


def _local(t):
    from torch.distributed.tensor import DTensor

    t = t.to_local() if isinstance(t, DTensor) else t
    # torchao's float8 wrappers (emulated float8 runs) hold their bytes in an inner tensor
    inner = {"Float8TrainingTensor": "_data", "WeightWithDynamicFloat8CastTensor": "_tensor"}.get(type(t).__name__)
    return getattr(t, inner) if inner else t


def _bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        st = _local(t).untyped_storage()
        if st._cdata not in seen:
            seen.add(st._cdata)
            total += st.nbytes()
    return total


def _plain(snapshot) -> dict[str, int]:
    """One device's snapshot of a PyTorch memory tracker, keyed by plain strings."""
    [per_device] = snapshot.values()
    return {str(k.value if hasattr(k, "value") else k): int(v) for k, v in per_device.items()}


def _saved_bytes(saved: dict, logits) -> int:
    """Saved for backward, each storage once, and the logits the loop holds. (A function,
    so that no reference to a storage outlives the count.)"""
    live = {k: r() for k, r in saved.items() if r() is not None}
    st = _local(logits).untyped_storage()
    live[st._cdata] = st
    return sum(s.nbytes() for s in live.values())


def measure_worker(rank: int, world: int, port: int, plan_path: str, overrides: list[str],
                   out: str) -> None:
    """Run two trainer steps of the plan; measure the second. Rank 0 saves the figures."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    import tpplan
    from tpplan.models import build_model, init_weights, materialize
    from tpplan.parallel.context.sequence import shard_batch
    from tpplan.parallel.mesh import dp_rank

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    plan = tpplan.load(plan_path, overrides)
    shape = plan.step_shape(world)
    mesh = plan.build_mesh("cpu")
    try:
        model = build_model(plan.model, "meta", real_buffers=True)
        if plan.spec.float8 is not None:  # torchao's emulated float8 on CPU, as the dry run traces it
            from tpplan.parallel.float8 import apply_float8, gathers_float8

            apply_float8(model, plan.spec, gathers_float8(plan.spec, plan.parallel_dims(world)), emulate=True)
        model = plan.apply(model, mesh)
        materialize(model, "cpu")
        init_weights(model, 0, "cpu", plan.model)
        t = plan.train
        optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, eps=t.eps,
                                      weight_decay=t.weight_decay)
        accum, micro = shape.grad_accum, shape.micro_batch
        gen = torch.Generator().manual_seed(dp_rank(mesh))  # tp peers: the same batch
        vocab = 64
        held = {"logits": None, "loss": None}
        known: set = set()
        figures = {"end_forward": [], "end_backward": [], "saved": []}

        def step(batch, mt=None):
            for m in range(accum):
                x = batch[m * micro:(m + 1) * micro]
                if accum > 1:
                    model.set_requires_gradient_sync(m == accum - 1)
                if mt is not None:
                    mt.reset_mod_stats()
                saved = {}  # storage -> a weak reference: measuring must not keep it alive

                def pack(tensor, saved=saved):
                    st = _local(tensor).untyped_storage()
                    if not isinstance(tensor, torch.nn.Parameter) and st._cdata not in known:
                        saved[st._cdata] = weakref.ref(st)
                    return tensor

                # under cp, this rank's part of the sequence (the trainer's shard_batch)
                inputs, targets, kwargs = shard_batch(model, x[:, :-1], x[:, 1:])
                with plan.loss_context():
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
                        held["logits"] = model(inputs, **kwargs)
                        held["loss"] = F.cross_entropy(held["logits"].flatten(0, 1).float(),
                                                       targets.flatten()) / accum
                    if mt is not None:
                        figures["end_forward"].append(_plain(mt.get_tracker_snapshot()))
                        figures["saved"].append(_saved_bytes(saved, held["logits"]))
                    held["loss"].backward()
                if mt is not None:
                    figures["end_backward"].append(_plain(mt.get_tracker_snapshot()))
            if mt is not None:
                figures["gradients"] = _bytes(p.grad for p in model.parameters())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def batch():
            return torch.randint(0, vocab, (accum * micro, shape.seq_len + 1), generator=gen)

        step(batch())
        b = batch()
        # Buffers and the batch are saved by some ops, but are not activations.
        known = {_local(t).untyped_storage()._cdata for t in [*model.buffers(), b]}
        figures["parameters"] = _bytes(model.parameters())
        figures["checkpointing"] = plan.activation_checkpointing.enabled
        figures["optimizer"] = _bytes(v for s in optimizer.state.values() for v in s.values())
        mt = _group_aware_tracker()(model, optimizer)
        mt.track_inputs((b, held["logits"], held["loss"]))
        held_by_fsdp = _fsdp_state_mode(model)
        with mt, held_by_fsdp:
            figures["start"] = _plain(mt.get_tracker_snapshot())
            step(b, mt)
        figures["fsdp_state_max"] = held_by_fsdp.largest
        dev = torch.device("cpu")
        figures["peak"] = _plain(mt.get_tracker_snapshot("peak"))
        unsharded = [0]
        for stats in mt.memory_tracking.values():
            for snaps in stats.snapshots.values():
                for snap in snaps:
                    unsharded.append(snap.get(dev, {}).get("Unsharded Param", 0))
        figures["fsdp_unsharded_max"] = max(unsharded)
        figures["by_module"] = {  # where the peak is: each module's moments, by part
            f"{stats.mod_fqn} {str(state.value if hasattr(state, 'value') else state)}":
                [{str(k.value if hasattr(k, "value") else k): int(v)
                  for k, v in snap.get(dev, {}).items()} for snap in snaps]
            for stats in mt.memory_tracking.values() for state, snaps in stats.snapshots.items()}
        if rank == 0:
            (Path(out) / "measured.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def _group_aware_tracker():
    """``FSDPMemTracker`` that keeps FSDP2's hooks of a unit of several modules
    (``fully_shard([norm, output])``) as FSDP2 registers them: one hook pair for the group,
    gathered at its first module's forward and resharded after its last one's. PyTorch's
    tracker (2.13, ``_instrument_fsdp_module``) hooks each module of the group on its own, so
    the unit is resharded after ``norm`` and gathered again for ``output``, while the first
    all-gather buffer is still held (FSDP2 defers its free to the next copy-out): a step the
    trainer never runs, one vocabulary-sized buffer more at the head's forward. On exit it
    puts the group's hooks back (its own puts per-module ones, which keep the double gather)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_state import _register_group_forward_hooks

    def groups(root):
        states = {id(s): s for m in root.modules() if isinstance(m, FSDPModule)
                  for s in [m._get_fsdp_state()] if s._fsdp_param_group and len(s._modules) > 1}
        return states.values()

    def drop(module, state) -> None:
        """Remove the per-module hooks a tracker left on ``module`` for ``state``."""
        ours = (state._pre_forward, state._post_forward)  # raw, or wrapped by the tracker
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if hook in ours or getattr(hook, "__wrapped__", None) in ours:
                    del hooks[key]
                    module._forward_pre_hooks_with_kwargs.pop(key, None)
                    module._forward_hooks_always_called.pop(key, None)

    def regroup(state, pre, post) -> None:
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        for module in state._modules:
            drop(module, state)
        handle = _register_group_forward_hooks(state._modules, pre, post,
                                               state._modules_to_run_forward,
                                               state._cast_output_dtype)
        state._pre_forward_hook_handle = state._post_forward_hook_handle = handle

    class GroupAware(FSDPMemTracker):
        def _instrument_fsdp_module(self) -> None:
            super()._instrument_fsdp_module()
            for state in groups(self._root_mod):
                pres = {m: self._fsdp_state_pre_forward(m, state._pre_forward)
                        for m in state._modules}
                posts = {m: self._fsdp_state_post_forward(m, state._post_forward)
                         for m in state._modules}
                regroup(state, lambda m, *a, pres=pres, **k: pres[m](m, *a, **k),
                        lambda m, *a, posts=posts: posts[m](m, *a))

        def _deregister_module_and_optimizer_hooks(self) -> None:
            super()._deregister_module_and_optimizer_hooks()
            for state in groups(self._root_mod):
                regroup(state, state._pre_forward, state._post_forward)

    return GroupAware


def _fsdp_state_mode(model):
    """A dispatch mode that reads, after every op, the bytes FSDP2's own state holds
    unsharded: each unit's all-gather output while its ``_all_gather_result`` is pending
    (issued, prefetched, not yet copied out) and every parameter's unsharded storage (zero
    once resharded). Read from FSDP2's objects, not from tpplan's tracker."""
    from torch.distributed.fsdp import FSDPModule
    from torch.utils._python_dispatch import TorchDispatchMode

    groups = [g for m in model.modules() if isinstance(m, FSDPModule)
              for g in m._get_fsdp_state()._fsdp_param_groups]

    class Mode(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.distributed.tensor import DTensor

            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            out = func(*args, **(kwargs or {}))
            storages = {}
            for g in groups:
                pending = g._all_gather_result
                if pending is not None:
                    st = pending.all_gather_output.untyped_storage()
                    storages[st._cdata] = st.nbytes()
                for p in g.fsdp_params:
                    for t in getattr(p, "all_gather_outputs", []):
                        st = t.untyped_storage()
                        storages[st._cdata] = st.nbytes()
            Mode.largest = max(Mode.largest, sum(storages.values()))
            return out

    return Mode()


class _Collectives:
    """Every collective a process issues, as (process group, kind, bytes of its buffer): a
    dispatch mode of its own (CommDebugMode's module tracker does not survive the trainer's
    model building), written independently of tpplan's recorder."""

    KINDS = {"all_reduce": "all_reduce", "allreduce_": "all_reduce",
             "all_gather_into_tensor": "all_gather", "_allgather_base_": "all_gather",
             "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base_": "reduce_scatter",
             "all_to_all_single": "all_to_all"}
    # The autograd all-to-all (Ulysses) reaches the mode as its own op, not the inner one.
    NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d")

    def __init__(self, accum: int):
        from torch.utils._python_dispatch import TorchDispatchMode

        rows = self.rows = []
        kinds, namespaces = self.KINDS, self.NAMESPACES
        # Where the step is: after the last micro-batch's backward and before the
        # optimizer step the trainer clips gradients (a norm per group of them).
        state = self.state = {"in_backward": False, "backwards": 0, "optimizer": False}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                import torch
                import torch.distributed as dist
                from torch.distributed.tensor import DTensor

                if any(issubclass(t, DTensor) for t in types):
                    return NotImplemented  # see the collectives DTensor issues inside its ops
                if torch._C._current_graph_task_id() != -1:
                    state["in_backward"] = True
                elif state["in_backward"]:
                    state["in_backward"] = False
                    state["backwards"] += 1
                out = func(*args, **(kwargs or {}))
                name = func._overloadpacket.__name__
                if name in kinds and func.namespace in namespaces:
                    if func.namespace == "c10d":  # FSDP2: (output, input, process group, ...)
                        pg = next(a for a in args if isinstance(a, torch.ScriptObject))
                        group = dist.ProcessGroup.unbox(pg).group_name
                        t = args[1] if name == "_reduce_scatter_base_" else args[0]
                        nbytes = sum(x.numel() * x.element_size() for x in
                                     (t if isinstance(t, list) else [t]))
                    else:  # DTensor: (input, ..., group name); all-gathers get a shard
                        group = args[-1]
                        t = args[0]
                        size = args[-2] if name == "all_gather_into_tensor" else 1
                        nbytes = t.numel() * t.element_size() * size
                    phase = "optimizer" if state["optimizer"] else \
                        "clipping" if state["backwards"] >= accum else "step"
                    rows.append((group, kinds[name], nbytes, phase))
                return out

        self.mode = Mode()


def trainer_collectives_worker(rank: int, world: int, port: int, plan_path: str,
                               overrides: list[str], out: str) -> None:
    """One step of ``tpplan train`` itself under a collective recorder; rank 0 saves every
    collective as (mesh dimension, kind, bytes, phase of the step). The process group is started here, so the
    trainer leaves it running and the groups can be named afterwards."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import warnings

    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    import tpplan
    from tpplan.train import train

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    plan = tpplan.load(plan_path, overrides)
    dims = plan.parallel_dims(world)
    dist.init_process_group("gloo")
    try:
        rec = _Collectives(plan.step_shape(world).grad_accum)

        def optimizer_step(*args) -> None:
            rec.state["optimizer"] = True

        from torch.optim.optimizer import register_optimizer_step_pre_hook

        hook = register_optimizer_step_pre_hook(optimizer_step)
        with rec.mode:
            train(plan_path, overrides, device_type="cpu")
        hook.remove()
        # Name each group by its ranks: tp groups are runs of consecutive ranks,
        # dp_shard groups stride over them (the mesh is (dp_replicate, dp_shard, tp)).
        names = {}
        for group, *_ in rec.rows:
            if group not in names:
                pg = _resolve_process_group(group)
                ranks = dist.get_process_group_ranks(pg)
                stride = ranks[1] - ranks[0] if len(ranks) > 1 else 0
                desc = getattr(pg, "group_desc", "")
                if desc in ("mesh_cp", "mesh_dp_shard_cp"):  # ranks alone cannot tell them apart
                    names[group] = desc.removeprefix("mesh_")
                    continue
                names[group] = ("tp" if len(ranks) == dims.tp and stride == 1 else
                                "dp_shard" if len(ranks) == dims.dp_shard and stride == dims.tp
                                else "world" if len(ranks) == world else str(ranks))
        if rank == 0:
            rows = [(names[g], kind, nbytes, phase) for g, kind, nbytes, phase in rec.rows]
            (Path(out) / "collectives.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()
