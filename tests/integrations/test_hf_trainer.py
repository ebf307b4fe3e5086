"""``RecycleTrainer`` with pp=2 x dp=2 on CPU: real ranks started by ds_recycle's launcher running
examples/hf_trainer_llama.py. The loss falls, a run resumed from checkpoint-3 ends with the
parameters of the uninterrupted run bit for bit, and ``save_model`` output loads with
``from_pretrained`` with the trained weights and logits."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from ds_recycle.runtime.node.launcher import launch

PRELOAD = ()
"""Exec, not --preload: with transformers preloaded (imported with the agent's environment) the
ranks evaluated on other data (eval losses differ from step 6 on; docs/runtime.md), and with
torch and DeepSpeed preloaded the kill-and-re-join test failed that way once in three runs
(not understood yet)."""

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "hf_trainer_llama.py"
HERE = Path(__file__).parent
DS_CONFIG = ROOT / "ds_configs" / "hf_llama_recycle.json"
STEPS = 6
WORLD = 4
TIMEOUT = 240


def steady_ds_config(out: Path) -> Path:
    """The README's config with straggler planning off, written in ``out``: these tests compare runs
    bitwise, and on a loaded host a worker slowed by noise is planned around in one run and not in
    the other (seen in CI: a '1.59x straggler' at iteration 5 of the uninterrupted run only)."""
    config = json.loads(DS_CONFIG.read_text())
    config["recycle"]["stragglers"] = {"enabled": False}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


def example_arguments(out: Path, *extra: str, wandb: bool = False) -> list[str]:
    """The README's HF command at a small size."""
    return [
        "--deepspeed", str(steady_ds_config(out)),
        "--output_dir", str(out),
        "--max_steps", str(STEPS),
        "--save_steps", "3",
        "--logging_steps", "1",
        "--per_device_train_batch_size", "2",
        "--gradient_accumulation_steps", "4",
        "--learning_rate", "1e-2",
        "--warmup_steps", "2",
        "--lr_scheduler_type", "cosine",
        "--hidden_size", "32",
        "--num_layers", "2",
        "--seq_len", "16",
        "--samples", "128",
        "--eval_samples", "32",
        "--eval_strategy", "steps",
        "--eval_steps", "3",
        "--report_to", "wandb" if wandb else "none",
        "--disable_tqdm", "true",
        "--dump_params", str(out / "dump"),
        *extra,
    ]  # fmt: skip


def hf_environment(out: Path, wandb: bool = False) -> dict[str, str]:
    env = {"WANDB_MODE": "offline" if wandb else "disabled", "WANDB_DIR": str(out), "WANDB_SILENT": "true"}
    return env | {"WANDB_DISABLE_GIT": "true", "WANDB_DISABLE_CODE": "true", "WANDB_CONSOLE": "off"}


def run_example(
    out: Path, *extra: str, wandb: bool = False, script: Path = EXAMPLE, env: dict | None = None, dead=()
) -> dict[int, dict]:
    argv = [str(script), *example_arguments(out, *extra, wandb=wandb)]
    env = hf_environment(out, wandb) | (env or {})
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("WANDB_SERVICE", raising=False)  # ranks must start their own wandb-core
        results = launch(argv, world_size=WORLD, timeout=TIMEOUT, log_dir=out / "logs", env=env, preload=PRELOAD)
    for result in results:
        if result.rank in dead:
            assert result.returncode == -9, f"rank {result.rank} exited {result.returncode}:\n{result.log[-4000:]}"
        else:
            assert result.ok, f"rank {result.rank} exited {result.returncode}:\n{result.log[-4000:]}"
    return {rank: torch.load(out / "dump" / f"rank{rank}.pt") for rank in range(WORLD) if rank not in dead}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    base = tmp_path_factory.mktemp("hf_trainer")
    full = run_example(base / "full", wandb=True)
    resumed = run_example(base / "resumed", "--resume_from_checkpoint", str(base / "full" / "checkpoint-3"))
    return {"full": (base / "full", full), "resumed": (base / "resumed", resumed)}


pytestmark = pytest.mark.multiprocess


def test_loss_falls_and_trainer_logs_as_usual(runs):
    out, dumps = runs["full"]
    history = [h for h in dumps[0]["log_history"] if "loss" in h]
    assert [h["step"] for h in history] == list(range(1, STEPS + 1))  # logging_steps=1
    assert history[-1]["loss"] < history[0]["loss"] - 0.2
    assert all({"grad_norm", "learning_rate", "epoch"} <= set(h) for h in history)
    assert history[0]["learning_rate"] == 0.0  # linear warm-up from 0, as HF reports it
    evaluated = [h for h in dumps[0]["log_history"] if "eval_loss" in h]
    assert [h["step"] for h in evaluated] == [3, 6, 6]  # eval_steps=3, then the example's evaluate()
    assert evaluated[1]["eval_loss"] < evaluated[0]["eval_loss"]
    for dump in dumps.values():
        metrics = dump["eval_metrics"]
        assert metrics["eval_loss"] == evaluated[-1]["eval_loss"]
        assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    assert sum(d["leader"] for d in dumps.values()) == 1
    for step in (3, 6):
        checkpoint = out / f"checkpoint-{step}"
        assert (checkpoint / "latest").read_text().strip() == f"global_step{step}"
        assert (checkpoint / "trainer_state.json").exists()
        assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step
        assert sorted(p.name for p in checkpoint.glob("rng_state_*.pth")) == [f"rng_state_{r}.pth" for r in range(4)]
        assert (checkpoint / "model.safetensors.index.json").exists()


def test_resume_from_checkpoint_gives_the_uninterrupted_parameters(runs):
    _, full = runs["full"]
    _, resumed = runs["resumed"]
    for rank in range(WORLD):
        assert resumed[rank]["global_step"] == full[rank]["global_step"] == STEPS
        want, got = full[rank]["params"], resumed[rank]["params"]
        assert sorted(want) == sorted(got)
        for name in want:
            assert torch.equal(want[name], got[name]), f"rank {rank} {name}"
    full_losses = [h["loss"] for h in full[0]["log_history"] if "loss" in h]
    resumed_losses = [h["loss"] for h in resumed[0]["log_history"] if "loss" in h]
    assert resumed_losses == full_losses


def test_save_model_loads_with_from_pretrained(runs):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    out, dumps = runs["full"]
    trained = {}
    for rank in (0, 2):  # data-parallel replica 0 of stage 0 and of stage 1
        trained.update(dumps[rank]["hf_params"])
    model = LlamaForCausalLM.from_pretrained(out / "final")
    state = model.state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the config says
    assert sorted(trained) == sorted(k for k in state if k != "lm_head.weight")
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor), name

    reference = AutoModelForCausalLM.from_config(model.config)
    reference.load_state_dict(trained, strict=False)
    reference.tie_weights()
    ids = torch.randint(1, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    model.eval()
    reference.eval()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, reference(ids, attention_mask=mask).logits)


