"""The local runner: `kubetrain run` runs a TrainingJob on this machine as simulated nodes.

Torch-free at import: the trainer runs in the `torchrun` processes it starts.
"""
