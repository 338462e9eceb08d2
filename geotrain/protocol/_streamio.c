/* A raw tensor stream's socket calls without TLS (protocol/tensorstream.py): a payload received in full, a message (a
 * frame, a reply) read, and a sender's frame, payload and reply, each one C call that releases the GIL for its system
 * calls.
 *
 * Python's socket methods make one system call per Python call, and a tensor's receive or send is a loop of them
 * with its checks in the interpreter, run cache-cold after each payload's copy (bench/tensor_path.py). These do what
 * tensorstream's Python loops do on a blocking socket bounded by the kernel's timeouts (SO_RCVTIMEO, SO_SNDTIMEO:
 * tensorstream.bound_calls), and raise what they raise: TimeoutError (socket.timeout) at a timeout, OSError on an
 * error. The Python loops remain for TLS sockets and where this is not built (setup.py: optional).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <time.h>

/* An error of a socket call as Python's socket module raises it: a timeout where the kernel's ran out. */
static PyObject *socket_error(int err) {
    if (err == EAGAIN || err == EWOULDBLOCK) return PyErr_Format(PyExc_TimeoutError, "timed out");
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

/* Fill `n` bytes at `at` from the blocking socket `fd` (timeouts before the first byte waited out with `idle`);
 * the bytes filled, fewer only where the stream ended, or -1 with an exception set. */
static Py_ssize_t fill(int fd, char *at, Py_ssize_t n, int idle) {
    Py_ssize_t filled = 0;
    while (filled < n) {
        ssize_t got;
        int err;
        /* MSG_WAITALL: one system call however many segments the bytes come in, short only at the end of the stream,
         * a timeout or a signal. */
        Py_BEGIN_ALLOW_THREADS
        got = recv(fd, at + filled, (size_t)(n - filled), MSG_WAITALL);
        err = errno;
        Py_END_ALLOW_THREADS
        if (got > 0) {
            filled += got;
        } else if (got == 0) {
            break; /* the stream ended */
        } else if (err == EINTR) {
            if (PyErr_CheckSignals()) return -1;
        } else if (!(idle && filled == 0 && (err == EAGAIN || err == EWOULDBLOCK))) {
            socket_error(err);
            return -1;
        }
    }
    return filled;
}

PyDoc_STRVAR(recv_exact_doc,
             "recv_exact(fd, buffer, idle) -> int: fill the writable `buffer` from the blocking socket `fd`; the bytes\n"
             "filled, fewer than asked only where the stream ended. With `idle`, timeouts before the first byte are\n"
             "waited out (a kept connection between tensors); any other raises TimeoutError.");

static PyObject *recv_exact(PyObject *self, PyObject *args) {
    int fd, idle;
    Py_buffer view;
    if (!PyArg_ParseTuple(args, "iw*p", &fd, &view, &idle)) return NULL;
    const Py_ssize_t filled = fill(fd, view.buf, view.len, idle);
    PyBuffer_Release(&view);
    return filled < 0 ? NULL : PyLong_FromSsize_t(filled);
}

/* EOFError, as tensorstream's Closed says it, where `filled` of `n` bytes came before the stream ended. */
static PyObject *ended(Py_ssize_t filled, Py_ssize_t n) {
    if (filled) return PyErr_Format(PyExc_EOFError, "the stream ended %zd bytes short", n - filled);
    return PyErr_Format(PyExc_EOFError, "the stream ended");
}

/* One message off `fd`: a 4-byte little-endian length and that many bytes (see recv_message). */
static PyObject *read_message(int fd, Py_ssize_t limit, int idle) {
    unsigned char prefix[4];
    Py_ssize_t filled = fill(fd, (char *)prefix, sizeof prefix, idle);
    if (filled < 0) return NULL;
    if (filled < (Py_ssize_t)sizeof prefix) return ended(filled, sizeof prefix);
    const uint32_t length = prefix[0] | prefix[1] << 8 | prefix[2] << 16 | (uint32_t)prefix[3] << 24;
    if ((uint64_t)length > (uint64_t)limit)
        return PyErr_Format(PyExc_ValueError, "a message of %lu bytes on a tensor stream", (unsigned long)length);
    PyObject *data = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
    if (data == NULL) return NULL;
    filled = fill(fd, PyBytes_AS_STRING(data), (Py_ssize_t)length, 0);
    if (filled == (Py_ssize_t)length) return data;
    Py_DECREF(data);
    return filled < 0 ? NULL : ended(filled, (Py_ssize_t)length);
}

PyDoc_STRVAR(recv_message_doc,
             "recv_message(fd, limit, idle) -> bytes: one message off the blocking socket `fd`, as a 4-byte\n"
             "little-endian length and that many bytes; ValueError, with nothing more read, where the length is over\n"
             "`limit`; EOFError where the stream ends first. `idle` as recv_exact's, for the length's first byte.");

static PyObject *recv_message(PyObject *self, PyObject *args) {
    int fd, idle;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "inp", &fd, &limit, &idle)) return NULL;
    return read_message(fd, limit, idle);
}

