"""`dynamo serve graphs/elastic:Frontend` as a test fixture, and the single-rank reference."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "elastic-ep/tiny-moe"


SSE_LINE_END = re.compile(r"\r\n|\r|\n")


def sse_data(response: httpx.Response) -> Iterator[str]:
    """The data of each event of a server-sent event stream, `[DONE]` left out. Not httpx's
    `iter_lines`: it splits like `str.splitlines`, at U+2028, U+0085, U+001C and other characters
    a token's text carries unescaped inside the JSON, and the halves fail to parse (bench
    .consistency counted such streams as failed). SSE ends a line at CR, LF or CRLF only."""
    rest = ""
    for text in response.iter_text():
        *lines, rest = SSE_LINE_END.split(rest + text)
        for line in lines:
            if line.startswith("data:"):
                data = line[6:] if line.startswith("data: ") else line[5:]
                if data != "[DONE]":
                    yield data


def env_tool(name: str) -> str:
    """A command of the environment these tests run in (its console scripts, and what `make
    install` put beside them), never an unrelated one on PATH. Missing is a failure that says how
    to get it, not a skip."""
    path = Path(sys.executable).parent / name  # not resolved: the venv's bin, not the base python's
    if not path.exists():
        raise FileNotFoundError(
            f"`{name}` is not installed in {path.parent}: run `make install` "
            f"(or `pip install -e .` for the console scripts)"
        )
    return str(path)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie still answers kill(0); it is dead for our purposes
        return _state(Path(f"/proc/{pid}/stat")) != "Z"
    except (FileNotFoundError, IndexError, ProcessLookupError):
        return False


def _state(stat: Path) -> str:
    """The state letter of a /proc/.../stat (after the command name, which may hold ") ")."""
    return stat.read_text().rsplit(") ", 1)[1][0]


def gone_within(pid: int, timeout_s: float) -> bool:
    """Whether process `pid` is gone (or a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped: kill() returns before the
    stop lands, and a thread still running could answer one more request (a UCX progress thread
    serving a READ), which a test of a frozen peer would take for the peer's answer."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = {_state(t / "stat") for t in Path(f"/proc/{pid}/task").iterdir()}
        if states <= {"T", "t"}:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} did not stop within {timeout_s}s (thread states {sorted(states)})")
        time.sleep(0.005)


def pids_with_env(marker: str) -> set[int]:
    """Live processes whose environment holds `marker` (a graph's unique discovery dir)."""
    needle = marker.encode()
    found: set[int] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0") and alive(int(entry.name)):
            found.add(int(entry.name))
    return found


