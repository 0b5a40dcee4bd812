"""The CUDA kind's reduction kernels: one source for every served dtype and reduce op.

Compiled once per device when the daemon starts (cuda.py: NVRTC through cupy.RawModule,
off every collective's deadline) and launched on raw device pointers, so a reduction
builds no cupy array (second reading, point 10; issue 47, item 4). Each kernel is a
grid-stride loop ``out = a (op) b`` over n elements, and ``x = x / d`` for avg; the
one-shot kernels (issue 47, item 3) reduce up to ONESHOT_MAX inputs in rank order into up
to ONESHOT_MAX outputs in one launch, through the same per-element functions:

  * sum and prod wrap around for integers (computed unsigned, as numpy's do), min and max
    propagate NaN and return one of the inputs' own bits (numpy's minimum/maximum);
  * float16 and bfloat16 are their 16-bit words, converted to float32 and back with
    round-to-nearest-even (what numpy and ml_dtypes do; NaN as they make it), by hand:
    no cuda_fp16.h or cuda_bf16.h is needed at run-time compilation;
  * avg divides in the type's own precision as numpy does (float16, bfloat16 and float32
    in float32, float64 in double), integers by floor division.

Apart from the prelude the source is plain C: the tests compile it for the host with
HOST_PRELUDE and compare every kernel bitwise with numpy and ml_dtypes
(tests/memory/test_cuda_contract_kernels.py), so what a GPU runs is what was checked.
"""

from __future__ import annotations

from lpsync.types import ReduceOp

# numpy name -> (code in the kernels' names, C type of one element)
DTYPES: dict[str, tuple[str, str]] = {
    "float16": ("f16", "unsigned short"),
    "bfloat16": ("bf16", "unsigned short"),
    "float32": ("f32", "float"),
    "float64": ("f64", "double"),
    "int8": ("i8", "signed char"),
    "int32": ("i32", "int"),
    "int64": ("i64", "long long"),
    "uint8": ("u8", "unsigned char"),
}
# Kernels combine with these; avg combines as a sum and divides once where final.
COMBINE = {
    ReduceOp.SUM: "sum",
    ReduceOp.AVG: "sum",
    ReduceOp.PROD: "prod",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
}
# Inputs and outputs one one-shot launch takes (by value: 2 * 16 pointers, 280 bytes of
# parameters, far below CUDA's 4 KiB); more participants on a device run the chain.
ONESHOT_MAX = 16

CUDA_PRELUDE = r"""
#define KERNEL extern "C" __global__
#define DEVICE static __device__ __forceinline__
#define LOOP(i, n) for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < (n); \
                        i += (long long)blockDim.x * gridDim.x)
DEVICE float as_float(unsigned int u) { return __uint_as_float(u); }
DEVICE unsigned int as_uint(float f) { return __float_as_uint(f); }
"""

HOST_PRELUDE = r"""
#include <string.h>
#define KERNEL
#define DEVICE static inline
#define LOOP(i, n) for (long long i = 0; i < (n); i++)
DEVICE float as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
DEVICE unsigned int as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
"""

_CONVERSIONS = r"""
DEVICE float h2f(unsigned short h) {  /* float16 -> float32, exact */
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16, ex = ((unsigned int)h >> 10) & 0x1fu;
    unsigned int man = (unsigned int)h & 0x3ffu;
    if (ex == 0x1fu) return as_float(sign | 0x7f800000u | (man << 13));  /* inf, NaN */
    if (ex) return as_float(sign | ((ex + 112u) << 23) | (man << 13));
    if (!man) return as_float(sign);
    ex = 113u;  /* a subnormal: normalized */
    while (!(man & 0x400u)) { man <<= 1; ex--; }
    return as_float(sign | (ex << 23) | ((man & 0x3ffu) << 13));
}
DEVICE unsigned short f2h(float f) {  /* float32 -> float16, round to nearest even */
    unsigned int x = as_uint(f), sign = (x >> 16) & 0x8000u, mag = x & 0x7fffffffu;
    if (mag > 0x7f800000u) {  /* NaN: its top payload bits, kept a NaN (numpy's rule) */
        unsigned int bits = 0x7c00u + ((mag & 0x7fffffu) >> 13);
        return (unsigned short)(sign | (bits == 0x7c00u ? 0x7c01u : bits));
    }
    if (mag >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);  /* >= 65520: inf */
    if (mag >= 0x38800000u) {  /* a normal float16 */
        unsigned int r = mag - 0x38000000u;
        r += 0xfffu + ((r >> 13) & 1u);
        return (unsigned short)(sign | (r >> 13));
    }
    unsigned int e = mag >> 23;
    if (e < 102u) return (unsigned short)sign;  /* below half the smallest subnormal */
    unsigned int mant = (mag & 0x7fffffu) | 0x800000u, shift = 126u - e;
    unsigned int man = mant >> shift, rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (man & 1u))) man++;
    return (unsigned short)(sign | man);
}
DEVICE float bf2f(unsigned short h) { return as_float(((unsigned int)h) << 16); }
DEVICE unsigned short f2bf(float f) {  /* float32 -> bfloat16, round to nearest even */
    unsigned int u = as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u & 0x80000000u) ? 0xffc0u : 0x7fc0u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
"""


