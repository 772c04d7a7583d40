"""Compile every Triton kernel of the engine for a CUDA target, without a GPU.

The CPU tests run the kernels under Triton's interpreter, which never lowers them: a kernel that
the compiler rejects (a layout it cannot convert, a dot shape below the minimum, an op without a
lowering for this arch, ptxas out of registers) passes every CPU test and first fails on an H200.
Triton compiles for a named target with no device present, and ptxas ships in its wheel, so this
runs the whole pipeline (TTIR, TTGIR, LLVM, PTX, cubin) here.

Why it is built this way:

* The launches are the wrappers' own: each wrapper (rms_norm, decode_attention, swiglu_experts,
  route_and_sort, PeerWindows.exchange, ...) is called on meta tensors of a Mixtral-shaped model
  with JITFunction.run replaced by a recorder, so the kernel arguments, constexprs and launch
  options (num_warps, enable_fp_fusion) compiled here are exactly what the wrapper passes, and
  follow it when it changes. Meta tensors have shapes, strides and dtypes but no memory.
* Each recorded launch is compiled twice: as the JIT would specialise it on the device
  ("jit": pointers and ints divisible by 16 marked so, an int equal to 1 made a constant), and
  with no specialisation at all ("generic"), which other argument values reach.
* Identical compiles (same kernel, signature, constants, attributes, options) are done once.

Usage: .venv/bin/python tools/triton_compile_check.py [--arch 90]. One line per compile; exit 1
if any fails, or needs more shared memory than a block of the target gets. Registers and the
stack frame (spills: bytes of local memory a thread) come from cuobjdump on the cubin, shared
memory (bytes a block) from Triton's metadata.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import itertools
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("triton_compile_check: TRITON_INTERPRET is set; the compiler never runs under the interpreter")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton._C.libtriton import native_specialize_impl  # noqa: E402
from triton.backends.compiler import BaseBackend, GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler.errors import CompilationError  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# A Mixtral-8x7B-shaped model (the sizes the kernels' block shapes are derived from).
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, EXPERTS, TOP_K = 4096, 14336, 32, 8, 128, 8, 2
MAX_RANKS, MAX_LEN, CACHE_SLOTS = 8, 4096, 64
# DeepSeek-V3's MLA (its latent cache) and routing, where they differ from Mixtral's.
MLA_HEADS, KV_LORA, ROPE_DIM, DS_EXPERTS, DS_TOP_K, DS_GROUPS = 128, 512, 64, 256, 8, 8
BATCHES = (1, 32, 512)  # decode graph rows: one row, a typical batch, the largest graph
SLOTS_PER_RANK = (8, 4)  # expert slots per rank: a rank holding all experts, or half of them
DTYPES = (torch.bfloat16, torch.float32)  # the model's, and the tests'
# Shared memory a block may opt into, by compute capability (cudaDevAttrMaxSharedMemoryPerBlockOptin):
# a kernel over it compiles, then fails at its first launch (Triton's OutOfResources).
MAX_SHARED = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 103: 232448, 120: 101376}


@dataclass
class Launch:
    where: str  # the wrapper call that launched it
    fn: JITFunction
    args: dict  # argument name -> value, as bound at the launch
    options: dict  # launch options (num_warps, enable_fp_fusion, ...)


@contextmanager
def _recording(launches: list[Launch], where: str):
    """JITFunction.run records the launch instead of compiling and running it."""

    def run(self, *args, grid, warmup, **kwargs):
        names = [p.name for p in self.params]
        bound = dict(zip(names, args))
        bound.update({k: v for k, v in kwargs.items() if k in names})
        for p in self.params:
            if p.name not in bound:
                bound[p.name] = p.default
        options = {k: v for k, v in kwargs.items() if k not in names}
        launches.append(Launch(where, self, bound, options))

    with mock.patch.object(JITFunction, "run", run):
        yield


def _meta(*shape, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _fake_windows(rank: int, capacity: int, dtype: torch.dtype):
    """A PeerWindows whose mailbox is meta tensors: its methods launch what the real one does."""
    from components.engine.exchange.windows import PeerWindows
    from components.engine.memory.vmm import DEFAULT_ALIGN

    R, C = MAX_RANKS, capacity
    W = HIDDEN * dtype.itemsize // 4
    w = object.__new__(PeerWindows)
    w.rank, w.max_ranks, w.cap, w.hidden, w.dtype, w.words, w.timeout_s = rank, R, C, HIDDEN, dtype, W, 30.0
    specs = {
        "rows": ((R, C, W), torch.int32),
        "slots": ((R, C), torch.int32),
        "counts": ((R,), torch.int64),
        "ret": ((R, C, W), torch.int32),
        "arrive": ((2, R), torch.int64),
    }
    w._off, off = {}, 0
    for name, (shape, dt) in specs.items():  # the arena's bump allocation (plan_bytes)
        w._off[name] = off
        off += -(-torch.Size(shape).numel() * dt.itemsize // DEFAULT_ALIGN) * DEFAULT_ALIGN
    w.recv_rows, w.recv_slots, w.recv_counts, w.ret_rows, w.arrive = (_meta(*s, dtype=t) for s, t in specs.values())
    w.mask = _meta(R, dtype=torch.bool)
    w.table = _meta(R, dtype=torch.int64)
    w.expect = _meta(2, R, dtype=torch.int64)
    w.failed = torch.zeros(R, dtype=torch.int32)  # host memory: the kernels get its address
    w.abort = torch.zeros(1, dtype=torch.int32)
    w.peer_starts = _meta(R, dtype=torch.int64)
    return w


def _prompt_step(call: Callable[[], object], rows: int) -> object:
    """`call` as a step with prompt rows makes it: the experts in the tiling for such steps."""
    from components.engine.kernels.expert_gemm import PROMPT_TILES, expert_tiles

    with expert_tiles(PROMPT_TILES, rows):
        return call()


def _calls(dt: torch.dtype) -> Iterator[tuple[str, Callable[[], object]]]:
    """(where, the wrapper call) of each way the engine launches its kernels for dtype `dt`. Run each
    call before drawing the next: the calls close over the loop variables."""
    from components.engine.kernels import checksum as checksum_kernel
    from components.engine.kernels.decode_attention import decode_attention, latent_decode_attention
    from components.engine.kernels.expert_gemm import swiglu_experts
    from components.engine.kernels.latent_cache import latent_rotary_cache_write
    from components.engine.kernels.norm import add_rms_norm, rms_norm
    from components.engine.kernels.rotary import rotary_cache_write
    from components.engine.kernels.routing import GroupedSigmoid, combine_pairs, gather_rows, route_and_sort
    from components.engine.weights import checksum

    t = functools.partial(_meta, dtype=dt)
    i64 = functools.partial(_meta, dtype=torch.int64)
    i32 = functools.partial(_meta, dtype=torch.int32)
    flags = functools.partial(_meta, dtype=torch.bool)
    name = str(dt).removeprefix("torch.")
    for B in BATCHES:
        at = f"{name} B={B}"
        x, q, k, v = t(B, HIDDEN), t(B, HEADS, HEAD_DIM), t(B, KV_HEADS, HEAD_DIM), t(B, KV_HEADS, HEAD_DIM)
        kc, vc = t(CACHE_SLOTS, MAX_LEN, KV_HEADS, HEAD_DIM), t(CACHE_SLOTS, MAX_LEN, KV_HEADS, HEAD_DIM)
        yield f"rms_norm {at}", lambda: rms_norm(x, t(HIDDEN), 1e-5)
        yield f"add_rms_norm {at}", lambda: add_rms_norm(x, t(B, HIDDEN), t(HIDDEN), 1e-5)
        # The rotary tables: cast with the model (model.to), or fp32; every dim rotated, or half (GLM).
        for tab, rot in itertools.product({dt, torch.float32}, (HEAD_DIM, HEAD_DIM // 2)):
            cos, sin = _meta(MAX_LEN, rot, dtype=tab), _meta(MAX_LEN, rot, dtype=tab)
            yield (
                f"rotary_cache_write {at} tables {tab} rotary {rot}",
                lambda: rotary_cache_write(q, k, v, cos, sin, i64(B), i64(B), kc, vc),
            )
        yield f"decode_attention {at}", lambda: decode_attention(q, kc, vc, i64(B), i64(B))
        yield f"decode_attention {at} prompt rows", lambda: decode_attention(q, kc, vc, i64(B), i64(B), alone=B // 3)
        latent = t(CACHE_SLOTS, MAX_LEN, 1, KV_LORA + ROPE_DIM)
        # The query parts as LatentAttention has them: q_latent a transposed bmm result, q_rope contiguous.
        q_latent, q_rope = t(MLA_HEADS, B, KV_LORA).transpose(0, 1), t(B, MLA_HEADS, ROPE_DIM)
        yield (
            f"latent_decode_attention {at}",
            lambda: latent_decode_attention(q_latent, q_rope, latent, i64(B), i64(B), 0.1),
        )
        # Slices of the q and kv_a projections, as LatentAttention passes them.
        q_proj, kv_a = t(B, MLA_HEADS * (128 + ROPE_DIM)), t(B, KV_LORA + ROPE_DIM)
        for tab, interleave in itertools.product({dt, torch.float32}, (True, False)):  # tables as for rotary
            yield (
                f"latent_rotary_cache_write {at} tables {tab} interleave={interleave}",
                lambda: latent_rotary_cache_write(
                    q_proj.view(B, MLA_HEADS, 128 + ROPE_DIM)[..., 128:],
                    kv_a[:, KV_LORA:],
                    t(B, KV_LORA),
                    _meta(MAX_LEN, ROPE_DIM, dtype=tab),
                    _meta(MAX_LEN, ROPE_DIM, dtype=tab),
                    i64(B),
                    i64(B),
                    latent,
                    interleave,
                ),  # fmt: skip
            )
        for S in SLOTS_PER_RANK:
            w_gate, w_up, w_down = t(S, INTER, HIDDEN), t(S, INTER, HIDDEN), t(S, HIDDEN, INTER)
            yield (
                f"swiglu_experts {at} slots={S}",
                lambda: swiglu_experts(t(B * TOP_K, HIDDEN), i32(B * TOP_K), w_gate, w_up, w_down, i64(1)),
            )
            yield (  # a step with prompt rows: its own tiling (fp32 keeps the decode one)
                f"swiglu_experts {at} slots={S} prompt tiles",
                lambda: _prompt_step(
                    lambda: swiglu_experts(t(B * TOP_K, HIDDEN), i32(B * TOP_K), w_gate, w_up, w_down, i64(1)),
                    B * TOP_K,
                ),
            )
            for graph in (False, True):  # a decode graph's valid rows, with the windows' misrouted count
                valid, misrouted = (flags(B), (i64(1), i64(1))) if graph else (None, None)
                yield (
                    f"route_and_sort {at} slots={S} graph={graph}",
                    lambda: route_and_sort(
                        t(B, EXPERTS),
                        valid,
                        i64(EXPERTS, 2),
                        i64(EXPERTS),
                        flags(MAX_RANKS),
                        i64(EXPERTS),
                        TOP_K,
                        True,
                        S,
                        dt,
                        misrouted,
                    ),  # fmt: skip
                )
            grouped = GroupedSigmoid(_meta(DS_EXPERTS, dtype=torch.float32), DS_GROUPS, DS_GROUPS // 2, 2.5)
            yield (  # DeepSeek-V3's routing: fp32 logits (its router stays fp32), a decode graph's
                f"route_and_sort grouped sigmoid {at} slots={S}",
                lambda: route_and_sort(
                    _meta(B, DS_EXPERTS, dtype=torch.float32),
                    flags(B),
                    i64(DS_EXPERTS, 2),
                    i64(DS_EXPERTS),
                    flags(MAX_RANKS),
                    i64(DS_EXPERTS),
                    DS_TOP_K,
                    True,
                    S,
                    dt,
                    (i64(1), i64(1)),
                    grouped,
                ),  # fmt: skip
            )
        yield f"gather_rows {at}", lambda: gather_rows(x, i64(B * TOP_K), TOP_K)
        yield f"combine_pairs {at}", lambda: combine_pairs(t(B * TOP_K, HIDDEN), i32(B * TOP_K), t(B, TOP_K))
    P = 32 * TOP_K
    for rank in (0, 1, 3):  # 0 and 1 are specialised (divisible by 16, equal to 1), 3 is not
        windows = _fake_windows(rank, max(BATCHES) * TOP_K, dt)  # rank.ep_communicator's capacity
        yield (
            f"PeerWindows.exchange {name} rank={rank}",
            lambda: windows.exchange(t(P, HIDDEN), i32(P), i64(MAX_RANKS + 2), t(P, HIDDEN), _echo),
        )
    for word in (torch.int32, torch.int16, torch.uint8):
        words = [_meta(1000, dtype=word)]
        yield f"block_sums {word}", lambda: checksum_kernel.block_sums(words, checksum._COLS, checksum._ROW_MOD)
    pairs = [(_meta(5000, dtype=torch.int32), _meta(5000, dtype=torch.int32))]
    yield "copy_block_sums", lambda: checksum_kernel.copy_block_sums(pairs, checksum._COLS, checksum._ROW_MOD)


def _echo(rows: torch.Tensor, slots: torch.Tensor, zero_unrouted: bool = True) -> torch.Tensor:
    return torch.empty_like(rows)


def entry_kernels() -> set[str]:
    """Every @triton.jit of components/engine that no other kernel calls: what wrappers launch."""
    engine = Path(__file__).resolve().parents[1] / "components" / "engine"
    kernels: list[JITFunction] = []
    for path in sorted(engine.glob("*.py")):
        if "@triton.jit" in path.read_text():  # import only the modules with kernels
            mod = importlib.import_module(f"components.engine.{path.stem}")
            kernels += [v for v in vars(mod).values() if isinstance(v, JITFunction) and v.__module__ == mod.__name__]
    called = {k.__name__ for k in kernels for other in kernels if other is not k and f"{k.__name__}(" in other.src}
    return {k.__name__ for k in kernels} - called


def record_launches(dtypes=DTYPES) -> list[Launch]:
    """Every kernel launch the engine's CUDA wrappers make for the model shapes above."""
    out: list[Launch] = []
    for dt in dtypes:
        for where, call in _calls(dt):
            with _recording(out, where):
                call()
    return out


