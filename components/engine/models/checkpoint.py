"""Hugging Face checkpoint directory: validated up front from safetensors headers, read lazily."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from components.engine.models.config import ConfigError, ModelConfig
from components.engine.models.registry import expected_tensors, read_config

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be served; the message names the file and the problem."""


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


class Checkpoint:
    def __init__(self, path: Path, config: ModelConfig, handles: dict[Path, object], locations: dict[str, Path]):
        self.path = path
        self.config = config
        self._handles = handles  # one safe_open per file; mmapped, so cheap to keep open
        self._locations = locations
        self._lock = threading.Lock()

    @classmethod
    def open(cls, path: str | Path) -> Checkpoint:
        path = Path(path).absolute()
        if not path.exists():
            raise CheckpointError(f"{path}: no such directory")
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory")
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{path}: missing config.json")
        try:
            cfg = read_config(cfg_path)
        except ConfigError as e:
            raise CheckpointError(str(e)) from None

        # name -> (file, the file to blame when it is absent: the index if one listed it)
        listed: dict[str, Path] = {}
        index = path / INDEX_NAME
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise CheckpointError(f"{index}: invalid JSON ({e})") from None
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map object")
            for name, fname in weight_map.items():
                f = path / fname
                if not f.is_file():
                    raise CheckpointError(f"{index}: refers to missing file {fname}")
                listed[name] = f
            files = sorted(set(listed.values()))
            blame = index
        elif (path / SINGLE_NAME).is_file():
            files = [path / SINGLE_NAME]
            blame = files[0]
        else:
            raise CheckpointError(f"{path}: no weights ({SINGLE_NAME} or {INDEX_NAME})")

        handles, locations, shapes = {}, {}, {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
                for name in h.keys():
                    locations.setdefault(name, f)
                    shapes.setdefault(name, tuple(h.get_slice(name).get_shape()))
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: corrupt safetensors header ({e})") from None
            handles[f] = h

        for name, want in expected_tensors(cfg).items():
            if name in listed and locations.get(name) != listed[name]:
                raise CheckpointError(f"{listed[name]}: missing tensor {name} (listed in {INDEX_NAME})")
            if name not in locations:
                raise CheckpointError(f"{blame}: missing tensor {name}")
            if shapes[name] != want:
                raise CheckpointError(
                    f"{locations[name]}: tensor {name} has shape {_fmt(shapes[name])}, expected {_fmt(want)}"
                )
        return cls(path, cfg, handles, locations)

    def __contains__(self, name: str) -> bool:
        return name in self._locations

    def tensor_names(self) -> list[str]:
        return sorted(self._locations)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def _handle(self, name: str):
        f = self._locations.get(name)
        if f is None:
            raise CheckpointError(f"{self.path}: no tensor {name}")
        with self._lock:
            h = self._handles.get(f)
            if h is None:  # reopened after close()
                h = self._handles[f] = safe_open(str(f), framework="pt", device="cpu")
        return h

    def get(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> torch.Tensor:
        t = self._handle(name).get_tensor(name)
        if t.dtype == torch.float8_e4m3fn:  # on the device it goes to: a GPU converts fp8 far faster
            t = self._dequantised(name, t.to(device))
        return t.to(device=device, dtype=dtype) if dtype is not None or str(device) != "cpu" else t

    def _dequantised(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """An FP8 weight as fp32: each [rows, cols] block (config.weight_block) times its
        `weight_scale_inv` entry, as DeepSeek's published checkpoints store them. The engine
        serves the dequantised weights (their own dtype's bytes in memory and in weight pulls)."""
        block, scale_name = self.config.weight_block, f"{name}_scale_inv"
        if block is None or scale_name not in self._locations:
            raise CheckpointError(
                f"{self._locations[name]}: tensor {name} is float8_e4m3fn but "
                + ("config.json has no quantization_config" if block is None else f"{scale_name} is missing")
            )
        scale = self._handle(scale_name).get_tensor(scale_name).to(device=w.device, dtype=torch.float32)
        rows, cols = w.shape
        want = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != want:
            where = self._locations[scale_name]
            raise CheckpointError(f"{where}: tensor {scale_name} has shape {_fmt(scale.shape)}, expected {_fmt(want)}")
        (br, bc), (nr, nc) = block, want
        # Each block times its scale as a broadcast over a [nr, br, nc, bc] view (no scale
        # expanded to the weight's size); partial last blocks padded, then cut off.
        x = torch.nn.functional.pad(w.float(), (0, nc * bc - cols, 0, nr * br - rows))
        return (x.view(nr, br, nc, bc) * scale[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols]

    def close(self) -> None:
        with self._lock:
            self._handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, {self.config.architecture}, {len(self._locations)} tensors)"
