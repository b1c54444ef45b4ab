/*
 * bcg._native: replay a bcg plan in one C loop.
 *
 * A plan is a tuple of steps. Each step is either
 *   - a Python int: a cudaGraphExec_t (== driver CUgraphExec) to launch with
 *     cuGraphLaunch on the stream given to replay(),
 *   - a Python callable, called with no arguments (segments whose replay must
 *     go through torch so its RNG bookkeeping runs), or
 *   - a call: a tuple (fn, args, kwargs, on_result, always): fn(*args, **kwargs)
 *     is called straight from C (a breakpoint, no wrapper frame); then
 *     on_result(result) when on_result is not None and the result is not None
 *     or `always` is true (bcg refreshes a breakpoint's bridges this way).
 *
 * Plan(steps) converts the tuple to a C array once; Plan.replay(stream, device)
 * walks it. The GIL is released around each run of consecutive launches (a
 * launch blocks while the launch queue is full; torch's replay() releases it
 * too) and held for callables.
 *
 * Nothing here links against CUDA or PyTorch: the driver (libcuda.so.1) is
 * opened with dlopen at the first replay that launches a graph, and the few
 * types used are declared below. Only the CPython C API is used.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

/* ---- the CUDA driver API, declared by hand (no CUDA headers needed) ---------------- */

typedef int CUresult; /* enum cudaError_enum; 0 is CUDA_SUCCESS */
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUgraphExec;

#define BCG_CUDA_SUCCESS 0
#define BCG_MAX_DEVICES 64

typedef CUresult (*cuGraphLaunch_t)(CUgraphExec, CUstream);
typedef CUresult (*cuGraphUpload_t)(CUgraphExec, CUstream);
typedef CUresult (*cuGetErrorName_t)(CUresult, const char **);
typedef CUresult (*cuGetErrorString_t)(CUresult, const char **);
typedef CUresult (*cuCtxGetCurrent_t)(CUcontext *);
typedef CUresult (*cuCtxSetCurrent_t)(CUcontext);
typedef CUresult (*cuDeviceGet_t)(CUdevice *, int);
typedef CUresult (*cuDevicePrimaryCtxRetain_t)(CUcontext *, CUdevice);
typedef CUresult (*cuStreamIsCapturing_t)(CUstream, int *); /* CUstreamCaptureStatus: 0 = none */

/* Loaded once, at first use, under the GIL; never unloaded. */
static struct {
    int state; /* 0: not tried, 1: loaded, -1: failed (error holds why) */
    char error[768];
    cuGraphLaunch_t GraphLaunch;
    cuGraphUpload_t GraphUpload; /* may be NULL: upload() then reports it */
    cuGetErrorName_t GetErrorName;
    cuGetErrorString_t GetErrorString;
    cuCtxGetCurrent_t CtxGetCurrent;
    cuCtxSetCurrent_t CtxSetCurrent;
    cuDeviceGet_t DeviceGet;
    cuDevicePrimaryCtxRetain_t DevicePrimaryCtxRetain;
    cuStreamIsCapturing_t StreamIsCapturing; /* may be NULL: the check is then skipped */
    /* primary contexts this module retained (once per device, never released, as cudart does) */
    CUcontext primary[BCG_MAX_DEVICES];
} drv;

static const char DRIVER_NEEDED[] = "the native replay path needs the NVIDIA driver (libcuda.so.1)";

/* bcg.errors.ReplayError if importable, else RuntimeError (new reference). */
static PyObject *
replay_error_type(void)
{
    PyObject *mod = PyImport_ImportModule("bcg.errors");
    if (mod != NULL) {
        PyObject *cls = PyObject_GetAttrString(mod, "ReplayError");
        Py_DECREF(mod);
        if (cls != NULL && PyType_Check(cls) &&
            PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_RuntimeError)) {
            return cls;
        }
        Py_XDECREF(cls);
    }
    PyErr_Clear();
    Py_INCREF(PyExc_RuntimeError);
    return PyExc_RuntimeError;
}

