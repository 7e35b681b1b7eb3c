"""The GPU check: one command on a bare GPU machine (torch, transformers and triton installed, no
network), within 8 minutes, one PASS or FAIL line per check with the figure it measured.

    scripts/gpu_pack.sh             # here: .gpu/ (wheels the machine lacks, the bundled tokenizer)
    scripts/gpu_check.sh            # there, carrying .gpu/: every check
    scripts/gpu_check.sh --dry-run  # anywhere: the checks and their targets, nothing run

The bundled model's weights (~94 MiB) do not fit one transfer: .gpu/ carries the bundled file's
header alone (its config and tokenizer, no tensors). Tests that need the real weights then skip
with that reason, and the timing checks of the bundled model run on random weights in its
shapes (`--load-format dummy`), which cost the same time; each line says which it ran.
`gpu_pack.sh --with-model` carries the whole file where a transfer allows it.

Everything here is the standard library (and `packaging`, a dependency of transformers, to pick
the wheels), so the dry run and the set-up need nothing installed; the checks run as child
processes of the machine's Python. Results go to $OUT when it is set (`results.txt`,
`results.json`, `logs/`). `--device cpu --small` rehearses a run without a GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

# Run as a file: its folder is first on the path, and gpu_pack beside it is imported from there.
from gpu_pack import BUNDLED_FILE, BUNDLED_PACKAGE, CARRY, ROOT, dir_bytes, gguf_tensor_count

BUDGET_S = 460.0  # of the 8 minutes a device call may take, the rest for start-up and transfer
# Sends of one burst request at most (OpenAI's client makes 3 by default; the check asks more of
# the server's Retry-After: that every request gets in while the client waits as told).
RETRIES = 20
# The tests of what runs on the device (each runs its kernels compiled there, not interpreted).
TESTS = ["tests/gpu", "tests/test_triton_attention.py", "tests/test_triton_decode_split.py",
         "tests/test_triton_prefill.py", "tests/test_triton_self_checks.py",
         "tests/test_triton_norms.py", "tests/test_mixed_graphs.py"]


@dataclass
class Check:
    key: str
    title: str
    target: str
    budget_s: float  # at most this long; less when the whole budget runs short
    status: str = "FAIL"
    figure: str = "not run"
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def line(self) -> str:
        return (f"{self.status:<4} ({self.key}) {self.title}: {self.figure} "
                f"[target: {self.target}] ({self.seconds:.0f} s)")


def checks(small: bool) -> list[Check]:
    """The checks in the order they run; `small`: a rehearsal's loads, and three times the
    time (a CPU runs even those far slower). The measured targets come first and the tests
    last, with what is left: 75 s of the 460 where every check before takes all of its own
    (less the server's shutdown after (c), at most 20 s); a test run cut short still says how
    far it got."""
    burst = 48 if small else 1024
    todo = [
        Check("d1", "decode step, bundled model (SmolLM2-135M), batch 32, context 512; and "
              "with a 64-token prompt chunk, replayed from its token bucket vs eager",
              "runs; step time / bandwidth floor printed (no ratio target yet: that belongs "
              "to the attention kernel work)", 60),
        Check("d2", "decode step, llama-3.1-8b shapes (--load-format dummy), batch 32, "
              "context 2048", "runs; step time / bandwidth floor printed (no ratio target "
              "yet: that belongs to the attention kernel work)", 70),
        Check("e", "chat64 through our engine vs transformers static batching, same GPU, "
              "dtype and prompts (`python -m scripts.bench gpu`)", "ours faster than the best "
              "transformers batch", 110),
        Check("b", "chat64 over HTTP, `batcher serve` at its default flags, all 64 at once",
              "64/64 answered", 90),
        Check("c", f"burst of {burst} short synthetic requests at t=0, client honouring "
              "429/503 + Retry-After (`batcher bench --retries`)",
              f"{burst}/{burst} answered", 55),
        Check("a", "GPU tests: " + " ".join(TESTS), "all pass (bundled-weight tests skip, "
              "with the reason, where the weights were not carried)", 150),
    ]
    for c in todo:
        c.budget_s *= 3 if small else 1
    return todo


# ---- set-up on the machine ---------------------------------------------------------------------

def install_wheels(site: Path) -> list[str]:
    """Unpack into `site` the carried wheel of each package that best fits this Python."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename

    rank = {t: i for i, t in enumerate(sys_tags())}
    best: dict[str, tuple[int, Path]] = {}
    for whl in sorted((CARRY / "wheels").glob("*.whl")):
        name, _, _, tags = parse_wheel_filename(whl.name)
        r = min((rank[t] for t in tags if t in rank), default=None)
        if r is not None and (name not in best or r < best[name][0]):
            best[name] = (r, whl)
    for _, whl in best.values():
        with zipfile.ZipFile(whl) as z:
            z.extractall(site)
    return sorted(best)


def bundled_dir(site: Path) -> Path | None:
    """Where the bundled model package is: installed on this machine, or the carried one."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is not None and spec.origin is not None:
        return Path(spec.origin).parent
    carried = CARRY / "bundled" / BUNDLED_PACKAGE
    return carried if (carried / BUNDLED_FILE).is_file() else None


@dataclass
class Env:
    py: str
    env: dict
    logs: Path
    device: str
    small: bool
    weights: bool  # the bundled model's real weights are here
    deadline: float
    site: Path  # the carried wheels, unpacked
    url: str = ""  # the server of (b) and (c)

    def left(self) -> float:
        return self.deadline - time.monotonic()


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict) -> int | None:
    """Run `cmd` in its own process group, output to `log`; None if it ran out of time (then
    the whole group is ended)."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def tail(log: Path, n: int = 3) -> str:
    return tail_text(log.read_text(errors="replace"), n)


def tail_text(text: str, n: int = 3) -> str:
    lines = [x for x in text.splitlines() if x.strip()]
    return " | ".join(lines[-n:])[-400:]


# ---- the checks --------------------------------------------------------------------------------

def check_tests(c: Check, e: Env) -> None:
    log = e.logs / "tests.log"
    rc = run_logged([e.py, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider", *TESTS], log,
                    min(c.budget_s, e.left()), e.env)
    c.figure = tests_figure(log.read_text(errors="replace"), rc)
    c.status = "PASS" if rc == 0 else "FAIL"


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# A test's line under `-v`: its id (spaces allowed in parameters), then its outcome.
TEST_OUTCOME = re.compile(rf"^(\S+::.+?) ({'|'.join(OUTCOMES)})\b", re.MULTILINE)


def tests_figure(text: str, rc: int | None) -> str:
    """What a pytest run (`-v -rs`) says of itself: its summary line and the reasons for its
    skips, or, where it was cut short (`rc` None) or printed no summary, its tests' outcomes so
    far and the failed ones by name."""
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed|skipped|error).*?)\s*=*$", text,
                         re.MULTILINE)
    skips = re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", text, re.MULTILINE)
    if summary and rc is not None:
        figure = summary[-1]
    else:
        outcomes = TEST_OUTCOME.findall(text)
        counts = {k: sum(o == k for _, o in outcomes) for k in OUTCOMES}
        so_far = ", ".join(f"{n} {k.lower()}" for k, n in counts.items() if n) or "no test done"
        bad = [t for t, o in outcomes if o in ("FAILED", "ERROR")]
        # `-v` prints a test's id as it starts and its outcome as it ends: a last id with no
        # outcome is the test the run was cut in.
        ids = [x for x in text.splitlines() if "::" in x.split(" ")[0]]
        running = (ids[-1].split(" [")[0].strip()
                   if ids and rc is None and not TEST_OUTCOME.match(ids[-1]) else None)
        figure = (f"{'timed out' if rc is None else f'exited {rc}'} after {so_far}"
                  + (f" (failed: {', '.join(bad)})" if bad else "")
                  + (f", in {running}" if running else "")
                  + ("" if outcomes or rc is None else f": {tail_text(text)}"))
    if skips:
        figure += f"; skipped: {'; '.join(sorted(set(skips)))}"
    return figure


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except OSError:
        return 0


