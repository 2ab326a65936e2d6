/* moerun.kernels._cpu, continued (module.c has the rest): gated DeltaNet's recurrent steps and the sampler's passes
 * over a step's logits. Buffers come in as addresses, checked by the Python wrappers (kernels/delta.py,
 * kernels/sample.py); each call runs with the GIL released where it may take long. */
#include "module.h"

#include "deltanet.h"
#include "qk.h"
#include "sample.h"

/* delta_step(B, C, K, nk, nv, dk, dv, tiled, qkv, z, beta, alpha, conv, ssm, slots, fresh, w, a, dt, norm, eps, y,
 * out): gated DeltaNet's decode step for B sequences (deltanet.h); buffers as addresses. */
static PyObject *py_delta_step(PyObject *self, PyObject *args) {
    (void)self;
    qk_delta_args a;
    unsigned long long p[15];
    int tiled, rc;
    if (!PyArg_ParseTuple(args, "LLLLLLLiKKKKKKKKKKKKfKK", &a.B, &a.C, &a.K, &a.nk, &a.nv, &a.dk, &a.dv, &tiled,
                          &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &p[7], &p[8], &p[9], &p[10], &p[11],
                          &a.eps, &p[12], &p[13]))
        return NULL;
    a.tiled = tiled;
    a.qkv = (const float *)(uintptr_t)p[0], a.z = (const float *)(uintptr_t)p[1];
    a.beta = (const float *)(uintptr_t)p[2], a.alpha = (const float *)(uintptr_t)p[3];
    a.conv = (float *)(uintptr_t)p[4], a.ssm = (float *)(uintptr_t)p[5];
    a.slots = (const int64_t *)(uintptr_t)p[6], a.fresh = (const uint8_t *)(uintptr_t)p[7];
    a.w = (const float *)(uintptr_t)p[8], a.a = (const float *)(uintptr_t)p[9];
    a.dt = (const float *)(uintptr_t)p[10], a.norm = (const float *)(uintptr_t)p[11];
    a.y = (float *)(uintptr_t)p[12], a.out = (float *)(uintptr_t)p[13];
    Py_BEGIN_ALLOW_THREADS rc = qk_delta_step(&a);
    Py_END_ALLOW_THREADS if (rc) return qk_raise(rc);
    Py_RETURN_NONE;
}

/* delta_prompt(isa, T, nk, nv, dk, dv, sq, sk, sv, tiled, q, k, v, g, beta, state, z, sz, norm, eps, out): the delta
 * rule over one sequence's T positions, gated and normed where z is not 0 (deltanet.h); buffers as addresses. */
static PyObject *py_delta_prompt(PyObject *self, PyObject *args) {
    (void)self;
    qk_delta_prompt_args a;
    unsigned long long p[9];
    int rc;
    if (!PyArg_ParseTuple(args, "iLLLLLLLLiKKKKKKKLKfK", &a.isa, &a.T, &a.nk, &a.nv, &a.dk, &a.dv, &a.sq, &a.sk, &a.sv,
                          &a.tiled, &p[0], &p[1], &p[2], &p[3], &p[4], &p[5], &p[6], &a.sz, &p[7], &a.eps, &p[8]))
        return NULL;
    a.q = (const float *)(uintptr_t)p[0], a.k = (const float *)(uintptr_t)p[1], a.v = (const float *)(uintptr_t)p[2];
    a.g = (const float *)(uintptr_t)p[3], a.beta = (const float *)(uintptr_t)p[4];
    a.state = (float *)(uintptr_t)p[5], a.z = (const float *)(uintptr_t)p[6], a.norm = (const float *)(uintptr_t)p[7];
    a.out = (float *)(uintptr_t)p[8];
    Py_BEGIN_ALLOW_THREADS rc = qk_delta_prompt(&a);
    Py_END_ALLOW_THREADS if (rc) return qk_raise(rc);
    Py_RETURN_NONE;
}

/* delta_conv_prompt(T, C, K, x, sx, w, state, y): the conv1d (+ SiLU) over one sequence's T positions. */
static PyObject *py_delta_conv_prompt(PyObject *self, PyObject *args) {
    (void)self;
    long long T, C, K, sx;
    unsigned long long x, w, state, y;
    int rc;
    if (!PyArg_ParseTuple(args, "LLLKLKKK", &T, &C, &K, &x, &sx, &w, &state, &y)) return NULL;
    Py_BEGIN_ALLOW_THREADS rc = qk_delta_conv_prompt(T, C, K, (const float *)(uintptr_t)x, sx,
                                                     (const float *)(uintptr_t)w, (float *)(uintptr_t)state,
                                                     (float *)(uintptr_t)y);
    Py_END_ALLOW_THREADS if (rc) return qk_raise(rc);
    Py_RETURN_NONE;
}

