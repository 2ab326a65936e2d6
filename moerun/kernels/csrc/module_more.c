/* moerun.kernels._cpu, continued (module.c has the rest): gated DeltaNet's recurrent steps, the sampler's passes
 * over a step's logits, and the layer loop's per-row pieces in the fused layers' arithmetic. Buffers come in as
 * addresses, checked by the Python wrappers (kernels/delta.py, kernels/sample.py, kernels/rows.py); each call runs
 * with the GIL released where it may take long. */
#include "module.h"

#include "attn.h"
#include "deltanet.h"
#include "pool.h"
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

static PyObject *py_sample_argmax(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    unsigned long long x;
    long long n;
    if (!PyArg_ParseTuple(args, "iKL", &isa, &x, &n)) return NULL;
    return PyLong_FromLongLong(samp_argmax(isa, (const float *)(uintptr_t)x, n));
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

/* The layer loop's pieces in the fused layers' arithmetic (attn.h; kernels/rows.py checks the buffers). */
static PyObject *py_rms_norm_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, w, out;
    long long rows, n;
    float eps;
    if (!PyArg_ParseTuple(args, "KKLLfK", &x, &w, &rows, &n, &eps, &out)) return NULL;
    qk_rms_norm_rows((const float *)(uintptr_t)x, (const float *)(uintptr_t)w, rows, n, eps, (float *)(uintptr_t)out);
    Py_RETURN_NONE;
}

static PyObject *py_rope_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, cs, sn;
    long long T, heads, D, R;
    int neox;
    if (!PyArg_ParseTuple(args, "KLLLKKLi", &x, &T, &heads, &D, &cs, &sn, &R, &neox)) return NULL;
    qk_rope_rows((float *)(uintptr_t)x, T, heads, D, (const float *)(uintptr_t)cs, (const float *)(uintptr_t)sn, R, neox);
    Py_RETURN_NONE;
}

static PyObject *py_gate_mul(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long x, g;
    long long n;
    if (!PyArg_ParseTuple(args, "KKL", &x, &g, &n)) return NULL;
    qk_gate_mul((float *)(uintptr_t)x, (const float *)(uintptr_t)g, n);
    Py_RETURN_NONE;
}