static double monotonic_s(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* what python's time.monotonic reads on Linux */
    return (double)now.tv_sec + now.tv_nsec * 1e-9;
}

/* Bound the socket's sends and receives by the time left to `deadline` (at least a millisecond), as tensorstream's
 * _Connection._bound does: `*timeout` is what they are bounded by now (0: not yet), kept while within a tenth of the
 * time left, since setting it costs system calls. 0, or -1 with an exception set. */
static int bound(int fd, double deadline, double *timeout) {
    double left = deadline - monotonic_s();
    if (left < 1e-3) left = 1e-3;
    if (0.9 * *timeout <= left && left <= 1.1 * *timeout) return 0;
    const long long microseconds = (long long)(left * 1e6 + 0.5);
    struct timeval value = {(time_t)(microseconds / 1000000), (suseconds_t)(microseconds % 1000000)};
    if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &value, sizeof value) ||
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &value, sizeof value)) {
        socket_error(errno);
        return -1;
    }
    *timeout = left;
    return 0;
}

PyDoc_STRVAR(exchange_doc,
             "exchange(fd, head, payload, deadline, timeout, limit) -> (bytes, float): a sender's tensor on the\n"
             "blocking socket `fd`: `head` then `payload` (contiguous buffers), in one system call where the socket\n"
             "takes them, then the receiver's reply (recv_message's, up to `limit` bytes). Every call is bounded by the\n"
             "time left to `deadline` (time.monotonic) in the kernel (SO_SNDTIMEO, SO_RCVTIMEO), `timeout` being what\n"
             "they are set to now (0: not yet), set again where it is not within a tenth of the time left; the reply,\n"
             "and what they are set to after. TimeoutError at a timeout, EOFError and ValueError as recv_message's.");

static PyObject *exchange(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer head, payload;
    double deadline, timeout;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "iy*y*ddn", &fd, &head, &payload, &deadline, &timeout, &limit)) return NULL;
    struct iovec parts[2] = {{head.buf, (size_t)head.len}, {payload.buf, (size_t)payload.len}};
    struct msghdr message = {0};
    message.msg_iov = parts;
    message.msg_iovlen = 2;
    PyObject *reply = NULL;
    /* A blocking socket's send returns short only at its timeout (or a signal): the rest goes in calls bounded by
     * the time left, as a python timeout bounds sendall, until the deadline has passed. */
    for (int calls = 0; message.msg_iovlen; calls++) {
        ssize_t sent;
        int err;
        if (calls && monotonic_s() >= deadline) {
            PyErr_SetString(PyExc_TimeoutError, "timed out");
            goto done;
        }
        if (bound(fd, deadline, &timeout)) goto done;
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(fd, &message, MSG_NOSIGNAL);
        err = errno;
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (err != EINTR) {
                socket_error(err);
                goto done;
            }
            if (PyErr_CheckSignals()) goto done;
            continue;
        }
        while (message.msg_iovlen && (size_t)sent >= message.msg_iov->iov_len) {
            sent -= (ssize_t)message.msg_iov->iov_len;
            message.msg_iov++;
            message.msg_iovlen--;
        }
        if (message.msg_iovlen) {
            message.msg_iov->iov_base = (char *)message.msg_iov->iov_base + sent;
            message.msg_iov->iov_len -= (size_t)sent;
        }
    }
    if (bound(fd, deadline, &timeout)) goto done;
    reply = read_message(fd, limit, 0);
done:
    PyBuffer_Release(&head);
    PyBuffer_Release(&payload);
    if (reply == NULL) return NULL;
    return Py_BuildValue("(Nd)", reply, timeout);
}

static PyMethodDef methods[] = {
    {"recv_exact", recv_exact, METH_VARARGS, recv_exact_doc},
    {"recv_message", recv_message, METH_VARARGS, recv_message_doc},
    {"exchange", exchange, METH_VARARGS, exchange_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "geotrain.protocol._streamio",
    "A raw tensor stream's receive and send without TLS, one C call each; see _streamio.c.", -1, methods,
};

PyMODINIT_FUNC PyInit__streamio(void) { return PyModule_Create(&module); }
