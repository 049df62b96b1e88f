"""An RL loop over SessionClient, shaped like tinker-cookbook's rl_loop.py.

Each round samples a group of completions per prompt, rewards each by how often it says " great",
centres the rewards within the group and takes one importance-sampling update. The sampler's
logprobs are the trainer's own, so the update is exactly on-policy. With the defaults this is the
run ``trainwire demo --rl`` does.

    trainwire serve --listen 127.0.0.1:50051 --state-dir state --model-root models --device cpu
    python examples/rl_loop.py --server 127.0.0.1:50051 --model tiny-llama

Each run opens a run of its own (``--run-id``, default ``rl-loop-<time>``) and closes it at the
end, so the server takes the next run; a run id that is still open is refused rather than
continued from wherever it stands.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from trainwire.client import Sample, SessionClient, TokenExample, TrainingConfig

PROMPTS = ["The movie was", "The food was", "The service was", "The hotel room was"]
TARGET_WORD = " great"
GROUP_SIZE, MAX_TOKENS, LEARNING_RATE = 8, 16, 3e-2  # samples per prompt, tokens per sample


def group_examples(
    prompt: list[int], prompt_q: list[float], group: list[Sample], rewards: list[float]
) -> list[TokenExample]:
    """One example per sample: prompt + sample, advantage reward - mean on the sampled targets
    and 0 on the prompt's (``sample.logprobs[k]`` is q of ``sample.tokens[k]``)."""
    mean = sum(rewards) / len(rewards)
    if len(set(rewards)) == 1:
        return []  # a group that scored alike has no advantage to learn from
    return [
        TokenExample.from_sequence(
            [*prompt, *sample.tokens],
            logprobs=[*prompt_q, *sample.logprobs],
            advantages=[0.0] * len(prompt_q) + [r - mean] * len(sample.tokens),
        )
        for sample, r in zip(group, rewards, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", required=True, help="HOST:PORT of a running trainwire serve")
    parser.add_argument("--model", required=True, help="a causal LM under the server's model root")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--run-id",
        default=f"rl-loop-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}",
        help="the run's name on the server (default: rl-loop-<time>, a new run each time)",
    )
    args = parser.parse_args()
    config = TrainingConfig(args.model, learning_rate=LEARNING_RATE, lr_scheduler="constant")
    with SessionClient(args.server) as client:
        opened = client.open(args.run_id, config)
        if not opened.created:
            sys.exit(
                f"run {args.run_id} is already open on the server (step {opened.step}); this "
                f"loop starts runs afresh: pass another --run-id, or end that one with "
                f"trainwire close --server {args.server} --run-id {args.run_id}"
            )
        prompts = client.tokenize(PROMPTS)
        target = client.tokenize([TARGET_WORD], add_special_tokens=False)[0][0]
        for step in range(args.rounds):
            started, batch, rewards, tokens = time.monotonic(), [], [], 0
            prompt_q = client.forward([TokenExample.from_sequence(p) for p in prompts]).logprobs
            for i, prompt in enumerate(prompts):
                seed = step * len(prompts) + i
                group = client.sample(
                    prompt, max_tokens=MAX_TOKENS, num_samples=GROUP_SIZE, seed=seed
                )
                scores = [s.tokens.count(target) / len(s.tokens) for s in group]
                batch += group_examples(prompt, prompt_q[i], group, scores)
                rewards += scores
                tokens += sum(len(s.tokens) for s in group)
            if batch:
                fb_key, step_key = f"rl/{step}/fb", f"rl/{step}/step"
                client.forward_backward(batch, operation_key=fb_key, loss_fn="importance_sampling")
                client.optim_step(operation_key=step_key)
            rate = tokens / (time.monotonic() - started)
            print(f"step {step}: reward {sum(rewards) / len(rewards):.3f}  {rate:.0f} tokens/s")
        print(f"final state digest {client.info().state_digest}")
        client.close()  # ends the run on the server, which then takes the next one


if __name__ == "__main__":
    main()