def streamer_of(pid: int) -> int:
    """The streaming process of the rank process `pid` (its child serving `generate`)."""
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and (d / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                if b"components.worker.streamer" in (d / "cmdline").read_bytes():
                    return int(d.name)
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError(f"rank process {pid} has no streaming process")


class Server:
    """The whole graph in a subprocess on free ports, with a private discovery directory."""

    def __init__(
        self,
        args: list[str],
        boot_timeout_s: float = 180,
        model: str | None = MODEL,
        wait: bool = True,
        env: dict[str, str] | None = None,
        ports: tuple[int, int] | None = None,
    ):
        """`model`: the served model name to wait for and query; None takes the first served one.
        `wait`: return once it serves (else call `wait_ready`). `env`: set for every component.
        `ports`: (OpenAI, router) ports, free ones by default (a restart reuses its predecessor's)."""
        self.model = model
        self.http_port, self.router_port = ports or free_ports(2)
        self.tmp = Path(tempfile.mkdtemp(prefix="elastic-test-"))
        self.discovery_dir = self.tmp / "discovery"
        self.env_marker = f"DYN_FILE_KV={self.discovery_dir}"
        self.url = f"http://127.0.0.1:{self.http_port}/v1"
        self.log_path = self.tmp / "serve.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                env_tool("dynamo"),
                "serve",
                "graphs/elastic:Frontend",
                f"--Frontend.port={self.http_port}",
                f"--Router.port={self.router_port}",
                "--discovery-dir",
                str(self.discovery_dir),
                *args,
            ],
            cwd=ROOT,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.http_port}", timeout=120)
        self.ctl = httpx.Client(base_url=f"http://127.0.0.1:{self.router_port}", timeout=120)
        if wait:
            try:
                self.wait_ready(boot_timeout_s)
            except BaseException:  # the caller gets no Server to stop: leave no graph running
                self.stop()
                raise

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                served = [m["id"] for m in self.http.get("/v1/models").json()["data"]]
                if self.ctl.get("/health").status_code == 200 and served and self.model in (None, *served):
                    self.model = self.model or served[0]
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"graph not ready after {timeout:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def story(self, ops: list[dict]) -> str:
        """What a failed check needs to tell which way a race went: each operation's record, and
        the router's and ranks' lines about it."""
        keys = (
            "id",
            "kind",
            "phase",
            "from_size",
            "to_size",
            "joiners",
            "leaving",
            "masked",
            "error",
            "followup_error",
        )
        ids = [f"[op {op['id']}]" for op in ops]
        lines = [ln for ln in self.output.splitlines() if any(i in ln for i in ids)]
        return "\n".join([*(str({k: op.get(k) for k in keys}) for op in ops), *lines[-200:]])

    def control(self, method: str, path: str, **kw) -> httpx.Response:
        return self.ctl.request(method, path, **kw)

    def topology(self) -> dict:
        return self.ctl.get("/topology").json()

    def stream_text(
        self,
        prompt: list[int],
        max_tokens: int,
        on_chunk: Callable[[float, float | None], None] | None = None,
        sampling: dict | None = None,
    ) -> str:
        """Streaming completion of a token-id prompt, greedy unless `sampling` says otherwise
        (e.g. {"temperature": 0.8, "seed": 7}); returns the generated text.
        `on_chunk(arrival time, gap since the previous chunk of this stream or None)`."""
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
            **(sampling or {}),
        }
        text, last, finished = [], None, None
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()}")
            for data in sse_data(r):
                if on_chunk is not None:
                    now = time.time()
                    on_chunk(now, None if last is None else now - last)
                    last = now
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    if finished:
                        raise RuntimeError(f"a chunk after finish_reason {finished!r}: {chunk}")
                    text.append(choice.get("text") or "")
                    finished = choice.get("finish_reason")
        return "".join(text)

    def stop(self) -> int:
        """SIGTERM the graph; anything of it still alive after that is killed (and the exit code
        says whether the stop was clean)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid in pids_with_env(self.env_marker):
            os.kill(pid, signal.SIGKILL)
        self._log.close()
        keep = os.environ.get("ELASTIC_EP_TEST_LOGS")  # e.g. $OUT on a device run
        if keep:  # without Dynamo's line per routed request, which would bury the rest
            lines = [ln for ln in self.output.splitlines(keepends=True) if "route request" not in ln]
            Path(keep).mkdir(parents=True, exist_ok=True)
            (Path(keep) / f"serve-{self.http_port}.log").write_text("".join(lines))
        return self.proc.returncode


_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from tokenizers import Tokenizer

        from components.engine.models.builtin import builtin_model_dir

        _TOKENIZER = Tokenizer.from_file(str(builtin_model_dir() / "tokenizer.json"))
    return _TOKENIZER


def engine_reference(
    prompts: list[list[int]],
    max_tokens: int,
    max_len: int = 0,
    device: str = "cpu",
    model_dir: Path | None = None,
    sampling: list[dict] | None = None,
    **config,
) -> list[str]:
    """Greedy output of the single-rank in-process engine on `model_dir` (the built-in model if
    None), as text. `sampling`: each prompt's sampling options (GenerateRequest's temperature,
    top_p, seed; {} greedy), each prompt then run alone, as the same request sent by itself.
    `config`: further RankConfig fields (dtype, max_seqs, ...) of the ranks it stands for."""
    from components.engine.models.builtin import builtin_model_dir
    from harness.reference import generate, single_rank

    eng = single_rank(model_dir or builtin_model_dir(), device=device, max_len=max_len, **config)
    eng.start()
    try:
        if sampling is None:
            tokens, _ = generate(eng, prompts, max_tokens, ignore_eos=True)
        else:
            tokens = [generate(eng, [p], max_tokens, ignore_eos=True, **s)[0][0] for p, s in zip(prompts, sampling)]
    finally:
        eng.stop()
    if device.startswith("cuda"):  # a graph started next sizes its KV cache by the memory free
        import gc

        import torch

        del eng
        gc.collect()
        torch.cuda.empty_cache()
    return [tokenizer().decode(t, skip_special_tokens=True) for t in tokens]


class Traffic:
    """Clients streaming completions of `prompts` until stopped, greedy unless `sampling[i]` says
    how to sample prompt i; every request is recorded as (prompt index, text, start, end), every
    failure as (prompt index, error). `on_chunk` sees every streamed chunk (Server.stream_text). A
    client waits `error_pause_s` after a failure (an outage then costs a countable number of
    refused requests)."""

    def __init__(
        self,
        srv: Server,
        prompts: list[list[int]],
        max_tokens: int,
        clients: int = 4,
        on_chunk: Callable[[float, float | None], None] | None = None,
        error_pause_s: float = 0.0,
        sampling: list[dict | None] | None = None,
    ):
        self.srv, self.prompts, self.max_tokens, self.on_chunk = srv, prompts, max_tokens, on_chunk
        self.sampling = sampling or [None] * len(prompts)
        self.error_pause_s = error_pause_s
        self.results, self.errors = [], []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            p = k % len(self.prompts)
            k += len(self.threads)
            t0 = time.time()
            try:
                text = self.srv.stream_text(self.prompts[p], self.max_tokens, self.on_chunk, self.sampling[p])
                self.results.append((p, text, t0, time.time()))
            except Exception as e:  # recorded: tests assert there are none
                self.errors.append((p, repr(e)))
                time.sleep(self.error_pause_s)

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def failure_reasons(errors: list[tuple[int, str]]) -> dict[str, int]:
    """How many failed requests got each reason (Traffic.errors), the operation's id and phase
    left out of the router's reason so that one outage counts as one reason."""
    counts = Counter(re.sub(r" \(operation [^)]*\)", "", why)[:200] for _, why in errors)
    return dict(counts.most_common())


