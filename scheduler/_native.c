/* The scheduler's hot loops in C: the prefix index's probes (a prompt's walk, a KV
 * event's stores and removals) and the fleet-wide scoring of one placement (switchyard's
 * prefill choice, the decode pick).
 *
 * Every function here is the loop of a Python function it stands in for, on the very same
 * buffers (the index's ``array.array`` columns, the fleet's numpy arrays), with the same
 * arithmetic in the same order: the same answers, bit for bit (built with
 * -ffp-contract=off, so no fused multiply-add rounds differently). The Python stays the
 * reference and the fallback: ``scheduler/index.py`` and ``scheduler/placement.py`` use
 * this module when it was built, and ``tests/unit/test_native.py`` checks both paths agree
 * on random tables and fleets. What is rare or holds Python objects (a key held by several
 * workers gaining or losing a holder, eviction, a rebuild) is handed back to Python: each
 * loop stops there and says where.
 *
 * Table layout (``scheduler/index.py``): keys uint64, stamps int64, holders int32 (a worker
 * slot, -1 free, -2 a tombstone, or -3 - row for a key several workers hold, whose four
 * worker masks are Python ints in ``masks[4 * row:]``), tiers uint8.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <string.h>

#define H_EMPTY (-1)
#define H_TOMB (-2)
#define H_MULTI (-3)
#define T_DEVICE 1
#define T_OWN 7
#define T_CLUSTER 8
#define GOLDEN 0x9E3779B97F4A7C15ULL
#define STACK_WORDS 64 /* bitsets of up to 4,096 workers live on the stack */

/* --- arguments ------------------------------------------------------------------- */

/* The METH_FASTCALL arguments of ``name`` by ``fmt``, one character each: O an object,
 * l a list, i an int, n a Py_ssize_t, L a long long, d a double, p a truth value; what
 * PyArg_ParseTuple would take for O, O!&PyList_Type, i, n, L, d and p, without building a
 * tuple or reading a format per call (the placement's 25 arguments came to a tenth of
 * its call). 0, or -1 with an error set. */
static int parse_args(PyObject *const *args, Py_ssize_t nargs, const char *name, const char *fmt, ...) {
    Py_ssize_t want = (Py_ssize_t)strlen(fmt);
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd arguments (%zd given)", name, want, nargs);
        return -1;
    }
    va_list out;
    va_start(out, fmt);
    int rc = 0;
    for (Py_ssize_t i = 0; i < nargs && rc == 0; i++) {
        PyObject *a = args[i];
        switch (fmt[i]) {
        case 'O':
            *va_arg(out, PyObject **) = a;
            break;
        case 'l':
            if (!PyList_Check(a)) {
                PyErr_Format(PyExc_TypeError, "%s() argument %zd must be list, not %.50s", name, i + 1,
                             Py_TYPE(a)->tp_name);
                rc = -1;
            } else {
                *va_arg(out, PyObject **) = a;
            }
            break;
        case 'i': {
            long v = PyLong_AsLong(a);
            if (v == -1 && PyErr_Occurred()) {
                rc = -1;
            } else if (v > INT_MAX || v < INT_MIN) {
                PyErr_Format(PyExc_OverflowError, "%s() argument %zd does not fit a C int", name, i + 1);
                rc = -1;
            } else {
                *va_arg(out, int *) = (int)v;
            }
            break;
        }
        case 'n': {
            Py_ssize_t v = PyLong_AsSsize_t(a);
            if (v == -1 && PyErr_Occurred()) rc = -1;
            else *va_arg(out, Py_ssize_t *) = v;
            break;
        }
        case 'L': {
            long long v = PyLong_AsLongLong(a);
            if (v == -1 && PyErr_Occurred()) rc = -1;
            else *va_arg(out, long long *) = v;
            break;
        }
        case 'd': {
            double v = PyFloat_AsDouble(a);
            if (v == -1.0 && PyErr_Occurred()) rc = -1;
            else *va_arg(out, double *) = v;
            break;
        }
        case 'p': {
            int v = PyObject_IsTrue(a);
            if (v < 0) rc = -1;
            else *va_arg(out, int *) = v;
            break;
        }
        default:
            PyErr_Format(PyExc_SystemError, "%s(): bad argument format %c", name, fmt[i]);
            rc = -1;
        }
    }
    va_end(out);
    return rc;
}

/* --- buffers ---------------------------------------------------------------------- */

#define MAX_BUFFERS 16

typedef struct {
    Py_buffer view[MAX_BUFFERS];
    int n;
} Buffers;

static void release(Buffers *b) {
    for (int i = 0; i < b->n; i++) PyBuffer_Release(&b->view[i]);
    b->n = 0;
}

/* A contiguous buffer of items of ``itemsize`` bytes; NULL (an error set) otherwise. */
static void *take(Buffers *b, PyObject *obj, Py_ssize_t itemsize, int writable, Py_ssize_t *len) {
    if (b->n == MAX_BUFFERS) {
        PyErr_SetString(PyExc_RuntimeError, "too many buffers for one call");
        return NULL;
    }
    Py_buffer *v = &b->view[b->n];
    if (PyObject_GetBuffer(obj, v, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0) return NULL;
    b->n++;
    if (v->itemsize != itemsize || v->len % itemsize) {
        PyErr_Format(PyExc_TypeError, "expected items of %zd bytes, got %zd", itemsize, v->itemsize);
        return NULL;
    }
    if (len) *len = v->len / itemsize;
    return v->buf;
}

typedef struct {
    uint64_t *keys;
    int64_t *stamp;
    int32_t *holder;
    uint8_t *tiers;
    uint64_t mask;
    int shift;
} Table;

static int take_table(Buffers *b, Table *t, PyObject *keys, PyObject *stamp, PyObject *holder, PyObject *tiers,
                      int shift) {
    Py_ssize_t n, n2, n3, n4;
    if (!(t->keys = take(b, keys, 8, 0, &n)) || !(t->stamp = take(b, stamp, 8, 1, &n2)) ||
        !(t->holder = take(b, holder, 4, 1, &n3)) || !(t->tiers = take(b, tiers, 1, 1, &n4)))
        return -1;
    if (n != n2 || n != n3 || n != n4 || n == 0 || (n & (n - 1)) || shift < 1 || shift > 63 ||
        ((uint64_t)1 << (64 - shift)) != (uint64_t)n) {
        PyErr_SetString(PyExc_ValueError, "the table's columns disagree on its size");
        return -1;
    }
    t->mask = (uint64_t)n - 1;
    t->shift = shift;
    return 0;
}

/* ``PrefixIndex._probe``: the slot holding ``key``, or -1 - the slot it would take. */
static Py_ssize_t probe(const Table *t, uint64_t key) {
    uint64_t i = (key * GOLDEN) >> t->shift;
    Py_ssize_t reuse = -1;
    for (;;) {
        int32_t h = t->holder[i];
        if (h == H_EMPTY) return -1 - (reuse < 0 ? (Py_ssize_t)i : reuse);
        if (h == H_TOMB) {
            if (reuse < 0) reuse = (Py_ssize_t)i;
        } else if (t->keys[i] == key) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & t->mask;
    }
}

/* A block key as the table's uint64; 0 (no error left set) when it is no block hash. */
static int key_of(PyObject *obj, uint64_t *key) {
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "block keys are ints");
        return -1;
    }
    /* ``unsigned long`` is 64 bits here (LP64, checked below); its conversion reads the
     * int's digits directly, where ``PyLong_AsUnsignedLongLong`` goes through
     * ``_PyLong_AsByteArray`` for any int of more than one digit, as every block hash is. */
    unsigned long k = PyLong_AsUnsignedLong(obj);
    if (k == (unsigned long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear(); /* negative, or 2**64 and above: never stored */
        return 0;
    }
    *key = (uint64_t)k;
    return 1;
}

