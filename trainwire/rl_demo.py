"""``trainwire demo --rl``: the RL loop on the embedded tiny causal model, end to end.

Each round samples a group of completions per prompt from the live weights, scores each with a
programmatic reward (how often it says :data:`TARGET_WORD`), centres the rewards within each group
(GRPO's advantage: a group whose samples all score the same carries no signal), and applies one
``importance_sampling`` forward_backward and one optim_step through a local server. The sampler's
logprobs are the trainer's own, so every ratio is 1 (to the last bits of a padded batch) and the
loss is the on-policy policy gradient. The mean reward starts near zero (a fresh model says the
word about once in 500 tokens) and rises to about 1 in 20 rounds; the curve and a summary land in
the work directory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainwire.contract.config import LoraSettings, TrainingConfig
from trainwire.contract.tokens import TokenExample
from trainwire.demo import DemoDirs, demo_client, model_found_by

if TYPE_CHECKING:
    from trainwire.client.session.session_client import SessionClient
    from trainwire.contract.outcomes import Sample

MODEL_NAME = "tiny-llama-rl"
RUN_ID = "rl-demo"
TARGET_WORD = " great"  # one token of the tiny tokenizer ("Ġgreat"), so the reward is a count
PROMPTS = ("The movie was", "The food was", "The service was", "The hotel room was")
SUMMARY_FORMAT = "trainwire.rl_summary/v1"
SUMMARY_STEM = "rl_summary"
CURVE_FILE = "reward_curve.png"


@dataclass(frozen=True)
class RlDemoSettings:
    """The RL demo's defaults (what ``trainwire demo --rl`` runs); ``fast`` trims them for tests.

    Full weights, at a constant rate (a constant schedule needs no ``max_steps``, which an
    open-ended loop does not know). ``lora`` takes an adapter instead, but on this fresh model an
    r=8 all-linear adapter at this rate left the reward flat over the 20 rounds when tried.
    """

    rounds: int = 20
    group_size: int = 8
    max_tokens: int = 16
    learning_rate: float = 3e-2  # Adam at a high rate: the tiny model finds the word in ~12 rounds
    lora: LoraSettings | None = None
    seed: int = 0

    @classmethod
    def fast(cls) -> RlDemoSettings:
        return cls(rounds=10)


@dataclass(frozen=True)
class RlResult:
    """What the demo did: one record per round, the final state digest, the files written."""

    rounds: list[dict[str, Any]]
    state_digest: str
    files: dict[str, Path] = field(default_factory=dict)

    @property
    def rewards(self) -> list[float]:
        return [r["mean_reward"] for r in self.rounds]


def reward(tokens: Sequence[int], target: int) -> float:
    """The fraction of sampled tokens that are the target word (0 for an empty sample)."""
    return sum(token == target for token in tokens) / len(tokens) if tokens else 0.0


def group_advantages(rewards: Sequence[float]) -> list[float]:
    """Each reward minus its group's mean: better than the group's average pushes up."""
    mean = sum(rewards) / len(rewards)
    return [r - mean for r in rewards]


def rl_example(
    prompt: Sequence[int], prompt_logprobs: Sequence[float], sample: Sample, advantage: float
) -> TokenExample:
    """Prompt plus sample as one shifted sequence; only the sampled targets carry the advantage.

    ``sample.logprobs[i]`` is q of ``sample.tokens[i]``, the target at position
    ``len(prompt) - 1 + i``; the prompt's own targets get the forward's logprobs and advantage 0,
    so they add nothing to the loss or its gradient.
    """
    sampled = len(sample.tokens)
    return TokenExample.from_sequence(
        [*prompt, *sample.tokens],
        logprobs=[*prompt_logprobs, *sample.logprobs],
        advantages=[0.0] * len(prompt_logprobs) + [advantage] * sampled,
    )


def rl_round(
    client: SessionClient,
    prompts: Sequence[Sequence[int]],
    target: int,
    index: int,
    settings: RlDemoSettings,
) -> dict[str, Any]:
    """One round: sample, score, one importance-sampling update. Returns the round's record."""
    started = time.monotonic()
    # The prompts' own target logprobs, once a round (the weights are the same for every group).
    prompt_logprobs = client.forward([TokenExample.from_sequence(p) for p in prompts]).logprobs
    examples, rewards, sampled = [], [], 0
    for i, prompt in enumerate(prompts):
        samples = client.sample(
            prompt,
            max_tokens=settings.max_tokens,
            num_samples=settings.group_size,
            temperature=1.0,
            seed=settings.seed * 1_000_003 + index * len(prompts) + i,  # one per round and prompt
        )
        sampled += sum(len(s.tokens) for s in samples)
        group = [reward(s.tokens, target) for s in samples]
        rewards.extend(group)
        if len(set(group)) == 1:
            continue  # every sample scored alike: no advantage, nothing to learn from this group
        pairs = zip(samples, group_advantages(group), strict=True)
        examples.extend(rl_example(prompt, prompt_logprobs[i], s, a) for s, a in pairs)
    record: dict[str, Any] = {"round": index, "mean_reward": sum(rewards) / len(rewards)}
    record.update(loss=None, ratio_max=None)  # no update when every group scored alike
    if examples:
        outcome = client.forward_backward(
            examples, operation_key=f"rl/{index}/fb", loss_fn="importance_sampling"
        )
        record.update(loss=outcome.loss, ratio_max=outcome.metrics["ratio:max"])
        client.optim_step(operation_key=f"rl/{index}/step")
    record["examples"] = len(examples)
    record["sampled_tokens"] = sampled
    record["tokens_per_s"] = sampled / (time.monotonic() - started)  # the whole round's time
    return record


