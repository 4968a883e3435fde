"""kernels.cu -> cubin with nvcc, cached on disk. Needs nvcc, not a GPU."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tvmpipe.executor.errors import BackendUnavailable, DeviceError


def cache_root() -> Path:
    """Where tvmpipe caches compiled artifacts: $TVMPIPE_CACHE, else ~/.cache/tvmpipe."""
    return Path(os.environ.get("TVMPIPE_CACHE") or Path.home() / ".cache" / "tvmpipe")


def compile_cubin(source: str, arch: str, nvcc: str | None = None, cache_dir: str | Path | None = None) -> bytes:
    """kernels.cu -> cubin for `arch`, cached on disk by (source, arch) so each process compiles once."""
    cache = Path(cache_dir or cache_root()) / "cubin"
    key = hashlib.sha256(f"{arch}\0{source}".encode()).hexdigest()[:32]
    cached = cache / f"{key}-{arch}.cubin"
    if cached.is_file():
        return cached.read_bytes()
    nvcc = nvcc or shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc")
                                                 if os.path.exists(p)), None)
    if nvcc is None:
        raise BackendUnavailable("the cuda backend needs nvcc to compile kernels.cu (not found on PATH)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / "kernels.cu", Path(tmp) / "kernels.cubin"
        src.write_text(source)
        res = subprocess.run([nvcc, "--cubin", f"-arch={arch}", "-O3", "-o", str(out), str(src)],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise DeviceError(f"nvcc failed to compile kernels.cu for {arch}:\n{res.stderr.strip()[-4000:]}")
        os.replace(out, cached)  # atomic: concurrent workers never read half a cubin
    return cached.read_bytes()