@dataclass
class Compile:
    where: str
    fn: JITFunction
    variant: str  # "jit" (specialised as on the device) or "generic"
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict

    def key(self):
        return (self.fn.__name__, repr(self.signature), repr(self.constexprs), repr(self.attrs), repr(self.options))

    def label(self) -> str:
        consts = ",".join(f"{self.fn.arg_names[k[0]]}={_short(v)}" for k, v in self.constexprs.items())
        ptrs = sorted({t for t in self.signature.values() if t.startswith("*")})
        return f"{self.fn.__name__} [{self.variant}] {'/'.join(ptrs)} {consts}  ({self.where})"


def _short(v) -> str:
    return str(v).removeprefix("triton.language.")


def specialise(launch: Launch, variant: str) -> Compile:
    """The signature, constants and attributes JITFunction.run would compile `launch` with
    ("jit"), or the same with no value specialisation ("generic")."""
    on = variant == "jit"
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(launch.fn.params):
        value = launch.args[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        spec, attr = native_specialize_impl(
            BaseBackend, value, p.is_const, on and not p.do_not_specialize, on and not p.do_not_specialize_on_alignment
        )
        signature[p.name] = spec
        if spec == "constexpr":
            constexprs[(i,)] = attr
        elif isinstance(attr, str):
            attrs[(i,)] = BaseBackend.parse_attr(attr)
    return Compile(launch.where, launch.fn, variant, signature, constexprs, attrs, launch.options)


def _resources(cubin: bytes, name: str) -> dict[str, int]:
    """REG, LOCAL (spills and local arrays, bytes a thread), STACK of `name` in a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        dump = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    line = re.search(rf"Function {re.escape(name)}:\s*\n\s*(.*)", dump)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line.group(1))} if line else {}


def _first_line(e: BaseException) -> str:
    if isinstance(e, CompilationError):
        cause = e.error_message or str(e.__cause__ or "")
        line = getattr(e.node, "lineno", None)
        where = f"kernel line {line}: " if line is not None else ""
        return f"{type(e).__name__}: {where}{_nonempty(cause)}"
    return f"{type(e).__name__}: {_nonempty(str(e))}"


def _nonempty(text: str) -> str:
    return next((s.strip() for s in text.splitlines() if s.strip()), "")


_COMPILES: list[Compile] = []  # what forked workers compile, by index


def _compile(i: int, arch: int, verbose: bool) -> tuple[bool, str]:
    c = _COMPILES[i]
    t0 = time.monotonic()
    try:
        src = ASTSource(c.fn, c.signature, c.constexprs, c.attrs)
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=c.options)
    except Exception as e:  # every compiler stage's error is a finding to report
        return False, f"FAILED  {c.label()}\n        {_first_line(e)}" + (f"\n{e}" if verbose else "")
    res = _resources(kernel.asm["cubin"], kernel.name)
    limit = MAX_SHARED.get(arch)
    if limit is not None and kernel.metadata.shared > limit:
        return False, f"FAILED  {c.label()}\n        OutOfResources: shared memory {kernel.metadata.shared} > {limit}"
    return True, (
        f"ok      {c.label()}  regs={res.get('REG')} stack={res.get('STACK')} local={res.get('LOCAL')} "
        f"shared={kernel.metadata.shared} warps={kernel.metadata.num_warps} {time.monotonic() - t0:.1f}s"
    )


def check(arch: int, quick: bool = False, jobs: int = 1, verbose: bool = False) -> int:
    """Compile every launch (quick: the model dtype's, as the JIT specialises them on the device)."""
    compiles: dict[tuple, Compile] = {}
    for launch in record_launches(DTYPES[:1] if quick else DTYPES):
        for variant in ("jit",) if quick else ("jit", "generic"):
            c = specialise(launch, variant)
            compiles.setdefault(c.key(), c)
    _COMPILES[:] = compiles.values()
    # A kernel no recorded call launches would go unchecked: a new wrapper needs a line in _calls.
    missing = entry_kernels() - {c.fn.__name__ for c in _COMPILES}
    for name in sorted(missing):
        print(f"FAILED  {name}: no call in _calls launches it, so it was not compiled")
    run = functools.partial(_compile, arch=arch, verbose=verbose)
    ids = range(len(_COMPILES))
    failed = 0
    # Forked workers inherit the kernels (JITFunctions do not pickle); nothing here touches CUDA.
    with multiprocessing.get_context("fork").Pool(jobs) if jobs > 1 else nullcontext() as pool:
        for ok, line in pool.imap(run, ids) if pool else map(run, ids):
            failed += not ok
            print(line, flush=True)
    print(f"{len(_COMPILES) - failed}/{len(_COMPILES)} compiled for sm_{arch}")
    return 1 if failed or missing else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability to compile for (90: H100/H200)")
    ap.add_argument("--quick", action="store_true", help="the model dtype's launches, JIT-specialised only")
    ap.add_argument("-j", "--jobs", type=int, default=os.cpu_count(), help="compiles run in parallel")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each failure's full message")
    args = ap.parse_args()
    sys.exit(check(args.arch, args.quick, args.jobs, args.verbose))


if __name__ == "__main__":
    main()
