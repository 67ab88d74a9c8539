"""A process that runs rendered Triton kernels in Triton's interpreter, for `interpret=True`.

Triton decides when it is imported whether `@triton.jit` functions (its own library included) are
compiled or interpreted, so one process cannot both interpret kernels and compile them for a GPU
target. The backend therefore starts this file as a separate Python process (`python -P`, so that
this folder's `triton.py` does not shadow the triton package) with TRITON_INTERPRET=1 and sends it
requests over stdin: pickled `(module path, sha256 of its rendering, kernel name, grid, arrays,
output shapes, constants)`, answered on stdout with the output arrays or the error text. It imports
only numpy, torch and triton (not jax, not tuner).

A module runs only if its file's bytes have the sha256 the request names (what `tuner.kernels.codegen`
rendered); those checked bytes are what runs -- compiled from memory and registered in `linecache`,
where Triton's interpreter reads kernel sources with `inspect` -- so the file is never read again. A
file that does not match is refused with a `mismatch` reply: the backend rewrites it and asks again.
"""

import hashlib
import linecache
import os
import pickle
import sys
import traceback
import types

import numpy as np


class Mismatch(Exception):
    """The module file is not the rendering the request names."""


def _verified_module(name: str, path: str, expected: str) -> types.ModuleType:
    """Execute the file at `path` if its bytes have the sha256 `expected`, from those same bytes."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as error:
        raise Mismatch(f"cannot read {path}: {error}") from None
    found = hashlib.sha256(data).hexdigest()
    if found != expected:
        raise Mismatch(f"{path} has sha256 {found}, not {expected} of its rendering; not running it")
    text = data.decode("utf-8")
    linecache.cache[path] = (len(data), None, text.splitlines(keepends=True), path)
    module = types.ModuleType(name)
    module.__file__ = path
    sys.modules[name] = module
    exec(compile(text, path, "exec"), module.__dict__)  # noqa: S102 - the bytes just checked
    return module


def _tensor(packed):
    import torch

    data, dtype, shape = packed
    if dtype == "bfloat16":
        return torch.from_numpy(np.frombuffer(data, np.int16).reshape(shape).copy()).view(torch.bfloat16)
    return torch.from_numpy(np.frombuffer(data, dtype).reshape(shape).copy())


def _fix_bfloat16_dot() -> None:
    """Triton's interpreter multiplies bfloat16 operands of `tl.dot` as their raw 16-bit patterns
    (it widens only fp8); widen them to float32 first -- exact, and the product accumulates in float32
    as on the GPU. Checked by the bf16 property tests (tests/test_triton.py)."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def widened(handle):
        if handle.dtype.scalar != tl.bfloat16:
            return handle
        data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None).view(np.float32)
        return interpreter.TensorHandle(data, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return original(self, widened(a), widened(b), d, input_precision, max_num_imprecise_acc)

    interpreter.InterpreterBuilder.create_dot = create_dot


def serve(requests, replies) -> None:
    """Answer requests until stdin closes."""
    import torch

    _fix_bfloat16_dot()
    modules = {}
    while True:
        try:
            request = pickle.load(requests)
        except EOFError:
            return
        try:
            key = (request["module"], request["sha256"])
            if key not in modules:
                modules[key] = _verified_module(f"interpreted_{len(modules)}", *key)
            kernel = getattr(modules[key], request["kernel"])
            outs = [torch.zeros(shape, dtype=torch.float32) for shape in request["out_shapes"]]
            kernel[tuple(request["grid"])](*map(_tensor, request["args"]), *outs, **request["constants"])
            reply = {"outputs": [o.numpy() for o in outs]}
        except Mismatch as error:
            reply = {"mismatch": str(error)}
        except Exception:  # noqa: BLE001 - the error travels back to the caller, which raises it
            reply = {"error": traceback.format_exc()}
        pickle.dump(reply, replies)
        replies.flush()


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1")
    protocol = sys.stdout.buffer
    sys.stdout = sys.stderr  # anything a kernel prints must not corrupt the replies
    serve(sys.stdin.buffer, protocol)
