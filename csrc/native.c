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
 *     or `always` is true (bcg refreshes a breakpoint's bridges this way), or
 *   - a parameter step: a tuple (exec, node, params) of ints: the kernel node's
 *     parameters in that executable are set with cuGraphExecKernelNodeSetParams
 *     (a staged value, before the launch that reads it; queued launches keep theirs).
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
typedef void *CUgraphNode;

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
/* the parameters: a CUDA_KERNEL_NODE_PARAMS (v2) the caller built (bcg.staged.kernel) */
typedef CUresult (*cuGraphExecKernelNodeSetParams_t)(CUgraphExec, CUgraphNode, const void *);

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
    cuGraphExecKernelNodeSetParams_t ExecKernelNodeSetParams; /* may be NULL: plans that set one refuse */
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
            BCG_SYM(ExecKernelNodeSetParams, "cuGraphExecKernelNodeSetParams_v2", 0);
            if (drv.ExecKernelNodeSetParams == NULL)
                BCG_SYM(ExecKernelNodeSetParams, "cuGraphExecKernelNodeSetParams", 0);
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
    CUgraphExec exec;    /* launched when fn and node are NULL */
    CUgraphNode node;    /* not NULL: set this kernel node of exec to params (no launch) */
    const void *params;  /* owned by the caller, who keeps it alive as long as the plan */
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
    Py_ssize_t sets;      /* how many steps set a kernel node's parameters */
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
    Py_ssize_t launches = 0, sets = 0;
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
        else if (PyTuple_Check(step) && PyTuple_GET_SIZE(step) == 3) {
            void *handles[3];
            for (int k = 0; k < 3; k++) {
                PyObject *item = PyTuple_GET_ITEM(step, k);
                if (!PyLong_Check(item) || PyBool_Check(item)) {
                    PyErr_Format(PyExc_TypeError,
                                 "Plan step %zd: a parameter step is (cudaGraphExec_t, kernel node, address "
                                 "of its CUDA_KERNEL_NODE_PARAMS), three ints", i);
                    goto fail;
                }
                handles[k] = PyLong_AsVoidPtr(item);
                if (handles[k] == NULL) {
                    if (!PyErr_Occurred())
                        PyErr_Format(PyExc_ValueError, "Plan step %zd: a parameter step holds a null handle", i);
                    goto fail;
                }
            }
            entries[i].exec = handles[0];
            entries[i].node = handles[1];
            entries[i].params = handles[2];
            entries[i].fn = NULL;
            sets++;
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
                         "callable taking no arguments, a call tuple (fn, args, kwargs, on_result, "
                         "always), or a parameter tuple (exec, node, params), not %.200s",
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
    self->sets = sets;
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
    self->sets = 0;
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

/* Run every step of `self` on `stream` (see Plan.replay). `checked`: the caller's previous plan
 * checked this stream and device in this replay already (a staged tail after its head). Returns 0,
 * or -1 with an exception set. */
static int
plan_run(PlanObject *self, CUstream stream, int device, int checked)
{
    self->failed = -1;
    if (self->launches + self->sets > 0 && !checked) {
        /* Before any step runs: a missing driver refuses the whole replay. */
        if (load_driver() < 0 || ensure_context(device) < 0 || check_not_capturing(stream) < 0)
            return -1;
    }
    if (self->sets > 0 && drv.ExecKernelNodeSetParams == NULL) {
        raise_replay_error("the loaded libcuda.so.1 has no cuGraphExecKernelNodeSetParams (the driver is too "
                           "old) to set a staged value carried in kernel parameters; update the NVIDIA driver",
                           -1, NULL);
        return -1;
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
                /* a staged value is set in the executable before its launch (queued launches keep theirs) */
                r = e->node != NULL ? drv.ExecKernelNodeSetParams(e->exec, e->node, e->params)
                                    : launch(e->exec, stream);
                if (r != BCG_CUDA_SUCCESS || i + 1 == n || e[1].fn != NULL)
                    break;
                i++;
                e++;
            }
            Py_END_ALLOW_THREADS
            if (r != BCG_CUDA_SUCCESS) {
                self->failed = i;
                raise_cuda_error(e->node != NULL ? "cuGraphExecKernelNodeSetParams" : "cuGraphLaunch", i, r);
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
        return -1;
    }
    return 0;
}

static PyObject *
Plan_replay(PlanObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    CUstream stream;
    int device;
    if (parse_stream_device("replay", args, nargs, &stream, &device) < 0)
        return NULL;
    if (plan_run(self, stream, device, 0) < 0)
        return NULL;
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
        if (self->entries[i].fn == NULL && self->entries[i].node == NULL) {
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
    return PyUnicode_FromFormat("<bcg._native.Plan: %zd steps, %zd graph launches, %zd parameter sets, %zd calls>",
                                self->n, self->launches, self->sets, self->n - self->launches - self->sets);
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
"taking no arguments, a call ``(fn, args, kwargs, on_result, always)``:\n"
"``fn(*args, **kwargs)``, then ``on_result(result)`` if ``on_result`` is not\n"
"None and the result is not None or ``always``, or a parameter step\n"
"``(exec, node, params)`` of ints: ``cuGraphExecKernelNodeSetParams`` with the\n"
"address of a ``CUDA_KERNEL_NODE_PARAMS``, which the caller keeps alive. The plan keeps the callables\n"
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

/* ---- Replay: one replay of a graph, its form chosen and launched in C ------------------- */

/* One form of a graph, as Replay runs it. Every field is borrowed from Replay.forms. */
typedef struct {
    PyObject *checks;        /* tuple of (fits, staged, reads_staged, reason), or NULL: takes any live */
    PlanObject *head;        /* the steps before the staged copies, or NULL */
    PlanObject *tail;        /* the (other) steps, or NULL: this form replays through `slow` */
    PyObject *prepares;      /* tuple of callables prepare(live), run between head and tail */
    PyObject *form;          /* its `replays` attribute counts the replays */
    PyObject *after;         /* callable (), run after a replay, or NULL */
    PyObject *annotate_head; /* callable (exc) adding notes to an error of head, or NULL */
    PyObject *annotate_tail; /* the same for tail */
} FormEntry;

typedef struct {
    PyObject_HEAD
    PyObject *forms; /* the tuple given: owns everything a FormEntry borrows */
    FormEntry *entries;
    Py_ssize_t n;
    int device;
    PyObject *get_device;     /* () -> the current device ordinal */
    PyObject *get_stream;     /* (device) -> the current raw stream there */
    PyObject *slow;           /* (live, index, reason) -> the Python replay, for what C does not run */
    PyObject *suspects;       /* a list: non-empty means check_suspects(suspects) first */
    PyObject *check_suspects; /* (suspects) -> raises if a held tensor was replaced */
    PyObject *profiler;       /* (holder, name): getattr(holder, name) is true while a profiler runs
                                 (then Python replays, marking steps): read without a Python call */
    PyObject *groups_off;     /* a frozenset: the node groups every form skips, as the graph switched
                                 them before it built this object (it builds another when they
                                 change), so a runner call skips set_enabled when they already say
                                 what it asks; None: not known (set_enabled is always called) */
    PyObject *live_var;       /* the contextvars.ContextVar bcg.live() reads */
    PyObject *unset;          /* the sentinel for "no live metadata": the variable is left as it is */
    PyObject *outputs;        /* what a replay returns */
    Py_ssize_t replaying;     /* replays in progress */
} ReplayObject;

static PyObject *str_replays; /* interned "replays" */

static int
Replay_traverse(ReplayObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->forms);
    Py_VISIT(self->get_device);
    Py_VISIT(self->get_stream);
    Py_VISIT(self->slow);
    Py_VISIT(self->suspects);
    Py_VISIT(self->check_suspects);
    Py_VISIT(self->profiler);
    Py_VISIT(self->groups_off);
    Py_VISIT(self->live_var);
    Py_VISIT(self->unset);
    Py_VISIT(self->outputs);
    return 0;
}

static int
Replay_clear(ReplayObject *self)
{
    self->n = 0; /* the entries borrow from forms */
    Py_CLEAR(self->forms);
    Py_CLEAR(self->get_device);
    Py_CLEAR(self->get_stream);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->suspects);
    Py_CLEAR(self->check_suspects);
    Py_CLEAR(self->profiler);
    Py_CLEAR(self->groups_off);
    Py_CLEAR(self->live_var);
    Py_CLEAR(self->unset);
    Py_CLEAR(self->outputs);
    return 0;
}

static void
Replay_dealloc(ReplayObject *self)
{
    PyObject_GC_UnTrack(self);
    Replay_clear(self);
    PyMem_Free(self->entries);
    self->entries = NULL;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
none_to_null(PyObject *o)
{
    return o == Py_None ? NULL : o;
}

static int
parse_form(PyObject *item, Py_ssize_t i, FormEntry *e)
{
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 8) {
        PyErr_Format(PyExc_TypeError, "Replay: form %zd must be a tuple (checks, head, tail, prepares, form, "
                     "after, annotate_head, annotate_tail)", i);
        return -1;
    }
    e->checks = none_to_null(PyTuple_GET_ITEM(item, 0));
    PyObject *head = none_to_null(PyTuple_GET_ITEM(item, 1));
    PyObject *tail = none_to_null(PyTuple_GET_ITEM(item, 2));
    e->prepares = PyTuple_GET_ITEM(item, 3);
    e->form = PyTuple_GET_ITEM(item, 4);
    e->after = none_to_null(PyTuple_GET_ITEM(item, 5));
    e->annotate_head = none_to_null(PyTuple_GET_ITEM(item, 6));
    e->annotate_tail = none_to_null(PyTuple_GET_ITEM(item, 7));
    if ((head != NULL && !PyObject_TypeCheck(head, &PlanType)) ||
        (tail != NULL && !PyObject_TypeCheck(tail, &PlanType))) {
        PyErr_Format(PyExc_TypeError, "Replay: form %zd: head and tail must be bcg._native.Plan or None", i);
        return -1;
    }
    if (head != NULL && tail == NULL) {
        PyErr_Format(PyExc_ValueError, "Replay: form %zd has a head but no tail", i);
        return -1;
    }
    e->head = (PlanObject *)head;
    e->tail = (PlanObject *)tail;
    if (!PyTuple_Check(e->prepares)) {
        PyErr_Format(PyExc_TypeError, "Replay: form %zd: prepares must be a tuple", i);
        return -1;
    }
    if (e->checks != NULL) {
        if (!PyTuple_Check(e->checks)) {
            PyErr_Format(PyExc_TypeError, "Replay: form %zd: checks must be a tuple or None", i);
            return -1;
        }
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(e->checks); k++) {
            PyObject *c = PyTuple_GET_ITEM(e->checks, k);
            if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 4 || !PyCallable_Check(PyTuple_GET_ITEM(c, 0)) ||
                !PyBool_Check(PyTuple_GET_ITEM(c, 2))) {
                PyErr_Format(PyExc_TypeError, "Replay: form %zd: check %zd must be a tuple (fits, staged, "
                             "reads_staged: bool, reason)", i, k);
                return -1;
            }
        }
    }
    return 0;
}

