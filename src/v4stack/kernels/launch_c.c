/* The light launcher's hot path in C (``v4stack.kernels.launch`` builds it with the system C
 * compiler the first time and falls back to its Python path when that is impossible).
 *
 * launch(kernel, grid, *args, **consts) builds the specialisation key - the kernel's id, the current device, each
 * constexpr's name and value, two items per runtime argument (a tensor: its dtype and whether its
 * data pointer is 16-byte aligned; an int: its class: == 1, i32, i64 or u64, each 16-divisible or
 * not; a bool, a float, None) - looks it up in the cache dict, and for an ``Entry`` packs the
 * arguments into the kernel's parameter slots and calls ``cuLaunchKernel`` on the current torch
 * stream (``cuLaunchKernelEx`` with programmatic stream serialisation for an entry made with
 * ``pdl`` while ``set_pdl(True)`` holds: the kernel may be launched while the one before it in the
 * stream finishes, and waits for it in its first instruction - ``kernels/gdc.py``). A miss, or an entry that is not an ``Entry``, goes to the Python ``fallback(kernel, grid,
 * args, consts, key)``, which compiles through Triton and fills the cache (``key`` None: an argument
 * the key cannot read, launched by Triton itself).
 *
 * The driver is reached through dlopen("libcuda.so.1") on first use, so the module builds and
 * imports on a machine without CUDA (the CPU test run checks its keys and its packing).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define MAX_ARGS 64

typedef int CUresult;
typedef void *CUfunction, *CUstream, *CUcontext;
typedef int CUdevice;
typedef CUresult (*launch_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             CUstream, void **, void **);
typedef CUresult (*ctx_get_t)(CUcontext *);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*dev_get_t)(CUdevice *, int);
typedef CUresult (*retain_t)(CUcontext *, CUdevice);
typedef CUresult (*errstr_t)(CUresult, const char **);
/* cuLaunchKernelEx's configuration, as cuda.h lays it out (an attribute: its id padded to 8 bytes,
 * then a 64-byte value union) */
typedef struct {
  int id;
  char pad[4];
  union {
    int flag;
    char bytes[64];
  } value;
} LaunchAttr;
typedef struct {
  unsigned gridX, gridY, gridZ, blockX, blockY, blockZ, shmem;
  CUstream stream;
  LaunchAttr *attrs;
  unsigned nattrs;
} LaunchConfig;
typedef CUresult (*launch_ex_t)(const LaunchConfig *, CUfunction, void **, void **);
enum { ATTR_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };
_Static_assert(sizeof(LaunchAttr) == 72 && offsetof(LaunchAttr, value) == 8, "CUlaunchAttribute's layout");
_Static_assert(offsetof(LaunchConfig, stream) == 32 && sizeof(LaunchConfig) == 56, "CUlaunchConfig's layout");

static launch_t cu_launch;
static launch_ex_t cu_launch_ex;
static int pdl_on;  /* set_pdl(): whether an entry made with pdl is launched programmatically now */
static ctx_get_t cu_ctx_get;
static ctx_set_t cu_ctx_set;
static dev_get_t cu_dev_get;
static retain_t cu_retain;
static errstr_t cu_errstr;

static PyObject *cache, *fallback, *tensor_type, *get_device, *get_stream;
static PyObject *s_data_ptr, *s_dtype;
static PyObject *codes[11];

enum { K_SKIP = 's', K_PTR = 'p', K_I32 = 'i', K_I64 = 'l', K_U64 = 'u', K_U1 = 'b', K_F32 = 'f' };

/* ---- Entry: one compiled kernel as the C path launches it -------------------------------- */

typedef struct {
  PyObject_HEAD
  CUfunction fn;
  unsigned block, shmem;
  int nargs, nparams, pdl;
  char kinds[MAX_ARGS];
} Entry;

static int Entry_init(Entry *self, PyObject *args, PyObject *kw) {
  unsigned long long fn;
  unsigned block, shmem;
  const char *kinds;
  Py_ssize_t n;
  int pdl = 0;
  if (!PyArg_ParseTuple(args, "KIIs#|p", &fn, &block, &shmem, &kinds, &n, &pdl)) return -1;
  if (n > MAX_ARGS) {
    PyErr_SetString(PyExc_ValueError, "Entry: too many arguments");
    return -1;
  }
  self->fn = (CUfunction)(uintptr_t)fn;
  self->block = block;
  self->shmem = shmem;
  self->nargs = (int)n;
  self->nparams = 0;
  self->pdl = pdl;
  for (Py_ssize_t i = 0; i < n; i++) {
    char k = kinds[i];
    if (!strchr("splibfu", k)) {
      PyErr_Format(PyExc_ValueError, "Entry: unknown argument kind %c", k);
      return -1;
    }
    self->kinds[i] = k;
    self->nparams += k != K_SKIP;
  }
  return 0;
}

