"""A torchrun worker for the sharded pretrained-load test: FSDP2 ranks each load their shards.

    pretrained_worker.py OUT FOLDER [FOLDER ...]

For each FOLDER in turn (several share one launch), builds the Transformer that its
config.json describes (its family, and INL dynamics when it marks them), shards it with
the trainer's own `parallelize` (FSDP2, fp32), loads the folder with `load_pretrained`,
and writes OUT/<i>/reads-<rank>.json, i the folder's position: every ranged read this
rank made, as the pretrained module logs them (tensor name, first and last row, bytes).
Rank 0 then writes the full (unsharded) model state to OUT/<i>/state.pt.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh

from kubetrain.api.trainingjob import ParallelismSpec
from kubetrain.trainer.model import Transformer
from kubetrain.trainer.parallelize import parallelize
from kubetrain.trainer.pretrained import load_pretrained
from kubetrain.trainer.pretrained_config import read_config


class _Reads(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.reads: list[list[object]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg.startswith("read "):
            self.reads.append(list(record.args or ()))


def main(out: str, *folders: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    logger = logging.getLogger("kubetrain.trainer.pretrained")
    logger.setLevel(logging.DEBUG)
    for index, folder in enumerate(folders):
        reads = _Reads()
        logger.addHandler(reads)
        config = read_config(folder, None)
        model = Transformer(config.dims, max_seq_len=64, dynamics=config.dynamics)
        parallel = parallelize(model, ParallelismSpec(strategy="fsdp", precision="fp32"), mesh,
                               torch.device("cpu"))
        load_pretrained(parallel.module, folder, None)
        logger.removeHandler(reads)

        written = Path(out, str(index))
        written.mkdir(exist_ok=True)
        (written / f"reads-{rank}.json").write_text(json.dumps(reads.reads))
        state = get_model_state_dict(
            parallel.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(state, written / "state.pt")
    # Both ranks leave the group together: a gloo rank that tears it down while the other
    # is still writing state.pt now and then aborts ("terminate called without an active
    # exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    # Launched by tests/forked_torchrun.py: this rank is a fork, which ends without the
    # interpreter's teardown once main returns (torch's C++ teardown, which under load now
    # and then aborted with "terminate called without an active exception" after the work
    # was done).
    main(*sys.argv[1:])
