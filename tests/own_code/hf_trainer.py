"""A transformers `Trainer` script run as a job's own code (spec.trainer): a tiny Llama.

A test asset, never part of a product image. The model is built from a `LlamaConfig`
(nothing is downloaded) and trains on token ids drawn from a seeded generator. Progress
reaches the job's status through transformers' own KubeflowCallback, which transformers
adds by itself when KUBEFLOW_TRAINER_SERVER_URL is set: this script does not touch it.
Checkpoints go to the documented folder (`output_dir=sdk.checkpoint_dir()`), marked
complete by kubetrain's KubetrainCallback, which also saves and stops on SIGTERM (exit 143);
`trainer.train(resume_from_checkpoint=...)` resumes from the folder kubetrain restored.

Rank 0 prints `own-code step N loss L` per step and `own-code resumed from step N`, which
the tests read to count the steps a restart redid.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from kubetrain import sdk
from kubetrain.sdk.transformers_callback import KubetrainCallback

SEQ_LEN = 32
VOCAB = 128


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token ids, the same for the same index on every run."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (SEQ_LEN,), generator=torch.Generator().manual_seed(index))
        return {"input_ids": ids, "labels": ids.clone()}


class Steps(TrainerCallback):
    """Rank 0's one line per step, and an optional pause so a test can act mid-run."""

    def __init__(self, step_seconds: float) -> None:
        self.step_seconds = step_seconds
        self.loss: float | None = None

    def on_train_begin(self, args: TrainingArguments, state: Any, control: Any,
                       **kwargs: Any) -> None:
        if state.is_world_process_zero and state.global_step:
            print(f"own-code resumed from step {state.global_step}", flush=True)

    def on_log(self, args: TrainingArguments, state: Any, control: Any,
               logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])

    def on_step_end(self, args: TrainingArguments, state: Any, control: Any,
                    **kwargs: Any) -> None:
        if state.is_world_process_zero:
            print(f"own-code step {state.global_step} loss {self.loss}", flush=True)
        time.sleep(self.step_seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=SEQ_LEN)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(
        output_dir=str(sdk.checkpoint_dir()), max_steps=args.steps,
        save_steps=args.save_every, save_strategy="steps", logging_steps=1,
        per_device_train_batch_size=4, learning_rate=3e-3, use_cpu=True,
        ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None,
        dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(),
                      callbacks=[KubetrainCallback(), Steps(args.step_seconds)])
    latest = sdk.latest_checkpoint()
    trainer.train(resume_from_checkpoint=str(latest) if latest is not None else None)
    # Nothing left that matters: should the teardown below hang, kubetrain ends the process.
    sdk.mark_finished()
    # The process group ends here, after a barrier. Its last collective (the Trainer's
    # all_gather at the end of train()) may still be being freed on a gloo thread, which
    # needs the GIL for that; the group itself is freed with the model as main() returns,
    # and its destructor joins that thread holding the GIL: without the barrier, a rank
    # hung there now and then (py-spy: ~ProcessGroupGloo in std::thread::join, the thread
    # in ~AsyncAllgatherWork waiting for the GIL), or aborted ("terminate called without
    # an active exception"), after the last checkpoint. The barrier waits without the GIL,
    # and makes the hang rare, not impossible (docs/own-code.md).
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
