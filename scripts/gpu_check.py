"""One prepared check of aftgen on a device: the suite, parity, training, generation and serving.

    python scripts/gpu_check.py OUT [--device cuda] [--quick] [--corpus FILE] [--only STAGE,...]

Every stage runs in its own process with its own time limit; a failure is recorded and the later
stages still run. OUT receives results.json (every figure), report.txt (which stages passed, the
main numbers) and log.txt (each stage's command and the end of its output). `--quick` (the default
on the CPU) shrinks every size so the whole check takes about a minute; tests/test_gpu_check.py
runs it that way, so the script cannot rot where no GPU is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Where Tiny Shakespeare may be: a carried bundle (make gpu-bundle), the checkout's shared/, the folder beside it.
CORPUS_PLACES = (
    ".gpu-bundle/tinyshakespeare.txt",
    "shared/data/tinyshakespeare.txt",
    "../shared/data/tinyshakespeare.txt",
)
PACKAGES = ("torch", "triton", "numpy", "typer", "sentencepiece", "safetensors", "huggingface-hub", "rich",
            "starlette", "uvicorn", "openai", "pydantic", "pytest", "hypothesis", "pytest-xdist")  # fmt: skip
TRAIN_MARGIN = 30  # seconds a training run takes beyond --max-time: start, corpus, the final held-out score
LOG_TAIL = 4000
MODEL_TESTS = (
    "mixers",
    "test_mixers.py",
    "generation",
    "training/test_loop.py",
    "test_serve.py",
    "serve",
    "test_cli.py",
    "cli/test_generate.py",
    "bench/test_mixers.py",
)  # characters of each stage's output kept in log.txt


@dataclass
class Sizes:
    """What each stage runs: the full sizes for a GPU, or `quick` ones that keep a CPU run near a minute."""

    suite: list[str]
    train: list[str]
    train_time: float
    compile_time: float
    parity_tokens: int
    bench_train: list[str]
    kernel: list[str]  # the fused mixer kernels' stage: lengths, preset, tokens per step, timed repeats
    bench_generate: list[str]
    serve: list[str]

    @classmethod
    def pick(cls, quick: bool) -> Sizes:
        if quick:
            return cls(
                suite=["tests/mixers/test_aft.py::test_model_parallel_equals_recurrent_over_1000_tokens"],
                train=["--preset", "tiny", "--vocab-size", "300", "--eval-interval", "10", "--eval-windows", "4"],
                train_time=3,
                compile_time=3,
                parity_tokens=100,
                bench_train=["--lengths", "64", "--mixers", "aft_local", "--repeats", "1"],
                kernel=["64", "tiny", "128", "1"],
                bench_generate=["--preset", "tiny", "--contexts", "600,1200", "--tokens", "1500"],
                # batch invariance set, not judged at the server's start: one step to compile, not two to time
                serve=["--tokens", "16", "--rounds", "1", "--batch-invariant"],
            )
        return cls(
            # The model-heavy files first: with -x, a failure elsewhere then stops the suite after them.
            suite=["-m", "not cpu", *(f"tests/{name}" for name in MODEL_TESTS), "tests"],
            train=[],
            train_time=120,
            compile_time=60,  # what the budget leaves: enough to show --compile works and its speed
            parity_tokens=2048,
            bench_train=["--lengths", "1024,4096,16384", "--mixers", "aft_local,attention", "--repeats", "3"],
            kernel=["1024,4096,16384", "small", "4096", "5"],  # bench train's model and tokens per step
            bench_generate=["--contexts", "1000,8000,32000", "--tokens", "3000"],
            serve=["--tokens", "128", "--rounds", "1"],
        )


@dataclass
class Stage:
    name: str
    timeout: float  # seconds
    run: Callable[[Stage], dict]  # returns the stage's figures; raises StageFailed on a failure
    ok: bool | None = None  # None: not run
    seconds: float = 0.0
    error: str = ""
    figures: dict = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


class StageFailed(Exception):
    pass


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.out: Path = args.out
        self.device: str = args.device
        self.quick: bool = args.quick if args.quick is not None else args.device == "cpu"
        self.sizes = Sizes.pick(self.quick)
        self.work = Path(tempfile.mkdtemp(prefix="aftgen-gpu-check-"))
        self.corpus = args.corpus or self._find_corpus()
        self.deadline = time.monotonic() + args.budget
        # --eager: torch.compile off in every stage (TorchDynamo's own switch), for a short CPU run.
        self.env = {"TORCHDYNAMO_DISABLE": "1"} if args.eager else {}
        self.runs: dict[str, Path] = {}

    # --- helpers -------------------------------------------------------------------------------------

    def _find_corpus(self) -> Path:
        for place in CORPUS_PLACES:
            if (ROOT / place).is_file():
                return (ROOT / place).resolve()
        # No Tiny Shakespeare here (the device machine has no ../shared): the suite's play-like text, 1 MB.
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_corpus

        path = self.work / "synthetic-plays.txt"
        path.write_text(make_corpus(200_000 if self.quick else 1_000_000, seed=26))
        return path

    def command(self, stage: Stage, args: list[str], env: dict | None = None) -> str:
        """Run `args` within the stage's time; its output, or StageFailed with the end of it.

        In a session of its own: on a timeout the whole group goes (pytest's workers, a bench's server,
        its probe processes), so nothing of this stage runs on into the next one's timings.
        """
        limit = min(stage.timeout, self.deadline - time.monotonic())
        stage.log.append("$ " + " ".join(args))
        process = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env=os.environ | self.env | (env or {}), start_new_session=True,
        )  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            stage.log.append(stdout[-LOG_TAIL:] + stderr[-LOG_TAIL:])
            raise StageFailed(f"timed out after {limit:.0f} s") from None
        stage.log.append(stdout[-LOG_TAIL:] + stderr[-LOG_TAIL:])
        if process.returncode != 0:
            last = (stderr.strip() or stdout.strip()).splitlines()[-1:] or [""]
            raise StageFailed(f"exit {process.returncode}: {last[0][:300]}")
        return stdout

    def aftgen(self, stage: Stage, *args: str) -> str:
        return self.command(stage, [sys.executable, "-m", "aftgen", *args])

    def json_rows(self, stage: Stage, *args: str) -> list[dict]:
        return [json.loads(line) for line in self.aftgen(stage, *args, "--json").splitlines() if line.startswith("{")]

    # --- stages ---------------------------------------------------------------------------------------

    def environment(self, stage: Stage) -> dict:
        import torch

        stage.log.append("(read in the check's own process)")
        figures = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "packages": {name: _version(name) for name in PACKAGES},
            "torch_cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
            "device": self.device,
            "quick": self.quick,
            "corpus": str(self.corpus),
            "corpus_mb": round(self.corpus.stat().st_size / 1e6, 2),
        }
        if self.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise StageFailed(f"torch {torch.__version__} sees no CUDA GPU")
            properties = torch.cuda.get_device_properties(0)
            figures |= {
                "gpu": properties.name,
                "gpu_memory_gib": round(properties.total_memory / 2**30, 1),
                "compute_capability": f"{properties.major}.{properties.minor}",
                "bf16": torch.cuda.is_bf16_supported(),
            }
        return figures

    def suite(self, stage: Stage) -> dict:
        report = self.work / "suite.xml"
        args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", f"--junitxml={report}"]
        if not self.quick and _version("pytest-xdist"):
            args += ["-n", "12"]  # tiny models: the suite is bound by the CPU side, and this machine has cores
        try:
            self.command(stage, [*args, *self.sizes.suite], env={"AFTGEN_TEST_DEVICE": self.device})
        finally:
            counts = _junit_counts(report) if report.exists() else {}
            stage.figures.update(counts)
        return counts

    def parity(self, stage: Stage) -> dict:
        code = PARITY.replace("TOKENS", str(self.sizes.parity_tokens))
        figures = json.loads(self.command(stage, [sys.executable, "-c", code, self.device]).splitlines()[-1])
        if not figures["ok"]:
            raise StageFailed(f"forms disagree past their tolerances: {figures}")
        return figures

    def train(self, stage: Stage, *extra: str, seconds: float) -> dict:
        """`aftgen train` for `seconds`, or less where the budget has less left (the run's own figures say which)."""
        left = self.deadline - time.monotonic() - TRAIN_MARGIN
        if left < min(seconds, 10):
            raise StageFailed("not run: the check's time budget was spent")
        seconds = round(min(seconds, left))
        out = self.work / stage.name
        args = ["train", str(self.corpus), "--out", str(out), "--device", self.device, "--max-time", str(seconds)]
        self.aftgen(stage, *args, "--max-steps", "1000000", *self.sizes.train, *extra)
        self.runs[stage.name] = out
        stage.figures = _run_figures(out, stage.log[-1]) | {"max_time": seconds}
        if "--compile" in extra and stage.figures["note"]:
            raise StageFailed(f"torch.compile did not run: {stage.figures['note']}")
        return stage.figures

    def bench_train(self, stage: Stage) -> dict:
        return {
            "rows": self.json_rows(
                stage, "bench", "train", "--device", self.device, *self.sizes.bench_train, "--rounds", "1"
            )
        }

    def kernel(self, stage: Stage) -> dict:
        """The fused mixer kernels (issue 33) against the PyTorch form and SDPA; on a CPU in Triton's interpreter."""
        env = {"TRITON_INTERPRET": "1"} if self.device == "cpu" else {}
        output = self.command(stage, [sys.executable, "-c", KERNEL, self.device, *self.sizes.kernel], env=env)
        figures = json.loads(output.splitlines()[-1])
        if not figures["ok"]:
            raise StageFailed(f"the fused kernels disagree with the PyTorch form: {figures['parity']}")
        return figures

    def bench_generate(self, stage: Stage) -> dict:
        return {"rows": self.json_rows(stage, "bench", "generate", "--device", self.device, *self.sizes.bench_generate)}

    def bench_serve(self, stage: Stage) -> dict:
        # On a GPU the shipped model; in a quick run the tiny model trained above (the shipped one is slow on a CPU).
        model = ["--model", str(self.runs["train_bf16"])] if self.quick and "train_bf16" in self.runs else []
        return {"rows": self.json_rows(stage, "bench", "serve", "--device", self.device, *model, *self.sizes.serve)}

    def stages(self) -> list[Stage]:
        sizes = self.sizes
        return [
            Stage("environment", 60, self.environment),
            Stage("parity", 120, self.parity),
            Stage("suite", 150, self.suite),
            Stage(
                "train_bf16",
                sizes.train_time + 90,
                lambda s: self.train(s, "--dtype", "bf16", seconds=sizes.train_time),
            ),
            Stage("bench_train", 150, self.bench_train),
            Stage("kernel", 360, self.kernel),
            Stage("bench_generate", 150, self.bench_generate),
            Stage("bench_serve", 120, self.bench_serve),
            # Last: a run short of the budget trains for what is left (its figures record how long).
            Stage(
                "train_compile",
                sizes.compile_time + 120,
                lambda s: self.train(s, "--dtype", "bf16", "--compile", seconds=sizes.compile_time),
            ),
        ]

    def run(self, only: set[str] | None) -> list[Stage]:
        stages = [stage for stage in self.stages() if only is None or stage.name in only or stage.name == "environment"]
        names = [stage.name for stage in self.stages()]
        unknown = sorted((only or set()) - set(names))
        if unknown:
            print(f"error: --only: no stage {', '.join(unknown)}; choose from: {', '.join(names)}", file=sys.stderr)
            raise SystemExit(2)
        for stage in stages:
            left = self.deadline - time.monotonic()
            if left < 10:
                stage.error = "not run: the check's time budget was spent"
                continue
            print(
                f"gpu-check: {stage.name} (at most {min(stage.timeout, left):.0f} s) ...", file=sys.stderr, flush=True
            )
            started = time.monotonic()
            try:
                stage.figures |= stage.run(stage)
                stage.ok = True
            except StageFailed as exc:
                stage.ok, stage.error = False, str(exc)
            except Exception as exc:  # a bug in a stage must not stop the others
                stage.ok, stage.error = False, f"{type(exc).__name__}: {exc}"
            stage.seconds = round(time.monotonic() - started, 1)
            verdict = "passed" if stage.ok else f"FAILED: {stage.error}"
            print(f"gpu-check: {stage.name} {verdict} ({stage.seconds} s)", file=sys.stderr, flush=True)
            self.write(stages)  # after every stage: a run stopped from outside still leaves its results
        return stages

    def write(self, stages: list[Stage]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        results = {
            "device": self.device,
            "quick": self.quick,
            "passed": all(stage.ok for stage in stages),
            "stages": [{k: v for k, v in vars(stage).items() if k not in ("run", "log")} for stage in stages],
        }
        _write(self.out / "results.json", json.dumps(results, indent=2, default=str) + "\n")
        _write(self.out / "report.txt", report(stages, self.device, self.quick))
        log = [f"===== {stage.name}\n" + "\n".join(stage.log) for stage in stages if stage.log]
        _write(self.out / "log.txt", "\n\n".join(log) + "\n")


# The parallel (training) form against the recurrent (generation) form of the shipped model, on the
# device, in fp32 (no TF32) and under bf16 autocast; bf16 is also held against the fp32 logits.
PARITY = """
import json, sys, torch
import aftgen
from aftgen.device import Placement, pick_device
device = pick_device(sys.argv[1])
torch.backends.cuda.matmul.allow_tf32 = False
model, _ = aftgen.load(None, device)
ids = torch.randint(0, model.config.vocab_size, (2, TOKENS), generator=torch.Generator().manual_seed(0)).to(device)
def forms(dtype):
    placement = Placement(device, dtype)
    with torch.inference_mode(), placement.autocast():
        parallel = model(ids).float()
        state = model.initial_state(2)
        half, state = model.prefill(ids[:, : TOKENS // 2], state)
        stepped = [model.step(ids[:, t], state)[0].float() for t in range(TOKENS // 2, TOKENS)]
    return parallel, torch.cat([half.float(), torch.stack(stepped, 1)], 1)
exact, exact_recurrent = forms(torch.float32)
mixed, mixed_recurrent = forms(torch.bfloat16)
scale = exact.abs().max().item()
figures = {
    "tokens": TOKENS,
    "logit_scale": round(scale, 3),
    "fp32_max_diff": (exact - exact_recurrent).abs().max().item(),
    "bf16_max_diff": (mixed - mixed_recurrent).abs().max().item(),
    "bf16_vs_fp32_max_diff": (mixed - exact).abs().max().item(),
    "bf16_top1_agreement": (mixed.argmax(-1) == exact.argmax(-1)).float().mean().item(),
}
figures["ok"] = (figures["fp32_max_diff"] <= 1e-3 and figures["bf16_max_diff"] <= 0.05 * scale
                 and figures["bf16_vs_fp32_max_diff"] <= 0.05 * scale and figures["bf16_top1_agreement"] >= 0.9)
print(json.dumps(figures))
"""

# The fused mixer kernels (issue 33) on the device: their parity with the PyTorch form (fp32 exact; bf16 autocast
# with TF32, as training runs), then per length the mixer alone, forward + backward, in either form against
# attention (SDPA: flash in bf16), and a training step of the whole model, both mixers compiled, bf16.
# argv: device, lengths, preset, tokens per step, timed repeats. The bars are issue 33's, for a GPU.
KERNEL = """
import contextlib, json, os, sys, time, torch
from aftgen.bench.mixers import comparison_model
from aftgen.device import resolve, synchronize
from aftgen.mixers.chunked import KERNEL_VARIABLE
from aftgen.training.probe import training_step
device, lengths, preset, tokens, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
placement = resolve(device, "bf16")
BARS = {1024: 1.0, 4096: 1.5, 16384: 3.0}  # compiled train tokens/s, aft_local / attention
def seconds(run):
    for _ in range(2):
        run()
    best = float("inf")
    for _ in range(repeats):
        synchronize(placement.device)
        start = time.perf_counter()
        run()
        synchronize(placement.device)
        best = min(best, time.perf_counter() - start)
    return best
def mixer_pass(mixer, x, grad, form, autocast):
    def run():
        os.environ[KERNEL_VARIABLE] = form
        with autocast():
            y, _ = mixer(x)
        y.backward(grad.to(y.dtype))
        return y
    return run
def worst_difference(mixer, x, grad, autocast):
    results = {}
    for form in ("torch", "triton"):
        mixer.zero_grad()
        x.grad = None
        y = mixer_pass(mixer, x, grad, form, autocast)()
        results[form] = [y.float(), x.grad] + [p.grad for p in mixer.parameters() if p.grad is not None]
    return max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()
               for a, b in zip(results["triton"], results["torch"], strict=True))
rows, parity = [], {}
for length in (int(t) for t in lengths.split(",")):
    batch = max(1, tokens // length)
    torch.manual_seed(0)
    models = {name: comparison_model(name, length, preset).to(placement.device).train()
              for name in ("aft_local", "attention")}
    x = torch.randn(batch, length, models["aft_local"].config.n_embd, device=placement.device, requires_grad=True)
    grad = torch.randn_like(x)
    mixer = models["aft_local"].blocks[0].mixer
    if not parity:
        allowed = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        parity["fp32"] = worst_difference(mixer, x, grad, contextlib.nullcontext)
        torch.backends.cuda.matmul.allow_tf32 = allowed
        parity["bf16"] = worst_difference(mixer, x, grad, placement.autocast)
    row = {"length": length, "batch": batch}
    for name, form in (("torch", "torch"), ("triton", "triton"), ("attention", "auto")):
        chosen = models["attention"].blocks[0].mixer if name == "attention" else mixer
        row[f"mixer_ms_{name}"] = 1e3 * seconds(mixer_pass(chosen, x, grad, form, placement.autocast))
    os.environ[KERNEL_VARIABLE] = "auto"
    for name, model in models.items():
        step = training_step(torch.compile(model), batch, length, placement.autocast)
        row[f"train_tokens_per_s_{name}"] = batch * length / seconds(step)
    row["mixer_triton_vs_attention"] = row["mixer_ms_attention"] / row["mixer_ms_triton"]
    row["train_vs_attention"] = row["train_tokens_per_s_aft_local"] / row["train_tokens_per_s_attention"]
    if length in BARS:
        row["bar"], row["met"] = BARS[length], row["train_vs_attention"] >= BARS[length]
    rows.append(row)
    del models, mixer, x, grad
ok = parity["fp32"] <= 1e-4 and parity["bf16"] <= 0.02
print(json.dumps({"parity": parity, "rows": rows, "ok": ok}))
"""


def report(stages: list[Stage], device: str, quick: bool) -> str:
    passed = sum(1 for stage in stages if stage.ok)
    lines = [
        f"aftgen gpu-check on {device}{' (quick sizes)' if quick else ''}: {passed}/{len(stages)} stages passed",
        "",
    ]
    for stage in stages:
        verdict = "passed" if stage.ok else "FAILED" if stage.ok is False else "not run"
        lines.append(f"{stage.name:<15} {verdict:<8} {stage.seconds:>7.1f} s  {stage.error}".rstrip())
    lines.append("")
    for stage in stages:
        lines += [f"  {line}" for line in _summary(stage)]
    return "\n".join(lines) + "\n"


def _summary(stage: Stage) -> list[str]:
    """The figures a reader wants first, one line each."""
    f = stage.figures
    if not f:
        return []
    if stage.name == "environment":
        packages = ", ".join(f"{k} {v}" for k, v in f["packages"].items() if v)
        gpu = f"{f['gpu']}, {f['gpu_memory_gib']} GiB, sm {f['compute_capability']}" if "gpu" in f else "no GPU"
        return [
            f"environment: {gpu}; Python {f['python']}, CUDA {f['torch_cuda']}",
            f"packages: {packages}",
            f"corpus: {f['corpus']} ({f['corpus_mb']} MB)",
        ]
    if stage.name == "suite":
        counts = ", ".join(f"{f.get(k, 0)} {k}" for k in ("passed", "failed", "errors", "skipped"))
        return [f"suite: {counts}" + (f"; first failure: {f['first_failure']}" if f.get("first_failure") else "")]
    if stage.name == "parity":
        return [
            f"parity over {f['tokens']} tokens, max |logit diff|: fp32 {f['fp32_max_diff']:.2e}, "
            f"bf16 {f['bf16_max_diff']:.3g}, bf16 vs fp32 {f['bf16_vs_fp32_max_diff']:.3g} "
            f"(logits up to {f['logit_scale']}); bf16 top-1 agreement {f['bf16_top1_agreement']:.4f}"
        ]
    if stage.name == "kernel":
        lines = [f"kernel parity with the PyTorch form, worst relative diff: fp32 {f['parity']['fp32']:.2e}, "
                 f"bf16 {f['parity']['bf16']:.2e}"]  # fmt: skip
        for row in f["rows"]:
            bar = f" [{'ok' if row['met'] else 'missed'}: >= {row['bar']}]" if "bar" in row else ""
            lines.append(
                f"kernel T={row['length']} (batch {row['batch']}): mixer fwd+bwd torch {row['mixer_ms_torch']:.2f} ms, "
                f"triton {row['mixer_ms_triton']:.2f} ms, attention {row['mixer_ms_attention']:.2f} ms; "
                f"compiled bf16 train aft_local / attention {row['train_vs_attention']:.2f}x{bar}"
            )
        return lines
    if "nats_per_char" in f:
        note = f"; {f['note']}" if f.get("note") else ""
        return [
            f"{stage.name}: held-out {f['nats_per_char']:.4f} nats/char ({f['bits_per_char']:.4f} bits/char) "
            f"after {f['steps']} steps in {f['elapsed']:.0f} s (--max-time {f['max_time']}); "
            f"{f['tokens_per_s']:,.0f} tokens/s (median of checks), {f['tokens_per_s_overall']:,.0f} overall{note}"
        ]
    return [f"{stage.name}: {_row_text(row)}" for row in f.get("rows", []) if _headline(stage.name, row)]


def _headline(stage: str, row: dict) -> bool:
    if "target" in row:
        return True
    wanted = {
        "bench_train": ("train step", "train peak memory"),
        "bench_generate": ("step latency", "prompt ingestion", "matvec floor"),
        "bench_serve": ("aggregate throughput", "inter-token latency p99"),
    }[stage]
    return row["measure"].startswith(wanted) and not (stage == "bench_serve" and row.get("streams") == 8)


def _row_text(row: dict) -> str:
    keys = ("mixer", "length", "context", "streams", "generated", "compared")
    where = ", ".join(f"{k} {row[k]}" for k in keys if k in row)
    ratio = f" ({row['vs_attention']}x attention)" if "vs_attention" in row else ""
    verdict = f" [{'ok' if row['ok'] else 'missed'}: {row['target']}]" if "target" in row else ""
    return (
        f"{row['measure']}{' (' + where + ')' if where else ''}: {row['value']} {row.get('unit', '')}{ratio}{verdict}"
    )


def _run_figures(out: Path, output: str) -> dict:
    """A finished run's held-out score, steps, time and training speed (the median over its checks)."""
    info = json.loads((out / "training.json").read_text())
    metrics = out / "metrics.jsonl"  # absent when the run ended before its first check (a long compile)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    speeds = [row["tokens_per_s"] for row in rows if row.get("tokens_per_s")]
    final = info["final_eval"]
    tokens = info["step"] * info["global_batch_size"] * info["settings"]["context_length"]
    fell_back = [line for line in output.splitlines() if "compile" in line.lower() and "eager" in line.lower()]
    return {
        "nats_per_char": final["nats_per_char"],
        "bits_per_char": final["bits_per_char"],
        "steps": info["step"],
        "elapsed": info["elapsed"],
        "tokens_per_s": statistics.median(speeds) if speeds else 0.0,
        "tokens_per_s_overall": tokens / info["elapsed"],  # warm-up and checks included
        "device": info.get("device"),
        "note": fell_back[0][:200] if fell_back else "",
    }


def _junit_counts(report: Path) -> dict:
    suite = ElementTree.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {name: int(suite.get(name, 0)) for name in ("tests", "failures", "errors", "skipped")}
    broken = [
        case for case in suite.iter("testcase") if case.find("failure") is not None or case.find("error") is not None
    ]
    first = broken[0] if broken else None
    return {
        "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
        "failed": counts["failures"],
        "errors": counts["errors"],
        "skipped": counts["skipped"],
        "first_failure": f"{first.get('classname')}::{first.get('name')}" if first is not None else "",
    }


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


def _write(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="Folder for results.json, report.txt and log.txt.")
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu.")
    quick = "Small sizes (default: on the CPU only)."
    parser.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None, help=quick)
    parser.add_argument("--corpus", type=Path, help="Text to train on (default: Tiny Shakespeare if found).")
    parser.add_argument("--only", help="Comma-separated stages to run (a rerun of some); environment always runs.")
    parser.add_argument("--eager", action="store_true", help="Turn torch.compile off in every stage (faster on a CPU).")
    parser.add_argument(
        "--budget", type=float, default=560.0, help="Seconds for the whole check; later stages get less."
    )
    args = parser.parse_args()
    if args.corpus is not None and not args.corpus.is_file():
        print(f"error: --corpus {args.corpus}: no such file", file=sys.stderr)
        return 2
    check = Check(args)
    try:
        stages = check.run(set(args.only.split(",")) if args.only else None)
    finally:
        shutil.rmtree(check.work, ignore_errors=True)  # the runs' checkpoints: their figures are in results.json
    print(report(stages, check.device, check.quick), end="")
    return 0 if all(stage.ok for stage in stages) else 1


if __name__ == "__main__":
    sys.exit(main())
