"""jspec's CPU matmul kernels (`cpu_kernels.cc`): built on first use, called inside XLA programs.

    matmul(x [..., K], panels [N/32, K, 32]) -> [..., N]                 (fp32)
    matmul_int8(xq [M, K], panels [N/32, K/4, 32, 4], sums [N]) -> [M, N] (exact int32)
    matmul_f32s8(x [M, K], qpanels [N/32, K, 32] int8) -> [M, N]       (fp32 x int8)
    matmul_int4(xq [M, K], panels [N/32, K/32, 640]) -> [M, N]          (int8 x 4-bit blocks)

XLA CPU's own dot re-packs its weight operand on every call and does not
overlap those memory reads with the arithmetic, so a decode step, which
multiplies a few rows by every weight once, runs well below the memory
roof (docs/decisions.md, "Kernels"). The kernel reads weights stored
already packed in panels (`jspec.weights.Panels`) once, at nearly the
memory bandwidth, and is registered as an XLA FFI custom call so the
whole generation stays one compiled program.

It is compiled from source with the host's C++ compiler (`$CXX`, else
`c++`) for the host's CPU (-march=native) the first time a process asks
for it, into `<jspec cache>/kernels/<digest>/`, written to a temporary
file and renamed, so a half-written library is never loaded. Where that
cannot be done (no compiler, a compiler that runs past `build_timeout()`,
JSPEC_CPU_KERNELS=0) `available()` says no, with the reason in
`unavailable_reason()`, and models are prepared for XLA's own dot instead
(`jspec.bundle.prepare`); kernel panels still run everywhere, through an
einsum. The int8 kernel needs AVX-512 VNNI or, a slower variant, AVX2
(`int8_kind()`); without either the draft keeps XLA's int8 dot.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import importlib.metadata
import os
import pathlib
import platform
import shlex
import signal
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jspec import fetch

PANEL = 32  # output columns per panel: the kernel's tile width
GROUP = 4  # k per int8 lane (`vpdpbusd`)
TARGET = "jspec_gemm_f32"  # the FFI target names inside compiled programs
TARGET_INT8 = "jspec_gemm_i8"  # u8 x s8, AVX-512 VNNI
TARGET_S8 = "jspec_gemm_s8"  # s8 x s8, AVX2
TARGET_BLK = "jspec_gemm_blk"  # f32 x int8 blocks with scales and offsets (`matmul_blocks`)
TARGET_BLK_SYM = "jspec_gemm_blk_sym"  # the same without offsets
TARGET_BLK4 = "jspec_gemm_blk4"  # the same with q in [0, 15] stored two per byte
TARGET_BLK4_SYM = "jspec_gemm_blk4_sym"
TARGET_BF16 = "jspec_gemm_bf16"  # f32 x bf16 panels widened exactly (`matmul_bf16`)
TARGET_BLK_MANY = "jspec_gemm_blk_many"  # several block matrices, one x (`matmul_blocks_many`)
TARGET_BLK_FORMS = "jspec_gemm_blk_forms"  # a layer's blocks among layers of other forms
TARGET_INT8_MANY = "jspec_gemm_i8_many"  # several int8 matrices, one x (`matmul_int8_many`)
TARGET_S8_MANY = "jspec_gemm_s8_many"
TARGET_INT4 = "jspec_gemm_i4"  # s8 x 4-bit blocks, the 4-bit draft (`cpu_int4.cc`)
TARGET_INT4_MANY = "jspec_gemm_i4_many"
# The same products with the weight picked from one buffer per layer (`LayerPick`).
LAYER_TARGETS = {t: t + "_layer" for t in (TARGET, TARGET_INT8, TARGET_S8, TARGET_BLK,
                                           TARGET_BLK_SYM, TARGET_BLK4, TARGET_BLK4_SYM,
                                           TARGET_BF16, TARGET_INT4)}
TARGET_ATTEND = "jspec_attend_f32"  # decode attention over the cache (`jspec.cpu_attention`)
TARGET_F32S8 = "jspec_gemm_f32s8"  # f32 x s8 -> f32, the greedy head's estimate (`jspec.greedy_head`)
TARGETS = (TARGET, TARGET_INT8, TARGET_S8, *LAYER_TARGETS.values(), TARGET_ATTEND, TARGET_F32S8,
           TARGET_BLK, TARGET_BLK_SYM, TARGET_BLK4, TARGET_BLK4_SYM, TARGET_BF16, TARGET_BLK_MANY,
           TARGET_BLK_FORMS, TARGET_INT8_MANY, TARGET_S8_MANY, TARGET_INT4, TARGET_INT4_MANY)
SOURCE = pathlib.Path(__file__).with_name("cpu_kernels.cc")
# The attention and 4-bit draft kernels, built into the same library; the sources include the
# thread and FFI helpers of HEADERS.
OTHER_SOURCES = (pathlib.Path(__file__).with_name("cpu_attention.cc"),
                 pathlib.Path(__file__).with_name("cpu_int4.cc"))
HEADERS = (pathlib.Path(__file__).with_name("cpu_threads.h"),
           pathlib.Path(__file__).with_name("cpu_ffi.h"))
_SYMBOLS = {TARGET: "JspecGemmF32", TARGET_INT8: "JspecGemmI8", TARGET_S8: "JspecGemmS8",
            LAYER_TARGETS[TARGET]: "JspecGemmF32Layer", LAYER_TARGETS[TARGET_INT8]: "JspecGemmI8Layer",
            LAYER_TARGETS[TARGET_S8]: "JspecGemmS8Layer", TARGET_ATTEND: "JspecAttendF32",
            TARGET_F32S8: "JspecGemmF32S8", TARGET_BLK: "JspecGemmBlk",
            TARGET_BLK_SYM: "JspecGemmBlkSym", LAYER_TARGETS[TARGET_BLK]: "JspecGemmBlkLayer",
            LAYER_TARGETS[TARGET_BLK_SYM]: "JspecGemmBlkSymLayer", TARGET_BLK4: "JspecGemmBlk4",
            TARGET_BLK4_SYM: "JspecGemmBlk4Sym", LAYER_TARGETS[TARGET_BLK4]: "JspecGemmBlk4Layer",
            LAYER_TARGETS[TARGET_BLK4_SYM]: "JspecGemmBlk4SymLayer", TARGET_BF16: "JspecGemmBf16",
            LAYER_TARGETS[TARGET_BF16]: "JspecGemmBf16Layer", TARGET_BLK_MANY: "JspecGemmBlkMany",
            TARGET_BLK_FORMS: "JspecGemmBlkForms",
            TARGET_INT8_MANY: "JspecGemmI8Many", TARGET_S8_MANY: "JspecGemmS8Many",
            TARGET_INT4: "JspecGemmI4", LAYER_TARGETS[TARGET_INT4]: "JspecGemmI4Layer",
            TARGET_INT4_MANY: "JspecGemmI4Many"}
_FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC")
# How long the compiler may run before jspec gives up on the kernels for
# this process and uses XLA's dot. On the 2-core host the build took 19 s
# alone and 40 s with two at once (the test workers' first use), with the
# machine's load average at 9-10; a compiler that hangs stalled generation
# for the 300 s the limit was before. JSPEC_KERNEL_BUILD_TIMEOUT overrides it
# (seconds); see docs/decisions-reliability.md.
BUILD_TIMEOUT_S = 120.0
_LIBRARY = None  # the loaded library: kept referenced so it is never unloaded


def packable(kernel_shape: tuple) -> bool:
  """Whether an [in, out] matrix can be stored in panels: out a multiple of `PANEL`.

  Args:
    kernel_shape: the matrix's [in, out] shape.

  Returns:
    True if `pack` accepts it.
  """
  return len(kernel_shape) == 2 and kernel_shape[1] % PANEL == 0


def pack(kernel: jax.Array) -> jax.Array:
  """An [in, out] matrix as panels of `PANEL` output columns, each contiguous.

  Args:
    kernel: [K, N] with N a multiple of `PANEL`.

  Returns:
    [N / PANEL, K, PANEL], a new array.

  Raises:
    ValueError: N is not a multiple of `PANEL`.
  """
  k, n = kernel.shape
  if n % PANEL:
    raise ValueError(f"cannot pack a [{k}, {n}] matrix: its {n} columns are not a multiple of {PANEL}")
  return _pack(jnp.asarray(kernel))


def unpack(panels: jax.Array) -> jax.Array:
  """The inverse of `pack`: [N / PANEL, K, PANEL] -> [K, N], a new array."""
  return _unpack(jnp.asarray(panels))


# Jitted so that each is one copy: converting a model's weights then needs
# room for one more matrix, not for a chain of temporaries (peak memory is
# part of the bench's budget).
@jax.jit
def _pack(kernel: jax.Array) -> jax.Array:  # [K, N] -> [N/32, K, 32]
  k, n = kernel.shape
  return kernel.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)


@jax.jit
def _unpack(panels: jax.Array) -> jax.Array:  # [N/32, K, 32] -> [K, N]
  p, k, width = panels.shape
  return panels.transpose(1, 0, 2).reshape(k, p * width)


def pack_table(table: jax.Array) -> jax.Array:
  """An output table [V, D] (token embedding and head) as the panels of its head, [D, V].

  Args:
    table: [V, D] with V a multiple of `PANEL`.

  Returns:
    [V / PANEL, D, PANEL]; token v's embedding is `[v // PANEL, :, v % PANEL]`.
  """
  v, d = table.shape
  if v % PANEL:
    raise ValueError(f"cannot pack a [{v}, {d}] table: its {v} rows are not a multiple of {PANEL}")
  return _pack_table(jnp.asarray(table))


def unpack_table(panels: jax.Array) -> jax.Array:
  """The inverse of `pack_table`: [V / PANEL, D, PANEL] -> [V, D], a new array."""
  return _unpack_table(jnp.asarray(panels))


@jax.jit
def _pack_table(table: jax.Array) -> jax.Array:  # [V, D] -> [V/32, D, 32]
  return _pack(table.T)  # a table is an [out, in] matrix: its head's kernel is table.T


@jax.jit
def _unpack_table(panels: jax.Array) -> jax.Array:  # [V/32, D, 32] -> [V, D]
  return _unpack(panels).T


class LayerPick:
  """One layer's weight out of per-layer buffers, chosen by a traced layer index.

  A `lax.scan` over layers (`jspec.model`) hands this to the kernels in
  place of a weight: they take every layer's buffer and the index, and
  read the chosen one where it lies. Slicing a stacked [L, ...] weight in
  the loop would copy it first (docs/decisions.md, "Layer loop").

  Attributes:
    weights: one array per layer, all of one shape and dtype.
    index: [] int32 layer.
  """

  def __init__(self, weights: tuple[jax.Array, ...], index: jax.Array):
    self.weights = tuple(weights)
    self.index = index
    kinds = {(tuple(w.shape), jnp.dtype(w.dtype)) for w in self.weights}
    if len(kinds) != 1:  # the kernel would read every layer with the first one's shape
      raise ValueError(f"LayerPick: the layers' buffers differ in shape or dtype {sorted(kinds)}; "
                       "make them one stored form first (jspec.weights.uniform)")

  @property
  def shape(self) -> tuple[int, ...]:
    return self.weights[0].shape

  @property
  def dtype(self):
    return self.weights[0].dtype

  def value(self) -> jax.Array:
    """The chosen layer's weight as an array (a copy: for the fallbacks without the kernel)."""
    return jax.lax.switch(self.index, [lambda w=w: w for w in self.weights])


