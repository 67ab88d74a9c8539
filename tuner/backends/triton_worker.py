"""A process that runs rendered Triton kernels in Triton's interpreter, for `interpret=True`.

Triton decides when it is imported whether `@triton.jit` functions (its own library included) are
compiled or interpreted, so one process cannot both interpret kernels and compile them for a GPU
target. The backend therefore starts this file as a separate Python process (`python -P`, so that
this folder's `triton.py` does not shadow the triton package) with TRITON_INTERPRET=1 and sends it
requests over stdin: pickled `(module path, kernel name, grid, arrays, output shapes,
constants)`, answered on stdout with the output arrays or the error text. It imports only numpy,
torch and triton (not jax, not tuner).
"""

import importlib.util
import os
import pickle
import sys
import traceback

import numpy as np


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
            path = request["module"]
            if path not in modules:
                spec = importlib.util.spec_from_file_location(f"interpreted_{len(modules)}", path)
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                modules[path] = module
            kernel = getattr(modules[path], request["kernel"])
            outs = [torch.zeros(shape, dtype=torch.float32) for shape in request["out_shapes"]]
            kernel[tuple(request["grid"])](*map(_tensor, request["args"]), *outs, **request["constants"])
            reply = {"outputs": [o.numpy() for o in outs]}
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
