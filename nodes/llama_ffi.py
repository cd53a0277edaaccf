"""The few llama.cpp/ggml C entry points the shard runtime needs beyond llama_cpp's bindings.

`LayerInputCapture` (the default) reads the input rows of one layer that llama.cpp keeps
for every token when asked with llama_set_embeddings_layer_inp (a staging C++ API of
llama.cpp, looked up by its mangled name). `HiddenCapture` (fallback) copies the output rows of one named graph tensor (`l_out-<last layer>`)
out of llama.cpp's compute graph through a `cb_eval` callback. The scheduler asks the
callback about every graph node, so the `ask` path is kept to one pointer compare in the
common case (graphs are reused between decode steps, so the tensor's address repeats) and
one fixed-size name read otherwise.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path

import numpy as np

GGML_MAX_DIMS = 4
GGML_MAX_SRC = 10
GGML_MAX_OP_PARAMS = 64
# struct ggml_tensor field offsets (ggml.h): type, buffer, ne[4], nb[4], op, op_params[16],
# flags, src[10], view_src, view_offs, data, name[64]
_NE_OFFSET = 16
_NAME_OFFSET = 16 + 8 * GGML_MAX_DIMS * 2 + 4 + GGML_MAX_OP_PARAMS + 4 + 8 * GGML_MAX_SRC + 8 + 8 + 8
GGML_TYPE_F32 = 0

EvalCallback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
GOMP_SPIN_DEFAULT = "2000"


def import_llama_cpp():
    """Import llama_cpp with a short OpenMP idle spin: every path of the shard runtime that
    loads llama.cpp goes through here, because libgomp reads GOMP_SPINCOUNT only when it
    loads, with the first llama_cpp import (the environment wins over the default).

    libgomp's default lets an idle worker spin ~10 ms after every graph compute; on a machine
    shared with the next hop that worker takes a core from the other node's model call (a
    tail that once imported llama_cpp before setting this made the head's decode step take
    23 ms instead of 9.7). GOMP_SPIN_DEFAULT keeps ggml's in-graph barriers fast and lets
    workers sleep ~0.1 ms after work (OMP_WAIT_POLICY=PASSIVE would also sleep at every
    barrier: ~2x slower decode)."""
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPIN_DEFAULT)
    import llama_cpp

    return llama_cpp


@lru_cache(maxsize=1)
def ggml_base() -> ctypes.CDLL:
    """libggml-base shipped inside the llama_cpp package (holds ggml_backend_tensor_get)."""
    llama_cpp = import_llama_cpp()
    libdir = Path(llama_cpp.__file__).parent / "lib"
    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        if (libdir / name).exists():
            lib = ctypes.CDLL(str(libdir / name), mode=getattr(os, "RTLD_GLOBAL", 0))
            break
    else:  # pragma: no cover - depends on the wheel's layout
        raise FileNotFoundError(f"libggml-base not found in {libdir}")
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
    lib.ggml_nbytes.restype = ctypes.c_size_t
    return lib


def tensor_name(addr: int) -> bytes:
    """The NUL-terminated name of a ggml_tensor at `addr`."""
    return ctypes.string_at(addr + _NAME_OFFSET)


class HiddenCapture:
    """Collect rows of the tensor named `name` ([n_embd, n_tokens] f32) into a numpy buffer."""

    def __init__(self, name: str, n_embd: int, max_rows: int) -> None:
        self._name = name.encode() + b"\0"
        self._name_len = len(self._name)
        self._n_embd = n_embd
        self.buffer = np.zeros((max_rows, n_embd), dtype=np.float32)
        self.rows = 0
        self._hit = 0  # address of the last matching tensor
        lib = ggml_base()
        self._get = lib.ggml_backend_tensor_get
        self._nbytes = lib.ggml_nbytes
        self._string_at = ctypes.string_at
        self.callback = EvalCallback(self._on_eval)  # keep a reference while the context lives

    def reset(self) -> None:
        """Forget rows captured by a previous call."""
        self.rows = 0

    def collect(self, n: int) -> np.ndarray:
        """The n rows captured during the last decode, as a new [n, n_embd] array."""
        return self.buffer[:n].copy()

    def _on_eval(self, t: int, ask: bool, _ud: int) -> bool:
        if ask:
            if t == self._hit:
                return True
            if self._string_at(t + _NAME_OFFSET, self._name_len) != self._name:
                return False
            self._hit = t
            return True
        return self._copy(t)

    def _copy(self, t: int) -> bool:
        if self._string_at(t + _NAME_OFFSET, self._name_len) != self._name:
            self._hit = 0  # the graph was rebuilt and this address is another tensor now
            return True
        nbytes = self._nbytes(t)
        n = nbytes // (4 * self._n_embd)
        if self.rows + n > self.buffer.shape[0]:
            raise RuntimeError("hidden capture buffer overflow")
        dst = self.buffer[self.rows : self.rows + n]
        self._get(t, dst.ctypes.data, 0, nbytes)
        self.rows += n
        return True


# llama-ext.h is C++ without extern "C": the symbols carry Itanium-mangled names
_SET_LAYER_INP = "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"
_GET_LAYER_INP = "_Z30llama_get_embeddings_layer_inpP13llama_contextj"


@lru_cache(maxsize=1)
def layer_input_api() -> tuple[object, object] | None:
    """(set, get) of llama.cpp's per-layer input extraction, or None if this build lacks it."""
    lib = import_llama_cpp().llama_cpp._lib
    try:
        set_fn, get_fn = getattr(lib, _SET_LAYER_INP), getattr(lib, _GET_LAYER_INP)
    except AttributeError:
        return None
    set_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool]
    set_fn.restype = None
    get_fn.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
    get_fn.restype = ctypes.c_void_p  # the address as an int: no pointer object per call
    return set_fn, get_fn


