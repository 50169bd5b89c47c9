"""What every training process imports, imported once by kubetrain.trainer.launch's fork server.

Importing this module is its whole purpose: the training loop, torch with it,
torch._dynamo, which building the first optimizer would otherwise import (0.6 s:
torch.optim's methods are wrapped by `torch._disable_dynamo`), and Liger Kernel's loss
where it is installed (`loss.preload_fused_loss`). On an H100, a rank restarted in place
took 6.3 s from the kill to its first step while it imported Liger itself, 2.1 s with
Liger preloaded (plain torchrun: 10.1 s). Nothing here may touch a device: a fork server
that initialised CUDA forks ranks that cannot use it, so the loss's preload refuses any
import that would.
The collector is off while they load, and what they created is frozen out of its later
passes, as kubetrain.trainer.__main__ does for a process that imports them itself.
"""

from kubetrain.trainer.collector import collector_paused

with collector_paused():
    import torch._dynamo  # noqa: F401

    import kubetrain.trainer.loop  # noqa: F401
    from kubetrain.trainer.loss import preload_fused_loss

    preload_fused_loss()