/* --- worker masks as bitsets ------------------------------------------------------- */

_Static_assert(sizeof(unsigned long) == 8, "key_of needs a 64-bit unsigned long");

/* A non-negative int into ``nwords`` 64-bit words, least significant first (zeroed here);
 * OverflowError if it is negative or needs more words. */
static int bits_of(PyObject *mask, uint64_t *words, Py_ssize_t nwords) {
    if (!PyLong_Check(mask)) {
        PyErr_SetString(PyExc_TypeError, "worker masks are ints");
        return -1;
    }
#if PY_VERSION_HEX < 0x030C0000
    /* CPython before 3.12 keeps an int as ``ob_size`` (its sign) digits of PyLong_SHIFT
     * bits, least significant first: read them straight into the words. */
    Py_ssize_t ndigits = Py_SIZE(mask);
    if (ndigits < 0) {
        PyErr_SetString(PyExc_OverflowError, "a worker mask is negative");
        return -1;
    }
    const digit *d = ((PyLongObject *)mask)->ob_digit;
    memset(words, 0, (size_t)nwords * sizeof(uint64_t));
    for (Py_ssize_t i = 0; i < ndigits; i++) {
        uint64_t v = d[i];
        if (!v) continue;
        Py_ssize_t bit = i * PyLong_SHIFT, w = bit / 64;
        int at = (int)(bit % 64);
        if (w >= nwords || (at + PyLong_SHIFT > 64 && w + 1 >= nwords && (v >> (64 - at)))) {
            PyErr_SetString(PyExc_OverflowError, "a worker mask past the worker slots");
            return -1;
        }
        words[w] |= v << at;
        if (at + PyLong_SHIFT > 64) words[w + 1] |= v >> (64 - at);
    }
    return 0;
#elif PY_VERSION_HEX >= 0x030D0000
    return _PyLong_AsByteArray((PyLongObject *)mask, (unsigned char *)words, (size_t)nwords * 8, 1, 0, 1);
#else
    return _PyLong_AsByteArray((PyLongObject *)mask, (unsigned char *)words, (size_t)nwords * 8, 1, 0);
#endif
}

/* ``out[w] = value`` for every worker ``w`` in ``a & ~b`` (``b`` NULL: in ``a``). */
static void scatter(const uint64_t *a, const uint64_t *b, Py_ssize_t nwords, int32_t *out, int32_t value) {
    for (Py_ssize_t w = 0; w < nwords; w++) {
        uint64_t x = b ? a[w] & ~b[w] : a[w];
        while (x) {
            out[w * 64 + __builtin_ctzll(x)] = value;
            x &= x - 1;
        }
    }
}

static int any_bit(const uint64_t *a, Py_ssize_t nwords) {
    for (Py_ssize_t w = 0; w < nwords; w++)
        if (a[w]) return 1;
    return 0;
}

/* walk(keys, stamp, holder, tiers, shift, masks, wanted, block_keys, clock, blocks, device) -> clock
 *
 * ``PrefixIndex._walk`` and ``_by_slot``: the leading blocks of ``block_keys`` each worker
 * of ``wanted`` reaches on any tier into ``blocks``, and on its device tier into
 * ``device`` (int32 arrays by worker slot, zeroed here first, one entry per worker
 * slot), and the matched keys stamped as used, the prefix last. Returns the new clock. */
