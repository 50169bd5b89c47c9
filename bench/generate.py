"""Generation cost per token against the context length: the SSM student and its teacher.

    OMP_NUM_THREADS=1 python bench/generate.py [--contexts 256,1024,4096] [--tokens 64]
                                               [--rounds 5] [--preset tiny]

Both models have the preset's dimensions (an SSM sized from a transformer, as
`model.fromTeacher` sizes it) and random weights: the cost of a token does not depend
on what the weights are. From a prompt of each context length, each model first takes
the prompt as `kubetrain generate` does (`generate.sample`: the SSM's parallel prefill,
the transformer's forward over it), untimed; then N tokens are generated greedily with
the calls `sample` makes for each token - the SSM's recurrent `step` from its state,
the transformer's forward over its whole context (it has no key/value cache) - and
timed. A check first asserts that this loop produces what `sample` produces. Rounds
alternate contexts and models so machine noise hits all; medians are reported. Prints
ms per token at each context and, per model, the ratio of the longest context's to the
shortest's (goal for the SSM: <= 1.2; the transformer's grows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kubetrain.api.presets import PRESETS
from kubetrain.trainer.architecture import LanguageModel, build_model
from kubetrain.trainer.generate import sample
from kubetrain.trainer.ssm import StateSpaceModel


def decode(model: LanguageModel, prompt: list[int], tokens: int) -> tuple[list[int], float]:
    """Greedily generate `tokens` tokens after `prompt` as `generate.sample` does; returns
    them and the seconds the tokens after the prompt's own pass took."""
    context = torch.tensor([prompt])
    produced: list[int] = []
    with torch.no_grad():
        if isinstance(model, StateSpaceModel):
            logits, states = model.prefill(context)
            token = int(logits[0, -1].argmax())
            started = time.perf_counter()
            for _ in range(tokens):
                produced.append(token)
                stepped, states = model.step(torch.tensor([token]), states)
                token = int(stepped[0].argmax())
        else:
            token = int(model(context)[0, -1].argmax())
            started = time.perf_counter()
            for _ in range(tokens):
                produced.append(token)
                context = torch.cat([context, torch.tensor([[token]])], dim=1)
                token = int(model(context[:, -model.max_seq_len:])[0, -1].argmax())
        elapsed = time.perf_counter() - started
    return produced, elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="256,1024,4096",
                        help="prompt lengths, comma-separated (default 256,1024,4096)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens generated per measurement (default 64)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (default 5)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS),
                        help="dimensions of both models (default tiny)")
    args = parser.parse_args()
    contexts = [int(value) for value in args.contexts.split(",")]
    dims = PRESETS[args.preset].dims
    longest = max(contexts) + args.tokens + 1  # the transformer never crops its context
    torch.manual_seed(0)
    models = {"ssm student": build_model("ssm", dims, max_seq_len=longest).eval(),
              "transformer teacher": build_model("transformer", dims,
                                                 max_seq_len=longest).eval()}
    generator = torch.Generator().manual_seed(1)
    prompts = {length: torch.randint(0, dims.vocab_size, (length,),
                                     generator=generator).tolist() for length in contexts}
    print(f"{args.preset} dimensions (dim {dims.dim}, {dims.n_layers} layers, vocabulary "
          f"{dims.vocab_size}), {torch.get_num_threads()} thread(s), {args.tokens} tokens "
          f"per measurement, median of {args.rounds} rounds")
    for model in models.values():  # the loop timed is generate's; and a warm-up
        expected = sample(model, prompts[contexts[0]], max_tokens=4, temperature=0, top_k=None)
        assert decode(model, prompts[contexts[0]], 4)[0] == expected
    times: dict[tuple[str, int], list[float]] = {(name, length): [] for name in models
                                                 for length in contexts}
    for round_index in range(args.rounds):
        order = contexts if round_index % 2 == 0 else contexts[::-1]
        for length in order:
            for name, model in models.items():
                seconds = decode(model, prompts[length], args.tokens)[1]
                times[name, length].append(seconds / args.tokens)
    median = {key: statistics.median(values) for key, values in times.items()}
    print(f"\n| context | {' | '.join(f'{name} ms/token' for name in models)} |")
    print(f"|---|{'---|' * len(models)}")
    for length in contexts:
        cells = " | ".join(f"{1000 * median[name, length]:.2f}" for name in models)
        print(f"| {length} | {cells} |")
    shortest, last = min(contexts), max(contexts)
    for name in models:
        ratio = median[name, last] / median[name, shortest]
        goal = " (goal <= 1.2)" if name.startswith("ssm") else ""
        print(f"{name}: {last} / {shortest} tokens of context = {ratio:.2f}{goal}")


if __name__ == "__main__":
    main()
