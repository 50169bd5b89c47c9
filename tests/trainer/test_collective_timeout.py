"""A collective that times out is told apart from other errors: class CollectiveTimeout.

Two real gloo ranks: rank 1 never joins an all-reduce, so rank 0's times out after the
group's 2 s timeout, with gloo's own error. The trainer writes such an error into its
termination message as CollectiveTimeout (the operator reads the class from there);
this test shows that the check it uses recognises gloo's words, and not a plain error's.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

from kubetrain.trainer.failure_classes import is_collective_timeout

RANKS = textwrap.dedent("""
    import datetime, os, time
    import torch, torch.distributed as dist
    from kubetrain.trainer.failure_classes import is_collective_timeout

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=2))
    if dist.get_rank() == 0:
        try:
            dist.all_reduce(torch.ones(1))
        except RuntimeError as error:
            print("timeout:", is_collective_timeout(error), "|", str(error).splitlines()[0])
    else:
        time.sleep(6)  # never joins: rank 0 waits on it
    os._exit(0)  # leaving the broken group politely would wait on it again
""")


def test_a_gloo_collective_timeout_is_recognised(tmp_path: Any) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node=2", str(script)], capture_output=True, text=True,
                          timeout=120)
    line = next((line for line in done.stdout.splitlines() if line.startswith("timeout:")), "")
    print(line)
    assert line.startswith("timeout: True |"), done.stdout + done.stderr[-3000:]
    assert not is_collective_timeout(RuntimeError("CUDA error: an illegal memory access"))
