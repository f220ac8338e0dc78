"""What a run's processes import, for Ray to import into its idle workers ahead of time.

A node whose raylet starts with this module in Ray's `preload_python_modules` imports it into
every Python worker it starts, before the worker takes work; the workers Ray starts ahead of a
job (one a CPU, when the first Driver connects) do it while the run connects, places and runs
its preflight, so the controller and the components skip most of their imports:

    RAY_preload_python_modules=rlinf_twoworker.preload ray start --head ...
    LocalCluster(preload=True)   # the same, for a cluster on one host

Only imports: nothing here touches a GPU. Ray assigns a GPU to a worker (CUDA_VISIBLE_DEVICES)
when it hands it a GPU actor; CUDA must not be initialised before that, or the process would
keep seeing every GPU of the node. `cuda_untouched()` says whether that still holds; the
preload warns in the worker's log when it does not.
"""

from __future__ import annotations

import logging
import time

_began = time.time()

# The order a component imports them in: torch, the library's components (which pull in
# omegaconf, numpy, the engines and the storage layer), transformers' model loading, the
# compiler the engines compile with, the actor's FSDP2 and DCP, the reward's grader.
import importlib  # noqa: E402

from rlinf_twoworker.bytecode import bulk_imports  # noqa: E402

with bulk_imports():  # no cyclic collection while they import, then frozen (bytecode.py)
    import torch
    import torch.distributed.checkpoint
    import torch.distributed.fsdp
    import transformers.modeling_utils  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    import rlinf_twoworker.run.controller  # noqa: F401
    from rlinf_twoworker import components

    for _component in components.TABLE:  # every worker module, as the table names them
        importlib.import_module(_component.worker.partition(":")[0])

    try:  # the compiler's stack (~2-3 s); a build without it compiles nothing anyway
        import torch._dynamo
        import torch._inductor.compile_fx  # noqa: F401
    except Exception:  # pragma: no cover - depends on the torch build
        pass

    try:
        import math_verify  # noqa: F401
    except Exception:  # pragma: no cover - the reward names a missing grader itself
        pass

seconds = time.time() - _began


def cuda_untouched() -> bool:
    """True while this process has neither initialised CUDA nor counted its GPUs (either fixes
    the GPUs it sees before Ray has told it which are its own)."""
    return not torch.cuda.is_initialized() and torch.cuda._cached_device_count is None


if not cuda_untouched():  # pragma: no cover - a torch or transformers release that did
    logging.getLogger("rlinf_twoworker").warning(
        "rlinf_twoworker.preload: importing the library's modules initialised CUDA in this "
        "idle Ray worker; a GPU actor it later runs would see every GPU of the node. Remove "
        "rlinf_twoworker.preload from RAY_preload_python_modules on this node and report the "
        "torch and transformers versions."
    )