static PyObject *py_sample_draw(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    unsigned long long x;
    long long n;
    float t, cut;
    double u;
    if (!PyArg_ParseTuple(args, "iKLffd", &isa, &x, &n, &t, &cut, &u)) return NULL;
    const int64_t j = samp_draw(isa, (const float *)(uintptr_t)x, n, t, cut, u);
    if (j == -2) return PyErr_NoMemory();
    return PyLong_FromLongLong(j);
}

static PyObject *py_sample_norm(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    unsigned long long x;
    long long n;
    float mx;
    if (!PyArg_ParseTuple(args, "iKLf", &isa, &x, &n, &mx)) return NULL;
    return PyFloat_FromDouble(samp_norm(isa, (const float *)(uintptr_t)x, n, mx));
}

static PyObject *py_sample_cut(PyObject *self, PyObject *args) {
    (void)self;
    int isa, use_tp, use_mp;
    unsigned long long x, hist, keys;
    long long n, cap;
    float tp, lmp, cut;
    if (!PyArg_ParseTuple(args, "iKLfifiKKL", &isa, &x, &n, &tp, &use_tp, &lmp, &use_mp, &hist, &keys, &cap))
        return NULL;
    if (!samp_cut(isa, (const float *)(uintptr_t)x, n, tp, use_tp, lmp, use_mp, (double *)(uintptr_t)hist,
                  (uint32_t *)(uintptr_t)keys, cap, &cut))
        Py_RETURN_NONE;
    return PyFloat_FromDouble(cut);
}

static PyObject *py_sample_topk(PyObject *self, PyObject *args) {
    (void)self;
    int isa, use_tp, use_mp;
    unsigned long long vals, ids, sv, sid;
    long long k;
    float t, tp, lmp;
    double u;
    if (!PyArg_ParseTuple(args, "iKKLffifidKK", &isa, &vals, &ids, &k, &t, &tp, &use_tp, &lmp, &use_mp, &u, &sv, &sid))
        return NULL;
    const int64_t j = samp_topk(isa, (const float *)(uintptr_t)vals, (const int64_t *)(uintptr_t)ids, k, t, tp, use_tp,
                                lmp, use_mp, u, (float *)(uintptr_t)sv, (int64_t *)(uintptr_t)sid);
    if (j == -2) return PyErr_NoMemory();
    return PyLong_FromLongLong(j);
}

static PyObject *py_sample_exp(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    unsigned long long x, out;
    long long n;
    if (!PyArg_ParseTuple(args, "iKLK", &isa, &x, &n, &out)) return NULL;
    samp_exp(isa, (const float *)(uintptr_t)x, n, (float *)(uintptr_t)out);
    Py_RETURN_NONE;
}

PyMethodDef QK_RECURRENT_METHODS[] = {
    {"delta_step", py_delta_step, METH_VARARGS,
     "delta_step(B, C, K, nk, nv, dk, dv, tiled, qkv, z, beta, alpha, conv, ssm, slots, fresh, w, a, dt, norm, eps, "
     "y, out): gated DeltaNet's decode step."},
    {"delta_prompt", py_delta_prompt, METH_VARARGS,
     "delta_prompt(isa, T, nk, nv, dk, dv, sq, sk, sv, tiled, q, k, v, g, beta, state, z, sz, norm, eps, out): the "
     "delta rule over one sequence's prompt chunk (gated and normed where z is not 0)."},
    {"delta_conv_prompt", py_delta_conv_prompt, METH_VARARGS,
     "delta_conv_prompt(T, C, K, x, sx, w, state, y): the conv1d (+ SiLU) over one sequence's prompt chunk."},
    {NULL, NULL, 0, NULL},
};

PyMethodDef QK_SAMPLE_METHODS[] = {
    {"sample_draw", py_sample_draw, METH_VARARGS, "sample_draw(isa, x, n, t, cut, u): the inverse-CDF draw (sample.c)."},
    {"sample_norm", py_sample_norm, METH_VARARGS, "sample_norm(isa, x, n, mx): sum of exp32(x - mx), block by block."},
    {"sample_cut", py_sample_cut, METH_VARARGS,
     "sample_cut(isa, x, n, top_p, use_top_p, log_min_p, use_min_p, hist, keys, cap): the smallest kept logit or None."},
    {"sample_topk", py_sample_topk, METH_VARARGS,
     "sample_topk(isa, vals, ids, k, t, top_p, use_top_p, log_min_p, use_min_p, u, sv, sid): top-p, min-p, draw."},
    {"sample_exp", py_sample_exp, METH_VARARGS, "sample_exp(isa, x, n, out): exp32 (sample.c), for tests."},
    {NULL, NULL, 0, NULL},
};