static PyTypeObject EntryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "v4stack_launch.Entry",
    .tp_basicsize = sizeof(Entry),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Entry_init,
    .tp_doc = "Entry(function, block_threads, shared_bytes, kinds, pdl=False): a kernel the C path launches",
};

/* ---- the key ------------------------------------------------------------------------------ */

/* Fill key items 2i, 2i+1 for argument a; store a tensor's data pointer in *ptr. Returns 0, or -1
 * with an exception set (also for an argument kind the C path does not know: TypeError). */
static int arg_code(PyObject *a, PyObject **k0, PyObject **k1, unsigned long long *ptr) {
  *k1 = Py_None;
  if (PyObject_TypeCheck(a, (PyTypeObject *)tensor_type)) {
    PyObject *p = PyObject_CallMethodNoArgs(a, s_data_ptr);
    if (!p) return -1;
    *ptr = PyLong_AsUnsignedLongLong(p);
    Py_DECREF(p);
    if (PyErr_Occurred()) return -1;
    *k0 = PyObject_GetAttr(a, s_dtype);
    if (!*k0) return -1;
    *k1 = (*ptr & 15) == 0 ? Py_True : Py_False;
    Py_INCREF(*k1);
    return 0;
  }
  int c;
  if (a == Py_None) {
    c = 10;
  } else if (PyBool_Check(a)) {
    c = 8;
  } else if (PyLong_CheckExact(a)) {
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(a, &overflow);
    if (overflow < 0) {
      PyErr_SetString(PyExc_TypeError, "int argument below -2**63");
      return -1;
    }
    if (overflow > 0) {
      unsigned long long u = PyLong_AsUnsignedLongLong(a);
      if (PyErr_Occurred()) return -1;
      c = u % 16 == 0 ? 6 : 7;
    } else {
      int d = v % 16 == 0;
      c = v == 1 ? 1 : (v >= INT32_MIN && v <= INT32_MAX) ? (d ? 2 : 3) : (d ? 4 : 5);
    }
  } else if (PyFloat_CheckExact(a)) {
    c = 9;
  } else {
    PyErr_Format(PyExc_TypeError, "argument of type %s", Py_TYPE(a)->tp_name);
    return -1;
  }
  *k0 = codes[c];
  Py_INCREF(*k0);
  Py_INCREF(Py_None);
  return 0;
}

/* key = (id(kernel), device, name_0, value_0, ..., then two items per argument); the constexprs are
 * ``names`` (a tuple, or NULL for none) with their values in ``vals`` */
static PyObject *make_key(PyObject *kernel, PyObject *dev, PyObject *const *args, Py_ssize_t n, PyObject *names,
                          PyObject *const *vals, unsigned long long *ptrs) {
  Py_ssize_t nc = names ? PyTuple_GET_SIZE(names) : 0;
  PyObject *key = PyTuple_New(2 + 2 * nc + 2 * n);
  if (!key) return NULL;
  PyObject *kid = PyLong_FromVoidPtr(kernel);  /* id(kernel): a JITFunction's own hash is Python code */
  if (!kid) {
    Py_DECREF(key);
    return NULL;
  }
  PyTuple_SET_ITEM(key, 0, kid);
  Py_INCREF(dev);
  PyTuple_SET_ITEM(key, 1, dev);
  Py_ssize_t j = 2;
  for (Py_ssize_t i = 0; i < nc; i++) {
    PyObject *name = PyTuple_GET_ITEM(names, i);
    Py_INCREF(name);
    Py_INCREF(vals[i]);
    PyTuple_SET_ITEM(key, j++, name);
    PyTuple_SET_ITEM(key, j++, vals[i]);
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *k0, *k1;
    if (arg_code(args[i], &k0, &k1, &ptrs[i]) < 0) {
      Py_DECREF(key);
      return NULL;
    }
    PyTuple_SET_ITEM(key, j++, k0);
    PyTuple_SET_ITEM(key, j++, k1);
  }
  return key;
}