def _apply(code: str, ctype: str, op: str) -> str:
    """``x (op) y`` of one element pair, as a device function: what the pairwise combine
    kernels and the one-shot kernel both compute, so the two cannot disagree."""
    head = f"DEVICE {ctype} lpsync_{op}_{code}({ctype} p, {ctype} q) {{\n"
    pick = "<" if op == "min" else ">"
    if code in ("f16", "bf16"):
        load, store = ("h2f", "f2h") if code == "f16" else ("bf2f", "f2bf")
        body = f"    float x = {load}(p), y = {load}(q);\n"
        body += {
            "sum": f"    return {store}(x + y);\n",
            "prod": f"    return {store}(x * y);\n",
        }.get(op, f"    return (x != x) ? p : ((y != y) ? q : ((x {pick} y) ? p : q));\n")
    elif code in ("f32", "f64"):
        body = {
            "sum": "    return p + q;\n",
            "prod": "    return p * q;\n",
        }.get(op, f"    return (p != p) ? p : ((q != q) ? q : ((p {pick} q) ? p : q));\n")
    else:  # integers: sums and products wrap (unsigned arithmetic is defined to)
        body = {
            "sum": f"    return ({ctype})((unsigned long long)p + (unsigned long long)q);\n",
            "prod": f"    return ({ctype})((unsigned long long)p * (unsigned long long)q);\n",
            "min": "    return p < q ? p : q;\n",
            "max": "    return p > q ? p : q;\n",
        }[op]
    return head + body + "}\n"


def _combine(code: str, ctype: str, op: str) -> str:
    name = f"lpsync_combine_{code}_{op}"
    head = f"KERNEL void {name}(const {ctype}* a, const {ctype}* b, {ctype}* out, long long n) {{\n"
    return head + f"    LOOP(i, n) out[i] = lpsync_{op}_{code}(a[i], b[i]);\n}}\n"


def _quotient(code: str, ctype: str) -> str:
    """``x / d`` of one element (avg's division), as a device function."""
    head = f"DEVICE {ctype} lpsync_quotient_{code}({ctype} x, long long d) {{\n"
    body = {
        "f16": "    return f2h(h2f(x) / (float)d);\n",
        "bf16": "    return f2bf(bf2f(x) / (float)d);\n",
        "f32": "    return x / (float)d;\n",
        "f64": "    return x / (double)d;\n",
    }.get(
        code,  # integers: floor division (numpy's floor_divide; d > 0)
        f"    long long v = x, q = v / d;\n    if (v % d != 0 && v < 0) q -= 1;\n    return ({ctype})q;\n",
    )
    return head + body + "}\n"


def _divide(code: str, ctype: str) -> str:
    name = f"lpsync_divide_{code}"
    head = f"KERNEL void {name}({ctype}* x, long long n, long long d) {{\n"
    return head + f"    LOOP(i, n) x[i] = lpsync_quotient_{code}(x[i], d);\n}}\n"


def _oneshot(code: str, ctype: str, op: str) -> str:
    """The one-shot allreduce of one launch (issue 47, item 3): element i of every output
    is in0[i] (op) in1[i] (op) ... in rank order, divided once by ``d`` when d > 1 (avg),
    each element read and written by one thread. Pointers go by value (ONESHOT_MAX of
    each, unused ones null): no pointer table in device memory, nothing written per call.
    An output may be the very span of an input (in place: its thread has read every input
    of that element before it writes it); partial overlaps are refused by the caller
    (kind.oneshot_refusal)."""
    m = ONESHOT_MAX
    ins = ", ".join(f"const {ctype}* i{k}" for k in range(m))
    outs = ", ".join(f"{ctype}* o{k}" for k in range(m))
    name = f"lpsync_oneshot_{code}_{op}"
    text = f"KERNEL void {name}({ins}, {outs}, int nin, int nout, long long n, long long d) {{\n"
    text += f"    const {ctype}* in[{m}] = {{{', '.join(f'i{k}' for k in range(m))}}};\n"
    text += f"    {ctype}* out[{m}] = {{{', '.join(f'o{k}' for k in range(m))}}};\n"
    text += "    LOOP(i, n) {\n"
    text += f"        {ctype} acc = in[0][i];\n"
    text += f"        for (int k = 1; k < nin; k++) acc = lpsync_{op}_{code}(acc, in[k][i]);\n"
    text += f"        if (d > 1) acc = lpsync_quotient_{code}(acc, d);\n"
    text += "        for (int k = 0; k < nout; k++) out[k][i] = acc;\n"
    text += "    }\n}\n"
    return text


_OPS = ("sum", "prod", "min", "max")


def source(prelude: str = CUDA_PRELUDE) -> str:
    """Every kernel, after ``prelude`` (CUDA's, or HOST_PRELUDE for the tests)."""
    parts = [prelude, _CONVERSIONS]
    for code, ctype in DTYPES.values():
        parts += [_apply(code, ctype, op) for op in _OPS]
        parts.append(_quotient(code, ctype))
        parts += [_combine(code, ctype, op) for op in _OPS]
        parts.append(_divide(code, ctype))
        parts += [_oneshot(code, ctype, op) for op in _OPS]
    return "".join(parts)


def names() -> list[str]:
    """Every kernel's name, as ``source`` defines them."""
    out = []
    for code, _ in DTYPES.values():
        out += [f"lpsync_combine_{code}_{op}" for op in _OPS]
        out.append(f"lpsync_divide_{code}")
        out += [f"lpsync_oneshot_{code}_{op}" for op in _OPS]
    return out


def combine_name(op: ReduceOp, dtype_name: str) -> str:
    return f"lpsync_combine_{DTYPES[dtype_name][0]}_{COMBINE[op]}"


def divide_name(dtype_name: str) -> str:
    return f"lpsync_divide_{DTYPES[dtype_name][0]}"


def oneshot_name(op: ReduceOp, dtype_name: str) -> str:
    return f"lpsync_oneshot_{DTYPES[dtype_name][0]}_{COMBINE[op]}"