static PyObject *
Replay_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"forms", "device", "get_device", "get_stream", "slow", "suspects",
                             "check_suspects", "profiler", "live_var", "unset", "outputs", "groups_off", NULL};
    PyObject *forms_arg, *get_device, *get_stream, *slow, *suspects, *check_suspects, *profiler, *live_var,
        *unset, *outputs, *groups_off;
    int device;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OiOOOO!OO!OOOO:Replay", kwlist, &forms_arg, &device, &get_device,
                                     &get_stream, &slow, &PyList_Type, &suspects, &check_suspects, &PyTuple_Type,
                                     &profiler, &live_var, &unset, &outputs, &groups_off))
        return NULL;
    if (PyTuple_GET_SIZE(profiler) != 2 || !PyUnicode_Check(PyTuple_GET_ITEM(profiler, 1))) {
        PyErr_SetString(PyExc_TypeError, "Replay: profiler must be a tuple (holder, attribute name)");
        return NULL;
    }
    if (groups_off != Py_None && !PyFrozenSet_CheckExact(groups_off)) {
        PyErr_SetString(PyExc_TypeError, "Replay: groups_off must be a frozenset or None");
        return NULL;
    }
    if (!PyContextVar_CheckExact(live_var)) {
        PyErr_SetString(PyExc_TypeError, "Replay: live_var must be a contextvars.ContextVar");
        return NULL;
    }
    PyObject *forms = PySequence_Tuple(forms_arg);
    if (forms == NULL)
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(forms);
    FormEntry *entries = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(FormEntry));
    if (entries == NULL) {
        Py_DECREF(forms);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (parse_form(PyTuple_GET_ITEM(forms, i), i, &entries[i]) < 0) {
            PyMem_Free(entries);
            Py_DECREF(forms);
            return NULL;
        }
    }
    ReplayObject *self = (ReplayObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        PyMem_Free(entries);
        Py_DECREF(forms);
        return NULL;
    }
    self->forms = forms;
    self->entries = entries;
    self->n = n;
    self->device = device;
    self->get_device = Py_NewRef(get_device);
    self->get_stream = Py_NewRef(get_stream);
    self->slow = Py_NewRef(slow);
    self->suspects = Py_NewRef(suspects);
    self->check_suspects = Py_NewRef(check_suspects);
    self->profiler = Py_NewRef(profiler);
    self->groups_off = Py_NewRef(groups_off);
    self->live_var = Py_NewRef(live_var);
    self->unset = Py_NewRef(unset);
    self->outputs = Py_NewRef(outputs);
    self->replaying = 0;
    return (PyObject *)self;
}

