"""Which node an agent is: flags, Slurm's and torchrun's variables, the token, and bad input."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from ds_recycle.cli.common import UsageError
from ds_recycle.cli.launch import add_arguments
from ds_recycle.cli.nodes import NodeSpec, expand_hostlist, resolve

TOKEN = "0123456789abcdef0123"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([*argv, "train.py"])


def test_one_node_with_nproc_is_as_before():
    assert resolve(parse("--nproc", "4"), {}) == NodeSpec(1, 0, 4, None, None)


def test_torchrun_spelling_and_aliases():
    args = parse("--nnodes", "4", "--node_rank", "2", "--nproc_per_node", "8", "--rdzv_endpoint", "n0:1234")
    assert resolve(args, {"DS_RECYCLE_TOKEN": TOKEN}) == NodeSpec(4, 2, 8, ("n0", 1234), TOKEN)
    args = parse(
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--master_addr", "h", "--master-port", "9"
    )
    assert resolve(args, {"DS_RECYCLE_TOKEN": TOKEN}).endpoint == ("h", 9)


def test_slurm_and_torchrun_variables_fill_absent_flags():
    slurm = {
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "2",
        "SLURM_GPUS_ON_NODE": "8",
        "SLURM_JOB_NODELIST": "gpu[007-009],login1",
        "DS_RECYCLE_TOKEN": TOKEN,
    }
    assert resolve(parse(), slurm) == NodeSpec(3, 2, 8, ("gpu007", 29500), TOKEN)
    torchrun = {"NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "2222", "DS_RECYCLE_TOKEN": TOKEN}
    spec = resolve(parse("--nnodes", "2", "--nproc-per-node", "4"), torchrun)
    assert spec == NodeSpec(2, 1, 4, ("10.0.0.1", 2222), TOKEN)
    assert resolve(parse("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "4"), torchrun).node_rank == 0


def test_a_domain_label_is_kept():
    args = parse("--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1")
    args.domain = "rack-3.row:a_1"
    assert resolve(args, {"DS_RECYCLE_TOKEN": TOKEN}).domain == "rack-3.row:a_1"


def test_hostlist_expansion():
    assert expand_hostlist("node[01-03,07],gpu5,a[8-10]b") == [
        "node01", "node02", "node03", "node07", "gpu5", "a8b", "a9b", "a10b"
    ]  # fmt: skip


def test_token_file_must_be_private(tmp_path):
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    args = parse("--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--rdzv-endpoint", "h:1")
    args.token_file = str(path)
    with pytest.raises(UsageError, match="readable by others"):
        resolve(args, {})
    path.chmod(0o600)
    assert resolve(args, {}).token == TOKEN


@pytest.mark.parametrize(
    "argv,env,message",
    [
        (["--nnodes", "1:4", "--nproc-per-node", "2"], {}, "elastic range MIN:MAX is not accepted"),
        (["--nnodes", "2", "--nproc", "2"], {}, "use --nproc-per-node G on several nodes"),
        (["--nproc", "2", "--node-rank", "1"], {}, "--node-rank is for several nodes"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--nproc-per-node", "1"],
            {},
            "--node-rank 2: must be an integer in 0..1",
        ),
        (["--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1"], {"DS_RECYCLE_TOKEN": TOKEN}, "HOST:PORT"),
        (["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "h:99999"], {}, "port 99999"),
        (["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "h:1"], {"DS_RECYCLE_TOKEN": "short"}, "token"),
        ([], {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "x"}, "SLURM_GPUS_ON_NODE x: must be an integer"),
        ([], {"SLURM_NNODES": "2", "SLURM_GPUS_ON_NODE": "1", "SLURM_JOB_NODELIST": "n[1-x]"}, "cannot read"),
        ([], {}, "--nproc N (one node) or --nproc-per-node G is required"),
        (
            ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", "h:1", "--domain", "rack 1"],
            {"DS_RECYCLE_TOKEN": TOKEN},
            "--domain 'rack 1': 1 to 64 characters",
        ),
        (["--nproc", "2", "--domain", "r1"], {}, "--domain is for several nodes"),
    ],
)
def test_bad_node_input_names_the_problem(argv, env, message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve(parse(*argv), env, gpu_count=lambda: 0)  # as on a machine without a GPU


def test_bad_node_input_through_the_cli_is_one_line_and_starts_nothing(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    command = [sys.executable, "-m", "ds_recycle.cli", "launch", "--nnodes", "2", "--nproc-per-node", "1"]
    done = subprocess.run([*command, "--rdzv-endpoint", "h:1", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("ds-recycle launch: error: several nodes need")


def test_a_deepspeed_hostfile_gives_the_nodes_the_endpoint_and_this_nodes_rank(tmp_path):
    import socket

    hostfile = tmp_path / "hostfile"
    hostfile.write_text(
        f"# the job's hosts\nworker-0 slots=4\n\n{socket.gethostname()} slots=4  # this one\nw2 slots=4\n"
    )
    env = {"DS_RECYCLE_TOKEN": TOKEN, "MASTER_PORT": "2345"}
    assert resolve(parse("--hostfile", str(hostfile)), env) == NodeSpec(3, 1, 4, ("worker-0", 2345), TOKEN)
    assert resolve(parse("--hostfile", str(hostfile), "--node-rank", "2"), env).node_rank == 2


@pytest.mark.parametrize(
    "text,extra,message",
    [
        ("a slots=2\nb slots=4\n", [], "every host needs the same slots (found [2, 4])"),
        ("a slots=2\na slots=2\n", [], "line 2: host a is listed twice"),
        ("a 2\n", [], "line 1: 'a 2': expected `HOST slots=G`"),
        ("a slots=0\n", [], "slots 0: must be an integer in 1..1024"),
        ("# nothing\n", [], "no host in it"),
        ("a slots=2\nb slots=2\n", [], "no line names this host"),
        ("a slots=2\nb slots=2\n", ["--nnodes", "3"], "--nnodes 3 and --hostfile"),
        ("a slots=2\nb slots=2\n", ["--nproc-per-node", "4"], "--nproc-per-node 4 and --hostfile"),
        ("a slots=2\nb slots=2\n", ["--node-rank", "2"], "--node-rank 2: must be an integer in 0..1"),
        ("a slots=2\nb slots=2\n", ["--node-rank", "0", "--rdzv-endpoint", "h:1"], "leave out --rdzv-endpoint"),
    ],
)
def test_bad_hostfiles_name_the_line_and_the_problem(tmp_path, text, extra, message):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(text)
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        resolve(parse("--hostfile", str(hostfile), *extra), {"DS_RECYCLE_TOKEN": TOKEN})
    with pytest.raises(UsageError, match="cannot read it"):
        resolve(parse("--hostfile", str(tmp_path / "absent")), {})