/* Raise ReplayError(message) with attributes step and cuda_error (None when not a CUDA error). */
static void
raise_replay_error(const char *message, Py_ssize_t step, const char *cuda_error)
{
    PyObject *cls = replay_error_type();
    /* dlerror() text is not guaranteed to be UTF-8 */
    PyObject *text = PyUnicode_DecodeUTF8(message, (Py_ssize_t)strlen(message), "replace");
    PyObject *exc = text != NULL ? PyObject_CallOneArg(cls, text) : NULL;
    Py_XDECREF(text);
    if (exc != NULL) {
        PyObject *py_step = PyLong_FromSsize_t(step);
        PyObject *py_name = cuda_error ? PyUnicode_FromString(cuda_error) : Py_NewRef(Py_None);
        if (py_step == NULL || py_name == NULL ||
            PyObject_SetAttrString(exc, "step", py_step) < 0 ||
            PyObject_SetAttrString(exc, "cuda_error", py_name) < 0) {
            PyErr_Clear(); /* the message says it all; attributes are a convenience */
        }
        Py_XDECREF(py_step);
        Py_XDECREF(py_name);
        PyErr_SetObject(cls, exc);
        Py_DECREF(exc);
    }
    Py_DECREF(cls);
}

static void
cuda_error_names(CUresult r, char *name, size_t name_len, char *text, size_t text_len)
{
    const char *s = NULL;
    if (drv.GetErrorName != NULL && drv.GetErrorName(r, &s) == BCG_CUDA_SUCCESS && s != NULL)
        snprintf(name, name_len, "%s", s);
    else
        snprintf(name, name_len, "CUDA error %d", (int)r);
    s = NULL;
    if (drv.GetErrorString != NULL && drv.GetErrorString(r, &s) == BCG_CUDA_SUCCESS && s != NULL)
        snprintf(text, text_len, "%s", s);
    else
        text[0] = '\0';
}

/* "<what> failed at step <i>: CUDA_ERROR_X (description)" as a ReplayError. */
static void
raise_cuda_error(const char *what, Py_ssize_t step, CUresult r)
{
    char name[128], text[256], message[640];
    cuda_error_names(r, name, sizeof name, text, sizeof text);
    if (step >= 0)
        snprintf(message, sizeof message, "%s failed at step %zd: %s%s%s%s", what, step, name,
                 text[0] ? " (" : "", text, text[0] ? ")" : "");
    else
        snprintf(message, sizeof message, "%s failed: %s%s%s%s", what, name, text[0] ? " (" : "",
                 text, text[0] ? ")" : "");
    raise_replay_error(message, step, name);
}

/* Load libcuda.so.1 once. Returns 0, or -1 with a ReplayError (a RuntimeError) set. */
static int
load_driver(void)
{
    if (drv.state == 1)
        return 0;
    if (drv.state == 0) {
        void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL) {
            const char *why = dlerror();
            snprintf(drv.error, sizeof drv.error,
                     "%s: it could not be loaded (%s). Install the NVIDIA driver, or set "
                     "BCG_NATIVE=0 to replay with the Python executor",
                     DRIVER_NEEDED, why ? why : "dlopen failed");
            drv.state = -1;
        }
        else {
            const char *missing = NULL;
#define BCG_SYM(field, name, required)                                   \
    do {                                                                 \
        *(void **)(&drv.field) = dlsym(lib, name);                       \
        if (drv.field == NULL && (required) && missing == NULL)          \
            missing = name;                                              \
    } while (0)
            BCG_SYM(GraphLaunch, "cuGraphLaunch", 1);
            BCG_SYM(GraphUpload, "cuGraphUpload", 0);
            BCG_SYM(GetErrorName, "cuGetErrorName", 1);
            BCG_SYM(GetErrorString, "cuGetErrorString", 1);
            BCG_SYM(CtxGetCurrent, "cuCtxGetCurrent", 1);
            BCG_SYM(CtxSetCurrent, "cuCtxSetCurrent", 1);
            BCG_SYM(DeviceGet, "cuDeviceGet", 1);
            BCG_SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", 1);
            BCG_SYM(StreamIsCapturing, "cuStreamIsCapturing", 0);
#undef BCG_SYM
            if (missing != NULL) {
                snprintf(drv.error, sizeof drv.error,
                         "%s: the loaded libcuda.so.1 has no %s (the driver is too old). "
                         "Set BCG_NATIVE=0 to replay with the Python executor",
                         DRIVER_NEEDED, missing);
                drv.state = -1;
            }
            else {
                drv.state = 1;
            }
        }
    }
    if (drv.state == 1)
        return 0;
    raise_replay_error(drv.error, -1, NULL);
    return -1;
}

