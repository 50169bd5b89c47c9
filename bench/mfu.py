"""Model FLOPs utilisation of kubetrain on a GPU, beside the trainers users would pick instead.

    python bench/mfu.py [--steps 30] [--micro-batch 16] [--variants bf16-full,bf16,fp8]
    python bench/mfu.py --micro-batch 16 --peers default     # + HF/Liger and torchtitan
    python bench/mfu.py --preset llama-8b --layers 8 --micro-batch 4 \
        --variants bf16,fp8,fp8-rowwise                          # where float8 pays
    python bench/mfu.py --steps 4 --micro-batch 4,8,16 --checkpointing none,full \
        --compile on,off --variants bf16,fp8                     # peak / estimate sweep
    torchrun --nproc-per-node 8 bench/mfu.py [--variant bf16]       # FSDP2 over 8 GPUs
    torchrun --nnodes 2 --nproc-per-node 8 ... bench/mfu.py --variant bf16 --mesh hsdp
    torchrun --nproc-per-node 8 bench/mfu.py --variant bf16 --mesh tp2   # fsdp 4 x tp 2

Trains `llama-1b` (vocabulary 128256) with torch.compile and strategy fsdp through
the real `Trainer`, on the standard library's sources prepared by `kubetrain
prepare`, and prints the tokens per second and MFU that kubetrain itself reports
(its metrics log, wall time between synchronised log steps), leaving out the
compile warm-up. MFU is against the device's peak dense bf16 FLOP/s (989 TFLOP/s
for H100/H200), for fp8 too, so the variants compare directly; the goal is >= 0.5
on one H100 in bf16, and fp8 >= 1.3x bf16's tokens/s.

Peers (`--peers`, bench/peers.py): the same model dimensions, batch and process layout
in Hugging Face transformers (with Liger Kernel, torch.compile and gradient
checkpointing in the combinations named) and in torchtitan (its Llama 3 and its own
parallelize path), each in a fresh process; the table ends with kubetrain's bf16
tokens/s over the best peer's (goal >= 1.0).

Variants (one fresh process each, so each has its own compile and peak memory):
- `bf16-full`: bf16, the loss through the full logits (KUBETRAIN_OUTPUT_LOSS=full,
  what the trainer did before loss.py);
- `bf16-chunked`: bf16, the pure-PyTorch chunked loss;
- `bf16`: bf16, the loss the trainer picks (Liger's fused one when installed);
- `fp8`: parallelism.precision fp8 (torchao), the trainer's default float8 recipe;
- `fp8-tensorwise`, `fp8-rowwise`, `fp8-rowwise-gw-hp`: fp8 with that torchao recipe
  (KUBETRAIN_FLOAT8_RECIPE).
Each prints its peak GPU memory (the allocator's peak reservation plus what the
process holds outside it: CUDA context, cuBLAS workspaces) next to `kubetrain
estimate` for the same job (goal: within 10 %).

With one process the model trains unwrapped under bf16 autocast (FSDP2 over a
world of one would shard nothing); under torchrun with several GPUs it is sharded
with FSDP2 and runs the one `--variant` given. Without CUDA it prints why and exits 0.

Meshes (`--mesh`, mesh.py): `fsdp` (the default), `hsdp` (shard within a node of
LOCAL_WORLD_SIZE GPUs, replicate across nodes), `tpN` (fsdp x tensorParallel N) and
`hsdp-tpN`. HSDP only differs from fsdp across nodes and tensor parallelism only pays
where a model's memory needs it, so a single GPU, or one node for hsdp, cannot show
their speed: the bench says so and exits 0 instead of printing a number that means
nothing. Comparing meshes is a run per mesh on the same machines, tokens/s over
fsdp's.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from peers import parse_variant  # bench/peers.py, beside this script

from kubetrain.api.manifest import parse_job
from kubetrain.api.trainingjob import TrainingJob
from kubetrain.local.workspace import copy_stdlib_sources
from kubetrain.trainer import Trainer
from kubetrain.trainer.estimate import GIB, estimate_memory, job_plan
from kubetrain.trainer.loss import OUTPUT_LOSS_ENV
from kubetrain.trainer.parallelize import FLOAT8_RECIPE_ENV
from kubetrain.trainer.prepare import prepare

LOG_EVERY = 5
WARM_UP_INTERVALS = 2  # torch.compile and the allocator settle during the first steps
VARIANTS = {  # name: (precision, KUBETRAIN_OUTPUT_LOSS, KUBETRAIN_FLOAT8_RECIPE or None)
    "bf16-full": ("bf16", "full", None),
    "bf16-chunked": ("bf16", "chunked", None),
    "bf16": ("bf16", "auto", None),
    "fp8": ("fp8", "auto", None),
    "fp8-tensorwise": ("fp8", "auto", "tensorwise"),
    "fp8-rowwise": ("fp8", "auto", "rowwise"),
    "fp8-rowwise-gw-hp": ("fp8", "auto", "rowwise_with_gw_hp"),
}
# The peers' fastest candidates at llama-1b, micro-batch 16 on 80 GB (bench/peers.py).
DEFAULT_PEERS = ("hf+liger+compile", "hf+liger", "hf+liger+compile+ac-full", "hf+compile+ac-full",
                 "torchtitan+compile+ac-selective", "torchtitan+compile+ac-full")
CHILD_TIMEOUT = 300  # seconds for one variant's process: compile included


def corpus(folder: Path) -> str:
    """About 2 MB of the standard library's sources, tokenized with a 2048-token BPE."""
    texts = copy_stdlib_sources(folder / "text", max_bytes=2_000_000)
    return prepare([str(texts)], str(folder / "data"), vocab_size=2048,
                   validation_fraction=0.0, progress=False).train_uri