static PyObject *py_attend_rows(PyObject *self, PyObject *args) {
    (void)self;
    int isa, rc;
    unsigned long long q, k, v, slots, pos, sinks, att;
    long long B, nh, nkv, D, window;
    float scale;
    if (!PyArg_ParseTuple(args, "iKLLLLKKKKLKfK", &isa, &q, &B, &nh, &nkv, &D, &k, &v, &slots, &pos, &window, &sinks,
                          &scale, &att))
        return NULL;
    Py_BEGIN_ALLOW_THREADS rc = qk_attend_rows(isa, (const float *)(uintptr_t)q, B, nh, nkv, D, (const float *)(uintptr_t)k,
                                               (const float *)(uintptr_t)v, (const int64_t *const *)(uintptr_t)slots,
                                               (const int64_t *)(uintptr_t)pos, window, (const float *)(uintptr_t)sinks,
                                               scale, (float *)(uintptr_t)att);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

static PyObject *py_mla_rows(PyObject *self, PyObject *args) {
    (void)self;
    int isa, rc;
    unsigned long long q, wk, wv, cache, slots, pos, o;
    long long B, nh, rank, R, nope, dv;
    float scale;
    if (!PyArg_ParseTuple(args, "iKLLLLLLKKKKKfK", &isa, &q, &B, &nh, &rank, &R, &nope, &dv, &wk, &wv, &cache, &slots,
                          &pos, &scale, &o))
        return NULL;
    Py_BEGIN_ALLOW_THREADS rc = qk_mla_attend_rows(isa, (const float *)(uintptr_t)q, B, nh, rank, R, nope, dv,
                                                   (const float *)(uintptr_t)wk, (const float *)(uintptr_t)wv,
                                                   (const float *)(uintptr_t)cache,
                                                   (const int64_t *const *)(uintptr_t)slots,
                                                   (const int64_t *)(uintptr_t)pos, scale, (float *)(uintptr_t)o);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* route_rows(logits, B, E, n_used, gating, score_b, n_groups, topk_groups, group_score, norm_topk, scale, ids, w) */
static PyObject *py_route_rows(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long logits, score_b, ids, w;
    long long B, E, k, gating, groups, topk_groups, group_score, norm_topk;
    float scale[2] = {1.0f, 0.0f};
    if (!PyArg_ParseTuple(args, "KLLLLKLLLLfKK", &logits, &B, &E, &k, &gating, &score_b, &groups, &topk_groups,
                          &group_score, &norm_topk, &scale[0], &ids, &w))
        return NULL;
    qk_attn_desc d;
    memset(&d, 0, sizeof d);
    d.n_used = k, d.gating = gating, d.score_b = (int64_t)score_b, d.n_groups = groups, d.topk_groups = topk_groups;
    d.group_score = group_score, d.norm_topk = norm_topk, d.fparams = (int64_t)(uintptr_t)scale;
    return qk_raise(qk_route_rows(&d, (float *)(uintptr_t)logits, B, E, (int64_t *)(uintptr_t)ids, (float *)(uintptr_t)w));
}

static PyObject *py_pool_trace(PyObject *self, PyObject *args) {
    (void)self;
    int on;
    if (!PyArg_ParseTuple(args, "p", &on)) return NULL;
    qk_pool_trace(on);
    Py_RETURN_NONE;
}

static PyObject *py_pool_trace_rows(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    qk_trace_row rows[QK_TRACE_ROWS];
    const int n = qk_pool_trace_rows(rows, QK_TRACE_ROWS);
    PyObject *out = PyList_New(n);
    for (int i = 0; out && i < n; i++) {
        PyObject *t = Py_BuildValue("(sLLLLL)", rows[i].name, rows[i].jobs, rows[i].own_ns, rows[i].wait_ns,
                                    rows[i].gap_ns, rows[i].long_gap_ns);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *py_pool_span_checks(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    long long matched, missed;
    qk_pool_span_checks(&matched, &missed);
    return Py_BuildValue("(LL)", matched, missed);
}

/* then_spans(isa, mats, K, T): mats [(address, ggml, N)] -> [(address, bytes)] a thread (matmul.h's qk_then_spans). */
static PyObject *py_then_spans(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    PyObject *seq;
    long long K, T;
    if (!PyArg_ParseTuple(args, "iOLL", &isa, &seq, &K, &T)) return NULL;
    PyObject *fast = PySequence_Fast(seq, "mats must be a sequence of (address, ggml, N)");
    if (!fast) return NULL;
    qk_wmat w[QK_MM_MAX];
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    for (Py_ssize_t i = 0; i < n && i < QK_MM_MAX; i++) {
        unsigned long long a;
        long long N;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "KiL", &a, &w[i].ggml, &N)) {
            Py_DECREF(fast);
            return NULL;
        }
        w[i].w = (const uint8_t *)(uintptr_t)a, w[i].N = N;
    }
    Py_DECREF(fast);
    const qk_then then = {n <= QK_MM_MAX ? (int)n : 0, w, K};
    qk_span spans[QK_THEN_MAX];
    const int m = qk_then_spans(isa, &then, T, spans);
    PyObject *out = PyList_New(m);
    for (int t = 0; out && t < m; t++) {
        PyObject *s = Py_BuildValue("(KL)", (unsigned long long)(uintptr_t)spans[t].p, (long long)spans[t].bytes);
        if (!s) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, t, s);
    }
    return out;
}

PyMethodDef QK_STEP_METHODS[] = {
    {"pool_span_checks", py_pool_span_checks, METH_NOARGS,
     "pool_span_checks() -> (matched, missed): while pool_trace is on, the threads whose first read of a job was (or "
     "was not) where the job before said it would be (pool.h's qk_pool_first_read)."},
    {"then_spans", py_then_spans, METH_VARARGS,
     "then_spans(isa, mats, K, T) -> [(address, bytes)]: where each thread's share of a matmuls job of mats [(address, "
     "ggml, N)] against T rows of K values starts (matmul.h's qk_then_spans)."},
    {"pool_trace", py_pool_trace, METH_VARARGS,
     "pool_trace(on): keep (True, the counters reset) or stop keeping the pool's per-job-kind times (pool.h)."},
    {"pool_trace_rows", py_pool_trace_rows, METH_NOARGS,
     "pool_trace_rows() -> [(task, jobs, own_ns, wait_ns, gap_ns, long_gap_ns)] (pool.h's qk_trace_row)."},
    {"sample_argmax", py_sample_argmax, METH_VARARGS,
     "sample_argmax(isa, x, n): the first index of the largest of x[:n], or -1 where one is NaN (sample.c)."},
    {"sample_draw", py_sample_draw, METH_VARARGS, "sample_draw(isa, x, n, t, cut, u): the inverse-CDF draw (sample.c)."},
    {"sample_norm", py_sample_norm, METH_VARARGS, "sample_norm(isa, x, n, mx): sum of exp32(x - mx), block by block."},
    {"sample_cut", py_sample_cut, METH_VARARGS,
     "sample_cut(isa, x, n, top_p, use_top_p, log_min_p, use_min_p, hist, keys, cap): the smallest kept logit or None."},
    {"sample_topk", py_sample_topk, METH_VARARGS,
     "sample_topk(isa, vals, ids, k, t, top_p, use_top_p, log_min_p, use_min_p, u, sv, sid): top-p, min-p, draw."},
    {"sample_exp", py_sample_exp, METH_VARARGS, "sample_exp(isa, x, n, out): exp32 (sample.c), for tests."},
    {"rms_norm_rows", py_rms_norm_rows, METH_VARARGS, "rms_norm_rows(x, w, rows, n, eps, out) (attn.h)"},
    {"rope_rows", py_rope_rows, METH_VARARGS, "rope_rows(x, T, heads, D, cos, sin, R, neox) (attn.h)"},
    {"gate_mul", py_gate_mul, METH_VARARGS, "gate_mul(x, gate, n): x *= sigmoid(gate) (attn.h)"},
    {"attend_rows", py_attend_rows, METH_VARARGS,
     "attend_rows(isa, q, B, nh, nkv, D, k, v, slots, pos, window, sinks, scale, att) (attn.h)"},
    {"mla_rows", py_mla_rows, METH_VARARGS,
     "mla_rows(isa, q, B, nh, rank, R, nope, dv, wk_b, wv_b, latents, slots, pos, scale, o) (attn.h)"},
    {"route_rows", py_route_rows, METH_VARARGS,
     "route_rows(logits, B, E, n_used, gating, score_b, groups, topk_groups, group_score, norm_topk, scale, ids, w)"},
    {NULL, NULL, 0, NULL},
};
