"""What nvcc compiled, read back from the cubin (ELF) and ptxas's report, to check tvmpipe's launch
ABI against: per kernel, the parameter table (`.nv.info.<kernel>` EIATTR_KPARAM_INFO entries, what
`cuobjdump -elf` prints), the parameter bank size, `__launch_bounds__` (EIATTR_MAX_THREADS) and
ptxas's registers and static shared memory."""

from __future__ import annotations

import re
import struct
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

KPARAM_INFO, MAX_THREADS, CBANK_PARAM_SIZE = 0x17, 0x05, 0x19
EIFMT_NVAL, EIFMT_BVAL, EIFMT_HVAL, EIFMT_SVAL = 1, 2, 3, 4


@dataclass
class CompiledKernel:
    name: str
    params: dict[int, tuple[int, int]] = field(default_factory=dict)  # ordinal -> (offset, size)
    param_bytes: int | None = None
    max_threads: int | None = None
    registers: int | None = None
    static_smem: int | None = None


def sections(elf: bytes) -> dict[str, bytes]:
    assert elf[:4] == b"\x7fELF" and elf[4] == 2, "a 64-bit ELF cubin"
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]

    def name(off: int) -> str:
        return elf[names + off:elf.index(b"\0", names + off)].decode()
    return {name(h[0]): elf[h[4]:h[4] + h[5]] for h in heads}


def attributes(info: bytes):
    """(attribute, payload) of an .nv.info section."""
    i = 0
    while i < len(info):
        fmt, attr = info[i], info[i + 1]
        if fmt == EIFMT_SVAL:
            size = struct.unpack_from("<H", info, i + 2)[0]
            yield attr, info[i + 4:i + 4 + size]
            i += 4 + size
        else:
            yield attr, info[i + 2:i + 4]
            i += 4


def read_kernels(elf: bytes, ptxas_report: str) -> dict[str, CompiledKernel]:
    out = {}
    for sec, data in sections(elf).items():
        if not sec.startswith(".nv.info."):
            continue
        k = out[sec[len(".nv.info."):]] = CompiledKernel(sec[len(".nv.info."):])
        for attr, pay in attributes(data):
            if attr == KPARAM_INFO:
                _index, ordinal, offset, flags = struct.unpack("<IHHI", pay)
                k.params[ordinal] = (offset, (flags >> 18) & 0x3FFF)
            elif attr == CBANK_PARAM_SIZE:
                k.param_bytes = struct.unpack("<H", pay)[0]
            elif attr == MAX_THREADS:
                x, y, z = struct.unpack("<III", pay)
                k.max_threads = x * y * z
    for name, body in re.findall(r"Compiling entry function '(\w+)'.*?\n(.*?)(?=Compiling entry|\Z)", ptxas_report, re.S):
        regs = re.search(r"Used (\d+) registers", body)
        smem = re.search(r"Used \d+ registers[^\n]*?(\d+) bytes smem", body)
        if name in out and regs:
            out[name].registers, out[name].static_smem = int(regs.group(1)), int(smem.group(1)) if smem else 0
    return out


def compile_and_read(nvcc: str, source: str, arch: str, tmp: Path) -> dict[str, CompiledKernel]:
    src, cubin = tmp / "kernels.cu", tmp / "kernels.cubin"
    src.write_text(source)
    r = subprocess.run([nvcc, "--cubin", f"-arch={arch}", "-O3", "--resource-usage", "-diag-suppress", "177",
                        "-o", str(cubin), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_kernels(cubin.read_bytes(), r.stdout + r.stderr)
