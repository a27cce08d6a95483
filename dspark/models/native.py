"""dspark's own CPU kernels (csrc/*.c), built once with the system C compiler and called through ctypes.

- `int4_mm.c`: 4-bit grouped weights times bf16 rows. PyTorch's int4 kernel decodes a weight tile again
  for every few rows, so an 8-row verify window cost ~3x one row and a prefill ran at a third of the
  CPU's bf16 speed; this one decodes each tile once per call for every row (AVX-512 BF16).
  With DSPARK_AMX=1 on CPUs with AMX (Sapphire Rapids and later), a group's sums come from one tile
  multiply for up to 16 rows: a verify window of 8 rows, a step of many sequences and prefill get 2-3x
  cheaper, one row ~10-20% dearer (the decoded tile goes through memory), hence not the default.
  By default each row's groups of 32 inputs are rounded to 8 bits first (as llama.cpp does) and a group's
  dot product is an exact integer from VNNI: an 8-row window ~1.6x one row instead of ~3-4x, one row
  cheaper too, the target's acceptance of the drafts about the same; DSPARK_INT8_ACTIVATIONS=0 (or
  DSPARK_AMX=1) keeps the rows in bf16. AMX-INT8 tiles (TDPBSUD) would give the same integers but do not
  pay here: a tile multiply can hold only one group of 32 inputs (each group has its own scales), and its
  fixed cost per group and 16 columns (codes stored and loaded as a tile, sums stored and reloaded to be
  scaled) is about what VPDPBUSD spends on 8 rows; tried on Sapphire Rapids, one thread, a [3072, 576]
  matmul took 1.45x as long at 8 rows and 1.6x at 16.
- `q8_mm.c`: the same for 8-bit groups (GGUF Q8_0), fp32 out: the embedded model's LM head in its own
  8-bit form, half the bytes of bf16.
- `q8_vnni_mm.c`: 8-bit weights times rows rounded to 8-bit groups too, on VNNI (twice the multiply-adds
  an instruction, no decoding of the codes): the drafter's projections, whose drafts need not be exact.
- `attention.c`: fp32 attention one row at a time, in place of a chain of ~15 PyTorch ops per layer
  that had to pad rows and keys to stay window-invariant. It reads the target's cache in bf16 (keys rounded
  once when written, widened exactly when read: a row still does not depend on its window), half the bytes
  of the fp32 cache it read before: a one-token step 1.06x as fast at 256 cached tokens, 1.24x at 1024.
- `layer_ops.c`: RMSNorm (with the residual add), SiLU-gating, and RoPE with the KV cache write, one
  call each instead of 3-7 PyTorch ops: at batch 1 a step's time went mostly to dispatching small ops.
- `layer.c`: a whole decoder layer of one sequence as one call (the kernels above in the Python layer's
  order, so the same bits): at batch 1 the Python between ~10 kernel calls a layer cost as much as they did.
  Likewise one call per layer of the drafter's block pass, and one for its context projection. Then every
  layer of such a step in one call (dspark_layers): the Python of 30 layer calls still cost ~1 ms of a
  ~5.4 ms one-token step, the other core waiting for it (4.3 ms after).
- `step.c`: that step whole, the embedding before the layers and the final norm and 8-bit LM head after them.
- `draft_block.c`: a greedy DSpark drafting block whole (embeddings, the drafter's layers, its LM head and
  confidence, the Markov head's picks), so that a batch-1 round makes two calls (context feed, block).
- `markov.c`: greedy drafting through DSpark's vanilla Markov head, every position of every request's block
  in one call (in PyTorch, ~8 ops and a 16k-row product per position, sequential by construction); a
  position's pass over W2 serves up to 8 requests at once.
- `vocab_loss.c`: for training, the drafter's vocabulary-sized losses and their gradient, and the target's
  soft labels, a row at a time while it sits in cache (in PyTorch, ~10-14 passes through memory over
  [rows, vocabulary] tensors each: ~2.5 s of a ~13 s training step).

Each serving kernel gives a row the same result whatever the other rows of the call, which is what keeps speculative
verification token-identical to plain decoding (tests/test_native.py, tests/test_packing.py).

The shared library is compiled on first use (a few seconds; `dspark prepare` does it ahead) into
$DSPARK_HOME/kernels, keyed by a hash of the sources and flags. Where there is no C compiler or the CPU
lacks AVX-512 BF16 and VNNI, or with DSPARK_KERNELS=torch, `library()` returns None and models run on PyTorch
ops alone (a process picks one or the other per model load, never both within a model).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = [CSRC / name for name in ("int4_mm.c", "q8_mm.c", "q8_vnni_mm.c", "attention.c", "layer_ops.c",
                                           "layer.c", "step.c", "markov.c", "draft_block.c", "vocab_loss.c")]
FLAGS = ["-O3", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-fopenmp",
         "-fPIC", "-shared"]
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-DDSPARK_AMX"]  # left out where the compiler does not know them
ENV = "DSPARK_KERNELS"  # "auto" (default) or "torch": read at each library() call
AMX_ENV = "DSPARK_AMX"  # "1": the 4-bit and 8-bit matmuls on AMX tiles where the CPU has them; "0" (default)
ACT8_ENV = "DSPARK_INT8_ACTIVATIONS"  # "1" (default, "0" with DSPARK_AMX=1): the 4-bit matmuls on activations
# rounded to 8 bits; "0": on bf16 activations
ROUTES = {"int8_activations": (False, True), "bf16_activations": (False, False), "amx": (True, False)}
"""The 4-bit matmuls' routes by name: (on AMX tiles, on 8-bit activations); see route()."""
_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {
    "dspark_int4_mm": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _INT],
    "dspark_q8_mm": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _INT, _INT],
    "dspark_q8_vnni_mm": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _INT, _PTR, _PTR, _PTR, _INT],
    "dspark_attention": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _INT, _I64, _I64, _I64,
                         _I64, _I64, _I64, _I64, _I64, _I64, _INT, _INT],
    "dspark_attention_paged": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _I64,
                               _I64, _I64, _I64, _I64, _I64, _I64, _I64, _I64, _INT, _INT],
    "dspark_decode_attention_bf16": [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64,
                                     _I64, _F32, _INT],
    "dspark_add_rmsnorm": [_PTR, _PTR, _PTR, _PTR, _F32, _PTR, _I64, _I64, _INT],
    "dspark_silu_mul": [_PTR, _PTR, _I64, _I64, _INT],
    "dspark_rope_store": [_PTR, _PTR, _PTR, _PTR, _F32, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT, _INT],
    "dspark_layer": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR,
                     _PTR, _PTR, _F32, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _INT, _INT],
    "dspark_step": [_PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _F32, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR,
                    _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _I64, _INT, _PTR, _PTR,
                    _F32, _PTR, _I64, _INT, _PTR, _I64, _PTR, _INT],
    "dspark_drafter_layer": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _F32, _PTR, _PTR, _PTR, _PTR,
                             _PTR, _PTR, _F32, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR, _F32, _PTR, _I64, _I64, _PTR, _PTR,
                             _PTR, _PTR,
                             _PTR, _PTR, _PTR, _INT, _INT],
    "dspark_drafter_context": [_PTR, _I64, _I64, _I64, _PTR, _PTR, _F32, _PTR, _I64, _I64, _I64, _PTR, _F32, _PTR,
                               _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT],
    "dspark_draft_block": [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _F32, _PTR, _PTR, _INT],
    "dspark_markov_pack": [_PTR, _I64, _I64, _PTR],
    "dspark_vocab_loss_fwd": [_PTR, _INT, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "dspark_vocab_loss_bwd": [_PTR, _INT, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _INT],
    "dspark_soft_labels": [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _INT],
    "dspark_markov_greedy": [_PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR,
                             _PTR, _INT],
}

