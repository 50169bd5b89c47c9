"""A transformers `TrainerCallback` that makes a `Trainer` script a well-behaved own-code job.

    from kubetrain import sdk
    from kubetrain.sdk.transformers_callback import KubetrainCallback

    args = TrainingArguments(output_dir=str(sdk.checkpoint_dir()), save_steps=500, ...)
    trainer = Trainer(model, args, ..., callbacks=[KubetrainCallback()])
    trainer.train(resume_from_checkpoint=sdk.latest_checkpoint() is not None)
    ...                                        # trainer.save_model(), an evaluation
    sdk.mark_finished()                        # then end the process group

It marks each checkpoint folder the Trainer saves (`<output_dir>/checkpoint-<step>`)
complete once every rank has written its files (every rank marks its own part: a pod
without a shared filesystem holds only its ranks' files, such as their RNG states), so
kubetrain uploads it. On SIGTERM every rank agrees at the next step's end (an all-reduce),
the Trainer saves one checkpoint there and stops, and the process exits with 143 (stopped,
not finished) so that neither kubetrain nor your script mistakes it for the end of training.
It does not mark the finish at the end of training: your script may do more after
`train()` returns, and `sdk.mark_finished()` says when it is done (docs/own-code.md).
Progress is reported by transformers' own KubeflowCallback, which it adds when
KUBEFLOW_TRAINER_SERVER_URL is set. transformers' `enable_jit_checkpoint` is not the same:
it decides per process, so a rank whose pod was not signalled never joins the save.
Imports transformers (and torch) when this module is imported, never through kubetrain.sdk.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from kubetrain.protocol import EXIT_SIGNALLED
from kubetrain.sdk.checkpoints import mark_complete
from kubetrain.sdk.stop import stop_agreed, stop_requested

# transformers' folder name for the checkpoint of a step (trainer_utils.PREFIX_CHECKPOINT_DIR).
CHECKPOINT_PREFIX = "checkpoint"


class KubetrainCallback(TrainerCallback):
    """Marks saved checkpoints complete; on SIGTERM saves, stops and exits 143."""

    def __init__(self, exit_on_stop: bool = True) -> None:
        self.exit_on_stop = exit_on_stop
        self.stopped = False
        stop_requested()  # from here on SIGTERM only sets the flag

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> TrainerControl:
        if stop_agreed():
            self.stopped = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState,
                control: TrainerControl, **kwargs: Any) -> TrainerControl:
        folder = os.path.join(args.output_dir or ".", f"{CHECKPOINT_PREFIX}-{state.global_step}")
        # Every rank, after its own files (a pod whose ranks wrote none uploads an empty part):
        # the pod's part is whole when all its ranks have said so.
        mark_complete(folder, state.global_step, sharded=args.world_size > 1)
        return control

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> TrainerControl:
        if self.stopped and self.exit_on_stop:
            sys.exit(EXIT_SIGNALLED)
        return control
