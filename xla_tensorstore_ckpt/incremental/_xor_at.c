/* The apply loop of a sparse delta (kind 2, `deltas._apply_sparse8`), fused: each changed element's position
 * from its one-byte gap (or the long gap listed for it), then the XOR in place, in one pass over the frame and
 * without the GIL. numpy takes five passes and two index arrays for the same (widen, add up, gather, XOR,
 * scatter: ~3.3 ns per changed element; ~1.8 here inside a restore at 8 % of a chunk's elements changed, about
 * what touching each of its cache lines costs). Built where a C compiler is (optional: without it, `deltas`
 * applies the same frames with numpy). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* The long gaps' lists follow the values in the frame: not aligned for uint32 where the values are bytes */
static inline uint32_t read32(const uint8_t *at, Py_ssize_t index) {
    uint32_t value;
    memcpy(&value, at + 4 * index, 4);
    return value;
}

#define APPLY(T)                                                                         \
    {                                                                                    \
        T *out = (T *)elements.buf;                                                      \
        const T *xor = (const T *)values.buf;                                            \
        for (Py_ssize_t i = 0; i < count; i++) {                                         \
            uint64_t step = gaps[i];                                                     \
            if (next < nlong && read32(long_at, next) == (uint64_t)i) {                  \
                step = read32(long_gaps, next++);                                        \
            }                                                                            \
            position += step + 1;                                                        \
            if (position >= size) {                                                      \
                past = 1;                                                                \
                break;                                                                   \
            }                                                                            \
            out[position] ^= xor[i];                                                     \
        }                                                                                \
    }

static PyObject *xor_at(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer elements, gaps_buffer, values, long_at_buffer, long_gaps_buffer;
    int itemsize;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*i", &elements, &gaps_buffer, &values, &long_at_buffer,
                          &long_gaps_buffer, &itemsize)) {
        return NULL;
    }
    const char *error = NULL;
    Py_ssize_t count = gaps_buffer.len;
    Py_ssize_t nlong = long_at_buffer.len / 4;
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        error = "an element size of 1, 2, 4 or 8 bytes";
    } else if (values.len != count * itemsize || long_gaps_buffer.len != long_at_buffer.len ||
               long_at_buffer.len % 4 || elements.len % itemsize) {
        error = "a delta's values, gaps and long gaps of unequal counts";
    }
    int past = 0;
    if (error == NULL) {
        const uint8_t *gaps = (const uint8_t *)gaps_buffer.buf;
        const uint8_t *long_at = (const uint8_t *)long_at_buffer.buf;
        const uint8_t *long_gaps = (const uint8_t *)long_gaps_buffer.buf;
        uint64_t size = (uint64_t)(elements.len / itemsize);
        uint64_t position = (uint64_t)-1; /* the first gap counts from before the first element */
        Py_ssize_t next = 0;
        Py_BEGIN_ALLOW_THREADS
        switch (itemsize) {
            case 1: APPLY(uint8_t) break;
            case 2: APPLY(uint16_t) break;
            case 4: APPLY(uint32_t) break;
            default: APPLY(uint64_t) break;
        }
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&elements);
    PyBuffer_Release(&gaps_buffer);
    PyBuffer_Release(&values);
    PyBuffer_Release(&long_at_buffer);
    PyBuffer_Release(&long_gaps_buffer);
    if (error != NULL) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    if (past) {
        PyErr_SetString(PyExc_ValueError, "a delta's positions run past its chunk");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"xor_at", xor_at, METH_VARARGS,
     "xor_at(elements, gaps, values, long_at, long_gaps, itemsize): XOR each value into the element at its "
     "position (each the one before plus its gap plus one, from -1; a long gap replaces the gap at its index). "
     "Raises ValueError (a position past the end: the elements before it are applied)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_xor_at", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__xor_at(void) { return PyModule_Create(&module); }
