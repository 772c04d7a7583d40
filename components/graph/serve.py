"""`dynamo serve`: start every component of a graph as a process and supervise them.

ai-dynamo 1.x dropped its graph SDK and `dynamo serve`; this is the small part of it we need:
graph loading, config layering (defaults <- YAML <- `--Name.key=value`), one process group
per child, prefixed logs, and a clean, orphan-free shutdown.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import importlib.util
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import yaml

from components.graph.component import (
    COMPONENT_ENV,
    EXIT_CANNOT_START,
    GRAPH_ENV,
    GRAPH_PID_ENV,
    Component,
    GraphContext,
    ProcessSpec,
    encode_context,
    graph_components,
)
from components.graph.spawn import Child, spawn

USAGE_ERROR = 2
STOP_GRACE_S = 10.0
# A restartable process that dies this soon after its start this many times in a row is not
# restarted again: it cannot run as configured (a port taken, a broken install).
QUICK_DEATH_S = 30.0
MAX_QUICK_DEATHS = 3

OVERRIDES_HELP = """\
component overrides:
  --Name.key=value      set field `key` of component `Name`'s Config (also `--Name.key value`);
                        values are parsed as YAML scalars (8080, true, 1.5, [1, 2]) and then
                        checked against the field's type. Precedence: Config defaults <- -f
                        file <- overrides. Pass a graph with --help to list its fields.

config file (-f): YAML mapping of component name -> {field: value}, e.g.
  Frontend: {port: 8000}
  Worker: {model: /models/qwen-moe, device: cuda}