def model_flags(e: Env) -> tuple[list[str], str]:
    if e.weights:
        return [], "bundled model"
    return (["--load-format", "dummy"],
            "random weights in the bundled model's shapes (its weights were not carried)")


def check_serving(b: Check, c: Check, e: Env) -> None:
    """(b) and (c) against one `batcher serve` started with its default flags."""
    port = free_port()
    flags, what = model_flags(e)
    # The embedding model (another ~90 MiB package) is not carried and not part of either load.
    cmd = [e.py, "-m", "batcher.app.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--embedding-model", "none", *flags]
    if e.device != "cuda":
        cmd += ["--device", e.device]
    base = e.url = f"http://127.0.0.1:{port}"
    log = (e.logs / "serve.log").open("w")
    server = subprocess.Popen(cmd, cwd=ROOT, env=e.env, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True)
    t0 = time.monotonic()
    try:
        ready_by = t0 + min(b.budget_s, e.left())
        while time.monotonic() < ready_by and server.poll() is None and get(base + "/ready") != 200:
            time.sleep(0.5)
        start = time.monotonic() - t0
        if get(base + "/ready") != 200:
            why = "exited" if server.poll() is not None else "not ready in time"
            for x in (b, c):
                x.figure = f"server {why} after {start:.0f} s: {tail(e.logs / 'serve.log')}"
            return
        try:
            serve_chat64(b, e, start, " ".join(["--embedding-model none", *flags]), what)
        except Exception as exc:  # noqa: BLE001 (the burst still runs on the same server)
            failed_itself(b, e, exc)
        b.seconds = time.monotonic() - t0
        t1 = time.monotonic()
        try:
            serve_burst(c, e, what)
        except Exception as exc:  # noqa: BLE001
            failed_itself(c, e, exc)
        c.seconds = time.monotonic() - t1
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
        log.close()