static PyObject *walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys, *stamp, *holder, *tiers, *masks, *wanted, *block_keys, *blocks_obj, *device_obj;
    int shift;
    long long clock;
    if (parse_args(args, nargs, "walk", "OOOOilOlLOO", &keys, &stamp, &holder, &tiers, &shift, &masks,
                   &wanted, &block_keys, &clock, &blocks_obj, &device_obj) < 0)
        return NULL;
    Buffers b = {.n = 0};
    Table t;
    Py_ssize_t nslots, ndevice;
    int32_t *out_blocks, *out_device;
    uint64_t stack[6 * STACK_WORDS];
    uint64_t *heap = NULL;
    Py_ssize_t *matched = NULL;
    PyObject *result = NULL;
    if (take_table(&b, &t, keys, stamp, holder, tiers, shift) < 0) goto done;
    if (!(out_blocks = take(&b, blocks_obj, 4, 1, &nslots)) || !(out_device = take(&b, device_obj, 4, 1, &ndevice)))
        goto done;
    if (nslots != ndevice) {
        PyErr_SetString(PyExc_ValueError, "blocks and device differ in length");
        goto done;
    }
    memset(out_blocks, 0, (size_t)nslots * sizeof(int32_t));
    memset(out_device, 0, (size_t)nslots * sizeof(int32_t));
    Py_ssize_t nwords = (nslots + 63) / 64, n = PyList_GET_SIZE(block_keys);
    if (nwords == 0) nwords = 1; /* no worker: every mask is 0, one word says so */
    uint64_t *words = stack;
    if (nwords > STACK_WORDS) {
        if (!(words = heap = PyMem_Calloc((size_t)(6 * nwords), sizeof(uint64_t)))) {
            PyErr_NoMemory();
            goto done;
        }
    }
    uint64_t *reach = words, *dev_alive = words + nwords, *dev = words + 2 * nwords, *own = words + 3 * nwords,
             *next = words + 4 * nwords, *tmp = words + 5 * nwords;
    memset(words, 0, (size_t)(6 * nwords) * sizeof(uint64_t));
    if (bits_of(wanted, reach, nwords) < 0) goto done;
    if (nslots % 64) reach[nslots / 64] &= ((uint64_t)1 << (nslots % 64)) - 1; /* no write past the arrays */
    for (Py_ssize_t w = nslots / 64 + (nslots % 64 != 0); w < nwords; w++) reach[w] = 0;
    memcpy(dev_alive, reach, (size_t)nwords * sizeof(uint64_t));
    if (!(matched = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Py_ssize_t)))) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t key;
        int ok = key_of(PyList_GET_ITEM(block_keys, i), &key);
        if (ok < 0) goto done;
        if (!ok) break;
        Py_ssize_t slot = probe(&t, key);
        if (slot < 0) break;
        int32_t h = t.holder[slot];
        int in_cluster;
        if (h <= H_MULTI) { /* _holders_of: the row's masks */
            Py_ssize_t row = 4 * (Py_ssize_t)(H_MULTI - h);
            if (row + 4 > PyList_GET_SIZE(masks)) {
                PyErr_SetString(PyExc_ValueError, "a holder names a row past the masks");
                goto done;
            }
            if (bits_of(PyList_GET_ITEM(masks, row), dev, nwords) < 0) goto done;
            memcpy(own, dev, (size_t)nwords * sizeof(uint64_t));
            for (int r = 1; r < 3; r++) {
                if (bits_of(PyList_GET_ITEM(masks, row + r), tmp, nwords) < 0) goto done;
                for (Py_ssize_t w = 0; w < nwords; w++) own[w] |= tmp[w];
            }
            in_cluster = PyObject_IsTrue(PyList_GET_ITEM(masks, row + 3));
            if (in_cluster < 0) goto done;
        } else {
            if (h >= nslots) {
                PyErr_SetString(PyExc_ValueError, "a holder past the worker slots");
                goto done;
            }
            uint8_t tier = t.tiers[slot];
            memset(dev, 0, (size_t)nwords * sizeof(uint64_t));
            memset(own, 0, (size_t)nwords * sizeof(uint64_t));
            if (tier & T_DEVICE) dev[h / 64] = (uint64_t)1 << (h % 64);
            if (tier & T_OWN) own[h / 64] = (uint64_t)1 << (h % 64);
            in_cluster = (tier & T_CLUSTER) != 0;
        }
        /* _Walk.step */
        for (Py_ssize_t w = 0; w < nwords; w++) next[w] = in_cluster ? reach[w] : reach[w] & own[w];
        if (!in_cluster && !any_bit(next, nwords)) break;
        if (i) scatter(reach, next, nwords, out_blocks, (int32_t)i);
        memcpy(reach, next, (size_t)nwords * sizeof(uint64_t));
        for (Py_ssize_t w = 0; w < nwords; w++) next[w] = dev_alive[w] & dev[w];
        if (i) scatter(dev_alive, next, nwords, out_device, (int32_t)i);
        memcpy(dev_alive, next, (size_t)nwords * sizeof(uint64_t));
        matched[m++] = slot;
    }
    if (m) { /* _Walk.finish */
        scatter(reach, NULL, nwords, out_blocks, (int32_t)m);
        scatter(dev_alive, NULL, nwords, out_device, (int32_t)m);
    }
    for (Py_ssize_t j = m - 1; j >= 0; j--) t.stamp[matched[j]] = ++clock; /* the prefix newest */
    result = PyLong_FromLongLong(clock);
done:
    release(&b);
    PyMem_Free(heap);
    PyMem_Free(matched);
    return result;
}

/* --- KV events --------------------------------------------------------------------- */

enum { DONE = 0, NEEDS_PYTHON = 1, OVER_BOUND = 2 };

/* store(keys, stamp, holder, tiers, shift, block_keys, pos, worker, bit, clock, live, tombs, pairs, max_pairs)
 *   -> (code, pos, slot, clock, live, tombs, pairs)
 *
 * ``PrefixIndex._store``'s loop from ``block_keys[pos]`` back to the first (the caller made
 * room: ``_reserve``). It stops, with the counters so far, at a key another worker holds
 * (NEEDS_PYTHON: ``pos`` and its ``slot``, not yet stored or stamped: ``_add_holder``'s
 * work) or once the pairs pass ``max_pairs`` (OVER_BOUND: ``pos`` is the next key to
 * store; the key before it was stored and stamped). DONE: all stored. */
static PyObject *store(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys, *stamp, *holder, *tiers, *block_keys;
    int shift, worker, bit;
    Py_ssize_t pos;
    long long clock, live, tombs, pairs, max_pairs;
    if (parse_args(args, nargs, "store", "OOOOilniiLLLLL", &keys, &stamp, &holder, &tiers, &shift, &block_keys,
                   &pos, &worker, &bit, &clock, &live, &tombs, &pairs, &max_pairs) < 0)
        return NULL;
    Buffers b = {.n = 0};
    Table t;
    PyObject *result = NULL;
    int code = DONE;
    Py_ssize_t at = -1;
    if (take_table(&b, &t, keys, stamp, holder, tiers, shift) < 0) goto done;
    if (pos >= PyList_GET_SIZE(block_keys)) {
        PyErr_SetString(PyExc_IndexError, "pos past the keys");
        goto done;
    }
    for (; pos >= 0; pos--) {
        uint64_t key;
        int ok = key_of(PyList_GET_ITEM(block_keys, pos), &key);
        if (ok < 0) goto done;
        if (!ok) continue; /* not a block hash: never stored, so never matched */
        Py_ssize_t slot = probe(&t, key);
        if (slot < 0) { /* _insert */
            slot = -1 - slot;
            if (t.holder[slot] == H_TOMB) tombs--;
            t.keys[slot] = key;
            t.holder[slot] = worker;
            t.tiers[slot] = (uint8_t)bit;
            live++;
            pairs++;
        } else if (t.holder[slot] == worker) {
            t.tiers[slot] |= (uint8_t)bit;
        } else {
            code = NEEDS_PYTHON;
            at = slot;
            break;
        }
        t.stamp[slot] = ++clock;
        if (pairs > max_pairs) {
            code = OVER_BOUND;
            pos--;
            break;
        }
    }
    result = Py_BuildValue("inlLLLL", code, pos, (long)at, clock, live, tombs, pairs);
done:
    release(&b);
    return result;
}

/* unset(keys, stamp, holder, tiers, shift, block_keys, pos, worker, bits, live, tombs, pairs)
 *   -> (code, pos, slot, live, tombs, pairs)
 *
 * ``PrefixIndex._unset`` for ``block_keys[pos:]``, in order: a key only ``worker`` holds
 * loses ``bits``, and goes (a tombstone, or freed with the tombstones before it when the
 * slot after it is free: ``_delete``) once it has no tier left. It stops at a key several
 * workers hold (NEEDS_PYTHON: ``pos`` and its ``slot``: ``_unset_multi``'s work). */
