/* The binding's parts (module.c, module_more.c): the error translation they share and the method tables
 * module.c adds to the module. */
#ifndef MOERUN_MODULE_H
#define MOERUN_MODULE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* QK_OK -> None; a QK_E* code -> NULL with the matching Python exception set. */
PyObject *qk_raise(int rc);

/* Gated DeltaNet's steps (decode and prompt) and the sampler's passes over the logits. */
extern PyMethodDef QK_RECURRENT_METHODS[];
extern PyMethodDef QK_STEP_METHODS[];

#endif
