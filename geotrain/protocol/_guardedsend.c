/* A stage's live tensor sent on a state stream without the GIL, for geotrain.node.handover.StateSnapshot.
 *
 * A snapshot sends each tensor from the stage's own memory until the stage is about to change it; the sender runs at
 * the lowest CPU priority (SCHED_IDLE). In python it takes the GIL for every chunk it copies and sends, and while it
 * waits for a core with the GIL requested, the node's compute thread, made to hand the GIL over, waits with it (CPython
 * hands the GIL to the thread that asked). Here a tensor is sent in one call that holds neither the GIL nor a
 * lock the stage waits for: each piece is copied out and then sent only if the snapshot's guard still reads 0, the
 * reading side of a seqlock whose writer (StateSnapshot.preserve) sets the guard, keeps the unsent tensors in a file,
 * and only then lets the stage change them. A piece copied while the stage changed it is never sent: the guard read
 * after the copy sees the change coming.
 *
 * The module is optional: where it was not built, the snapshot copies chunk by chunk in python under its lock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

/* Send n bytes on fd (blocking or not), each wait for room bounded by timeout_ms; 0 or an errno. */
static int send_all(int fd, const char *data, size_t n, int timeout_ms) {
    size_t off = 0;
    while (off < n) {
        ssize_t k = send(fd, data + off, n - off, MSG_NOSIGNAL);
        if (k >= 0) {
            off += (size_t)k;
            continue;
        }
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return errno;
        struct pollfd p = {fd, POLLOUT, 0};
        int ready = poll(&p, 1, timeout_ms);
        if (ready == 0)
            return ETIMEDOUT;
        if (ready < 0 && errno != EINTR)
            return errno;
    }
    return 0;
}

PyDoc_STRVAR(send_unchanged_doc,
"send_unchanged(fd, source, guard, piece_bytes, timeout_s) -> int\n\n"
"Send the bytes of `source` (a contiguous buffer) on the stream socket `fd`, `piece_bytes` at a time, each piece\n"
"copied out first and sent only while the int64 `guard` reads 0 after its copy; returns how many bytes were sent\n"
"(less than all once the guard was set). Each wait for the socket to take more is bounded by `timeout_s`\n"
"(TimeoutError); other socket errors raise OSError. The GIL is released throughout.");

static PyObject *send_unchanged(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer source, guard;
    Py_ssize_t piece;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "iy*w*nd", &fd, &source, &guard, &piece, &timeout_s))
        return NULL;
    PyObject *result = NULL;
    char *copy = NULL;
    if (guard.len < (Py_ssize_t)sizeof(int64_t) || ((uintptr_t)guard.buf % sizeof(int64_t)) != 0) {
        PyErr_SetString(PyExc_ValueError, "guard must be an aligned int64");
        goto done;
    }
    if (piece <= 0 || !(timeout_s > 0) || timeout_s > 1e6) {
        PyErr_SetString(PyExc_ValueError, "piece_bytes and timeout_s must be positive");
        goto done;
    }
    copy = malloc((size_t)piece);
    if (copy == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const char *data = source.buf;
    const int64_t *flag = guard.buf;
    int timeout_ms = (int)(timeout_s * 1000.0);
    Py_ssize_t sent = 0;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    while (sent < source.len) {
        size_t n = (size_t)(source.len - sent < piece ? source.len - sent : piece);
        memcpy(copy, data + sent, n);
        /* The copy's loads come before the guard's: a writer that set it before changing the data is seen. */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(flag, __ATOMIC_RELAXED) != 0)
            break;
        err = send_all(fd, copy, n, timeout_ms);
        if (err != 0)
            break;
        sent += (Py_ssize_t)n;
    }
    Py_END_ALLOW_THREADS
    if (err == ETIMEDOUT)
        PyErr_SetString(PyExc_TimeoutError, "the receiver took nothing in time");
    else if (err != 0) {
        errno = err;
        PyErr_SetFromErrno(PyExc_OSError);
    } else
        result = PyLong_FromSsize_t(sent);
done:
    free(copy);
    PyBuffer_Release(&source);
    PyBuffer_Release(&guard);
    return result;
}

static PyMethodDef methods[] = {
    {"send_unchanged", send_unchanged, METH_VARARGS, send_unchanged_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_guardedsend", "A live tensor sent on a state stream without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__guardedsend(void) { return PyModule_Create(&module); }