RETURNS = {"dspark_step": _INT}  # the functions that return a status (the others return nothing)


class DraftWeights(ctypes.Structure):
    """csrc/draft_block.c's struct draft_weights: a drafter's fixed arguments (drafters/runner.py builds it)."""

    _fields_ = [(name, _PTR) for name in ("embed", "ln_in", "layers", "head", "w1", "w2", "w_tok", "d2t")] + [
        (name, _I64) for name in ("n_layers", "d", "h", "hkv", "hd", "inter", "vd", "head_rows", "rank", "mask_id")] + [
        (name, _F32) for name in ("eps", "qk_eps", "q_scale")] + [("w4", _I64)]


_lib: ctypes.CDLL | None = None
_tried = False
_why = ""
_key = ""  # the loaded build's hash of sources and flags


def _cache_dir() -> Path:
    from dspark.models.embedded import dspark_home
    return dspark_home() / "kernels"


def _compiles(cc: str, flags: list[str]) -> bool:
    """Whether the compiler takes these flags (an empty translation unit)."""
    proc = subprocess.run([cc, *flags, "-x", "c", "-c", "-o", os.devnull, "-"], input="", capture_output=True,
                          text=True)
    return proc.returncode == 0


def _build(out: Path, sources: list[Path] | None = None, flags: list[str] | None = None) -> None:
    """Compile `sources` (default: SOURCES, with AMX where the compiler knows it) into the shared library `out`."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not cc:
        raise RuntimeError("no C compiler (gcc / cc) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        if flags is None:
            flags = FLAGS + (AMX_FLAGS if _compiles(cc, AMX_FLAGS) else [])  # older compilers build the rest
        proc = subprocess.run([cc, *flags, *map(str, sources or SOURCES), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-500:]}")
        os.replace(tmp, out)  # atomic: concurrent first starts never load a half-written file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def library() -> ctypes.CDLL | None:
    """The kernels, building them on first use; None where they cannot run here (see why()) or when
    DSPARK_KERNELS=torch is set (read at each call, so one process can load a model both ways)."""
    global _lib, _tried, _why, _key
    if os.environ.get(ENV, "auto") == "torch":
        return None
    if _tried:
        return _lib
    choice = os.environ.get(AMX_ENV, "0")
    choice8 = os.environ.get(ACT8_ENV, "0" if choice == "1" else "1")  # AMX tiles take bf16 activations
    for env, value in ((AMX_ENV, choice), (ACT8_ENV, choice8)):
        if value not in ("0", "1"):
            raise ValueError(f"{env} must be 0 or 1, not {value!r}")
    _tried = True
    files = SOURCES + sorted(CSRC.glob("*.h"))
    key = hashlib.sha256(b"".join(p.read_bytes() for p in files)
                         + " ".join(FLAGS + AMX_FLAGS).encode()).hexdigest()[:12]
    path = _cache_dir() / f"dspark-kernels-{key}.so"
    try:
        if not path.exists():
            _build(path)
        lib = open_library(path)
        if not lib.dspark_supported():
            _why = "this CPU lacks AVX-512 BF16 and VNNI"
            return None
        amx = lib.dspark_amx_init(int(choice))
        act8 = lib.dspark_act8_init(int(choice8))
    except (OSError, RuntimeError) as e:
        _why = str(e)
        return None
    _lib, _key = lib, key + ("-amx" if amx else "") + ("-act8" if act8 else "")
    return _lib


def open_library(path: Path) -> ctypes.CDLL:
    """A built kernel library at `path`, its functions typed (SIGNATURES); its routes are not set. For a
    benchmark of another build (bench/kernels_ab.py) as for library()."""
    lib = ctypes.CDLL(str(path))  # after torch: its libgomp (same soname) serves this library too
    for name, args in SIGNATURES.items():
        fn = getattr(lib, name, None)  # None: an older revision's build (kernels_ab.py) without this function
        if fn is not None:
            fn.argtypes, fn.restype = args, RETURNS.get(name)
    lib.dspark_amx_init.argtypes = [_INT]
    lib.dspark_act8_init.argtypes = [_INT]
    return lib


def loaded() -> ctypes.CDLL | None:
    """The library if library() has loaded it, whatever DSPARK_KERNELS says now: modules decide at
    construction (a bool, so they stay deep-copyable) and fetch it here at each call."""
    return _lib


def build_key() -> str:
    """The loaded kernels' hash of sources and flags, with "-amx" where their matmuls run on AMX tiles and
    "-act8" where the 4-bit ones round their activations to 8 bits ("" when none are loaded): what a cached
    timing of them (an SPS table) is valid for."""
    return _key if _lib is not None else ""


def amx() -> bool:
    """Whether the loaded kernels run the 4-bit and 8-bit matmuls on AMX tiles (DSPARK_AMX=1 where the CPU
    has them): a row's bits then differ from the AVX-512 path's (though not with the window), so a process
    keeps one path for all its calls."""
    return _lib is not None and "-amx" in _key


def act8() -> bool:
    """Whether the loaded kernels' 4-bit matmuls round their activations to 8 bits now (the default;
    DSPARK_INT8_ACTIVATIONS=0 or DSPARK_AMX=1 turn it off; read from the library, so a test that switches
    it packs weights for what it switched to)."""
    return _lib is not None and ctypes.c_int.in_dll(_lib, "dspark_act8_on").value == 1


@contextlib.contextmanager
def route(name: str) -> Iterator[bool]:
    """For a benchmark or a test: the loaded kernels' matmuls on route `name` (ROUTES) inside the block,
    the process's own routes after it. Yields whether that route runs here (AMX needs the CPU's tiles).
    Weights packed for the 4-bit matmuls suit one activation route (int4.pack_for_kernel), so a model is
    loaded and run under the same one."""
    amx, act8 = ROUTES[name]
    lib = library()
    try:
        yield (lib is not None and lib.dspark_amx_init(int(amx)) == int(amx)
               and lib.dspark_act8_init(int(act8)) == int(act8))
    finally:
        use_configured_routes()


def use_configured_routes() -> None:
    """Put the loaded kernels' matmul routes back to the ones this process started with (DSPARK_AMX,
    DSPARK_INT8_ACTIVATIONS), after a benchmark or a test switched them for a while."""
    if _lib is not None:
        _lib.dspark_amx_init(int(amx()))
        _lib.dspark_act8_init(int("-act8" in _key))


def why() -> str:
    """Why library() is None ("" when it is not, or not yet asked)."""
    if os.environ.get(ENV, "auto") == "torch":
        return f"{ENV}=torch"
    return _why


def _threads() -> int:
    return torch.get_num_threads()


def int4_mm(lib, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [rows, K] bf16 contiguous times weights packed by int4.pack_for_kernel: [rows, n] bf16."""
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    lib.dspark_int4_mm(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n, y.data_ptr(), _threads())
    return y


