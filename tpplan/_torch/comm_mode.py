"""CommDebugMode's module tracker, repaired, and its table of c10d collectives.

Checked on torch 2.11 through 2.14.1: ``torch.distributed.tensor.debug._comm_mode`` keeps
``_CommModeModuleTracker`` (its hooks ``_fw_pre_hook``, ``_fw_set_module_hook``, ``_bw_hook``,
``_get_mod_name``, the handle ``_bw_handle`` of its global backward pre-hook, and
``register_forward_hook_handles``) and ``c10d_collective_ops``.
"""

from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker, c10d_collective_ops
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["ModuleTracker", "c10d_collective_ops"]


class ModuleTracker(_CommModeModuleTracker):
    """CommDebugMode's module tracker, with two repairs.

    - It registers a post-forward hook on a module at every call and never removes the last
      one, so a module called twice in one forward (phi's residual dropout, for the attention
      and the MLP) pops its parent twice and the trace ends in ``IndexError: list index out
      of range``. The hook of the call before is removed first, so each call pops once.
    - It learns which module a backward collective runs in from a *global full backward
      pre-hook*, which wraps every module's output in a ``BackwardHookFunction``: a model
      that then writes into a module's output in place (Llama 4's MoE adds the routed
      experts' output into the shared expert's, Gemma 3n's AltUp adds into its predictions)
      fails with "Output 0 of BackwardHookFunction is a view and is being modified
      inplace". The name is set instead by a multi-grad hook on the module's outputs,
      registered in the per-call forward hook the tracker adds last (after the plan's
      styles have turned the output into what the caller receives): it fires where the
      wrapping function's backward would, when every gradient of those outputs is in, and
      wraps nothing. A module that returns its child's output as it is (an attention
      returning its output projection's) hooks nothing more: hooks on one tensor run in the
      order they were added, so the outer module's would fire last and take the name, where
      nested wrappers give it to the inner module, the one whose code runs next.
    """

    def __enter__(self):
        super().__enter__()
        self._bw_handle.remove()  # the global full backward pre-hook, replaced as above
        self._hooked = WeakIdKeyDictionary()  # output tensors that already name a module

    def _fw_set_module_hook(self, mod, input, output):
        super()._fw_set_module_hook(mod, input, output)
        tensors = [t for t in tree_flatten(output)[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and not self.is_bw and not all(t in self._hooked for t in tensors):
            for t in tensors:
                self._hooked[t] = True
            w_mod = weakref.ref(mod)

            def named(grads):
                if w_mod() is not None:
                    self._bw_hook(w_mod(), grads)

            register_multi_grad_hook(tensors, named, mode="all")

    def _fw_pre_hook(self, mod, input):
        handle = self.register_forward_hook_handles.pop(self._get_mod_name(mod), None)
        if handle is not None:
            handle.remove()
        super()._fw_pre_hook(mod, input)