def scale(srv: Server, n: int, **extra) -> dict:
    """POST /scale and wait for the operation; returns its record (200 if it is done, else 500)."""
    r = srv.control("POST", "/scale?wait=true", json={"dp_size": n, **extra}, timeout=300)
    assert r.status_code in (200, 500), r.text
    rec = r.json()
    assert r.status_code == (200 if rec["phase"] == "done" else 500), (r.status_code, r.text)
    return rec


def scale_under_traffic(srv: Server, sizes, traffic: Traffic, reference) -> tuple[list[dict], list[float]]:
    """Scale `srv` through `sizes` while `traffic` streams (a second before each and after the
    last): each operation ends done with the active set it asked for, no stream fails, and every
    completion is `reference`'s. Returns the records and every rank's KV use seen after each."""
    ops, kv_usage = [], []
    with traffic:
        for n in sizes:
            time.sleep(1.0)
            op = scale(srv, n)
            assert op["phase"] == "done", op
            topo = srv.topology()
            assert topo["dp_size"] == n and topo["active"] == list(range(n))
            kv_usage += [r["kv_usage"] for r in topo["ranks"]]
            ops.append(op)
        time.sleep(1.0)
    assert traffic.errors == []
    for p, toks, _, _ in traffic.results:
        assert toks == reference[p], f"prompt {p}"
    return ops, kv_usage