@dataclass(frozen=True)
class Config:
    """One measured configuration: a variant, the model and the memory-deciding settings."""

    variant: str
    preset: str
    layers: int | None  # override of the preset's depth (wide matrices that fit one GPU)
    micro_batch: int
    checkpointing: str
    compile: bool
    mesh: str = "fsdp"  # fsdp, hsdp, tpN or hsdp-tpN

    def label(self) -> str:
        model = self.preset + (f"/{self.layers}L" if self.layers else "")
        mesh = "" if self.mesh == "fsdp" else f" {self.mesh}"
        return (f"{self.variant} {model} mb{self.micro_batch} ac-{self.checkpointing}"
                f"{' compile' if self.compile else ' eager'}{mesh}")

    def arguments(self) -> list[str]:
        return ["--variant", self.variant, "--preset", self.preset, "--micro-batch",
                str(self.micro_batch), "--checkpointing", self.checkpointing,
                "--compile", "on" if self.compile else "off", "--mesh", self.mesh,
                *(["--layers", str(self.layers)] if self.layers else [])]


def mesh_settings(mesh: str, world: int, per_node: int) -> tuple[dict[str, Any], str | None]:
    """The workers and parallelism fields of `--mesh` on `world` GPUs, `per_node` to a node,
    or why this machine cannot show that mesh's speed."""
    strategy, _, tp = mesh.partition("-")
    if strategy.startswith("tp"):
        strategy, tp = "fsdp", strategy
    degree = int(tp.removeprefix("tp") or 1)
    if strategy not in ("fsdp", "hsdp") or (tp and not tp.startswith("tp")):
        raise SystemExit(f"--mesh {mesh}: use fsdp, hsdp, tpN or hsdp-tpN")
    if degree > 1 and (per_node % degree or world < 2 * degree):
        return {}, (f"--mesh {mesh} needs {2 * degree} GPUs or more, {degree} to a node, to "
                    f"show tensor parallelism's speed; this run has {world}")
    if strategy == "hsdp" and world <= per_node:
        return {}, (f"--mesh {mesh}: hsdp differs from fsdp only across nodes, and this run "
                    f"has one node ({world} GPUs)")
    return {"workers": {"replicas": world // per_node, "procsPerWorker": per_node},
            "parallelism": {"strategy": strategy, "tensorParallel": degree}}, None


def training_job(train_uri: str, folder: Path, config: Config, steps: int,
                 mesh: dict[str, Any] | None = None) -> TrainingJob:
    precision = VARIANTS[config.variant][0]
    mesh = mesh or {"workers": {}, "parallelism": {"strategy": "fsdp"}}
    model: dict[str, Any] = {"preset": config.preset, "vocabSize": 128_256}
    if config.layers:
        model["nLayers"] = config.layers
    return parse_job({
        "apiVersion": "kubetrain.io/v1alpha1", "kind": "TrainingJob",
        "metadata": {"name": "mfu"},
        "spec": {
            "image": "bench",
            "workers": mesh["workers"],
            "model": model,
            "data": {"train": train_uri, "seqLen": 2048},
            "optimization": {"maxSteps": steps, "warmupSteps": min(5, steps - 1),
                             "microBatchSize": config.micro_batch},
            "evaluation": {"everySteps": 0},
            "parallelism": {**mesh["parallelism"], "precision": precision,
                            "compile": config.compile,
                            "activationCheckpointing": config.checkpointing},
            "checkpoint": {"uri": str(folder / "checkpoints"), "everySteps": 100_000,
                           "export": False},
            "metrics": {"logEverySteps": LOG_EVERY},
        },
    })


def run_variant(config: Config, train_uri: str, steps: int) -> dict[str, Any]:
    """Train one configuration in this process; what rank 0 measured (empty on other ranks)."""
    _, output_loss, recipe = VARIANTS[config.variant]
    os.environ[OUTPUT_LOSS_ENV] = output_loss
    if recipe is not None:
        os.environ[FLOAT8_RECIPE_ENV] = recipe
    world = int(os.environ.get("WORLD_SIZE", "1"))
    mesh, _ = mesh_settings(config.mesh, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        job = training_job(train_uri, folder, config, steps, mesh)
        log = folder / "metrics.jsonl"
        torch.cuda.reset_peak_memory_stats()
        Trainer(job, metrics_log=log, serve_metrics=False).fit()
        if int(os.environ.get("RANK", "0")) != 0:
            return {}
        events = [json.loads(line) for line in log.read_text().splitlines()]
    free, total = torch.cuda.mem_get_info()
    outside_allocator = (total - free) - torch.cuda.memory_reserved()
    (start,) = [e for e in events if e["event"] == "start"]
    estimate = estimate_memory(job.spec, world, job_plan(job.spec, world),
                               start["output_loss"])
    # A memory sweep's few steps log none after the warm-up: its rates are NaN.
    logged = [e for e in events if e["event"] == "step"][WARM_UP_INTERVALS:]

    def median(key: str) -> float:
        return statistics.median(e[key] for e in logged) if logged else math.nan

    return {
        "label": config.label(), "variant": config.variant, "world": world, "mesh": config.mesh,
        "output_loss": start["output_loss"],
        "tokens_per_second": median("tokens_per_second"), "mfu": median("mfu"),
        "step_time": median("step_time"),
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak": torch.cuda.max_memory_reserved() + outside_allocator,
        "estimate": estimate.total,
    }


def report(result: dict[str, Any]) -> None:
    per_gpu = result["tokens_per_second"] / result["world"]
    print(f"{result['label']:<40} loss {result['output_loss']:<8} "
          f"{result['tokens_per_second']:>9,.0f} tokens/s ({per_gpu:,.0f} per GPU), "
          f"{result['step_time'] * 1000:.0f} ms/step, MFU {result['mfu']:.1%}; "
          f"peak {result['peak'] / GIB:.1f} GiB (allocated {result['peak_allocated'] / GIB:.1f}),"
          f" estimate {result['estimate'] / GIB:.1f} GiB, measured/estimate "
          f"{result['peak'] / result['estimate']:.2f}", flush=True)


def run_child(arguments: list[str], out: Path, label: str) -> dict[str, Any] | None:
    """One configuration in a fresh process (its own compile and peak memory)."""
    try:
        done = subprocess.run([sys.executable, *arguments, "--result", str(out)],
                              capture_output=True, text=True, timeout=CHILD_TIMEOUT)
    except subprocess.TimeoutExpired as expired:
        print(f"{label:<40} TIMED OUT after {CHILD_TIMEOUT} s:\n{str(expired.stderr)[-2000:]}",
              flush=True)
        return None
    if done.returncode != 0 or not out.exists():
        print(f"{label:<40} FAILED (exit {done.returncode}):\n"
              f"{done.stdout[-2000:]}{done.stderr[-4000:]}", flush=True)
        return None
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def run_peers(peers: list[str], micro_batch: int, steps: int, folder: Path,
              kubetrain: dict[str, Any] | None) -> None:
    """Each peer in its own process, then kubetrain's ratio to the best one that ran."""
    peers_script = Path(__file__).with_name("peers.py")
    best: dict[str, Any] | None = None
    for name in peers:
        options = parse_variant(name)
        arguments = [str(peers_script), "--peer", options["peer"], "--micro-batch",
                     str(micro_batch), "--steps", str(steps),
                     "--checkpointing", options["checkpointing"],
                     *(["--liger"] if options["liger"] else []),
                     *(["--compile"] if options["compile_"] else [])]
        result = run_child(arguments, folder / f"peer-{name}.json", name)
        if result is None:
            continue
        if result["status"] != "ok":
            print(f"{name:<40} {result['status']}: {result['reason']}", flush=True)
            continue
        print(f"{name:<40} {result['tokens_per_second']:>9,.0f} tokens/s, "
              f"{result['step_time'] * 1000:.0f} ms/step, MFU {result['mfu']:.1%}; "
              f"peak {result['peak'] / GIB:.1f} GiB", flush=True)
        if best is None or result["tokens_per_second"] > best["tokens_per_second"]:
            best = result
    if best is not None and kubetrain is not None:
        ratio = kubetrain["tokens_per_second"] / best["tokens_per_second"]
        print(f"kubetrain {kubetrain['variant']} / best peer ({best['variant']}) tokens/s: "
              f"{ratio:.2f}  (goal >= 1.0, aim 1.1)", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--micro-batch", default="16",
                        help="micro-batch, or a comma-separated list to sweep")
    parser.add_argument("--variants", default="bf16-full,bf16,fp8",
                        help=f"comma-separated, of {', '.join(VARIANTS)} (one process each)")
    parser.add_argument("--preset", default="llama-1b")
    parser.add_argument("--layers", type=int, default=None,
                        help="override the preset's depth (wide matrices on one GPU)")
    parser.add_argument("--checkpointing", default="none",
                        help="activation checkpointing: none, selective, full, or a list")
    parser.add_argument("--compile", default="on", help="on, off, or on,off to sweep")
    parser.add_argument("--peers", default="none",
                        help="'default', 'none' or comma-separated bench/peers.py variants")
    parser.add_argument("--peer-steps", type=int, default=12)
    parser.add_argument("--variant", choices=VARIANTS, default=None,
                        help="run only this one, in this process (what torchrun ranks do)")
    parser.add_argument("--mesh", default="fsdp",
                        help="fsdp, hsdp, tpN or hsdp-tpN (under torchrun with several GPUs)")
    parser.add_argument("--train", help=argparse.SUPPRESS)  # a prepared corpus, from the parent
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/mfu.py measures GPU utilisation and needs CUDA: no CUDA device here, "
              "skipped.")
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    _, cannot = mesh_settings(args.mesh, world, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    if cannot is not None:
        print(f"bench/mfu.py: {cannot}: skipped, no figure.")
        return 0
    # Every combination of the listed values, in this order (a child process runs one).
    configs = [Config(variant, args.preset, args.layers, int(micro), checkpointing,
                      compile_ == "on", args.mesh)
               for micro, checkpointing, compile_, variant in itertools.product(
                   args.micro_batch.split(","), args.checkpointing.split(","),
                   args.compile.split(","), (args.variant or args.variants).split(","))]
    print(f"device: {torch.cuda.get_device_name()} x {os.environ.get('WORLD_SIZE', '1')}; "
          f"torch {torch.__version__}; seq 2048", flush=True)

    if args.variant is not None or "WORLD_SIZE" in os.environ:
        # One configuration in this process: under torchrun every rank runs it.
        with tempfile.TemporaryDirectory() as scratch:
            # Every rank prepares into its own folder; prepare is deterministic, so they agree.
            train = args.train or corpus(Path(scratch))
            result = run_variant(configs[0], train, args.steps)
        if result:
            report(result)
            if args.result:
                Path(args.result).write_text(json.dumps(result))
        return 0

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        train = corpus(Path(scratch))
        for config in configs:
            result = run_child([__file__, *config.arguments(), "--train", train,
                                "--steps", str(args.steps)],
                               Path(scratch) / f"{len(results)}.json", config.label())
            if result is not None:
                results[config.label()] = result
                report(result)
        by_variant = {r["variant"]: r for r in results.values()}
        if "bf16" in by_variant:
            bf16 = by_variant["bf16"]
            print(f"bf16 MFU {bf16['mfu']:.1%} (goal >= 50% on one H100)")
            for variant, result in by_variant.items():
                if variant != "bf16":
                    ratio = result["tokens_per_second"] / bf16["tokens_per_second"]
                    print(f"{variant} / bf16 tokens/s: {ratio:.2f}"
                          + ("  (goal >= 1.3)" if variant.startswith("fp8") else ""))
        if args.peers != "none":
            peers = list(DEFAULT_PEERS) if args.peers == "default" else args.peers.split(",")
            run_peers(peers, configs[0].micro_batch, args.peer_steps, Path(scratch),
                      by_variant.get("bf16"))
    return 0 if results else 1


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except Exception:
        traceback.print_exc()
        raise
