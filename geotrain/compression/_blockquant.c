/* int8 blockwise absmax (de)quantisation in one pass over the data, for geotrain.compression.codecs.Int8Codec.
 *
 * The torch path takes five whole-tensor passes (absmax bits, reduction, multiply, round, cast) and reaches about a
 * tenth of memcpy's speed on an activation that fits in the caches; here the data is read from memory once, a group
 * of blocks at a time that is reduced and quantised while it sits in L1. The arithmetic is the torch path's,
 * operation for operation and in float32, so both write the same bytes (tests/test_compression.py checks it):
 *
 *     scale = max(absmax, 127 * 2^-120) / 127       absmax from the bits with the sign cleared: NaN above Inf
 *     q     = round(x * (1 / scale))                 half to even; |x * (1 / scale)| <= 127
 *     x'    = (float)q * scale
 *
 * The module is optional: where it was not built (no C compiler at install), the codec uses the torch path. It also
 * holds all_finite, the receiving stage's test of a float tensor for NaN and Inf (at the end of this file).
 * Work is split over `threads` POSIX threads (the caller passes torch's intra-op thread count) once a tensor is large
 * enough that a thread start costs less than its share; the GIL is released throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#define HAVE_THREADS 1
#endif

#define QMAX 127
#define ROUND_MAGIC 12582912.0f
/* The codec's default block size, which gets code specialised for it. */
#define COMMON_BLOCK 64

/* x86-64's baseline vector unit is SSE2 (4 floats, no unsigned max); on Linux, where the compiler can, it also builds
 * an AVX2 copy of the hot loops and the loader (an ifunc) picks the copy this CPU runs. Both compute the same bits. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef TARGET_CLONES
#define TARGET_CLONES
#endif

#define MAX_THREADS 64
/* Values per thread below which another thread does not pay for its start (tens of microseconds). */
#define MIN_PER_THREAD (1 << 17)

typedef struct {
    float *values; /* read by encode, written by decode */
    float *scales;
    int8_t *codes;
    int64_t numel, block, first_block, end_block;
    int finite; /* out: no NaN or Inf among the blocks */
} Job;

static inline float scale_of(uint32_t absmax_bits) {
    float absmax;
    memcpy(&absmax, &absmax_bits, sizeof absmax);
    const float floor_ = QMAX * 0x1p-120f;
    /* NaN must survive: comparisons with NaN are false, so it is the one left standing. */
    return (absmax < floor_ ? floor_ : absmax) / (float)QMAX;
}

static inline uint32_t absmax_bits(const float *restrict x, int64_t len) {
    uint32_t m = 0;
    for (int64_t i = 0; i < len; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, sizeof bits);
        bits &= 0x7FFFFFFFu;
        m = bits > m ? bits : m;
    }
    return m;
}

static inline void quantize(const float *restrict x, float inverse, int8_t *restrict q, int64_t len) {
    /* Adding and subtracting 1.5 * 2^23 rounds |v| < 2^22 to the nearest integer, ties to even, as rintf does, in
     * two plain float operations that every vector unit has (SSE2 has no rounding instruction); the truncating
     * conversion of an integer-valued float is exact. Built with -ffp-contract=off: an FMA would round once. */
    for (int64_t i = 0; i < len; i++) q[i] = (int8_t)(int32_t)((x[i] * inverse + ROUND_MAGIC) - ROUND_MAGIC);
}

static inline void decode_block(const int8_t *restrict q, float scale, float *restrict x, int64_t len) {
    for (int64_t i = 0; i < len; i++) x[i] = (float)q[i] * scale;
}

/* Blocks go in groups: the absmax of every block of a group, then their scales and inverses together (vector
 * divisions instead of two dependent scalar ones per block), then the quantisation, while the group is in L1. */
#define GROUP 32

TARGET_CLONES static void encode_blocks(Job *job) {
    uint32_t finite_bits = 0;
    for (int64_t g = job->first_block; g < job->end_block; g += GROUP) {
        const int64_t count = g + GROUP <= job->end_block ? GROUP : job->end_block - g;
        uint32_t absmax[GROUP];
        float inverse[GROUP];
        float *scales = job->scales + g;
        for (int64_t b = 0; b < count; b++) {
            const int64_t start = (g + b) * job->block;
            const int64_t len = start + job->block <= job->numel ? job->block : job->numel - start;
            absmax[b] = len == COMMON_BLOCK ? absmax_bits(job->values + start, COMMON_BLOCK)
                                            : absmax_bits(job->values + start, len);
        }
        for (int64_t b = 0; b < count; b++) {
            finite_bits |= absmax[b] >= 0x7F800000u;
            scales[b] = scale_of(absmax[b]);
            inverse[b] = 1.0f / scales[b];
        }
        for (int64_t b = 0; b < count; b++) {
            const int64_t start = (g + b) * job->block;
            const int64_t len = start + job->block <= job->numel ? job->block : job->numel - start;
            if (len == COMMON_BLOCK) quantize(job->values + start, inverse[b], job->codes + start, COMMON_BLOCK);
            else quantize(job->values + start, inverse[b], job->codes + start, len);
        }
    }
    job->finite = !finite_bits;
}

