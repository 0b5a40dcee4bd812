/* The Python face of engine.c: lpsync.native._engine.Engine. Thin: arguments in, the
 * GIL released around everything that may wait or move data. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "engine.h"

typedef struct {
    PyObject_HEAD
    lpn_engine engine;
    PyObject *owner; /* keeps the page's mapping alive */
    int ready;
} EngineObject;

static int check_open(EngineObject *self) {
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "the engine is closed");
        return -1;
    }
    return 0;
}

static int Engine_init(EngineObject *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"page", "address", "length", "slots", "bounds", NULL};
    PyObject *owner, *bounds;
    unsigned long long address;
    Py_ssize_t length;
    unsigned int slots;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OKnIO", names, &owner, &address, &length, &slots,
                                     &bounds))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_ValueError, "the engine is initialized already");
        return -1;
    }
    PyObject *seq = PySequence_Fast(bounds, "bounds must be a sequence of floats");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    double values[LPN_BUCKETS];
    if (n > (Py_ssize_t)LPN_BUCKETS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "too many histogram bounds");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            Py_DECREF(seq);
            return -1;
        }
    }
    Py_DECREF(seq);
    const char *why = NULL;
    if (length < 0 || lpn_engine_init(&self->engine, (uint8_t *)(uintptr_t)address, (size_t)length, slots,
                                      values, (uint32_t)n, &why) != 0) {
        PyErr_SetString(PyExc_ValueError, why ? why : "negative length");
        return -1;
    }
    if (lpn_engine_start(&self->engine) != 0) {
        lpn_engine_destroy(&self->engine);
        PyErr_SetString(PyExc_OSError, "cannot start the engine's thread");
        return -1;
    }
    Py_INCREF(owner);
    self->owner = owner;
    self->ready = 1;
    return 0;
}

static PyObject *Engine_close(EngineObject *self, PyObject *unused) {
    (void)unused;
    if (self->ready) {
        self->ready = 0;
        Py_BEGIN_ALLOW_THREADS lpn_engine_destroy(&self->engine);
        Py_END_ALLOW_THREADS Py_CLEAR(self->owner);
    }
    Py_RETURN_NONE;
}