static PyObject *
replay_slow(ReplayObject *self, PyObject *live, Py_ssize_t index, PyObject *reason)
{
    PyObject *py_index = index == PY_SSIZE_T_MIN ? Py_NewRef(Py_None) : PyLong_FromSsize_t(index);
    if (py_index == NULL)
        return NULL;
    PyObject *argv[3] = {live, py_index, reason};
    PyObject *res = PyObject_Vectorcall(self->slow, argv, 3, NULL);
    Py_DECREF(py_index);
    return res;
}

/* Call fn(exc) on the pending exception (notes), keeping that exception pending. */
static void
annotate_error(PyObject *fn)
{
    if (fn == NULL || !PyErr_Occurred())
        return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *res = value != NULL ? PyObject_CallOneArg(fn, value) : NULL;
    if (res == NULL)
        PyErr_Clear(); /* a note is a convenience: the replay's own error is what counts */
    Py_XDECREF(res);
    PyErr_Restore(type, value, tb);
}

/* Whether fits says yes: 1, 0, or -1 with an exception set. */
static int
ask_fits(PyObject *check, PyObject *live)
{
    PyObject *argv[2] = {live, PyTuple_GET_ITEM(check, 1)};
    Py_ssize_t nargs = PyTuple_GET_ITEM(check, 2) == Py_True ? 2 : 1;
    PyObject *res = PyObject_Vectorcall(PyTuple_GET_ITEM(check, 0), argv, nargs, NULL);
    if (res == NULL)
        return -1;
    int yes = PyObject_IsTrue(res);
    Py_DECREF(res);
    return yes;
}

/* The truth of obj.name: 1, 0, or -1 with an exception set. */
static int
attr_true(PyObject *obj, PyObject *name)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* obj.name += n. 0, or -1 with an exception set. */
static int
attr_add(PyObject *obj, PyObject *name, long n)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    PyObject *k = PyLong_FromLong(n);
    PyObject *next = k != NULL ? PyNumber_Add(v, k) : NULL;
    Py_DECREF(v);
    Py_XDECREF(k);
    if (next == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, next);
    Py_DECREF(next);
    return rc;
}

/* The current device (from get_device()) and, when it is `expected`, its current stream (from
 * get_stream(device)). Returns 1 (both set), 0 (another device: *device set), or -1 with an
 * exception set. */
