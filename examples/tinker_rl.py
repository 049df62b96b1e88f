"""Reinforcement learning with the Tinker SDK against a self-hosted trainwire server: sample a
group per prompt, score it, train with importance sampling. Start the server as in
examples/tinker_sl.py, then:

    TINKER_API_KEY=tml-... python examples/tinker_rl.py http://127.0.0.1:8000 llama

The reward is programmatic: the share of sampled tokens that are digits. A fresh tiny model
writes one in about 25 tokens; within 12 steps it answers almost only in digits (about 0.04 -> 1.0).
Rewards are centred within each prompt's group (GRPO's advantage), and the sampler's logprobs
are the trainer's own, so the importance ratio of an on-policy sample is 1.
"""

import sys

import tinker
from tinker import types

base_url, base_model = sys.argv[1], sys.argv[2]
service_client = tinker.ServiceClient(base_url=base_url)
training_client = service_client.create_lora_training_client(base_model=base_model, rank=8).result()
tokenizer = training_client.get_tokenizer()
texts = ["The movie was", "The food was", "The service was", "The hotel room was"]
prompts = [tokenizer.encode(text) for text in texts]
digits = {i for token, i in tokenizer.get_vocab().items() if token.lstrip("Ġ").isdigit()}
learning_rate = 2e-2  # high, as a tiny model from scratch wants: the reward rises in ~10 steps


def params(seed: int) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=16, temperature=1.0, seed=seed)


def reward(tokens: list[int]) -> float:
    return sum(token in digits for token in tokens) / len(tokens)


for step in range(12):
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    futures = [  # a seed per step and prompt: the run is the same every time
        sampling_client.sample(types.ModelInput.from_ints(prompt), 8, params(step * 4 + i))
        for i, prompt in enumerate(prompts)
    ]
    data, rewards = [], []
    for prompt, future in zip(prompts, futures, strict=True):
        sequences = future.result().sequences
        group = [reward(seq.tokens) for seq in sequences]
        rewards += group
        mean = sum(group) / len(group)
        for seq, r in zip(sequences, group, strict=True):
            tokens, pad = prompt + seq.tokens, [0.0] * (len(prompt) - 1)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": pad + list(seq.logprobs),
                        "advantages": pad + [r - mean] * len(seq.tokens),
                    },
                )
            )
    fwd_bwd_future = training_client.forward_backward(data, "importance_sampling")
    optim_future = training_client.optim_step(types.AdamParams(learning_rate=learning_rate))
    fwd_bwd_future.result(), optim_future.result()
    print(f"step {step}: mean reward {sum(rewards) / len(rewards):.3f}")

sampling_client = training_client.save_weights_and_get_sampling_client().result()
sample = sampling_client.sample(types.ModelInput.from_ints(prompts[0]), 1, params(1000)).result()
print(f"{texts[0]!r} -> {tokenizer.decode(sample.sequences[0].tokens)!r}")
service_client.close("success").result()