/*
 * The driver launches in the calling thread's current context. Threads that
 * have used the CUDA runtime have the device's primary context current; a
 * thread that has not (a fresh Python thread) has none, so make the primary
 * context of `device` current, as the runtime would. Returns 0 or -1 (error set).
 */
static int
ensure_context(int device)
{
    CUcontext ctx = NULL;
    CUresult r = drv.CtxGetCurrent(&ctx);
    if (r != BCG_CUDA_SUCCESS || ctx != NULL || device < 0)
        return 0; /* a context is current, or the launch will report what is wrong */
    if (device >= BCG_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device %d is out of range", device);
        return -1;
    }
    if (drv.primary[device] == NULL) {
        CUdevice dev;
        r = drv.DeviceGet(&dev, device);
        if (r != BCG_CUDA_SUCCESS) {
            raise_cuda_error("cuDeviceGet", -1, r);
            return -1;
        }
        r = drv.DevicePrimaryCtxRetain(&ctx, dev);
        if (r != BCG_CUDA_SUCCESS) {
            raise_cuda_error("cuDevicePrimaryCtxRetain", -1, r);
            return -1;
        }
        drv.primary[device] = ctx;
    }
    r = drv.CtxSetCurrent(drv.primary[device]);
    if (r != BCG_CUDA_SUCCESS) {
        raise_cuda_error("cuCtxSetCurrent", -1, r);
        return -1;
    }
    return 0;
}

/*
 * torch refuses to replay a graph while the stream captures (its RNG prologue
 * asserts); a raw cuGraphLaunch would instead be captured as a child graph and
 * the breakpoints would run once, at capture time. Refuse the same way.
 */
static int
check_not_capturing(CUstream stream)
{
    if (drv.StreamIsCapturing == NULL)
        return 0;
    int status = 0;
    CUresult r = drv.StreamIsCapturing(stream, &status);
    if (r != BCG_CUDA_SUCCESS) {
        raise_cuda_error("cuStreamIsCapturing", -1, r);
        return -1;
    }
    if (status != 0) {
        raise_replay_error("a bcg graph cannot be replayed on a stream that is capturing a CUDA graph: "
                           "its breakpoints would run once, at capture time, instead of at every "
                           "replay; replay it outside the capture",
                           -1, NULL);
        return -1;
    }
    return 0;
}

/* ---- Plan ------------------------------------------------------------------------- */

typedef struct {
    CUgraphExec exec;    /* launched when fn is NULL */
    PyObject *fn;        /* borrowed from Plan.steps (which the plan owns), like the fields below */
    PyObject *args;      /* a tuple for a call step; NULL: fn is called with no arguments */
    PyObject *kwargs;    /* a dict or NULL */
    PyObject *on_result; /* a callable or NULL */
    int always;          /* call on_result even with a None result */
} Entry;

typedef struct {
    PyObject_HEAD
    PyObject *steps; /* tuple: owns every callable an Entry borrows */
    Entry *entries;
    Py_ssize_t n;
    Py_ssize_t launches;  /* how many steps are graph launches */
    Py_ssize_t failed;    /* the step the last replay stopped at, or -1 */
} PlanObject;