static int
current_place(PyObject *get_device, PyObject *get_stream, int expected, long *device, CUstream *stream)
{
    PyObject *dev_obj = PyObject_CallNoArgs(get_device);
    if (dev_obj == NULL)
        return -1;
    *device = PyLong_AsLong(dev_obj);
    Py_DECREF(dev_obj);
    if (*device == -1 && PyErr_Occurred())
        return -1;
    if (*device != expected)
        return 0;
    PyObject *dev_arg = PyLong_FromLong(*device);
    PyObject *stream_obj = dev_arg != NULL ? PyObject_CallOneArg(get_stream, dev_arg) : NULL;
    Py_XDECREF(dev_arg);
    if (stream_obj == NULL)
        return -1;
    int bad = parse_stream(stream_obj, stream);
    Py_DECREF(stream_obj);
    return bad < 0 ? -1 : 1;
}

/* The launch of form `e`: head, prepares, tail, with live set. 0, or -1 with an exception set. */
static int
replay_form(ReplayObject *self, FormEntry *e, PyObject *live, CUstream stream, int device)
{
    PyObject *token = NULL;
    if (live != self->unset) {
        token = PyContextVar_Set(self->live_var, live);
        if (token == NULL)
            return -1;
    }
    int rc = 0;
    if (e->head != NULL) {
        rc = plan_run(e->head, stream, device, 0);
        if (rc < 0)
            annotate_error(e->annotate_head);
    }
    for (Py_ssize_t k = 0; rc == 0 && k < PyTuple_GET_SIZE(e->prepares); k++) {
        PyObject *res = PyObject_CallOneArg(PyTuple_GET_ITEM(e->prepares, k), live);
        if (res == NULL)
            rc = -1;
        Py_XDECREF(res);
    }
    if (rc == 0) {
        rc = plan_run(e->tail, stream, device, e->head != NULL && e->head->launches > 0);
        if (rc < 0)
            annotate_error(e->annotate_tail);
    }
    if (token != NULL) {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        if (rc < 0)
            PyErr_Fetch(&type, &value, &tb);
        if (PyContextVar_Reset(self->live_var, token) < 0) {
            if (rc < 0)
                PyErr_Clear(); /* the replay's error is the one to report */
            rc = -1;
        }
        if (type != NULL || value != NULL)
            PyErr_Restore(type, value, tb);
        Py_DECREF(token);
    }
    return rc;
}

PyDoc_STRVAR(Replay_run_doc,
"run(live, /)\n--\n\n"
"One replay: the first form whose checks all pass (``fits(live)``, or\n"
"``fits(live, staged)``; a form without checks takes any ``live``), then, on\n"
"the current device and stream: the held-storage check, ``live`` set,\n"
"``head``, each ``prepare(live)``, ``tail``. Returns ``outputs``. Whatever C\n"
"does not run (a profiler, a form without plans, another device, nothing\n"
"fits) goes to ``slow(live, index, reason)``, with the choice already made\n"
"(``index`` None: no choice made; -1: nothing fits).");

static PyObject *replay_at(ReplayObject *self, PyObject *live, int placed, long dev, CUstream stream);

static PyObject *
Replay_run(ReplayObject *self, PyObject *live)
{
    return replay_at(self, live, 0, -1, NULL);
}

/* Replay_run; `placed`: the caller (a runner call) has read the current device `dev` and its
 * stream `stream` already, so they are not read again. */
static PyObject *
replay_at(ReplayObject *self, PyObject *live, int placed, long dev, CUstream stream)
{
    if (self->forms == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "bcg._native.Replay was cleared");
        return NULL;
    }
    int profiling = attr_true(PyTuple_GET_ITEM(self->profiler, 0), PyTuple_GET_ITEM(self->profiler, 1));
    if (profiling < 0)
        return NULL;
    if (profiling)
        return replay_slow(self, live, PY_SSIZE_T_MIN, Py_None);

    Py_INCREF(self); /* user code (fits, prepare, breakpoints) may drop the last other reference */
    /* From the first fits to the last copy: user code (fits, breakpoints, prepare) or another
     * thread (while the GIL is released) calling reset() meanwhile is refused, not let free the
     * executables this replay is about to launch. */
    self->replaying++;
    PyObject *result = NULL;
    PyObject *reason = Py_None; /* borrowed from forms: why the last staged form tried did not fit */
    Py_ssize_t chosen = -1;
    for (Py_ssize_t i = 0; i < self->n && chosen < 0; i++) {
        PyObject *checks = self->entries[i].checks;
        if (checks == NULL) {
            chosen = i;
            break;
        }
        int all = 1;
        for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(checks); k++) {
            PyObject *check = PyTuple_GET_ITEM(checks, k);
            int yes = ask_fits(check, live);
            if (yes < 0)
                goto done;
            if (!yes) {
                reason = PyTuple_GET_ITEM(check, 3);
                all = 0;
                break;
            }
        }
        if (all)
            chosen = i;
    }
    if (self->n == 0) { /* cleared during a fits */
        PyErr_SetString(PyExc_RuntimeError, "bcg._native.Replay was cleared during its replay");
        goto done;
    }
    if (chosen < 0 || self->entries[chosen].tail == NULL) {
        result = replay_slow(self, live, chosen, reason);
        goto done;
    }
    FormEntry *e = &self->entries[chosen];
    int here = placed ? dev == self->device
                      : current_place(self->get_device, self->get_stream, self->device, &dev, &stream);
    if (here < 0)
        goto done;
    if (here == 0) { /* Python says which device to replay on */
        result = replay_slow(self, live, chosen, reason);
        goto done;
    }
    if (PyList_GET_SIZE(self->suspects) > 0) {
        PyObject *ok = PyObject_CallOneArg(self->check_suspects, self->suspects);
        if (ok == NULL)
            goto done;
        Py_DECREF(ok);
    }
    if (replay_form(self, e, live, stream, (int)dev) < 0)
        goto done;
    if (attr_add(e->form, str_replays, 1) < 0)
        goto done;
    if (e->after != NULL) {
        PyObject *res = PyObject_CallNoArgs(e->after);
        if (res == NULL)
            goto done;
        Py_DECREF(res);
    }
    result = Py_NewRef(self->outputs != NULL ? self->outputs : Py_None);
