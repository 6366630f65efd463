"""GPU check of the collective data plane: a channels_last ResNet-18 (11.2 M parameters), pgc vs ddp, on one GPU.

    python benchmarks/gpu_check.py --json round1.json               # on a machine with a CUDA GPU (one round)
    python benchmarks/gpu_check.py --merge round1.json round2.json   # -> docs/results/gpu_check.json and docs/results/gpu_check.md
    python benchmarks/gpu_check.py --render                          # docs/results/gpu_check.json -> docs/results/gpu_check.md
    python benchmarks/gpu_check.py --accelerator cpu --steps 8 --skip 2 --ranks 2 --passes-params 1000000 \\
        --json /tmp/gpu_check.json                                   # a dry run of the script itself (gloo, CPU)

Three parts, each written into the results file as soon as it is done:

``passes``: the passes a ``pgc_cr`` step (n = 4, s = 1, c = 2) makes over its payload, each timed alone at
``--passes-params`` float32 parameters with CUDA events (median of ``REPEATS``), through the library's own code:
copying ``param.grad`` into the partition's slot (:meth:`~lightning_pgc.strategy.gradients.Gradients.store`, with
the loss read back), the finite check (:meth:`~lightning_pgc.strategy.gradients.Gradients.nonfinite`), the encode
(``Scheme.encode``), the rank's share of the decode (:func:`~lightning_pgc.codes.shares.contribute`), the all-reduce
(two ranks sharing the GPU over gloo, :class:`~lightning_pgc.runtime.group.DataGroup`; and NCCL on one rank) and
pointing ``param.grad`` at the aggregate (:meth:`~lightning_pgc.strategy.gradients.Gradients.apply`). Each pass's
fewest bytes moved through device memory, over its time, gives its bandwidth.

``one_rank``: ddp on one rank (NCCL on CUDA); ``PGCStrategy`` refuses one rank (its schemes need n >= 2), and the
refusal is recorded. A probe also asks NCCL for two ranks on the one GPU and records its answer.

``shared``: for each ``--ranks``, that many processes share the one GPU (a Lightning "node" each): ddp with
``DDPStrategy(process_group_backend="gloo")``, pgc with ``PGCStrategy(process_group_backend="gloo",
data_backend="gloo")``, so codes, aggregates and ``param.grad`` stay on the GPU and gloo stages each all-reduce
through host memory. Random 32x32 images live on the GPU (no batch copies). For each configuration: the step time
(throughput as in step_time.py: wall time from every rank past step ``--skip`` to every rank done, per step, after
``torch.cuda.synchronize``), whether the last aggregate has the same bits on every rank (and the parameters too),
where the buffers live, and the host<->device copies per step (count and bytes by direction) that the profiler saw
over three steps (CUDA only). On CPU (the dry run) the same code runs on gloo and no copies are counted.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

from pgc_lab.experiments.launch import launch_script
from pgc_lab.experiments.report import write_json, write_report
from pgc_lab.experiments.stats import seconds_per_step

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "results"
REPEATS = 20  # timed calls per pass (after two warm-up calls)
ALLREDUCE_REPEATS = 5  # timed gloo all-reduces of the payload (after one warm-up)
PROFILED_STEPS = 3
PROBE = "PROBE:"  # the NCCL probe's answer line


# ------------------------------------------------------------------------------------------- one rank of a fit
def worker(args: argparse.Namespace) -> None:
    import lightning.pytorch as pl
    import torch
    import torchvision
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pgc import PGCStrategy
    from lightning_pgc.callbacks.stragglers import StragglerInjector
    from pgc_lab.experiments.callbacks import parameter_checksum

    cuda = args.accelerator == "cuda"

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torchvision.models.resnet18(weights=None, num_classes=10).to(memory_format=torch.channels_last)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x.contiguous(memory_format=torch.channels_last)), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(pl.Callback):
        """Step times; host<->device copies over ``PROFILED_STEPS`` steps from ``skip`` (CUDA); at the last step the
        aggregate's hash and where the buffers live."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.copies: Optional[dict[str, float]] = None
            self.aggregate_sha = ""
            self.placement: dict[str, Any] = {}
            self._prof: Any = None

        def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
            if trainer.global_step == args.skip and cuda:
                from torch.profiler import ProfilerActivity, profile

                torch.cuda.synchronize()
                self._prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self._prof.__enter__()

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.time())
            if self._prof is not None and trainer.global_step == args.skip + PROFILED_STEPS:
                self._prof.__exit__(None, None, None)
                self.copies = host_copies(self._prof, PROFILED_STEPS)
                self._prof = None
            if trainer.global_step == args.steps:
                self.placement = placement(trainer, pl_module)

    def placement(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        st = trainer.strategy
        grads = [p.grad for p in module.parameters() if p.grad is not None]
        conv = [g for g in grads if g.dim() == 4]
        out: dict[str, Any] = {
            "param_grad": sorted({str(g.device) for g in grads}),
            "conv_grads_channels_last": all(g.is_contiguous(memory_format=torch.channels_last) for g in conv),
        }
        info = getattr(st, "last_step", None)
        if info is not None:
            data = info.aggregate.detach().float().cpu().numpy().tobytes()
            clock.aggregate_sha = hashlib.sha256(data).hexdigest()
            storage = info.aggregate.untyped_storage().data_ptr()
            out["aggregate"] = str(info.aggregate.device)
            out["param_grad_views_aggregate"] = all(g.untyped_storage().data_ptr() == storage for g in grads)
            out["slots"] = sorted({str(t.device) for t in st.gradients.slots.values()})
            runtime = st.runtime
            if runtime is not None and runtime.group is not None:
                codes = [*runtime._codes.values(), *runtime._free_codes]
                out["codes"] = sorted({str(c.flat.device) for c in codes})
                out["data_group"] = type(runtime.group.pg).__name__
        return out

    g = torch.Generator().manual_seed(0)
    n = 64 * args.ranks * 4
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    images = torch.randn(n, 3, 32, 32, generator=g).to(device)
    labels = torch.randint(0, 10, (n,), generator=g).to(device)
    clock = Clock()
    callbacks: list[Any] = [clock]
    if args.slow_seconds > 0:
        callbacks.append(StragglerInjector(f"slowranks(ranks=[1], seconds={args.slow_seconds})"))
    if args.strategy == "ddp":
        strategy: Any = DDPStrategy(process_group_backend=args.backend)
    else:
        strategy = PGCStrategy(
            scheme=args.strategy,
            stragglers=1,
            diagnostics={"enabled": False},
            process_group_backend=args.backend,
            data_backend=args.backend,
        )
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=1,
        num_nodes=args.ranks,
        strategy=strategy,
        max_steps=args.steps,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Net(), DataLoader(TensorDataset(images, labels), batch_size=64, shuffle=True))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    st = trainer.strategy
    (out / f"rank{trainer.global_rank}.json").write_text(
        json.dumps(
            {
                "times": clock.times,
                "host_copies_per_step": clock.copies,
                "aggregate_sha256": clock.aggregate_sha,
                "checksum": parameter_checksum(trainer.lightning_module),
                "device": str(st.root_device),
                "placement": clock.placement,
                "params": sum(p.numel() for p in trainer.lightning_module.parameters()),
            }
        )
    )


