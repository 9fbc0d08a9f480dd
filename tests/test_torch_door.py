"""Every entry of the door to PyTorch's internals (``tpplan._torch``) still finds, on the
installed torch (and transformers), the private names it relies on, with the signature it
calls them with. Cheap: attribute lookups and signatures, no process group, no model.

A torch that moves or renames one of them fails here, by name, instead of in the middle of
a dry run.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import tpplan._torch as door


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _has(obj, *names: str) -> None:
    missing = [n for n in names if not hasattr(obj, n)]
    assert not missing, f"{obj!r} has no {missing} on torch {torch.__version__}"


def _dispatch():
    from torch.utils._python_dispatch import TorchDispatchMode

    _has(TorchDispatchMode, "_should_skip_dynamo")
    add = torch.ops.aten.add.Tensor
    _has(add, "_overloadpacket", "_schema")
    _has(torch._C, "_DisableTorchDispatch", "DisableTorchFunction", "_len_torch_dispatch_stack")
    assert torch._C._len_torch_dispatch_stack() == 0


def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tpplan._torch.fake import fast_key_overridable

    assert fast_key_overridable(), "FakeTensorMode._prep_args_for_hash changed its arguments"
    assert "__torch_dispatch__" in FakeTensorMode.__dict__
    with FakeTensorMode():
        t = torch.empty(2, 3)
    assert t._has_symbolic_sizes_strides is False


def _collectives():
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    assert _params(funcol.all_to_all_single_autograd)[:4] == [
        "self", "output_split_sizes", "input_split_sizes", "group"]
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd  # 2.11
    assert _params(gather)[:3] == ["self", "gather_dim", "group"]
    assert _params(funcol.all_gather_tensor)[:3] == ["self", "gather_dim", "group"]
    assert (_resolve_process_group.__doc__ or "").startswith("_resolve_process_group(group_name: str)")  # C++


def _fsdp():
    from tpplan._torch.fsdp import fsdp_internals

    param, group = fsdp_internals("_fsdp_param"), fsdp_internals("_fsdp_param_group")
    _has(param, "_chunk_with_empty", "FSDPParam")
    _has(group, "record_function")
    assert _params(param._chunk_with_empty) == ["tensor", "num_chunks", "dim"]
    annotations = inspect.get_annotations(param.FSDPParam)
    assert {"_sharded_param_data", "_orig_size"} <= set(annotations) | set(dir(param.FSDPParam))
    from torch.distributed.fsdp import FSDPModule

    _has(FSDPModule, "_get_fsdp_state")


def _mesh():
    from torch.distributed import device_mesh
    from torch.distributed.device_mesh import DeviceMesh

    _has(device_mesh, "new_group")
    assert _params(DeviceMesh._flatten)[:2] == ["self", "mesh_dim_name"]
    assert _params(DeviceMesh._unflatten)[:4] == ["self", "dim", "mesh_sizes", "mesh_dim_names"]
    assert isinstance(inspect.getattr_static(DeviceMesh, "_concatenate"), staticmethod)


def _dtensor():
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor._sharding_prop import ShardingPropagator
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _has(torch._C, "_clear_DTensor_sharding_propagator_cache")
    _has(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding, "cache_clear")
    _has(_redistribute._gen_transform_infos, "cache_clear")
    assert _params(compute_local_shape_and_global_offset)[:3] == ["global_shape", "mesh", "placements"]
    # 2.13 on: the lock; 2.11: the method sharding_propagation_marked wraps instead
    assert hasattr(ShardingPropagator, "_fake_mode_lock") or \
        _params(ShardingPropagator._propagate_tensor_meta_non_cached) == ["self", "op_schema"]


def _storage():
    _has(torch.UntypedStorage, "resize_")
    assert isinstance(torch.empty(1).untyped_storage()._cdata, int)


def _autograd():
    assert torch._C._current_graph_task_id() == -1
    assert torch._C._current_autograd_node() is None
    y = torch.ones(1, requires_grad=True) * 2
    assert isinstance(y.grad_fn._sequence_nr(), int)


def _attention():
    from tpplan._torch.attention import cpu_flash_ops

    forward, backward = cpu_flash_ops()
    assert [a.name for a in forward._schema.arguments][:5] == [
        "query", "key", "value", "dropout_p", "is_causal"]
    assert [a.name for a in backward._schema.arguments][:8] == [
        "grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal"]
    _has(torch.nn.functional, "scaled_dot_product_attention")


def _nn():
    _has(torch.nn.Module, "register_parameter")
    assert _params(torch.nn.Module.register_parameter)[:3] == ["self", "name", "param"]
    assert torch.nn.BatchNorm1d(2)._non_persistent_buffers_set == set()
    # initializers_seen: these skip a meta tensor without drawing; under it they draw on CPU
    from tpplan._torch.nn import initializers_seen

    for name in ("trunc_normal_", "orthogonal_", "sparse_", "dirac_"):
        t = torch.empty(4, 4, *([3] if name == "dirac_" else []), device="meta")
        state = torch.get_rng_state()
        assert getattr(torch.nn.init, name)(t, *([0.5] if name == "sparse_" else [])) is t, name
        assert torch.equal(torch.get_rng_state(), state), f"nn.init.{name} draws on a meta tensor"
    state = torch.get_rng_state()
    with initializers_seen(draw=True):
        seen = torch.nn.init.trunc_normal_(torch.empty(4, 4, device="meta"))
    assert seen.is_meta and not torch.equal(torch.get_rng_state(), state)


def _optim():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(1))])
    assert _params(opt._init_group) == ["group", "params_with_grad", "grads", "exp_avgs",
                                        "exp_avg_sqs", "max_exp_avg_sqs", "state_steps"]


def _cuda():
    _has(torch.cuda.memory, "_record_memory_history", "_dump_snapshot")
    assert {"enabled", "max_entries"} <= set(_params(torch.cuda.memory._record_memory_history))


def _launch():
    import logging

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    from torch.distributed.run import config_from_args, get_args_parser

    from tpplan._torch.launch import FAILURE_LOGGER

    _has(get_args_parser(), "_actions")  # shutdown_timeout_args reads its option strings
    # run_forked: torchrun's own parse, then its agent with a function entrypoint, forked
    for method in ("forkserver", "fork"):  # a CPU run's workers forked from the agent itself
        args = get_args_parser().parse_args([f"--start-method={method}", "--nproc-per-node=2", "x"])
        config, _, _ = config_from_args(args)
        assert isinstance(config, LaunchConfig) and config.start_method == method
    assert _params(elastic_launch)[:2] == ["config", "entrypoint"]
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    assert _params(dynamic_rendezvous.get_method_name) == ["depth"]  # quick_rendezvous_event_names
    assert FAILURE_LOGGER in logging.Logger.manager.loggerDict or \
        importlib.import_module(FAILURE_LOGGER).logger.name == FAILURE_LOGGER


def _pipelining():
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    from tpplan._torch.pipelining import schedule_table

    assert [t.value for t in schedules._ComputationType][:2] == ["F", "I"]
    assert _params(generate_stage_to_rank_mapping)[:3] == ["pp_size", "num_stages", "style"]
    table = schedule_table("ScheduleInterleaved1F1B", 2, 2, 4, False)
    assert sorted(table) == [0, 1] and all(table.values())


def _comm_mode():
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker, c10d_collective_ops

    _has(_CommModeModuleTracker, "_fw_pre_hook", "_fw_set_module_hook", "_bw_hook", "_get_mod_name")
    tracker = _CommModeModuleTracker()
    _has(tracker, "register_forward_hook_handles")
    assert c10d_collective_ops


def _checkpoint():
    from torch.distributed.checkpoint import FileSystemReader

    assert _params(FileSystemReader._get_metadata_path) == ["self", "rank"]


def _ops():
    from tpplan._torch.ops import reduce_scatter_base

    import torch.distributed  # noqa: F401  (registers c10d ops)

    assert reduce_scatter_base() is not None


def _transformers():
    transformers = pytest.importorskip("transformers")
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.integrations import moe

    _has(transformers.AutoModelForCausalLM, "_model_mapping")
    _has(PreTrainedModel, "_from_config", "_can_set_experts_implementation")
    assert "config" in _params(PreTrainedModel._from_config)
    assert hasattr(PretrainedConfig(), "_attn_implementation")
    _has(moe, "_can_use_grouped_mm", "grouped_mm_experts_forward")
    import transformers.masking_utils as masking

    _has(masking, "is_tracing", "find_packed_sequence_indices")


# door module -> the check of the names its entries rely on
ENTRIES = {
    "attention": _attention, "autograd": _autograd, "checkpoint": _checkpoint,
    "collectives": _collectives, "comm_mode": _comm_mode, "cuda": _cuda, "dispatch": _dispatch,
    "dtensor": _dtensor, "fake": _fake, "fsdp": _fsdp, "launch": _launch, "mesh": _mesh,
    "nn": _nn, "ops": _ops, "optim": _optim, "pipelining": _pipelining, "storage": _storage,
    "transformers": _transformers,
}


@pytest.mark.parametrize("module", sorted(ENTRIES))
def test_the_names_a_door_entry_relies_on_exist(module):
    importlib.import_module(f"tpplan._torch.{module}")
    ENTRIES[module]()


def test_every_door_module_has_its_check():
    modules = {m.name for m in pkgutil.iter_modules(door.__path__)}
    # modules.py (the parameter/child swap) has its own tests in test_module_swap.py
    unchecked = modules - set(ENTRIES) - {"modules"}
    assert not unchecked, f"door modules without a check here: {sorted(unchecked)}"


def test_the_names_used_outside_the_door_exist():
    """The two names tests/test_architecture.py lets the tensor-parallel styles use
    (``OUTSIDE_THE_DOOR``): ParallelStyle's contract and ColwiseParallel's partition hook."""
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

    assert "_apply" in ParallelStyle.__abstractmethods__
    assert _params(ParallelStyle._apply) == ["self", "module", "device_mesh"]
    assert _params(ColwiseParallel._partition_linear_fn) == ["self", "name", "module", "device_mesh"]


SIGNALS_SEEN = """
import signal, sys
from tpplan._torch.launch import run_forked