static PyObject *unset(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *keys, *stamp, *holder, *tiers, *block_keys;
    int shift, worker, bits;
    Py_ssize_t pos;
    long long live, tombs, pairs;
    if (parse_args(args, nargs, "unset", "OOOOilniiLLL", &keys, &stamp, &holder, &tiers, &shift, &block_keys,
                   &pos, &worker, &bits, &live, &tombs, &pairs) < 0)
        return NULL;
    Buffers b = {.n = 0};
    Table t;
    PyObject *result = NULL;
    int code = DONE;
    Py_ssize_t at = -1, n = PyList_GET_SIZE(block_keys);
    if (take_table(&b, &t, keys, stamp, holder, tiers, shift) < 0) goto done;
    if (pos < 0) {
        PyErr_SetString(PyExc_IndexError, "negative pos");
        goto done;
    }
    for (; pos < n; pos++) {
        uint64_t key;
        int ok = key_of(PyList_GET_ITEM(block_keys, pos), &key);
        if (ok < 0) goto done;
        if (!ok) continue;
        Py_ssize_t slot = probe(&t, key);
        if (slot < 0) continue;
        int32_t h = t.holder[slot];
        if (h == worker) {
            uint8_t left = t.tiers[slot] & (uint8_t)~bits;
            if (left) {
                t.tiers[slot] = left;
                continue;
            }
            t.holder[slot] = H_TOMB; /* _delete */
            live--;
            tombs++;
            pairs--;
            uint64_t s = ((uint64_t)slot + 1) & t.mask; /* _free_tombs_before */
            if (t.holder[s] == H_EMPTY) {
                s = (s - 1) & t.mask;
                while (t.holder[s] == H_TOMB) {
                    t.holder[s] = H_EMPTY;
                    tombs--;
                    s = (s - 1) & t.mask;
                }
            }
        } else if (h <= H_MULTI) {
            code = NEEDS_PYTHON;
            at = slot;
            break;
        }
    }
    result = Py_BuildValue("inlLLL", code, pos, (long)at, live, tombs, pairs);
done:
    release(&b);
    return result;
}

/* --- placement --------------------------------------------------------------------- */

/* ``ceil(x)`` for |x| < 2**62 without a libm call (-O2 on baseline x86-64 has no rounding
 * instruction): the truncation toward zero, exact in a double there, then up by one if it
 * fell below x. Anything else (NaN too) goes to ``ceil``. */
static inline double ceil_small(double x) {
    if (!(x < 4611686018427387904.0 && x > -4611686018427387904.0)) return ceil(x);
    double down = (double)(int64_t)x;
    return down < x ? down + 1.0 : down;
}

/* A worker's uncached prompt tokens from its matched blocks (``nb``, ``nd`` of them on its
 * device; ``PlacementView.uncached_tokens``), and what its ledger takes for them: at least
 * one, whole (``_fitting``). */
static inline double uncached_of(int64_t nb, int64_t nd, long long prompt, long long block_size, double fetch_credit) {
    if (nb <= 0) return (double)prompt;
    int64_t fetchable = (nb - nd) * block_size;
    double computed = (double)(prompt - nd * block_size) - fetch_credit * (double)fetchable;
    return computed > 0.0 ? computed : 0.0;
}

static inline double need_of(double uncached) {
    double need = ceil_small(uncached);
    return need >= 1.0 ? need : 1.0;
}

/* ``Placer._fits`` at slot ``s``: its budget takes ``need`` (an idle worker takes anything),
 * and (``check_kv``) a colocated worker holding decodes has KV room for this one's. */
static inline int slot_fits(int64_t s, double need, const double *load, const double *budget, int check_kv,
                            const double *coloc, const double *holding, const double *kv, const double *kvcap,
                            long long decode_tokens) {
    if (!(load[s] == 0.0 || load[s] + need <= budget[s])) return 0;
    return !(check_kv && coloc[s] != 0.0 && !(holding[s] == 0.0 || kv[s] + (double)decode_tokens <= kvcap[s]));
}

/* One worker that fits, kept by the first pass for the second (``spread``). */
typedef struct {
    int64_t slot;
    double pred, uncached, need, work, tie;
    int crowds;
} Fit;

/* The first pass's candidates, kept for the second: one buffer, grown to the largest fleet
 * seen and kept (the GIL is held throughout; no call here re-enters another). */
static Fit *fit_buf = NULL;
static Py_ssize_t fit_cap = 0;

static Fit *fit_space(Py_ssize_t n) {
    if (n > fit_cap) {
        Fit *grown = PyMem_Realloc(fit_buf, sizeof(Fit) * (size_t)n);
        if (!grown) {
            PyErr_NoMemory();
            return NULL;
        }
        fit_buf = grown;
        fit_cap = n;
    }
    return fit_buf ? fit_buf : fit_space(1);
}

/* ``spread_slots``: of the ``m`` workers in ``fit`` that ``equal`` says cost the same work
 * and whose predicted TTFT is ``least`` (the least of theirs), the one that took new content
 * longest ago (``filled``, read only with ``by_filled``: ``policies.spreads``, not on a busy
 * fleet with colocated workers), then the lowest rank. ``equal`` NULL: those of uncached tokens ``uncached``. */
static const Fit *spread(const Fit *fit, Py_ssize_t m, const Fit *equal, double uncached, double least,
                         int by_filled, const double *filled, const int64_t *rank) {
    const Fit *best = NULL;
    for (Py_ssize_t j = 0; j < m; j++) {
        const Fit *f = &fit[j];
        if (equal ? (f->work != equal->work || f->crowds != equal->crowds || f->tie != equal->tie)
                  : f->uncached != uncached)
            continue;
        if (f->pred != least) continue;
        double at = by_filled ? filled[f->slot] : 0.0, best_at = best && by_filled ? filled[best->slot] : 0.0;
        if (best == NULL || at < best_at || (at == best_at && rank[f->slot] < rank[best->slot])) best = f;
    }
    return best;
}

/* ``choose_prefill`` with no SLO to keep (``limit`` infinite): among the workers that fit,
 * the least predicted TTFT; then (``spread``) of those that compute as much as the quickest
 * and are as quick, the one filled longest ago. The same operations on
 * the same values as the general loop's branch for a worker that is not safe, in a loop with
 * nothing else: most requests are placed here, and its scan over ~750 workers was a seventh
 * of the core's instructions. */