TARGET_CLONES static void decode_blocks(Job *job) {
    for (int64_t b = job->first_block; b < job->end_block; b++) {
        const int64_t start = b * job->block;
        const int64_t len = start + job->block <= job->numel ? job->block : job->numel - start;
        const int8_t *q = job->codes + start;
        float *x = job->values + start;
        if (len == COMMON_BLOCK) decode_block(q, job->scales[b], x, COMMON_BLOCK);
        else decode_block(q, job->scales[b], x, len);
    }
}

#ifdef HAVE_THREADS
static void *run_encode(void *job) { encode_blocks(job); return NULL; }
static void *run_decode(void *job) { decode_blocks(job); return NULL; }
#endif

/* Split the blocks over up to `threads` jobs and run them; returns 1 when every job saw only finite values. */
static int run_jobs(Job base, int64_t threads, int encode) {
    const int64_t blocks = (base.numel + base.block - 1) / base.block;
    int64_t n = base.numel / MIN_PER_THREAD;
    if (n > threads) n = threads;
    if (n > MAX_THREADS) n = MAX_THREADS;
    if (n > blocks) n = blocks;
    if (n < 1) n = 1;
#ifndef HAVE_THREADS
    n = 1;
#endif
    Job jobs[MAX_THREADS];
    for (int64_t t = 0; t < n; t++) {
        jobs[t] = base;
        jobs[t].first_block = blocks * t / n;
        jobs[t].end_block = blocks * (t + 1) / n;
        jobs[t].finite = 1;
    }
#ifdef HAVE_THREADS
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 1; t < n; t++)
        started[t] = pthread_create(&ids[t], NULL, encode ? run_encode : run_decode, &jobs[t]) == 0;
    /* A thread that could not start leaves its blocks to this one. */
    for (int64_t t = 0; t < n; t++) {
        if (t == 0 || !started[t]) {
            if (encode) encode_blocks(&jobs[t]); else decode_blocks(&jobs[t]);
        }
    }
    for (int64_t t = 1; t < n; t++)
        if (started[t]) pthread_join(ids[t], NULL);
#else
    if (encode) encode_blocks(&jobs[0]); else decode_blocks(&jobs[0]);
#endif
    int finite = 1;
    for (int64_t t = 0; t < n; t++) finite &= jobs[t].finite;
    return finite;
}

PyDoc_STRVAR(int8_encode_doc,
             "int8_encode(values, block, offset, threads) -> bytearray | None\n\n"
             "Quantise the float32 `values` block by block into a new bytearray: `offset` bytes left for the\n"
             "caller's header, then one float32 scale per block, then one int8 code per value. None when a block\n"
             "holds NaN or Inf.");

static PyObject *int8_encode(PyObject *self, PyObject *args) {
    Py_buffer values;
    long long block, offset, threads;
    if (!PyArg_ParseTuple(args, "y*LLL", &values, &block, &offset, &threads)) return NULL;
    PyObject *payload = NULL;
    if (block < 1 || offset < 0 || values.len % 4) {
        PyErr_SetString(PyExc_ValueError, "block must be positive, offset not negative, values whole float32s");
    } else {
        const int64_t numel = values.len / 4, blocks = (numel + block - 1) / block;
        /* Left uninitialised (no zero-fill, a tenth of the encode): every byte past the offset is written below, and
         * the caller writes the header. */
        payload = PyByteArray_FromStringAndSize(NULL, offset + 4 * blocks + numel);
        if (payload != NULL) {
            char *body = PyByteArray_AS_STRING(payload) + offset;
            Job job = {values.buf, (float *)body, (int8_t *)(body + 4 * blocks), numel, block, 0, 0, 1};
            int finite;
            Py_BEGIN_ALLOW_THREADS
            finite = run_jobs(job, threads, 1);
            Py_END_ALLOW_THREADS
            if (!finite) {
                Py_DECREF(payload);
                payload = Py_NewRef(Py_None);
            }
        }
    }
    PyBuffer_Release(&values);
    return payload;
}

