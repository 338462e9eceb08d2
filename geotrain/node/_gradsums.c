/* A stage's float64 gradient sums in one pass over memory, for geotrain.node.stage.StageRuntime.
 *
 * Each counted microbatch adds its float32 parameter gradients into float64 sums (stage.py says why), and the
 * commit rounds the sums' mean to float32. torch does the add as a mixed-dtype add_ (its TensorIterator converts
 * the float32 operand chunk by chunk before adding), and the mean as a float64 div_ and a cast: several passes over
 * tensors that are far larger than the caches, which made the sums cost a third of a CPU stage's backward on a 50M
 * model. Here each is one pass, computing what torch computes, operation for operation, in IEEE double:
 *
 *     accumulate(sums, grads, first)   sums = 0.0 + (double)grads  (first)   or   sums += (double)grads
 *     mean_squares(out, sums, count)   out = (float)(sums / count)           round to nearest even, once
 *                                      sums = (double)out * (double)out      exact: 24-bit significands
 *     accumulate_mean_squares(sums, grads, out, first, count)   the two above, element by element: a stage that
 *                                      takes its mean as it adds its last microbatch passes over the sums once
 *
 * The mean leaves its squares in the sums, which it was the last to read: the gradient norm's parts are their
 * sums (torch's sum over the same float64 values, so the same bits as torch's g.double().pow(2).sum()), with no
 * float64 copies of the gradients to allocate and fill.
 * (0.0 + x: torch's sums start as zeros, so a gradient's -0.0 sums to +0.0 here as there.) The module is optional:
 * where it was not built (no C compiler at install), the stage uses the torch ops, which give the same bits
 * (tests/test_node_runtime.py checks it). The GIL is released throughout.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* As _blockquant.c: an AVX2 copy of each loop on Linux x86-64, picked by the loader; both compute the same bits. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GNUC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define TARGET_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef TARGET_CLONES
#define TARGET_CLONES
#endif

TARGET_CLONES static void add_floats(double *restrict sums, const float *restrict grads, int64_t n, int first) {
    if (first) {
        for (int64_t i = 0; i < n; i++) sums[i] = 0.0 + (double)grads[i];
    } else {
        for (int64_t i = 0; i < n; i++) sums[i] += (double)grads[i];
    }
}

/* Store sum / count rounded to float32 in *out and return that mean's square in float64. */
static inline double mean_square(float *out, double sum, double count) {
    const float mean = (float)(sum / count);
    *out = mean;
    return (double)mean * (double)mean;
}

TARGET_CLONES static void round_mean(float *restrict out, double *restrict sums, int64_t n, double count) {
    for (int64_t i = 0; i < n; i++) sums[i] = mean_square(&out[i], sums[i], count);
}

TARGET_CLONES static void add_and_mean(double *restrict sums, const float *restrict grads, float *restrict out,
                                      int64_t n, int first, double count) {
    for (int64_t i = 0; i < n; i++) {
        sums[i] = mean_square(&out[i], first ? 0.0 + (double)grads[i] : sums[i] + (double)grads[i], count);
    }
}

/* The buffers' lengths in elements, equal, or -1 with a ValueError set. */
static int64_t matching(const Py_buffer *doubles, const Py_buffer *floats) {
    if (doubles->len % 8 || floats->len % 4 || doubles->len / 8 != floats->len / 4) {
        PyErr_Format(PyExc_ValueError, "%zd bytes of float64 and %zd bytes of float32 are not the same elements",
                     doubles->len, floats->len);
        return -1;
    }
    return floats->len / 4;
}

PyDoc_STRVAR(accumulate_doc,
             "accumulate(sums, grads, first): sums (a writable contiguous float64 buffer) = 0.0 + grads (first) or\n"
             "sums + grads, elementwise in float64; grads: a contiguous float32 buffer of as many elements.");

static PyObject *accumulate(PyObject *self, PyObject *args) {
    Py_buffer sums, grads;
    int first;
    if (!PyArg_ParseTuple(args, "w*y*p", &sums, &grads, &first)) return NULL;
    const int64_t n = matching(&sums, &grads);
    if (n >= 0) {
        Py_BEGIN_ALLOW_THREADS
        add_floats(sums.buf, grads.buf, n, first);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&sums);
    PyBuffer_Release(&grads);
    if (n < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(mean_squares_doc,
             "mean_squares(out, sums, count): out (a writable contiguous float32 buffer) = sums / count rounded to\n"
             "float32, then sums (a writable contiguous float64 buffer of as many elements) = out * out in float64,\n"
             "elementwise; count > 0.");

static PyObject *mean_squares(PyObject *self, PyObject *args) {
    Py_buffer out, sums;
    long long count;
    if (!PyArg_ParseTuple(args, "w*w*L", &out, &sums, &count)) return NULL;
    int64_t n = matching(&sums, &out);
    if (n >= 0 && count <= 0) {
        PyErr_Format(PyExc_ValueError, "a mean over %lld microbatches", count);
        n = -1;
    }
    if (n >= 0) {
        Py_BEGIN_ALLOW_THREADS
        round_mean(out.buf, sums.buf, n, (double)count);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&sums);
    if (n < 0) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(accumulate_mean_squares_doc,
             "accumulate_mean_squares(sums, grads, out, first, count): accumulate(sums, grads, first), then\n"
             "mean_squares(out, sums, count), in one pass.");

static PyObject *accumulate_mean_squares(PyObject *self, PyObject *args) {
    Py_buffer sums, grads, out;
    int first;
    long long count;
    if (!PyArg_ParseTuple(args, "w*y*w*pL", &sums, &grads, &out, &first, &count)) return NULL;
    int64_t n = matching(&sums, &grads);
    if (n >= 0 && matching(&sums, &out) < 0) n = -1;
    if (n >= 0 && count <= 0) {
        PyErr_Format(PyExc_ValueError, "a mean over %lld microbatches", count);
        n = -1;
    }
    if (n >= 0) {
        Py_BEGIN_ALLOW_THREADS
        add_and_mean(sums.buf, grads.buf, out.buf, n, first, (double)count);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&sums);
    PyBuffer_Release(&grads);
    PyBuffer_Release(&out);
    if (n < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"accumulate", accumulate, METH_VARARGS, accumulate_doc},
    {"mean_squares", mean_squares, METH_VARARGS, mean_squares_doc},
    {"accumulate_mean_squares", accumulate_mean_squares, METH_VARARGS, accumulate_mean_squares_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "geotrain.node._gradsums",
    "A stage's float64 gradient sums, their float32 mean and its squares, one pass each; see _gradsums.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__gradsums(void) { return PyModule_Create(&module); }