static PyObject *quickest(const double *load, const double *rate, const double *budget, const double *kv,
                          const double *kvcap, const double *holding, const double *coloc, const int64_t *rank,
                          const int64_t *slots, const int64_t *rows, const int32_t *blocks, const int32_t *device,
                          Py_ssize_t nfleet, Py_ssize_t n, Py_ssize_t nblocks, long long prompt, long long block_size,
                          double fetch_credit, long long decode_tokens, int check_kv, const double *factor,
                          double prefill_scale, double both_scale, const double *filled, int by_filled,
                          Fit *fit) {
    const double whole = (double)prompt, whole_need = need_of(whole);
    const int prefill_scaled = prefill_scale == prefill_scale, both_scaled = both_scale == both_scale;
    double best_pred = INFINITY, best_unc = INFINITY;
    int64_t best = -1;
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (s < 0 || s >= nfleet) {
            PyErr_SetString(PyExc_IndexError, "a slot past the fleet");
            return NULL;
        }
        int64_t r = rows[s];
        int32_t nb = (r >= 0 && r < nblocks) ? blocks[r] : 0;
        double uncached = whole, need = whole_need;
        if (nb > 0) {
            uncached = uncached_of(nb, device[r], prompt, block_size, fetch_credit);
            need = need_of(uncached);
        }
        if (!slot_fits(s, need, load, budget, check_kv, coloc, holding, kv, kvcap, decode_tokens)) continue;
        double w = coloc[s] != 0.0 ? (both_scaled ? factor[s] * both_scale : rate[s])
                                   : (prefill_scaled ? factor[s] * prefill_scale : rate[s]);
        double pred = (load[s] + uncached) / w; /* choose_slots */
        if (pred <= best_pred || best < 0) /* a slower one cannot tie the quickest: not kept */
            fit[m++] = (Fit){.slot = s, .pred = pred, .uncached = uncached, .need = need};
        if (pred < best_pred || best < 0) {
            best_pred = pred;
            best_unc = uncached;
            best = s;
        } else if (pred == best_pred && uncached < best_unc) {
            best_unc = uncached;
        }
    }
    if (best < 0) return Py_NewRef(Py_None);
    const Fit *chosen = spread(fit, m, NULL, best_unc, best_pred, by_filled, filled, rank);
    return Py_BuildValue("Ld", (long long)chosen->slot, chosen->need);
}

/* choose_prefill(load, rate, budget, kv, kv_cap, holding, colocated, rank, slots, rows, blocks,
 *                device, prompt, block_size, fetch_credit, decode_tokens, check_kv, limit, limit2,
 *                queue_weight, kv_tie, placed, room_edge, factor, prefill_scale, both_scale,
 *                filled, by_filled)
 *   -> (slot, need) of the best worker, ties to the one filled longest ago (``by_filled``),
 *      then the lowest ``rank`` (the fleet's order of worker ids, so the lowest id); None if
 *      none fits
 *
 * A worker's prefill rate is ``factor * prefill_scale`` (``both_scale`` for a colocated one)
 * where that scale is a number, else ``rate``: ``Fleet.native_rates``, whose ``rate`` is not
 * rewritten after every learnt sample.
 *
 * ``Placer._prefill_by_slot`` with ``Switchyard.choose_slots``: over the fleet's workers at
 * ``slots`` (each one's index slot ``rows[slot]``, past ``blocks`` for a worker the index
 * does not know), its uncached tokens (``_uncached``), whether it takes them (``_fitting``:
 * ``check_kv`` when the fleet has colocated workers), and among those that do, when
 * ``limit`` (half the time left before the TTFT SLO) is finite and some worker's predicted
 * TTFT is within it, the least work among those (on a colocated worker its queue counts
 * ``queue_weight`` times), then a colocated worker whose decodes have room for the prompt
 * (``room_edge - placed``: ``WorkerState.room_tokens``) before one whose decodes have not,
 * then (``kv_tie``) the least KV a colocated worker decodes, then the quickest; where none
 * is within ``limit``, the same among those within ``limit2`` (``policies.safe_limits``:
 * infinite for a request alone in the queue; else ``limit``); else the quickest (of those,
 * the ones that compute least). */