def serve_chat64(b: Check, e: Env, start: float, extra: str, what: str) -> None:
    """(b): chat64, all at once, against the server of `check_serving` (ready after `start` s)."""
    n = 8 if e.small else 64
    answered(b, e, "chat64", ["--num-requests", str(n)], b.budget_s - start, n, lambda s: (
        f"{s['ok']}/{n} answered in {s['duration_s']:.1f} s, "
        f"{s['output_tok_s']:.0f} output tok/s, p50 TTFT "
        f"{s['ttft_ms']['p50'] or 0:.0f} ms, errors {s['errors_by_kind'] or 0}, "
        f"{s['length_mismatches']} short; server ready in {start:.0f} s with "
        f"`{extra}` (the embedding model is not carried); {what}"))


def serve_burst(c: Check, e: Env, what: str) -> None:
    """(c): a burst at t=0 whose client sends a refused request again as Retry-After says."""
    n = 48 if e.small else 1024
    args = ["--synthetic", "--num-requests", str(n), "--input-median", "64", "--output-median",
            "32", "--max-input", "256", "--max-output", "128", "--retries", str(RETRIES),
            "--warmup", "0"]
    answered(c, e, "burst", args, c.budget_s, n, lambda s: (
        f"{s['ok']}/{n} answered in {s['duration_s']:.1f} s, "
        f"{s['retried']} sent again after 429/503 ({s['retries']} retries, "
        f"at most {s['max_attempts']} sends of {RETRIES + 1}), "
        f"still failed: {s['errors_by_kind'] or 0}, p50 TTFT "
        f"{s['ttft_ms']['p50'] or 0:.0f} ms; {what}"))


def answered(c: Check, e: Env, name: str, args: list[str], budget: float, n: int,
             describe: Callable[[dict], str]) -> None:
    """`batcher bench` NAME with `args` against the server: `c` passes when all `n` requests
    were answered; its figure is `describe(summary)`."""
    s = bench(e, name, args, budget)
    if s is None:
        c.figure = f"the load client failed: {tail(e.logs / f'bench-{name}.log')}"
        return
    c.status = "PASS" if s["ok"] == n else "FAIL"
    c.figure = describe(s)
    c.details = s


def bench(e: Env, name: str, args: list[str], budget: float) -> dict | None:
    """`batcher bench` against the running server; its summary, or None if it failed."""
    out = e.logs / f"bench-{name}"
    timeout = min(budget, e.left())
    rc = run_logged([e.py, "-m", "batcher.bench.cli", "--base-url", e.url, "--no-plots",
                     "--out", str(out), "--request-timeout", f"{max(10.0, timeout - 5):.0f}",
                     *args], e.logs / f"bench-{name}.log", timeout, e.env)
    report = out / "report.json"
    if rc is None or not report.is_file():
        return None
    doc = json.loads(report.read_text())
    return dict(doc["summary"], max_attempts=max((r["attempts"] for r in doc["requests"]),
                                                 default=0))


def bench_gpu(e: Env, name: str, args: list[str], budget: float) -> dict | None:
    """The gpu bench scenario (`python -m scripts.bench gpu`, from the root) with `args`; its
    JSON, or None if it failed."""
    out = e.logs / f"{name}.json"
    rc = run_logged([e.py, "-m", "scripts.bench", "gpu", "--device", e.device, "--no-append",
                     "--json", str(out), *args], e.logs / f"{name}.log",
                    min(budget, e.left()), e.env)
    return json.loads(out.read_text()) if rc == 0 and out.is_file() else None