/* ---- packing ------------------------------------------------------------------------------ */

/* Parameter slots for an entry: slots[] hold the values, params[] point at them; the two trailing
 * scratch pointers Triton 3.6 kernels take are null. Returns the number of params or -1. */
static int pack(Entry *e, PyObject *const *args, Py_ssize_t n, const unsigned long long *ptrs, uint64_t *slots,
                void **params) {
  if (n != e->nargs) {
    PyErr_Format(PyExc_TypeError, "kernel takes %d runtime arguments, got %zd", e->nargs, n);
    return -1;
  }
  int p = 0;
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *a = args[i];
    uint64_t *s = &slots[p];
    *s = 0;
    switch (e->kinds[i]) {
      case K_SKIP:
        continue;
      case K_PTR:
        *s = ptrs[i];
        break;
      case K_I32: {
        int32_t v = (int32_t)PyLong_AsLong(a);
        memcpy(s, &v, 4);
        break;
      }
      case K_I64: {
        int64_t v = PyLong_AsLongLong(a);
        memcpy(s, &v, 8);
        break;
      }
      case K_U64:
        *s = PyLong_AsUnsignedLongLong(a);
        break;
      case K_U1: {
        uint8_t v = (uint8_t)(a == Py_True);
        memcpy(s, &v, 1);
        break;
      }
      case K_F32: {
        float v = (float)PyFloat_AsDouble(a);
        memcpy(s, &v, 4);
        break;
      }
    }
    params[p] = s;
    p++;
  }
  if (PyErr_Occurred()) return -1;
  slots[p] = slots[p + 1] = 0;
  params[p] = &slots[p];
  params[p + 1] = &slots[p + 1];
  return p + 2;
}

/* ---- the driver --------------------------------------------------------------------------- */

static int driver(void) {
  if (cu_launch) return 0;
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!h) {
    PyErr_SetString(PyExc_RuntimeError, "light launcher: libcuda.so.1 not found");
    return -1;
  }
  cu_ctx_get = (ctx_get_t)dlsym(h, "cuCtxGetCurrent");
  cu_ctx_set = (ctx_set_t)dlsym(h, "cuCtxSetCurrent");
  cu_dev_get = (dev_get_t)dlsym(h, "cuDeviceGet");
  cu_retain = (retain_t)dlsym(h, "cuDevicePrimaryCtxRetain");
  cu_errstr = (errstr_t)dlsym(h, "cuGetErrorString");
  launch_t l = (launch_t)dlsym(h, "cuLaunchKernel");
  if (!(cu_ctx_get && cu_ctx_set && cu_dev_get && cu_retain && cu_errstr && l)) {
    PyErr_SetString(PyExc_RuntimeError, "light launcher: a driver entry point is missing");
    return -1;
  }
  cu_launch_ex = (launch_ex_t)dlsym(h, "cuLaunchKernelEx");  /* optional: without it, no PDL launches */
  cu_launch = l;
  return 0;
}

static int check(CUresult r, const char *what) {
  if (r == 0) return 0;
  const char *s = "unknown error";
  if (cu_errstr) cu_errstr(r, &s);
  PyErr_Format(PyExc_RuntimeError, "light launcher: %s failed: %s (%d)", what, s, r);
  return -1;
}

static int grid_dims(PyObject *grid, unsigned g[3]) {
  g[0] = g[1] = g[2] = 1;
  PyObject *seq = PySequence_Fast(grid, "grid must be a tuple of 1 to 3 ints");
  if (!seq) return -1;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  if (n < 1 || n > 3) {
    Py_DECREF(seq);
    PyErr_SetString(PyExc_TypeError, "grid must be a tuple of 1 to 3 ints");
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v < 0 || v > 0x7fffffffL) {
      Py_DECREF(seq);
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "grid dimension out of range");
      return -1;
    }
    g[i] = (unsigned)v;
  }
  Py_DECREF(seq);
  return 0;
}