done:
    self->replaying--;
    Py_DECREF(self);
    return result;
}

static PyObject *
Replay_get_replaying(ReplayObject *self, void *closure)
{
    return PyLong_FromSsize_t(self->replaying);
}

static PyObject *
Replay_repr(ReplayObject *self)
{
    return PyUnicode_FromFormat("<bcg._native.Replay: %zd forms on cuda:%d>", self->n, self->device);
}

static PyMethodDef Replay_methods[] = {
    {"run", (PyCFunction)Replay_run, METH_O, Replay_run_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *
Replay_get_groups_off(ReplayObject *self, void *closure)
{
    return Py_NewRef(self->groups_off != NULL ? self->groups_off : Py_None);
}

static PyGetSetDef Replay_getset[] = {
    {"replaying", (getter)Replay_get_replaying, NULL, "Replays in progress, from the form's choice to the output copy.",
     NULL},
    {"groups_off", (getter)Replay_get_groups_off, NULL,
     "The node groups every form skips (a frozenset), or None: not known.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyDoc_STRVAR(Replay_doc,
"Replay(forms, device, get_device, get_stream, slow, suspects, check_suspects, profiler, live_var, unset, "
"outputs, groups_off)\n--\n\n"
"One graph's replay in C (see ``run``). ``forms``: tuples ``(checks, head, tail,\n"
"prepares, form, after, annotate_head, annotate_tail)`` in the order a replay\n"
"tries them; ``checks`` tuples ``(fits, staged, reads_staged, reason)`` or None\n"
"(takes any live metadata); ``head``/``tail`` ``Plan`` s (``tail`` None: the\n"
"form replays through ``slow``). ``profiler``: ``(holder, name)``, where\n"
"``getattr(holder, name)`` is true while a profiler runs. ``groups_off``: the\n"
"frozenset of node groups every form skips, or None (not known). Built by ``bcg.graph``; rebuilt\n"
"whenever a form's executor, the outputs, the forms or the groups switched\n"
"off change.");

static PyTypeObject ReplayType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bcg._native.Replay",
    .tp_basicsize = sizeof(ReplayObject),
    .tp_dealloc = (destructor)Replay_dealloc,
    .tp_repr = (reprfunc)Replay_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Replay_doc,
    .tp_traverse = (traverseproc)Replay_traverse,
    .tp_clear = (inquiry)Replay_clear,
    .tp_methods = Replay_methods,
    .tp_getset = Replay_getset,
    .tp_new = Replay_new,
};

/* ---- Call: a GraphRunner call on its own input buffers, in C ----------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *runner;      /* its _real_rows counts the rows of real calls */
    PyObject *handed;      /* dict: id(first padded input) -> (T, bucket, inputs) */
    Py_ssize_t first;      /* the position of the first padded input */
    PyObject *buckets;     /* dict: size -> Bucket */
    PyObject *ladder;      /* kept_own_pools: non-empty means Python frees them first */
    PyObject *schedule;    /* serving: false means Python sets the ladder up first */
    PyObject *lock_state;  /* PoolCallLock: background, last_stream */
    PyObject *lock;        /* its RLock */
    PyObject *views_safe;  /* () -> whether this call may return views */
    PyObject *padding;     /* the padding node group's label */
    PyObject *get_device, *get_stream;
    int device;
    double max_ratio;      /* < 0: any padding share */
} CallObject;

static PyObject *str_background, *str_kept_own_pools, *str_serving, *str_captured, *str_failure, *str_graph,
    *str_sliced, *str_single, *str_last_stream, *str_real_rows, *str_native, *str_set_enabled, *str_replay,
    *str_acquire, *str_release, *str_sanitizer, *str_set_rows, *str_shared, *str_first_caller, *str_rows_written,
    *str_graph_replaying, *str_leaves, *str_slice;

static int
Call_traverse(CallObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->runner);
    Py_VISIT(self->handed);
    Py_VISIT(self->buckets);
    Py_VISIT(self->ladder);
    Py_VISIT(self->schedule);
    Py_VISIT(self->lock_state);
    Py_VISIT(self->lock);
    Py_VISIT(self->views_safe);
    Py_VISIT(self->padding);
    Py_VISIT(self->get_device);
    Py_VISIT(self->get_stream);
    return 0;
}

static int
Call_clear(CallObject *self)
{
    Py_CLEAR(self->runner);
    Py_CLEAR(self->handed);
    Py_CLEAR(self->buckets);
    Py_CLEAR(self->ladder);
    Py_CLEAR(self->schedule);
    Py_CLEAR(self->lock_state);
    Py_CLEAR(self->lock);
    Py_CLEAR(self->views_safe);
    Py_CLEAR(self->padding);
    Py_CLEAR(self->get_device);
    Py_CLEAR(self->get_stream);
    return 0;
}