static PyObject *choose_prefill(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *o_load, *o_rate, *o_budget, *o_kv, *o_kvcap, *o_holding, *o_coloc, *o_rank, *o_slots, *o_rows,
        *o_blocks, *o_device, *o_placed, *o_edge, *o_factor, *o_filled;
    long long prompt, block_size, decode_tokens;
    double fetch_credit, limit, limit2, queue_weight, prefill_scale, both_scale;
    int check_kv, kv_tie, by_filled;
    if (parse_args(args, nargs, "choose_prefill", "OOOOOOOOOOOOLLdLpdddpOOOddOp", &o_load, &o_rate, &o_budget, &o_kv,
                   &o_kvcap, &o_holding, &o_coloc, &o_rank, &o_slots, &o_rows, &o_blocks, &o_device, &prompt,
                   &block_size, &fetch_credit, &decode_tokens, &check_kv, &limit, &limit2, &queue_weight, &kv_tie, &o_placed,
                   &o_edge, &o_factor, &prefill_scale, &both_scale, &o_filled, &by_filled) < 0)
        return NULL;
    Buffers b = {.n = 0};
    PyObject *result = NULL;
    Fit *fit = NULL;
    double *load, *rate, *budget, *kv, *kvcap, *holding, *coloc, *placed, *edge, *factor, *filled;
    int64_t *rank, *slots, *rows;
    int32_t *blocks, *device;
    Py_ssize_t nfleet, n, nrows, nblocks, ndevice, k;
    if (!(load = take(&b, o_load, 8, 0, &nfleet)) || !(rate = take(&b, o_rate, 8, 0, &k)) || k != nfleet ||
        !(budget = take(&b, o_budget, 8, 0, &k)) || k != nfleet || !(kv = take(&b, o_kv, 8, 0, &k)) || k != nfleet ||
        !(kvcap = take(&b, o_kvcap, 8, 0, &k)) || k != nfleet || !(holding = take(&b, o_holding, 8, 0, &k)) ||
        k != nfleet || !(coloc = take(&b, o_coloc, 8, 0, &k)) || k != nfleet ||
        !(rank = take(&b, o_rank, 8, 0, &k)) || k != nfleet || !(slots = take(&b, o_slots, 8, 0, &n)) ||
        !(rows = take(&b, o_rows, 8, 0, &nrows)) || nrows != nfleet || !(blocks = take(&b, o_blocks, 4, 0, &nblocks)) ||
        !(device = take(&b, o_device, 4, 0, &ndevice)) || ndevice != nblocks ||
        !(placed = take(&b, o_placed, 8, 0, &k)) || k != nfleet || !(edge = take(&b, o_edge, 8, 0, &k)) || k != nfleet ||
        !(factor = take(&b, o_factor, 8, 0, &k)) || k != nfleet || !(filled = take(&b, o_filled, 8, 0, &k)) ||
        k != nfleet) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the fleet's arrays differ in length");
        goto done;
    }
    if (!(fit = fit_space(n))) goto done;
    int slo = limit < INFINITY; /* -inf (a late request): nothing is safe, the quickest wins */
    if (!slo) {
        result = quickest(load, rate, budget, kv, kvcap, holding, coloc, rank, slots, rows, blocks, device, nfleet, n,
                          nblocks, prompt, block_size, fetch_credit, decode_tokens, check_kv, factor, prefill_scale,
                          both_scale, filled, by_filled, fit);
        goto done;
    }
    for (int pass = 0;; pass++) { /* ``limit``, then (none within it) ``limit2`` */
        const double lim = pass ? limit2 : limit;
        int any_safe = 0;
        double best_work = INFINITY, best_tie = INFINITY, best_pred = INFINITY, best_unc = INFINITY;
        int best_crowds = 1;
        int64_t best = -1;
        Py_ssize_t m = 0, best_at = -1;
        int64_t last_nb = -1, last_nd = -1; /* no worker's: the first computes its own */
        double uncached = 0.0, need = 1.0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t s = slots[i];
            if (s < 0 || s >= nfleet) {
                PyErr_SetString(PyExc_IndexError, "a slot past the fleet");
                goto done;
            }
            int64_t r = rows[s];
            int64_t nb = (r >= 0 && r < nblocks) ? blocks[r] : 0, nd = (r >= 0 && r < nblocks) ? device[r] : 0;
            if (nb != last_nb || nd != last_nd) { /* a worker's (blocks, device) is mostly its neighbour's */
                last_nb = nb;
                last_nd = nd;
                uncached = uncached_of(nb, nd, prompt, block_size, fetch_credit);
                need = need_of(uncached);
            }
            if (!slot_fits(s, need, load, budget, check_kv, coloc, holding, kv, kvcap, decode_tokens)) continue;
            double scale = coloc[s] != 0.0 ? both_scale : prefill_scale; /* NaN: ``rate`` holds it */
            double pred = (load[s] + uncached) / (scale == scale ? factor[s] * scale : rate[s]); /* choose_slots */
            double work = uncached, tie = 0.0;
            int crowds = 0;
            int safe = slo && pred <= lim;
            Fit f = {.slot = s, .pred = pred, .uncached = uncached, .need = need, .work = INFINITY};
            if (safe) {
                /* the KV a colocated worker decodes is not work; with ``kv_tie`` it breaks ties */
                if (coloc[s] == 0.0) {
                    work = uncached;
                } else {
                    work = uncached + queue_weight * load[s];
                    if (kv_tie) tie = kv[s];
                }
                crowds = coloc[s] != 0.0 && uncached > edge[s] - placed[s];
                f.work = work, f.tie = tie, f.crowds = crowds;
                int same_work = work == best_work, same_crowds = same_work && crowds == best_crowds;
                if (!any_safe || work < best_work || (same_work && crowds < best_crowds) ||
                    (same_crowds && (tie < best_tie || (tie == best_tie && pred < best_pred)))) {
                    any_safe = 1;
                    best_work = work;
                    best_crowds = crowds;
                    best_tie = tie;
                    best_pred = pred;
                } else if (!(same_crowds && tie == best_tie && pred == best_pred && rank[s] < rank[best])) {
                    if (same_crowds && tie == best_tie && pred == best_pred) fit[m++] = f; /* tied, a higher id */
                    continue; /* worse, or tied with a lower id */
                }
            } else {
                if (any_safe) continue; /* a worker that is not safe ties no safe one (work infinite) */
                if (pred <= best_pred || best < 0) fit[m++] = f; /* a slower one cannot tie the quickest */
                if (pred < best_pred || best < 0) {
                    best_pred = pred;
                    best_unc = uncached;
                    best = s;
                } else if (pred == best_pred && uncached < best_unc) {
                    best_unc = uncached;
                }
                continue;
            }
            best = s;
            best_at = m;
            fit[m++] = f;
        }
        if (!any_safe && best >= 0 && pass == 0 && limit2 > limit) continue; /* none within ``limit`` */
        if (best < 0) {
            result = Py_NewRef(Py_None);
        } else {
            /* spread_slots: the safe workers of the best's work, or the quickest's uncached tokens */
            const Fit *chosen = any_safe ? spread(fit, m, &fit[best_at], 0.0, best_pred, by_filled, filled, rank)
                                         : spread(fit, m, NULL, best_unc, best_pred, by_filled, filled, rank);
            result = Py_BuildValue("Ld", (long long)chosen->slot, chosen->need);
        }
        break;
    }
done:
    release(&b);
    return result;
}

/* choose_decode(load, budget, running, rank, slots, tokens, saved, weight) -> slot, or -1 if none fits
 *
 * ``_decode_by_slot``: among the decode workers at ``slots`` that take ``tokens``, the one of
 * the least KV share of its budget, then the fewest sequences, then the lowest ``rank`` (the
 * fleet's order of worker ids). ``saved`` (None, or int32 by slot): the prompt's tokens that
 * decodes on each worker already hold, which it needs less there and which count ``weight``
 * times off that worker's load (``Fleet.decode_sharing``, ``placement._SHARE_WEIGHT``). */
static PyObject *choose_decode(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *o_load, *o_budget, *o_running, *o_rank, *o_slots, *o_saved;
    long long tokens;
    double weight;
    if (parse_args(args, nargs, "choose_decode", "OOOOOLOd", &o_load, &o_budget, &o_running, &o_rank, &o_slots,
                   &tokens, &o_saved, &weight) < 0)
        return NULL;
    Buffers b = {.n = 0};
    PyObject *result = NULL;
    double *load, *budget, *running;
    int64_t *rank, *slots;
    int32_t *saved = NULL;
    Py_ssize_t nfleet, n, k;
    if (!(load = take(&b, o_load, 8, 0, &nfleet)) || !(budget = take(&b, o_budget, 8, 0, &k)) || k != nfleet ||
        !(running = take(&b, o_running, 8, 0, &k)) || k != nfleet || !(rank = take(&b, o_rank, 8, 0, &k)) ||
        k != nfleet || !(slots = take(&b, o_slots, 8, 0, &n)) ||
        (o_saved != Py_None && (!(saved = take(&b, o_saved, 4, 0, &k)) || k != nfleet))) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "the fleet's arrays differ in length");
        goto done;
    }
    double best_share = INFINITY, best_running = INFINITY;
    int64_t best = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (s < 0 || s >= nfleet) {
            PyErr_SetString(PyExc_IndexError, "a slot past the fleet");
            goto done;
        }
        double held = saved ? (double)saved[s] : 0.0;
        if (!(load[s] == 0.0 || load[s] + (double)tokens - held <= budget[s])) continue;
        double share = (load[s] - weight * held) / (budget[s] > 1.0 ? budget[s] : 1.0);
        if (best < 0 || share < best_share || (share == best_share && running[s] < best_running)) {
            best_share = share;
            best_running = running[s];
        } else if (!(share == best_share && running[s] == best_running && rank[s] < rank[best])) {
            continue;
        }
        best = s;
    }
    result = PyLong_FromLongLong((long long)best);