static void Engine_dealloc(EngineObject *self) {
    Engine_close(self, NULL);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A sequence of ints as n u64 values (PyMem); NULL with an exception set on failure. */
static uint64_t *u64s(PyObject *items, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(items, "expected a sequence of ints");
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *values = PyMem_Calloc((size_t)(*n ? *n : 1), sizeof(uint64_t));
    if (!values) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        values[i] = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (PyErr_Occurred()) {
            PyMem_Free(values);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return values;
}

static PyObject *Engine_arm(EngineObject *self, PyObject *args) {
    unsigned int index;
    Py_buffer program;
    PyObject *bases_arg, *sizes_arg;
    double timeout;
    unsigned long long key = 0;
    if (check_open(self) ||
        !PyArg_ParseTuple(args, "Iy*OOd|K", &index, &program, &bases_arg, &sizes_arg, &timeout, &key))
        return NULL;
    Py_ssize_t n = 0, m = 0;
    uint64_t *bases = u64s(bases_arg, &n);
    uint64_t *sizes = bases ? u64s(sizes_arg, &m) : NULL;
    if (!bases || !sizes || n != m) {
        if (bases && sizes) PyErr_SetString(PyExc_ValueError, "bases and sizes differ in length");
        PyMem_Free(bases);
        PyMem_Free(sizes);
        PyBuffer_Release(&program);
        return NULL;
    }
    const char *why = NULL;
    long gen;
    Py_BEGIN_ALLOW_THREADS gen = lpn_engine_arm(&self->engine, index, program.buf, (size_t)program.len, bases,
                                                sizes, (uint32_t)n, timeout, (uint64_t)key, &why);
    Py_END_ALLOW_THREADS PyMem_Free(bases);
    PyMem_Free(sizes);
    PyBuffer_Release(&program);
    if (gen < 0) {
        PyErr_SetString(PyExc_ValueError, why ? why : "cannot arm the plan");
        return NULL;
    }
    return PyLong_FromLong(gen);
}

static PyObject *Engine_disarm(EngineObject *self, PyObject *args) {
    unsigned int index;
    if (check_open(self) || !PyArg_ParseTuple(args, "I", &index)) return NULL;
    Py_BEGIN_ALLOW_THREADS lpn_engine_disarm(&self->engine, index);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *Engine_yield_seq(EngineObject *self, PyObject *arg) {
    if (check_open(self)) return NULL;
    unsigned long long seq = PyLong_AsUnsignedLongLongMask(arg);
    if (PyErr_Occurred()) return NULL;
    /* The engine's lock is held while a program runs: wait for it without the GIL. */
    Py_BEGIN_ALLOW_THREADS lpn_engine_yield(&self->engine, (uint32_t)seq);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Engine_run(EngineObject *self, PyObject *args) {
    unsigned int index, gen, seq = 0;
    if (check_open(self) || !PyArg_ParseTuple(args, "II|I", &index, &gen, &seq)) return NULL;
    uint32_t code;
    Py_BEGIN_ALLOW_THREADS code = lpn_engine_run(&self->engine, index, gen, seq);
    Py_END_ALLOW_THREADS return PyLong_FromUnsignedLong(code);
}

static PyObject *Engine_connect(EngineObject *self, PyObject *args) {
    unsigned int chan;
    int fd;
    if (check_open(self) || !PyArg_ParseTuple(args, "Ii", &chan, &fd)) return NULL;
    const char *why = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = lpn_engine_connect(&self->engine, chan, fd, &why);
    Py_END_ALLOW_THREADS if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, why ? why : "cannot connect the channel");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_notice(EngineObject *self, PyObject *args) {
    unsigned int seq;
    int chan = -1;
    if (check_open(self) || !PyArg_ParseTuple(args, "I|i", &seq, &chan)) return NULL;
    Py_BEGIN_ALLOW_THREADS lpn_engine_notice(&self->engine, seq, chan);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *Engine_abort(EngineObject *self, PyObject *unused) {
    (void)unused;
    if (check_open(self)) return NULL;
    lpn_engine_abort(&self->engine); /* no lock: safe on any thread, the event loop's too */
    Py_RETURN_NONE;
}

static PyObject *Engine_drop_net(EngineObject *self, PyObject *unused) {
    (void)unused;
    if (check_open(self)) return NULL;
    Py_BEGIN_ALLOW_THREADS lpn_engine_drop_net(&self->engine);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *Engine_activate(EngineObject *self, PyObject *args) {
    Py_buffer flags;
    if (check_open(self) || !PyArg_ParseTuple(args, "y*", &flags)) return NULL;
    const char *why = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = lpn_engine_activate(&self->engine, flags.buf, (uint32_t)flags.len, &why);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&flags);
    if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, why ? why : "cannot activate the slots");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_tune(EngineObject *self, PyObject *args) {
    unsigned long long tile, parallel, stream = LPN_STREAM;
    unsigned int threads;
    if (check_open(self) || !PyArg_ParseTuple(args, "KKI|K", &tile, &parallel, &threads, &stream)) return NULL;
    const char *why = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = lpn_engine_tune(&self->engine, tile, parallel, threads, stream, &why);
    Py_END_ALLOW_THREADS if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, why ? why : "cannot tune the engine");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Engine_shape(EngineObject *self, PyObject *args) {
    unsigned int index;
    if (check_open(self) || !PyArg_ParseTuple(args, "I", &index)) return NULL;
    uint64_t tile, scratch;
    uint32_t threads;
    int stream;
    Py_BEGIN_ALLOW_THREADS lpn_engine_shape(&self->engine, index, &tile, &threads, &scratch, &stream);
    Py_END_ALLOW_THREADS return Py_BuildValue("(KIKO)", (unsigned long long)tile, threads,
                                              (unsigned long long)scratch, stream ? Py_True : Py_False);
}

static PyObject *Engine_failed_channel(EngineObject *self, PyObject *unused) {
    (void)unused;
    if (check_open(self)) return NULL;
    int chan;
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->engine.mu);
    chan = self->engine.failed_channel;
    pthread_mutex_unlock(&self->engine.mu);
    Py_END_ALLOW_THREADS return PyLong_FromLong(chan);
}

/* (calls, seconds, buckets) of plan ``index`` and the engine's last records, under the lock. */
static PyObject *Engine_stats(EngineObject *self, PyObject *args) {
    unsigned int index;
    if (check_open(self) || !PyArg_ParseTuple(args, "I", &index)) return NULL;
    if (index >= LPN_MAX_PLANS) {
        PyErr_SetString(PyExc_ValueError, "plan index out of range");
        return NULL;
    }
    lpn_plan copy;
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->engine.mu); /* a run holds it */
    copy = self->engine.plans[index];
    pthread_mutex_unlock(&self->engine.mu);
    Py_END_ALLOW_THREADS
    PyObject *buckets = PyTuple_New(self->engine.nbounds + 1);
    if (!buckets) return NULL;
    for (uint32_t b = 0; b <= self->engine.nbounds; b++)
        PyTuple_SET_ITEM(buckets, b, PyLong_FromUnsignedLongLong(copy.buckets[b]));
    return Py_BuildValue("(KdN)", (unsigned long long)copy.calls, copy.seconds, buckets);
}

static PyObject *Engine_records(EngineObject *self, PyObject *unused) {
    (void)unused;
    if (check_open(self)) return NULL;
    lpn_record records[LPN_RECORDS];
    uint64_t total, fallbacks;
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->engine.mu); /* a run holds it */
    memcpy(records, self->engine.records, sizeof records);
    total = self->engine.nrecords;
    fallbacks = self->engine.fallbacks;
    pthread_mutex_unlock(&self->engine.mu);
    Py_END_ALLOW_THREADS
    uint64_t n = total < LPN_RECORDS ? total : LPN_RECORDS;
    PyObject *list = PyList_New(0);
    if (!list) return NULL;
    for (uint64_t k = total - n; k < total; k++) {
        lpn_record *r = &records[k % LPN_RECORDS];
        PyObject *item = Py_BuildValue("(IIIddd)", r->seq, r->plan, r->code, r->first_arrival,
                                       r->last_arrival, r->done);
        if (!item || PyList_Append(list, item) != 0) {
            Py_XDECREF(item);
            Py_DECREF(list);
            return NULL;
        }
        Py_DECREF(item);
    }
    return Py_BuildValue("(KKN)", (unsigned long long)total, (unsigned long long)fallbacks, list);
}

static PyMethodDef Engine_methods[] = {
    {"arm", (PyCFunction)Engine_arm, METH_VARARGS,
     "arm(index, program, bases, sizes, timeout, key=0) -> generation: check the program against its "
     "buffers, arm it (key: a net plan's identity in its message headers)"},
    {"disarm", (PyCFunction)Engine_disarm, METH_VARARGS,
     "disarm(index): waiting rings of it fall back to the general path"},
    {"yield_seq", (PyCFunction)Engine_yield_seq, METH_O,
     "yield_seq(seq): a rank arrived for seq on the general path; rings of it fall back"},
    {"run", (PyCFunction)Engine_run, METH_VARARGS,
     "run(index, generation, seq=0) -> code: run an armed plan once (0 ok, 1 not armed at that "
     "generation, 2 timeout, 3 channel lost, 4 message mismatch), its messages numbered seq"},
    {"connect", (PyCFunction)Engine_connect, METH_VARARGS,
     "connect(channel, fd): the channel becomes a duplicate of the connected socket fd (-1: closed)"},
    {"notice", (PyCFunction)Engine_notice, METH_VARARGS,
     "notice(seq, channel=-1): this node runs seq on the general path (a NOTICE to the GO "
     "round's root; the root's to every channel: -1); armed peers fall back at once"},
    {"abort", (PyCFunction)Engine_abort, METH_NOARGS,
     "abort(): a net run waiting now ends LOST at once (the peers are lost); never blocks"},
    {"drop_net", (PyCFunction)Engine_drop_net, METH_NOARGS,
     "drop_net(): close every channel and disarm every plan with messages"},
    {"activate", (PyCFunction)Engine_activate, METH_VARARGS,
     "activate(flags: bytes): one flag per slot, set for this node's ranks"},
    {"failed_channel", (PyCFunction)Engine_failed_channel, METH_NOARGS,
     "failed_channel() -> int: the channel the last failed net run failed on (-1: none)"},
    {"tune", (PyCFunction)Engine_tune, METH_VARARGS,
     "tune(tile, parallel, threads, stream=STREAM): before the first plan is armed: tiles of tile "
     "bytes (a multiple of 64; 0: op by op), programs of parallel bytes or more on threads threads "
     "(0: min(CPUs, participants)), streaming stores from stream bytes"},
    {"shape", (PyCFunction)Engine_shape, METH_VARARGS,
     "shape(index) -> (tile, threads, scratch, stream): how plan index runs (tile 0: op by op; threads "
     "0: not armed), its scratch's bytes, whether it copies out with streaming stores"},
    {"stats", (PyCFunction)Engine_stats, METH_VARARGS, "stats(index) -> (calls, seconds, buckets)"},
    {"records", (PyCFunction)Engine_records, METH_NOARGS,
     "records() -> (answered, fallbacks, [(seq, plan, code, first, last, done)])"},
    {"close", (PyCFunction)Engine_close, METH_NOARGS, "close(): pending rings fall back; the thread ends"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject EngineType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lpsync.native._engine.Engine",
    .tp_basicsize = sizeof(EngineObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Engine(page, address, length, slots, bounds): one job's armed plans and doorbell",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Engine_init,
    .tp_dealloc = (destructor)Engine_dealloc,
    .tp_methods = Engine_methods,
};

/* combine(out, a, b, dtype, redop): one COMBINE step over whole buffers of equal size
 * (program.py checks the engine's float min and max against numpy's with it). */
static PyObject *combine(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer d, a, b;
    unsigned int dtype, redop;
    if (!PyArg_ParseTuple(args, "w*y*y*II", &d, &a, &b, &dtype, &redop)) return NULL;
    PyObject *result = NULL;
    uint32_t item = lpn_itemsize(dtype);
    if (item == 0 || redop == 0 || redop >= LPN_REDOP_END)
        PyErr_SetString(PyExc_ValueError, "unknown type or reduction");
    else if (a.len != d.len || b.len != d.len || d.len % item)
        PyErr_SetString(PyExc_ValueError, "the buffers differ in size or are not whole elements");
    else if (((uintptr_t)d.buf | (uintptr_t)a.buf | (uintptr_t)b.buf) % item)
        PyErr_SetString(PyExc_ValueError, "a buffer is not aligned to its type");
    else {
        Py_BEGIN_ALLOW_THREADS
        lpn_combine(d.buf, a.buf, b.buf, dtype, (uint64_t)d.len / item, redop);
        Py_END_ALLOW_THREADS
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&d);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return result;
}

static PyMethodDef module_methods[] = {
    {"combine", combine, METH_VARARGS,
     "combine(out, a, b, dtype, redop): out = a (redop) b elementwise, as a program's COMBINE step"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, .m_name = "lpsync.native._engine",
    .m_doc = "The native steady-state engine (engine.c)", .m_size = -1, .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__engine(void) {
    if (PyType_Ready(&EngineType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&EngineType);
    if (PyModule_AddObject(m, "Engine", (PyObject *)&EngineType) < 0) {
        Py_DECREF(&EngineType);
        Py_DECREF(m);
        return NULL;
    }
    const struct {
        const char *name;
        long value;
    } constants[] = {
        {"HEADER_BYTES", LPN_HEADER_BYTES}, {"BELL_OFFSET", LPN_BELL_OFFSET}, {"SLOT_BYTES", LPN_SLOT_BYTES},
        {"MAX_SLOTS", LPN_MAX_SLOTS},       {"MAX_PLANS", LPN_MAX_PLANS},     {"OK", LPN_OK},
        {"FALLBACK", LPN_FALLBACK},         {"VERSION", LPN_VERSION},         {"MAGIC", LPN_MAGIC},
        {"PROGRAM_MAGIC", LPN_PROGRAM_MAGIC}, {"OP_BYTES", sizeof(lpn_op)},   {"BUCKETS", LPN_BUCKETS},
        {"TILE", (long)LPN_TILE},           {"PARALLEL", (long)LPN_PARALLEL}, {"STREAM", (long)LPN_STREAM},
        {"MAX_OPS", LPN_MAX_OPS},
    };
    for (size_t i = 0; i < sizeof constants / sizeof constants[0]; i++)
        if (PyModule_AddIntConstant(m, constants[i].name, constants[i].value) < 0) {
            Py_DECREF(m);
            return NULL;
        }
    return m;
}
