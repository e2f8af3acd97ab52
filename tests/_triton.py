"""Helpers for Triton kernel tests on a CPU: a script under Triton's interpreter, and a compile for the H200."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest


def run_interpreted(script: str, *args: str) -> Any:
    """Run `script` in a fresh Python with TRITON_INTERPRET=1 (it must be set before a kernel is defined) and return
    the JSON it printed last."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # a limit against a hang, not a speed check: a Talker reply's frames under the interpreter took 11.6-12.1 min on
    # this project's 2-core CPU machine (alone, at two commits)
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_for_h200(kernel: Any, types: dict[str, str], constants: dict[str, Any], num_warps: int = 4) -> str:
    """Triton's compiler, not its interpreter, down to Hopper machine code (sm_90), with no GPU: what the interpreter
    lets pass and a GPU would refuse (a Python annotation in a jit function, a type Triton cannot lower) fails here.
    `types`: each runtime argument's Triton type; `constants`: the constexpr arguments. Returns the PTX."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**types, **{name: "constexpr" for name in constants}}
    source = ASTSource(kernel, signature, constexprs=constants)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert compiled.asm["cubin"] and ".target sm_90" in compiled.asm["ptx"]
    return compiled.asm["ptx"]