# The tiny model's positions: a prompt and its sample fit, and a session refuses a max_length
# its model cannot hold.
RL_MAX_LENGTH = 256


def rl_config(model: str, settings: RlDemoSettings) -> TrainingConfig:
    """The session's config: the defaults but for the rate and a constant schedule, so the loop
    needs no ``max_steps`` (``examples/rl_loop.py`` opens the same one)."""
    return TrainingConfig(
        model=model,
        task="causal-lm",
        lora=settings.lora,
        learning_rate=settings.learning_rate,
        lr_scheduler="constant",
        max_length=RL_MAX_LENGTH,
        seed=settings.seed,
    )


def run_rl_demo(
    work_dir: Path,
    *,
    server: str | None = None,
    settings: RlDemoSettings = RlDemoSettings(),  # frozen, so one shared default is safe
    quiet: bool = False,
    run_id: str = RUN_ID,
) -> RlResult:
    """Build the tiny model, serve it (unless ``server`` is given), run the loop, report."""
    from trainwire.testing import make_tiny_model

    dirs = DemoDirs.at(work_dir)
    make_tiny_model(dirs.models / MODEL_NAME)
    config = rl_config(dirs.model_reference(server, MODEL_NAME), settings)
    rounds: list[dict[str, Any]] = []
    with demo_client(dirs, server) as client:
        with model_found_by(server, dirs):
            client.open(run_id, config)
        prompts = client.tokenize(list(PROMPTS))
        (word,) = client.tokenize([TARGET_WORD], add_special_tokens=False)
        if len(word) != 1:
            raise ValueError(f"{TARGET_WORD!r} is {len(word)} tokens here: the reward counts one")
        for index in range(settings.rounds):
            rounds.append(rl_round(client, prompts, word[0], index, settings))
            if not quiet:
                print(describe_round(rounds[-1]))
        digest = client.info().state_digest
        client.close()  # the server takes the next run (another demo's, say)
    files = write_rl_artifacts(dirs.root / "rl", rounds, digest, config, settings)
    result = RlResult(rounds, digest, files)
    print(describe_rl_result(result))  # ``quiet`` leaves out the rounds, never where results are
    return result


def write_rl_artifacts(
    directory: Path,
    rounds: list[dict[str, Any]],
    digest: str,
    config: TrainingConfig,
    settings: RlDemoSettings,
) -> dict[str, Path]:
    """``rl_summary.json`` and ``.yaml`` (the same content) and ``reward_curve.png``."""
    import yaml

    from trainwire.contract.files import write_text_atomic

    summary = {
        "format": SUMMARY_FORMAT,
        "state_digest": digest,
        "config_fingerprint": config.fingerprint(),
        "target_word": TARGET_WORD,
        "prompts": list(PROMPTS),
        "settings": asdict(settings),
        "rewards": [r["mean_reward"] for r in rounds],
        "rounds": rounds,
    }
    text = json.dumps(summary, indent=2) + "\n"
    paths = {
        "json": directory / f"{SUMMARY_STEM}.json",
        "yaml": directory / f"{SUMMARY_STEM}.yaml",
        "curve": directory / CURVE_FILE,
    }
    write_text_atomic(paths["json"], text)
    write_text_atomic(paths["yaml"], yaml.safe_dump(json.loads(text), sort_keys=False))
    plot_reward_curve(paths["curve"], summary["rewards"])
    return paths


def plot_reward_curve(path: Path, rewards: Sequence[float]) -> None:
    """Mean reward per round, as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, axis = plt.subplots(figsize=(7, 4), dpi=100)
    axis.plot(range(len(rewards)), rewards, "o-", label="mean reward")
    axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    axis.set(xlabel="round", ylabel=f"share of tokens that are {TARGET_WORD.strip()!r}")
    axis.set_ylim(bottom=0)
    axis.legend(loc="upper left")
    axis.set_title("trainwire RL demo")
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)


def describe_round(record: dict[str, Any]) -> str:
    return (
        f"round {record['round']:>3}  mean reward {record['mean_reward']:.3f}  "
        f"{record['tokens_per_s']:>6,.0f} sampled tokens/s"
    )


def describe_rl_result(result: RlResult) -> str:
    rewards = result.rewards
    head = sum(rewards[:3]) / len(rewards[:3])
    tail = sum(rewards[-3:]) / len(rewards[-3:])
    return "\n".join(
        [
            "",
            f"mean reward, first 3 rounds  {head:.3f}",
            f"mean reward, last 3 rounds   {tail:.3f}",
            f"final state digest           {result.state_digest}",
            f"summary                      {result.files['json']}",
            f"reward curve                 {result.files['curve']}",
        ]
    )
