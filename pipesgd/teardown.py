"""Keeps ``torch.distributed.destroy_process_group()`` a real teardown.

``torch.distributed.nn.functional`` binds ``group.WORLD`` as its functions' default arguments when
it is imported. Imported after ``init_process_group`` (the first ``torch.optim`` optimizer built
imports it, through ``torch._dynamo``), it holds the default group for good: destroying the group
then leaves its Gloo worker threads running into interpreter exit, and a worker that lets go of a
finished collective's tensors once Python is finalizing cannot take the GIL and aborts the process
(SIGABRT, "terminate called without an active exception"), after the script has finished. It
struck one run in eight of a two-rank job on a loaded host. Imported here, before any group exists
(by ``pipesgd.comm``, which every engine imports, and ``pipesgd.hooks``), its defaults are ``None``, and
``destroy_process_group()`` joins the workers while Python is still whole. A script that creates
its group before importing pipesgd is not covered (nothing short of patching torch would be).
"""

import torch.distributed as dist

if dist.is_available():
    import torch.distributed.nn  # noqa: F401  (imported for its import-time side effect, see above)