static void
Call_dealloc(CallObject *self)
{
    PyObject_GC_UnTrack(self);
    Call_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
Call_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"runner", "handed", "first", "buckets", "ladder", "schedule", "lock_state",
                             "views_safe", "padding", "device", "get_device", "get_stream",
                             "max_ratio", NULL};
    PyObject *runner, *handed, *buckets, *ladder, *schedule, *lock_state, *views_safe, *padding,
        *get_device, *get_stream;
    Py_ssize_t first;
    int device;
    double max_ratio;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!nO!OOOOOiOOd:Call", kwlist, &runner, &PyDict_Type, &handed,
                                     &first, &PyDict_Type, &buckets, &ladder, &schedule, &lock_state, &views_safe,
                                     &padding, &device, &get_device, &get_stream, &max_ratio))
        return NULL;
    PyObject *lock = PyObject_GetAttrString(lock_state, "lock");
    if (lock == NULL)
        return NULL;
    CallObject *self = (CallObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(lock);
        return NULL;
    }
    self->runner = Py_NewRef(runner);
    self->handed = Py_NewRef(handed);
    self->first = first;
    self->buckets = Py_NewRef(buckets);
    self->ladder = Py_NewRef(ladder);
    self->schedule = Py_NewRef(schedule);
    self->lock_state = Py_NewRef(lock_state);
    self->lock = lock;
    self->views_safe = Py_NewRef(views_safe);
    self->padding = Py_NewRef(padding);
    self->get_device = Py_NewRef(get_device);
    self->get_stream = Py_NewRef(get_stream);
    self->device = device;
    self->max_ratio = max_ratio;
    return (PyObject *)self;
}

#define CALL_PYTHON() (Py_NewRef(Py_NotImplemented))

/* 1 where the call lock's views_safe() would plainly say yes, with nothing to record: no
 * background capture, this thread its first caller and no other thread has called. 0: ask
 * views_safe(). -1 with an exception set. (Read under the call lock, as views_safe() is.) */
static int
views_plainly_safe(PyObject *lock_state)
{
    int busy = attr_true(lock_state, str_background);
    if (busy != 0)
        return busy < 0 ? -1 : 0;
    int shared = attr_true(lock_state, str_shared);
    if (shared != 0)
        return shared < 0 ? -1 : 0;
    PyObject *first = PyObject_GetAttr(lock_state, str_first_caller);
    if (first == NULL)
        return -1;
    int mine = 0;
    if (PyLong_CheckExact(first)) {
        unsigned long ident = PyLong_AsUnsignedLong(first);
        if (ident == (unsigned long)-1 && PyErr_Occurred())
            PyErr_Clear(); /* not a thread ident: views_safe() decides */
        else
            mine = ident == PyThread_get_thread_ident(); /* what threading.get_ident() returns */
    }
    Py_DECREF(first);
    return mine;
}

static PyObject *Call_bucket(CallObject *self, PyObject *bucket, PyObject *live, long T, long n);

PyDoc_STRVAR(Call_call_doc,
"call(inputs, live, /)\n--\n\n"
"One runner call on inputs ``input_buffers(T)`` handed out, when nothing\n"
"unusual holds: the bucket captured into the runner's pool, its views for\n"
"``T`` made, within the padding limit, the call lock free, views allowed, the\n"
"current device the runner's and the stream the last replay's. Then, under\n"
"the call lock: the sanitizer's row count, the padding group on or off, the\n"
"graph's replay (in C when it has one), the counts; returns the output view\n"
"(a copy where a breakpoint began a background capture and views_safe() then\n"
"says no, as the Python call decides after the replay).\n"
"Otherwise ``NotImplemented``, having done nothing: the Python call runs.");

static PyObject *
Call_call(CallObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "call(inputs: tuple, live)");
        return NULL;
    }
    PyObject *inputs = args[0], *live = args[1];
    if (self->runner == NULL)
        return CALL_PYTHON();
    int t = attr_true(self->lock_state, str_background);
    if (t != 0)
        return t < 0 ? NULL : CALL_PYTHON();
    Py_ssize_t n_in = PyTuple_GET_SIZE(inputs);
    if (n_in <= self->first)
        return CALL_PYTHON();
    PyObject *key = PyLong_FromVoidPtr(PyTuple_GET_ITEM(inputs, self->first));
    if (key == NULL)
        return NULL;
    PyObject *found = PyDict_GetItemWithError(self->handed, key); /* borrowed */
    Py_DECREF(key);
    if (found == NULL)
        return PyErr_Occurred() ? NULL : CALL_PYTHON();
    if (!PyTuple_Check(found) || PyTuple_GET_SIZE(found) != 3)
        return CALL_PYTHON();
    PyObject *handed = PyTuple_GET_ITEM(found, 2);
    if (!PyTuple_Check(handed) || PyTuple_GET_SIZE(handed) != n_in)
        return CALL_PYTHON();
    /* (the inputs tuple holds the handed tensors, and the ints below are taken as values) */
    for (Py_ssize_t i = 0; i < n_in; i++)
        if (PyTuple_GET_ITEM(handed, i) != PyTuple_GET_ITEM(inputs, i))
            return CALL_PYTHON();
    long T = PyLong_AsLong(PyTuple_GET_ITEM(found, 0));
    long n = PyLong_AsLong(PyTuple_GET_ITEM(found, 1));
    if ((T == -1 || n == -1) && PyErr_Occurred())
        return NULL;
    if (self->max_ratio >= 0 && (double)(n - T) > self->max_ratio * (double)n)
        return CALL_PYTHON(); /* Python counts the padding-waste fallback */
    PyObject *bucket_key = PyTuple_GET_ITEM(found, 1);
    PyObject *bucket = PyDict_GetItemWithError(self->buckets, bucket_key); /* borrowed, held below */
    if (bucket == NULL)
        return PyErr_Occurred() ? NULL : CALL_PYTHON();
    Py_INCREF(bucket);
    PyObject *ret = Call_bucket(self, bucket, live, T, n);
    Py_DECREF(bucket);
    return ret;
}