static PyObject *
Plan_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"steps", NULL};
    PyObject *arg;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:Plan", kwlist, &arg))
        return NULL;
    PyObject *steps = PySequence_Tuple(arg);
    if (steps == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Format(PyExc_TypeError, "Plan(steps): steps must be an iterable, not %.200s",
                         Py_TYPE(arg)->tp_name);
        }
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(steps);
    Entry *entries = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Entry));
    if (entries == NULL) {
        Py_DECREF(steps);
        return PyErr_NoMemory();
    }
    Py_ssize_t launches = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *step = PyTuple_GET_ITEM(steps, i);
        if (PyLong_Check(step) && !PyBool_Check(step)) {
            void *handle = PyLong_AsVoidPtr(step);
            if (handle == NULL && PyErr_Occurred()) {
                if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    PyErr_Format(PyExc_OverflowError,
                                 "Plan step %zd: %R does not fit a cudaGraphExec_t handle", i, step);
                }
                goto fail;
            }
            entries[i].exec = handle;
            entries[i].fn = NULL;
            launches++;
        }
        else if (PyCallable_Check(step)) {
            entries[i].exec = NULL;
            entries[i].fn = step;
        }
        else if (PyTuple_Check(step) && PyTuple_GET_SIZE(step) == 5) {
            PyObject *fn = PyTuple_GET_ITEM(step, 0), *fargs = PyTuple_GET_ITEM(step, 1);
            PyObject *fkw = PyTuple_GET_ITEM(step, 2), *on_result = PyTuple_GET_ITEM(step, 3);
            int always = PyObject_IsTrue(PyTuple_GET_ITEM(step, 4));
            if (always < 0)
                goto fail;
            if (!PyCallable_Check(fn) || !PyTuple_Check(fargs) || (fkw != Py_None && !PyDict_Check(fkw)) ||
                (on_result != Py_None && !PyCallable_Check(on_result))) {
                PyErr_Format(PyExc_TypeError,
                             "Plan step %zd: a call step is (fn, args tuple, kwargs dict or None, "
                             "on_result callable or None, always)", i);
                goto fail;
            }
            entries[i].exec = NULL;
            entries[i].fn = fn;
            entries[i].args = fargs;
            entries[i].kwargs = (fkw != Py_None && PyDict_GET_SIZE(fkw) > 0) ? fkw : NULL;
            entries[i].on_result = on_result != Py_None ? on_result : NULL;
            entries[i].always = always;
        }
        else {
            PyErr_Format(PyExc_TypeError,
                         "Plan step %zd must be an int (a cudaGraphExec_t handle to launch), a "
                         "callable taking no arguments, or a call tuple (fn, args, kwargs, on_result, "
                         "always), not %.200s",
                         i, Py_TYPE(step)->tp_name);
            goto fail;
        }
    }
    PlanObject *self = (PlanObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        goto fail;
    self->steps = steps;
    self->entries = entries;
    self->n = n;
    self->launches = launches;
    self->failed = -1;
    return (PyObject *)self;

fail:
    PyMem_Free(entries);
    Py_DECREF(steps);
    return NULL;
}

static int
Plan_traverse(PlanObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->steps);
    return 0;
}

static int
Plan_clear(PlanObject *self)
{
    self->n = 0; /* the entries borrow from steps */
    self->launches = 0;
    Py_CLEAR(self->steps);
    return 0;
}

static void
Plan_dealloc(PlanObject *self)
{
    PyObject_GC_UnTrack(self);
    Plan_clear(self);
    PyMem_Free(self->entries);
    self->entries = NULL;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int
parse_stream(PyObject *obj, CUstream *stream)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError,
                     "stream must be an int (a cudaStream_t handle, e.g. "
                     "torch.cuda.current_stream().cuda_stream), not %.200s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    *stream = PyLong_AsVoidPtr(obj);
    return (*stream == NULL && PyErr_Occurred()) ? -1 : 0;
}

/* Parse ``(stream, device=-1)`` positional arguments of ``replay``/``upload``. */
static int
parse_stream_device(const char *name, PyObject *const *args, Py_ssize_t nargs, CUstream *stream, int *device)
{
    *stream = NULL;
    *device = -1;
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "%s() takes 1 or 2 positional arguments (stream, device), "
                     "%zd given", name, nargs);
        return -1;
    }
    if (parse_stream(args[0], stream) < 0)
        return -1;
    if (nargs == 2) {
        long d = PyLong_AsLong(args[1]);
        if (d == -1 && PyErr_Occurred())
            return -1;
        *device = d < 0 ? -1 : (int)(d > INT32_MAX ? INT32_MAX : d);
    }
    return 0;
}

