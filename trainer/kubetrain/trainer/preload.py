"""What every training process imports, imported once by kubetrain.trainer.launch's fork server.

Importing this module is its whole purpose: the training loop, torch with it, and
torch._dynamo, which building the first optimizer would otherwise import (0.6 s:
torch.optim's methods are wrapped by `torch._disable_dynamo`). Nothing here may touch a
device: a fork server that initialised CUDA forks ranks that cannot use it. That rules
out Liger Kernel's loss, whose import asks torch whether Triton fits the GPU and so
initialises CUDA (seen on an H100, 2026-11-26): a rank on CUDA imports it itself after
the preflight, 5 s of each restart there. The collector is off
while they load, and what they created is frozen out of its later passes, as
kubetrain.trainer.__main__ does for a process that imports them itself.
"""

import gc

gc.disable()
import torch._dynamo  # noqa: E402, F401

import kubetrain.trainer.loop  # noqa: E402, F401

gc.freeze()
gc.enable()