/* The rest of Call.call, for `bucket` (held by the caller). */
static PyObject *
Call_bucket(CallObject *self, PyObject *bucket, PyObject *live, long T, long n)
{
    /* The call lock first, if free (else Python waits for it, counted): the state read below is
     * what captures, lazy calls and reset() change under it. */
    PyObject *got = PyObject_CallMethodOneArg(self->lock, str_acquire, Py_False);
    if (got == NULL)
        return NULL;
    int locked = PyObject_IsTrue(got);
    Py_DECREF(got);
    if (locked <= 0)
        return locked < 0 ? NULL : CALL_PYTHON();
    PyObject *result = NULL, *views = NULL, *sliced = NULL, *py_T = NULL, *graph = NULL;
    int t;
    if ((t = attr_true(self->ladder, str_kept_own_pools)) != 0 || (t = attr_true(self->schedule, str_serving)) != 1 ||
        (t = attr_true(bucket, str_captured)) != 1 || (t = attr_true(bucket, str_single)) != 1) {
        if (t < 0)
            goto done;
        goto python;
    }
    PyObject *failure = PyObject_GetAttr(bucket, str_failure);
    if (failure == NULL)
        goto done;
    Py_DECREF(failure);
    if (failure != Py_None)
        goto python;
    graph = PyObject_GetAttr(bucket, str_graph);
    if (graph == NULL)
        goto done;
    if (graph == Py_None)
        goto python;
    sliced = PyObject_GetAttr(bucket, str_sliced);
    if (sliced == NULL)
        goto done;
    py_T = PyLong_FromLong(T);
    if (py_T == NULL)
        goto done;
    if (!PyDict_Check(sliced))
        goto python;
    views = PyDict_GetItemWithError(sliced, py_T);
    if (views == NULL && PyErr_Occurred())
        goto done;
    if (views == NULL || !PyList_Check(views) || PyList_GET_SIZE(views) < 1) {
        views = NULL;
        goto python; /* Python makes the views of T first */
    }
    Py_INCREF(views);
    t = views_plainly_safe(self->lock_state);
    if (t == 0) {
        PyObject *safe = PyObject_CallNoArgs(self->views_safe);
        if (safe == NULL)
            goto done;
        t = PyObject_IsTrue(safe);
        Py_DECREF(safe);
        if (t == 0)
            goto python; /* Python copies the outputs */
    }
    if (t < 0)
        goto done;
    long dev;
    CUstream raw;
    int here = current_place(self->get_device, self->get_stream, self->device, &dev, &raw);
    if (here < 0)
        goto done;
    if (here == 0)
        goto python; /* Python says which device */
    PyObject *stream = PyLong_FromVoidPtr(raw);
    if (stream == NULL)
        goto done;
    PyObject *last = PyObject_GetAttr(self->lock_state, str_last_stream);
    if (last == NULL) {
        Py_DECREF(stream);
        goto done;
    }
    int same = last == Py_None ? 1 : PyObject_RichCompareBool(last, stream, Py_EQ);
    Py_DECREF(last);
    if (same != 1) {
        Py_DECREF(stream);
        if (same < 0)
            goto done;
        goto python; /* Python orders this replay after the other stream's */
    }
    if (PyObject_SetAttr(self->lock_state, str_last_stream, stream) < 0) {
        Py_DECREF(stream);
        goto done;
    }
    PyObject *sanitizer = PyObject_GetAttr(self->ladder, str_sanitizer);
    if (sanitizer == NULL) {
        Py_DECREF(stream);
        goto done;
    }
    /* set_rows(T, stream) writes nothing when T is the count it wrote last: then it is not called */
    PyObject *written = PyObject_GetAttr(sanitizer, str_rows_written);
    int same_rows = written != NULL ? PyObject_RichCompareBool(written, py_T, Py_EQ) : -1;
    Py_XDECREF(written);
    PyObject *res = NULL;
    if (same_rows == 0) {
        PyObject *argv[3] = {sanitizer, py_T, stream};
        res = PyObject_VectorcallMethod(str_set_rows, argv, 3, NULL);
        Py_XDECREF(res);
    }
    Py_DECREF(sanitizer);
    Py_DECREF(stream);
    if (same_rows < 0 || (same_rows == 0 && res == NULL))
        goto done;
    /* the padding group on or off: set_enabled is not called when the graph's native replay was
     * built with the group already so (the graph builds another when its groups change), and no
     * replay of the graph is in progress (a call from its breakpoint: set_enabled refuses it) */
    PyObject *native = PyObject_GetAttr(graph, str_native);
    if (native == NULL)
        goto done;
    int off = -2; /* whether the native replay's forms skip the padding group; -2: not known */
    if (Py_IS_TYPE(native, &ReplayType) && ((ReplayObject *)native)->groups_off != NULL &&
        ((ReplayObject *)native)->groups_off != Py_None && ((ReplayObject *)native)->replaying == 0) {
        /* (with replaying above: the two counts BreakableGraph._in_replay reads) */
        int busy = attr_true(graph, str_graph_replaying); /* a replay through Python */
        if (busy == 0)
            off = PySet_Contains(((ReplayObject *)native)->groups_off, self->padding);
        if (busy < 0 || off == -1) {
            Py_DECREF(native);
            goto done;
        }
    }
    if (off != (T >= n)) { /* T < n: rows are padded, the zeroing runs */
        Py_DECREF(native);
        PyObject *argv[3] = {graph, self->padding, (T < n) ? Py_True : Py_False};
        res = PyObject_VectorcallMethod(str_set_enabled, argv, 3, NULL);
        if (res == NULL)
            goto done;
        Py_DECREF(res);
        native = PyObject_GetAttr(graph, str_native);
        if (native == NULL)
            goto done;
    }
    if (Py_IS_TYPE(native, &ReplayType))
        res = replay_at((ReplayObject *)native, live, 1, dev, raw); /* (device and stream read above) */
    else {
        PyObject *rargv[2] = {graph, live};
        res = PyObject_VectorcallMethod(str_replay, rargv, 2, NULL);
    }
    Py_DECREF(native);
    if (res == NULL)
        goto done;
    Py_DECREF(res);
    if (attr_add(bucket, str_replays, 1) < 0 || attr_add(self->runner, str_real_rows, T) < 0)
        goto done;
    /* A breakpoint began a background capture of the pool: views_safe() is asked again, as the
     * Python call asks it after the replay (a copy, unless this thread is inside locked()). */
    if ((t = attr_true(self->lock_state, str_background)) == 1) {
        PyObject *safe = PyObject_CallNoArgs(self->views_safe);
        if (safe == NULL)
            goto done;
        t = PyObject_IsTrue(safe);
        Py_DECREF(safe);
        if (t == 0) {
            PyObject *leaves = PyObject_GetAttr(bucket, str_leaves);
            if (leaves == NULL)
                goto done;
            PyObject *argv[5] = {bucket, leaves, py_T, Py_True, Py_True};
            result = PyObject_VectorcallMethod(str_slice, argv, 5, NULL); /* slice(leaves, T, copy, keep) */
            Py_DECREF(leaves);
            goto done;
        }
    }
    if (t < 0)
        goto done;
    result = Py_NewRef(PyList_GET_ITEM(views, 0));
    goto done;
python:
    result = CALL_PYTHON();
done:
    if (locked) {
        PyObject *type = NULL, *value = NULL, *tb = NULL;
        if (result == NULL)
            PyErr_Fetch(&type, &value, &tb);
        PyObject *r = PyObject_CallMethodNoArgs(self->lock, str_release);
        if (r == NULL) {
            if (result != NULL) {
                Py_CLEAR(result);
            }
            else
                PyErr_Clear();
        }
        Py_XDECREF(r);
        if (type != NULL || value != NULL)
            PyErr_Restore(type, value, tb);
    }
    Py_XDECREF(views);
    Py_XDECREF(sliced);
    Py_XDECREF(py_T);
    Py_XDECREF(graph);
    return result;
}

