"""``RecycleTrainer(model=AutoModelForCausalLM.from_pretrained(dir))`` for a small LLaMA and GPT-2
saved in the test (nothing downloaded), 2 stages on gloo, with evaluation: before training the
pipeline's logits are transformers' and its eval loss is transformers' own model's; the Trainer
evaluates at ``eval_steps`` (LLaMA) or every epoch (GPT-2) with HF's logs and callbacks,
``predict()`` reports the loss, and after training the eval loss is that of the saved model
reloaded with ``from_pretrained``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_configs import CONFIGS

from ds_recycle.runtime.node.launcher import launch
from ds_recycle.runtime.node.preload import PRELOAD_MODULES

pytestmark = [pytest.mark.multiprocess, pytest.mark.beside]  # fault-free and bitwise: no timing

WORKER = Path(__file__).with_name("pretrained_worker.py")


STRATEGY = {"llama_untied": "steps", "gpt2": "epoch"}
EVALUATED_AT = {"steps": [0, 2, 4, 4], "epoch": [0, 4, 8, 8]}
"""Steps of the evaluations: before training, by the strategy, and after training."""


@pytest.fixture(scope="module", params=sorted(STRATEGY))
def run(request, tmp_path_factory) -> tuple[str, dict[int, dict]]:
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(out / "pretrained")
    argv = [str(WORKER), str(out / "pretrained"), str(out), STRATEGY[request.param]]
    results = launch(argv, world_size=2, timeout=240, log_dir=out / "logs", preload=PRELOAD_MODULES)
    for result in results:
        assert result.ok, f"rank {result.rank} exited {result.returncode}:\n{result.log[-4000:]}"
    return request.param, {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)}


def test_logits_and_eval_loss_before_training_are_transformers(run):
    _name, dumps = run
    last = dumps[1]
    assert last["stage"] == 1 and dumps[0]["logits"] is None
    assert torch.equal(last["logits"], last["reference_logits"])
    for dump in dumps.values():
        torch.testing.assert_close(dump["first_loss"], dump["reference_first_loss"], rtol=1e-6, atol=0)
        torch.testing.assert_close(dump["before"]["eval_loss"], dump["reference_before"], rtol=1e-6, atol=0)


def test_trainer_evaluates_by_its_strategy_with_hfs_logs_and_callbacks(run):
    name, dumps = run
    for dump in dumps.values():
        evaluated = [(step, metrics["eval_loss"]) for step, metrics in dump["evaluated"]]
        assert [step for step, _ in evaluated] == EVALUATED_AT[STRATEGY[name]]
        logged = [h for h in dump["log_history"] if "eval_loss" in h]
        assert [(h["step"], h["eval_loss"]) for h in logged] == evaluated[1:]  # train() starts a fresh history
        assert all("eval_runtime" in h and "epoch" in h for h in logged)
        assert evaluated[-1][1] < evaluated[0][1] - 0.1, "training lowered the eval loss"
        [predicted] = dump["predicted_callbacks"]
        assert predicted["test_loss"] == dump["predicted"]["test_loss"] == dump["after"]["eval_loss"]


def test_eval_loss_after_training_is_the_saved_models(run):
    _name, dumps = run
    for dump in dumps.values():
        torch.testing.assert_close(dump["after"]["eval_loss"], dump["reference_after"], rtol=1e-5, atol=0)