def seen(path):
    names = {signal.SIG_DFL: "default", signal.default_int_handler: "python"}
    with open(path, "w") as f:
        f.write(" ".join(names.get(signal.getsignal(s), "other")
                         for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)))

if __name__ == "__main__":  # a forkserver's worker imports this script as its main module
    for method, from_here in (("fork", True), ("forkserver", False)):
        assert run_forked(["--nnodes=1", "--rdzv-backend=c10d", "--rdzv-endpoint=localhost:0",
                           "--nproc-per-node=1", "-m", "x"], seen, (sys.argv[1] + method,), [], from_here)
"""


def test_rendezvous_events_get_the_name_torchruns_own_lookup_gives():
    """The cheap name of a rendezvous event is the one ``inspect.stack()`` gives: the method
    that called the handler's recorder (two frames up), or torchrun's placeholder past the
    top of the stack."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from tpplan._torch.launch import quick_rendezvous_event_names

    original = dynamic_rendezvous.get_method_name
    try:
        quick_rendezvous_event_names()
        quick = dynamic_rendezvous.get_method_name
        assert quick.__module__ == "tpplan._torch.launch"  # put in (earlier, if original is it)

        def record(name_of):  # the handler's recorder, as dynamic_rendezvous calls it
            return name_of(), inspect.stack()[1].function

        def keep_alive(name_of):
            return record(name_of)

        assert keep_alive(quick) == ("keep_alive", "keep_alive")
        if original is not quick:
            assert keep_alive(original) == ("keep_alive", "keep_alive")
            assert original(depth=10_000) == "no_method_name"
        assert quick(depth=10_000) == "no_method_name"
    finally:
        dynamic_rendezvous.get_method_name = original


def test_forked_workers_start_with_a_new_interpreters_signal_handlers(tmp_path):
    """Workers forked from the agent itself (``from_here``, a CPU run's) or from a server:
    SIGTERM and SIGHUP at their defaults, SIGINT Python's, not the agent's handlers that
    raise torchrun's ``SignalException`` (which a worker forked from it would inherit)."""
    import subprocess
    import sys

    from helpers import cli_env

    script = tmp_path / "seen.py"
    script.write_text(SIGNALS_SEEN)
    subprocess.run([sys.executable, str(script), str(tmp_path / "seen-")], check=True, env=cli_env(), timeout=120)
    for method in ("fork", "forkserver"):
        assert (tmp_path / f"seen-{method}").read_text() == "default python default", method