static PyMethodDef Call_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Call_call, METH_FASTCALL, Call_call_doc},
    {NULL, NULL, 0, NULL},
};

PyDoc_STRVAR(Call_doc,
"Call(runner, handed, first, buckets, ladder, schedule, lock_state, views_safe, padding, device, "
"get_device, get_stream, max_ratio)\n--\n\n"
"A ``GraphRunner``'s call in C, for the calls it can serve (see ``call``).\n"
"It reads the runner's state at every call and keeps none of its own.");

static PyTypeObject CallType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bcg._native.Call",
    .tp_basicsize = sizeof(CallObject),
    .tp_dealloc = (destructor)Call_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = Call_doc,
    .tp_traverse = (traverseproc)Call_traverse,
    .tp_clear = (inquiry)Call_clear,
    .tp_methods = Call_methods,
    .tp_new = Call_new,
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
    if (PyType_Ready(&PlanType) < 0 || PyType_Ready(&ReplayType) < 0 || PyType_Ready(&CallType) < 0)
        return NULL;
    struct { PyObject **slot; const char *text; } names[] = {
        {&str_replays, "replays"}, {&str_background, "background"}, {&str_kept_own_pools, "kept_own_pools"},
        {&str_serving, "serving"}, {&str_captured, "captured"}, {&str_failure, "failure"}, {&str_graph, "graph"},
        {&str_sliced, "sliced"}, {&str_single, "single"}, {&str_last_stream, "last_stream"},
        {&str_real_rows, "_real_rows"}, {&str_native, "_native"}, {&str_set_enabled, "set_enabled"},
        {&str_replay, "replay"}, {&str_acquire, "acquire"}, {&str_release, "release"},
        {&str_sanitizer, "sanitizer"}, {&str_set_rows, "set_rows"}, {&str_shared, "shared"},
        {&str_first_caller, "first_caller"}, {&str_rows_written, "rows_written"},
        {&str_graph_replaying, "_replaying"}, {&str_leaves, "leaves"}, {&str_slice, "slice"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].text);
        if (*names[i].slot == NULL)
            return NULL;
    }
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&PlanType);
    if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(&PlanType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&ReplayType);
    if (PyModule_AddObject(m, "Replay", (PyObject *)&ReplayType) < 0) {
        Py_DECREF(&ReplayType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&CallType);
    if (PyModule_AddObject(m, "Call", (PyObject *)&CallType) < 0) {
        Py_DECREF(&CallType);
        Py_DECREF(m);
        return NULL;
    }
    if (PyModule_AddStringConstant(m, "DRIVER_LIBRARY", "libcuda.so.1") < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
