/* moerun.kernels._cpu: the CPython binding (plain C API, no torch headers).
 *
 * Buffers come in as integer addresses (torch's tensor.data_ptr()) with their sizes; the Python
 * wrapper (kernels/cpu.py) checks shapes, dtypes and contiguity before calling. Every kernel runs
 * with the GIL released. The `isa` argument selects the kernel set per call (0 scalar, 1 AVX2, 2 VNNI),
 * so the module itself keeps no state besides the thread pool. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "amx.h"
#include "attn.h"
#include "matmul.h"
#include "module.h"
#include "pool.h"
#include "qk.h"
#include "sysload.h"

PyObject *qk_raise(int rc) {
    switch (rc) {
    case QK_ENOMEM: return PyErr_NoMemory();
    case QK_EISA: PyErr_SetString(PyExc_ValueError, "kernel set not available on this CPU"); return NULL;
    case QK_ETYPE: PyErr_SetString(PyExc_ValueError, "no CPU kernel for this ggml type"); return NULL;
    case QK_ESHAPE:
        PyErr_SetString(PyExc_ValueError, "shape does not fit the types' block sizes");
        return NULL;
    case QK_EIDS: PyErr_SetString(PyExc_ValueError, "expert id out of range"); return NULL;
    case QK_EMISSING: PyErr_SetString(PyExc_ValueError, "a routed expert's weights were not given"); return NULL;
    case QK_ESLOT: PyErr_SetString(PyExc_ValueError, "a slot table names a slot the KV cache does not hold"); return NULL;
    case QK_ETOKEN: PyErr_SetString(PyExc_ValueError, "token id outside the embedding table"); return NULL;
    default: Py_RETURN_NONE;
    }
}

static PyObject *py_features(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    PyObject *isas = PyList_New(0);
    if (!isas) return NULL;
    for (int i = 0; i < ISA_COUNT; i++) {
        if (!qk_kernels(i)) continue;
        PyObject *s = PyUnicode_FromString(qk_isa_name(i));
        if (!s || PyList_Append(isas, s) < 0) {
            Py_XDECREF(s);
            Py_DECREF(isas);
            return NULL;
        }
        Py_DECREF(s);
    }
    return Py_BuildValue("{s:s,s:i,s:N,s:i,s:i,s:i,s:i,s:i,s:O,s:i,s:i,s:O,s:O,s:L}", "best", qk_isa_name(qk_best_isa()),
                         "best_id", qk_best_isa(), "isas", isas, "threads", qk_pool_threads(), "spin_us",
                         qk_pool_spin_us(), "prefetch", qk_prefetch(), "prefetch_hint", qk_prefetch_hint(), "wide",
                         qk_wide(), "prefetch_spread", qk_prefetch_spread() ? Py_True : Py_False, "idle_prefetch",
                         qk_idle_prefetch(), "prefetch_near", qk_prefetch_near(),
                         "amx", qk_amx() ? Py_True : Py_False, "amx_usable",
                         qk_amx_usable() ? Py_True : Py_False, "amx_calls", qk_amx_calls());
}

static PyObject *py_qtypes(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    Py_ssize_t n = 0;
    for (int i = 0; i < QT_COUNT; i++) n += QK_TYPES[i].ggml < QK_R8;
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (int i = 0, j = 0; i < QT_COUNT; i++)
        if (QK_TYPES[i].ggml < QK_R8) PyTuple_SET_ITEM(t, j++, PyLong_FromLong(QK_TYPES[i].ggml));
    return t;
}

static PyObject *py_set_threads(PyObject *self, PyObject *args) {
    (void)self;
    int n, spin_us = -1;
    if (!PyArg_ParseTuple(args, "i|i", &n, &spin_us)) return NULL;
    if (spin_us < 0) spin_us = qk_pool_spin_us();
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_pool_set_threads(n, spin_us);
    Py_END_ALLOW_THREADS if (rc) {
        PyErr_SetString(PyExc_ValueError, "threads must be in 1..1024 and spin_us in 0..1000000");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* One int argument through a pool setting's setter; `error` when it refuses the value. */
