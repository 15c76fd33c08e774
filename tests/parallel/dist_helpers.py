"""Helpers of the multi-process (gloo) tests."""

import os
import sys

import torch.distributed as dist


def _leave() -> None:
    """Leave the group together: a rank that exits while another still works has aborted (SIGABRT, in a loaded
    CI run). On an error the ranks are not waited for (they may never arrive). A rank that succeeded then exits
    at once (``os._exit(0)``): about one run in twenty, a rank aborted in the interpreter's teardown *after* both
    ranks had destroyed the group ("terminate called without an active exception", gloo's threads), which
    mp.spawn reports as a failure of a test whose work had passed."""
    ok = sys.exc_info()[0] is None
    if ok:
        dist.barrier()
    dist.destroy_process_group()
    if ok:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