exit codes: 0 after a requested stop (Ctrl-C / SIGTERM), 1 when a critical component dies (a
restartable one, such as the router, is started again unless it keeps dying within 30 s of its
start), 2 on a usage or config error (nothing is started). A component with a health URL (the
router) that stops answering it is killed as hung, then restarted or reported like a death; so is
one that never answers it within its startup deadline (the router's: --Router.startup_timeout_s,
60 s by default), which counts as dying soon after its start.
"""


class UsageError(Exception):
    pass


CHILD_PATHS: list[str] = []  # extra PYTHONPATH entries for the children, besides cwd


# ---------------------------------------------------------------------------------------------
# graph and config resolution


def load_graph(ref: str) -> type[Component]:
    """`path/to/file[.py]:Attr` (relative to cwd) or `pkg.module:Attr`."""
    mod_ref, sep, attr = ref.rpartition(":")
    if not sep or not mod_ref or not attr:
        raise UsageError(f"graph {ref!r} must look like graphs/elastic:Frontend or graphs.elastic:Frontend")
    cwd = Path.cwd()
    # The console script does not put cwd on sys.path, but graphs live in the user's tree.
    if str(cwd) not in sys.path:
        sys.path.insert(0, str(cwd))

    path = Path(mod_ref if mod_ref.endswith(".py") else mod_ref + ".py")
    is_path = "/" in mod_ref or mod_ref.endswith(".py") or os.sep in mod_ref
    try:
        if is_path or (path.is_file() and "." not in mod_ref):
            if not path.is_file():
                raise UsageError(f"graph file {str(path)!r} not found (from {ref!r})")
            module = _import_file(path.resolve(), cwd)
        else:
            module = importlib.import_module(mod_ref)
    except UsageError:
        raise
    except ModuleNotFoundError as e:
        raise UsageError(f"cannot import graph module {mod_ref!r}: {e}") from e
    try:
        root = getattr(module, attr)
    except AttributeError:
        raise UsageError(f"graph module {mod_ref!r} has no attribute {attr!r}") from None
    if not (isinstance(root, type) and issubclass(root, Component)):
        raise UsageError(f"{ref!r} is not a Component class")
    return root


def _import_file(path: Path, cwd: Path):
    # Importing under its dotted name (when it lies under cwd) keeps one copy of the module, so
    # `graphs/elastic` and `graphs.elastic` yield the very same classes.
    try:
        dotted = ".".join(path.with_suffix("").relative_to(cwd).parts)
    except ValueError:
        dotted = ""
    if dotted and all(p.isidentifier() for p in dotted.split(".")):
        return importlib.import_module(dotted)
    name = f"_dynamo_graph_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    # Its sibling modules (the components' `module`s) must import in the children too.
    CHILD_PATHS.append(str(path.parent))
    spec.loader.exec_module(module)
    return module


def parse_overrides(extra: list[str]) -> list[tuple[str, list[str], str]]:
    """`--Name.key=value` / `--Name.key value` -> (Name, key path, raw value)."""
    out: list[tuple[str, list[str], str]] = []
    i = 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UsageError(f"unrecognized argument {arg!r} (overrides look like --Name.key=value)")
        target, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(extra):
                raise UsageError(f"override {arg!r} needs a value")
            i += 1
            value = extra[i]
        name, *keys = target.split(".")
        if not name or not keys or not all(keys):
            raise UsageError(f"bad override {arg!r} (expected --Name.key=value)")
        out.append((name, keys, value))
        i += 1
    return out


def _yaml_scalar(raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        return raw


def _field_name(config: type[msgspec.Struct], key: str) -> str | None:
    names = {f.name for f in msgspec.structs.fields(config)}
    for cand in (key, key.replace("-", "_")):
        if cand in names:
            return cand
    return None


def _field_type(config: type[msgspec.Struct], name: str) -> Any:
    return next(f.type for f in msgspec.structs.fields(config) if f.name == name)


def resolve_configs(
    comps: list[type[Component]],
    file_data: dict[str, Any],
    overrides: list[tuple[str, list[str], str]],
) -> dict[str, msgspec.Struct]:
    by_name = {c.__name__: c for c in comps}
    known = ", ".join(by_name)
    for name in file_data:
        if name not in by_name:
            raise UsageError(f"config file: unknown component {name!r} (graph has: {known})")
    for name, _, _ in overrides:
        if name not in by_name:
            raise UsageError(f"--{name}.*: unknown component {name!r} (graph has: {known})")

    resolved: dict[str, msgspec.Struct] = {}
    for name, comp in by_name.items():
        cfg_t = comp.Config
        data = _defaults(cfg_t)
        section = file_data.get(name) or {}
        if not isinstance(section, dict):
            raise UsageError(f"config file: section {name!r} must be a mapping")
        for key, value in section.items():
            field = _field_name(cfg_t, str(key))
            if field is None:
                raise UsageError(f"config file: {name} has no field {key!r} ({_fields_list(cfg_t)})")
            data[field] = _merge(data.get(field), value)
        for oname, keys, raw in overrides:
            if oname != name:
                continue
            field = _field_name(cfg_t, keys[0])
            if field is None:
                raise UsageError(f"--{name}.{keys[0]}: {name} has no field {keys[0]!r} ({_fields_list(cfg_t)})")
            data[field] = _apply_override(cfg_t, name, field, keys[1:], data.get(field), raw)
        try:
            resolved[name] = msgspec.convert(data, cfg_t)
        except msgspec.ValidationError as e:
            raise UsageError(f"invalid config for {name}: {_path_msg(name, e)}") from None
    return resolved


def _defaults(cfg_t: type[msgspec.Struct]) -> dict[str, Any]:
    # Fields without a default stay absent: the final convert names them as missing.
    out: dict[str, Any] = {}
    for f in msgspec.structs.fields(cfg_t):
        if f.default is not msgspec.NODEFAULT:
            out[f.name] = msgspec.to_builtins(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            out[f.name] = msgspec.to_builtins(f.default_factory())
    return out


def _apply_override(cfg_t: type[msgspec.Struct], comp: str, field: str, sub: list[str], current: Any, raw: str) -> Any:
    parsed = _yaml_scalar(raw)
    if sub:
        # Nested key into a dict/struct-valued field; the whole struct is validated afterwards.
        tree = dict(current) if isinstance(current, dict) else {}
        node = tree
        for k in sub[:-1]:
            if not isinstance(node.get(k), dict):
                node[k] = {}
            node = node[k]
        node[sub[-1]] = parsed
        return tree
    ftype = _field_type(cfg_t, field)
    label = f"--{comp}.{field}={raw}"
    try:
        msgspec.convert(parsed, ftype)
        return parsed
    except msgspec.ValidationError as e:
        # `--Worker.model=123` means the string "123" when the field is a string.
        try:
            msgspec.convert(raw, ftype)
            return raw
        except msgspec.ValidationError:
            raise UsageError(f"{label}: wrong type for {comp}.{field}: {e}") from None


def _merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = _merge(out.get(k), v)
        return out
    return over


def _path_msg(name: str, e: msgspec.ValidationError) -> str:
    msg = str(e)
    return msg.replace("`$.", f"`{name}.").replace("`$`", f"`{name}`")


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", None) or repr(t).replace("typing.", "")


def _fields_list(cfg_t: type[msgspec.Struct]) -> str:
    names = [f.name for f in msgspec.structs.fields(cfg_t)]
    return "fields: " + (", ".join(names) if names else "none")


def describe_graph(comps: list[type[Component]]) -> str:
    lines = ["graph components and their config fields (--Name.key=value):"]
    for comp in comps:
        links = ", ".join(c.__name__ for c in comp.links())
        lines.append(f"  {comp.__name__}  (module {comp.module}{'; -> ' + links if links else ''})")
        fields = msgspec.structs.fields(comp.Config)
        if not fields:
            lines.append("      (no fields)")
        for f in fields:
            default = (
                f.default
                if f.default is not msgspec.NODEFAULT
                else ("<required>" if f.default_factory is msgspec.NODEFAULT else f.default_factory())
            )
            lines.append(f"      --{comp.__name__}.{f.name}: {_type_name(f.type)} = {default!r}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# supervision


def _err(msg: str) -> None:
    sys.stderr.write(f"dynamo serve: {msg}\n")
    sys.stderr.flush()


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


async def answers(session, url: str, timeout: float) -> bool:
    """Whether an HTTP GET of `url` gets a response within `timeout` (any status: a process that
    answers 503 while it starts is alive)."""
    import aiohttp

    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)):
            return True
    except (aiohttp.ClientError, OSError, TimeoutError):
        return False


class Supervisor:
    def __init__(self, base_env: dict[str, str]) -> None:
        self.base_env = base_env
        self.children: list[Child] = []
        self.stop = asyncio.Event()
        self.stop_reason = ""
        self.exit_code = 0
        self.force = False
        self._tasks: set[asyncio.Task[None]] = set()  # the loop only keeps weak references
        self._hung_at_start: set[Child] = set()  # killed before they ever answered their health URL

    async def start(self, component: str, spec: ProcessSpec, quick_deaths: int = 0) -> None:
        """Start one process and watch it; `quick_deaths`: how many times in a row it died soon
        after a start (restartable processes)."""
        child = await spawn(spec, {**self.base_env, COMPONENT_ENV: component})
        # A dead child stays listed: shutdown still signals its process group, where what it
        # started may live on.
        self.children.append(child)
        watch = asyncio.create_task(self._watch(child, component, time.monotonic(), quick_deaths))
        self._tasks.add(watch)
        watch.add_done_callback(self._tasks.discard)
        if spec.health_url:
            probe = asyncio.create_task(self._liveness(child))
            self._tasks.add(probe)
            probe.add_done_callback(self._tasks.discard)
        kind = ", restartable" if spec.restart else "" if spec.critical else ", non-critical"
        _err(f"started {spec.label} (pid {child.pid}{kind})")

    async def _liveness(self, child: Child) -> None:
        """SIGKILL the child once it stops answering its health URL, or when it never answered it
        within its startup deadline (its watch then restarts or reports it): a hung process is as
        useless as a dead one, but nothing else would notice."""
        import aiohttp

        url, deadline, grace = child.spec.health_url, child.spec.liveness_timeout_s, child.spec.startup_timeout_s
        every = min(1.0, deadline / 3, grace / 3)
        started = time.monotonic()
        last: float | None = None  # its last answer; None before the first
        async with aiohttp.ClientSession() as session:
            while child.proc.returncode is None and not self.stop.is_set():
                t = time.monotonic()
                if await answers(session, url, deadline if last is not None else min(deadline, grace)):
                    last = time.monotonic()
                elif last is not None and time.monotonic() - last > deadline:
                    silent = time.monotonic() - last
                    _err(f"{child.label} (pid {child.pid}) did not answer {url} for {silent:.1f} s: hung, SIGKILL")
                    child.signal_group(signal.SIGKILL)
                    return
                elif last is None and time.monotonic() - started > grace:
                    _err(
                        f"{child.label} (pid {child.pid}) did not answer {url} within {grace:g} s of its start: "
                        "hung, SIGKILL"
                    )
                    self._hung_at_start.add(child)
                    child.signal_group(signal.SIGKILL)
                    return
                await asyncio.sleep(max(0.0, every - (time.monotonic() - t)))

    async def _watch(self, child: Child, component: str, started: float, quick_deaths: int) -> None:
        rc = await child.proc.wait()
        # One that never came up cannot run as configured either, however long it was given.
        never_up = child in self._hung_at_start
        self._hung_at_start.discard(child)
        quick_deaths = quick_deaths + 1 if never_up or time.monotonic() - started < QUICK_DEATH_S else 0
        try:
            await asyncio.wait_for(asyncio.shield(child.pump), 2.0)
        except TimeoutError:
            pass  # a grandchild still holds the pipe; its output keeps flowing
        if self.stop.is_set():
            return
        what = f"component {child.label} (pid {child.proc.pid}) {_describe_exit(rc)}"
        tail = "\n".join(f"    {line}" for line in child.tail) or "    (no output)"
        if rc == EXIT_CANNOT_START:
            said = [line for line in child.tail if "cannot start: " in line]
            reason = said[-1].split("cannot start: ", 1)[1] if said else "(no reason given)"
            _err(f"{child.label} cannot start: {reason}; stopping the graph")
            self.request_stop(f"{child.label} cannot start", 1)
        elif child.spec.restart and quick_deaths < MAX_QUICK_DEATHS:
            _err(f"{what}; restarting it. Last log lines:\n{tail}")
            try:
                await self.start(component, child.spec, quick_deaths)
            except OSError as e:
                _err(f"cannot restart {child.label}: {e}; stopping the graph")
                self.request_stop(f"{child.label} could not be restarted", 1)
        elif child.spec.restart:
            when = (
                "before it ever answered its health URL" if never_up else f"within {QUICK_DEATH_S:.0f} s of its start"
            )
            _err(
                f"{what}, {quick_deaths} times in a row {when}; "
                f"not restarting it again, stopping the graph. Last log lines:\n{tail}"
            )
            self.request_stop(f"{child.label} keeps dying", 1)
        elif child.spec.critical:
            _err(f"{what}; it is critical, stopping the graph. Last log lines:\n{tail}")
            self.request_stop(f"{child.label} died", 1)
        else:
            _err(f"{what}; non-critical, the rest keeps running. Last log lines:\n{tail}")
            if all(c.proc.returncode is not None for c in self.children):
                self.request_stop("every component has exited", 1)

    def request_stop(self, reason: str, code: int) -> None:
        if self.stop.is_set():
            # Second Ctrl-C / SIGTERM while stopping: stop waiting.
            self.force = True
            for c in self.children:
                c.signal_group(signal.SIGKILL)
            return
        self.stop_reason = reason
        self.exit_code = code
        self.stop.set()

    async def shutdown(self) -> None:
        # Frontend first (started last), so nothing is routed to workers that are going away.
        for c in reversed(self.children):
            c.signal_group(signal.SIGTERM)
        alive = [c for c in self.children if c.proc.returncode is None]
        if alive and not self.force:
            await asyncio.wait([asyncio.create_task(c.proc.wait()) for c in alive], timeout=STOP_GRACE_S)
            for c in alive:
                if c.proc.returncode is None:
                    _err(f"{c.label} (pid {c.proc.pid}) did not stop within {STOP_GRACE_S:.0f} s: SIGKILL")
        # Also reaps grandchildren left in a group whose leader already exited.
        for c in self.children:
            c.signal_group(signal.SIGKILL)
        await asyncio.gather(*(c.proc.wait() for c in self.children))
        for c in self.children:
            try:
                await asyncio.wait_for(c.pump, 1.0)
            except TimeoutError:
                pass


async def run_graph(ctx: GraphContext, plan: list[tuple[str, ProcessSpec]]) -> int:
    from components.graph.runtime import runtime_env

    cwd = os.getcwd()
    pythonpath = os.pathsep.join(p for p in (cwd, *CHILD_PATHS, os.environ.get("PYTHONPATH", "")) if p)
    base_env = {
        **os.environ,
        **runtime_env(ctx),
        GRAPH_ENV: encode_context(ctx),
        GRAPH_PID_ENV: str(os.getpid()),
        "PYTHONPATH": pythonpath,
        "PYTHONUNBUFFERED": "1",
    }
    # The runtime logs every routed request at info; our components log what a person follows.
    base_env.setdefault("DYN_LOG", "warn")
    if not sys.stdout.isatty():
        # Children write to our pipe, not a terminal: keep escape codes out of logs.
        base_env.setdefault("NO_COLOR", "1")
        base_env.setdefault("DYN_SDK_DISABLE_ANSI_LOGGING", "1")
    sup = Supervisor(base_env)
    loop = asyncio.get_running_loop()
    for sig, why in ((signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated"), (signal.SIGHUP, "hung up")):
        loop.add_signal_handler(sig, sup.request_stop, why, 0)
    try:
        for component, spec in plan:
            if sup.stop.is_set():
                break
            try:
                await sup.start(component, spec)
            except OSError as e:
                _err(f"cannot start {spec.label} ({spec.argv[0]}): {e}")
                sup.request_stop(f"{spec.label} failed to start", 1)
        await sup.stop.wait()
        _err(f"stopping ({sup.stop_reason})")
    finally:
        await sup.shutdown()
    _err("all components stopped")
    return sup.exit_code


def _banner(
    root: str, comps: list[type[Component]], configs: dict[str, msgspec.Struct], ctx: GraphContext, n: int
) -> None:
    where = ctx.discovery_dir if ctx.discovery == "file" else ctx.etcd_endpoints
    print(f"dynamo serve {root}: {n} processes, namespace {ctx.namespace!r}, {ctx.discovery} discovery ({where})")
    for comp in comps:
        for what, url in comp.urls(configs[comp.__name__]).items():
            print(f"  {what}: {url}")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# CLI


def build_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    top = argparse.ArgumentParser(prog="dynamo", description="Elastic EP serving on Dynamo")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="start every component of a graph and supervise them",
        description="Start each component of a serving graph as a process on the Dynamo runtime,\n"
        "prefix their output with their label, and stop them all together.",
        epilog=OVERRIDES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
        allow_abbrev=False,  # `--disc...` must never swallow a `--Name.key` override
    )
    serve.add_argument(
        "graph",
        nargs="?",
        help="graph root: graphs/elastic:Frontend (file path, "
        "relative to cwd, .py optional) or graphs.elastic:Frontend (module)",
    )
    serve.add_argument(
        "-h", "--help", action="store_true", help="show this help (and, with a graph, its config fields)"
    )
    serve.add_argument("-f", "--config-file", metavar="YAML", help="YAML file: {ComponentName: {field: value}}")
    serve.add_argument(
        "--namespace",
        default=os.environ.get("DYN_NAMESPACE", "elastic"),
        help="Dynamo namespace of every component (default: $DYN_NAMESPACE or 'elastic')",
    )
    serve.add_argument(
        "--discovery",
        choices=("file", "etcd"),
        default="file",
        help="service discovery: 'file' (default; a private temp dir deleted on exit, "
        "one machine, no etcd/NATS) or 'etcd' (clusters)",
    )
    serve.add_argument(
        "--discovery-dir",
        metavar="DIR",
        default="",
        help="file discovery: use DIR instead of a private temp dir (kept on exit)",
    )
    serve.add_argument(
        "--etcd-endpoints",
        metavar="URLS",
        default=os.environ.get("ETCD_ENDPOINTS", ""),
        help="etcd discovery: comma-separated endpoints (default: $ETCD_ENDPOINTS)",
    )
    serve.add_argument(
        "--dry-run", action="store_true", help="resolve configs, print the processes that would start, and exit"
    )
    return top, serve


def _usage_exit(parser: argparse.ArgumentParser, msg: str) -> NoReturn:
    parser.print_usage(sys.stderr)
    _err(msg)
    sys.exit(USAGE_ERROR)


def main(argv: list[str] | None = None) -> None:
    top, serve_p = build_parser()
    args, extra = top.parse_known_args(argv)
    if args.command != "serve":
        if extra:
            top.error(f"unrecognized arguments: {' '.join(extra)}")
        top.print_help(sys.stderr)
        sys.exit(USAGE_ERROR)

    if args.help:
        serve_p.print_help()
        if args.graph:
            try:
                print("\n" + describe_graph(graph_components(load_graph(args.graph))))
            except UsageError as e:
                print(f"\n(cannot list the graph's fields: {e})")
        sys.exit(0)
    if not args.graph:
        _usage_exit(serve_p, "a graph is required, e.g. dynamo serve graphs/elastic:Frontend")

    try:
        overrides = parse_overrides(extra)
        root = load_graph(args.graph)
        comps = graph_components(root)
        names = [c.__name__ for c in comps]
        if len(set(names)) != len(names):
            raise UsageError(f"graph has two components with the same name: {names}")
        file_data: dict[str, Any] = {}
        if args.config_file:
            try:
                file_data = yaml.safe_load(Path(args.config_file).read_text()) or {}
            except (OSError, yaml.YAMLError) as e:
                raise UsageError(f"cannot read config file {args.config_file!r}: {e}") from None
            if not isinstance(file_data, dict):
                raise UsageError(f"config file {args.config_file!r} must be a mapping of component name -> fields")
        configs = resolve_configs(comps, file_data, overrides)
        if args.discovery == "etcd" and not args.etcd_endpoints:
            raise UsageError("--discovery etcd needs --etcd-endpoints (or $ETCD_ENDPOINTS)")
    except UsageError as e:
        _usage_exit(serve_p, str(e))

    own_dir = args.discovery == "file" and not args.discovery_dir
    discovery_dir = ""
    if args.discovery == "file":
        discovery_dir = args.discovery_dir or tempfile.mkdtemp(prefix="dynamo-serve-")
        os.makedirs(discovery_dir, exist_ok=True)
    ctx = GraphContext(
        namespace=args.namespace,
        discovery=args.discovery,
        discovery_dir=discovery_dir,
        etcd_endpoints=args.etcd_endpoints if args.discovery == "etcd" else "",
        configs={n: msgspec.to_builtins(c) for n, c in configs.items()},
    )
    try:
        # Leaves first and the root (the frontend) last: nothing is exposed before its backends.
        plan: list[tuple[str, ProcessSpec]] = []
        for comp in reversed(comps):
            for spec in comp.processes(configs[comp.__name__], ctx):
                plan.append((comp.__name__, spec))
        labels = [s.label for _, s in plan]
        if len(set(labels)) != len(labels):
            raise UsageError(f"two processes share a label: {labels}")
        if not plan:
            raise UsageError("the graph starts no process")
    except (UsageError, ValueError) as e:  # a component refusing its config (Component.processes)
        if own_dir:
            shutil.rmtree(discovery_dir, ignore_errors=True)
        _usage_exit(serve_p, str(e))

    if args.dry_run:
        if own_dir:
            shutil.rmtree(discovery_dir, ignore_errors=True)
        print(msgspec.json.format(msgspec.json.encode(ctx.configs)).decode())
        for _component, spec in plan:
            print(f"{spec.label}{'' if spec.critical else ' (non-critical)'}: {' '.join(spec.argv)}")
        sys.exit(0)

    ctx.run_dir = tempfile.mkdtemp(prefix="dynamo-run-")
    _banner(args.graph, comps, configs, ctx, len(plan))
    try:
        code = asyncio.run(run_graph(ctx, plan))
    finally:
        shutil.rmtree(ctx.run_dir, ignore_errors=True)
        if own_dir:
            shutil.rmtree(discovery_dir, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