def check_decode(c: Check, e: Env, big: bool) -> None:
    if big:
        model = ["--model", "llama-3.2-1b" if e.small else "llama-3.1-8b",
                 "--load-format", "dummy"]
        shape = ["--batches", "4" if e.small else "32", "--ctx", "256" if e.small else "2048"]
        what = "random weights"
    else:
        flags, what = model_flags(e)
        model = ["--model", "smollm2-135m", *flags]
        shape = ["--batches", "4" if e.small else "32", "--ctx", "64" if e.small else "512"]
    name = f"decode-{'big' if big else 'bundled'}"
    res = bench_gpu(e, name, ["--only", "decode", *model, *shape], c.budget_s)
    if res is None:
        c.figure = f"did not run: {tail(e.logs / f'{name}.log')}"
        return
    (d,) = res["decode"]
    c.status = "PASS"
    c.figure = (f"{d['model']} batch {d['batch']} ctx {d['ctx']}: {d['step_ms']:.2f} ms a step "
                f"({d['tok_s']:.0f} tok/s), floor {d['floor_ms']:.2f} ms (weights "
                f"{d['weight_bytes'] / 1e9:.2f} GB + KV {d['kv_bytes'] / 1e9:.2f} GB at "
                f"{res['device']}): x{d['ratio']:.1f} the floor; {what}")
    if "mixed_ms" in d:
        c.figure += (f"; with a {d['mixed_chunk']}-token prompt chunk: {d['mixed_ms']:.2f} ms "
                     f"graphed vs {d['mixed_eager_ms']:.2f} ms eager")
    c.details = res


def check_chat(c: Check, e: Env) -> None:
    flags, what = model_flags(e)
    size = ["--requests", "4", "--max-tokens", "8", "--hf-batches", "4"] if e.small else \
        ["--hf-batches", "32,64"]
    res = bench_gpu(e, "chat", ["--only", "chat", *flags, *size], c.budget_s)
    if res is None:
        c.figure = f"did not run: {tail(e.logs / 'chat.log')}"
        return
    chat = res["chat"]
    ours, best = chat["engine"], chat["best_hf_batch"]
    hf = chat["hf"][str(best)]
    c.status = "PASS" if chat["speedup"] > 1 and ours["exact"] else "FAIL"
    c.figure = (f"ours {ours['tok_s']:.0f} tok/s ({ours['wall']:.2f} s) vs transformers static "
                f"batch {best} {hf['tok_s']:.0f} tok/s ({hf['wall']:.2f} s): "
                f"x{chat['speedup']:.2f}; {chat['requests']} requests, {chat['dtype']}; {what}")
    c.details = res


# ---- the run -----------------------------------------------------------------------------------

def dry_run(todo: list[Check]) -> int:
    weights = bundled = None
    pkg = CARRY / "bundled" / BUNDLED_PACKAGE / BUNDLED_FILE
    if pkg.is_file():
        bundled = f".gpu/ prepared ({dir_bytes(CARRY) / 2**20:.1f} MiB)"
        weights = gguf_tensor_count(pkg) > 0
    dummy = (ROOT / "batcher" / "models" / "dummy.py").is_file()
    print(f"gpu_check --dry-run: the checks a run makes, in order, {BUDGET_S:.0f} s for all "
          "(8 minutes less start-up), each at most its own time and what is left:")
    for c in todo:
        print(f"  ({c.key}) {c.title}\n      target: {c.target}; at most {c.budget_s:.0f} s")
    missing = ("not carried: (b), (c), (d1) and (e) run on random weights in its shapes, the "
               "tests of its weights skip")
    print(f"  carry: {bundled or '.gpu/ not prepared: run scripts/gpu_pack.sh first'}; bundled "
          f"weights {'carried' if weights else missing}")
    print(f"  --load-format dummy in this tree: {'yes' if dummy else 'not yet (d2 will fail)'}")
    return 0