@lru_cache(maxsize=1)
def logits_ith_address() -> object:
    """llama_get_logits_ith returning the row's address as an int (a foreign function of its
    own, so llama_cpp's binding of the same symbol keeps its pointer restype)."""
    proto = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32)
    return proto(("llama_get_logits_ith", import_llama_cpp().llama_cpp._lib))


class LayerInputCapture:
    """Rows entering layer `lid` of a context, for every token of the last llama_decode."""

    def __init__(self, ctx: object, lid: int, n_embd: int, max_rows: int) -> None:
        api = layer_input_api()
        if api is None:
            raise RuntimeError("this llama.cpp build has no llama_set_embeddings_layer_inp")
        set_fn, self._get = api
        set_fn(ctx, lid, True)
        self._ctx, self._lid, self._n_embd, self._max_rows = ctx, lid, n_embd, max_rows
        self._view = FloatView()
        self.rows = 0

    def reset(self) -> None:
        """Forget rows of a previous call."""
        self.rows = 0

    def collect(self, n: int) -> np.ndarray:
        """Copy the n rows of the last decode (batch order) into a new [n, n_embd] array."""
        rows = self._view(self._get(self._ctx, self._lid), self._max_rows, self._n_embd)
        self.rows = n
        return (rows[:n] if n > 1 else self._view.first).copy()


class FloatView:
    """A numpy [rows, width] view of a C float buffer, remembered by address (building one
    costs ~10 µs; on the decode path every numpy or ctypes call runs with caches the model
    call just evicted, so a step makes as few of them as it can)."""

    def __init__(self) -> None:
        self._addr = 0
        self._view: np.ndarray | None = None
        self.first: np.ndarray | None = None  # the view's first row, as [1, width]
        self.flat: np.ndarray | None = None  # the whole buffer, 1-D

    def __call__(self, addr: int | None, rows: int, width: int) -> np.ndarray:
        if not addr:
            raise RuntimeError("llama.cpp returned no buffer")
        if addr != self._addr or self._view is None or self._view.shape != (rows, width):
            self.flat = np.ctypeslib.as_array((ctypes.c_float * (rows * width)).from_address(addr))
            self._view = self.flat.reshape(rows, width)
            self.first = self._view[:1]
            self._addr = addr
        return self._view
