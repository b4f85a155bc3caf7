"""CuTeDSL compile cache.

A kernel is compiled once per *key*: a tuple of hashable facts (dtypes, static
dims, flags) plus the target arch. It is compiled against fake tensors with
symbolic sizes, so one compile serves every batch and sequence length, with
TVM-FFI as the calling convention (a few microseconds of host time a launch,
the stream taken from torch's current stream).

Two levels:
  * in memory: a dict key -> launchable function, filled once per process;
  * on disk: ``$CUDNN_TRAIN_CACHE_DIR`` (default ``~/.cache/cudnn_train``), one
    object file per key under a folder named by a fingerprint of the kernel
    sources and of the cutlass-dsl, tvm-ffi and Python versions; writers hold
    a file lock so that concurrent processes compile each key once.

Compiling is thread-safe (one lock per key). The arch comes from
``CUDNN_TRAIN_ARCH``, else from the current CUDA device, else ``sm_90a``; it is
put into ``CUTE_DSL_ARCH`` before cutlass is first imported, so kernels compile
on a machine without a GPU (the CPU compile tier).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "target_arch",
    "import_cute",
    "cache_dir",
    "get_kernel",
    "cuda_sm_major",
    "num_sms",
    "clear_memory_cache",
    "launcher_cache",
]

_ARCH_BY_CAPABILITY = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a", (12, 0): "sm_120a"}

_mem: dict[tuple, Any] = {}
_key_locks: dict[tuple, threading.Lock] = {}
_global_lock = threading.Lock()
_fingerprints: dict[tuple[str, ...], str] = {}


_detected_arch: list[str] = []


def target_arch() -> str:
    """The arch kernels compile for: CUDNN_TRAIN_ARCH, the current GPU, or sm_90a without one."""
    env = os.environ.get("CUDNN_TRAIN_ARCH", "").strip()
    if env:
        return env
    if not _detected_arch:
        import torch

        if torch.cuda.is_available():
            cap = torch.cuda.get_device_capability()
            _detected_arch.append(_ARCH_BY_CAPABILITY.get(cap, f"sm_{cap[0]}{cap[1]}"))
        else:
            _detected_arch.append("sm_90a")
    return _detected_arch[0]


def import_cute():
    """Import cutlass and cutlass.cute with CUTE_DSL_ARCH set first; returns (cutlass, cute)."""
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", target_arch())
    import cutlass
    import cutlass.cute as cute

    return cutlass, cute


_sm_major: dict[int, int] = {}


def cuda_sm_major(device) -> int | None:
    """Compute capability major of a CUDA device, or None for a non-CUDA device (cached per device)."""
    if device.type != "cuda":
        return None
    idx = device.index
    major = _sm_major.get(idx)
    if major is None:
        import torch

        major = torch.cuda.get_device_capability(device)[0]
        _sm_major[idx] = major
    return major


_sm_count: dict[int, int] = {}


def num_sms(device) -> int:
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _sm_count:
        _sm_count[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _sm_count[idx]


def cache_dir() -> Path:
    env = os.environ.get("CUDNN_TRAIN_CACHE_DIR", "").strip()
    return Path(env) if env else Path.home() / ".cache" / "cudnn_train"


def _fingerprint(sources: tuple[str, ...]) -> str:
    fp = _fingerprints.get(sources)
    if fp is None:
        import cutlass
        import tvm_ffi

        h = hashlib.sha256()
        for src in sources + (__file__,):
            h.update(Path(src).read_bytes())
        h.update(f"cutlass={cutlass.__version__};tvm_ffi={tvm_ffi.__version__};py={sys.version_info[:3]}".encode())
        fp = h.hexdigest()[:20]
        _fingerprints[sources] = fp
    return fp


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _load(obj_path: Path, symbol: str):
    _, cute = import_cute()
    mod = cute.runtime.load_module(str(obj_path), enable_tvm_ffi=True)
    return getattr(mod, symbol)


def get_kernel(name: str, key: tuple, build: Callable[[], Any], sources: Iterable[str], use_disk: bool | None = None):
    """Return the launchable TVM-FFI function for ``(name, key, arch)``, compiling on a miss.

    ``build()`` must return the result of ``cute.compile(..., options="--enable-tvm-ffi")``.
    ``sources``: the files whose text defines the kernel (hashed into the disk fingerprint).
    """
    arch = target_arch()
    full_key = (name, arch) + tuple(key)
    fn = _mem.get(full_key)
    if fn is not None:
        return fn
    with _global_lock:
        lock = _key_locks.setdefault(full_key, threading.Lock())
    with lock:
        fn = _mem.get(full_key)
        if fn is not None:
            return fn
        import_cute()
        if use_disk is None:
            use_disk = os.environ.get("CUDNN_TRAIN_DISK_CACHE", "1") != "0"
        digest = hashlib.sha256(repr(full_key).encode()).hexdigest()[:24]
        symbol = f"{name}_{digest}"
        if use_disk:
            folder = cache_dir() / _fingerprint(tuple(sorted(str(s) for s in sources)))
            obj = folder / f"{symbol}.o"
            # one lock per kernel: processes building other kernels of the same sources go on in parallel
            with _file_lock(folder / f"{symbol}.lock"):
                if not obj.exists():
                    compiled = build()
                    fd, tmp = tempfile.mkstemp(suffix=".o", dir=folder)
                    os.close(fd)
                    try:
                        compiled.export_to_c(tmp, symbol)
                        os.replace(tmp, obj)
                    finally:
                        if os.path.exists(tmp):
                            os.unlink(tmp)
            fn = _load(obj, symbol)
        else:
            fn = build()
        _mem[full_key] = fn
        return fn


_launcher_caches: list[dict] = []


def launcher_cache() -> dict:
    """A per-module dict for the fastest lookup on the hot path; cleared with the memory cache."""
    d: dict = {}
    _launcher_caches.append(d)
    return d


def clear_memory_cache() -> None:
    """Forget in-memory kernels (tests use this to exercise the disk cache)."""
    with _global_lock:
        _mem.clear()
        for d in _launcher_caches:
            d.clear()