def rms_norm(lib, x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) for x [rows, d] bf16 contiguous, weight [d] fp32; without residual the
    first is x itself."""
    out = torch.empty_like(x)
    total = x if residual is None else torch.empty_like(x)
    lib.dspark_add_rmsnorm(x.data_ptr(), None if residual is None else residual.data_ptr(), total.data_ptr(),
                           weight.data_ptr(), eps, out.data_ptr(), x.shape[0], x.shape[1], _threads())
    return total, out


def silu_mul(lib, gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [rows, 2n] bf16 contiguous -> [rows, n] bf16."""
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.bfloat16)
    lib.dspark_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, n, _threads())
    return out


def rope_store(lib, qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               q_scale: float, heads: int, kv_heads: int, pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """RoPE on the fused qkv rows [T, H + 2 Hkv, hd] bf16; keys and values written to the layer's pool
    [2 Hkv, rows, hd] (fp32, or bf16: keys rounded once) at `slots` [T] int64; returns q [T, H, hd] fp32
    (scaled by q_scale). cos and signed sin: fp32 tables [positions, hd] covering `positions` [T] int64."""
    t, _, hd = qkv.shape
    q = torch.empty(t, heads, hd, dtype=torch.float32)
    lib.dspark_rope_store(qkv.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(), q_scale, t, heads,
                          kv_heads, hd, q.data_ptr(), pool.data_ptr(), pool.shape[1], slots.data_ptr(),
                          int(pool.dtype == torch.bfloat16), _threads())
    return q


def markov_pack(lib, w: torch.Tensor) -> torch.Tensor:
    """The Markov head's W2 [Vd, r] as markov_greedy() reads it (bf16 tiles of 16 rows)."""
    w = w.detach().to(torch.bfloat16).contiguous()
    vd, r = w.shape
    out = torch.empty((vd + 15) // 16 * 16 * ((r + 1) // 2 * 2), dtype=torch.bfloat16)
    lib.dspark_markov_pack(w.data_ptr(), vd, r, out.data_ptr())
    return out


def markov_greedy(lib, anchors: torch.Tensor, base: torch.Tensor, w1: torch.Tensor, w2_packed: torch.Tensor,
                  w_tok: torch.Tensor | None, conf: torch.Tensor | None,
                  d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy picks of every block position through the vanilla Markov head: anchors [R] int64 target ids,
    base logits [R, n, Vd] bf16 (unit last stride), W1 [V, r] bf16 contiguous, W2 from markov_pack(), the
    confidence's token half w_tok [r] bf16 and its hidden half plus bias conf [R, n] fp32 (or both None),
    d2t [Vd] int64 or None -> (target ids [R, n] int64, confidence logits [R, n] fp32 or None)."""
    r, n, vd = base.shape
    if base.stride(-1) != 1:
        base = base.contiguous()
    if r and n and not 0 <= int(anchors.min()) <= int(anchors.max()) < w1.shape[0]:
        raise ValueError(f"anchor ids must be in [0, {w1.shape[0]})")
    if w1.shape[1] > 256:
        raise ValueError(f"markov_greedy takes a Markov rank of at most 256, got {w1.shape[1]}")
    anchors = anchors.to(torch.long).contiguous()
    tokens = torch.empty(r, n, dtype=torch.long)
    conf = None if conf is None else conf.float().contiguous()
    conf_out = None if conf is None else torch.empty(r, n, dtype=torch.float32)
    lib.dspark_markov_greedy(anchors.data_ptr(), base.data_ptr(), base.stride(0), base.stride(1), r, n,
                             vd, w1.data_ptr(), w1.shape[1], w2_packed.data_ptr(),
                             None if w_tok is None else w_tok.data_ptr(), None if conf is None else conf.data_ptr(),
                             None if d2t is None else d2t.data_ptr(), tokens.data_ptr(),
                             None if conf_out is None else conf_out.data_ptr(), _threads())
    return tokens, conf_out


def attention(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
              out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q [B, H, Q, hd] fp32 (any strides with a unit last one), k / v [Hkv, B, S, hd] fp32 or bf16 with rows of hd
    consecutive floats, mask [B, 1, Q, S] bool -> [B, H, Q, hd] in out_dtype (fp32 or bf16), whose
    memory is laid out [B, Q, H, hd]: the layout the output projection reads next."""
    b, h, nq, hd = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    mask = mask.contiguous()
    out = torch.empty(b, nq, h, hd, dtype=out_dtype)
    lib.dspark_attention(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(), v.data_ptr(),
                         k.stride(0), k.stride(1), mask.data_ptr(), out.data_ptr(), int(out_dtype == torch.bfloat16),
                         out.stride(0), out.stride(2), out.stride(1), b, h, k.shape[0], nq, k.shape[2], hd,
                         int(k.dtype == torch.bfloat16), _threads())
    return out.transpose(1, 2)


def attention_paged(lib, q: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor,
                    out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """attention() over a layer's cache as it is: pool [2 Hkv, pool rows, hd] fp32 or bf16 (keys, then values),
    rows [B, S] int64: the pool row of each sequence's key s (padding: any row, masked). The same values in the
    same order as attention() on the rows gathered into [Hkv, B, S, hd], so the same bits, without the copy."""
    b, h, nq, hd = q.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    mask, rows = mask.contiguous(), rows.contiguous()
    hkv = pool.shape[0] // 2
    out = torch.empty(b, nq, h, hd, dtype=out_dtype)
    lib.dspark_attention_paged(q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), pool.data_ptr(),
                               pool[hkv].data_ptr(), pool.stride(0), rows.data_ptr(), None, None, mask.data_ptr(),
                               out.data_ptr(),
                               int(out_dtype == torch.bfloat16), out.stride(0), out.stride(2), out.stride(1), b, h, hkv,
                               nq, rows.shape[1], hd, int(pool.dtype == torch.bfloat16), _threads())
    return out.transpose(1, 2)


def decode_attention_bf16(lib, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor,
                          lengths: torch.Tensor) -> torch.Tensor:
    """One query per row: q [R, H, hd] bf16 (rows of H * hd) over the first lengths[r] keys / values of cache
    slot slots[r], k / v [slots, Hkv, S, hd] bf16 with rows of hd (any slot and head strides) -> [R, H, hd]
    bf16. Query heads are grouped over KV heads as in GQA; scaled by 1/sqrt(hd)."""
    r, h, hd = q.shape
    q = q if q.stride(-1) == 1 and q.stride(-2) == hd else q.contiguous()
    slots, lengths = slots.to(torch.int64).contiguous(), lengths.to(torch.int64).contiguous()
    out = torch.empty(r, h, hd, dtype=torch.bfloat16)
    lib.dspark_decode_attention_bf16(q.data_ptr(), q.stride(0), k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1),
                                     slots.data_ptr(), lengths.data_ptr(), out.data_ptr(), r, h, k.shape[1],
                                     k.shape[2], hd, hd ** -0.5, _threads())
    return out


def attention_fits(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether attention() takes these shapes and layouts."""
    hd = q.shape[-1]
    return (q.dtype == torch.float32 and k.dtype in (torch.float32, torch.bfloat16) and hd % 16 == 0 and hd <= 256
            and k.stride(-1) == 1 and k.stride(-2) == hd and q.device.type == "cpu")


def vocab_loss_forward(lib, logits: torch.Tensor, pt: torch.Tensor, pt_rows: torch.Tensor, labels: torch.Tensor,
                       ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """train/losses.py's _VocabLoss.forward: logits [N, Vd] fp32 or bf16 contiguous, pt [U, Vd] fp32
    contiguous, pt_rows and labels (>= 0) [N] int64, ok [N] bool -> (lse, nll, tv, hit) [N]."""
    n, v = logits.shape
    lse, nll, tv = (torch.empty(n, dtype=torch.float32) for _ in range(3))
    hit = torch.empty(n, dtype=torch.bool)
    lib.dspark_vocab_loss_fwd(logits.data_ptr(), int(logits.dtype == torch.bfloat16), n, v, pt.data_ptr(),
                              pt_rows.data_ptr(), labels.data_ptr(), ok.data_ptr(), lse.data_ptr(), nll.data_ptr(),
                              tv.data_ptr(), hit.data_ptr(), _threads())
    return lse, nll, tv, hit


def vocab_loss_backward(lib, logits: torch.Tensor, pt: torch.Tensor, pt_rows: torch.Tensor, labels: torch.Tensor,
                        ok: torch.Tensor, lse: torch.Tensor, g_nll: torch.Tensor, g_tv: torch.Tensor) -> torch.Tensor:
    """_VocabLoss.backward: the forward's inputs, its lse, and the gradients of nll and tv [N] fp32
    contiguous -> the gradient in logits [N, Vd], in their dtype."""
    grad = torch.empty_like(logits)
    lib.dspark_vocab_loss_bwd(logits.data_ptr(), int(logits.dtype == torch.bfloat16), logits.shape[0],
                              logits.shape[1], pt.data_ptr(), pt_rows.data_ptr(), labels.data_ptr(), ok.data_ptr(),
                              lse.data_ptr(), g_nll.data_ptr(), g_tv.data_ptr(), grad.data_ptr(), _threads())
    return grad


def soft_labels(lib, logits: torch.Tensor, d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """train/features.py's soft_labels on rows of target logits [N, V] bf16 contiguous: (p_t on the draft
    vocabulary d2t [Vd] int64 (None: all of V) [N, Vd] fp32, normalised over all of V; argmax [N] int64)."""
    n, v = logits.shape
    vd = v if d2t is None else d2t.shape[0]
    probs = torch.empty(n, vd, dtype=torch.float32)
    greedy = torch.empty(n, dtype=torch.long)
    lib.dspark_soft_labels(logits.data_ptr(), n, v, None if d2t is None else d2t.data_ptr(), vd, probs.data_ptr(),
                           greedy.data_ptr(), _threads())
    return probs, greedy
