"""Decoupled backprop on one stage: the W path against a fused backward and the generic graph split.

For GPT stages (pre-LN blocks of ds_recycle.models.gpt, a middle stage: its input needs a
gradient) and a host-bound stack (24 x Linear + LayerNorm on tiny tensors), each row gives

- F: the forward (with the W path installed for "path": its hooks cost forward time);
- fused: one ``backward`` of the output (what stock DeepSpeed runs);
- B, W: BackwardInput and BackwardWeight (ds_recycle.engine.backward_split);
- (B+W)/fused: the median over repetitions of the ratio within one repetition (the three modes run
  interleaved, so a repetition's timings share the machine's load);
- held: bytes held between B and W over bytes held after F (ds_recycle.engine.held_memory);
- vs graph: bytes held between B and W over the generic graph split's.

Modes: "path" is the default W path (Linear weight GEMMs deferred), "graph" the generic graph
split, which the path falls back to for modules it does not cover.

Runs on CPU, and on CUDA when a GPU is present (``--device cuda``, CUDA-synchronized timings and
GPU-sized stages: d = 2048 and 4096, sequence 2048). The last line is
``host-bound (B+W)/fused: X.XXX`` for the default path.

    .venv/bin/python bench/backward_split.py [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ds_recycle.engine.backward_split import backward_input, backward_weight  # noqa: E402
from ds_recycle.engine.held_memory import measure_held_bytes  # noqa: E402
from ds_recycle.engine.weight_grad import install_weight_grad_path  # noqa: E402
from ds_recycle.models.gpt import Block  # noqa: E402


@dataclass(frozen=True)
class Stage:
    name: str
    build: Callable[[], nn.Module]
    input_shape: tuple[int, ...]
    dtype: torch.dtype | None
    """The autocast dtype, or None for fp32."""
    reps: int


@dataclass
class Row:
    stage: str
    dtype: str
    mode: str
    forward_ms: float
    fused_ms: float
    b_ms: float
    w_ms: float
    ratio: float
    held_ratio: float
    held_mib: float
    vs_graph: float = 1.0


def gpt_stage(d: int, layers: int) -> Callable[[], nn.Module]:
    return lambda: nn.Sequential(*[Block(d, max(1, d // 64), 4) for _ in range(layers)])


def host_bound_stage() -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(24):
        layers += [nn.Linear(64, 64), nn.LayerNorm(64)]
    return nn.Sequential(*layers)


HOST_BOUND = "host-bound 24x(Linear+LN) d=64"


def stages(device: str, quick: bool) -> list[Stage]:
    if device == "cuda":
        gpu = [(2048, 4, 1), (4096, 2, 1), (2048, 4, 4)]
        out = [
            Stage(f"gpt d={d} L={n} seq=2048 mb={b}", gpt_stage(d, n), (b, 2048, d), dtype, 10)
            for dtype in (torch.bfloat16, None)
            for d, n, b in (gpu[:1] if quick else gpu)
        ]
    else:
        cpu = [(128, 4, 64, 2, 20), (256, 4, 128, 2, 10), (512, 2, 256, 1, 6)]
        out = [
            Stage(f"gpt d={d} L={n} seq={t} mb={b}", gpt_stage(d, n), (b, t, d), None, 3 if quick else reps)
            for d, n, t, b, reps in (cpu[:2] if quick else cpu)
        ]
        # CPU bf16 matmuls are slow without AMX: one small stage.
        bf16 = Stage("gpt d=128 L=4 seq=64 mb=2", gpt_stage(128, 4), (2, 64, 128), torch.bfloat16, 3 if quick else 5)
        out.append(bf16)
    out.append(Stage(HOST_BOUND, host_bound_stage, (2, 8, 64), None, 60 if quick else 400))
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _autocast(device: str, dtype: torch.dtype | None):
    return torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None)


def bench_stage(stage: Stage, device: str) -> list[Row]:
    torch.manual_seed(0)
    fused = stage.build().to(device)
    graph = copy.deepcopy(fused)
    path_module = copy.deepcopy(fused)
    path = install_weight_grad_path(path_module)
    x0 = torch.randn(stage.input_shape, device=device)
    modules = {"fused": (fused, None), "graph": (graph, None), "path": (path_module, path)}
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in modules}

    def one(name: str) -> tuple[float, float, float]:
        module, p = modules[name]
        params = [q for q in module.parameters() if q.requires_grad]
        for q in params:
            q.grad = None
        x = x0.clone().requires_grad_()
        _sync(device)
        began = time.perf_counter()
        with _autocast(device, stage.dtype):
            out = module(x)
        _sync(device)
        forward = time.perf_counter() - began
        grad = torch.ones_like(out)
        _sync(device)
        began = time.perf_counter()
        if name == "fused":
            out.backward(grad)
            _sync(device)
            return forward, time.perf_counter() - began, 0.0
        _, work = backward_input([out], [grad], [x], params, path=p)
        _sync(device)
        b_done = time.perf_counter()
        del out
        backward_weight(work)
        _sync(device)
        return forward, b_done - began, time.perf_counter() - b_done

    for name in modules:  # warm-up
        for _ in range(3):
            one(name)
    for _ in range(stage.reps):
        for name in modules:
            times[name].append(one(name))

    held = {name: measure_held_bytes(modules[name][0], x0, modules[name][1], stage.dtype) for name in ("graph", "path")}
    fused_bwd = [t[1] for t in times["fused"]]
    dtype = "fp32" if stage.dtype is None else f"{str(stage.dtype).removeprefix('torch.')} autocast"
    rows = []
    for name in ("path", "graph"):
        runs = times[name]
        ratios = [(b + w) / f for (_, b, w), f in zip(runs, fused_bwd, strict=True)]
        rows.append(
            Row(
                stage.name,
                dtype,
                name,
                forward_ms=statistics.median(t[0] for t in runs) * 1e3,
                fused_ms=statistics.median(fused_bwd) * 1e3,
                b_ms=statistics.median(t[1] for t in runs) * 1e3,
                w_ms=statistics.median(t[2] for t in runs) * 1e3,
                ratio=statistics.median(ratios),
                held_ratio=held[name].ratio,
                held_mib=held[name].between_b_and_w / 2**20,
                vs_graph=held[name].between_b_and_w / held["graph"].between_b_and_w,
            )
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steadier timings)")
    parser.add_argument("--quick", action="store_true", help="fewer stages and repetitions")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"# device {args.device}, torch {torch.__version__}, {args.threads} CPU thread(s)")
    columns = ["stage", "dtype", "mode", "F ms", "fused ms", "B ms", "W ms", "(B+W)/fused"]
    columns += ["held B->W / after F", "held MiB", "vs graph"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    host_bound = None
    for stage in stages(args.device, args.quick):
        for row in bench_stage(stage, args.device):
            print(
                f"| {row.stage} | {row.dtype} | {row.mode} | {row.forward_ms:.3f} | {row.fused_ms:.3f} | "
                f"{row.b_ms:.3f} | {row.w_ms:.3f} | {row.ratio:.3f} | {row.held_ratio:.2f} | {row.held_mib:.2f} | "
                f"{row.vs_graph:.2f} |",
                flush=True,
            )
            if stage.name == HOST_BOUND and row.mode == "path":
                host_bound = row.ratio
    print(f"host-bound (B+W)/fused: {host_bound:.3f}")


if __name__ == "__main__":
    main()