static PyObject *set_int(PyObject *args, int (*set)(int), const char *error) {
    int v;
    if (!PyArg_ParseTuple(args, "i", &v)) return NULL;
    if (set(v)) {
        PyErr_SetString(PyExc_ValueError, error);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_set_prefetch(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_prefetch, "prefetch must be -1 or a multiple of 64 in 0..65536");
}

static PyObject *py_set_prefetch_hint(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_prefetch_hint, "prefetch hint must be -1 or 0..3 (T0, T1, T2, NTA)");
}

/* prefetch_default(vendor, family, model=0) -> (bytes, hint): pool.c's table for that CPU (tests read every row). */
static PyObject *py_prefetch_default(PyObject *self, PyObject *args) {
    (void)self;
    const char *vendor;
    int family, model = 0, hint = 0;
    if (!PyArg_ParseTuple(args, "si|i", &vendor, &family, &model)) return NULL;
    const int bytes = qk_prefetch_default(vendor, family, model, &hint);
    return Py_BuildValue("(ii)", bytes, hint);
}

static PyObject *py_set_wide(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_wide,
                   "wide must be -1 (the CPU's default) or a mask of 0..7 (Q4_K 1, Q6_K 2, MXFP4 4)");
}

static PyObject *py_set_amx(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_amx, "amx must be -1 (on where usable), 0 or 1");
}

static PyObject *py_set_prefetch_spread(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_prefetch_spread, "prefetch spread must be -1 (the CPU's default), 0 or 1");
}

/* A default of pool.c's table for a CPU (vendor, family, model=0) -> bool (as_bool) or int. */
static PyObject *table_entry(PyObject *args, int (*dflt)(const char *, int, int), int as_bool) {
    const char *vendor;
    int family, model = 0;
    if (!PyArg_ParseTuple(args, "si|i", &vendor, &family, &model)) return NULL;
    const int v = dflt(vendor, family, model);
    return as_bool ? PyBool_FromLong(v) : PyLong_FromLong(v);
}

static PyObject *py_wide_default(PyObject *self, PyObject *args) {
    (void)self;
    return table_entry(args, qk_wide_default, 0);
}

static PyObject *py_prefetch_spread_default(PyObject *self, PyObject *args) {
    (void)self;
    return table_entry(args, qk_prefetch_spread_default, 1);
}

static PyObject *py_set_idle_prefetch(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_idle_prefetch,
                   "idle prefetch must be -1 (the CPU's default) or a multiple of 4096 bytes in 0..16 MiB");
}

static PyObject *py_idle_prefetch_default(PyObject *self, PyObject *args) {
    (void)self;
    return table_entry(args, qk_idle_prefetch_default, 0);
}

static PyObject *py_set_prefetch_near(PyObject *self, PyObject *args) {
    (void)self;
    return set_int(args, qk_set_prefetch_near,
                   "near prefetch must be -1 (the CPU's default) or a multiple of 64 bytes in 0..65536");
}

static PyObject *py_prefetch_near_default(PyObject *self, PyObject *args) {
    (void)self;
    return table_entry(args, qk_prefetch_near_default, 0);
}