PyDoc_STRVAR(int8_decode_doc,
             "int8_decode(codes, scales, block, out, threads) -> None\n\n"
             "Dequantise int8 `codes` with their float32 block `scales` into the writable float32 buffer `out`.");

static PyObject *int8_decode(PyObject *self, PyObject *args) {
    Py_buffer codes, scales, out;
    long long block, threads;
    if (!PyArg_ParseTuple(args, "y*y*Lw*L", &codes, &scales, &block, &out, &threads)) return NULL;
    const int64_t numel = codes.len;
    const int fits = block >= 1 && out.len == numel * 4 && scales.len == (numel + block - 1) / block * 4;
    if (fits) {
        Job job = {out.buf, scales.buf, codes.buf, numel, block, 0, 0, 1};
        Py_BEGIN_ALLOW_THREADS
        run_jobs(job, threads, 0);
        Py_END_ALLOW_THREADS
    } else {
        PyErr_Format(PyExc_ValueError, "buffer sizes (%zd, %zd, %zd bytes) do not fit %lld values in blocks of %lld",
                     codes.len, scales.len, out.len, (long long)numel, block);
    }
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&out);
    if (!fits) return NULL;
    Py_RETURN_NONE;
}

/* Whether no value of a floating-point buffer is NaN or Inf, read as integers of the format's width: `exponent` is
 * its exponent mask, and (x & exponent) + its lowest bit reaches the bit above the mask (the sign bit) only where
 * every exponent bit is set, so a block's OR of those sums tells without a compare. A received activation's one
 * pass (node/servicer.py's all_finite), where the torch path sums it; it stops at the first block that holds one. */
#define FINITE_BLOCK 4096
#define FINITE_KERNEL(name, type)                                                                                   \
    TARGET_CLONES static int name(const type *restrict x, int64_t n, type exponent) {                              \
        const type lowest = exponent & (type)(~exponent + 1), above = exponent + lowest;                            \
        for (int64_t start = 0; start < n; start += FINITE_BLOCK) {                                                 \
            const int64_t end = n - start < FINITE_BLOCK ? n : start + FINITE_BLOCK;                                \
            type seen = 0;                                                                                          \
            for (int64_t i = start; i < end; i++) seen |= (type)((x[i] & exponent) + lowest);                       \
            if (seen & above) return 0;                                                                             \
        }                                                                                                           \
        return 1;                                                                                                   \
    }
FINITE_KERNEL(finite16, uint16_t)
FINITE_KERNEL(finite32, uint32_t)
FINITE_KERNEL(finite64, uint64_t)

PyDoc_STRVAR(all_finite_doc,
             "all_finite(values, width, exponent) -> bool: no element of `values` (a contiguous buffer of `width`-byte\n"
             "floats: 2, 4 or 8) has every bit of `exponent` set (its format's exponent mask: NaN or Inf).");

static PyObject *all_finite(PyObject *self, PyObject *args) {
    Py_buffer values;
    Py_ssize_t width;
    unsigned long long exponent;
    if (!PyArg_ParseTuple(args, "y*nK", &values, &width, &exponent)) return NULL;
    if ((width != 2 && width != 4 && width != 8) || values.len % width) {
        PyBuffer_Release(&values);
        return PyErr_Format(PyExc_ValueError, "%zd bytes are not a whole number of 2-, 4- or 8-byte floats (%zd)",
                            values.len, width);
    }
    const int64_t n = values.len / width;
    int finite;
    Py_BEGIN_ALLOW_THREADS
    if (width == 2) finite = finite16(values.buf, n, (uint16_t)exponent);
    else if (width == 4) finite = finite32(values.buf, n, (uint32_t)exponent);
    else finite = finite64(values.buf, n, (uint64_t)exponent);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&values);
    return PyBool_FromLong(finite);
}

static PyMethodDef methods[] = {
    {"int8_encode", int8_encode, METH_VARARGS, int8_encode_doc},
    {"int8_decode", int8_decode, METH_VARARGS, int8_decode_doc},
    {"all_finite", all_finite, METH_VARARGS, all_finite_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "geotrain.compression._blockquant",
    "int8 blockwise absmax (de)quantisation in one pass, and a float buffer's finiteness; see _blockquant.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__blockquant(void) { return PyModule_Create(&module); }