def _call(target: str, out_type, x: jax.Array, panels, **attrs) -> jax.Array:
  """The FFI call of `target` with `attrs` (of its layer variant when `panels` is a `LayerPick`)."""
  if isinstance(panels, LayerPick):
    return jax.ffi.ffi_call(LAYER_TARGETS[target], out_type)(
        x, panels.index.astype(jnp.int32), *panels.weights, **attrs)
  return jax.ffi.ffi_call(target, out_type)(x, panels, **attrs)


def matmul(x: jax.Array, panels: jax.Array) -> jax.Array:
  """x @ W for W stored as panels: [..., K] x [N/32, K, 32] -> [..., N], in x's dtype.

  Runs the kernel when it is available, x and W are float32 and the
  program runs on CPU; otherwise an einsum that gives the same product.

  Args:
    x: [..., K] activations.
    panels: W [K, N] as `pack` returns it, or a `LayerPick` of such.

  Returns:
    [..., N].
  """
  lead, k = x.shape[:-1], x.shape[-1]
  p, _, width = panels.shape
  rows = x.reshape(-1, k)  # [M, K]
  if (x.dtype == jnp.float32 and panels.dtype == jnp.float32 and available()
      and jax.default_backend() == "cpu"):
    out_type = jax.ShapeDtypeStruct((rows.shape[0], p * width), jnp.float32)
    y = _call(TARGET, out_type, rows, panels)
  else:
    if isinstance(panels, LayerPick):
      panels = panels.value()
    y = jnp.einsum("mk,pkw->mpw", rows, panels).reshape(rows.shape[0], p * width)
  return y.reshape(*lead, p * width)


def available() -> bool:
  """Whether the kernel is built, loaded and registered (building it on first call).

  Returns:
    True when `matmul` runs the kernel on CPU.
  """
  return _load() is None


_ANY_ORDER = contextvars.ContextVar("jspec_any_order", default=False)


@contextlib.contextmanager
def any_order():
  """Block and bfloat16 products traced inside may sum a row in an order other than a step's.

  Everywhere else a row's product is bit for bit the same whichever rows
  share the call, so a verify row equals the target-only step's. A prefill
  chunk needs no such equality (every mode prefills alike), and from 16
  rows on an AMX host its block and bfloat16 products take the tiles (`amx_available`),
  which multiply faster than the FMAs (docs/decisions-compact.md, "AMX
  for prefill chunks"). It acts at trace time, like `jax.named_scope`.

  Yields:
    None.
  """
  token = _ANY_ORDER.set(True)
  try:
    yield
  finally:
    _ANY_ORDER.reset(token)


def amx_available() -> bool:
  """Whether block and bfloat16 products under `any_order` take AMX tiles here.

  Returns:
    True where the kernels are built with AMX (the host has AMX-BF16) and
    the system lets this process use the tiles.
  """
  return available() and bool(_LIBRARY.JspecHaveAmx())


def int8_kind() -> Optional[str]:
  """Which int8 kernel `matmul_int8` runs on this host's CPU, if any.

  Returns:
    "vnni" (AVX-512 VNNI: four u8 x s8 products per instruction), "avx2"
    (s8 x s8 through 16-bit pair sums, about four instructions for the
    same work: still reading a quarter of float32's bytes), or None (XLA's
    int8 dot).
  """
  kinds = int8_kinds()
  return kinds[0] if kinds else None