static PyObject *run_entry(Entry *e, PyObject *grid, PyObject *dev, PyObject *const *args, Py_ssize_t n,
                           const unsigned long long *ptrs) {
  uint64_t slots[MAX_ARGS + 2];
  void *params[MAX_ARGS + 2];
  unsigned g[3];
  if (pack(e, args, n, ptrs, slots, params) < 0 || grid_dims(grid, g) < 0 || driver() < 0) return NULL;
  if ((unsigned long long)g[0] * g[1] * g[2] == 0) Py_RETURN_NONE;
  PyObject *st = PyObject_CallOneArg(get_stream, dev);
  if (!st) return NULL;
  unsigned long long stream = PyLong_AsUnsignedLongLong(st);
  Py_DECREF(st);
  if (PyErr_Occurred()) return NULL;
  CUcontext ctx;
  if (check(cu_ctx_get(&ctx), "cuCtxGetCurrent") < 0) return NULL;
  if (!ctx) {  /* a thread torch has not made current yet: the device's primary context */
    CUdevice d;
    if (check(cu_dev_get(&d, (int)PyLong_AsLong(dev)), "cuDeviceGet") < 0 ||
        check(cu_retain(&ctx, d), "cuDevicePrimaryCtxRetain") < 0 || check(cu_ctx_set(ctx), "cuCtxSetCurrent") < 0)
      return NULL;
  }
  if (e->pdl && pdl_on && cu_launch_ex) {
    LaunchAttr attr;
    memset(&attr, 0, sizeof attr);
    attr.id = ATTR_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.flag = 1;
    LaunchConfig cfg = {g[0], g[1], g[2], e->block, 1, 1, e->shmem, (CUstream)(uintptr_t)stream, &attr, 1};
    if (check(cu_launch_ex(&cfg, e->fn, params, NULL), "cuLaunchKernelEx") < 0) return NULL;
    Py_RETURN_NONE;
  }
  if (check(cu_launch(e->fn, g[0], g[1], g[2], e->block, 1, 1, e->shmem, (CUstream)(uintptr_t)stream, params, NULL),
            "cuLaunchKernel") < 0)
    return NULL;
  Py_RETURN_NONE;
}

/* ---- module functions --------------------------------------------------------------------- */

static int ready(void) {
  if (cache) return 0;
  PyErr_SetString(PyExc_RuntimeError, "light launcher: init() was not called");
  return -1;
}

static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
  if (ready() < 0) return NULL;
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "launch(kernel, grid, *args, **consts)");
    return NULL;
  }
  PyObject *kw = NULL;
  Py_ssize_t n = nargs - 2;
  unsigned long long ptrs[MAX_ARGS];
  PyObject *res = NULL, *key = NULL, *dev = NULL;
  if (n > MAX_ARGS) {
    PyErr_SetString(PyExc_TypeError, "light launcher: too many arguments");
    goto done;
  }
  dev = PyObject_CallNoArgs(get_device);
  if (!dev) goto done;
  key = make_key(args[0], dev, args + 2, n, kwnames, args + nargs, ptrs);
  if (!key) {
    if (!PyErr_ExceptionMatches(PyExc_TypeError)) goto done;
    PyErr_Clear();  /* an argument the key cannot read: the fallback gets key None (Triton's own launch) */
    key = Py_None;
    Py_INCREF(key);
  }
  PyObject *e = key == Py_None ? NULL : PyDict_GetItemWithError(cache, key);
  if (e && Py_IS_TYPE(e, &EntryType)) {
    res = run_entry((Entry *)e, args[1], dev, args + 2, n, ptrs);
  } else if (!PyErr_Occurred()) {
    PyObject *rest = PyTuple_New(n);
    if (!rest) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
      Py_INCREF(args[i + 2]);
      PyTuple_SET_ITEM(rest, i, args[i + 2]);
    }
    kw = PyDict_New();
    Py_ssize_t nk = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t i = 0; kw && i < nk; i++)
      if (PyDict_SetItem(kw, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) Py_CLEAR(kw);
    if (kw) res = PyObject_CallFunctionObjArgs(fallback, args[0], args[1], rest, kw, key, NULL);
    Py_DECREF(rest);
  }
done:
  Py_XDECREF(kw);
  Py_XDECREF(key);
  Py_XDECREF(dev);
  return res;
}