def host_copies(prof: Any, steps: int) -> dict[str, float]:
    """Host<->device copies per step in a finished profile: count and bytes by direction (from its trace's memcpy
    events, which carry their sizes)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    out = {"HtoD": 0.0, "DtoH": 0.0, "HtoD_bytes": 0.0, "DtoH_bytes": 0.0}
    for e in events:
        name = str(e.get("name", ""))
        if "Memcpy" not in name:  # (the runtime calls are cudaMemcpy..., without a direction in their names)
            continue
        for way in ("HtoD", "DtoH"):
            if way in name:
                out[way] += 1 / steps
                out[f"{way}_bytes"] += float((e.get("args") or {}).get("bytes", 0)) / steps
    return out


def launch(args: argparse.Namespace, strategy: str, ranks: int, backend: str, out: Path) -> dict:
    """Start ``ranks`` processes (one-device nodes that all see the same GPU) and summarize what they wrote."""
    worker = ["--strategy", strategy, "--ranks", str(ranks), "--steps", str(args.steps), "--backend", backend]
    worker += ["--skip", str(args.skip), "--accelerator", args.accelerator, "--slow-seconds", str(args.slow_seconds)]
    rank_files = launch_script(
        Path(__file__), worker, out, ranks, one_process_per_rank=True, threads=2, timeout=args.launch_timeout
    )
    shas = {r["aggregate_sha256"] for r in rank_files}
    pgc = strategy != "ddp"
    copies = [r["host_copies_per_step"] for r in rank_files]
    return {
        "strategy": strategy,
        "ranks": ranks,
        "backend": backend,
        "seconds_per_step": seconds_per_step([r["times"] for r in rank_files], args.skip),
        "device": rank_files[0]["device"],
        "params": rank_files[0]["params"],
        "placement": rank_files[0]["placement"],
        "aggregate_identical": (len(shas) == 1 and "" not in shas) if pgc else None,
        # (ddp's BatchNorm statistics differ between ranks after the last forward: buffers are broadcast before it)
        "parameters_identical": len({r["checksum"] for r in rank_files}) == 1 if pgc else None,
        "host_copies_per_step": copies,
        "host_copies_per_step_mean": _mean_copies(copies),
    }


def _mean_copies(copies: list[Optional[dict[str, float]]]) -> Optional[dict[str, float]]:
    got = [c for c in copies if c]
    return {k: statistics.mean(c[k] for c in got) for k in got[0]} if got else None


# ------------------------------------------------------------------------------------------- the passes
def _timer(cuda: bool) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call of ``fn``: the median of ``REPEATS`` calls after two warm-up calls (CUDA events around
    each call on CUDA, the host clock elsewhere)."""
    import torch

    def ms(fn: Callable[[], object]) -> float:
        fn()
        fn()
        times = []
        for _ in range(REPEATS):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                started = time.perf_counter()
                fn()
                times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)

    return ms