static PyObject *py_set_active(PyObject *self, PyObject *args) {
    (void)self;
    int n;
    if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
    if (qk_pool_set_active(n)) {
        PyErr_SetString(PyExc_ValueError, "active threads must be in 0..1024");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *py_get_threads(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    return PyLong_FromLong(qk_pool_threads());
}

/* read_bw(buf, nbytes, streams, prefetch) -> the xor of the bytes read (see qk_read_bw). */
static PyObject *py_read_bw(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long buf;
    long long n, prefetch;
    int streams, rc;
    uint64_t x = 0;
    if (!PyArg_ParseTuple(args, "KLiL", &buf, &n, &streams, &prefetch)) return NULL;
    Py_BEGIN_ALLOW_THREADS rc = qk_read_bw((const uint8_t *)(uintptr_t)buf, n, streams, prefetch, &x);
    Py_END_ALLOW_THREADS if (rc) return qk_raise(rc);
    return PyLong_FromUnsignedLongLong(x);
}

/* act_row_bytes(ggml, K): bytes of one quantized activation row paired with that weight type. */
static PyObject *py_act_row_bytes(PyObject *self, PyObject *args) {
    (void)self;
    int ggml;
    long long K;
    if (!PyArg_ParseTuple(args, "iL", &ggml, &K)) return NULL;
    const int qt = qk_qtype_index(ggml);
    if (qt < 0) return qk_raise(QK_ETYPE);
    const int act = QK_TYPES[qt].act;
    if (K < 1 || K % qk_act_elems(act)) return qk_raise(QK_ESHAPE);
    return PyLong_FromLongLong(K / qk_act_elems(act) * qk_act_bytes(act));
}

/* quantize_act(isa, ggml, x, T, K, out): the activation rows a matmul against that type uses. */
static PyObject *py_quantize_act(PyObject *self, PyObject *args) {
    (void)self;
    int isa, ggml;
    unsigned long long x, out;
    long long T, K;
    if (!PyArg_ParseTuple(args, "iiKLLK", &isa, &ggml, &x, &T, &K, &out)) return NULL;
    const kernel_set *ks = qk_kernels(isa);
    const int qt = qk_qtype_index(ggml);
    if (!ks) return qk_raise(QK_EISA);
    if (qt < 0) return qk_raise(QK_ETYPE);
    const int act = QK_TYPES[qt].act;
    if (T < 1 || K < 1 || K % qk_act_elems(act)) return qk_raise(QK_ESHAPE);
    const int64_t row = K / qk_act_elems(act) * qk_act_bytes(act);
    Py_BEGIN_ALLOW_THREADS for (long long t = 0; t < T; t++)
        ks->quant[act]((const float *)(uintptr_t)x + t * K, (uint8_t *)(uintptr_t)out + t * row, K);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* matmul(isa, ggml, w, N, K, x, T, out): out[T, N] = x[T, K] @ W[N, K]^T. */
static PyObject *py_matmul(PyObject *self, PyObject *args) {
    (void)self;
    int isa, ggml;
    unsigned long long w, x, out;
    long long N, K, T;
    if (!PyArg_ParseTuple(args, "iiKLLKLK", &isa, &ggml, &w, &N, &K, &x, &T, &out)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_matmul(isa, ggml, (const uint8_t *)(uintptr_t)w, N, K,
                                          (const float *)(uintptr_t)x, T, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* dot_passes(isa, ggml, w, N, K, x, reps, out): see qk_dot_passes. */
static PyObject *py_dot_passes(PyObject *self, PyObject *args) {
    (void)self;
    int isa, ggml;
    unsigned long long w, x, out;
    long long N, K, reps;
    if (!PyArg_ParseTuple(args, "iiKLLKLK", &isa, &ggml, &w, &N, &K, &x, &reps, &out)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_dot_passes(isa, ggml, (const uint8_t *)(uintptr_t)w, N, K,
                                              (const float *)(uintptr_t)x, reps, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* matmuls(isa, x, T, K, ((w, ggml, N, out), ...)): up to QK_MM_MAX matrices (quantized, or F32 / F16 rows) over
 * the same x [T, K] in one call of the pool, the activations quantized once per type. */
static PyObject *py_matmuls(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    unsigned long long x;
    long long T, K;
    PyObject *mats;
    if (!PyArg_ParseTuple(args, "iKLLO!", &isa, &x, &T, &K, &PyTuple_Type, &mats)) return NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(mats);
    if (n < 1 || n > QK_MM_MAX) return qk_raise(QK_ESHAPE);
    qk_wmat w[QK_MM_MAX];
    float *out[QK_MM_MAX];
    for (Py_ssize_t j = 0; j < n; j++) {
        unsigned long long wp, op;
        long long N;
        int ggml;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(mats, j), "KiLK", &wp, &ggml, &N, &op)) return NULL;
        w[j] = (qk_wmat){(const uint8_t *)(uintptr_t)wp, ggml, N};
        out[j] = (float *)(uintptr_t)op;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_matmuls(isa, (int)n, w, K, (const float *)(uintptr_t)x, T, out);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* moe_ffn(isa, x, T, H, ids, wts, k, gate, gate_stride, gate_type, up, up_stride, up_type, down, down_stride,
 *         down_type, E, I, out, pairs=0, act=0, alpha=0, limit=0, gate_b=0, up_b=0, down_b=0): see qk_moe_ffn;
 *         each matrix kind is (base, stride, type) as qk_expert_mats; act .. down_b: its qk_expert_fn. */
static PyObject *py_moe_ffn(PyObject *self, PyObject *args) {
    (void)self;
    int isa, k, gt, ut, dt, pairs = 0, act = QK_ACT_SWIGLU;
    unsigned long long x, ids, wts, gate, up, down, out, gb = 0, ub = 0, db = 0;
    long long T, H, E, I, gs, us, ds;
    float alpha = 0.0f, limit = 0.0f;
    if (!PyArg_ParseTuple(args, "iKLLKKiKLiKLiKLiLLK|iiffKKK", &isa, &x, &T, &H, &ids, &wts, &k, &gate, &gs, &gt,
                          &up, &us, &ut, &down, &ds, &dt, &E, &I, &out, &pairs, &act, &alpha, &limit, &gb, &ub, &db))
        return NULL;
    if (gs < 0 || us < 0 || ds < 0 || (act != QK_ACT_SWIGLU && act != QK_ACT_SWIGLU_OAI)) return qk_raise(QK_ESHAPE);
    const qk_expert_mats g = {(const uint8_t *)(uintptr_t)gate, gs, gt};
    const qk_expert_mats u = {(const uint8_t *)(uintptr_t)up, us, ut};
    const qk_expert_mats d = {(const uint8_t *)(uintptr_t)down, ds, dt};
    const qk_expert_fn fn = {act, alpha, limit, (const float *)(uintptr_t)gb, (const float *)(uintptr_t)ub,
                             (const float *)(uintptr_t)db};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_moe_ffn(isa, (const float *)(uintptr_t)x, T, H, (const int32_t *)(uintptr_t)ids,
                                          (const float *)(uintptr_t)wts, k, g, u, d, E, I, (float *)(uintptr_t)out,
                                          pairs, &fn, NULL);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* dequant_rows(ggml, w, N, K, rows, n, out): out[n, K] = rows of W[N, K] as floats. */
static PyObject *py_dequant_rows(PyObject *self, PyObject *args) {
    (void)self;
    int ggml;
    unsigned long long w, rows, out;
    long long N, K, n;
    if (!PyArg_ParseTuple(args, "iKLLKLK", &ggml, &w, &N, &K, &rows, &n, &out)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_dequant_rows_mt(ggml, (const uint8_t *)(uintptr_t)w, N, K,
                                                (const int64_t *)(uintptr_t)rows, n, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* deq_dot(isa, ggml, w, N, K, x, out): out[N] = the rows of W[N, K] (GGUF's layout) dotted with float x [K] as
 * the float kernel dots them dequantized (deqdot.c) -> True, or False (nothing written) where there is no kernel. */
static PyObject *py_deq_dot(PyObject *self, PyObject *args) {
    (void)self;
    int isa, ggml;
    unsigned long long w, x, out;
    long long N, K;
    if (!PyArg_ParseTuple(args, "iiKLLKK", &isa, &ggml, &w, &N, &K, &x, &out)) return NULL;
    const deq_dot_fn f = qk_deq_fdot(isa, ggml);
    const int qt = qk_qtype_index(ggml);
    if (!f) Py_RETURN_FALSE;
    if (qt < 0 || N < 0 || K < 1 || K % QK_TYPES[qt].blk_elems) return qk_raise(QK_ESHAPE);
    const int64_t row = K / QK_TYPES[qt].blk_elems * QK_TYPES[qt].blk_bytes;
    Py_BEGIN_ALLOW_THREADS for (int64_t r = 0; r < N; r++)
        f(K, (const uint8_t *)(uintptr_t)w + r * row, (const float *)(uintptr_t)x, (float *)(uintptr_t)out + r);
    Py_END_ALLOW_THREADS Py_RETURN_TRUE;
}

static PyObject *repack_call(PyObject *args, int (*fn)(int, const uint8_t *, uint8_t *, int64_t, int64_t)) {
    int type;
    unsigned long long src, dst;
    long long N, K;
    if (!PyArg_ParseTuple(args, "iKKLL", &type, &src, &dst, &N, &K)) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = fn(type, (const uint8_t *)(uintptr_t)src, (uint8_t *)(uintptr_t)dst, N, K);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

static PyObject *py_repack(PyObject *self, PyObject *args) {
    (void)self;
    return repack_call(args, qk_repack);
}

static PyObject *py_unpack(PyObject *self, PyObject *args) {
    (void)self;
    return repack_call(args, qk_unpack);
}

static PyObject *py_read_jobs(PyObject *self, PyObject *args) {
    (void)self;
    long long n, scratch_bytes;
    unsigned long long jobs, next, done, scratch;
    if (!PyArg_ParseTuple(args, "KLKKKL", &jobs, &n, &next, &done, &scratch, &scratch_bytes)) return NULL;
    Py_BEGIN_ALLOW_THREADS qk_read_jobs((const int64_t *)(uintptr_t)jobs, n, (int64_t *)(uintptr_t)next,
                                        (int64_t *)(uintptr_t)done, (uint8_t *)(uintptr_t)scratch, scratch_bytes);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

/* attn_fields(): the names of qk_attn_desc's int64 fields, in order. */
static PyObject *py_attn_fields(PyObject *self, PyObject *args) {
    (void)self, (void)args;
#define QK_ATTN_NAME(name) #name,
    static const char *const names[] = {QK_ATTN_FIELDS(QK_ATTN_NAME)};
#undef QK_ATTN_NAME
    const Py_ssize_t n = (Py_ssize_t)(sizeof names / sizeof names[0]);
    PyObject *t = PyTuple_New(n);
    if (!t) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *s = PyUnicode_FromString(names[i]);
        if (!s) {
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, i, s);
    }
    return t;
}

/* attn_block(isa, desc, x, B, slots, pos, kc, vc, cos, sin, eps, clip, xn_out, ids_out, w_out, moe=0, ktype=0,
 * vtype=0, sslots=0, nstates=0): see qk_attn_block; desc is the address of a qk_attn_desc, slots of B addresses of
 * int64 slot tables, sslots of B int64 state slots; ktype / vtype the caches' ggml types. */
static PyObject *py_attn_block(PyObject *self, PyObject *args) {
    (void)self;
    int isa, moe = 0, ktype = 0, vtype = 0;
    unsigned long long desc, x, slots, pos, kc, vc, cs, sn, xn, ids, w, sslots = 0;
    long long B, nstates = 0;
    float eps, clip;
    if (!PyArg_ParseTuple(args, "iKKLKKKKKKffKKK|iiiKL", &isa, &desc, &x, &B, &slots, &pos, &kc, &vc, &cs, &sn, &eps,
                          &clip, &xn, &ids, &w, &moe, &ktype, &vtype, &sslots, &nstates))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_attn_block(
        isa, (const qk_attn_desc *)(uintptr_t)desc, (float *)(uintptr_t)x, B,
        (const int64_t *const *)(uintptr_t)slots, (const int64_t *)(uintptr_t)pos, (void *)(uintptr_t)kc,
        (void *)(uintptr_t)vc, (const float *)(uintptr_t)cs, (const float *)(uintptr_t)sn, eps, clip,
        (float *)(uintptr_t)xn, (int64_t *)(uintptr_t)ids, (float *)(uintptr_t)w, moe, ktype, vtype,
        (const int64_t *)(uintptr_t)sslots, nstates);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* glu_down(isa, g, u, B, F, H, down, down_type, gl, out): see qk_glu_down; gl 0: no gate. */
static PyObject *py_glu_down(PyObject *self, PyObject *args) {
    (void)self;
    int isa, down_type;
    unsigned long long g, u, down, gl, out;
    long long B, F, H;
    if (!PyArg_ParseTuple(args, "iKKLLLKiKK", &isa, &g, &u, &B, &F, &H, &down, &down_type, &gl, &out)) return NULL;
    const qk_wmat wd = {(const uint8_t *)(uintptr_t)down, down_type, H};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_glu_down(isa, (float *)(uintptr_t)g, (const float *)(uintptr_t)u, B, F, H, &wd,
                                            (const float *)(uintptr_t)gl, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

/* decode_layers(isa, n, descs, x, B, slots, wslots, pos, kcs, vcs, cos, sin, eps, clip, xn_out, ids_out, w_out,
 *               out_norm, head, head_type, head_rows, logits, ktype, vtype, nslots, nwslots, embd, embd_type,
 *               embd_rows, tokens, active, sslots=0, nstates=0):
 * see qk_decode_layers; descs, kcs and vcs are addresses of n addresses each, slots and wslots of B; head 0: no
 * logits; embd 0: x holds the embeddings already. active > 0: the pool runs this call on that many threads
 * (set_active for the call, then the setting before). */
static PyObject *py_decode_layers(PyObject *self, PyObject *args) {
    (void)self;
    int isa, head_type, ktype, vtype;
    unsigned long long descs, x, slots, wslots, pos, kcs, vcs, cs, sn, xn, ids, w, norm, head, logits;
    unsigned long long embd, tokens, sslots = 0;
    long long n, B, head_rows, nslots, nwslots, embd_rows, nstates = 0;
    int embd_type, active;
    float eps, clip;
    if (!PyArg_ParseTuple(args, "iLKKLKKKKKKKffKKKKKiLKiiLLKiLKi|KL", &isa, &n, &descs, &x, &B, &slots, &wslots, &pos,
                          &kcs, &vcs, &cs, &sn, &eps, &clip, &xn, &ids, &w, &norm, &head, &head_type, &head_rows,
                          &logits, &ktype, &vtype, &nslots, &nwslots, &embd, &embd_type, &embd_rows, &tokens, &active,
                          &sslots, &nstates))
        return NULL;
    const qk_wmat hw = {(const uint8_t *)(uintptr_t)head, head_type, head_rows};
    const qk_wmat ew = {(const uint8_t *)(uintptr_t)embd, embd_type, embd_rows};
    int rc;
    Py_BEGIN_ALLOW_THREADS;
    const int before = qk_pool_active();
    if (active > 0) qk_pool_set_active(active);
    rc = qk_decode_layers(
        isa, n, (const qk_attn_desc *const *)(uintptr_t)descs, (float *)(uintptr_t)x, B,
        (const int64_t *const *)(uintptr_t)slots, (const int64_t *const *)(uintptr_t)wslots,
        (const int64_t *)(uintptr_t)pos, (void *const *)(uintptr_t)kcs, (void *const *)(uintptr_t)vcs,
        (const float *)(uintptr_t)cs, (const float *)(uintptr_t)sn, eps, clip, (float *)(uintptr_t)xn,
        (int64_t *)(uintptr_t)ids, (float *)(uintptr_t)w, (const float *)(uintptr_t)norm, head ? &hw : NULL,
        (float *)(uintptr_t)logits, ktype, vtype, nslots, nwslots, embd ? &ew : NULL, (const int64_t *)(uintptr_t)tokens,
        (const int64_t *)(uintptr_t)sslots, nstates);
    if (active > 0) qk_pool_set_active(before);
    Py_END_ALLOW_THREADS;
    return qk_raise(rc);
}

/* others_runnable() -> runnable threads of other processes (qk_others_runnable), or -1 where /proc cannot tell. */
static PyObject *py_others_runnable(PyObject *self, PyObject *args) {
    (void)self, (void)args;
    int n;
    Py_BEGIN_ALLOW_THREADS n = qk_others_runnable();
    Py_END_ALLOW_THREADS return PyLong_FromLong(n);
}

/* head(isa, x, B, H, norm, eps, head, head_type, head_rows, xn, logits): see qk_head. */
static PyObject *py_head(PyObject *self, PyObject *args) {
    (void)self;
    int isa, head_type;
    unsigned long long x, norm, head, xn, logits;
    long long B, H, rows;
    float eps;
    if (!PyArg_ParseTuple(args, "iKLLKfKiLKK", &isa, &x, &B, &H, &norm, &eps, &head, &head_type, &rows, &xn, &logits))
        return NULL;
    const qk_wmat hw = {(const uint8_t *)(uintptr_t)head, head_type, rows};
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_head(isa, (const float *)(uintptr_t)x, B, H, (const float *)(uintptr_t)norm, eps, &hw,
                                        (float *)(uintptr_t)xn, (float *)(uintptr_t)logits);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

static PyObject *py_attn_prompt(PyObject *self, PyObject *args) {
    (void)self;
    int isa;
    unsigned long long q, k, v, qp, kp, sinks, out;
    long long T, nh, D, S, nkv, Dv, window;
    float scale;
    if (!PyArg_ParseTuple(args, "iKLLLKKLLLKKfLKK", &isa, &q, &T, &nh, &D, &k, &v, &S, &nkv, &Dv, &qp, &kp, &scale,
                          &window, &sinks, &out))
        return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = qk_attn_prompt(
        isa, (const float *)(uintptr_t)q, T, nh, D, (const float *)(uintptr_t)k, (const float *)(uintptr_t)v, S, nkv,
        Dv, (const int64_t *)(uintptr_t)qp, (const int64_t *)(uintptr_t)kp, scale, window,
        (const float *)(uintptr_t)sinks, (float *)(uintptr_t)out);
    Py_END_ALLOW_THREADS return qk_raise(rc);
}

static PyMethodDef methods[] = {
    {"features", py_features, METH_NOARGS, "Kernel sets this CPU runs, the best one, thread pool settings."},
    {"qtypes", py_qtypes, METH_NOARGS, "ggml type ids (GGUF layouts) with kernels."},
    {"repack", py_repack, METH_VARARGS, "repack(to, src, dst, N, K): GGUF rows (Q4_K, Q5_K, Q6_K, Q8_0, MXFP4, IQ4_XS, Q5_0, Q5_1, IQ4_NL) into an interleaved layout."},
    {"read_jobs", py_read_jobs, METH_VARARGS, "read_jobs(jobs, n, next, done, scratch, scratch_bytes): take and run "
     "jobs (fd, offset, to or -1, dst, N, K) until none is left, the GIL free (r8.c's qk_read_jobs)."},
    {"unpack", py_unpack, METH_VARARGS, "unpack(from, src, dst, N, K): an interleaved layout back to GGUF rows."},
    {"set_threads", py_set_threads, METH_VARARGS, "set_threads(n, spin_us=-1): size the thread pool."},
    {"set_prefetch", py_set_prefetch, METH_VARARGS,
     "set_prefetch(bytes): the interleaved kernels' one-token prefetch distance (-1: the CPU's default, 0: none)."},
    {"set_amx", py_set_amx, METH_VARARGS,
     "set_amx(on): batches of Q8_0 / MXFP4 / Q4_K / Q5_K rows through AMX tiles where the CPU has them (-1, the "
     "default; 1), or not (0); the same bits either way."},
    {"set_wide", py_set_wide, METH_VARARGS,
     "set_wide(mask): which of the one-token Q4_K_R8 (1) / Q6_K_R8 (2) / MXFP4_R8 (4) passes run on 512-bit vectors, "
     "the others on 256-bit ones; -1: the CPU's default."},
    {"wide_default", py_wide_default, METH_VARARGS, "wide_default(vendor, family, model=0): the table's set_wide mask."},
    {"set_prefetch_spread", py_set_prefetch_spread, METH_VARARGS,
     "set_prefetch_spread(on): the one-token Q4_K_R8 / Q5_K_R8 (and 512-bit Q6_K_R8) passes prefetch a block's lines "
     "beside their loads (1) or all at the block's start (0), the CPU's default (-1)."},
    {"prefetch_spread_default", py_prefetch_spread_default, METH_VARARGS,
     "prefetch_spread_default(vendor, family, model=0): the table's set_prefetch_spread default."},
    {"set_idle_prefetch", py_set_idle_prefetch, METH_VARARGS,
     "set_idle_prefetch(bytes): how much of its share of the next job a thread done with its share of this one "
     "prefetches into L2 while it waits (0: none; -1: the CPU's default)."},
    {"idle_prefetch_default", py_idle_prefetch_default, METH_VARARGS,
     "idle_prefetch_default(vendor, family, model=0): the table's set_idle_prefetch default."},
    {"set_prefetch_near", py_set_prefetch_near, METH_VARARGS,
     "set_prefetch_near(bytes): the one-token interleaved passes also prefetch the lines this far ahead into L1 while "
     "their prefetch (set_prefetch) is on (0: not; -1: the CPU's default)."},
    {"prefetch_near_default", py_prefetch_near_default, METH_VARARGS,
     "prefetch_near_default(vendor, family, model=0): the table's set_prefetch_near default."},
    {"prefetch_default", py_prefetch_default, METH_VARARGS,
     "prefetch_default(vendor, family, model=0): the default (bytes, hint) of the CPUs of that CPUID vendor, family and model."},
    {"set_prefetch_hint", py_set_prefetch_hint, METH_VARARGS,
     "set_prefetch_hint(hint): the interleaved kernels' prefetch hint, 0..3 = T0, T1, T2, NTA (-1: the CPU's default)."},
    {"get_threads", py_get_threads, METH_NOARGS, "Threads of the pool (caller included)."},
    {"set_active", py_set_active, METH_VARARGS, "set_active(n): jobs run on min(n, threads) threads (0: all)."},
    {"act_row_bytes", py_act_row_bytes, METH_VARARGS, "act_row_bytes(ggml, K)"},
    {"read_bw", py_read_bw, METH_VARARGS, "read_bw(buf, nbytes, streams, prefetch): the read-bandwidth probe."},
    {"quantize_act", py_quantize_act, METH_VARARGS, "quantize_act(isa, ggml, x, T, K, out)"},
    {"matmul", py_matmul, METH_VARARGS, "matmul(isa, ggml, w, N, K, x, T, out)"},
    {"dot_passes", py_dot_passes, METH_VARARGS, "dot_passes(isa, ggml, w, N, K, x, reps, out): a kernel's passes alone."},
    {"matmuls", py_matmuls, METH_VARARGS, "matmuls(isa, x, T, K, ((w, ggml, N, out), ...))"},
    {"moe_ffn", py_moe_ffn, METH_VARARGS,
     "moe_ffn(isa, x, T, H, ids, wts, k, gate, gate_stride, gate_type, up, up_stride, up_type, down, "
     "down_stride, down_type, E, I, out, pairs=0, act=0, alpha=0, limit=0, gate_b=0, up_b=0, down_b=0)"},
    {"dequant_rows", py_dequant_rows, METH_VARARGS, "dequant_rows(ggml, w, N, K, rows, n, out)"},
    {"deq_dot", py_deq_dot, METH_VARARGS, "deq_dot(isa, ggml, w, N, K, x, out) -> whether this CPU has the kernel"},
    {"attn_fields", py_attn_fields, METH_NOARGS, "Field names of the attention block's layer descriptor."},
    {"attn_block", py_attn_block, METH_VARARGS,
     "attn_block(isa, desc, x, B, slots, pos, kc, vc, cos, sin, eps, clip, xn_out, ids_out, w_out, moe=0, ktype=0, "
     "vtype=0, sslots=0, nstates=0)"},
    {"attn_prompt", py_attn_prompt, METH_VARARGS,
     "attn_prompt(isa, q, T, nh, D, k, v, S, nkv, Dv, q_pos, k_pos, scale, window, sinks, out)"},
    {"others_runnable", py_others_runnable, METH_NOARGS, "others_runnable(): see moerun.model.ops.FreeCpus"},
    {"head", py_head, METH_VARARGS, "head(isa, x, B, H, norm, eps, head, head_type, head_rows, xn, logits)"},
    {"glu_down", py_glu_down, METH_VARARGS, "glu_down(isa, g, u, B, F, H, down, down_type, gl, out)"},
    {"decode_layers", py_decode_layers, METH_VARARGS,
     "decode_layers(isa, n, descs, x, B, slots, wslots, pos, kcs, vcs, cos, sin, eps, clip, xn_out, ids_out, w_out, "
     "out_norm, head, head_type, head_rows, logits, ktype, vtype, nslots, nwslots, embd, embd_type, embd_rows, tokens, "
     "active, sslots=0, nstates=0)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_cpu",
    .m_doc = "moerun CPU kernels over GGUF blocks (use moerun.kernels.cpu).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__cpu(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyModule_AddFunctions(m, QK_RECURRENT_METHODS) || PyModule_AddFunctions(m, QK_STEP_METHODS))) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
