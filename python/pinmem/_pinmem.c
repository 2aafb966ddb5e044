/*
 * DESIGN: the module pinmem._pinmem: its definition and PyInit__pinmem, which readies the types,
 * adds the types, the module functions of each file (their tables sit beside the functions),
 * the exceptions and the constants. _pinmem.h says which file holds what.
 */
#include "_pinmem.h"

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "pinmem._pinmem",
    .m_doc = "pinmem's C extension: pinned host memory, copies and the data loader.",
    .m_size = -1,
};

/* The module's functions, file by file. */
static PyMethodDef *const module_functions[] = {
    pmpy_empty_pin_functions, pmpy_copy_functions,  pmpy_files_functions, pmpy_pool_functions,
    pmpy_datasets_functions,  pmpy_procs_functions, pmpy_loader_functions,
    pmpy_streams_functions};

PyMODINIT_FUNC PyInit__pinmem(void);
PyMODINIT_FUNC PyInit__pinmem(void) {
  if (PyType_Ready(&pmpy_StreamType) < 0 || PyType_Ready(&pmpy_BufferType) < 0 ||
      PyType_Ready(&pmpy_PinnedBufferType) < 0 || PyType_Ready(&pmpy_DeviceBufferType) < 0 ||
      PyType_Ready(&pmpy_CompletionType) < 0 || PyType_Ready(&pmpy_DatasetType) < 0 ||
      PyType_Ready(&pmpy_LoaderType) < 0 || PyType_Ready(&pmpy_BatchType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&module_def);
  if (!m) return NULL;
  for (size_t i = 0; i < sizeof module_functions / sizeof module_functions[0]; i++)
    if (PyModule_AddFunctions(m, module_functions[i]) < 0) {
      Py_DECREF(m);
      return NULL;
    }
  if (pmpy_init_exceptions(m) < 0 || pmpy_blocks_add_types(m) < 0 ||
      pmpy_devcache_add(m) < 0 ||
      PyModule_AddType(m, &pmpy_StreamType) < 0 ||
      PyModule_AddType(m, &pmpy_BufferType) < 0 ||
      PyModule_AddType(m, &pmpy_PinnedBufferType) < 0 ||
      PyModule_AddType(m, &pmpy_DeviceBufferType) < 0 ||
      PyModule_AddType(m, &pmpy_CompletionType) < 0 ||
      PyModule_AddObjectRef(m, "_Loader", (PyObject *)&pmpy_LoaderType) < 0 ||
      PyModule_AddObjectRef(m, "_Dataset", (PyObject *)&pmpy_DatasetType) < 0 ||
      PyModule_AddIntConstant(m, "_LOADER_STATE_MAGIC", (long)PM_LOADER_STATE_MAGIC) < 0 ||
      PyModule_AddStringConstant(m, "version", pm_version()) < 0 ||
      PyModule_AddIntConstant(m, "DLPACK_CPU", kDLCPU) < 0 ||
      PyModule_AddIntConstant(m, "DLPACK_CUDA", kDLCUDA) < 0 ||
      PyModule_AddIntConstant(m, "DLPACK_CUDA_HOST", kDLCUDAHost) < 0 ||
#ifdef PMPY_DLPACK_VERSIONED
      PyModule_AddIntConstant(m, "DLPACK_VERSIONED", 1) < 0) {
#else
      PyModule_AddIntConstant(m, "DLPACK_VERSIONED", 0) < 0) {
#endif
    Py_DECREF(m);
    return NULL;
  }
  return m;
}