def passes(args: argparse.Namespace) -> dict[str, Any]:
    """Each pass of a ``pgc_cr`` step (n = 4, s = 1, rank 0) over a payload of ``--passes-params`` parameters, by the
    library's own code, timed alone; the gloo all-reduce on two ranks sharing the device is timed in two processes."""
    import torch
    import torch.distributed as dist

    from lightning_pgc.codes import make_scheme
    from lightning_pgc.codes.shares import contribute
    from lightning_pgc.runtime.aggregates import Code
    from lightning_pgc.strategy.gradients import Gradients

    cuda = args.accelerator == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    ms = _timer(cuda)
    pieces = 10
    per = args.passes_params // pieces
    params = [torch.nn.Parameter(torch.empty(per, device=device)) for _ in range(pieces)]
    for p in params:
        p.grad = torch.randn(per, device=device)
    gradients = Gradients(params, [], device)
    numel = gradients.numel
    scheme = make_scheme("pgc_cr", 4, 1)
    held = list(scheme.partitions(0))
    loss = torch.rand((), device=device)
    for partition in held:
        gradients.store(partition, loss)
    slots = {j: gradients.slots[j] for j in held}
    code = Code(numel, scheme.payload_dtype, device)
    scheme.encode(0, slots, out=code.rows)
    buf = torch.empty(numel, dtype=torch.float32, device=device)
    plan = [(0, 0, 7), (1, 1, 7), (2, 2, 7)]  # the ranks 0-2 admitted, rank 3 the straggler
    coded = gradients.grad_numel + 1

    def store() -> None:
        gradients.begin_step()  # (drops param.grad: put the gradients back, as a backward would)
        for p, g in zip(params, grads):
            p.grad = g
        gradients.store(held[0], loss)

    grads = [p.grad for p in params]
    timed: dict[str, float] = {
        "copy param.grad into its slot": ms(store),
        "finite check of the slot": ms(gradients.nonfinite),
        "encode (weighted sum of 2 slots)": ms(lambda: scheme.encode(0, slots, out=code.rows)),
        "share of the decode (code times its weight)": ms(
            lambda: contribute(scheme, plan, 0, {7: code.flat}, coded, buf)
        ),
    }
    if cuda:
        store_ = dist.HashStore()
        options = dist.ProcessGroupNCCL.Options()
        pg = dist.ProcessGroupNCCL(store_, 0, 1, options)
        timed["all-reduce, NCCL, 1 rank"] = ms(lambda: pg.allreduce([buf]).wait())
        del pg
    timed["all-reduce, gloo, 2 ranks on the device"] = gloo_allreduce_ms(args, numel)
    timed["param.grad views of the aggregate"] = ms(lambda: gradients.apply(buf[: gradients.grad_numel]))
    size = 4 * numel
    fewest_bytes = {
        "copy param.grad into its slot": 2 * size,
        "finite check of the slot": size,
        "encode (weighted sum of 2 slots)": 3 * size,
        "share of the decode (code times its weight)": 2 * size,
    }
    return {
        "params": args.passes_params,
        "payload_numel": numel,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "timer": "CUDA events" if cuda else "host clock",
        "repeats": REPEATS,
        "allreduce_repeats": ALLREDUCE_REPEATS,
        "ms": timed,
        "fewest_bytes": fewest_bytes,
        "gb_per_s": {k: fewest_bytes[k] / (timed[k] * 1e-3) / 1e9 for k in fewest_bytes},
    }


