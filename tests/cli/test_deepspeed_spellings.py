"""DeepSpeed's ``deepspeed`` spellings of ``ds-recycle launch`` (issue 40): ``--num_gpus``,
``--num_nodes``, ``-H``, and the ``--include``/``--exclude`` resource filter on a hostfile and on one
node; the default number of ranks on one node. Pure: nothing is started (the launcher is replaced)."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest

from ds_recycle.cli import main
from ds_recycle.cli.common import UsageError
from ds_recycle.cli.launch import add_arguments
from ds_recycle.cli.nodes import NodeSpec, resolve
from ds_recycle.runtime.shared import keys
from ds_recycle.runtime.shared.transport import QUIET_STORE_ENV

TOKEN = "0123456789abcdef0123"
HOST = socket.gethostname()
NODE_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "SLURM_NNODES",
    "SLURM_NODEID",
    "SLURM_GPUS_ON_NODE",
    "SLURM_JOB_NODELIST",
    "NODE_RANK",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "DS_RECYCLE_TOKEN",
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*argv, "train.py"])


def no_torch() -> int:
    raise AssertionError("torch was asked for the GPU count although the flags or the environment give it")


def node(*argv: str, env: Mapping[str, str] | None = None, gpus: Callable[[], int] = no_torch) -> NodeSpec:
    return resolve(parse(*argv), {"DS_RECYCLE_TOKEN": TOKEN} if env is None else env, gpus)


@pytest.fixture
def hostfile(tmp_path: Path) -> str:
    """Three hosts of 4 GPUs; this host is the second."""
    path = tmp_path / "hostfile"
    path.write_text(f"w0 slots=4\n{HOST} slots=4\nw2 slots=4\n")
    return str(path)


# ----- the same job as torchrun's spelling -------------------------------------------------------


@pytest.mark.parametrize(
    "deepspeed,torchrun",
    [
        (["--num_gpus", "4"], ["--nproc-per-node", "4"]),
        (["--num-gpus", "4"], ["--nproc_per_node", "4"]),
        (["--num_accelerators", "2"], ["--nproc-per-node", "2"]),
        (["--num_nodes", "1", "--num_gpus", "2"], ["--nnodes", "1", "--nproc-per-node", "2"]),
        (["--num_nodes", "1", "--nproc", "3"], ["--nnodes", "1", "--nproc", "3"]),
        (
            ["--num_nodes", "2", "--num_gpus", "8", "--node_rank", "1", "--master_addr", "h", "--master_port", "9"],
            ["--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1", "--rdzv-endpoint", "h:9"],
        ),
        (
            ["--num-nodes", "2", "--num-gpus", "2", "--nnodes", "2", "--node_rank", "0", "--master_addr", "h"],
            ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "0", "--rdzv-endpoint", "h:29500"],
        ),
    ],
)
def test_each_deepspeed_spelling_is_its_torchrun_spelling(deepspeed, torchrun):
    assert node(*deepspeed) == node(*torchrun)


def test_a_hostfile_by_deepspeeds_flags(hostfile):
    plain = node("--hostfile", hostfile)
    assert plain == NodeSpec(3, 1, 4, ("w0", 29500), TOKEN)
    assert node("-H", hostfile, "--num_gpus", "4", "--num_nodes", "3") == plain
    assert node("-H", hostfile, "--master_port", "2345").endpoint == ("w0", 2345)


class Captured:
    """Stands in for the Launcher: keeps the config, starts nothing."""

    configs: list = []

    def __init__(self, config) -> None:
        Captured.configs.append(config)

    def run(self, handle_signals: bool = False) -> int:
        return 0


@pytest.fixture
def launch(monkeypatch, tmp_path):
    """``ds-recycle launch ARGV`` through the CLI's main, returning the LaunchConfig it would run."""
    for name in NODE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in QUIET_STORE_ENV.items():  # main sets them: restored after the test
        monkeypatch.setenv(name, os.environ.get(name, value))
    monkeypatch.setenv("DS_RECYCLE_TOKEN", TOKEN)
    monkeypatch.setattr("ds_recycle.runtime.node.launcher.Launcher", Captured)
    monkeypatch.setattr("ds_recycle.cli.nodes.cuda_device_count", no_torch)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")

    def run(*argv: str):
        Captured.configs = []
        assert main(["launch", *argv, "--backend", "gloo", str(script)]) == 0
        (config,) = Captured.configs
        return config

    return run


def test_the_launch_config_is_the_same_for_both_spellings(launch, hostfile):
    assert launch("--num_gpus", "2") == launch("--nproc-per-node", "2")
    several = ["--node_rank", "1", "--master_addr", "h", "--master_port", "9"]
    assert launch("--num_nodes", "2", "--num-gpus", "2", *several) == launch(
        "--nnodes", "2", "--nproc-per-node", "2", *several
    )
    assert launch("-H", hostfile, "--num_gpus", "4") == launch("--hostfile", hostfile)
    assert launch("--num_gpus", "2").env is None