static PyObject *key_of(PyObject *self, PyObject *args) {
  PyObject *kernel, *dev, *targs, *kw;
  if (ready() < 0 || !PyArg_ParseTuple(args, "OOO!O!", &kernel, &dev, &PyTuple_Type, &targs, &PyDict_Type, &kw))
    return NULL;
  unsigned long long ptrs[MAX_ARGS];
  Py_ssize_t n = PyTuple_GET_SIZE(targs);
  if (n > MAX_ARGS) {
    PyErr_SetString(PyExc_TypeError, "light launcher: too many arguments");
    return NULL;
  }
  PyObject *names = PyTuple_New(PyDict_GET_SIZE(kw));
  PyObject *vals[MAX_ARGS];
  if (!names) return NULL;
  if (PyDict_GET_SIZE(kw) > MAX_ARGS) {
    Py_DECREF(names);
    PyErr_SetString(PyExc_TypeError, "light launcher: too many constexprs");
    return NULL;
  }
  Py_ssize_t pos = 0, i = 0;
  PyObject *name, *val;
  while (PyDict_Next(kw, &pos, &name, &val)) {
    Py_INCREF(name);
    PyTuple_SET_ITEM(names, i, name);
    vals[i++] = val;
  }
  PyObject *key = make_key(kernel, dev, &PyTuple_GET_ITEM(targs, 0), n, names, vals, ptrs);
  Py_DECREF(names);
  return key;
}

static PyObject *pack_of(PyObject *self, PyObject *args) {
  PyObject *e, *targs;
  if (ready() < 0 || !PyArg_ParseTuple(args, "O!O!", &EntryType, &e, &PyTuple_Type, &targs)) return NULL;
  Py_ssize_t n = PyTuple_GET_SIZE(targs);
  unsigned long long ptrs[MAX_ARGS];
  uint64_t slots[MAX_ARGS + 2];
  void *params[MAX_ARGS + 2];
  if (n > MAX_ARGS) {
    PyErr_SetString(PyExc_TypeError, "light launcher: too many arguments");
    return NULL;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *k0, *k1;
    if (arg_code(PyTuple_GET_ITEM(targs, i), &k0, &k1, &ptrs[i]) < 0) return NULL;
    Py_DECREF(k0);
    Py_DECREF(k1);
  }
  int np = pack((Entry *)e, &PyTuple_GET_ITEM(targs, 0), n, ptrs, slots, params);
  if (np < 0) return NULL;
  return PyBytes_FromStringAndSize((const char *)slots, (Py_ssize_t)np * 8);
}

static PyObject *init(PyObject *self, PyObject *args) {
  PyObject *c, *f, *t, *gd, *gs;
  if (!PyArg_ParseTuple(args, "O!OOOO", &PyDict_Type, &c, &f, &t, &gd, &gs)) return NULL;
  if (!PyType_Check(t)) {
    PyErr_SetString(PyExc_TypeError, "init: tensor_type must be a type");
    return NULL;
  }
  PyObject *old[5] = {cache, fallback, tensor_type, get_device, get_stream};
  Py_INCREF(c), Py_INCREF(f), Py_INCREF(t), Py_INCREF(gd), Py_INCREF(gs);
  cache = c, fallback = f, tensor_type = t, get_device = gd, get_stream = gs;
  for (int i = 0; i < 5; i++) Py_XDECREF(old[i]);
  Py_RETURN_NONE;
}

static PyObject *set_pdl(PyObject *self, PyObject *arg) {
  int on = PyObject_IsTrue(arg);
  if (on < 0) return NULL;
  int was = pdl_on;
  pdl_on = on;
  return PyBool_FromLong(was);
}

static PyMethodDef methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL | METH_KEYWORDS,
     "launch(kernel, grid, *args, **consts)"},
    {"key", key_of, METH_VARARGS, "key(kernel, device, args, consts): the cache key launch() builds"},
    {"pack", pack_of, METH_VARARGS, "pack(entry, args): the parameter slots launch() passes, as bytes"},
    {"init", init, METH_VARARGS, "init(cache, fallback, tensor_type, get_device, get_stream)"},
    {"set_pdl", set_pdl, METH_O, "set_pdl(on): launch pdl entries programmatically from now (returns the old value)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "v4stack_launch", NULL, -1, methods};

PyMODINIT_FUNC PyInit_v4stack_launch(void) {
  if (PyType_Ready(&EntryType) < 0) return NULL;
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  s_data_ptr = PyUnicode_InternFromString("data_ptr");
  s_dtype = PyUnicode_InternFromString("dtype");
  for (int i = 0; i < 11; i++) codes[i] = PyLong_FromLong(i);
  Py_INCREF(&EntryType);
  PyModule_AddObject(m, "Entry", (PyObject *)&EntryType);
  PyModule_AddIntConstant(m, "MAX_ARGS", MAX_ARGS);
  return m;
}