def gloo_allreduce_ms(args: argparse.Namespace, numel: int) -> float:
    """Milliseconds per gloo all-reduce of ``numel`` float32 values on the device, two ranks (processes) in one
    :class:`~lightning_pgc.runtime.group.DataGroup` with ``backend="gloo"``: the slower rank's median."""
    from lightning_pgc.runtime.control import serve_store

    server = serve_store()
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__)), "--allreduce-worker", "--accelerator", args.accelerator]
        cmd += ["--port", str(server.port), "--numel", str(numel), "--out", tmp]
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        procs = [subprocess.Popen([*cmd, "--rank", str(r)], env=env) for r in range(2)]
        if any(p.wait(timeout=args.launch_timeout) for p in procs):
            raise RuntimeError("the gloo all-reduce workers failed")
        return max(json.loads((Path(tmp) / f"allreduce{r}.json").read_text())["ms"] for r in range(2))


def allreduce_worker(args: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from lightning_pgc.runtime.group import DataGroup

    cuda = args.accelerator == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, use_libuv=True)
    group = DataGroup(store, "passes", 0, [0, 1], args.rank, device, timedelta(seconds=120), backend="gloo")
    buf = torch.randn(args.numel, device=device)
    times = []
    for i in range(ALLREDUCE_REPEATS + 1):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        group.all_reduce(buf)
        if cuda:
            torch.cuda.synchronize()
        if i:
            times.append((time.perf_counter() - started) * 1e3)
    group.close()
    Path(args.out, f"allreduce{args.rank}.json").write_text(json.dumps({"ms": statistics.median(times)}))