PyDoc_STRVAR(Plan_replay_doc,
"replay(stream, device=-1, /)\n--\n\n"
"Run every step in order: launch each graph handle on ``stream`` (an int\n"
"``cudaStream_t``) with ``cuGraphLaunch``, call each callable with no arguments.\n"
"``device`` (optional) is the CUDA device ordinal whose primary context is made\n"
"current if the calling thread has no current context.\n\n"
"Refuses to start (``ReplayError``) when the driver cannot be loaded or\n"
"``stream`` is capturing. Stops at the first failure and sets ``failed_step`` to its index (``-1`` after a\n"
"replay that completed or failed before any step ran). A callable's exception\n"
"propagates unchanged; a launch failure raises ``bcg.errors.ReplayError`` (a\n"
"``RuntimeError``) naming the step and the CUDA error, with attributes ``step``\n"
"and ``cuda_error``.");

static PyObject *
Plan_replay(PlanObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CUstream stream;
    int device;
    if (parse_stream_device("replay", args, nargs, &stream, &device) < 0)
        return NULL;
    self->failed = -1;
    if (self->launches > 0) {
        /* Before any step runs: a missing driver refuses the whole replay. */
        if (load_driver() < 0 || ensure_context(device) < 0 || check_not_capturing(stream) < 0)
            return NULL;
    }

    Py_INCREF(self); /* a callable may drop the last other reference */
    const Entry *e = self->entries;
    const Py_ssize_t n = self->n;
    const cuGraphLaunch_t launch = drv.GraphLaunch;
    Py_ssize_t i;
    for (i = 0; i < n; i++, e++) {
        if (e->fn == NULL) {
            /* A run of consecutive launches, with the GIL released (as torch's replay() does):
             * a launch blocks while the launch queue is full, and other Python threads must
             * run meanwhile. The entries are immutable and the plan holds a reference. */
            CUresult r = BCG_CUDA_SUCCESS;
            Py_BEGIN_ALLOW_THREADS
            for (;;) {
                r = launch(e->exec, stream);
                if (r != BCG_CUDA_SUCCESS || i + 1 == n || e[1].fn != NULL)
                    break;
                i++;
                e++;
            }
            Py_END_ALLOW_THREADS
            if (r != BCG_CUDA_SUCCESS) {
                self->failed = i;
                raise_cuda_error("cuGraphLaunch", i, r);
                break;
            }
        }
        else {
            PyObject *res = e->args == NULL ? PyObject_CallNoArgs(e->fn) : PyObject_Call(e->fn, e->args, e->kwargs);
            if (res != NULL && e->on_result != NULL && (res != Py_None || e->always)) {
                PyObject *done = PyObject_CallOneArg(e->on_result, res);
                Py_DECREF(res);
                res = done;
            }
            if (res == NULL) {
                self->failed = i;
                break;
            }
            Py_DECREF(res);
        }
        if (self->n != n) { /* cleared by the collector during a callable: stop safely */
            break;
        }
    }
    int ok = (i == n);
    Py_DECREF(self);
    if (!ok) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_RuntimeError, "bcg._native.Plan was cleared during its replay");
        return NULL;
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(Plan_upload_doc,
"upload(stream, device=-1, /)\n--\n\n"
"``cuGraphUpload`` every graph handle to ``stream`` (so a first launch costs what\n"
"later ones do). Raises like ``replay`` on failure.");

static PyObject *
Plan_upload(PlanObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CUstream stream;
    int device;
    if (parse_stream_device("upload", args, nargs, &stream, &device) < 0)
        return NULL;
    if (self->launches == 0)
        Py_RETURN_NONE;
    if (load_driver() < 0 || ensure_context(device) < 0)
        return NULL;
    if (drv.GraphUpload == NULL) {
        raise_replay_error("cuGraphUpload is not available in this driver (CUDA 11.1 or newer is needed)",
                           -1, NULL);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        if (self->entries[i].fn == NULL) {
            CUresult r = drv.GraphUpload(self->entries[i].exec, stream);
            if (r != BCG_CUDA_SUCCESS) {
                raise_cuda_error("cuGraphUpload", i, r);
                return NULL;
            }
        }
    }
    Py_RETURN_NONE;
}

