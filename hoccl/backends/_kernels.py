"""CUDA C++ source of the only kernels hoccl runs: a same-GPU copy and an element-wise reduction.

Pure text: nothing here imports CUDA.  ``hoccl.backends.cuda`` compiles ``source()``
with NVRTC through cupy's ``RawModule`` (which caches the binary on disk) for the
device's architecture and launches the kernels named by ``reduce_kernel_name`` and
``copy_kernel_name`` with ``cuLaunchKernel``.

Both kernels are written for a grid capped at a few SMs (one block per SM): each thread
runs a grid-stride loop over 16-byte vectors and keeps several of them in flight (the
``*_unroll`` entries of ``TUNING``), because a capped grid is bound by the bytes each SM
moves, not by arithmetic: the rate grows with the cap until memory bandwidth is the
limit, and keeping more bytes in flight per SM than ``TUNING`` does adds nothing (the
kernel sweep of ``tests/gpu/cuda_device_smoke.py`` prints the rate per cap on a given
GPU).  Elements before the first 16-byte boundary (``head``)
and after the last whole vector go one by one.

Arguments travel as one struct passed by value (``__grid_constant__``), so the input
pointer table needs no device memory and no lifetime management: the driver copies
kernel parameters when ``cuLaunchKernel`` returns.  The ctypes mirrors of the structs live
in ``_cuda_structs.py``; the definitions here are the contract, and
``tests/test_kernel_structs.py`` checks the mirrors' fields, types and offsets against them.

Numerics:
- float16 and bfloat16 are accumulated in float32, float32 in float32, float64 in
  float64; the result is rounded once (round to nearest even).
- integers are combined in their own type and wrap like C unsigned arithmetic
  (sum and prod modulo 2**bits).
- a sum with ``scaled`` set is multiplied by ``scale`` (converted to the accumulator's
  type) before the one rounding: torch's PREMUL_SUM without a pass of its own.
- ``avg`` is the sum divided by ``divisor`` (the number of inputs); for integers the
  wrapped sum is divided with C's truncation toward zero (what NCCL does).
- ``max``/``min`` propagate NaN, like numpy's ``maximum``/``minimum``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._errors import InvalidArgumentError
from ._base import DTYPES, OPS

__all__ = ["MAX_INPUTS", "CHUNK_FLAGS", "TUNING", "COPY_WIDTHS", "reduce_kernel_name", "copy_kernel_name",
           "reduce_chunks_kernel_name",
           "source", "templates", "compile_options", "reduce_launches", "DIRECT_OPS",
           "DIRECT_INPUTS", "DIRECT_THREADS", "DIRECT_WORDS", "direct_kernel_name", "direct_source",
           "block_range", "direct_compile_options"]

#: inputs one reduce launch combines; more are chained by the caller.
MAX_INPUTS = 64
#: most pad slots each chunk of a ``reduce_chunks`` launch waits on (one per peer that
#: copies into it)
CHUNK_FLAGS = 8
#: how the kernels are built: ``*_threads`` per block (one block per SM in a capped grid);
#: ``*_unroll`` 16-byte vectors each thread keeps in flight (per input for reduce, halved
#: for 1-byte types).  These are the fastest per-SM shapes of a sweep over block sizes
#: (256, 512, 1024 threads) and vectors in flight at 4 to 16 SMs: full 1024-thread blocks
#: with few vectors each beat smaller blocks with more.  Streaming loads
#: (``ld.global.nc.L1::no_allocate.L2::256B``) made no difference, so plain loads are used.
TUNING = {"reduce_threads": 1024, "reduce_unroll": 2, "copy_threads": 1024, "copy_unroll": 8}
#: vector widths of the copy kernels, widest first; the widest that src and dst share wins.
COPY_WIDTHS = (16, 8, 4, 2, 1)

_DTYPE_TRAITS = {
    "float16": "Float16",
    "bfloat16": "BFloat16",
    "float32": "Floating<float>",
    "float64": "Floating<double>",
    "int8": "Integer<signed char, unsigned int>",
    "uint8": "Integer<unsigned char, unsigned int>",
    "int32": "Integer<int, unsigned int>",
    "int64": "Integer<long long, unsigned long long>",
}
_COPY_VECTOR = {16: "uint4", 8: "uint2", 4: "unsigned int", 2: "unsigned short", 1: "unsigned char"}


def reduce_kernel_name(dtype: str, op: str) -> str:
    return f"hoccl_reduce_{dtype}_{op}"


def reduce_chunks_kernel_name(dtype: str, op: str) -> str:
    return f"hoccl_reduce_chunks_{dtype}_{op}"


def copy_kernel_name(width: int) -> str:
    return f"hoccl_copy_{width}"


def compile_options() -> list:
    """NVRTC options (the compiler picks the GPU's architecture); no host headers needed."""
    return (["-std=c++17", f"-DHOCCL_MAX_INPUTS={MAX_INPUTS}", f"-DHOCCL_CHUNK_FLAGS={CHUNK_FLAGS}"]
            + [f"-DHOCCL_{name.upper()}={value}" for name, value in sorted(TUNING.items())])


_COMMON = r"""
struct ReduceArgs {
    void* output;
    const void* inputs[HOCCL_MAX_INPUTS];
    unsigned long long count;    // elements
    unsigned long long head;     // leading elements done one by one (before 16-byte alignment)
    unsigned long long vectors;  // whole 16-byte vectors after the head
    unsigned int num_inputs;
    unsigned int divisor;        // avg divides by this (the total number of inputs)
    unsigned int scaled;         // sum: multiply by ``scale`` before rounding (PREMUL_SUM)
    double scale;
};

struct CopyArgs {
    char* dst;
    const char* src;
    unsigned long long nbytes;
    unsigned long long head;     // leading bytes done one by one (before the vector alignment)
};

enum Op { OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG };

// ---- element types: storage T, accumulator A ------------------------------------------
struct Float16 {
    typedef unsigned short T;
    typedef float A;
    static constexpr bool paired = true;
    static __device__ __forceinline__ A load(T h) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
    }
    static __device__ __forceinline__ T store(A f) {
        T h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
    }
    static __device__ __forceinline__ void load2(unsigned int w, A& lo, A& hi) {
        lo = load((T)(w & 0xffffu)); hi = load((T)(w >> 16));
    }
    static __device__ __forceinline__ unsigned int store2(A lo, A hi) {
#if __CUDA_ARCH__ >= 800
        unsigned int w; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo)); return w;
#else
        return (unsigned int)store(lo) | ((unsigned int)store(hi) << 16);
#endif
    }
    static __device__ __forceinline__ A add(A a, A b) { return a + b; }
    static __device__ __forceinline__ A mul(A a, A b) { return a * b; }
    static __device__ __forceinline__ A divide(A a, unsigned int n) { return a / (A)n; }
};

struct BFloat16 {
    typedef unsigned short T;
    typedef float A;
    static constexpr bool paired = true;
    static __device__ __forceinline__ A load(T h) { return __uint_as_float((unsigned int)h << 16); }
    static __device__ __forceinline__ T store(A f) {
#if __CUDA_ARCH__ >= 800
        T h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
        unsigned int u = __float_as_uint(f);
        if ((u & 0x7fffffffu) > 0x7f800000u) return (T)((u >> 16) | 0x40u);  // quiet NaN
        u += 0x7fffu + ((u >> 16) & 1u);                                     // nearest even
        return (T)(u >> 16);
#endif
    }
    static __device__ __forceinline__ void load2(unsigned int w, A& lo, A& hi) {
        lo = __uint_as_float(w << 16); hi = __uint_as_float(w & 0xffff0000u);
    }
    static __device__ __forceinline__ unsigned int store2(A lo, A hi) {
#if __CUDA_ARCH__ >= 800
        unsigned int w; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo)); return w;
#else
        return (unsigned int)store(lo) | ((unsigned int)store(hi) << 16);
#endif
    }
    static __device__ __forceinline__ A add(A a, A b) { return a + b; }
    static __device__ __forceinline__ A mul(A a, A b) { return a * b; }
    static __device__ __forceinline__ A divide(A a, unsigned int n) { return a / (A)n; }
};

template <typename F>
struct Floating {
    typedef F T;
    typedef F A;
    static constexpr bool paired = false;
    static __device__ __forceinline__ A load(T x) { return x; }
    static __device__ __forceinline__ T store(A x) { return x; }
    static __device__ __forceinline__ A add(A a, A b) { return a + b; }
    static __device__ __forceinline__ A mul(A a, A b) { return a * b; }
    static __device__ __forceinline__ A divide(A a, unsigned int n) { return a / (A)n; }
};

// W: the unsigned type the arithmetic wraps in (C's signed overflow is undefined).
template <typename I, typename W>
struct Integer {
    typedef I T;
    typedef I A;
    static constexpr bool paired = false;
    static __device__ __forceinline__ A load(T x) { return x; }
    static __device__ __forceinline__ T store(A x) { return x; }
    static __device__ __forceinline__ A add(A a, A b) { return (A)((W)a + (W)b); }
    static __device__ __forceinline__ A mul(A a, A b) { return (A)((W)a * (W)b); }
    static __device__ __forceinline__ A divide(A a, unsigned int n) {
        if constexpr ((I)-1 < (I)0) return (A)((long long)a / (long long)n);  // C truncation
        else return (A)((unsigned long long)a / n);
    }
};

template <class D, int OP>
static __device__ __forceinline__ typename D::A combine(typename D::A a, typename D::A b) {
    if constexpr (OP == OP_SUM || OP == OP_AVG) return D::add(a, b);
    else if constexpr (OP == OP_PROD) return D::mul(a, b);
    else if constexpr (OP == OP_MAX) return (a != a || a > b) ? a : b;
    else return (a != a || a < b) ? a : b;
}

template <class D, int OP, class X>
static __device__ __forceinline__ typename D::A finish(typename D::A a, const X& args) {
    if constexpr (OP == OP_AVG) return D::divide(a, args.divisor);
    else if constexpr (OP == OP_SUM) return args.scaled ? D::mul(a, (typename D::A)args.scale) : a;
    else return a;
}

// ---- a 16-byte vector <-> N accumulators ---------------------------------------------
template <class D>
struct Lanes {
    typedef typename D::T T;
    typedef typename D::A A;
    static constexpr int N = 16 / sizeof(T);

    static __device__ __forceinline__ void unpack(const uint4& v, A (&a)[N]) {
        if constexpr (D::paired) {
            D::load2(v.x, a[0], a[1]); D::load2(v.y, a[2], a[3]);
            D::load2(v.z, a[4], a[5]); D::load2(v.w, a[6], a[7]);
        } else {
            union { uint4 v; T t[N]; } u;
            u.v = v;
#pragma unroll
            for (int k = 0; k < N; ++k) a[k] = D::load(u.t[k]);
        }
    }

    static __device__ __forceinline__ uint4 pack(const A (&a)[N]) {
        if constexpr (D::paired) {
            return make_uint4(D::store2(a[0], a[1]), D::store2(a[2], a[3]),
                              D::store2(a[4], a[5]), D::store2(a[6], a[7]));
        } else {
            union { uint4 v; T t[N]; } u;
#pragma unroll
            for (int k = 0; k < N; ++k) u.t[k] = D::store(a[k]);
            return u.v;
        }
    }
};

// ---- output = op(inputs...) ----------------------------------------------------------
// ``reduce_span``: the elements [at, at + count) of every input and the output, ``vectors``
// whole 16-byte vectors of them after the head (``args.head`` elements, the same for every
// span whose start is a whole number of vectors from the arguments' start).
template <class D, int OP>
static __device__ __forceinline__ void reduce_span(const ReduceArgs& args, unsigned long long at,
                                                   unsigned long long count,
                                                   unsigned long long vectors) {
    typedef typename D::T T;
    typedef typename D::A A;
    typedef Lanes<D> L;
    constexpr int N = L::N;
    constexpr int U = sizeof(T) == 1 ? (HOCCL_REDUCE_UNROLL + 1) / 2 : HOCCL_REDUCE_UNROLL;

    const unsigned int n = args.num_inputs;
    const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long head = at + args.head;
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(args.output) + head);

    for (unsigned long long v = first; v < vectors; v += U * threads) {
        A acc[U][N];
        // Inputs go two at a time so that two inputs' loads are in flight together.
        for (unsigned int i = 0; i < n; i += 2) {
            const bool pair = i + 1 < n;
            const uint4* a =
                reinterpret_cast<const uint4*>(static_cast<const T*>(args.inputs[i]) + head);
            const uint4* b = reinterpret_cast<const uint4*>(
                static_cast<const T*>(args.inputs[pair ? i + 1 : i]) + head);
            uint4 x[U], y[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (v + u * threads < vectors) {
                    x[u] = a[v + u * threads];
                    if (pair) y[u] = b[v + u * threads];
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                A ax[N];
                L::unpack(x[u], ax);
                if (i == 0) {
#pragma unroll
                    for (int k = 0; k < N; ++k) acc[u][k] = ax[k];
                } else {
#pragma unroll
                    for (int k = 0; k < N; ++k) acc[u][k] = combine<D, OP>(acc[u][k], ax[k]);
                }
                if (pair) {
                    A ay[N];
                    L::unpack(y[u], ay);
#pragma unroll
                    for (int k = 0; k < N; ++k) acc[u][k] = combine<D, OP>(acc[u][k], ay[k]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (v + u * threads < vectors) {
#pragma unroll
                for (int k = 0; k < N; ++k) acc[u][k] = finish<D, OP>(acc[u][k], args);
                out[v + u * threads] = L::pack(acc[u]);
            }
        }
    }

    // The head (before the first 16-byte boundary) and the tail (after the last vector).
    const unsigned long long lead = args.head < count ? args.head : count;
    const unsigned long long body_end = lead + vectors * N;
    const unsigned long long scalars = lead + (count - body_end);
    T* out_elements = static_cast<T*>(args.output) + at;
    for (unsigned long long k = first; k < scalars; k += threads) {
        const unsigned long long e = at + (k < lead ? k : body_end + (k - lead));
        A acc = D::load(static_cast<const T*>(args.inputs[0])[e]);
        for (unsigned int i = 1; i < n; ++i)
            acc = combine<D, OP>(acc, D::load(static_cast<const T*>(args.inputs[i])[e]));
        out_elements[e - at] = D::store(finish<D, OP>(acc, args));
    }
}

template <class D, int OP>
static __device__ __forceinline__ void reduce_body(const ReduceArgs& args) {
    reduce_span<D, OP>(args, 0, args.count, args.vectors);
}

// ---- a pushed reduction's chunks in one launch -------------------------------------------
// Chunk k is the span at k * stride elements (``first`` describes chunk 0; the last chunk
// may be shorter) and may be summed once every one of this rank's pad slots ``flags``
// reaches ``value + k``: the peers' copy lanes signal each chunk's arrival there.  Thread
// 0 of every block waits for them (acquire loads, so the chunk's bytes, copied before
// the signals were written, are seen after them), the block's barrier passes that on,
// and the block sums its share.  A value of an abort (>= 2**62) ends the block: nothing more is
// written.  One launch per call instead of one per chunk: the blocks hold their SMs
// for the whole call, and the host issues one launch instead of a wait and a launch per
// chunk.
struct ChunkArgs {
    ReduceArgs first;
    const unsigned long long* flags[HOCCL_CHUNK_FLAGS];
    unsigned long long num_flags;
    unsigned long long value;
    unsigned long long chunks;
    unsigned long long stride;        // elements from one chunk to the next (whole vectors)
    unsigned long long last_count;    // the last chunk's elements
    unsigned long long last_vectors;  // and its whole vectors after the head
};

static __device__ __forceinline__ unsigned long long chunk_flag(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

template <class D, int OP>
static __device__ __forceinline__ void reduce_chunks_body(const ChunkArgs& c) {
    __shared__ int aborted;
    for (unsigned long long k = 0; k < c.chunks; ++k) {
        if (threadIdx.x == 0) {
            int stop = 0;
            for (unsigned long long f = 0; f < c.num_flags; ++f) {
                unsigned long long seen;
                while ((seen = chunk_flag(c.flags[f])) < c.value + k) {}
                stop |= seen >= (1ull << 62);
            }
            aborted = stop;
        }
        __syncthreads();
        if (aborted) return;
        const bool last = k + 1 == c.chunks;
        reduce_span<D, OP>(c.first, k * c.stride, last ? c.last_count : c.first.count,
                           last ? c.last_vectors : c.first.vectors);
        __syncthreads();  // ``aborted`` is read by every thread before thread 0 writes it again
    }
}

// ---- dst = src within one GPU ----------------------------------------------------------
template <typename V>
static __device__ __forceinline__ void copy_body(const CopyArgs& args) {
    constexpr int U = HOCCL_COPY_UNROLL;
    const unsigned long long threads = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long head = args.head;
    const unsigned long long vectors = (args.nbytes - head) / sizeof(V);
    const V* src = reinterpret_cast<const V*>(args.src + head);
    V* dst = reinterpret_cast<V*>(args.dst + head);

    for (unsigned long long v = first; v < vectors; v += U * threads) {
        V r[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (v + u * threads < vectors) r[u] = src[v + u * threads];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (v + u * threads < vectors) dst[v + u * threads] = r[u];
    }

    const unsigned long long body_end = head + vectors * sizeof(V);
    const unsigned long long scalars = head + (args.nbytes - body_end);
    for (unsigned long long k = first; k < scalars; k += threads) {
        const unsigned long long e = k < head ? k : body_end + (k - head);
        args.dst[e] = args.src[e];
    }
}
"""

_OP_ENUM = {"sum": "OP_SUM", "prod": "OP_PROD", "max": "OP_MAX", "min": "OP_MIN", "avg": "OP_AVG"}


def templates() -> str:
    """The shared part of ``source()`` without its kernels: the argument structs, the
    element types and ``reduce_body`` / ``copy_body``, for programs that wrap the same
    bodies in kernels of their own (``benchmarks/levers.py`` adds per-block timestamps)."""
    return _COMMON


def source() -> str:
    """The whole translation unit: shared templates plus one extern "C" kernel per variant."""
    kernels = []
    for dtype in DTYPES:
        for op in OPS:
            kernels.append(
                f'extern "C" __global__ void __launch_bounds__(HOCCL_REDUCE_THREADS)\n'
                f"{reduce_kernel_name(dtype, op)}(const __grid_constant__ ReduceArgs args) "
                f"{{ reduce_body<{_DTYPE_TRAITS[dtype]}, {_OP_ENUM[op]}>(args); }}\n")
    for dtype in DTYPES:
        for op in OPS:
            kernels.append(
                f'extern "C" __global__ void __launch_bounds__(HOCCL_REDUCE_THREADS)\n'
                f"{reduce_chunks_kernel_name(dtype, op)}(const __grid_constant__ ChunkArgs args) "
                f"{{ reduce_chunks_body<{_DTYPE_TRAITS[dtype]}, {_OP_ENUM[op]}>(args); }}\n")
    for width in COPY_WIDTHS:
        kernels.append(
            f'extern "C" __global__ void __launch_bounds__(HOCCL_COPY_THREADS)\n'
            f"{copy_kernel_name(width)}(const __grid_constant__ CopyArgs args) "
            f"{{ copy_body<{_COPY_VECTOR[width]}>(args); }}\n")
    return templates() + "\n" + "".join(kernels)


def reduce_launches(output: int, inputs: Sequence[int]) -> list[list[int]]:
    """The input addresses of each launch that computes ``output = op(*inputs)``, in order.

    A launch takes at most ``MAX_INPUTS`` inputs; each launch after the first takes the
    output so far as its first input and up to ``MAX_INPUTS - 1`` more.  The first launch
    overwrites ``output``, so an input that is ``output`` itself must be read by it: when
    one lies beyond the first launch, every input equal to ``output`` moves to the front
    (the others keep their order; the fold then runs in that order).
    """
    inputs = list(inputs)
    if output in inputs[MAX_INPUTS:]:
        in_place = [address for address in inputs if address == output]
        if len(in_place) > MAX_INPUTS:
            raise InvalidArgumentError(
                f"reduce: expected at most {MAX_INPUTS} inputs equal to the output (one launch "
                f"reads them before it writes the output), got {len(in_place)}")
        inputs = in_place + [address for address in inputs if address != output]
    launches = [inputs[:MAX_INPUTS]]
    for start in range(MAX_INPUTS, len(inputs), MAX_INPUTS - 1):
        launches.append([output] + inputs[start:start + MAX_INPUTS - 1])
    return launches


# ---- the direct kernel -------------------------------------------------------------------
#: most steps and reduction inputs one direct kernel takes (its argument struct stays
#: under the 4 KiB every driver accepts)
DIRECT_OPS = 48
DIRECT_INPUTS = 64
#: threads per block of the direct kernel (one block per SM)
DIRECT_THREADS = 512
#: signal words per slot: a kernel of any block count writes them all (block ``b`` the
#: words ``b, b + blocks, ...``) and a wait waits for them all, so that ranks whose kernels
#: differ in blocks (calls that differ) still meet (``sched.algorithms.KERNEL_MAX_BLOCKS``)
DIRECT_WORDS = 32


def direct_kernel_name(dtype: str, op: str) -> str:
    return f"hoccl_direct_{dtype}_{op}"


def block_range(nbytes: int, blocks: int, block: int) -> tuple:
    """The bytes ``[start, stop)`` of a data step of ``nbytes`` that block ``block`` of a
    direct kernel of ``blocks`` moves: whole 16-byte units, shared out evenly.  The same
    function of the same sizes on every rank and for every step, so a step that reads
    what an earlier one wrote (the same bytes) reads what its own block wrote."""
    units = -(-nbytes // 16)
    return (min(nbytes, units * block // blocks * 16),
            min(nbytes, units * (block + 1) // blocks * 16))


_DIRECT = r"""
// ---- the direct kernel: a whole small collective in one launch ---------------------------
// Every block runs the same list of steps on its own share of each data step
// (block_range).  A signal writes (epoch << 16) + value into the block's own words of the
// slot in the peer's pad (words b, b + blocks, ... of HOCCL_DIRECT_WORDS) after every
// thread of the block finished the earlier steps; a wait spins until every word of the
// peer's slot reaches it (one thread per word).
// ``epoch`` is this rank's count of direct kernels, kept in device memory so that a
// graph replays with fresh values.  Before each signal a block also writes the call's
// signature (a digest of what every rank must agree on) into the signal word's twin for
// the epoch's parity; a wait then compares every block's twin with its own: a peer that
// made another call is seen on the device, the kernel writes the call's value into the
// rank's ``error`` word and moves no more data (its signals and waits go on).
// The last block to finish advances the epoch and, for an eager
// call (``value`` > 0), writes the rank's completion words: the kernel then runs on the
// caller's stream with no stream operation around it.  A wait released by an abort's value
// (>= 2**62) ends the block: nothing more moves.
enum DirectKind { DIRECT_SIGNAL = 0, DIRECT_WAIT = 1, DIRECT_COPY = 2, DIRECT_REDUCE = 3 };

struct DirectOp {
    unsigned long long a;   // signal: the peer's slot (block 0's); wait: own slot; copy/reduce: dst
    unsigned long long b;   // copy: src; reduce: index of the first input in ``inputs``
    unsigned long long c;   // signal/wait: value; copy: bytes; reduce: elements
    unsigned long long sa;  // copy/reduce: added to a in odd epochs (a ring's second half)
    unsigned long long sb;  // copy: added to b in odd epochs
    unsigned int kind;
    unsigned int n;         // reduce: inputs
};

struct DirectInput {
    unsigned long long address;
    unsigned long long shift;  // added in odd epochs
};

struct DirectArgs {
    unsigned long long* counter;   // [0] epoch (>= 2**62: aborted), [1] blocks finished
    unsigned long long* completion;  // the rank's completion word (device memory)
    unsigned long long* host_word;   // its copy the host reads (mapped host memory)
    unsigned long long value;        // the call's completion value; 0: write none
    unsigned long long* error;       // mapped host word: the value of a call whose peer differed
    unsigned long long signature;    // the call's digest; 0: not checked
    unsigned long long sig_shift;    // bytes from a signal word to its signature twin (even epochs)
    unsigned long long sig_half;     // and on to the odd epochs' twin
    unsigned int num_ops;
    unsigned int divisor;          // avg
    unsigned int scaled;           // sum times ``scale``
    unsigned int unused;
    double scale;
    DirectOp ops[HOCCL_DIRECT_OPS];
    DirectInput inputs[HOCCL_DIRECT_INPUTS];
};

static __device__ __forceinline__ unsigned long long load_acquire(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void store_release(unsigned long long* p, unsigned long long v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" :: "l"(p), "l"(v) : "memory");
}

static __device__ __forceinline__ void share(unsigned long long nbytes, unsigned long long& start,
                                             unsigned long long& stop) {
    const unsigned long long units = (nbytes + 15) / 16;
    start = min(nbytes, units * blockIdx.x / gridDim.x * 16);
    stop = min(nbytes, units * (blockIdx.x + 1) / gridDim.x * 16);
}

template <typename V>
static __device__ __forceinline__ void direct_copy_as(char* dst, const char* src,
                                                      unsigned long long nbytes) {
    constexpr int U = 4;
    const unsigned long long count = nbytes / sizeof(V);
    const V* s = reinterpret_cast<const V*>(src);
    V* d = reinterpret_cast<V*>(dst);
    for (unsigned long long i = threadIdx.x; i < count; i += U * blockDim.x) {
        V r[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * blockDim.x < count) r[u] = s[i + u * blockDim.x];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (i + u * blockDim.x < count) d[i + u * blockDim.x] = r[u];
    }
}

static __device__ __forceinline__ void direct_copy(char* dst, const char* src,
                                                   unsigned long long nbytes) {
    const unsigned long long bits = (unsigned long long)dst | (unsigned long long)src | nbytes;
    if ((bits & 15) == 0) direct_copy_as<uint4>(dst, src, nbytes);
    else if ((bits & 7) == 0) direct_copy_as<uint2>(dst, src, nbytes);
    else if ((bits & 3) == 0) direct_copy_as<unsigned int>(dst, src, nbytes);
    else if ((bits & 1) == 0) direct_copy_as<unsigned short>(dst, src, nbytes);
    else direct_copy_as<unsigned char>(dst, src, nbytes);
}

template <class T>
static __device__ __forceinline__ const T* direct_input(const DirectArgs& args, unsigned int i,
                                                        unsigned long long odd) {
    return reinterpret_cast<const T*>(args.inputs[i].address + odd * args.inputs[i].shift);
}

template <class D, int OP>
static __device__ __forceinline__ void direct_reduce(const DirectArgs& args, const DirectOp& op,
                                                     unsigned long long start,
                                                     unsigned long long stop,
                                                     unsigned long long odd) {
    typedef typename D::T T;
    typedef typename D::A A;
    typedef Lanes<D> L;
    constexpr int N = L::N;
    const unsigned int n = op.n;
    const unsigned long long first = start / sizeof(T), count = (stop - start) / sizeof(T);
    T* out = reinterpret_cast<T*>(op.a + odd * op.sa) + first;
    unsigned long long bits = (unsigned long long)out | (stop - start);
    for (unsigned int i = 0; i < n; ++i)
        bits |= (unsigned long long)(direct_input<T>(args, op.b + i, odd) + first);
    if ((bits & 15) == 0) {
        // U vectors per thread, each input's U loads in flight together (a peer's input
        // is a round trip over NVLink away)
        constexpr int U = 4;
        const unsigned long long vectors = count / N;
        for (unsigned long long v = threadIdx.x; v < vectors; v += U * blockDim.x) {
            A acc[U][N];
            for (unsigned int i = 0; i < n; ++i) {
                const uint4* in =
                    reinterpret_cast<const uint4*>(direct_input<T>(args, op.b + i, odd) + first);
                uint4 x[U];
#pragma unroll
                for (int u = 0; u < U; ++u)
                    x[u] = v + u * blockDim.x < vectors ? in[v + u * blockDim.x]
                                                        : make_uint4(0, 0, 0, 0);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    A ax[N];
                    L::unpack(x[u], ax);
#pragma unroll
                    for (int k = 0; k < N; ++k)
                        acc[u][k] = i == 0 ? ax[k] : combine<D, OP>(acc[u][k], ax[k]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (v + u * blockDim.x < vectors) {
#pragma unroll
                    for (int k = 0; k < N; ++k) acc[u][k] = finish<D, OP>(acc[u][k], args);
                    reinterpret_cast<uint4*>(out)[v + u * blockDim.x] = L::pack(acc[u]);
                }
            }
        }
        return;
    }
    for (unsigned long long e = threadIdx.x; e < count; e += blockDim.x) {
        A acc = D::load((direct_input<T>(args, op.b, odd) + first)[e]);
        for (unsigned int i = 1; i < n; ++i)
            acc = combine<D, OP>(acc, D::load((direct_input<T>(args, op.b + i, odd) + first)[e]));
        out[e] = D::store(finish<D, OP>(acc, args));
    }
}

template <class D, int OP>
static __device__ __forceinline__ void direct_body(const DirectArgs& args) {
    __shared__ unsigned long long epoch;
    __shared__ int poisoned;
    __shared__ int differs;
    bool moving = true;  // false once a peer was seen making another call
    if (threadIdx.x == 0) epoch = *reinterpret_cast<volatile unsigned long long*>(args.counter);
    __syncthreads();
    if (epoch >= (1ull << 46)) return;  // aborted (the pad holds the abort value)
    const unsigned long long base = epoch << 16;
    const unsigned long long odd = epoch & 1;  // the rings' half this call uses
    for (unsigned int i = 0; i < args.num_ops; ++i) {
        const DirectOp& op = args.ops[i];
        if (op.kind == DIRECT_SIGNAL) {
            __syncthreads();
            const unsigned int w = blockIdx.x + threadIdx.x * gridDim.x;  // this thread's word
            if (w < HOCCL_DIRECT_WORDS) {
                unsigned long long* word = reinterpret_cast<unsigned long long*>(op.a) + w;
                *reinterpret_cast<volatile unsigned long long*>(
                    reinterpret_cast<char*>(word) + args.sig_shift + odd * args.sig_half) =
                    args.signature;
                __threadfence_system();
                store_release(word, base + op.c);
            }
        } else if (op.kind == DIRECT_WAIT) {
            if (threadIdx.x == 0) poisoned = differs = 0;
            __syncthreads();
            if (threadIdx.x < HOCCL_DIRECT_WORDS) {
                const unsigned long long* slot =
                    reinterpret_cast<const unsigned long long*>(op.a) + threadIdx.x;
                unsigned long long seen;
                while ((seen = load_acquire(slot)) < base + op.c) {
                }
                if (seen >= (1ull << 62)) poisoned = 1;
                else if (args.signature &&
                         *reinterpret_cast<const volatile unsigned long long*>(
                             reinterpret_cast<const char*>(slot) + args.sig_shift +
                             odd * args.sig_half) != args.signature)
                    differs = 1;
            }
            __syncthreads();
            // released by an abort's value, not by the peer: move nothing more (the peer's
            // memory may already be someone else's)
            if (poisoned) return;
            if (differs && moving) {  // every block read the same twins: all stop moving
                moving = false;
                if (threadIdx.x == 0 && blockIdx.x == 0) {
                    __threadfence_system();
                    *reinterpret_cast<volatile unsigned long long*>(args.error) =
                        args.value ? args.value : (1ull << 61);
                }
            }
        } else if (moving) {
            unsigned long long start, stop;
            share(op.kind == DIRECT_COPY ? op.c : op.c * sizeof(typename D::T), start, stop);
            if (start < stop) {
                if (op.kind == DIRECT_COPY)
                    direct_copy(reinterpret_cast<char*>(op.a + odd * op.sa) + start,
                                reinterpret_cast<const char*>(op.b + odd * op.sb) + start,
                                stop - start);
                else
                    direct_reduce<D, OP>(args, op, start, stop, odd);
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        if (atomicAdd(args.counter + 1, 1ull) == gridDim.x - 1) {
            args.counter[1] = 0;
            atomicCAS(args.counter, epoch, epoch + 1);  // not over an abort value
            if (args.value) {  // every block's work is visible (their fences, the counter)
                __threadfence_system();
                // never over an abort value; the host's word first: a later call on another
                // stream starts once the completion word has the value, and its own value
                // in the host's word must not be overwritten by this one
                if (*reinterpret_cast<volatile unsigned long long*>(args.completion)
                        < (1ull << 62)) {
                    store_release(args.host_word, args.value);
                    __threadfence_system();
                    atomicMax(args.completion, args.value);
                }
            }
        }
    }
}
"""


def direct_source(dtype: str, op: str) -> str:
    """One direct kernel (``dtype``, ``op``: its reductions; a plan that only copies uses
    any), with the shared templates, for NVRTC."""
    return (templates() + _DIRECT
            + f'extern "C" __global__ void __launch_bounds__({DIRECT_THREADS})\n'
            f"{direct_kernel_name(dtype, op)}(const __grid_constant__ DirectArgs args) "
            f"{{ direct_body<{_DTYPE_TRAITS[dtype]}, {_OP_ENUM[op]}>(args); }}\n")


def direct_compile_options() -> list:
    return compile_options() + [f"-DHOCCL_DIRECT_OPS={DIRECT_OPS}",
                                f"-DHOCCL_DIRECT_WORDS={DIRECT_WORDS}",
                                f"-DHOCCL_DIRECT_INPUTS={DIRECT_INPUTS}"]