def test_include_sets_the_ranks_devices_and_their_number(launch, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    config = launch("--include", "localhost:0,2")
    assert (config.nproc, config.env) == (2, {"CUDA_VISIBLE_DEVICES": "0,2"})
    config = launch("-e", "localhost:1", "--allow-unsafe-placement")
    assert (config.nproc, config.env) == (3, {keys.ENV_ALLOW_UNSAFE_PLACEMENT: "1", "CUDA_VISIBLE_DEVICES": "0,2,3"})


# ----- --include / --exclude on a hostfile ------------------------------------------------------


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["--include", f"w0:0,1@{HOST}:2,3"], NodeSpec(2, 1, 2, ("w0", 29500), TOKEN, visible_devices="2,3")),
        (["-i", f"{HOST}:3@w2:0,2@{HOST}:1"], NodeSpec(2, 0, 2, (HOST, 29500), TOKEN, visible_devices="1,3")),
        (["--exclude", "w0"], NodeSpec(2, 0, 4, (HOST, 29500), TOKEN, visible_devices="0,1,2,3")),
        (["-e", f"w0:1@{HOST}:1@w2:1"], NodeSpec(3, 1, 3, ("w0", 29500), TOKEN, visible_devices="0,2,3")),
        (["--include", f"w0@{HOST}", "--num_nodes", "2", "--num_gpus", "4"], NodeSpec(2, 1, 4, ("w0", 29500), TOKEN,
                                                                                    visible_devices="0,1,2,3")),
        (["--include", "w0:3@w2:3", "--node-rank", "1"], NodeSpec(2, 1, 1, ("w0", 29500), TOKEN, visible_devices="3")),
        (["--include", f"{HOST}:0,1"], NodeSpec(1, 0, 2, None, None, visible_devices="0,1")),
    ],
)  # fmt: skip
def test_a_filter_keeps_hosts_of_the_hostfile_and_their_gpus(hostfile, argv, expected):
    assert node("--hostfile", hostfile, *argv) == expected