done:
    release(&b);
    return result;
}

/* --- decodes' shared blocks ------------------------------------------------------------ */

/* The arguments of share_add and share_remove, (refs, keys, out): the keys as a fast
 * sequence (a new reference), or NULL with an error set. */
static PyObject *count_args(PyObject *const *args, Py_ssize_t nargs, const char *name, PyObject **refs,
                            PyObject **out) {
    PyObject *keys;
    if (parse_args(args, nargs, name, "OOO", refs, &keys, out) < 0) return NULL;
    if (!PyDict_Check(*refs) || (*out != Py_None && !PyList_Check(*out))) {
        PyErr_Format(PyExc_TypeError, "%s(dict, keys, list or None)", name);
        return NULL;
    }
    return PySequence_Fast(keys, "keys must be a sequence");
}

/* share_add(refs, keys, fresh) -> shared
 *
 * ``SharedBlocks.add``'s loop: each key's count in the dict ``refs`` goes up by one; the
 * keys already counted are the shared ones (how many, returned), the others are appended
 * to ``fresh`` (a list, or None). */
static PyObject *share_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *refs, *fresh, *seq = count_args(args, nargs, "share_add", &refs, &fresh);
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long long shared = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        PyObject *count = PyDict_GetItemWithError(refs, key); /* borrowed */
        long c = 0;
        if (count) {
            c = PyLong_AsLong(count);
            if (c == -1 && PyErr_Occurred()) goto fail;
        } else if (PyErr_Occurred()) {
            goto fail;
        }
        if (c) shared++;
        else if (fresh != Py_None && PyList_Append(fresh, key) < 0) goto fail;
        PyObject *next = PyLong_FromLong(c + 1);
        if (!next) goto fail;
        int rc = PyDict_SetItem(refs, key, next);
        Py_DECREF(next);
        if (rc < 0) goto fail;
    }
    Py_DECREF(seq);
    return PyLong_FromLongLong(shared);
fail:
    Py_DECREF(seq);
    return NULL;
}

/* share_remove(refs, keys, gone) -> dropped
 *
 * ``SharedBlocks.remove``'s loop: each key's count goes down by one (KeyError for a key
 * not counted); a key still counted after is one no longer counted twice (how many,
 * returned), a key at 0 leaves ``refs`` and is appended to ``gone`` (a list, or None). */
static PyObject *share_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *refs, *gone, *seq = count_args(args, nargs, "share_remove", &refs, &gone);
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    long long dropped = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        PyObject *count = PyDict_GetItemWithError(refs, key);
        if (!count) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            goto fail;
        }
        long c = PyLong_AsLong(count);
        if (c == -1 && PyErr_Occurred()) goto fail;
        if (c - 1) {
            PyObject *next = PyLong_FromLong(c - 1);
            if (!next) goto fail;
            int rc = PyDict_SetItem(refs, key, next);
            Py_DECREF(next);
            if (rc < 0) goto fail;
            dropped++;
        } else {
            Py_INCREF(key); /* the dict may hold the only other reference */
            int rc = PyDict_DelItem(refs, key);
            if (rc == 0 && gone != Py_None) rc = PyList_Append(gone, key);
            Py_DECREF(key);
            if (rc < 0) goto fail;
        }
    }
    Py_DECREF(seq);
    return PyLong_FromLongLong(dropped);
fail:
    Py_DECREF(seq);
    return NULL;
}

/* 1 << slot, a new reference. */
static PyObject *bit_of(long slot) {
    PyObject *one = PyLong_FromLong(1), *at = PyLong_FromLong(slot), *bit = NULL;
    if (one && at) bit = PyNumber_Lshift(one, at);
    Py_XDECREF(one);
    Py_XDECREF(at);
    return bit;
}

/* hold_keys(held_by, holding, slot, keys, held) -> None
 *
 * ``Fleet.hold_keys``: decodes on ``slot`` hold ``keys`` from now on (``held``), or no
 * longer do. ``held_by``: key -> the one slot holding it; ``holding``: key -> a bitset
 * (int) of the slots, once two or more hold it. */
static PyObject *hold_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *held_by, *holding, *keys;
    int slot, held;
    if (parse_args(args, nargs, "hold_keys", "OOiOp", &held_by, &holding, &slot, &keys, &held) < 0) return NULL;
    if (!PyDict_Check(held_by) || !PyDict_Check(holding) || slot < 0) {
        PyErr_SetString(PyExc_TypeError, "hold_keys(dict, dict, slot >= 0, keys, held)");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence");
    if (!seq) return NULL;
    PyObject *bit = bit_of(slot), *slot_obj = PyLong_FromLong(slot), *others = NULL;
    PyObject *result = NULL;
    if (!bit || !slot_obj || !(others = PyNumber_Invert(bit))) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = items[i];
        PyObject *one = PyDict_GetItemWithError(held_by, key); /* borrowed */
        if (!one && PyErr_Occurred()) goto done;
        if (held) {
            PyObject *mask = NULL;
            if (one) {
                long other = PyLong_AsLong(one);
                if (other == -1 && PyErr_Occurred()) goto done;
                PyObject *obit = bit_of(other);
                if (!obit) goto done;
                mask = PyNumber_Or(obit, bit);
                Py_DECREF(obit);
                if (!mask || PyDict_DelItem(held_by, key) < 0) {
                    Py_XDECREF(mask);
                    goto done;
                }
            } else {
                PyObject *was = PyDict_GetItemWithError(holding, key);
                if (was) mask = PyNumber_Or(was, bit);
                else if (PyErr_Occurred()) goto done;
                else if (PyDict_SetItem(held_by, key, slot_obj) < 0) goto done;
                else continue;
                if (!mask) goto done;
            }
            int rc = PyDict_SetItem(holding, key, mask);
            Py_DECREF(mask);
            if (rc < 0) goto done;
            continue;
        }
        if (one) {
            long only = PyLong_AsLong(one);
            if (only == -1 && PyErr_Occurred()) goto done;
            if (only == slot) {
                if (PyDict_DelItem(held_by, key) < 0) goto done;
                continue;
            }
        }
        PyObject *was = PyDict_GetItemWithError(holding, key);
        if (!was) {
            if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, key);
            goto done;
        }
        PyObject *mask = PyNumber_And(was, others);
        if (!mask) goto done;
        size_t bits = _PyLong_NumBits(mask);
        PyObject *low = bits ? bit_of((long)bits - 1) : NULL; /* mask is this bit alone? */
        int several = low ? PyObject_RichCompareBool(mask, low, Py_NE) : 0;
        Py_XDECREF(low);
        if (several < 0 || (bits && !low)) {
            Py_DECREF(mask);
            goto done;
        }
        int rc;
        if (several) {
            rc = PyDict_SetItem(holding, key, mask);
        } else { /* one holder left */
            PyObject *last = PyLong_FromLong((long)bits - 1);
            Py_INCREF(key);
            rc = last ? PyDict_DelItem(holding, key) : -1;
            if (rc == 0) rc = PyDict_SetItem(held_by, key, last);
            Py_DECREF(key);
            Py_XDECREF(last);
        }
        Py_DECREF(mask);
        if (rc < 0) goto done;
    }
    result = Py_NewRef(Py_None);