static PyObject *
Plan_get_failed_step(PlanObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->failed);
}

static PyObject *
Plan_get_launches(PlanObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->launches);
}

static PyObject *
Plan_get_steps(PlanObject *self, void *closure)
{
    if (self->steps == NULL)
        return PyTuple_New(0);
    return Py_NewRef(self->steps);
}

static Py_ssize_t
Plan_len(PlanObject *self)
{
    return self->n;
}

static PyObject *
Plan_repr(PlanObject *self)
{
    return PyUnicode_FromFormat("<bcg._native.Plan: %zd steps, %zd graph launches, %zd calls>",
                                self->n, self->launches, self->n - self->launches);
}

static PyMethodDef Plan_methods[] = {
    {"replay", (PyCFunction)(void (*)(void))Plan_replay, METH_FASTCALL, Plan_replay_doc},
    {"upload", (PyCFunction)(void (*)(void))Plan_upload, METH_FASTCALL, Plan_upload_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Plan_getset[] = {
    {"failed_step", (getter)Plan_get_failed_step, NULL,
     "Index of the step the last replay stopped at (-1: it completed, or failed before any step).",
     NULL},
    {"launches", (getter)Plan_get_launches, NULL, "How many steps are graph launches.", NULL},
    {"steps", (getter)Plan_get_steps, NULL, "The steps, as given (a tuple).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Plan_as_sequence = {
    .sq_length = (lenfunc)Plan_len,
};

PyDoc_STRVAR(Plan_doc,
"Plan(steps)\n--\n\n"
"A replay plan converted once to a C array. Each step is an int (a\n"
"``cudaGraphExec_t`` handle, launched with ``cuGraphLaunch``), a callable\n"
"taking no arguments, or a call ``(fn, args, kwargs, on_result, always)``:\n"
"``fn(*args, **kwargs)``, then ``on_result(result)`` if ``on_result`` is not\n"
"None and the result is not None or ``always``. The plan keeps the callables\n"
"and arguments alive; keeping the graphs behind the handles alive is the\n"
"caller's job.");

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bcg._native.Plan",
    .tp_basicsize = sizeof(PlanObject),
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_repr = (reprfunc)Plan_repr,
    .tp_as_sequence = &Plan_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Plan_doc,
    .tp_traverse = (traverseproc)Plan_traverse,
    .tp_clear = (inquiry)Plan_clear,
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
    .tp_new = Plan_new,
};

/* ---- module ----------------------------------------------------------------------- */

PyDoc_STRVAR(load_driver_doc,
"load_driver()\n--\n\n"
"Load the CUDA driver (libcuda.so.1) now; raise ``bcg.errors.ReplayError`` (a\n"
"``RuntimeError``) saying why if it cannot be. Replays load it on first use.");

static PyObject *
mod_load_driver(PyObject *module, PyObject *unused)
{
    if (load_driver() < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(error_name_doc,
"error_name(code)\n--\n\n"
"The name of a ``CUresult`` (e.g. ``'CUDA_ERROR_INVALID_VALUE'``), from the driver.");

static PyObject *
mod_error_name(PyObject *module, PyObject *arg)
{
    long code = PyLong_AsLong(arg);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    if (load_driver() < 0)
        return NULL;
    char name[128], text[256];
    cuda_error_names((CUresult)code, name, sizeof name, text, sizeof text);
    return PyUnicode_FromString(name);
}

static PyMethodDef module_methods[] = {
    {"load_driver", mod_load_driver, METH_NOARGS, load_driver_doc},
    {"error_name", mod_error_name, METH_O, error_name_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "bcg._native",
    .m_doc = "Native replay loop for bcg plans (see csrc/README.md).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    if (PyType_Ready(&PlanType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PlanType);
    if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(&PlanType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "DRIVER_LIBRARY", "libcuda.so.1") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