def int8_kinds() -> tuple[str, ...]:
  """Every int8 kernel built for this host, the preferred (`int8_kind`) first.

  Returns:
    A subset of ("vnni", "avx2"): an AVX-512 VNNI host has both.
  """
  if not available():
    return ()
  return tuple(kind for kind, have in (("vnni", _LIBRARY.JspecHaveInt8()),
                                       ("avx2", _LIBRARY.JspecHaveS8())) if have)


def int8_available() -> bool:
  """Whether an int8 kernel runs on this host (`int8_kind` is not None).

  Returns:
    True when `matmul_int8` runs one of jspec's kernels on CPU.
  """
  return int8_kind() is not None


PACK_SLICE_BYTES = 8 << 20  # int8 bytes of q packed per call (`pack_int8`)


def pack_int8(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  """An int8 [out, in] matrix as the int8 kernel's panels, with its row sums.

  Args:
    q: [N, K] int8, N a multiple of `PANEL`; K is zero-padded to a multiple
      of `GROUP`.

  Returns:
    (panels [N / 32, ceil(K / 4), 32, 4] int8, where panels[p, g, n, j] is
    q[32 p + n, 4 g + j]; sums [N] int32, the sum of each row of q).

  Raises:
    ValueError: N is not a multiple of `PANEL`.
  """
  n, k = q.shape
  if n % PANEL:
    raise ValueError(f"cannot pack a [{n}, {k}] int8 matrix: its {n} rows are not a multiple of {PANEL}")
  # A tall matrix (a vocabulary table or head) in slices of whole panels: each
  # panel and row sum depends on its own rows alone, and loading then holds
  # one slice's temporaries, not the whole matrix's.
  step = max(PANEL, PACK_SLICE_BYTES // max(k, 1) // PANEL * PANEL)
  if step >= n:
    return _pack_int8(jnp.asarray(q))
  panels = np.empty((n // PANEL, -(-k // GROUP), PANEL, GROUP), np.int8)
  sums = np.empty((n,), np.int32)
  for a in range(0, n, step):
    b = min(a + step, n)
    part, part_sums = _pack_int8(jnp.asarray(q[a:b]))
    panels[a // PANEL:b // PANEL], sums[a:b] = np.asarray(part), np.asarray(part_sums)
  return jnp.asarray(panels), jnp.asarray(sums)


@jax.jit
def _pack_int8(q: jax.Array) -> tuple[jax.Array, jax.Array]:
  n, k = q.shape
  padded = jnp.pad(q, ((0, 0), (0, -k % GROUP)))  # [N, Kp]
  panels = padded.reshape(n // PANEL, PANEL, -1, GROUP).transpose(0, 2, 1, 3)
  return panels, jnp.sum(q.astype(jnp.int32), axis=1)


def unpack_int8(panels: jax.Array, k: int) -> jax.Array:
  """The inverse of `pack_int8`'s panels: [N / 32, Kp / 4, 32, 4] -> [N, k] int8."""
  p, groups, width, group = panels.shape
  return jnp.asarray(panels).transpose(0, 2, 1, 3).reshape(p * width, groups * group)[:, :k]


def matmul_int8(xq: jax.Array, panels: jax.Array, sums: jax.Array) -> jax.Array:
  """xq @ q.T in int32 for q stored by `pack_int8`: [M, K] int8 -> [M, N] int32.

  The VNNI kernel multiplies unsigned by signed bytes, so xq is shifted by
  128 into [1, 255] and 128 * (row sums of q) taken off again: exact. The
  AVX2 one takes xq as it is.

  Args:
    xq: [M, K] int8 activations (symmetric, so in [-127, 127]).
    panels, sums: q as `pack_int8` returns it (panels may be a `LayerPick`).

  Returns:
    [M, N] int32, equal to the int32 product.
  """
  m, k = xq.shape
  p, groups, width, group = panels.shape
  kind = int8_kind() if jax.default_backend() == "cpu" else None
  out_type = jax.ShapeDtypeStruct((m, p * width), jnp.int32)
  pad = ((0, 0), (0, groups * group - k))  # zeros meet zero weights
  if kind == "vnni":
    shifted = jnp.pad((xq.astype(jnp.int32) + 128).astype(jnp.uint8), pad)
    acc = _call(TARGET_INT8, out_type, shifted, panels)
    return acc - 128 * sums[None, :]
  if kind == "avx2":
    return _call(TARGET_S8, out_type, jnp.pad(xq, pad), panels)
  if isinstance(panels, LayerPick):
    panels = panels.value()
  q = unpack_int8(panels, k)  # [N, K]
  return jax.lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)


def matmul_blocks_forms(x: jax.Array, groups, form: jax.Array, local: jax.Array) -> jax.Array:
  """x @ W for the layer loop's W when its layers are blocks of different forms.

  A GGUF file may keep one matrix in different k-quants from layer to layer
  (Q4_K_M: `ffn_down` in Q6_K in some layers, Q4_K in the rest). Each form's
  layers are one group of `LayerPick`s, and the layer is group `form`'s
  `local`-th: `jspec_gemm_blk_forms` reads it where it lies, in its own form
  (the output is `matmul_blocks`' on that layer's arrays, bit for bit).
  Where the kernel would not run, a `lax.switch` over the groups.

  Args:
    x: [..., K] float32 activations.
    groups: per form, (qpanels, spanels, opanels or None), each a `LayerPick`
      over that form's layers whose index is `local`.
    form: [] int32 the layer's group.
    local: [] int32 the layer's index in its group.

  Returns:
    [..., N] float32.
  """
  lead, k = x.shape[:-1], x.shape[-1]
  rows = x.reshape(-1, k)  # [M, K]
  n = groups[0][0].shape[0] * groups[0][0].shape[2]
  forms = [blocks_form(*group) for group in groups]
  if (x.dtype == jnp.float32 and all(f[0] == k and f[1] in BLOCK_SIZES for f in forms)
      and available() and jax.default_backend() == "cpu"):
    buffers = [b for group in groups for w in group if w is not None for b in w.weights]
    y = jax.ffi.ffi_call(TARGET_BLK_FORMS, jax.ShapeDtypeStruct((rows.shape[0], n), jnp.float32))(
        rows, form.astype(jnp.int32), local.astype(jnp.int32), *buffers,
        layers=np.asarray([len(group[0].weights) for group in groups], np.int64),
        nibbles=np.asarray([f[2] for f in forms], np.int64),
        offsets=np.asarray([f[3] for f in forms], np.int64), any_order=_ANY_ORDER.get())
  else:
    y = jax.lax.switch(form, [lambda group=group: matmul_blocks(rows, *group) for group in groups])
  return y.reshape(*lead, n)


def matmul_int8_many(xq: jax.Array, parts) -> list[jax.Array]:
  """xq @ q_j.T for several int8 matrices over the same xq, in one kernel call.

  As `matmul_blocks_many` for the int8 kernels: each output is
  `matmul_int8(xq, *part)`'s, exactly. Without an int8 kernel, or where the
  parts are not all arrays or all `LayerPick`s of one layer count, each
  part is its own product.

  Args:
    xq: [M, K] int8 activations.
    parts: (panels, sums) per matrix, as `matmul_int8` takes them.

  Returns:
    [M, N_j] int32 per part, in order.
  """
  m, k = xq.shape
  kind = int8_kind() if jax.default_backend() == "cpu" else None
  counts = {len(panels.weights) if isinstance(panels, LayerPick) else 0 for panels, _ in parts}
  groups = {panels.shape[1] for panels, _ in parts}
  if len(parts) < 2 or kind is None or len(counts) != 1 or len(groups) != 1:
    return [matmul_int8(xq, *part) for part in parts]
  layers = counts.pop()
  widths = [panels.shape[0] * panels.shape[2] for panels, _ in parts]
  buffers, index = [], jnp.zeros((), jnp.int32)
  for panels, _ in parts:
    if layers:
      buffers.extend(panels.weights)
      index = panels.index.astype(jnp.int32)
    else:
      buffers.append(panels)
  pad = ((0, 0), (0, groups.pop() * GROUP - k))  # zeros meet zero weights
  out_type = jax.ShapeDtypeStruct((m, sum(widths)), jnp.int32)
  if kind == "vnni":
    x_in, target = jnp.pad((xq.astype(jnp.int32) + 128).astype(jnp.uint8), pad), TARGET_INT8_MANY
  else:
    x_in, target = jnp.pad(xq, pad), TARGET_S8_MANY
  acc = jax.ffi.ffi_call(target, out_type)(x_in, index, *buffers, parts=len(parts),
                                           layers=max(layers, 1))
  outs, start = [], 0
  for (_, sums), n in zip(parts, widths):
    part = acc[:, start:start + n]
    outs.append(part - 128 * sums[None, :] if kind == "vnni" else part)
    start += n
  return outs


INT4_BLOCK = 32  # inputs per scale and offset of a 4-bit draft matrix
INT4_BLOCK_BYTES = 640  # a panel's block: 512 bytes of q, then 32 scales and 32 offsets (float16)


def int4_available() -> bool:
  """Whether `matmul_int4` runs jspec's kernel here (AVX-512 VNNI, on CPU).

  Returns:
    False where the kernels are not built, the host lacks AVX-512 VNNI, or
    the default backend is not the CPU.
  """
  return (jax.default_backend() == "cpu" and available()
          and bool(_LIBRARY.JspecHaveInt4()))


def pack_int4(q: jax.Array, scale: jax.Array, offset: jax.Array) -> jax.Array:
  """A 4-bit matrix W[k, n] = scale[n, k // 32] * q[n, k] + offset[n, k // 32] as the kernel's panels.

  Byte b of lane l of the 64 bytes at 128 c + 64 h of block j holds output
  16 h + l's q at input 32 j + 8 c + b (low nibble) and 32 j + 8 c + 4 + b
  (high nibble), the layout `vpdpbusd` reads four inputs a lane in
  (`cpu_int4.cc`); the block's 32 scales, then its 32 offsets, follow as
  float16 (rounded to it here).

  Args:
    q: [N, K] integers in [0, 15]; N a multiple of `PANEL`, K of `INT4_BLOCK`.
    scale, offset: [N, K / 32] float.

  Returns:
    [N / 32, K / 32, 640] uint8.

  Raises:
    ValueError: N or K is not a multiple of 32.
  """
  n, k = q.shape
  if n % PANEL or k % INT4_BLOCK:
    raise ValueError(f"cannot pack a [{n}, {k}] 4-bit matrix: expected outputs and inputs "
                     f"multiples of {PANEL}")
  return _pack_int4(jnp.asarray(q), jnp.asarray(scale), jnp.asarray(offset))


@jax.jit
def _pack_int4(q, scale, offset):  # [N, K], [N, J], [N, J] -> [N/32, J, 640]
  n, k = q.shape
  p, j = n // PANEL, k // INT4_BLOCK
  q = q.astype(jnp.uint8).reshape(p, 2, 16, j, 4, 2, 4)  # (p, h, l, j, c, nibble, b)
  byte = q[..., 0, :] | (q[..., 1, :] << 4)  # (p, h, l, j, c, b)
  nibbles = byte.transpose(0, 3, 4, 1, 2, 5).reshape(p, j, 512)  # (p, j, c, h, l, b)

  def halves(a):  # [N, J] -> [P, J, 64] bytes of float16, output order
    a = a.astype(jnp.float16).reshape(p, PANEL, j).transpose(0, 2, 1)
    return jax.lax.bitcast_convert_type(a, jnp.uint8).reshape(p, j, 2 * PANEL)

  return jnp.concatenate([nibbles, halves(scale), halves(offset)], axis=-1)


def unpack_int4(panels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The inverse of `pack_int4`: panels -> (q [N, K] uint8, scale [N, K/32], offset [N, K/32] float32)."""
  panels = jnp.asarray(panels)
  p, j, _ = panels.shape
  byte = panels[..., :512].reshape(p, j, 4, 2, 16, 4).transpose(0, 3, 4, 1, 2, 5)  # (p,h,l,j,c,b)
  q = jnp.stack([byte & 15, byte >> 4], axis=-2)  # (p, h, l, j, c, nibble, b)
  q = q.reshape(p * PANEL, j * INT4_BLOCK)

  def floats(a):  # [P, J, 64] bytes -> [N, J] float32
    a = jax.lax.bitcast_convert_type(a.reshape(p, j, PANEL, 2), jnp.float16)
    return a.astype(jnp.float32).transpose(0, 2, 1).reshape(p * PANEL, j)

  return q, floats(panels[..., 512:576]), floats(panels[..., 576:640])


def _int4_reference(xq: jax.Array, panels) -> jax.Array:
  """`matmul_int4`'s sums without the kernel: each block's exact int32 sums, scaled in float32."""
  if isinstance(panels, LayerPick):
    panels = panels.value()
  q, scale, offset = unpack_int4(panels)
  m, k = xq.shape
  blocks = xq.astype(jnp.int32).reshape(m, k // INT4_BLOCK, INT4_BLOCK)  # [M, J, 32]
  qb = q.astype(jnp.int32).reshape(q.shape[0], k // INT4_BLOCK, INT4_BLOCK)  # [N, J, 32]
  sums = jnp.einsum("mjb,njb->mnj", blocks, qb).astype(jnp.float32)  # [M, N, J]
  xsum = jnp.sum(blocks, axis=-1).astype(jnp.float32)  # [M, J]
  return jnp.sum(sums * scale[None] + xsum[:, None, :] * offset[None], axis=-1)


def matmul_int4(xq: jax.Array, panels) -> jax.Array:
  """xq @ W without xq's row scales, for W stored by `pack_int4`: [M, K] int8 -> [M, N] float32.

  y[m, n] = sum over blocks j of scale[n, j] * (q[n, j] . xq[m, j]) +
  offset[n, j] * sum(xq[m, j]): each block's sums exact in int32, then
  scaled in float32. The kernel where it runs (`int4_available`), else the
  same in XLA (equal up to the float32 sums' order).

  Args:
    xq: [M, K] int8 activations.
    panels: as `pack_int4` returns them, or a `LayerPick` of such.

  Returns:
    [M, N] float32.
  """
  m, _ = xq.shape
  if not int4_available():
    return _int4_reference(xq, panels)
  out_type = jax.ShapeDtypeStruct((m, panels.shape[0] * PANEL), jnp.float32)
  return _call(TARGET_INT4, out_type, xq, panels)


def matmul_int4_many(xq: jax.Array, parts) -> list[jax.Array]:
  """`matmul_int4` of several matrices over the same xq, in one kernel call.

  Each output is `matmul_int4(xq, part)`'s, bit for bit. Without the kernel,
  or where the parts are not all arrays or all `LayerPick`s of one layer
  count, each part is its own product.

  Args:
    xq: [M, K] int8 activations.
    parts: panels per matrix (arrays or `LayerPick`s), as `matmul_int4` takes them.

  Returns:
    [M, N_j] float32 per part, in order.
  """
  m, _ = xq.shape
  counts = {len(w.weights) if isinstance(w, LayerPick) else 0 for w in parts}
  if len(parts) < 2 or not int4_available() or len(counts) != 1:
    return [matmul_int4(xq, w) for w in parts]
  layers = counts.pop()
  widths = [w.shape[0] * PANEL for w in parts]
  buffers, index = [], jnp.zeros((), jnp.int32)
  for w in parts:
    if layers:
      buffers.extend(w.weights)
      index = w.index.astype(jnp.int32)
    else:
      buffers.append(w)
  out_type = jax.ShapeDtypeStruct((m, sum(widths)), jnp.float32)
  y = jax.ffi.ffi_call(TARGET_INT4_MANY, out_type)(xq, index, *buffers, parts=len(parts),
                                                  layers=max(layers, 1))
  return list(jnp.split(y, np.cumsum(widths)[:-1], axis=1))


def matmul_f32s8(x: jax.Array, qpanels: jax.Array) -> jax.Array:
  """x @ Q for an int8 Q stored as panels, in float32: [M, K] x [N/32, K, 32] -> [M, N].

  The kernel (`jspec_gemm_f32s8`) where it runs, else an einsum over Q in
  float32. The two sum in different orders: callers that need the result
  exactly bound its rounding (`jspec.greedy_head`).

  Args:
    x: [M, K] float32.
    qpanels: [N/32, K, 32] int8, laid out as `pack` lays out a float [K, N].

  Returns:
    [M, N] float32.
  """
  m, k = x.shape
  p, _, width = qpanels.shape
  if available() and jax.default_backend() == "cpu":
    out_type = jax.ShapeDtypeStruct((m, p * width), jnp.float32)
    return jax.ffi.ffi_call(TARGET_F32S8, out_type)(x, qpanels)
  return jnp.einsum("mk,pkw->mpw", x, qpanels.astype(jnp.float32)).reshape(m, p * width)


def unavailable_reason() -> Optional[str]:
  """Why `available()` is False, or None when it is True."""
  return _load()


@functools.lru_cache(maxsize=1)
def _load() -> Optional[str]:
  """Builds (if needed), loads and registers the kernel once per process.

  Returns:
    None on success, else the reason it is not available.
  """
  global _LIBRARY
  if os.environ.get("JSPEC_CPU_KERNELS", "1") == "0":
    return "turned off by JSPEC_CPU_KERNELS=0"
  try:
    path = build()
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in _SYMBOLS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform="cpu")
  except BuildTimeout as err:
    return str(err)
  except (OSError, subprocess.SubprocessError, AttributeError, RuntimeError) as err:
    return f"{type(err).__name__}: {err}"
  _LIBRARY = library
  return None


class BuildTimeout(RuntimeError):
  """The compiler ran past `build_timeout()`: it was stopped, and the kernels are not built."""


def build_timeout() -> float:
  """How many seconds the kernels' compile may take, so that a hanging compiler cannot stall a run.

  Returns:
    JSPEC_KERNEL_BUILD_TIMEOUT when set, else `BUILD_TIMEOUT_S`.

  Raises:
    RuntimeError: JSPEC_KERNEL_BUILD_TIMEOUT is not a number of seconds > 0.
  """
  text = os.environ.get("JSPEC_KERNEL_BUILD_TIMEOUT", "").strip()
  if not text:
    return BUILD_TIMEOUT_S
  try:
    seconds = float(text)
  except ValueError:
    seconds = float("nan")
  if not seconds > 0 or seconds == float("inf"):
    raise RuntimeError(f"JSPEC_KERNEL_BUILD_TIMEOUT={text!r}: expected a number of seconds > 0")
  return seconds


def _run_compiler(command: list[str], timeout: float) -> subprocess.CompletedProcess:
  """Runs the compiler in a process group of its own, killed whole (cc1plus too) at the timeout."""
  proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  try:
    out, err = proc.communicate(timeout=timeout)
  except BaseException:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
      pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
      pipe.close()
    raise
  return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _compiler() -> list[str]:
  return shlex.split(os.environ.get("CXX", "c++"))


def _host_cpu() -> str:
  """What -march=native compiles for: the CPU model and its feature flags."""
  try:
    lines = pathlib.Path("/proc/cpuinfo").read_text().splitlines()
  except OSError:
    return platform.processor() or platform.machine()
  wanted = [line for line in lines if line.startswith(("model name", "flags"))]
  return "\n".join(wanted[:2])


def build(source: pathlib.Path = SOURCE) -> pathlib.Path:
  """The compiled library for this source, compiler, jaxlib and CPU, compiling it if missing.

  The library also holds `OTHER_SOURCES`, as they are in this tree; both
  find `HEADERS` in this directory.

  Args:
    source: the matmul kernels' C++ file (another revision of it: `bench.tools.kernel_ab`).

  Returns:
    Path of the shared library.

  Raises:
    OSError: no compiler could be run.
    BuildTimeout: the compiler ran past `build_timeout()` and was stopped.
    RuntimeError: the compile failed (the compiler's output is in the message).
  """
  include = jax.ffi.include_dir()
  digest = hashlib.sha256()
  sources = (source, *OTHER_SOURCES)
  texts = [path.read_bytes() for path in sources + HEADERS]
  for part in (*texts, " ".join(_compiler() + list(_FLAGS)).encode(),
               importlib.metadata.version("jaxlib").encode(), _host_cpu().encode()):
    digest.update(part + b"\0")
  directory = fetch.cache_dir() / "kernels" / digest.hexdigest()[:24]
  path = directory / "libjspec_cpu_kernels.so"
  if path.exists():
    return path
  timeout = build_timeout()
  directory.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=directory, suffix=".so.tmp")
  os.close(fd)
  try:
    command = (_compiler() + list(_FLAGS) + ["-I", include, "-I", str(SOURCE.parent)]
               + [str(path) for path in sources] + ["-o", tmp])
    try:
      done = _run_compiler(command, timeout)
    except subprocess.TimeoutExpired:
      raise BuildTimeout(f"compiler timed out after {timeout:g} s: {shlex.join(command[:1])}, "
                         "stopped; JSPEC_KERNEL_BUILD_TIMEOUT sets the limit") from None
    if done.returncode != 0:
      names = ", ".join(path.name for path in sources)
      raise RuntimeError(f"compiling {names} failed ({shlex.join(command)}): "
                         f"{(done.stderr or done.stdout)[-2000:]}")
    os.replace(tmp, path)  # atomic: another process sees all of it or none
  finally:
    pathlib.Path(tmp).unlink(missing_ok=True)
  return path


# --- int8 block weights (`convert.gguf_blocks`): the compact target ---

BLOCK_SIZES = (16, 32)  # weights per scale that `jspec_gemm_blk` takes
NIBBLE_MAX = 15  # q in [0, NIBBLE_MAX] (Q4_K, Q4_1, Q2_K) is stored two to a byte
SUPER = 256  # inputs per super-block of factored scales (a K-quant's d)
D_ROWS = 4  # panel rows of bytes that hold a super-block's 32 float32 d
# Scale pivots tried first by `factor_scales`, the ones k-quant quantizers
# give a super-block's largest scale (Q4_K's 6-bit 63, Q6_K's -128); every
# other int8 follows.
_PIVOTS = (63, -128, 127, 31, 15, -32, -64)


def factor_scales(scale: np.ndarray, block: int) -> Optional[tuple[np.ndarray, np.ndarray]]:
  """Block scales as d * sc exactly: a float32 d per `SUPER` inputs and an int8 sc per block.

  A K-quant defines each block's scale as the float32 product of its
  super-block's float16 d and a small integer (Q4_K: d * sc, sc in [0, 63],
  and its offsets -(dmin * m)); stored so, the scales take a byte per block
  instead of four. Found from the float scales alone: the largest scale of a
  super-block is d * n for its own integer n, so d = scale / n exactly for
  the right n, tried over every int8 n; any (d, sc) whose products give every
  scale's bits is as good as the file's.

  Args:
    scale: [N, J] float32 block scales (or offsets), J blocks of `block` inputs.
    block: inputs per block.

  Returns:
    (sc [N, J] int8, d [N, J * block / SUPER] float32) with
    float32(d[n, j // R] * sc[n, j]) bitwise scale[n, j] (R = SUPER / block),
    or None where the inputs are not whole super-blocks or some super-block
    has no such factors.
  """
  scale = np.asarray(scale, np.float32)
  n, j = scale.shape
  if block <= 0 or SUPER % block or (j * block) % SUPER:
    return None
  r = SUPER // block
  groups = scale.reshape(n * j // r, r)  # [G, R]
  pivot = groups[np.arange(groups.shape[0]), np.argmax(np.abs(groups), axis=1)]  # [G]
  d = np.zeros(groups.shape[0], np.float32)
  sc = np.zeros(groups.shape, np.int8)
  todo = np.flatnonzero(pivot != 0)
  zero = np.flatnonzero(pivot == 0)  # every scale of the group is +-0: +0 times +-1
  sc[zero] = np.where(np.signbit(groups[zero]), -1, 1)
  tries = list(_PIVOTS) + [m for m in range(-128, 128) if m and m not in _PIVOTS]
  with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
    for m in tries:
      if not todo.size:
        break
      cand = pivot[todo] / np.float32(m)  # [T]
      ratio = groups[todo] / cand[:, None]  # [T, R]
      ints = np.rint(ratio)
      ok = (np.abs(ints) <= 127) | (ints == -128)
      ints = np.where(ok, ints, 0).astype(np.int8)
      back = cand[:, None] * ints.astype(np.float32)
      ok &= back.view(np.uint32) == groups[todo].view(np.uint32)
      good = ok.all(axis=1)
      d[todo[good]] = cand[good]
      sc[todo[good]] = ints[good]
      todo = todo[~good]
  back = d[:, None] * sc.astype(np.float32)
  if todo.size or not np.array_equal(back.view(np.uint32), groups.view(np.uint32)):
    return None
  return sc.reshape(n, j), d.reshape(n, j // r)


def pack_factored(sc: jax.Array, d: jax.Array) -> jax.Array:
  """Factored scales (`factor_scales`) as the block kernel's scale panels.

  Args:
    sc: [N, J] int8, N a multiple of `PANEL`.
    d: [N, G] float32, J a multiple of G.

  Returns:
    [N/32, G (4 + R), 32] int8 with R = J / G: super-block g's rows are its
    32 columns' d as float32 bytes (4 rows), then sc[32p + c, gR + i] at
    row 4 + i, column c (`jspec_gemm_blk`'s factored form).
  """
  n, j = sc.shape
  g = d.shape[1]
  r = j // g
  sc_p = _pack(jnp.asarray(sc).T).reshape(n // PANEL, g, r, PANEL)  # [P, G, R, 32]
  d_bytes = jax.lax.bitcast_convert_type(_pack(jnp.asarray(d, jnp.float32).T), jnp.int8)
  d_rows = d_bytes.reshape(n // PANEL, g, D_ROWS, PANEL)  # [P, G, 32, 4] bytes -> [P, G, 4, 32]
  return jnp.concatenate([d_rows, sc_p], axis=2).reshape(n // PANEL, g * (D_ROWS + r), PANEL)


def is_factored(spanels) -> bool:
  """Whether block scale panels (an array or a `LayerPick`) are factored int8 (`pack_factored`)."""
  return jnp.dtype(spanels.dtype) == jnp.int8


def block_size(k: int, spanels) -> int:
  """B, inputs per block, of scale panels over K inputs, in either form."""
  rows = spanels.shape[1]
  if not is_factored(spanels):
    return k // rows
  if k % SUPER or rows % (k // SUPER) or rows // (k // SUPER) <= D_ROWS:
    raise ValueError(f"factored scale panels {spanels.shape} do not fit {k} inputs")
  return SUPER // (rows // (k // SUPER) - D_ROWS)


def _factored_parts(spanels: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Factored scale panels over K inputs as (d [P, G, 32] float32, sc [P, G, R, 32] int8)."""
  p, rows, width = spanels.shape
  g = k // SUPER
  parts = spanels.reshape(p, g, rows // g, width)  # [P, G, 4 + R, 32]
  d_bytes = parts[:, :, :D_ROWS, :].reshape(p, g, width, 4)
  return jax.lax.bitcast_convert_type(d_bytes, jnp.float32), parts[:, :, D_ROWS:, :]


def scale_values(spanels: jax.Array, k: int) -> jax.Array:
  """Scale (or offset) panels of either form as float32 [P, K/B, 32], exactly (`pack_factored`)."""
  if not is_factored(spanels):
    return spanels
  d, sc = _factored_parts(spanels, k)  # [P, G, 32], [P, G, R, 32]
  p, g, r, width = sc.shape
  return (sc.astype(jnp.float32) * d[:, :, None, :]).reshape(p, g * r, width)


def scale_columns(spanels: jax.Array, k: int, p: jax.Array, c: jax.Array) -> jax.Array:
  """The scales (or offsets) of outputs 32p + c, float32, read from panels of either form.

  Args:
    spanels: [P, K/B, 32] float32 or factored int8 (`pack_factored`).
    k: K, the inputs.
    p, c: [...] int32 panel and column of each output.

  Returns:
    [..., K/B] float32: only the chosen outputs' scales are widened.
  """
  if not is_factored(spanels):
    return spanels[p, :, c]
  d, sc = _factored_parts(spanels, k)  # [P, G, 32], [P, G, R, 32]
  picked = sc[p, :, :, c].astype(jnp.float32) * d[p, :, c][..., None]  # [..., G, R]
  return picked.reshape(*p.shape, -1)


def pack_blocks(q: jax.Array, scale: jax.Array, offset: Optional[jax.Array] = None,
                nibbles: Optional[bool] = None, factored: Optional[bool] = None
                ) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
  """An int8 block matrix [out, in] as the block kernel's panels, each output column's K contiguous.

  The matrix is w[n, k] = scale[n, k // B] * q[n, k] + offset[n, k // B]
  (`convert.gguf_blocks.Blocks`, [out, in] like HF); its panels lay it out
  as `pack` lays out a float [in, out] kernel, so that the same x @ W reads
  a quarter of the bytes. Where every q is in [0, 15] (4-bit k-quants) the
  panels hold two q to a byte (`pack_nibbles`), so a decode step, which is
  bound by the bytes it reads, reads 0.75 instead of 1.25 bytes a weight for
  the same numbers.

  Args:
    q: [N, K] int8, N a multiple of `PANEL`.
    scale: [N, K / B] float32, B in `BLOCK_SIZES` (any even B for the einsum).
    offset: [N, K / B] float32, or None.
    nibbles: True: two q to a byte (every q must be in [0, 15] and K even);
      False: one int8 q a byte; None: nibbles where they can hold q.
    factored: True: scales (and offsets) as d * sc (`factor_scales`,
      `pack_factored`), a K-quant's own form in a quarter of the bytes;
      False: float32; None: factored where every scale and offset has
      exact factors.

  Returns:
    (qpanels [N/32, K, 32] int8 with qpanels[p, k, c] = q[32p + c, k], or
    with nibbles [N/32, K/2, 32] uint8 (`pack_nibbles`),
    spanels [N/32, K/B, 32] float32 with spanels[p, j, c] = scale[32p + c, j],
    or factored [N/32, (K/256)(4 + 256/B), 32] int8 (`pack_factored`),
    opanels the same for offset, or None).

  Raises:
    ValueError: N is not a multiple of `PANEL`, q is not int8, the scales do
      not divide K, or nibbles or factors were asked for that cannot hold
      q or the scales.
  """
  n, k = q.shape
  if n % PANEL or q.dtype != jnp.int8:
    raise ValueError(f"cannot pack a [{n}, {k}] {q.dtype} block matrix: expected int8 with rows "
                     f"a multiple of {PANEL}")
  if scale.ndim != 2 or scale.shape[0] != n or not scale.shape[1] or k % scale.shape[1]:
    raise ValueError(f"scales {scale.shape} do not divide a [{n}, {k}] matrix into blocks")
  if offset is not None and offset.shape != scale.shape:
    raise ValueError(f"offsets {offset.shape} differ from scales {scale.shape}")
  if nibbles is None or nibbles:
    fits = k % 2 == 0 and bool(_in_nibbles(jnp.asarray(q)))
    if nibbles and not fits:
      raise ValueError(f"cannot pack a [{n}, {k}] block matrix as nibbles: K must be even and "
                       f"every q in [0, {NIBBLE_MAX}]")
    nibbles = fits
  factors = None
  if factored is None or factored:
    b = k // scale.shape[1]
    factors = [factor_scales(np.asarray(a, np.float32), b)
               for a in (scale, offset) if a is not None]
    if any(f is None for f in factors):
      if factored:
        raise ValueError(f"cannot factor the block scales of a [{n}, {k}] matrix: every "
                         f"{SUPER} inputs need one float d with each scale d * an int8")
      factors = None
  qp = _pack_q(jnp.asarray(q), nibbles)
  if factors:
    return qp, pack_factored(*factors[0]), None if offset is None else pack_factored(*factors[1])
  return (qp, _pack(jnp.asarray(scale, jnp.float32).T),
          None if offset is None else _pack(jnp.asarray(offset, jnp.float32).T))


@jax.jit
def _in_nibbles(q: jax.Array) -> jax.Array:  # [N, K] int8 -> [] bool
  return jnp.all((q >= 0) & (q <= NIBBLE_MAX))


@functools.partial(jax.jit, static_argnums=1)
def _pack_q(q: jax.Array, nibbles: bool) -> jax.Array:  # [N, K] -> [N/32, K, 32] or nibbles
  qp = _pack(q.T)
  return pack_nibbles(qp) if nibbles else qp


def is_nibbles(qpanels) -> bool:
  """Whether block q panels (an array or a `LayerPick`) hold two q to a byte (`pack_nibbles`)."""
  return jnp.dtype(qpanels.dtype) == jnp.uint8


@jax.jit
def pack_nibbles(qpanels: jax.Array) -> jax.Array:
  """int8 block q panels with every q in [0, 15] as two q to a byte.

  Args:
    qpanels: [P, K, 32] int8, K even, every value in [0, 15].

  Returns:
    [P, K/2, 32] uint8: byte [p, i, c] holds q[p, 2i, c] in its low four
    bits and q[p, 2i + 1, c] in its high four, so each 32-byte row of a
    panel gives the kernel two k rows of it.
  """
  p, k, width = qpanels.shape
  pairs = qpanels.astype(jnp.uint8).reshape(p, k // 2, 2, width)
  return pairs[:, :, 0, :] | (pairs[:, :, 1, :] << 4)


@jax.jit
def unpack_nibbles(qpanels: jax.Array) -> jax.Array:
  """The inverse of `pack_nibbles`: [P, K/2, 32] uint8 -> [P, K, 32] int8 in [0, 15]."""
  p, half, width = qpanels.shape
  pairs = jnp.stack([qpanels & 15, qpanels >> 4], axis=2)  # [P, K/2, 2, 32]
  return pairs.reshape(p, 2 * half, width).astype(jnp.int8)


def block_inputs(qpanels) -> int:
  """K of block q panels (an array or a `LayerPick`): their rows, twice that for nibbles."""
  return qpanels.shape[1] * (2 if is_nibbles(qpanels) else 1)


def unpack_blocks(qpanels: jax.Array, spanels: jax.Array, opanels: Optional[jax.Array] = None
                  ) -> tuple[jax.Array, jax.Array, Optional[jax.Array]]:
  """The inverse of `pack_blocks`: (q [N, K] int8, scale [N, K/B] float32, offset or None), new arrays."""
  k = block_inputs(qpanels)
  if is_nibbles(qpanels):
    qpanels = unpack_nibbles(qpanels)
  return (_unpack(jnp.asarray(qpanels)).T, _unpack(scale_values(jnp.asarray(spanels), k)).T,
          None if opanels is None else _unpack(scale_values(jnp.asarray(opanels), k)).T)


def widen_blocks(qpanels: jax.Array, spanels: jax.Array, opanels: Optional[jax.Array] = None
                 ) -> jax.Array:
  """The float32 panels that block panels define: scale * q + offset, [N/32, K, 32].

  Args:
    qpanels, spanels, opanels: as `pack_blocks` returns them (int8 or nibbles).

  Returns:
    [N/32, K, 32] float32, as `pack` lays out the widened [K, N] matrix.
  """
  if is_nibbles(qpanels):
    qpanels = unpack_nibbles(qpanels)
  p, k, width = qpanels.shape
  spanels = scale_values(spanels, k)
  blocks = spanels.shape[1]
  w = qpanels.astype(jnp.float32).reshape(p, blocks, k // blocks, width) * spanels[:, :, None, :]
  if opanels is not None:
    w = w + scale_values(opanels, k)[:, :, None, :]
  return w.reshape(p, k, width)


def matmul_blocks(x: jax.Array, qpanels, spanels, opanels=None) -> jax.Array:
  """x @ W for W stored as int8 block panels: [..., K] -> [..., N] float32.

  Runs `jspec_gemm_blk` (or `_sym` without offsets; `jspec_gemm_blk4` and
  `_blk4_sym` for nibble panels, whose outputs are the int8 kernel's on the
  same q bit for bit) where the kernel is available, x is float32, B is in
  `BLOCK_SIZES` and the program runs on CPU; otherwise an einsum over
  `widen_blocks`. The kernel sums in another order than the einsum (a
  decode step's few rows block by block; many rows exactly as `matmul` over
  the widened panels).

  Args:
    x: [..., K] float32 activations.
    qpanels: [N/32, K, 32] int8 or [N/32, K/2, 32] uint8 nibbles, or a `LayerPick` of such.
    spanels: [N/32, K/B, 32] float32 or factored int8 (`pack_factored`; a
      `LayerPick` where qpanels is one).
    opanels: as spanels, of the same form, or None.

  Returns:
    [..., N] float32.
  """
  lead, k = x.shape[:-1], x.shape[-1]
  p, _, width = qpanels.shape
  rows = x.reshape(-1, k)  # [M, K]
  picks = [w for w in (qpanels, spanels, opanels) if w is not None]
  layered = isinstance(qpanels, LayerPick)
  if any(isinstance(w, LayerPick) != layered for w in picks):
    raise ValueError("matmul_blocks: q, scales and offsets must all be LayerPicks or all arrays")
  if block_inputs(qpanels) != k:
    raise ValueError(f"matmul_blocks: x has {k} inputs, the q panels {qpanels.shape} "
                     f"{jnp.dtype(qpanels.dtype)} hold {block_inputs(qpanels)}")
  if opanels is not None and is_factored(opanels) != is_factored(spanels):
    raise ValueError("matmul_blocks: scales and offsets must be of one form, float32 or factored")
  whole = is_factored(spanels) or k % spanels.shape[1] == 0  # blocks of B cover K
  if (x.dtype == jnp.float32 and whole and block_size(k, spanels) in BLOCK_SIZES and available()
      and jax.default_backend() == "cpu"):
    if _ANY_ORDER.get():  # the one call that carries it
      return matmul_blocks_many(x, [(qpanels, spanels, opanels)])[0]
    if is_nibbles(qpanels):
      target = TARGET_BLK4 if opanels is not None else TARGET_BLK4_SYM
    else:
      target = TARGET_BLK if opanels is not None else TARGET_BLK_SYM
    out_type = jax.ShapeDtypeStruct((rows.shape[0], p * width), jnp.float32)
    if layered:
      buffers = [b for w in picks for b in w.weights]
      y = jax.ffi.ffi_call(LAYER_TARGETS[target], out_type)(
          rows, qpanels.index.astype(jnp.int32), *buffers)
    else:
      y = jax.ffi.ffi_call(target, out_type)(rows, *picks)
  else:
    if layered:
      qpanels, spanels = qpanels.value(), spanels.value()
      opanels = None if opanels is None else opanels.value()
    w = widen_blocks(qpanels, spanels, opanels)
    y = jnp.einsum("mk,pkw->mpw", rows.astype(jnp.float32), w).reshape(rows.shape[0], p * width)
  return y.reshape(*lead, p * width)


def blocks_form(qpanels, spanels, opanels=None) -> tuple:
  """What one `jspec_gemm_blk_many` call needs its matrices to share.

  Returns:
    (K, B, nibbles, offsets, layers, factored): layers is the `LayerPick`'s
    count, 0 for an array; factored whether the scales are `pack_factored`'s.
  """
  k = block_inputs(qpanels)
  layers = len(qpanels.weights) if isinstance(qpanels, LayerPick) else 0
  return (k, block_size(k, spanels), is_nibbles(qpanels), opanels is not None, layers,
          is_factored(spanels))


def matmul_blocks_many(x: jax.Array, parts) -> list[jax.Array]:
  """x @ W_j for several block matrices of one form, in one kernel call.

  The matrices that read the same activations (the MLP's gate and up,
  attention's q and k) would each pay a call's start and its threads'
  uneven finish; one call over all their panels pays those once. Each
  output is `matmul_blocks(x, *part)`'s bit for bit (the same tiles over
  the same panels). Where the kernel would not run (see `matmul_blocks`),
  or the parts differ in `blocks_form`, each part is its own product.

  Args:
    x: [..., K] float32 activations.
    parts: (qpanels, spanels, opanels or None) per matrix, as `matmul_blocks` takes them.

  Returns:
    [..., N_j] float32 per part, in order.
  """
  parts = [tuple(part) + (None,) * (3 - len(part)) for part in parts]
  forms = {blocks_form(*part) for part in parts}
  lead, k = x.shape[:-1], x.shape[-1]
  # One part goes through here only under `any_order`, which this call carries.
  if not ((len(parts) > 1 or _ANY_ORDER.get()) and len(forms) == 1 and x.dtype == jnp.float32
          and available() and jax.default_backend() == "cpu"):
    return [matmul_blocks(x, *part) for part in parts]
  k_form, b, nibbles, offsets, layers, _ = forms.pop()
  if k_form != k:
    raise ValueError(f"matmul_blocks_many: x has {k} inputs, the q panels hold {k_form}")
  if b not in BLOCK_SIZES:
    return [matmul_blocks(x, *part) for part in parts]
  rows = x.reshape(-1, k)  # [M, K]
  widths = [part[0].shape[0] * part[0].shape[2] for part in parts]
  buffers, index = [], jnp.zeros((), jnp.int32)
  for part in parts:
    for w in part[:3 if offsets else 2]:
      if layers:
        buffers.extend(w.weights)
        index = w.index.astype(jnp.int32)
      else:
        buffers.append(w)
  out_type = jax.ShapeDtypeStruct((rows.shape[0], sum(widths)), jnp.float32)
  y = jax.ffi.ffi_call(TARGET_BLK_MANY, out_type)(
      rows, index, *buffers, parts=len(parts), layers=max(layers, 1), nibbles=nibbles,
      offsets=offsets, any_order=_ANY_ORDER.get())
  starts = [sum(widths[:j]) for j in range(len(parts))]
  return [y[:, s:s + n].reshape(*lead, n) for s, n in zip(starts, widths)]


def matmul_bf16(x: jax.Array, panels) -> jax.Array:
  """x @ W for a bfloat16 W stored as panels, in float32: [..., K] x [N/32, K, 32] -> [..., N].

  Each weight is widened to float32 exactly (a bfloat16 is a float32's top
  half), so this is `matmul` over the widened panels, reading half the
  bytes: `jspec_gemm_bf16` where the kernel is available, x is float32 and
  the program runs on CPU, else an einsum over the widened panels (the two
  sum in different orders). Under `any_order` (a prefill), from 16 rows on
  an AMX host, the kernel multiplies with tiles.

  Args:
    x: [..., K] float32 activations.
    panels: W [K, N] as `pack` lays it out, bfloat16, or a `LayerPick` of such.

  Returns:
    [..., N] float32.
  """
  lead, k = x.shape[:-1], x.shape[-1]
  p, _, width = panels.shape
  rows = x.reshape(-1, k)  # [M, K]
  if (x.dtype == jnp.float32 and panels.dtype == jnp.bfloat16 and available()
      and jax.default_backend() == "cpu"):
    out_type = jax.ShapeDtypeStruct((rows.shape[0], p * width), jnp.float32)
    y = _call(TARGET_BF16, out_type, rows, panels, any_order=_ANY_ORDER.get())
  else:
    if isinstance(panels, LayerPick):
      panels = panels.value()
    y = jnp.einsum("mk,pkw->mpw", rows.astype(jnp.float32),
                   panels.astype(jnp.float32)).reshape(rows.shape[0], p * width)
  return y.reshape(*lead, p * width)
