"""The tinker-cookbook's library entry points, driven the way its docs show: build the recipe's
``Config`` and call its ``main``. Run as a process from a cookbook workspace
(``trainwire.cookbook_workspace``): ``python cookbook_drivers.py <recipe> <base_url> <log_path>``.

Only what a user with a local model and local data would set differs from the recipes' own
examples: the server's address (the key comes from ``TINKER_API_KEY``), the model (the workspace's
tiny chat model under the recipes' default name), the data (local files, an environment that
needs no download) and sizes a CPU finishes in seconds.
"""

from __future__ import annotations

import asyncio
import sys

from tinker_cookbook import model_info
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

from trainwire.cookbook_workspace import CHAT_FILE, MODEL_NAME, PREFERENCE_FILE

RENDERER = model_info.get_recommended_renderer_name(MODEL_NAME)


def common(batch_size: int) -> ChatDatasetBuilderCommonConfig:
    return ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=MODEL_NAME,
        renderer_name=RENDERER,
        max_length=512,
        batch_size=batch_size,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )


def supervised(base_url: str, log_path: str) -> None:
    """The full supervised entry point on a local chat file: its NLL evaluator on the held-out
    part every two steps, and asynchronous periodic checkpoints every two steps."""
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder

    builder = FromConversationFileBuilder(common_config=common(8), file_path=CHAT_FILE, test_size=8)
    config = train.Config(
        log_path=log_path,
        model_name=MODEL_NAME,
        recipe_name="recipe_sl_basic",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=2e-4,
        lora_rank=8,
        base_url=base_url,
        eval_every=2,
        save_every=2,
        async_periodic_saves=True,
    )
    asyncio.run(train.main(config))


def rl(base_url: str, log_path: str, variant: str) -> None:
    """The full RL entry point on the arithmetic environment (no download): ``plain``, ``kl``
    (the plain synchronous loop with a KL penalty against the base model), ``async``
    (off-policy by one step) or ``stream`` (streaming minibatches)."""
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    builder = ArithmeticDatasetBuilder(
        batch_size=4,
        group_size=4,
        n_batches=2,
        model_name_for_tokenizer=MODEL_NAME,
        renderer_name=RENDERER,
    )
    options: dict = {}
    if variant == "kl":
        options = {
            "kl_penalty_coef": 0.1,
            "kl_reference_config": train.KLReferenceConfig(base_model=MODEL_NAME),
        }
    elif variant == "async":
        options = {
            "async_config": train.AsyncConfig(
                max_steps_off_policy=1, groups_per_batch=4, loss_fn="importance_sampling"
            )
        }
    elif variant == "stream":
        options = {
            "stream_minibatch_config": train.StreamMinibatchConfig(
                groups_per_batch=4, num_minibatches=2
            )
        }
    config = train.Config(
        log_path=log_path,
        model_name=MODEL_NAME,
        recipe_name="recipe_rl_basic",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=4e-4,
        lora_rank=8,
        max_tokens=8,
        base_url=base_url,
        loss_fn="importance_sampling",
        save_every=2,
        eval_every=0,
        **options,
    )
    asyncio.run(train.main(config))


def dpo(base_url: str, log_path: str) -> None:
    """The DPO recipe on a local preference file."""
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
    from tinker_cookbook.preference.preference_datasets import ComparisonBuilderFromJsonl

    builder = DPODatasetBuilderFromComparisons(
        comparison_builder=ComparisonBuilderFromJsonl(train_path=PREFERENCE_FILE),
        common_config=common(8),
    )
    config = train_dpo.Config(
        log_path=log_path,
        model_name=MODEL_NAME,
        recipe_name="recipe_dpo",
        renderer_name=RENDERER,
        dataset_builder=builder,
        learning_rate=1e-4,
        lora_rank=8,
        base_url=base_url,
    )
    train_dpo.main(config)


if __name__ == "__main__":
    recipe, url, path, *rest = sys.argv[1:]
    if recipe == "supervised":
        supervised(url, path)
    elif recipe == "rl":
        rl(url, path, rest[0] if rest else "plain")
    elif recipe == "dpo":
        dpo(url, path)
    else:
        raise SystemExit(f"unknown recipe {recipe!r}")
