"""Reinforcement learning with the Tinker SDK against a self-hosted trainwire server: sample a
group per prompt, score it, train with importance sampling. Start the server as in
examples/tinker_sl.py, then:

    TINKER_API_KEY=tml-... python examples/tinker_rl.py http://127.0.0.1:8000 llama

The sampler's logprobs are the trainer's own, so the importance ratio of an on-policy sample
is exactly 1 (for a group trained as one padded batch, equal to about 1e-6).
"""

import sys

import tinker
from tinker import types

base_url, base_model = sys.argv[1], sys.argv[2]
service_client = tinker.ServiceClient(base_url=base_url)
training_client = service_client.create_lora_training_client(base_model=base_model, rank=8).result()
tokenizer = training_client.get_tokenizer()
prompt = tokenizer.encode("Say something short:")
params = types.SamplingParams(max_tokens=8, temperature=1.0)


def reward(tokens: list[int]) -> float:
    return -len(tokens) / params.max_tokens  # shorter answers score higher


for step in range(10):
    sampling_client = training_client.save_weights_and_get_sampling_client().result()
    result = sampling_client.sample(types.ModelInput.from_ints(prompt), 8, params).result()
    rewards = [reward(seq.tokens) for seq in result.sequences]
    mean = sum(rewards) / len(rewards)
    data = []
    for seq, r in zip(result.sequences, rewards, strict=True):
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
    optim_future = training_client.optim_step(types.AdamParams(learning_rate=1e-3))
    fwd_bwd_future.result(), optim_future.result()
    print(f"step {step}: mean reward {mean:.3f}")

service_client.close("success").result()