def nccl_probe_worker(args: argparse.Namespace) -> None:
    """One of two ranks asking NCCL for a group on the same GPU (prints what happened)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", args.port, is_master=False, use_libuv=True)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timedelta(seconds=30)
    try:
        torch.cuda.set_device(0)
        pg = dist.ProcessGroupNCCL(store, args.rank, 2, options)
        t = torch.ones(4, device="cuda:0")
        pg.allreduce([t]).wait()
        torch.cuda.synchronize()
    except Exception as exc:
        said = " | ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        print(f"{PROBE} {type(exc).__name__}: {said}", flush=True)
        sys.exit(1)
    print(f"{PROBE} all-reduced: {t.tolist()}", flush=True)


def nccl_two_ranks_probe(args: argparse.Namespace) -> dict[str, Any]:
    """Two ranks on one GPU under NCCL: what NCCL says (each rank's exit status and last line of output)."""
    from lightning_pgc.runtime.control import serve_store

    server = serve_store()
    cmd = [sys.executable, str(Path(__file__)), "--nccl-probe-worker", "--port", str(server.port)]
    procs = [
        subprocess.Popen([*cmd, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(2)
    ]
    answers = []
    for p in procs:
        try:
            text = p.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            p.kill()
            text = p.communicate()[0] + "\n(killed after 60 s)"
        said = [line[len(PROBE) :].strip() for line in text.splitlines() if line.startswith(PROBE)]
        answers.append({"returncode": p.returncode, "said": (said or [text.strip()[-600:]])[-1][:600]})
    return {"ranks": answers}


# ------------------------------------------------------------------------------------------- the run
def run(args: argparse.Namespace) -> None:
    import torch

    result: dict[str, Any] = {
        "command": "python benchmarks/gpu_check.py " + " ".join(_public_args(sys.argv[1:])),
        "machine": torch.cuda.get_device_name(0) if args.accelerator == "cuda" else "cpu",
        "versions": _versions(),
        "steps": args.steps,
        "skip": args.skip,
        "profiled_steps": PROFILED_STEPS,
    }
    out = Path(args.json)

    def save(key: str, value: Any) -> None:
        result[key] = value
        write_json(out, result, newline=True)
        print(f"== {key}: {json.dumps(value)}", flush=True)

    def attempt(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # one configuration failing must not lose the others
            return {"error": f"{type(exc).__name__}: {str(exc)[-1500:]}"}

    if args.passes_params > 0:
        save("passes", attempt(lambda: passes(args)))
    one_backend = "nccl" if args.accelerator == "cuda" else "gloo"
    one: dict[str, Any] = {"ddp": attempt(lambda: launch(args, "ddp", 1, one_backend, _runs(args, "ddp_1")))}
    one["pgc_cr"] = {"refused": _one_rank_refusal()}
    save("one_rank", one)
    shared = []
    for ranks in args.ranks:
        for strategy in ("ddp", "pgc_cr"):
            res = attempt(lambda: launch(args, strategy, ranks, "gloo", _runs(args, f"{strategy}_{ranks}")))
            shared.append({"strategy": strategy, "ranks": ranks, **res})
            save("shared", shared)
    if args.accelerator == "cuda" and args.nccl_probe:
        save("nccl_two_ranks_one_gpu", attempt(lambda: nccl_two_ranks_probe(args)))
    print(render(result), flush=True)


def _public_args(argv: list[str]) -> list[str]:
    """The command line without the places it wrote to (``--json``, ``--out``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--json", "--out"):
            skip = True
        elif not a.startswith(("--json=", "--out=")):
            out.append(a)
    return out


def _runs(args: argparse.Namespace, name: str) -> Path:
    return Path(args.out) / name


def _one_rank_refusal() -> str:
    from lightning_pgc.codes import make_scheme

    try:
        make_scheme("pgc_cr", 1, 1)
    except ValueError as exc:
        return str(exc)
    return ""


def _versions() -> dict[str, str]:
    import lightning
    import torch

    return {"torch": torch.__version__, "lightning": lightning.__version__, "python": sys.version.split()[0]}


# ------------------------------------------------------------------------------------------- the page
META = ("command", "machine", "versions", "steps", "skip", "profiled_steps")
ROUND = ("passes", "one_rank", "shared", "nccl_two_ranks_one_gpu")


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One results file from the files of several rounds of the same command on the same machine (each the output
    of one run, or an earlier merge): the shared description once, each round's measurements under ``rounds``."""
    rounds: list[dict[str, Any]] = []
    for res in results:
        rounds += res["rounds"] if "rounds" in res else [{k: res[k] for k in ROUND if k in res}]
    first = results[0]
    for res in results[1:]:
        differ = [k for k in META if res.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"rounds of different runs cannot be merged: {differ} differ")
    return {**{k: first[k] for k in META}, "rounds": rounds}


def _per_round(values: list[Optional[float]], digits: int) -> str:
    return ", ".join("n/a" if v is None else f"{v:.{digits}f}" for v in values)


def _yes(values: list[Optional[bool]]) -> str:
    if all(v is None for v in values):
        return "n/a"
    return "yes" if all(values) else "NO (" + ", ".join(str(v) for v in values) + ")"


def _gist(said: str) -> str:
    """The NCCL error's code and its last line (the whole answer is in the results file)."""
    parts = said.split(" | ")
    code = [x for x in parts if x.startswith("nccl")]
    return "; ".join([*code[:1], parts[-1]]) if len(parts) > 1 else said


def render(res: dict[str, Any]) -> str:
    """docs/results/gpu_check.md from the results file (a run's file, or several rounds merged)."""
    if "rounds" not in res:
        res = merge([res])
    rounds = res["rounds"]
    v = res["versions"]
    lines = [
        "# GPU check: the data plane on one H200 GPU",
        "",
        f"Produced by `{res['command']}` on one H200 GPU ({res['machine']}; torch {v['torch']}, Lightning "
        f"{v['lightning']}, Python {v['python']}), {len(rounds)} round(s) of the same command, each round's value "
        "in order; every number below is in docs/results/gpu_check.json. The model is a channels_last ResNet-18 on random "
        f"32x32 images kept on the GPU, batch 64 per rank, SGD with momentum; {res['steps']} steps, throughput "
        f"measured after step {res['skip']} (wall time per step, after `torch.cuda.synchronize`); host<->device "
        f"copies counted by the profiler over {res['profiled_steps']} steps, per step, the mean over ranks.",
        "",
        "## Several ranks sharing the GPU (gloo)",
        "",
        "NCCL needs one GPU per rank, so ranks that share a GPU run every collective on gloo: ddp as "
        '`DDPStrategy(process_group_backend="gloo")`, pgc as `PGCStrategy(process_group_backend="gloo", '
        'data_backend="gloo")`. Codes, aggregates and `param.grad` stay on the GPU; gloo stages each all-reduce '
        "through host memory.",
        "",
        "| ranks | strategy | s/step | pgc / ddp | same aggregate bits | same parameters |",
        "|---:|---|---:|---:|---|---|",
    ]
    configs = [(r["ranks"], r["strategy"]) for r in rounds[0].get("shared", [])]

    def runs(ranks: int, strategy: str) -> list[dict[str, Any]]:
        got = [
            next((r for r in rd.get("shared", []) if (r["ranks"], r["strategy"]) == (ranks, strategy)), {})
            for rd in rounds
        ]
        return [r if "seconds_per_step" in r else {} for r in got]

    failed: list[str] = []
    for ranks, strategy in configs:
        mine, ddp = runs(ranks, strategy), runs(ranks, "ddp")
        times = [r.get("seconds_per_step") for r in mine]
        ratio = [
            t / d["seconds_per_step"] if t is not None and d and strategy != "ddp" else None for t, d in zip(times, ddp)
        ]
        lines.append(
            f"| {ranks} | {strategy} | {_per_round(times, 4)} | {_per_round(ratio, 2) if strategy != 'ddp' else ''} | "
            f"{_yes([r.get('aggregate_identical') for r in mine])} | {_yes([r.get('parameters_identical') for r in mine])} |"
        )
        for rd in rounds:
            for r in rd.get("shared", []):
                if (r["ranks"], r["strategy"]) == (ranks, strategy) and "error" in r:
                    failed.append(f"{strategy} on {ranks} ranks failed: `{r['error'][:300]}`")
    lines += [
        "",
        "Host<->device copies per step (count, and megabytes):",
        "",
        "| ranks | strategy | host to device | MB | device to host | MB |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    one = [rd.get("one_rank", {}).get("ddp", {}) for rd in rounds]
    rows = [(ranks, strategy, runs(ranks, strategy)) for ranks, strategy in configs]
    rows.append((1, "ddp (NCCL)", [r if "seconds_per_step" in r else {} for r in one]))
    for ranks, strategy, mine in rows:
        c = [r.get("host_copies_per_step_mean") or {} for r in mine]
        lines.append(
            f"| {ranks} | {strategy} | {_per_round([x.get('HtoD') for x in c], 1)} | "
            f"{_per_round([x['HtoD_bytes'] / 1e6 if x else None for x in c], 2)} | "
            f"{_per_round([x.get('DtoH') for x in c], 1)} | "
            f"{_per_round([x['DtoH_bytes'] / 1e6 if x else None for x in c], 2)} |"
        )
    placed = [r for r in rounds[-1].get("shared", []) if r["strategy"] != "ddp" and "placement" in r]
    if placed:
        p = placed[-1]["placement"]
        lines += [
            "",
            f"Where pgc's buffers lived ({placed[-1]['ranks']} ranks, last step of the last round): slots "
            f"{', '.join(p.get('slots', []))}; codes {', '.join(p.get('codes', []))}; aggregate "
            f"{p.get('aggregate', 'n/a')}; `param.grad` {', '.join(p.get('param_grad', []))}, views of the aggregate: "
            f"{_yes([p.get('param_grad_views_aggregate')])}, convolution gradients channels_last: "
            f"{_yes([p.get('conv_grads_channels_last')])}; data group `{p.get('data_group', 'n/a')}`.",
        ]
    lines += [f"\n{f}" for f in failed]
    lines += ["", "## One rank (NCCL)", ""]
    ok = [r for r in one if "seconds_per_step" in r]
    if ok:
        lines.append(
            f"ddp on one rank ({ok[0]['backend']}): {_per_round([r['seconds_per_step'] for r in ok], 4)} s/step "
            "(copies above)."
        )
    lines += [f"ddp on one rank failed: `{r['error'][:300]}`" for r in one if "error" in r]
    refused = rounds[0].get("one_rank", {}).get("pgc_cr", {}).get("refused")
    if refused:
        lines.append(f'pgc does not run on one rank: "{refused}".')
    for i, rd in enumerate(rounds, 1):
        probe = rd.get("nccl_two_ranks_one_gpu")
        if not probe:
            continue
        if "error" in probe:
            lines += [
                "",
                f"Round {i}: the probe of NCCL with two ranks on the one GPU did not run: `{probe['error'][:300]}`",
            ]
            continue
        said = "; ".join(
            f"rank {k}: exit {a['returncode']}"
            + (f", `{_gist(a['said'])}`" if "said" in a else " (its error line was not kept)")
            for k, a in enumerate(probe["ranks"])
        )
        lines += ["", f"Round {i}, two ranks asking NCCL for a group on the one GPU: {said}."]
    measured = [rd["passes"] for rd in rounds if "passes" in rd and "error" not in rd["passes"]]
    if measured:
        ps = measured[0]
        lines += [
            "",
            f"## The passes of a pgc step at {ps['params'] / 1e6:.0f} M parameters",
            "",
            f"Each pass a `pgc_cr` step (n = 4, s = 1, c = 2) makes over its payload ({ps['payload_numel']} float32 "
            f"values), by the library's own code, timed alone on the GPU with {ps['timer']} (median of "
            f"{ps['repeats']}; the gloo all-reduce: median of {ps['allreduce_repeats']} on the host clock after "
            "`torch.cuda.synchronize`, the slower of its two ranks). Bandwidth: the pass's fewest bytes through "
            "device memory over its time.",
            "",
            "| pass | ms | GB/s |",
            "|---|---:|---:|",
        ]
        for name in ps["ms"]:
            bw = [m["gb_per_s"].get(name) for m in measured]
            shown = "" if all(b is None for b in bw) else _per_round(bw, 0)
            lines.append(f"| {name} | {_per_round([m['ms'].get(name) for m in measured], 3)} | {shown} |")
        four = [sum(m["ms"][k] for k in m["fewest_bytes"]) for m in measured]
        gloo = [m["ms"].get("all-reduce, gloo, 2 ranks on the device") for m in measured]
        lines += [
            "",
            f"The four passes over the payload together: {_per_round(four, 3)} ms per round; the gloo all-reduce of "
            f"the same payload: {_per_round(gloo, 1)} ms.",
        ]
    lines += [
        f"\nThe pass timings failed: `{rd['passes']['error'][:300]}`"
        for rd in rounds
        if "error" in rd.get("passes", {})
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--allreduce-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--nccl-probe-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--numel", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--strategy", default="pgc_cr", help=argparse.SUPPRESS)
    p.add_argument("--backend", default="gloo", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(ROOT / "outputs" / "gpu_check"), help="the ranks' files")
    p.add_argument(
        "--json", default=str(ROOT / "outputs" / "gpu_check" / "round.json"), help="this round's results file"
    )
    p.add_argument(
        "--render", action="store_true", help="write docs/results/gpu_check.md from docs/results/gpu_check.json"
    )
    p.add_argument(
        "--merge", nargs="+", metavar="JSON", help="merge these runs' files into docs/results/gpu_check.json (+ .md)"
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4], help="ranks sharing the GPU, one run each")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--skip", type=int, default=5)
    p.add_argument("--accelerator", default="cuda")
    p.add_argument("--slow-seconds", type=float, default=0.0)
    p.add_argument("--passes-params", type=int, default=100_000_000, help="0: no pass timings")
    p.add_argument("--launch-timeout", type=float, default=240, help="seconds before one configuration's ranks die")
    p.add_argument("--no-nccl-probe", dest="nccl_probe", action="store_false")
    args = p.parse_args()
    if args.worker:
        args.ranks = args.ranks[0]
        worker(args)
    elif args.allreduce_worker:
        allreduce_worker(args)
    elif args.nccl_probe_worker:
        nccl_probe_worker(args)
    elif args.render or args.merge:
        files = args.merge or [str(DOCS / "gpu_check.json")]
        res = merge([json.loads(Path(f).read_text()) for f in files])
        write_report(DOCS, "gpu_check", res, page=render(res), newline=True)
    else:
        if args.skip + PROFILED_STEPS > args.steps:
            raise SystemExit(f"--steps must be at least --skip + {PROFILED_STEPS}")
        run(args)


if __name__ == "__main__":
    main()