def set_up(args: argparse.Namespace, out: Path) -> Env | str:
    """Install the carried wheels, point the children at them and at the bundled package."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        # A burst opens a connection a request on each side (inherited by the children).
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY
                                                    else 65536, hard))
    site = Path(tempfile.mkdtemp(prefix="batcher-gpu-site-"))
    installed = install_wheels(site) if (CARRY / "wheels").is_dir() else []
    bundled = bundled_dir(site)
    paths = [str(site)] + ([str(bundled.parent)] if bundled else []) + [str(ROOT)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]),
        PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    code = ("import torch, transformers, aiohttp, orjson, gguf, llguidance, prometheus_client, "
            "pytest; import batcher.app.serve; print(torch.__version__, torch.cuda.is_available(), "
            "torch.cuda.get_device_name() if torch.cuda.is_available() else '')")
    probe = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                           text=True, check=False)
    (out / "setup.txt").write_text(f"wheels: {installed}\n{probe.stdout}{probe.stderr}")
    problem = None
    if probe.returncode:
        problem = f"the packages do not import: {probe.stderr.strip().splitlines()[-1:]}"
    elif bundled is None:
        problem = "no bundled model package: carry .gpu/ (scripts/gpu_pack.sh)"
    elif args.device == "cuda" and " True " not in f" {probe.stdout} ":
        problem = "no CUDA device"
    if problem:
        shutil.rmtree(site, ignore_errors=True)
        return problem
    weights = gguf_tensor_count(bundled / BUNDLED_FILE) > 0
    print(f"set-up: Python {sys.version.split()[0]}, torch/cuda/device {probe.stdout.strip()}; "
          f"{len(installed)} wheels installed; bundled weights "
          f"{'present' if weights else 'not carried (tokenizer only)'}", flush=True)
    return Env(sys.executable, env, out, args.device, args.small, weights,
               time.monotonic() + args.budget, site)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="list the checks, run nothing")
    ap.add_argument("--only", default=None, help="comma-separated check keys, e.g. a,d2")
    ap.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for every check "
                    "together (default: %(default)s)")
    ap.add_argument("--device", default="cuda", help="cpu: a rehearsal of the run without a "
                    "GPU (default: %(default)s)")
    ap.add_argument("--small", action="store_true", help="small loads and shapes, three times "
                    "the time for each (a rehearsal on a CPU)")
    args = ap.parse_args(argv)
    todo = checks(args.small)
    if args.only:
        keys = set(args.only.split(","))
        todo = [c for c in todo if c.key in keys or c.key.rstrip("12") in keys]
    if args.dry_run:
        return dry_run(todo)
    out = Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="batcher-gpu-check-"))
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    env = set_up(args, logs)
    if isinstance(env, str):
        line = f"FAIL (setup) {env}; see {logs}/setup.txt"
        print(line, flush=True)
        (out / "results.txt").write_text(line + "\n")
        return 1
    try:
        return run_checks(todo, env, args.small, out)
    finally:
        shutil.rmtree(env.site, ignore_errors=True)


def run_checks(todo: list[Check], env: Env, small: bool, out: Path) -> int:
    by_key = {c.key: c for c in todo}
    for c in todo:
        if c.key == "c" and "b" in by_key:
            continue  # run with (b), on its server
        t0 = time.monotonic()
        try:
            run_check(c, by_key, env, small)
        except Exception as exc:  # noqa: BLE001 (a fault of the check's own: the rest still run)
            failed_itself(c, env, exc)
        if c.key not in ("b", "c"):
            c.seconds = time.monotonic() - t0
        print(c.line(), flush=True)
        if c.key == "b" and "c" in by_key:
            print(by_key["c"].line(), flush=True)
    failed = sum(c.status == "FAIL" for c in todo)
    verdict = f"gpu_check: {len(todo) - failed} of {len(todo)} passed; logs in {env.logs}"
    print(verdict)
    (out / "results.txt").write_text("\n".join(c.line() for c in todo) + "\n" + verdict + "\n")
    (out / "results.json").write_text(json.dumps([asdict(c) for c in todo], indent=2))
    return 1 if failed else 0


def failed_itself(c: Check, e: Env, exc: Exception) -> None:
    """`c` FAILs with the exception its own code raised (the traceback in its log)."""
    c.status = "FAIL"
    c.figure = f"the check itself failed: {type(exc).__name__}: {exc}"[:400]
    (e.logs / f"check-{c.key}.txt").write_text(traceback.format_exc())


def run_check(c: Check, by_key: dict[str, Check], env: Env, small: bool) -> None:
    if env.left() < 20:
        c.figure = "not run: the time budget ran out"
    elif c.key == "a":
        check_tests(c, env)
    elif c.key in ("b", "c"):
        default = {x.key: x for x in checks(small)}
        check_serving(by_key.get("b") or default["b"], by_key.get("c") or default["c"], env)
    elif c.key in ("d1", "d2"):
        check_decode(c, env, big=c.key == "d2")
    elif c.key == "e":
        check_chat(c, env)


if __name__ == "__main__":
    sys.exit(main())
