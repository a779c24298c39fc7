"""Description of the machine a kernel is tuned for, and its stable short key."""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shlex
import subprocess
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=None)
def cpu_target(compiler: str = "gcc") -> dict[str, Any]:
    """CPU model, SIMD flags, core count and compiler version of this machine."""
    model, flags = platform.processor() or "unknown", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("unknown", "", platform.processor()):
                    model = line.split(":", 1)[1].strip()
                if line.startswith("flags"):
                    flags = sorted(x for x in line.split(":", 1)[1].split() if x.startswith(("avx", "fma", "sse4")))
                    break
    except OSError:
        pass
    try:
        cc = subprocess.run([*shlex.split(compiler), "--version"], capture_output=True, text=True,
                            timeout=10).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        cc = "unknown"
    return {"kind": "cpu", "model": model, "isa": flags, "cores": os.cpu_count() or 1, "compiler": cc}


def target_key(target: dict[str, Any]) -> str:
    """`cpu-<model words>-<hash>`: equal for equal machines and compilers."""
    h = hashlib.sha1(json.dumps(target, sort_keys=True).encode()).hexdigest()[:10]
    model = "".join(c if c.isalnum() else "_" for c in str(target.get("model", "")))[:24]
    return f"{target.get('kind', 'cpu')}-{model}-{h}"
