"""The one door to PyTorch's (and transformers') internals.

Every private name of torch or transformers that tpplan uses, and every runtime patch of
their functions, lives in this package as a named function or context manager whose
docstring says what it relies on and the torch versions it was checked on (2.11 through
2.14.1). Where a name is gone in a torch version, the entry falls back or raises one clear
line naming that version. ``tests/test_architecture.py`` fails any private torch name, any
private attribute written on a torch object and any monkeypatch outside this package;
``tests/test_torch_door.py`` checks that each entry's names exist with the signature used.

By area: ``attention`` (CPU flash kernel, SDPA routing), ``autograd`` (engine state),
``checkpoint`` (DCP reader), ``collectives`` (functional collectives, groups by name),
``comm_mode`` (CommDebugMode's module tracker), ``cuda`` (memory history), ``dispatch``
(modes, pytrees, ``torch._C`` switches), ``dtensor`` (sharding caches and propagation),
``fake`` (fake tensors), ``fsdp`` (FSDP2's module path and sharding), ``launch`` (torchrun's
flags), ``mesh`` (DeviceMesh's flatten/unflatten/concatenate, its groups), ``modules``
(swapping a module's parameters or children), ``nn`` (parameter registration), ``ops``
(private-named operators), ``optim`` (lazy optimizer state), ``pipelining`` (schedule
tables), ``storage`` (storage identity and resizes), ``transformers`` (its internals).

Sits at the bottom of the layers with ``plan``: every layer may import it; it imports no
other tpplan module.
"""
