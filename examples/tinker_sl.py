"""Supervised fine-tuning with the Tinker SDK, against a self-hosted trainwire server.

    trainwire serve --listen 127.0.0.1:50051 --state-dir state --model-root models \\
        --token-file key.txt --tinker-listen 127.0.0.1:8000 --tinker-token-file key.txt
    # key.txt holds tml-...; it keys both ports (a keyed front beside an open gRPC port is refused)
    TINKER_API_KEY=tml-... python examples/tinker_sl.py http://127.0.0.1:8000 llama

The loop is the SDK docs' own; only base_url (and the key) point at trainwire. A rank-8 LoRA
adapter memorizes two sentences: the mean loss per token falls from about 6.2 (a fresh tiny
model's guess among 500 tokens) to below 0.5 in 40 steps, and the model then completes them.
"""

import sys

import tinker
from tinker import types

base_url, base_model = sys.argv[1], sys.argv[2]
service_client = tinker.ServiceClient(base_url=base_url)
training_client = service_client.create_lora_training_client(base_model=base_model, rank=8).result()
tokenizer = training_client.get_tokenizer()

texts = ["The capital of France is Paris.", "Water boils at 100 degrees Celsius."]
data = []
for text in texts:
    tokens = tokenizer.encode(text)
    data.append(
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
    )
target_tokens = sum(len(datum.loss_fn_inputs["target_tokens"].data) for datum in data)

for step in range(40):
    fwd_bwd_future = training_client.forward_backward(data, "cross_entropy")
    optim_future = training_client.optim_step(types.AdamParams(learning_rate=5e-3))
    loss = fwd_bwd_future.result().metrics["loss:sum"] / target_tokens  # the mean per token
    optim_future.result()
    if step % 5 == 0 or step == 39:
        print(f"step {step}: loss {loss:.4f}")

sampling_client = training_client.save_weights_and_get_sampling_client().result()
prompt = tokenizer.encode("The capital of France is")
greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
sample = sampling_client.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
print(f"The capital of France is -> {tokenizer.decode(sample.sequences[0].tokens)!r}")
training_client.save_state("final").result()
service_client.close("success").result()