def test_one_wandb_run_shared_by_hf_and_the_recycle_monitor(runs):
    import wandb_log

    out, _ = runs["full"]
    [path] = sorted(out.glob("wandb/offline-run-*/run-*.wandb"))  # one writer: the lowest live rank
    rows = wandb_log.history(path)
    hf = [r for r in rows if "train/loss" in r]
    ours = [r for r in rows if "recycle/iteration_time_s" in r]
    assert [r["train/global_step"] for r in hf] == list(range(1, STEPS + 1))
    assert [r["train/global_step"] for r in ours] == list(range(1, STEPS + 1))
    for mine, theirs in zip(ours, hf, strict=True):
        assert mine["recycle/loss"] == pytest.approx(theirs["train/loss"], rel=1e-6)
        assert mine["recycle/membership_epoch"] == 0 and mine["recycle/samples_per_s"] > 0
    config = wandb_log.config(path)
    assert config["ds_config"]["pipeline"] == {"stages": 2} and config["recycle_topology"]["data_parallel"] == 2
    assert config["per_device_train_batch_size"] == 2  # HF's TrainingArguments, same run
    run = wandb_log.run_record(path)
    assert run.project == "ds-recycle-hf" and run.run_id.startswith("recycle-")  # the monitor's, opened by HF


def test_killing_rank_0_keeps_the_fault_free_math_and_the_wandb_run(runs, tmp_path):
    """Rank 0, stage 0 of pipeline 0, the leader and the W&B writer, is SIGKILLed after step 2: the
    survivors finish with the fault-free run's parameters, rank 1 leads, and it carries on the
    one W&B run: ReCycle's membership change and HF's train/* rows."""
    import wandb_log

    kill = {"HF_KILL_RANK": "0", "HF_KILL_AFTER": "2", "HF_KILL_DELAY": "2"}  # W&B flushes every second
    dumps = run_example(tmp_path, wandb=True, script=HERE / "hf_kill_worker.py", env=kill, dead=(0,))
    _, full = runs["full"]
    for rank, dump in dumps.items():
        assert dump["global_step"] == STEPS and dump["leader"] == (rank == 1)
        for name, value in full[rank]["params"].items():
            torch.testing.assert_close(dump["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")

    paths = sorted(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(paths) == 2 and len({wandb_log.run_record(p).run_id for p in paths}) == 1
    before, after = (wandb_log.history(p) for p in paths)
    # rank 0 dies in on_step_end of step 2, before HF logs step 2 (no one logs it: rank 1 did not lead then)
    assert [r["train/global_step"] for r in before if "train/loss" in r] == [1]
    assert [r["train/global_step"] for r in before if "recycle/iteration_time_s" in r] == [1, 2]
    [event] = [r for r in after if "recycle/event/failed" in r]
    assert event["recycle/event/failed"] == 1 and event["recycle/membership_epoch"] == 1
    assert event["recycle/live_workers/stage_0"] == 1 and event["recycle/event/recovery_s"] > 0
    assert [r["train/global_step"] for r in after if "train/loss" in r] == list(range(3, STEPS + 1))
    assert [r["train/global_step"] for r in after if "recycle/iteration_time_s" in r] == list(range(3, STEPS + 1))
    assert [r["train/global_step"] for r in after if "eval/loss" in r] == [3, 6, 6]
    assert_fault_free_evaluation(dumps, full)


def assert_fault_free_evaluation(dumps: dict[int, dict], full: dict[int, dict]) -> None:
    """The evaluations (a degraded grid's among them) give the fault-free run's eval losses."""
    reference = [(h["step"], h["eval_loss"]) for h in full[1]["log_history"] if "eval_loss" in h]
    for rank, dump in dumps.items():
        evaluated = [(h["step"], h["eval_loss"]) for h in dump["log_history"] if "eval_loss" in h]
        assert [step for step, _ in evaluated] == [step for step, _ in reference], f"rank {rank}"
        for (step, loss), (_, want) in zip(evaluated, reference, strict=True):
            assert loss == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}"


@pytest.mark.parametrize("killed", [2, 0], ids=["rank2", "leader"])
def test_a_killed_rank_rejoins_and_the_trainer_takes_up_the_job(runs, tmp_path, killed):
    """The README's command under ``ds-recycle launch --respawn``: rank ``killed`` is SIGKILLed from
    outside while every rank waits at the end of step 2; released, the survivors recover together in
    step 3 and wait at its end until the respawn's join is accepted; it re-joins (the Trainer takes
    up the engine's step, epoch, data position, LR and log history), and every rank ends with the
    fault-free parameters and the fault-free logged losses.

    The kill waits for every rank at the hold: killed while some survivors were still in step 3 and
    others already waited at its end, the ones in step 3 recovered alone and waited 120 s for the
    held ones' progress (MembershipError), seen once on a loaded host."""
    from ds_recycle.testing.jobs import Job, wait_until_held

    out = tmp_path / "rejoin"
    argv = [str(HERE / "hf_kill_worker.py"), *example_arguments(out)]
    job = Job(tmp_path, 2, 2, STEPS, {}, argv=argv, timeout=TIMEOUT, env=hf_environment(out))
    job.env["HF_PROGRESS_DIR"] = str(job.out)
    job.hold(2)
    job.start()
    try:
        wait_until_held(job, away=[], timeout=180)
        os.kill(job.pids[killed], signal.SIGKILL)
        job.wait_for_event("published_failure", slot=killed)
        job.hold(3)
        job.wait_for_event("accepted", timeout=180, kind="join", slot=killed)
        job.hold(None)
    except BaseException:
        job.kill()
        raise
    assert job.finish() == 0, job.log_tail()
    assert job.count(rf"rank {killed} respawned") == 1, "one respawn, no crash loop"
    assert job.count_in_rank_logs(r"RecycleTrainer: re-joined at step \d+") == 1, job.log_tail()
    _, full = runs["full"]
    for rank in range(WORLD):
        dump = torch.load(out / "dump" / f"rank{rank}.pt")
        assert dump["leader"] == (rank == 0)  # the lowest live rank leads
        assert_fault_free_training(dump, full, rank)
    assert_fault_free_evaluation({rank: torch.load(out / "dump" / f"rank{rank}.pt") for rank in range(WORLD)}, full)


@pytest.mark.parametrize(("victim", "sig"), [(0, signal.SIGKILL), (3, signal.SIGSTOP)], ids=["leader-killed", "hung"])
def test_a_failure_while_the_trainer_saves_is_survived_and_the_checkpoint_written_whole(runs, tmp_path, victim, sig):
    """Rank ``victim`` parks inside checkpoint-3's DeepSpeed save (after DeepSpeed's first barrier,
    before it writes its files) while the other ranks go on to wait for it in DeepSpeed's next
    barrier; it is SIGKILLed (the leader, who writes ``latest``, the index and the Trainer state) or
    SIGSTOPped (a hang, found by the heartbeat) from outside. The survivors recover inside the save,
    write checkpoint-3 again on the new plan and train on: checkpoint-3 holds the fault-free run's
    checkpoint-3 bit for bit, and the survivors end with the fault-free parameters and losses."""
    from ds_recycle.testing.jobs import Job

    out = tmp_path / "save"
    argv = [str(HERE / "hf_kill_worker.py"), *example_arguments(out)]
    job = Job(tmp_path, 2, 2, STEPS, {}, argv=argv, timeout=TIMEOUT, env=hf_environment(out), respawn=False)
    job.env |= {"HF_PROGRESS_DIR": str(job.out), "HF_TRAP": f"{victim}:checkpoint:3"}
    job.launcher_args = ["--heartbeat-min-timeout", "3"]
    job.start()
    try:
        job.signal_when_trapped(victim, sig)
        job.wait_for_event("exited", slot=victim, signal="SIGKILL")  # a hung rank is killed by its agent
    except BaseException:
        job.kill()
        raise
    assert job.finish() == 0, job.log_tail()
    failure = ": heartbeat stale" if sig == signal.SIGSTOP else ""
    assert job.count(rf"published failure of slot {victim}{failure}") == 1, job.log_tail()
    saving = r"stopped by a failure at iteration 3: (a failure was announced during )?the Trainer's checkpoint-3"
    assert job.count_in_rank_logs(saving) == WORLD - 1, job.log_tail()

    full_out, full = runs["full"]
    assert_same_checkpoint(out / "checkpoint-3", full_out / "checkpoint-3", dead=victim)
    survivors = [rank for rank in range(WORLD) if rank != victim]
    for rank in survivors:
        dump = torch.load(out / "dump" / f"rank{rank}.pt")
        assert dump["leader"] == (rank == min(survivors))
        assert_fault_free_training(dump, full, rank)


def assert_fault_free_training(dump: dict, full: dict[int, dict], rank: int) -> None:
    """Rank ``rank`` trained every step, ended with the fault-free run's parameters and logged its
    losses for every step."""
    assert dump["global_step"] == STEPS
    for name, value in full[rank]["params"].items():
        torch.testing.assert_close(dump["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"rank {rank} {name}")
    reference = [(h["step"], h["loss"]) for h in full[0]["log_history"] if "loss" in h]
    logged = [(h["step"], h["loss"]) for h in dump["log_history"] if "loss" in h]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1)), f"rank {rank}: {logged}"
    for (step, loss), (_, want) in zip(logged, reference, strict=True):
        assert loss == pytest.approx(want, rel=1e-5), f"rank {rank} step {step}"


def assert_same_checkpoint(got: Path, want: Path, dead: int) -> None:
    """Every file of ``want`` is in ``got`` (but rank ``dead``'s own RNG state); tensors (DeepSpeed's
    and the safetensors shards) equal bit for bit, ``latest`` the same, the Trainer state at the
    same step."""
    from safetensors.torch import load_file

    names = sorted(
        str(p.relative_to(want)) for p in want.rglob("*") if p.is_file() and p.name != f"rng_state_{dead}.pth"
    )
    missing = [name for name in names if not (got / name).is_file()]
    assert not missing, f"{got} lacks {missing}"
    assert (got / "latest").read_text() == (want / "latest").read_text() == "global_step3"
    for name in names:
        if name.endswith(".safetensors"):
            a, b = load_file(got / name), load_file(want / name)
        elif name.startswith("global_step3/"):
            a, b = (
                _tensors(torch.load(got / name, weights_only=False)),
                _tensors(torch.load(want / name, weights_only=False)),
            )
        else:
            continue
        assert sorted(a) == sorted(b), name
        for key in a:
            assert torch.equal(a[key], b[key]), f"{name}: {key}"
    assert json.loads((got / "trainer_state.json").read_text())["global_step"] == 3


def _tensors(value, prefix: str = "") -> dict[str, torch.Tensor]:
    """The tensors of a saved object, by their path in it."""
    if isinstance(value, torch.Tensor):
        return {prefix: value}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return {}
    return {k: v for key, item in items for k, v in _tensors(item, f"{prefix}/{key}").items()}