done:
    Py_DECREF(seq);
    Py_XDECREF(bit);
    Py_XDECREF(slot_obj);
    Py_XDECREF(others);
    return result;
}

/* The slots holding ``key`` (``Fleet.holders``), a new reference: an int bitset. */
static PyObject *holders_of(PyObject *held_by, PyObject *holding, PyObject *key) {
    PyObject *one = PyDict_GetItemWithError(held_by, key);
    if (one) {
        long slot = PyLong_AsLong(one);
        return slot == -1 && PyErr_Occurred() ? NULL : bit_of(slot);
    }
    if (PyErr_Occurred()) return NULL;
    PyObject *mask = PyDict_GetItemWithError(holding, key);
    if (mask) return Py_NewRef(mask);
    return PyErr_Occurred() ? NULL : PyLong_FromLong(0);
}

/* out[slot] = value for each slot in the bitset ``mask`` (``index.by_slot``'s step). */
static int set_bits(PyObject *mask, int32_t *out, Py_ssize_t n, int32_t value) {
    size_t bits = _PyLong_NumBits(mask);
    if (bits == (size_t)-1 && PyErr_Occurred()) return -1;
    if ((Py_ssize_t)bits > n) {
        PyErr_SetString(PyExc_OverflowError, "a holder past the fleet's slots");
        return -1;
    }
    unsigned char stack[512], *bytes = stack;
    size_t len = (bits + 7) / 8;
    if (len > sizeof stack && !(bytes = PyMem_Malloc(len))) {
        PyErr_NoMemory();
        return -1;
    }
#if PY_VERSION_HEX >= 0x030D0000
    int rc = _PyLong_AsByteArray((PyLongObject *)mask, bytes, len, 1, 0, 1);
#else
    int rc = _PyLong_AsByteArray((PyLongObject *)mask, bytes, len, 1, 0);
#endif
    if (rc == 0)
        for (size_t i = 0; i < bits; i++)
            if (bytes[i >> 3] >> (i & 7) & 1) out[i] = value;
    if (bytes != stack) PyMem_Free(bytes);
    return rc;
}

/* decode_sharing(held_by, holding, keys, block_size, out) -> bool
 *
 * ``Fleet.decode_sharing`` into the int32 array ``out`` (zeroed, a slot each): for each
 * slot, the tokens of the prompt with these block keys that decodes there hold, its
 * leading blocks held there times ``block_size``. False (``out`` untouched) where none
 * holds its first block. */
static PyObject *decode_sharing(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    PyObject *held_by, *holding, *keys, *o_out;
    int block_size;
    if (parse_args(args, nargs, "decode_sharing", "OOOiO", &held_by, &holding, &keys, &block_size, &o_out) < 0)
        return NULL;
    if (!PyDict_Check(held_by) || !PyDict_Check(holding)) {
        PyErr_SetString(PyExc_TypeError, "decode_sharing(dict, dict, keys, block_size, out)");
        return NULL;
    }
    Buffers b = {.n = 0};
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence"), *mask = NULL, *result = NULL;
    Py_ssize_t nslots;
    int32_t *out;
    if (!seq || !(out = take(&b, o_out, 4, 1, &nslots))) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    if (!n || !(mask = holders_of(held_by, holding, items[0]))) goto maybe_none;
    int any = PyObject_IsTrue(mask);
    if (any < 0) goto done;
    if (!any) goto maybe_none;
    Py_ssize_t depth = 1;
    for (; depth < n; depth++) {
        PyObject *h = holders_of(held_by, holding, items[depth]);
        if (!h) goto done;
        PyObject *deeper = PyNumber_And(mask, h);
        Py_DECREF(h);
        if (!deeper) goto done;
        int differs = PyObject_RichCompareBool(deeper, mask, Py_NE);
        if (differs < 0) {
            Py_DECREF(deeper);
            goto done;
        }
        if (differs) {
            PyObject *inverse = PyNumber_Invert(deeper), *stopped = inverse ? PyNumber_And(mask, inverse) : NULL;
            Py_XDECREF(inverse);
            int rc = stopped ? set_bits(stopped, out, nslots, (int32_t)(depth * block_size)) : -1;
            Py_XDECREF(stopped);
            int none = rc < 0 ? -1 : !PyObject_IsTrue(deeper);
            Py_SETREF(mask, deeper);
            if (none < 0) goto done;
            if (none) break;
        } else {
            Py_DECREF(deeper);
        }
    }
    if (depth == n && set_bits(mask, out, nslots, (int32_t)(n * block_size)) < 0) goto done;
    result = Py_NewRef(Py_True);
    goto done;
maybe_none:
    if (!PyErr_Occurred()) result = Py_NewRef(Py_False);
done:
    release(&b);
    Py_XDECREF(seq);
    Py_XDECREF(mask);
    return result;
}

#define FAST(f) (PyCFunction)(void (*)(void))(f), METH_FASTCALL

static PyMethodDef methods[] = {
    {"walk", FAST(walk), "PrefixIndex._walk and _by_slot into two int32 arrays; returns the clock."},
    {"store", FAST(store), "PrefixIndex._store's loop, back to front, stopping for Python."},
    {"unset", FAST(unset), "PrefixIndex._unset over keys, stopping for Python."},
    {"choose_prefill", FAST(choose_prefill), "switchyard's prefill choice over the fleet's arrays."},
    {"choose_decode", FAST(choose_decode), "The decode pick over the fleet's arrays."},
    {"share_add", FAST(share_add), "SharedBlocks.add's loop over a dict of counts."},
    {"share_remove", FAST(share_remove), "SharedBlocks.remove's loop over a dict of counts."},
    {"hold_keys", FAST(hold_keys), "Fleet.hold_keys: which slots' decodes hold each key."},
    {"decode_sharing", FAST(decode_sharing), "Fleet.decode_sharing into an int32 array by slot."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The scheduler's hot loops in C (see the source's note).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    if (PyModule_AddIntConstant(m, "DONE", DONE) < 0 || PyModule_AddIntConstant(m, "NEEDS_PYTHON", NEEDS_PYTHON) < 0 ||
        PyModule_AddIntConstant(m, "OVER_BOUND", OVER_BOUND) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