def test_the_slots_index_the_devices_this_agent_sees(hostfile):
    env = {"DS_RECYCLE_TOKEN": TOKEN, "CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}
    assert node("-H", hostfile, "--include", f"{HOST}:1,3", env=env).visible_devices == "GPU-b,GPU-d"
    assert node("-H", hostfile, "--exclude", "w0", env=env).visible_devices == "GPU-a,GPU-b,GPU-c,GPU-d"
    env["CUDA_VISIBLE_DEVICES"] = "4,5"
    with pytest.raises(UsageError, match="GPU 3 is out of range: CUDA_VISIBLE_DEVICES=4,5 gives this node 2"):
        node("-H", hostfile, "--include", f"{HOST}:2,3", env=env)


# ----- --include / --exclude on one node --------------------------------------------------------


def test_one_node_filters_pick_gpus_for_cuda_visible_devices():
    assert node("--include", "localhost:0,2", env={}) == NodeSpec(1, 0, 2, None, None, visible_devices="0,2")
    assert node("--include", f"{HOST}:1", env={}).visible_devices == "1"
    assert node("-i", "localhost:1@localhost:0", "--nproc", "2", env={}).visible_devices == "0,1"
    assert node("--include", "localhost:0", "--num_gpus", "1", env={}).nproc_per_node == 1
    assert node("--exclude", "localhost:1", env={}, gpus=lambda: 4).visible_devices == "0,2,3"
    assert node("--include", "localhost", env={}, gpus=lambda: 2) == NodeSpec(
        1, 0, 2, None, None, visible_devices="0,1"
    )
    assert node("--include", "localhost", env={"SLURM_GPUS_ON_NODE": "3"}).visible_devices == "0,1,2"
    spec = node("--exclude", "localhost:0", env={"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert (spec.nproc_per_node, spec.visible_devices) == (3, "5,6,7")


def test_a_filter_on_one_of_several_nodes_without_a_hostfile_names_this_node():
    argv = ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:1", "--include", "localhost:2,3"]
    assert node(*argv) == NodeSpec(2, 1, 2, ("h", 1), TOKEN, visible_devices="2,3")


def test_the_default_rank_count_of_one_node_is_the_gpus_torch_sees():
    assert node(env={}, gpus=lambda: 3) == NodeSpec(1, 0, 3, None, None)
    assert node(env={"SLURM_GPUS_ON_NODE": "2"}).nproc_per_node == 2  # torch is not asked
    assert node("--num_gpus", "5", env={}).nproc_per_node == 5
    with pytest.raises(UsageError, match=r"or --num_gpus G, or SLURM_GPUS_ON_NODE\): torch sees no CUDA device"):
        node(env={}, gpus=lambda: 0)
    with pytest.raises(UsageError, match="--nproc-per-node G is required"):  # several nodes: no guess
        node("--nnodes", "2", "--rdzv-endpoint", "h:1")


def test_resolving_from_flags_does_not_import_torch():
    code = (
        "import sys, argparse; from ds_recycle.cli.launch import add_arguments; from ds_recycle.cli.nodes import "
        "resolve; p = argparse.ArgumentParser(); add_arguments(p); "
        "resolve(p.parse_args(['--include', 'localhost:0,1', 't.py']), {}); "
        "resolve(p.parse_args(['--num_gpus', '2', 't.py']), {}); sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# ----- bad input: one line naming the flag and the value, exit 2, nothing started ---------------


BAD = [
    (["--num_gpus", "2", "--nproc-per-node", "2"], {}, "--nproc-per-node 2 and --num_gpus 2: give one of them"),
    (["--num-gpus", "2", "--nproc", "2"], {}, "--nproc and --num_gpus: give one of them"),
    (["--num_gpus", "0"], {}, "--num_gpus 0: must be an integer in 1..1024"),
    (["--num_nodes", "2", "--nnodes", "3"], {}, "--nnodes 3 and --num_nodes 2: give one of them"),
    (["--num_nodes", "0"], {}, "--num_nodes 0: must be an integer in 1..4096"),
    (["--num_nodes", "2", "--nproc", "2"], {}, "--nproc with --num_nodes 2: use --nproc-per-node G"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], {}, "--include localhost:0 and --exclude localhost:1"),
    (["--include", "localhost:x"], {}, "--include localhost:x: cannot read 'localhost:x': expected HOST[:GPU"),
    (["--include", "localhost:"], {}, "--include localhost:: cannot read 'localhost:': expected"),
    (["--exclude", "a@@b"], {}, "--exclude a@@b: cannot read '': expected"),
    (["--include", ":0"], {}, "--include :0: cannot read ':0': expected"),
    (["--include", ""], {}, "--include '': cannot read '': expected"),
    (["--include", "localhost:0:1"], {}, "--include localhost:0:1: cannot read"),
    (["--include", "localhost:-1"], {}, "--include localhost:-1: cannot read"),
    (["--include", "localhost:9999"], {}, "GPU 9999 of localhost: a GPU index must be in 0..1023"),
    (["--include", "elsewhere:0"], {}, "--include elsewhere:0: without --hostfile the host must be localhost"),
    (
        ["--include", "localhost:2"],
        {"CUDA_VISIBLE_DEVICES": "0,1"},
        "--include localhost:2: GPU 2 of localhost is out of range: it has 2 GPUs (CUDA_VISIBLE_DEVICES=0,1;",
    ),
    (["--exclude", "localhost:4"], {"SLURM_GPUS_ON_NODE": "4"}, "GPU 4 of localhost is out of range"),
    (["--exclude", "localhost"], {"CUDA_VISIBLE_DEVICES": "0"}, "--exclude localhost: leaves none of this node's"),
    (["--include", "localhost:0,1", "--num_gpus", "4"], {}, "selects 2 GPUs on this node but --num_gpus 4"),
    (["--include", "localhost:0", "--nproc", "2"], {}, "selects 1 GPU on this node but --nproc 2"),
]

HOSTFILE_BAD = [
    (["--include", "w9:0"], "--include w9:0: no host w9 to select: expected one of w0, "),
    (["--include", "w0:4"], "--include w0:4: GPU 4 of w0 is out of range: it has 4 GPUs (slots in --hostfile"),
    (["--exclude", "w0:9@w2"], "--exclude w0:9@w2: GPU 9 of w0 is out of range"),
    (["--include", f"w0:0@{HOST}"], "must have the same number of GPUs (found w0 1, "),
    (["--exclude", HOST], f"--exclude {HOST}: leaves out this host ({HOST}): start ds-recycle launch only on"),
    (["--exclude", f"w0@{HOST}@w2"], "leaves no host of --hostfile"),
    (["--exclude", "w2", "--nnodes", "3"], "--nnodes 3 and --hostfile"),
    (["--include", "w0:0@w2:0", "--node-rank", "1", "--num_gpus", "2"], "--num_gpus 2 and --hostfile"),
]


@pytest.mark.parametrize("argv,env,message", BAD)
def test_bad_deepspeed_input_names_the_flag_and_the_value(argv, env, message):
    with pytest.raises(UsageError) as caught:
        node(*argv, env=env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("argv,message", HOSTFILE_BAD)
def test_bad_filters_on_a_hostfile_name_the_flag_and_the_value(hostfile, argv, message):
    with pytest.raises(UsageError) as caught:
        node("--hostfile", hostfile, *argv)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize("argv,env,message", BAD)
def test_bad_deepspeed_input_through_the_cli_is_one_line_and_exit_2(launch, monkeypatch, capsys, argv, env, message):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    Captured.configs = []
    assert main(["launch", *argv, "--backend", "gloo", "train.py"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and Captured.configs == [] and err.count("\n") == 1, err
    assert err.startswith("ds-recycle launch: error: ") and message in err and "Traceback" not in err


def test_a_bad_filter_as_a_real_process_starts_nothing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("open(__file__ + '.ran', 'w').close()\n")
    command = [sys.executable, "-m", "ds_recycle.cli", "launch", "--include", "localhost:0", "--exclude", "localhost"]
    done = subprocess.run([*command, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("ds-recycle launch: error: --include localhost:0 and --exclude localhost")
    assert not Path(str(script) + ".ran").exists()
