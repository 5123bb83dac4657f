/* The inner loops of plan evaluation, compiled.

Why this file exists: `choose_plan` ranks tens to hundreds of candidate plans with list-schedule
models (`_event_loop.event_loop`, for `_stream.stream_ms` and `_split_stream.split_ms`) and times the best few with a
replay of the engine's start rule (`roundpipe.planning.replay_rule.replay_starts`). At 94 layers those
three loops are most of a choice's time, each a heap of events over thousands of tasks, and in
Python each event costs a microsecond or more. Here they run the same steps on C arrays.

What it must never do: decide anything differently from the Python code it stands in for. Each
function below is a line-by-line transcription of a Python loop (same event order, same tie
breaks, the same float additions in the same order), and `tests/test_native_kernels.py` checks
every result against the Python loop on random and grid-shaped inputs; `build` makes the engine's
task graph (`roundpipe.sched.graph.GraphBuilder`) for plan evaluation's setup, and
`tests/test_plan_replay.py` checks it array for array against that graph on random plans. The Python loops stay the
reference and the fallback: a machine without a compiler runs them (`roundpipe.plan.native`).
It knows nothing of plans, devices or bytes: only integers, floats and the graphs it is handed.

Inputs are buffers (`array.array`): 'q' for integers, 'd' for floats, 'B' for flags. Graphs are
in CSR form: `off[t]..off[t+1]` index `idx` for task t's dependents. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef long long i64;

static PyObject *new_array(const char *typecode, Py_ssize_t count, void **data);
static PyObject *vec_array(const char *typecode, const void *items, Py_ssize_t count);

/* ---- heaps ------------------------------------------------------------------------------- */

static inline void ipush(i64 *h, Py_ssize_t *n, i64 v) {
    Py_ssize_t i = (*n)++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) >> 1;
        if (h[p] <= v) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static inline i64 ipop(i64 *h, Py_ssize_t *n) {
    i64 top = h[0];
    Py_ssize_t m = --(*n);
    if (m == 0) return top;
    i64 last = h[m];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && h[c + 1] < h[c]) c++;
        if (h[c] >= last) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

/* (time, task), ordered as Python orders the tuple */
typedef struct {
    double t;
    i64 task;
} Event;

static inline int ev_less(Event a, Event b) { return a.t < b.t || (a.t == b.t && a.task < b.task); }

static inline void epush(Event *h, Py_ssize_t *n, Event v) {
    Py_ssize_t i = (*n)++;
    while (i > 0) {
        Py_ssize_t p = (i - 1) >> 1;
        if (!ev_less(v, h[p])) break;
        h[i] = h[p];
        i = p;
    }
    h[i] = v;
}

static inline Event epop(Event *h, Py_ssize_t *n) {
    Event top = h[0];
    Py_ssize_t m = --(*n);
    if (m == 0) return top;
    Event last = h[m];
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= m) break;
        if (c + 1 < m && ev_less(h[c + 1], h[c])) c++;
        if (!ev_less(h[c], last)) break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

/* ---- buffers ----------------------------------------------------------------------------- */

typedef struct {
    Py_buffer view;
    int held;
} Buf;

static int get_buf(PyObject *obj, Buf *b, Py_ssize_t itemsize, const char *name) {
    if (PyObject_GetBuffer(obj, &b->view, PyBUF_C_CONTIGUOUS) < 0) return -1;
    b->held = 1;
    if (b->view.itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: items of %zd bytes expected, got %zd", name, itemsize,
                     b->view.itemsize);
        return -1;
    }
    return 0;
}

static void release(Buf *bufs, int count) {
    for (int i = 0; i < count; i++)
        if (bufs[i].held) PyBuffer_Release(&bufs[i].view);
}

/* The buffers of ``count`` objects of 8-byte items (``names`` for the errors): 0, or -1 with the
   error set and every buffer released. */
static int get_bufs(Buf *b, int count, PyObject *const *objs, const char *const *names) {
    memset(b, 0, sizeof(Buf) * count);
    for (int i = 0; i < count; i++)
        if (get_buf(objs[i], &b[i], 8, names[i])) {
            release(b, count);
            return -1;
        }
    return 0;
}

#define LEN(b) ((b).view.len / (b).view.itemsize)
#define I64(b) ((i64 *)(b).view.buf)
#define F64(b) ((double *)(b).view.buf)
#define U8(b) ((unsigned char *)(b).view.buf)

static PyObject *float_list(const double *values, Py_ssize_t count) {
    PyObject *list = PyList_New(count);
    if (list == NULL) return NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *f = PyFloat_FromDouble(values[i]);
        if (f == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, f);
    }
    return list;
}

/* A block kept from one call to the next (the working arrays of the replay, the builder and the
   inversion, in sets: `WorkingBlocks`): see `build` for why. */
typedef struct {
    void *p;
    size_t cap;
} Kept;

static void *kept(Kept *k, size_t bytes) {
    if (bytes > k->cap || k->p == NULL) { /* never NULL for an empty graph: malloc(0) may be */
        void *grown = malloc(bytes ? bytes : 8);
        if (!grown) return NULL;
        free(k->p);
        k->p = grown;
        k->cap = bytes;
    }
    return k->p;
}

/* Per-group heaps carved from one block: group g's heap holds at most size[g] items. */
typedef struct {
    i64 *items;
    Py_ssize_t *start, *len;
    int kept_items; /* ``items`` is a `Kept` block, not to be freed */
} Heaps;

static int heaps_init(Heaps *h, const i64 *group_of, Py_ssize_t count, Py_ssize_t groups, Kept *items) {
    h->kept_items = items != NULL;
    h->items = items ? kept(items, sizeof(i64) * count) : malloc(sizeof(i64) * (count > 0 ? count : 1));
    h->start = calloc(groups + 1, sizeof(Py_ssize_t));
    h->len = calloc(groups > 0 ? groups : 1, sizeof(Py_ssize_t));
    if (!h->items || !h->start || !h->len) return -1;
    for (Py_ssize_t t = 0; t < count; t++) h->start[group_of[t] + 1]++;
    for (Py_ssize_t g = 0; g < groups; g++) h->start[g + 1] += h->start[g];
    return 0;
}

static void heaps_free(Heaps *h) {
    if (!h->kept_items) free(h->items);
    free(h->start);
    free(h->len);
}

#define HEAP(h, g) ((h).items + (h).start[g])

/* A growable list of group numbers (the Python loops' ``touched``). */
typedef struct {
    i64 *items;
    Py_ssize_t len, cap;
} Vec;

static inline int vpush(Vec *v, i64 x) {
    if (v->len == v->cap) {
        Py_ssize_t cap = v->cap ? 2 * v->cap : 8;
        i64 *grown = realloc(v->items, sizeof(i64) * cap);
        if (!grown) return -1;
        v->items = grown;
        v->cap = cap;
    }
    v->items[v->len++] = x;
    return 0;
}

typedef struct {
    double *items;
    Py_ssize_t len, cap;
} DVec;

static inline int dgrow(DVec *v) {
    Py_ssize_t cap = v->cap ? 2 * v->cap : 64;
    double *grown = realloc(v->items, sizeof(double) * cap);
    if (!grown) return -1;
    v->items = grown;
    v->cap = cap;
    return 0;
}

typedef struct {
    Vec res, level, dep_off, dep_idx, tmp;
    DVec dur;
    int failed; /* out of memory */
    int broken; /* a dependency on a task that does not exist: `GraphBuilder` would raise */
} Graph;

/* ---- the stream models' loop: `_event_loop.event_loop` ---------------------------------------- */

/* One loop for both models, as in Python (`_event_loop.event_loop`): a free
   device starts its ready task first in dispatch order; computes end in time order; dependencies
   met after transfers (codes past k) come once every compute of the instant has ended. Optional
   parts (NULL when unused): extra dependents (`_stream`'s weight waits and gate), the watched
   tasks and their deadline (a window), start times, and `split_ms`'s uploads and saved readers. */
typedef struct {
    Py_ssize_t k, num_devices;
    const double *duration;
    const i64 *device, *off, *idx, *xoff, *xidx;
    i64 *unmet;
    double *left, give_up;
    const unsigned char *watch;
    Py_ssize_t waiting;
    i64 opening;
    double span, *start;
    const i64 *uploads_after, *uploads, *saving, *roff, *ridx;
    i64 bound;
    Py_ssize_t met_cap;
} Stream;

/* Returns 0 and sets *result (inf once given up), or -1 out of memory. */
static int stream_loop(Stream *s, double *result) {
    Py_ssize_t k = s->k, n = s->num_devices;
    const i64 *device = s->device;
    unsigned char *busy = calloc(n ? n : 1, 1);
    Event *ends = malloc(sizeof(Event) * (n + 1));
    i64 *met = malloc(sizeof(i64) * (s->met_cap ? s->met_cap : 1));
    Heaps ready;
    Vec touched = {0};
    int failed = heaps_init(&ready, device, k, n, NULL) || !busy || !ends || !met;
    if (!failed) {
        for (Py_ssize_t t = 0; t < k; t++) /* ascending: each device's is a heap */
            if (!s->unmet[t]) HEAP(ready, device[t])[ready.len[device[t]]++] = t;
        Py_ssize_t nends = 0, nmet = 0, waiting = s->waiting;
        double now = 0.0, deadline = INFINITY;
        for (Py_ssize_t d = 0; d < n; d++) failed |= vpush(&touched, d);
        for (;;) {
            int done = 0;
            for (Py_ssize_t i = 0; i < touched.len && !done; i++) {
                i64 d = touched.items[i];
                if (busy[d] || !ready.len[d]) continue;
                i64 t = ipop(HEAP(ready, d), &ready.len[d]);
                busy[d] = 1;
                if (s->start) s->start[t] = now;
                Event e = {now + s->duration[t], t};
                epush(ends, &nends, e);
                if (now + s->left[d] > s->give_up) {
                    *result = INFINITY;
                    done = 1;
                    break;
                }
                s->left[d] -= s->duration[t];
                if (s->watch && s->watch[t]) {
                    if (!--waiting) {
                        *result = now;
                        done = 1;
                    } else if (t == s->opening) {
                        deadline = now + s->span;
                    }
                }
            }
            if (done) break;
            touched.len = 0;
            i64 t;
            if (nends && (ends[0].t == now || !nmet)) {
                Event e = epop(ends, &nends);
                now = e.t;
                t = e.task;
                if (now > deadline) {
                    *result = INFINITY;
                    break;
                }
            } else if (nmet) {
                t = ipop(met, &nmet) % k;
                if (!--s->unmet[t]) {
                    ipush(HEAP(ready, device[t]), &ready.len[device[t]], t);
                    failed |= vpush(&touched, device[t]);
                }
                continue;
            } else {
                *result = now;
                break;
            }
            busy[device[t]] = 0;
            failed |= vpush(&touched, device[t]);
            for (int pass = 0; pass < 2; pass++) { /* the base dependents, then the extra ones */
                const i64 *from = pass ? s->xidx : s->idx;
                if (from == NULL) continue;
                i64 lo = pass ? s->xoff[t] : s->off[t], hi = pass ? s->xoff[t + 1] : s->off[t + 1];
                for (i64 j = lo; j < hi; j++) {
                    i64 u = from[j];
                    if (u >= k) {
                        ipush(met, &nmet, u);
                    } else if (!--s->unmet[u]) {
                        ipush(HEAP(ready, device[u]), &ready.len[device[u]], u);
                        failed |= vpush(&touched, device[u]);
                    }
                }
            }
            if (s->uploads_after && s->uploads_after[t] >= 0) ipush(met, &nmet, s->uploads[s->uploads_after[t]]);
            if (s->saving && s->saving[t] >= 0) {
                i64 q = s->saving[t] / s->bound, j = s->saving[t] % s->bound;
                for (i64 r = s->roff[q]; r < s->roff[q + 1]; r++) ipush(met, &nmet, s->ridx[r] + 2 * j);
            }
            if (failed) break;
        }
    }
    free(busy);
    free(ends);
    free(met);
    free(touched.items);
    heaps_free(&ready);
    return failed ? -1 : 0;
}

/* `_stream._list_schedule`: returns (now, starts): every task's, or (``every`` false) the watched
   tasks', in their order. */
static PyObject *list_schedule(PyObject *self, PyObject *args) {
    PyObject *o_slot_ms, *o_slot, *o_dev, *o_off, *o_idx, *o_unmet, *o_xsrc, *o_xcode, *o_left, *o_watched;
    Py_ssize_t num_devices;
    double give_up, span;
    int every;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnOdOdp", &o_slot_ms, &o_slot, &o_dev, &o_off, &o_idx, &o_unmet,
                          &o_xsrc, &o_xcode, &num_devices, &o_left, &give_up, &o_watched, &span, &every))
        return NULL;
    Buf b[10];
    memset(b, 0, sizeof b);
    if (get_buf(o_slot_ms, &b[0], 8, "slot_ms") || get_buf(o_dev, &b[1], 8, "device") ||
        get_buf(o_off, &b[2], 8, "offsets") || get_buf(o_idx, &b[3], 8, "dependents") ||
        get_buf(o_unmet, &b[4], 8, "unmet") || get_buf(o_xsrc, &b[5], 8, "extra sources") ||
        get_buf(o_xcode, &b[6], 8, "extra codes") || get_buf(o_left, &b[7], 8, "left") ||
        get_buf(o_watched, &b[8], 8, "watched") || get_buf(o_slot, &b[9], 8, "slot")) {
        release(b, 10);
        return NULL;
    }
    const double *slot_ms = F64(b[0]);
    const i64 *device = I64(b[1]), *slot = I64(b[9]), *xsrc = I64(b[5]), *xcode = I64(b[6]);
    const i64 *watched = I64(b[8]);
    Py_ssize_t k = LEN(b[1]), nextra = LEN(b[5]), nwatched = LEN(b[8]), nslots = LEN(b[0]);
    int bad = LEN(b[9]) != k || LEN(b[2]) != k + 1 || LEN(b[4]) != k || LEN(b[6]) != nextra ||
              LEN(b[7]) != num_devices;
    for (Py_ssize_t t = 0; !bad && t < k; t++) bad = slot[t] < 0 || slot[t] >= nslots;
    for (Py_ssize_t i = 0; !bad && i < nextra; i++) bad = xsrc[i] < 0 || xsrc[i] >= k;
    for (Py_ssize_t i = 0; !bad && i < nwatched; i++) bad = watched[i] < 0 || watched[i] >= k;
    for (Py_ssize_t t = 0; !bad && t < k; t++) bad = device[t] < 0 || device[t] >= num_devices;
    if (bad) {
        release(b, 10);
        PyErr_SetString(PyExc_ValueError, "list_schedule: arrays of unequal lengths or out of range");
        return NULL;
    }
    Stream s = {0};
    double *duration = malloc(sizeof(double) * (k ? k : 1)); /* `[slot_ms[i] for i in shape.slot]` */
    s.unmet = malloc(sizeof(i64) * (k ? k : 1));
    s.left = malloc(sizeof(double) * (num_devices ? num_devices : 1));
    s.start = malloc(sizeof(double) * (k ? k : 1));
    unsigned char *watch = calloc(k ? k : 1, 1);
    /* the extra dependents by source, each source's in the order given (a stable counting sort) */
    i64 *xoff = calloc(k + 1, sizeof(i64));
    i64 *xidx = malloc(sizeof(i64) * (nextra ? nextra : 1));
    i64 *xfill = malloc(sizeof(i64) * (k ? k : 1));
    int failed = !duration || !s.unmet || !s.left || !s.start || !watch || !xoff || !xidx || !xfill;
    double result = 0.0;
    if (!failed) {
        for (Py_ssize_t t = 0; t < k; t++) {
            duration[t] = slot_ms[slot[t]];
            s.start[t] = -1.0;
        }
        for (Py_ssize_t i = 0; i < nextra; i++) xoff[xsrc[i] + 1]++;
        for (Py_ssize_t t = 0; t < k; t++) {
            xoff[t + 1] += xoff[t];
            xfill[t] = xoff[t];
        }
        for (Py_ssize_t i = 0; i < nextra; i++) xidx[xfill[xsrc[i]]++] = xcode[i];
        memcpy(s.unmet, I64(b[4]), sizeof(i64) * k);
        memcpy(s.left, F64(b[7]), sizeof(double) * num_devices);
        for (Py_ssize_t i = 0; i < nwatched; i++)
            if (!watch[watched[i]]) {
                watch[watched[i]] = 1;
                s.waiting++;
            }
        if (!s.waiting) s.waiting = -1;
        s.k = k;
        s.num_devices = num_devices;
        s.duration = duration;
        s.device = device;
        s.off = I64(b[2]);
        s.idx = I64(b[3]);
        s.xoff = xoff;
        s.xidx = xidx;
        s.give_up = give_up;
        s.watch = watch;
        s.opening = nwatched ? watched[0] : -1;
        s.span = span;
        s.met_cap = s.off[k] + nextra + 1;
        failed = stream_loop(&s, &result) < 0;
    }
    PyObject *out = NULL;
    if (failed) {
        PyErr_NoMemory();
    } else {
        PyObject *starts = every ? float_list(s.start, k) : PyList_New(nwatched);
        for (Py_ssize_t i = 0; starts && !every && i < nwatched; i++) {
            PyObject *f = PyFloat_FromDouble(s.start[watched[i]]);
            if (f == NULL) Py_CLEAR(starts);
            else PyList_SET_ITEM(starts, i, f);
        }
        if (starts) out = Py_BuildValue("(dN)", result, starts);
    }
    free(duration);
    free(s.unmet);
    free(s.left);
    free(s.start);
    free(watch);
    free(xoff);
    free(xidx);
    free(xfill);
    release(b, 10);
    return out;
}

/* `_split_stream.split_ms`'s loop: returns the makespan (inf once given up). */
static PyObject *split_schedule(PyObject *self, PyObject *args) {
    PyObject *o_dur, *o_dev, *o_off, *o_idx, *o_unmet, *o_saving, *o_uploads, *o_upafter;
    PyObject *o_roff, *o_ridx, *o_left;
    Py_ssize_t num_devices, bound;
    double give_up;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOnnOd", &o_dur, &o_dev, &o_off, &o_idx, &o_unmet, &o_saving,
                          &o_uploads, &o_upafter, &o_roff, &o_ridx, &num_devices, &bound, &o_left,
                          &give_up))
        return NULL;
    Buf b[11];
    memset(b, 0, sizeof b);
    if (get_buf(o_dur, &b[0], 8, "duration") || get_buf(o_dev, &b[1], 8, "device") ||
        get_buf(o_off, &b[2], 8, "offsets") || get_buf(o_idx, &b[3], 8, "dependents") ||
        get_buf(o_unmet, &b[4], 8, "unmet") || get_buf(o_saving, &b[5], 8, "saving") ||
        get_buf(o_uploads, &b[6], 8, "uploads") || get_buf(o_upafter, &b[7], 8, "uploads_after") ||
        get_buf(o_roff, &b[8], 8, "reader offsets") || get_buf(o_ridx, &b[9], 8, "readers") ||
        get_buf(o_left, &b[10], 8, "left")) {
        release(b, 11);
        return NULL;
    }
    const i64 *device = I64(b[1]), *saving = I64(b[5]), *roff = I64(b[8]);
    Py_ssize_t k = LEN(b[1]), nuploads = LEN(b[6]), nruns = LEN(b[8]) - 1;
    int bad = LEN(b[0]) != k || LEN(b[2]) != k + 1 || LEN(b[4]) != k || LEN(b[5]) != k ||
              LEN(b[7]) != k || LEN(b[10]) != num_devices || bound <= 0;
    for (Py_ssize_t t = 0; !bad && t < k; t++) bad = device[t] < 0 || device[t] >= num_devices;
    /* every code pushed on ``met``: edges past k, one upload per run, every reader of a save */
    Py_ssize_t met_cap = bad ? 0 : I64(b[2])[k] + nuploads + 1;
    for (Py_ssize_t t = 0; !bad && t < k; t++)
        if (saving[t] >= 0) {
            i64 q = saving[t] / bound;
            bad = q >= nruns;
            if (!bad) met_cap += roff[q + 1] - roff[q];
        }
    if (bad) {
        release(b, 11);
        PyErr_SetString(PyExc_ValueError, "split_schedule: arrays of unequal lengths or out of range");
        return NULL;
    }
    Stream s = {0};
    s.unmet = malloc(sizeof(i64) * (k ? k : 1));
    s.left = malloc(sizeof(double) * (num_devices ? num_devices : 1));
    int failed = !s.unmet || !s.left;
    double result = 0.0;
    if (!failed) {
        memcpy(s.unmet, I64(b[4]), sizeof(i64) * k);
        memcpy(s.left, F64(b[10]), sizeof(double) * num_devices);
        s.k = k;
        s.num_devices = num_devices;
        s.duration = F64(b[0]);
        s.device = device;
        s.off = I64(b[2]);
        s.idx = I64(b[3]);
        s.give_up = give_up;
        s.uploads = I64(b[6]);
        s.uploads_after = I64(b[7]);
        s.saving = saving;
        s.roff = roff;
        s.ridx = I64(b[9]);
        s.bound = bound;
        s.met_cap = met_cap;
        failed = stream_loop(&s, &result) < 0;
    }
    PyObject *out = failed ? PyErr_NoMemory() : PyFloat_FromDouble(result);
    free(s.unmet);
    free(s.left);
    release(b, 11);
    return out;
}

/* ---- replay: `roundpipe.planning.replay_rule.replay_starts` -------------------------------------- */

/* The working blocks of the replay, the graph builder and its inversion. `planning.replay.side_by_side`
   replays a graph's two submissions at once, each on a thread of its own with the GIL let go, so
   two replays cannot share one set. Each call takes a set from a free list and gives it back
   (both holding the GIL, which guards the list): a set is kept from one call to the next (see
   `build` for why) and outlives the thread that used it. Kept per thread instead, the worker's
   would be freed as it is joined after each choice (a pipe leaves no thread behind), and its next
   choice would fault every page in again. There are as many sets as calls have run at once: two. */
typedef struct WorkingBlocks {
    Kept unmet, wave, heap; /* the replay's */
    Kept fill;              /* the inversion's */
    /* the builder's: per layer and version, the uploads that read it and the gradient downloads
       (``lv`` of each), the graph's growing lists and its other lists */
    Vec *readers, *grads;
    Py_ssize_t lv;
    Graph graph;
    Vec lists[7];
    struct WorkingBlocks *next; /* in the free list */
} WorkingBlocks;

static WorkingBlocks *free_blocks;

/* A set of blocks for a call, the GIL held: NULL out of memory. */
static WorkingBlocks *take_blocks(void) {
    WorkingBlocks *t = free_blocks;
    if (t != NULL) {
        free_blocks = t->next;
        return t;
    }
    return calloc(1, sizeof *t);
}

/* The set back to the free list, the GIL held. */
static void give_blocks(WorkingBlocks *t) {
    if (t == NULL) return;
    t->next = free_blocks;
    free_blocks = t;
}

static PyObject *replay(PyObject *self, PyObject *args) {
    PyObject *o_res, *o_rank, *o_dur, *o_off, *o_idx, *o_unmet, *o_batches, *o_loss_of, *o_losses,
        *o_flags;
    Py_ssize_t resources, beyond;
    long long seq;
    int loop, loss_lag;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOOnLpin", &o_res, &o_rank, &o_dur, &o_off, &o_idx, &o_unmet,
                          &o_batches, &o_loss_of, &o_losses, &o_flags, &resources, &seq, &loop,
                          &loss_lag, &beyond))
        return NULL;
    Buf b[10];
    memset(b, 0, sizeof b);
    if (get_buf(o_res, &b[0], 8, "res") || get_buf(o_rank, &b[1], 8, "rank") ||
        get_buf(o_dur, &b[2], 8, "dur") || get_buf(o_off, &b[3], 8, "offsets") ||
        get_buf(o_idx, &b[4], 8, "dependents") || get_buf(o_unmet, &b[5], 8, "unmet") ||
        get_buf(o_batches, &b[6], 8, "batches") || get_buf(o_loss_of, &b[7], 1, "loss_of") ||
        get_buf(o_losses, &b[8], 8, "losses_left") || get_buf(o_flags, &b[9], 1, "stop")) {
        release(b, 10);
        return NULL;
    }
    const i64 *res = I64(b[0]), *rank = I64(b[1]), *off = I64(b[3]), *idx = I64(b[4]);
    const i64 *batches = I64(b[6]);
    const double *dur = F64(b[2]);
    const unsigned char *loss_of = U8(b[7]), *flags = U8(b[9]);
    Py_ssize_t count = LEN(b[0]), nbatches = LEN(b[6]);
    const i64 seq_mask = seq - 1; /* seq is a power of two (checked below): the task of a heap key */
    if (LEN(b[1]) != count || LEN(b[2]) != count || LEN(b[3]) != count + 1 || LEN(b[5]) != count ||
        LEN(b[7]) != count || LEN(b[9]) != count || seq <= 0 || (seq & (seq - 1))) {
        release(b, 10);
        PyErr_SetString(PyExc_ValueError, "replay: arrays of unequal lengths, or a seq not a power of two");
        return NULL;
    }
    WorkingBlocks *blocks = take_blocks();
    if (blocks == NULL) {
        release(b, 10);
        return PyErr_NoMemory();
    }
    i64 *unmet = kept(&blocks->unmet, sizeof(i64) * count);
    i64 *losses_left = malloc(sizeof(i64) * (LEN(b[8]) ? LEN(b[8]) : 1));
    double *start = NULL; /* written straight into the array returned */
    PyObject *a_start = new_array("d", count, (void **)&start);
    unsigned char *is_free = malloc(resources ? resources : 1);
    Event *timed = malloc(sizeof(Event) * (resources + 1));
    i64 *wave = kept(&blocks->wave, sizeof(i64) * count);
    Heaps heaps;
    Vec touched = {0};
    int failed = heaps_init(&heaps, res, count, resources, &blocks->heap) || !unmet || !losses_left ||
                 !a_start || !is_free || !timed || !wave;
    Py_ssize_t stalled = 0;
    double earliest = -1.0; /* the first start of a task numbered ``beyond`` or more */
    Py_BEGIN_ALLOW_THREADS /* from here on, C arrays only (the buffers stay held) */
    if (!failed) {
        memcpy(unmet, I64(b[5]), sizeof(i64) * count);
        memcpy(losses_left, I64(b[8]), sizeof(i64) * LEN(b[8]));
        memset(is_free, 1, resources);
        for (Py_ssize_t t = 0; t < count; t++) start[t] = -1.0;
        double now = 0.0;
        Py_ssize_t done_count = 0, first = 0, nwave = 0, ntimed = 0, next_batch = 0;
        i64 released = loop ? 1 + 3 * loss_lag : nbatches;
        int submitting = 0, stopped = 0;
        for (;;) {
            touched.len = 0;
            if (next_batch < nbatches && released && (submitting || !nwave)) {
                i64 last = batches[next_batch++];
                released -= 1;
                submitting = released && next_batch < nbatches;
                for (i64 task = first; task < last; task++)
                    if (!unmet[task]) {
                        i64 r = res[task];
                        ipush(HEAP(heaps, r), &heaps.len[r], rank[task]);
                        failed |= vpush(&touched, r);
                    }
                first = last;
            } else {
                if (!nwave) {
                    if (!ntimed) break;
                    now = timed[0].t;
                    while (ntimed && timed[0].t == now) wave[nwave++] = epop(timed, &ntimed).task;
                }
                for (Py_ssize_t w = 0; w < nwave; w++) {
                    i64 task = wave[w], r = res[task];
                    is_free[r] = 1;
                    failed |= vpush(&touched, r);
                    if (loss_of[task]) {
                        i64 it = loss_of[task] - 1;
                        if (!--losses_left[it]) released += 2;
                    }
                    for (i64 j = off[task]; j < off[task + 1]; j++) {
                        i64 dep = idx[j];
                        if (!--unmet[dep] && dep < first) {
                            i64 rd = res[dep];
                            ipush(HEAP(heaps, rd), &heaps.len[rd], rank[dep]);
                            failed |= vpush(&touched, rd);
                        }
                    }
                }
                done_count += nwave;
                nwave = 0;
            }
            if (failed) break;
            for (Py_ssize_t i = 0; i < touched.len; i++) {
                i64 r = touched.items[i];
                if (is_free[r] && heaps.len[r]) {
                    i64 task = ipop(HEAP(heaps, r), &heaps.len[r]) & seq_mask;
                    is_free[r] = 0;
                    start[task] = now;
                    if (task >= beyond && earliest < 0.0) earliest = now;
                    stopped = stopped || flags[task];
                    double end = now + dur[task];
                    if (end == now) {
                        wave[nwave++] = task;
                    } else {
                        Event e = {end, task};
                        epush(timed, &ntimed, e);
                    }
                }
            }
            if (stopped) break;
        }
        if (!failed && !stopped) stalled = count - done_count;
    }
    Py_END_ALLOW_THREADS
    PyObject *out = NULL;
    if (failed) {
        Py_XDECREF(a_start);
        if (!PyErr_Occurred()) PyErr_NoMemory();
    } else {
        out = Py_BuildValue("(Nnd)", a_start, stalled, earliest);
    }
    free(losses_left);
    free(is_free);
    free(timed);
    free(touched.items);
    heaps_free(&heaps);
    give_blocks(blocks);
    release(b, 10);
    return out;
}

/* ---- invert: dependencies to dependents (`ReplayGraph.dependents`) -------------------- */

static PyObject *new_array(const char *typecode, Py_ssize_t count, void **data) {
    /* array.array(typecode, [0]) * count: zeroed, writable through the buffer; one block
       (through bytes it takes two, each a fresh mapping to fault in at a large graph's size) */
    PyObject *module = PyImport_ImportModule("array");
    if (module == NULL) return NULL;
    PyObject *one = PyObject_CallMethod(module, "array", "s[i]", typecode, 0);
    Py_DECREF(module);
    if (one == NULL) return NULL;
    PyObject *out = PySequence_Repeat(one, count);
    Py_DECREF(one);
    if (out == NULL) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE) < 0) {
        Py_DECREF(out);
        return NULL;
    }
    *data = view.buf; /* the array is not resized while we hold it */
    PyBuffer_Release(&view);
    return out;
}

/* Dependencies (CSR, every one in range) to (dependents offsets, dependents, unmet counts): each
   task's dependents in task order, as the engine lists them; ``blocks``: the caller's set. */
static PyObject *invert_csr(const i64 *off, const i64 *idx, Py_ssize_t count, WorkingBlocks *blocks) {
    Py_ssize_t edges = off[count];
    i64 *out_off, *out_idx, *unmet;
    PyObject *a_off = new_array("q", count + 1, (void **)&out_off);
    PyObject *a_idx = a_off ? new_array("q", edges, (void **)&out_idx) : NULL;
    PyObject *a_unmet = a_idx ? new_array("q", count, (void **)&unmet) : NULL;
    i64 *fill = a_unmet ? kept(&blocks->fill, sizeof(i64) * count) : NULL;
    if (fill == NULL) {
        Py_XDECREF(a_off);
        Py_XDECREF(a_idx);
        Py_XDECREF(a_unmet);
        return PyErr_Occurred() ? NULL : PyErr_NoMemory();
    }
    for (Py_ssize_t j = 0; j < edges; j++) out_off[idx[j] + 1]++;
    for (Py_ssize_t t = 0; t < count; t++) {
        out_off[t + 1] += out_off[t];
        fill[t] = out_off[t];
        unmet[t] = off[t + 1] - off[t];
    }
    /* tasks in ascending order, so each task's dependents come in task order */
    for (Py_ssize_t t = 0; t < count; t++)
        for (i64 j = off[t]; j < off[t + 1]; j++) out_idx[fill[idx[j]]++] = t;
    return Py_BuildValue("(NNN)", a_off, a_idx, a_unmet);
}

static PyObject *invert(PyObject *self, PyObject *args) {
    PyObject *o_off, *o_idx;
    if (!PyArg_ParseTuple(args, "OO", &o_off, &o_idx)) return NULL;
    Buf b[2];
    if (get_bufs(b, 2, (PyObject *[]){o_off, o_idx}, (const char *[]){"offsets", "dependencies"})) return NULL;
    const i64 *off = I64(b[0]), *idx = I64(b[1]);
    Py_ssize_t count = LEN(b[0]) - 1, edges = LEN(b[1]);
    const char *bad = count < 0 || off[count] != edges ? "offsets do not match the dependencies" : NULL;
    for (Py_ssize_t j = 0; !bad && j < edges; j++)
        if (idx[j] < 0 || idx[j] >= count) bad = "a dependency out of range";
    PyObject *out = NULL;
    if (bad)
        PyErr_Format(PyExc_ValueError, "invert: %s", bad);
    else {
        WorkingBlocks *blocks = take_blocks();
        out = blocks ? invert_csr(off, idx, count, blocks) : PyErr_NoMemory();
        give_blocks(blocks);
    }
    release(b, 2);
    return out;
}

/* ---- build: `roundpipe.sched.graph.GraphBuilder`, as `replay_graph._rendered` writes it -- */

/* `GraphBuilder`'s graph for plan evaluation's setup (one unit per layer, no chunking, no fresh
   units, barrier or ordered steps; see `sched/graph.py`, `forward_run.py`, `backward_run.py` and
   `rules.py` for the why of each edge), rendered as `replay_graph._rendered` renders it: the same
   tasks, in the same order, with the same dependencies; lean graphs as `build_graph` says. The
   rules' ledgers become arrays indexed by version (each read only while the ledger's dict still
   holds the key), the device histories two numbers. Resources and priorities as the fake backend
   and `sched.task.PRIORITY` give them. */

enum { COMPUTE_RES = 0, H2D_RES = 1, D2H_RES = 2 };
enum { HIGH = 30, MID = 20, LOW = 10, P_COPY_LEVEL = 12 };
enum { KIND_FWD = 0, KIND_FUSED = 1, KIND_BWD = 2 };

/* Room for ``more`` items; 0, or -1 out of memory. */
static inline int vreserve(Vec *v, Py_ssize_t more) {
    if (v->len + more <= v->cap) return 0;
    Py_ssize_t cap = v->cap ? 2 * v->cap : 8;
    while (cap < v->len + more) cap *= 2;
    i64 *grown = realloc(v->items, sizeof(i64) * cap);
    if (!grown) return -1;
    v->items = grown;
    v->cap = cap;
    return 0;
}

/* A task: its lists grown once, then written (a task is a few hundred instructions of pushes
   otherwise, and a 20-iteration graph at 94 layers holds twenty thousand of them). */
static i64 gadd(Graph *g, i64 res, int priority, double dur, const i64 *deps, Py_ssize_t nd) {
    i64 task = g->res.len;
    if (vreserve(&g->res, 1) || vreserve(&g->level, 1) || vreserve(&g->dep_idx, nd) ||
        vreserve(&g->dep_off, 1) || (g->dur.len == g->dur.cap && dgrow(&g->dur))) {
        g->failed = 1;
        return task;
    }
    g->dur.items[g->dur.len++] = dur;
    g->res.items[g->res.len++] = res;
    g->level.items[g->level.len++] = 100 - priority;
    i64 *to = g->dep_idx.items + g->dep_idx.len;
    for (Py_ssize_t i = 0; i < nd; i++) {
        g->broken |= deps[i] < 0 || deps[i] >= task;
        to[i] = deps[i];
    }
    g->dep_idx.len += nd;
    g->dep_off.items[g->dep_off.len++] = g->dep_idx.len;
    return task;
}

/* `GraphBuilder._p_copy`: P-copy(step) after the uploads that read the weights before it (rule 1)
   and the step itself; ``readers``, ``steps`` and ``copies`` are the layer's, by version. */
static void p_copy_task(Graph *g, Vec *readers, i64 *steps, i64 *copies, i64 s, i64 host) {
    Vec *mine = &readers[s];
    g->tmp.len = 0;
    for (Py_ssize_t i = 0; i < mine->len; i++) g->failed |= vpush(&g->tmp, mine->items[i]);
    mine->len = 0;
    if (steps[s] >= 0) g->failed |= vpush(&g->tmp, steps[s]);
    copies[s + 1] = gadd(g, host, P_COPY_LEVEL, 0.0, g->tmp.items, g->tmp.len);
}

static PyObject *vec_array(const char *typecode, const void *items, Py_ssize_t count) {
    void *data;
    PyObject *out = new_array(typecode, count, &data);
    if (out && count) memcpy(data, items, 8 * count);
    return out;
}

static PyObject *build(PyObject *self, PyObject *args) {
    PyObject *o_kind, *o_lstart, *o_lstop, *o_ms, *o_rms, *o_saved_by, *o_read_by, *o_sizes;
    Py_ssize_t n, iterations, layers, seq_floor;
    int asynch, lean;
    if (!PyArg_ParseTuple(args, "OOOOOOOOnnnppn", &o_kind, &o_lstart, &o_lstop, &o_ms, &o_rms,
                          &o_saved_by, &o_read_by, &o_sizes, &n, &iterations, &layers, &asynch, &lean,
                          &seq_floor))
        return NULL;
    Buf b[8];
    memset(b, 0, sizeof b);
    if (get_buf(o_kind, &b[0], 8, "kind") || get_buf(o_lstart, &b[1], 8, "layer starts") ||
        get_buf(o_lstop, &b[2], 8, "layer stops") || get_buf(o_ms, &b[3], 8, "ms") ||
        get_buf(o_rms, &b[4], 8, "recompute ms") || get_buf(o_saved_by, &b[5], 8, "saved_by") ||
        get_buf(o_read_by, &b[6], 8, "read_by") || get_buf(o_sizes, &b[7], 8, "round sizes")) {
        release(b, 8);
        return NULL;
    }
    const i64 *kind = I64(b[0]), *lstart = I64(b[1]), *lstop = I64(b[2]), *saved_by = I64(b[5]);
    const i64 *read_by = I64(b[6]), *sizes = I64(b[7]);
    const double *ms = F64(b[3]), *rms = F64(b[4]);
    Py_ssize_t S = LEN(b[0]), rounds = LEN(b[7]), m = 0;
    for (Py_ssize_t r = 0; r < rounds; r++) m += sizes[r];
    int bad = S < 1 || n < 1 || iterations < 1 || layers < 1 || LEN(b[1]) != S || LEN(b[2]) != S ||
              LEN(b[3]) != S || LEN(b[4]) != S || LEN(b[5]) != S || LEN(b[6]) != S || m < 1;
    for (Py_ssize_t i = 0; !bad && i < S; i++)
        bad = lstart[i] < 0 || lstop[i] > layers || lstart[i] >= lstop[i] || saved_by[i] >= S ||
              read_by[i] >= S;
    if (bad) {
        release(b, 8);
        PyErr_SetString(PyExc_ValueError, "build: a plan the graph cannot be built from");
        return NULL;
    }
    Py_ssize_t V = iterations + 2; /* versions, steps and iterations: 0 .. iterations + 1 */
    Py_ssize_t LV = layers * V;
    /* Per layer and version, the uploads that read it and the gradient downloads: thousands of
       short lists, kept from one build to the next with their blocks (allocating and freeing
       each was a fifth of a 20-iteration build at 94 layers), emptied here. */
    WorkingBlocks *blocks = take_blocks();
    if (blocks == NULL) {
        release(b, 8);
        return PyErr_NoMemory();
    }
    if (LV > blocks->lv) {
        Vec *more_readers = realloc(blocks->readers, sizeof(Vec) * LV);
        if (more_readers) blocks->readers = more_readers;
        Vec *more_grads = more_readers ? realloc(blocks->grads, sizeof(Vec) * LV) : NULL;
        if (more_grads) blocks->grads = more_grads;
        if (!more_readers || !more_grads) {
            give_blocks(blocks);
            release(b, 8);
            return PyErr_NoMemory();
        }
        memset(blocks->readers + blocks->lv, 0, sizeof(Vec) * (LV - blocks->lv));
        memset(blocks->grads + blocks->lv, 0, sizeof(Vec) * (LV - blocks->lv));
        blocks->lv = LV;
    }
    Vec *readers = blocks->readers, *grads = blocks->grads;
    for (Py_ssize_t i = 0; i < LV; i++) readers[i].len = grads[i].len = 0;
    i64 *p_copy = malloc(sizeof(i64) * LV), *step = malloc(sizeof(i64) * LV);
    i64 *last_g_copy = malloc(sizeof(i64) * layers);
    i64 *hist_last = malloc(sizeof(i64) * n), *hist_before = malloc(sizeof(i64) * n);
    i64 *hist_count = calloc(n, sizeof(i64));
    /* One device: its previous run's last uploads (act_up, and a backward run's grad_up), which
       every upload of the next run waits for (`forward_run`'s `uploads_after`). */
    i64 last_up[2] = {-1, -1};
    i64 *act_down = malloc(sizeof(i64) * S * m), *act_up = malloc(sizeof(i64) * S * m);
    i64 *last_grad_down = malloc(sizeof(i64) * S);
    /* The growing lists keep their blocks from one build to the next: a 20-iteration graph's are
       megabytes, which malloc maps afresh and unmaps on free, so each build would fault every
       page in again (more than half of its time at 94 layers). */
    Vec *kept_lists = blocks->lists;
    Vec params = kept_lists[0], chain = kept_lists[1], batches = kept_lists[2],
        computes = kept_lists[3], comp_off = kept_lists[4], losses = kept_lists[5],
        loss_off = kept_lists[6];
    params.len = chain.len = batches.len = computes.len = comp_off.len = losses.len = loss_off.len = 0;
    Graph g = blocks->graph;
    g.res.len = g.level.len = g.dep_off.len = g.dep_idx.len = g.tmp.len = g.dur.len = 0;
    g.failed = g.broken = 0;
    int failed = !readers || !grads || !p_copy || !step || !last_g_copy || !hist_last ||
                 !hist_before || !hist_count || !act_down || !act_up || !last_grad_down;
    failed = failed || vpush(&g.dep_off, 0) || vpush(&comp_off, 0) || vpush(&loss_off, 0);
    if (!failed) {
        for (Py_ssize_t i = 0; i < LV; i++) p_copy[i] = step[i] = -1;
        for (Py_ssize_t l = 0; l < layers; l++) last_g_copy[l] = -1;
        i64 first_device = 0, host = 3 * n;
        i64 deps[8];
        for (Py_ssize_t it = 0; it < iterations && !g.failed; it++) {
            int last_it = lean && it == iterations - 1, gradients = !last_it;
            i64 version = asynch ? (it > 0 ? it - 1 : 0) : it;
            for (Py_ssize_t i = 0; i < S * m; i++) act_down[i] = act_up[i] = -1;
            for (Py_ssize_t i = 0; i < S; i++) last_grad_down[i] = -1;
            /* dispatch: round by round, every slot, on (g0 + slot) mod n */
            i64 g0 = first_device, mb0 = 0;
            for (Py_ssize_t r = 0; r < rounds; r++) {
                for (Py_ssize_t slot = 0; slot < S; slot++) {
                    i64 device = (g0 + slot) % n, d = 3 * device;
                    i64 two_back = hist_count[device] >= 2 ? hist_before[device] : -1;
                    /* `_param_uploads` */
                    params.len = 0;
                    for (i64 layer = lstart[slot]; layer < lstop[slot]; layer++) {
                        Py_ssize_t nd = 0;
                        if (two_back >= 0) deps[nd++] = two_back;
                        if (version > 0) deps[nd++] = p_copy[layer * V + version];
                        i64 key = gadd(&g, d + H2D_RES, MID, 0.0, deps, nd);
                        g.failed |= vpush(&params, key) | vpush(&readers[layer * V + version], key);
                    }
                    chain.len = 0;
                    i64 last, run_up = -1, run_grad = -1;
                    if (kind[slot] == KIND_BWD) { /* `_backward_chains` */
                        i64 previous = hist_count[device] && n == 1 ? hist_last[device] : -1;
                        for (i64 mb = mb0, pos = 0; mb < mb0 + sizes[r]; mb++, pos++) {
                            i64 ahead = pos >= 2 ? chain.items[pos - 2] : two_back;
                            Py_ssize_t nd = 0;
                            if (ahead >= 0) deps[nd++] = ahead;
                            if (saved_by[slot] >= 0) deps[nd++] = act_down[saved_by[slot] * m + mb];
                            if (read_by[slot] >= 0) deps[nd++] = act_up[read_by[slot] * m + mb];
                            for (int u = 0; u < 2 && n == 1; u++)
                                if (last_up[u] >= 0) deps[nd++] = last_up[u];
                            i64 up = act_up[slot * m + mb] = gadd(&g, d + H2D_RES, HIGH, 0.0, deps, nd);
                            g.tmp.len = 0;
                            g.failed |= vpush(&g.tmp, up);
                            if (!pos) {
                                for (Py_ssize_t i = 0; i < params.len; i++) g.failed |= vpush(&g.tmp, params.items[i]);
                                if (previous >= 0) g.failed |= vpush(&g.tmp, previous);
                            } else {
                                if (!lean)
                                    for (Py_ssize_t i = 0; i < params.len; i++) g.failed |= vpush(&g.tmp, params.items[i]);
                                g.failed |= vpush(&g.tmp, chain.items[pos - 1]);
                            }
                            i64 recompute = gadd(&g, d + COMPUTE_RES, MID, rms[slot], g.tmp.items, g.tmp.len);
                            nd = 0;
                            deps[nd++] = act_down[(slot - 1) * m + mb];
                            if (ahead >= 0) deps[nd++] = ahead;
                            for (int u = 0; u < 2 && n == 1; u++)
                                if (last_up[u] >= 0) deps[nd++] = last_up[u];
                            i64 grad = gadd(&g, d + H2D_RES, HIGH, 0.0, deps, nd);
                            deps[0] = recompute;
                            deps[1] = grad;
                            i64 backward = gadd(&g, d + COMPUTE_RES, MID, ms[slot], deps, 2);
                            deps[0] = backward;
                            act_down[slot * m + mb] = gadd(&g, d + D2H_RES, HIGH, 0.0, deps, 1);
                            g.failed |= vpush(&chain, backward);
                            run_up = up;
                            run_grad = grad;
                        }
                    } else { /* `_chains` */
                        for (i64 mb = mb0, pos = 0; mb < mb0 + sizes[r]; mb++, pos++) {
                            Py_ssize_t nd = 0;
                            if (slot > 0) deps[nd++] = act_down[(slot - 1) * m + mb];
                            i64 ahead = pos >= 2 ? chain.items[pos - 2] : two_back;
                            if (ahead >= 0) deps[nd++] = ahead;
                            for (int u = 0; u < 2 && n == 1; u++)
                                if (last_up[u] >= 0) deps[nd++] = last_up[u];
                            i64 up = act_up[slot * m + mb] = gadd(&g, d + H2D_RES, HIGH, 0.0, deps, nd);
                            run_up = up;
                            g.tmp.len = 0;
                            g.failed |= vpush(&g.tmp, up);
                            if (!pos || !lean)
                                for (Py_ssize_t i = 0; i < params.len; i++) g.failed |= vpush(&g.tmp, params.items[i]);
                            if (pos) g.failed |= vpush(&g.tmp, chain.items[pos - 1]);
                            i64 compute = gadd(&g, d + COMPUTE_RES, MID, ms[slot], g.tmp.items, g.tmp.len);
                            deps[0] = compute;
                            act_down[slot * m + mb] = gadd(&g, d + D2H_RES, HIGH, 0.0, deps, 1);
                            g.failed |= vpush(&chain, compute);
                        }
                        if (kind[slot] == KIND_FUSED)
                            for (Py_ssize_t i = 0; i < chain.len; i++) g.failed |= vpush(&losses, chain.items[i]);
                    }
                    for (Py_ssize_t i = 0; i < chain.len; i++) g.failed |= vpush(&computes, chain.items[i]);
                    last = chain.items[chain.len - 1];
                    hist_before[device] = hist_last[device];
                    hist_last[device] = last;
                    hist_count[device]++;
                    last_up[0] = run_up;
                    last_up[1] = run_grad;
                    if (kind[slot] != KIND_FWD && gradients) { /* `_grad_download` */
                        g.tmp.len = 0;
                        g.failed |= vpush(&g.tmp, last);
                        if (last_grad_down[slot] >= 0) {
                            g.failed |= vpush(&g.tmp, last_grad_down[slot]);
                        } else {
                            for (i64 layer = lstart[slot]; layer < lstop[slot]; layer++)
                                if (last_g_copy[layer] >= 0) g.failed |= vpush(&g.tmp, last_g_copy[layer]);
                        }
                        i64 key = last_grad_down[slot] = gadd(&g, d + D2H_RES, LOW, 0.0, g.tmp.items, g.tmp.len);
                        for (i64 layer = lstart[slot]; layer < lstop[slot]; layer++)
                            g.failed |= vpush(&grads[layer * V + it], key);
                    }
                }
                g0 = (g0 + S) % n;
                mb0 += sizes[r];
            }
            first_device = g0;
            g.failed |= vpush(&comp_off, computes.len) | vpush(&loss_off, losses.len);
            if (gradients) { /* `_g_copies` */
                for (Py_ssize_t layer = 0; layer < layers; layer++) {
                    Vec *mine = &grads[layer * V + it];
                    g.tmp.len = 0;
                    for (Py_ssize_t i = 0; i < mine->len; i++) g.failed |= vpush(&g.tmp, mine->items[i]);
                    mine->len = 0;
                    if (it >= 1 && step[layer * V + it - 1] >= 0) g.failed |= vpush(&g.tmp, step[layer * V + it - 1]);
                    if (!asynch && p_copy[layer * V + it] >= 0) g.failed |= vpush(&g.tmp, p_copy[layer * V + it]);
                    last_g_copy[layer] = gadd(&g, host, LOW, 0.0, g.tmp.items, g.tmp.len);
                }
            }
            g.failed |= vpush(&batches, g.res.len);
            if (last_it) continue;
            /* `optimizer_step(it)`: async, P-copy(it - 1) then step(it); sync, step then P-copy(it) */
            for (Py_ssize_t layer = 0; layer < layers; layer++) {
                i64 *steps = step + layer * V, *copies = p_copy + layer * V;
                if (asynch && it > 0) p_copy_task(&g, &readers[layer * V], steps, copies, it - 1, host);
                g.tmp.len = 0;
                g.failed |= vpush(&g.tmp, last_g_copy[layer]);
                if (it >= 1 && steps[it - 1] >= 0) g.failed |= vpush(&g.tmp, steps[it - 1]);
                if (copies[it] >= 0) g.failed |= vpush(&g.tmp, copies[it]);
                steps[it] = gadd(&g, host, LOW, 0.0, g.tmp.items, g.tmp.len);
                if (!asynch) p_copy_task(&g, &readers[layer * V], steps, copies, it, host);
            }
            g.failed |= vpush(&batches, g.res.len);
        }
        failed = g.failed;
    }
    PyObject *out = NULL;
    if (failed) {
        PyErr_NoMemory();
    } else if (g.broken) {
        PyErr_SetString(PyExc_RuntimeError, "build: a task depends on one that does not exist");
    } else {
        Py_ssize_t count = g.res.len, bits = 0;
        while (((Py_ssize_t)1 << bits) <= count) bits++; /* count.bit_length() */
        i64 seq = (i64)1 << bits;
        if (seq < seq_floor) seq = seq_floor;
        i64 *rank = g.level.items; /* the levels become the heap keys in place */
        if (!rank) {
            PyErr_NoMemory();
        } else {
            for (Py_ssize_t t = 0; t < count; t++) rank[t] = g.level.items[t] * seq + t;
            PyObject *a_res = vec_array("q", g.res.items, count);
            PyObject *a_rank = vec_array("q", rank, count);
            PyObject *a_dur = vec_array("d", g.dur.items, count);
            PyObject *a_dependents = invert_csr(g.dep_off.items, g.dep_idx.items, count, blocks);
            PyObject *a_batches = vec_array("q", batches.items, batches.len);
            PyObject *a_coff = vec_array("q", comp_off.items, comp_off.len);
            PyObject *a_comp = vec_array("q", computes.items, computes.len);
            PyObject *a_loff = vec_array("q", loss_off.items, loss_off.len);
            PyObject *a_loss = vec_array("q", losses.items, losses.len);
            if (a_res && a_rank && a_dur && a_dependents && a_batches && a_coff && a_comp && a_loff && a_loss)
                out = Py_BuildValue("(NNNNNNNNNL)", a_res, a_rank, a_dur, a_dependents, a_batches, a_coff,
                                    a_comp, a_loff, a_loss, (long long)seq);
            else {
                Py_XDECREF(a_res);
                Py_XDECREF(a_rank);
                Py_XDECREF(a_dur);
                Py_XDECREF(a_dependents);
                Py_XDECREF(a_batches);
                Py_XDECREF(a_coff);
                Py_XDECREF(a_comp);
                Py_XDECREF(a_loff);
                Py_XDECREF(a_loss);
            }
        }
    }
    free(p_copy);
    free(step);
    free(last_g_copy);
    free(hist_last);
    free(hist_before);
    free(hist_count);
    free(act_down);
    free(act_up);
    free(last_grad_down);
    Vec lists[7] = {params, chain, batches, computes, comp_off, losses, loss_off};
    memcpy(kept_lists, lists, sizeof lists);
    blocks->graph = g;
    give_blocks(blocks);
    release(b, 8);
    return out;
}

/* ---- stream_extras: the weight waits and the gate of `_stream_graph._structure` -------------- */

static PyObject *stream_extras(PyObject *self, PyObject *args) {
    PyObject *o_run_start, *o_unmet, *o_woff, *o_widx, *o_soff, *o_sidx;
    Py_ssize_t s_count, nrounds, gate, gate_lag, num_devices;
    long long gate_code, weight_code, upload_code;
    int waits, shares;
    if (!PyArg_ParseTuple(args, "OOnnnnOOOOppnLLL", &o_run_start, &o_unmet, &s_count, &nrounds, &gate,
                          &gate_lag, &o_woff, &o_widx, &o_soff, &o_sidx, &waits, &shares, &num_devices,
                          &gate_code, &weight_code, &upload_code))
        return NULL;
    Buf b[6];
    memset(b, 0, sizeof b);
    if (get_buf(o_run_start, &b[0], 8, "run_start") || get_buf(o_unmet, &b[1], 8, "unmet") ||
        get_buf(o_woff, &b[2], 8, "weight wait offsets") || get_buf(o_widx, &b[3], 8, "weight waits") ||
        get_buf(o_soff, &b[4], 8, "sharer offsets") || get_buf(o_sidx, &b[5], 8, "sharers")) {
        release(b, 6);
        return NULL;
    }
    const i64 *run_start = I64(b[0]), *woff = I64(b[2]), *widx = I64(b[3]), *soff = I64(b[4]);
    const i64 *sidx = I64(b[5]);
    Py_ssize_t runs = LEN(b[0]) - 1, count = LEN(b[1]), per = s_count * nrounds;
    int bad = runs < 0 || s_count < 1 || nrounds < 1 || (waits && LEN(b[2]) != s_count + 1) ||
              (shares && LEN(b[4]) != s_count + 1) || (gate >= s_count) || gate_lag < 0;
    for (Py_ssize_t i = 0; !bad && waits && i < LEN(b[3]); i++) bad = widx[i] < 0 || widx[i] >= s_count;
    for (Py_ssize_t i = 0; !bad && shares && i < LEN(b[5]); i++) bad = sidx[i] < 0 || sidx[i] >= s_count;
    if (bad) {
        release(b, 6);
        PyErr_SetString(PyExc_ValueError, "stream_extras: arrays that do not fit the stream");
        return NULL;
    }
    void *unmet_data;
    PyObject *a_unmet = new_array("q", count, &unmet_data);
    i64 *unmet = unmet_data;
    Vec sources = {0}, codes = {0};
    int failed = a_unmet == NULL;
    if (!failed) {
        memcpy(unmet, I64(b[1]), sizeof(i64) * count);
        if (gate >= 0) /* iteration t's runs after iteration t - 1 - gate_lag's fused runs (its losses) */
            for (Py_ssize_t t = 1 + gate_lag; t < runs / per; t++)
                for (Py_ssize_t run = t * per; run < (t + 1) * per; run++) {
                    i64 first = run_start[run];
                    for (Py_ssize_t r = 0; r < nrounds; r++) {
                        failed |= vpush(&sources, run_start[(t - 1 - gate_lag) * per + r * s_count + gate + 1] - 1);
                        failed |= vpush(&codes, gate_code + first);
                        unmet[first] += 1;
                    }
                }
        if (waits) /* iteration t reads the weights of step t - 2 */
            for (Py_ssize_t run = 2 * per; run < runs; run++) {
                i64 first = run_start[run], earlier = (run / per - 2) * per;
                i64 i = run % s_count;
                for (i64 j = woff[i]; j < woff[i + 1]; j++)
                    for (Py_ssize_t r = 0; r < nrounds; r++) {
                        failed |= vpush(&sources, run_start[earlier + r * s_count + widx[j] + 1] - 1);
                        failed |= vpush(&codes, weight_code + first);
                        unmet[first] += 1;
                    }
            }
        if (waits && shares) /* the uploads of the weights before, each after its device's run 2N back */
            for (Py_ssize_t run = 2 * per; run < runs; run++) {
                i64 t = run / per, first = run_start[run], i = run % s_count;
                for (i64 at = t == 2 ? 0 : (t - 1) * per; at < t * per; at += per)
                    for (i64 j = soff[i]; j < soff[i + 1]; j++)
                        for (Py_ssize_t r = 0; r < nrounds; r++) {
                            i64 q = at + r * s_count + sidx[j] - 2 * num_devices;
                            if (q >= 0) {
                                failed |= vpush(&sources, run_start[q + 1] - 1);
                                failed |= vpush(&codes, upload_code + first);
                                unmet[first] += 1;
                            }
                        }
            }
    }
    PyObject *out = NULL;
    if (failed) {
        Py_XDECREF(a_unmet);
        if (!PyErr_Occurred()) PyErr_NoMemory();
    } else {
        PyObject *a_sources = vec_array("q", sources.items, sources.len);
        PyObject *a_codes = a_sources ? vec_array("q", codes.items, codes.len) : NULL;
        if (a_codes)
            out = Py_BuildValue("(NNN)", a_unmet, a_sources, a_codes);
        else {
            Py_DECREF(a_unmet);
            Py_XDECREF(a_sources);
        }
    }
    free(sources.items);
    free(codes.items);
    release(b, 6);
    return out;
}

/* ---- split_layout: `_split_stream.SplitGraph.layout` ------------------------------------ */

static PyObject *split_layout(PyObject *self, PyObject *args) {
    PyObject *o_sizes;
    Py_ssize_t s_count, n, first_backward, bound;
    long long hops;
    if (!PyArg_ParseTuple(args, "OnnnnL", &o_sizes, &s_count, &n, &first_backward, &bound, &hops))
        return NULL;
    Buf b[1];
    memset(b, 0, sizeof b);
    if (get_buf(o_sizes, &b[0], 8, "sizes")) {
        release(b, 1);
        return NULL;
    }
    const i64 *sizes = I64(b[0]);
    Py_ssize_t runs = LEN(b[0]), count = 0;
    int bad = s_count < 1 || n < 1 || bound < 1;
    for (Py_ssize_t r = 0; !bad && r < runs; r++) {
        bad = sizes[r] < 1 || sizes[r] > bound;
        count += 2 * sizes[r];
    }
    if (bad) {
        release(b, 1);
        PyErr_SetString(PyExc_ValueError, "split_layout: run sizes that do not fit");
        return NULL;
    }
    i64 *off_data, *unmet, *saving;
    void *data;
    PyObject *a_off = new_array("q", count + 1, &data);
    off_data = data;
    PyObject *a_unmet = a_off ? new_array("q", count, &data) : NULL;
    unmet = data;
    PyObject *a_saving = a_unmet ? new_array("q", count, &data) : NULL;
    saving = data;
    Vec idx = {0}, ready = {0};
    int failed = a_saving == NULL;
    i64 first = 0; /* 2 * pos[run] */
    for (Py_ssize_t run = 0; run < runs && !failed; run++) {
        i64 size = sizes[run], i = run % s_count, stop = first + 2 * size;
        int backward = i >= first_backward;
        int before_backward = n == 1 && first_backward <= i + 1 && i + 1 < s_count;
        i64 uploads = run >= 2 * n, to = hops + stop + 1;
        for (i64 j = 0; j < size; j++) {
            i64 even = first + 2 * j, odd = even + 1;
            /* task 2p: a backward run's recompute (to its own rest); elsewhere nothing */
            if (backward) failed |= vpush(&idx, odd);
            off_data[even + 1] = idx.len;
            /* task 2p + 1: the microbatch's last: the next slot's, the run's next microbatch */
            if (i < s_count - 1) failed |= vpush(&idx, to + 2 * j);
            if (j < size - 1) failed |= vpush(&idx, first + 2 * j + 2 + !backward);
            if (j == size - 1 && before_backward) failed |= vpush(&idx, stop);
            off_data[odd + 1] = idx.len;
            if (backward) {
                i64 saved = i < s_count - 1;
                unmet[even] = j == 0 ? uploads + saved + (n == 1 && run > 0) : 1 + saved;
                unmet[odd] = 2;
            } else {
                unmet[even] = 1;
                unmet[odd] = j == 0 ? (i > 0) + uploads : 1 + (i > 0);
            }
            saving[even] = saving[odd] = -1;
        }
        if (!backward && i < first_backward - 1) /* a forward run: recomputes read its saves */
            for (i64 j = 0; j < size; j++) saving[first + 2 * j + 1] = run * bound + j;
        i64 head = backward ? first : first + 1;
        if (!unmet[head]) failed |= vpush(&ready, head);
        first = stop;
    }
    PyObject *out = NULL;
    if (failed) {
        Py_XDECREF(a_off);
        Py_XDECREF(a_unmet);
        Py_XDECREF(a_saving);
        if (!PyErr_Occurred()) PyErr_NoMemory();
    } else {
        PyObject *a_idx = vec_array("q", idx.items, idx.len);
        PyObject *a_ready = a_idx ? vec_array("q", ready.items, ready.len) : NULL;
        if (a_ready)
            out = Py_BuildValue("(NNNNN)", a_off, a_idx, a_unmet, a_ready, a_saving);
        else {
            Py_DECREF(a_off);
            Py_DECREF(a_unmet);
            Py_DECREF(a_saving);
            Py_XDECREF(a_idx);
        }
    }
    free(idx.items);
    free(ready.items);
    release(b, 1);
    return out;
}

/* ---- stream_base: `_stream_graph._runs_structure` ---------------------------------------------- */

static PyObject *stream_base(PyObject *self, PyObject *args) {
    PyObject *o_rounds;
    Py_ssize_t s_count, n, iterations;
    long long activation_hops, param_hops;
    if (!PyArg_ParseTuple(args, "nnOnLL", &s_count, &n, &o_rounds, &iterations, &activation_hops,
                          &param_hops))
        return NULL;
    Buf b[1];
    memset(b, 0, sizeof b);
    if (get_buf(o_rounds, &b[0], 8, "rounds")) {
        release(b, 1);
        return NULL;
    }
    const i64 *rounds = I64(b[0]);
    Py_ssize_t nrounds = LEN(b[0]), per_iteration = 0;
    int bad = s_count < 1 || n < 1 || iterations < 0 || nrounds < 1;
    for (Py_ssize_t r = 0; !bad && r < nrounds; r++) {
        bad = rounds[r] < 1;
        per_iteration += rounds[r];
    }
    if (bad) {
        release(b, 1);
        PyErr_SetString(PyExc_ValueError, "stream_base: a stream that cannot be built");
        return NULL;
    }
    Py_ssize_t runs = iterations * nrounds * s_count, count = iterations * per_iteration * s_count;
    void *data;
    PyObject *a_slot = new_array("q", count, &data);
    i64 *slot = data;
    PyObject *a_device = a_slot ? new_array("q", count, &data) : NULL;
    i64 *device = data;
    PyObject *a_unmet = a_device ? new_array("q", count, &data) : NULL;
    i64 *unmet = data;
    PyObject *a_off = a_unmet ? new_array("q", count + 1, &data) : NULL;
    i64 *off = data;
    PyObject *a_run_start = a_off ? new_array("q", runs + 1, &data) : NULL;
    i64 *run_start = data;
    i64 *sizes = malloc(sizeof(i64) * (runs ? runs : 1));
    Vec idx = {0};
    int failed = a_run_start == NULL || sizes == NULL;
    if (!failed) {
        Py_ssize_t k = 0, t = 0;
        for (Py_ssize_t it = 0; it < iterations; it++)
            for (Py_ssize_t r = 0; r < nrounds; r++)
                for (Py_ssize_t i = 0; i < s_count; i++, k++) {
                    run_start[k] = t;
                    sizes[k] = rounds[r];
                    for (i64 j = 0; j < rounds[r]; j++, t++) {
                        slot[t] = i;
                        device[t] = k % n;
                    }
                }
        run_start[runs] = count;
        i64 activation = activation_hops * count, param = param_hops * count;
        for (Py_ssize_t run = 0; run < runs && !failed; run++) {
            i64 first = run_start[run], size = sizes[run], stop = first + size, i = run % s_count;
            for (i64 task = first; task < stop - 1; task++) { /* the run's next; the next slot's */
                failed |= vpush(&idx, task + 1);
                if (i < s_count - 1) failed |= vpush(&idx, activation + task + size);
                off[task + 1] = idx.len;
            }
            if (i < s_count - 1) failed |= vpush(&idx, activation + stop - 1 + size);
            if (run + 2 * n < runs) failed |= vpush(&idx, param + run_start[run + 2 * n]);
            off[stop] = idx.len;
            unmet[first] = (i > 0) + (run >= 2 * n);
            for (i64 task = first + 1; task < stop; task++) unmet[task] = 1 + (i > 0);
        }
    }
    PyObject *out = NULL;
    PyObject *a_idx = failed ? NULL : vec_array("q", idx.items, idx.len);
    if (a_idx) {
        out = Py_BuildValue("(NNNNNN)", a_slot, a_device, a_unmet, a_off, a_idx, a_run_start);
    } else {
        Py_XDECREF(a_slot);
        Py_XDECREF(a_device);
        Py_XDECREF(a_unmet);
        Py_XDECREF(a_off);
        Py_XDECREF(a_run_start);
        if (!PyErr_Occurred()) PyErr_NoMemory();
    }
    free(sizes);
    free(idx.items);
    release(b, 1);
    return out;
}

/* ---- span: `max(s + d) - min(s)` of a sync replay (`planning.replay.replay_iteration_ms`) ---- */

static PyObject *span(PyObject *self, PyObject *args) {
    PyObject *o_start, *o_dur;
    if (!PyArg_ParseTuple(args, "OO", &o_start, &o_dur)) return NULL;
    Buf b[2];
    memset(b, 0, sizeof b);
    if (get_buf(o_start, &b[0], 8, "starts") || get_buf(o_dur, &b[1], 8, "durations")) {
        release(b, 2);
        return NULL;
    }
    const double *start = F64(b[0]), *dur = F64(b[1]);
    Py_ssize_t count = LEN(b[0]);
    if (LEN(b[1]) != count || count == 0) {
        release(b, 2);
        PyErr_SetString(PyExc_ValueError, "span: no tasks, or starts and durations of unequal lengths");
        return NULL;
    }
    double last = start[0] + dur[0], first = start[0];
    for (Py_ssize_t t = 1; t < count; t++) {
        double end = start[t] + dur[t];
        if (end > last) last = end;
        if (start[t] < first) first = start[t];
    }
    release(b, 2);
    return PyFloat_FromDouble(last - first);
}

/* ---- first_starts: each iteration's first compute (`planning.replay._first_computes`) ----- */

/* Per group g (``idx[off[g]..off[g+1]]``, task numbers): the least of their starts that is not
   negative (a task that never started has -1). */
static PyObject *first_starts(PyObject *self, PyObject *args) {
    PyObject *o_start, *o_off, *o_idx;
    Py_ssize_t groups;
    if (!PyArg_ParseTuple(args, "OOOn", &o_start, &o_off, &o_idx, &groups)) return NULL;
    Buf b[3];
    memset(b, 0, sizeof b);
    if (get_buf(o_start, &b[0], 8, "starts") || get_buf(o_off, &b[1], 8, "offsets") ||
        get_buf(o_idx, &b[2], 8, "tasks")) {
        release(b, 3);
        return NULL;
    }
    const double *start = F64(b[0]);
    const i64 *off = I64(b[1]), *idx = I64(b[2]);
    Py_ssize_t count = LEN(b[0]), bad = groups < 0 || groups >= LEN(b[1]);
    for (Py_ssize_t g = 0; !bad && g < groups; g++)
        bad = off[g] < 0 || off[g] > off[g + 1] || off[g + 1] > LEN(b[2]);
    for (Py_ssize_t j = 0; !bad && groups && j < off[groups]; j++) bad = idx[j] < 0 || idx[j] >= count;
    PyObject *out = bad ? NULL : PyList_New(groups);
    for (Py_ssize_t g = 0; out && g < groups; g++) {
        double first = -1.0;
        for (i64 j = off[g]; j < off[g + 1]; j++) {
            double at = start[idx[j]];
            if (at >= 0.0 && (first < 0.0 || at < first)) first = at;
        }
        PyObject *f = first < 0.0 ? NULL : PyFloat_FromDouble(first);
        if (f == NULL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "first_starts: group %zd never started", g);
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, g, f);
    }
    if (bad) PyErr_SetString(PyExc_ValueError, "first_starts: groups out of range");
    release(b, 3);
    return out;
}

/* ---- policy_iterate: `_steady.steady_period`'s policy iteration ------------------------ */

/* `_value_policy` and `_improve_policy` on in-arcs in CSR form (per node its arcs: source,
   weight, transit), from ``policy`` (changed in place). 0 and *top = max(eta) once no node
   improves; 1 if it did not settle in ``rounds_max`` rounds; -1 out of memory. */
static int policy_iterate(const i64 *off, const i64 *src, const double *wt, const i64 *tr, i64 *policy,
                          Py_ssize_t count, double tol, Py_ssize_t rounds_max, double *top) {
    i64 *path = malloc(sizeof(i64) * count);
    unsigned char *state = malloc(count);
    double *x = calloc(count, sizeof(double)), *eta = calloc(count, sizeof(double));
    int result = 1;
    if (!path || !state || !x || !eta) {
        result = -1;
        goto done;
    }
#define ARC(c) (off[c] + policy[c])
    for (Py_ssize_t round = 0; round < rounds_max; round++) {
        /* `_value_policy` */
        memset(state, 0, count);
        for (Py_ssize_t first = 0; first < count; first++) {
            if (state[first]) continue;
            Py_ssize_t len = 0, stop, k = 0;
            i64 v = first;
            while (!state[v]) {
                state[v] = 1;
                path[len++] = v;
                v = src[ARC(v)];
            }
            stop = len;
            if (state[v] == 1) { /* a new cycle: path[k:] */
                while (path[k] != v) k++;
                double weight = 0.0;
                i64 transit = 0;
                for (Py_ssize_t j = k; j < len; j++) weight += wt[ARC(path[j])];
                for (Py_ssize_t j = k; j < len; j++) transit += tr[ARC(path[j])];
                double ratio = weight / (double)transit;
                for (Py_ssize_t j = len - 1; j > k; j--) {
                    i64 c = path[j], a = ARC(c);
                    x[c] = x[src[a]] + wt[a] - ratio * (double)tr[a];
                    eta[c] = ratio;
                }
                eta[v] = ratio;
                stop = k;
            }
            for (Py_ssize_t j = stop - 1; j >= 0; j--) {
                i64 c = path[j], a = ARC(c), u = src[a];
                eta[c] = eta[u];
                x[c] = x[u] + wt[a] - eta[u] * (double)tr[a];
            }
            for (Py_ssize_t j = 0; j < len; j++) state[path[j]] = 2;
        }
        /* `_improve_policy` */
        int changed = 0;
        for (Py_ssize_t v = 0; v < count; v++) {
            double best = eta[src[ARC(v)]];
            for (i64 a = off[v]; a < off[v + 1]; a++)
                if (eta[src[a]] > best + tol) {
                    best = eta[src[a]];
                    policy[v] = a - off[v];
                    changed = 1;
                }
        }
        if (!changed)
            for (Py_ssize_t v = 0; v < count; v++) {
                i64 a0 = ARC(v), u0 = src[a0];
                double best = x[u0] + wt[a0] - eta[u0] * (double)tr[a0];
                for (i64 a = off[v]; a < off[v + 1]; a++) {
                    i64 u = src[a];
                    double value = x[u] + wt[a] - eta[u] * (double)tr[a];
                    if (fabs(eta[u] - eta[v]) <= tol && value > best + tol * 1e3) {
                        best = value;
                        policy[v] = a - off[v];
                        changed = 1;
                    }
                }
            }
        if (!changed) {
            *top = eta[0];
            for (Py_ssize_t v = 1; v < count; v++)
                if (eta[v] > *top) *top = eta[v];
            result = 0;
            goto done;
        }
    }
#undef ARC
done:
    free(path);
    free(state);
    free(x);
    free(eta);
    return result;
}

/* ---- steady_period_of: `_steady.steady_period`, its graph built here too ---------------- */

/* `_steady._steady_graph`'s in-arcs, node by node in its order, each node's first policy (its
   heaviest arc crossing the most iterations, the first such), then the policy iteration above.
   ``slot_ms`` and ``lead_ms`` (empty: none) as floats, ``rounds`` as ints, ``tol`` as the caller
   works it out (it multiplies the caller's own numbers). Floor division as Python's divmod. */
static PyObject *steady_period_of(PyObject *self, PyObject *args) {
    PyObject *o_ms, *o_rounds, *o_lead;
    Py_ssize_t n;
    double tol;
    if (!PyArg_ParseTuple(args, "OnOOd", &o_ms, &n, &o_rounds, &o_lead, &tol)) return NULL;
    Buf b[3];
    if (get_bufs(b, 3, (PyObject *[]){o_ms, o_rounds, o_lead}, (const char *[]){"slot_ms", "rounds", "lead_ms"}))
        return NULL;
    const double *ms = F64(b[0]), *lead = LEN(b[2]) ? F64(b[2]) : NULL;
    const i64 *rounds = I64(b[1]);
    Py_ssize_t s_count = LEN(b[0]), r_count = LEN(b[1]);
    if (s_count < 1 || r_count < 1 || n < 1 || (lead && LEN(b[2]) != s_count)) {
        release(b, 3);
        PyErr_SetString(PyExc_ValueError, "steady_period_of: no slots, no rounds, no devices, or a lead per slot missing");
        return NULL;
    }
    Py_ssize_t period = s_count * r_count, count = 2 * period, most = 5 * period;
    i64 *off = malloc(sizeof(i64) * (count + 1)), *src = malloc(sizeof(i64) * most);
    i64 *tr = malloc(sizeof(i64) * most), *policy = malloc(sizeof(i64) * count);
    double *wt = malloc(sizeof(double) * most);
    PyObject *out = NULL;
    if (!off || !src || !tr || !policy || !wt) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t arcs = 0;
#define ARC_ADD(u, w, t) (src[arcs] = (u), wt[arcs] = (w), tr[arcs] = (t), arcs++)
    for (Py_ssize_t k = 0; k < period; k++) {
        Py_ssize_t rnd = k / s_count, i = k % s_count;
        double lead_i = lead ? lead[i] : 0.0;
        /* node 2k (the run starts) */
        off[2 * k] = arcs;
        if (i) ARC_ADD(2 * (k - 1), ms[i - 1] - lead_i, 0);
        for (int back_twice = 0; back_twice < 2; back_twice++) {
            Py_ssize_t back = (back_twice + 1) * n, diff = k - back;
            Py_ssize_t q = diff >= 0 ? diff / period : -((-diff + period - 1) / period);
            Py_ssize_t m = diff - q * period; /* divmod(k - back, period): m in [0, period) */
            if (!back_twice)
                ARC_ADD(2 * m, (double)rounds[m / s_count] * ms[m % s_count], -q);
            else
                ARC_ADD(2 * m + 1, 0.0, -q);
        }
        /* node 2k + 1 (its last microbatch ends) */
        off[2 * k + 1] = arcs;
        ARC_ADD(2 * k, (double)rounds[rnd] * ms[i], 0);
        if (i) ARC_ADD(2 * (k - 1) + 1, ms[i] - lead_i, 0);
    }
    off[count] = arcs;
#undef ARC_ADD
    for (Py_ssize_t v = 0; v < count; v++) { /* max by (transit, weight), the first of the best */
        i64 best = off[v];
        for (i64 a = off[v] + 1; a < off[v + 1]; a++)
            if (tr[a] > tr[best] || (tr[a] == tr[best] && wt[a] > wt[best])) best = a;
        policy[v] = best - off[v];
    }
    double top = 0.0;
    int result = policy_iterate(off, src, wt, tr, policy, count, tol, 4 * count + 16, &top);
    if (result < 0)
        PyErr_NoMemory();
    else if (result > 0)
        PyErr_SetString(PyExc_AssertionError, "policy iteration did not converge");
    else
        out = PyFloat_FromDouble(top);
done:
    free(off);
    free(src);
    free(tr);
    free(policy);
    free(wt);
    release(b, 3);
    return out;
}

/* ---- steady_bound_ticks: `_steady.steady_bound` on integer slot times ------------------- */

/* The same bound, its sums exact in 64-bit integers (the ticks of `steady_search` stay far
   under 2**53, where Python's fsum of them is the exact sum), each float operation the one
   Python makes: an int times a float, a float over an int, a float plus an int. */
static PyObject *steady_bound_ticks(PyObject *self, PyObject *args) {
    PyObject *o_slots, *o_rounds;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO", &o_slots, &n, &o_rounds)) return NULL;
    Buf b[2];
    if (get_bufs(b, 2, (PyObject *[]){o_slots, o_rounds}, (const char *[]){"slots", "rounds"})) return NULL;
    const i64 *slots = I64(b[0]), *rounds = I64(b[1]);
    Py_ssize_t s_count = LEN(b[0]), r_count = LEN(b[1]);
    if (n < 1 || r_count < 1) {
        release(b, 2);
        PyErr_SetString(PyExc_ValueError, "steady_bound_ticks: no devices or no rounds");
        return NULL;
    }
    i64 total = 0, r_sum = 0;
    int one_size = 1;
    for (Py_ssize_t i = 0; i < s_count; i++) total += slots[i];
    for (Py_ssize_t r = 0; r < r_count; r++) {
        r_sum += rounds[r];
        one_size = one_size && rounds[r] == rounds[0];
    }
    double bound = (double)r_sum * (double)total / (double)n;
    Py_ssize_t g = s_count, h = n; /* gcd(S, N) */
    while (h) {
        Py_ssize_t t = g % h;
        g = h;
        h = t;
    }
    if (g > 1 && one_size) {
        i64 most = 0;
        for (Py_ssize_t i = 0; i < g; i++) {
            i64 part = 0;
            for (Py_ssize_t j = i; j < s_count; j += g) part += slots[j];
            if (i == 0 || part > most) most = part;
        }
        double device = (double)(r_sum * g) * (double)most / (double)n;
        if (device > bound) bound = device;
    }
    Py_ssize_t d = s_count - n;
    if (d >= 0) {
        i64 window = 0; /* slots[h - d .. h) */
        for (Py_ssize_t j = 0; j < d; j++) window += slots[j];
        for (Py_ssize_t at = d; at < s_count; at++) {
            if (at > d) window += slots[at - 1] - slots[at - 1 - d];
            double wave = (double)r_count * (double)window + (double)(r_sum * slots[at]);
            if (wave > bound) bound = wave;
        }
    }
    release(b, 2);
    return PyFloat_FromDouble(bound);
}

/* ---- balanced_split: `_candidates.balanced_split` --------------------------------------- */

/* Python's bisect on ascending integer prefix sums, against an integer or a float value (the
   ints are below 2**53, so each compares exactly as a double). */
static Py_ssize_t bisect_right_i(const i64 *a, i64 x, Py_ssize_t lo, Py_ssize_t hi) {
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (x < a[mid]) hi = mid; else lo = mid + 1;
    }
    return lo;
}

static Py_ssize_t bisect_left_i(const i64 *a, i64 x, Py_ssize_t lo, Py_ssize_t hi) {
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (a[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static Py_ssize_t bisect_left_f(const i64 *a, double x, Py_ssize_t lo, Py_ssize_t hi) {
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if ((double)a[mid] < x) lo = mid + 1; else hi = mid;
    }
    return lo;
}

typedef struct {
    const i64 *pre, *reach;
    Py_ssize_t stop, parts;
} Chain;

static Py_ssize_t chain_next(const Chain *c, Py_ssize_t i, i64 t) { /* `nxt` */
    Py_ssize_t j = bisect_right_i(c->pre, c->pre[i] + t, i + 1, c->stop + 1) - 1;
    return j < c->reach[i] ? j : (Py_ssize_t)c->reach[i];
}

static Py_ssize_t chain_count(const Chain *c, i64 t) { /* `count` */
    Py_ssize_t i = 0, used = 0;
    while (i < c->stop) {
        i = chain_next(c, i, t);
        used++;
    }
    return used;
}

/* `_least_largest_part`: the least t at which greedy packing needs at most ``parts`` parts. */
static i64 least_largest_part(const Chain *c, int *fits) {
    const i64 *pre = c->pre, *reach = c->reach;
    Py_ssize_t stop = c->stop, parts = c->parts;
    i64 largest = pre[1] - pre[0];
    for (Py_ssize_t k = 1; k < stop; k++)
        if (pre[k + 1] - pre[k] > largest) largest = pre[k + 1] - pre[k];
    i64 total = pre[stop] - pre[0], share = (total + parts - 1) / parts; /* ceil: ticks are >= 0 */
    i64 lo = largest > share ? largest : share, hi = total;
    for (int jump = 0; jump < 8; jump++) { /* `_JUMPS` */
        Py_ssize_t i = 0, used = 0;
        i64 step = hi;
        while (i < stop) {
            i64 base = pre[i];
            Py_ssize_t j = bisect_right_i(pre, base + lo, i + 1, stop + 1) - 1, r = reach[i];
            if (j >= r) j = r;
            else if (j < stop && pre[j + 1] - base < step) step = pre[j + 1] - base;
            i = j;
            used++;
        }
        if (used <= parts) {
            *fits = 1;
            return lo;
        }
        if (step <= lo) break;
        lo = step;
    }
    while (lo < hi) {
        i64 mid = lo + (hi - lo) / 2; /* (lo + hi) // 2 for lo, hi >= 0 */
        if (chain_count(c, mid) <= parts) hi = mid; else lo = mid + 1;
    }
    *fits = chain_count(c, lo) <= parts;
    return lo;
}

/* `_nearest`: the end k in [j_min, j_max] whose part [i, k) is nearest ``goal``. */
static Py_ssize_t nearest_end(const i64 *pre, Py_ssize_t i, double goal, Py_ssize_t j_min, Py_ssize_t j_max) {
    Py_ssize_t at = bisect_left_f(pre, (double)pre[i] + goal, j_min, j_max + 1);
    if (j_min < at && at <= j_max) {
        double below = (double)(pre[at - 1] - pre[i]) - goal, above = (double)(pre[at] - pre[i]) - goal;
        if (below < 0.0 && 0.0 <= above) {
            if (above > -below) return at - 1;
            while (at < j_max && pre[at + 1] == pre[at]) at++;
            return at;
        }
    }
    Py_ssize_t best = j_max, first = at + 1 < j_max ? at + 1 : j_max, last = at - 2 > j_min ? at - 2 : j_min;
    double best_gap = INFINITY;
    for (Py_ssize_t k0 = first; k0 >= last; k0--) {
        Py_ssize_t k = k0;
        while (k < j_max && pre[k + 1] == pre[k]) k++;
        double gap = fabs((double)(pre[k] - pre[i]) - goal);
        if (gap < best_gap || (gap == best_gap && k > best)) {
            best = k;
            best_gap = gap;
        }
    }
    return best;
}

/* `_nearest_target`: where in ``targets`` (sorted; descending or not) the value nearest ``got``
   is, the first in list order on ties. */
static Py_ssize_t nearest_target(const i64 *targets, Py_ssize_t len, i64 got, int descending) {
    Py_ssize_t lo = 0, hi = len;
    while (lo < hi) { /* the first value <= got (descending) or >= got */
        Py_ssize_t mid = (lo + hi) / 2;
        if (descending ? targets[mid] > got : targets[mid] < got) lo = mid + 1; else hi = mid;
    }
    Py_ssize_t at = lo, best = at < len ? at : at - 1;
    if (at > 0) {
        Py_ssize_t before = at - 1;
        while (before > 0 && targets[before - 1] == targets[before]) before--;
        i64 gb = targets[before] - got, gs = targets[best] - got;
        if ((gb < 0 ? -gb : gb) <= (gs < 0 ? -gs : gs)) best = before;
    }
    return best;
}

/* `cut`: left to right, each part nearest its target (NULL: an equal share of what is left). */
static void chain_cut(const Chain *c, i64 t, const i64 *fits, i64 *targets, Py_ssize_t ntargets,
                      int descending, i64 *ends) {
    const i64 *pre = c->pre;
    Py_ssize_t i = 0, parts = c->parts, stop = c->stop;
    for (Py_ssize_t left = parts; left > 1; left--) {
        Py_ssize_t j_max = bisect_right_i(pre, pre[i] + t, i + 1, stop + 1) - 1;
        if (c->reach[i] < j_max) j_max = c->reach[i];
        if (stop - left + 1 < j_max) j_max = stop - left + 1;
        Py_ssize_t j_min = i + 1 > fits[left - 1] ? i + 1 : fits[left - 1];
        double goal = ntargets ? (double)targets[0] : (double)(pre[stop] - pre[i]) / (double)left;
        Py_ssize_t j = nearest_end(pre, i, goal, j_min, j_max);
        if (ntargets) { /* this part used up the target nearest to what it got */
            Py_ssize_t used = nearest_target(targets, ntargets, pre[j] - pre[i], descending);
            memmove(targets + used, targets + used + 1, sizeof(i64) * (ntargets - used - 1));
            ntargets--;
        }
        ends[parts - left] = j;
        i = j;
    }
    ends[parts - 1] = stop;
}

static int compare_i64(const void *a, const void *b) {
    i64 x = *(const i64 *)a, y = *(const i64 *)b;
    return (x > y) - (x < y);
}

static PyObject *balanced_split(PyObject *self, PyObject *args) {
    PyObject *o_pre, *o_reach;
    Py_ssize_t stop, parts;
    int larger_last;
    if (!PyArg_ParseTuple(args, "OnnOp", &o_pre, &stop, &parts, &o_reach, &larger_last)) return NULL;
    Buf b[2];
    memset(b, 0, sizeof b);
    if (get_buf(o_pre, &b[0], 8, "prefix sums") || get_buf(o_reach, &b[1], 8, "reach")) {
        release(b, 2);
        return NULL;
    }
    Chain c = {I64(b[0]), I64(b[1]), stop, parts};
    if (stop >= LEN(b[0]) || stop >= LEN(b[1]) || stop < 0) {
        release(b, 2);
        PyErr_SetString(PyExc_ValueError, "balanced_split: stop past the prefix sums");
        return NULL;
    }
    if (!(1 <= parts && parts <= stop)) {
        release(b, 2);
        Py_RETURN_NONE;
    }
    int fits_parts = 0;
    i64 t = least_largest_part(&c, &fits_parts);
    if (!fits_parts) {
        release(b, 2);
        Py_RETURN_NONE; /* memory cuts the chain into more parts than asked for */
    }
    const i64 *pre = c.pre, *reach = c.reach;
    i64 *fits = malloc(sizeof(i64) * parts), *even = malloc(sizeof(i64) * parts);
    i64 *sizes = malloc(sizeof(i64) * parts), *again = malloc(sizeof(i64) * parts);
    PyObject *out = NULL;
    if (!fits || !even || !sizes || !again) {
        PyErr_NoMemory();
        goto done;
    }
    fits[0] = stop; /* fits[k]: the least start from which the rest fits in k parts at t */
    for (Py_ssize_t k = 1; k < parts; k++) {
        i64 end = fits[k - 1];
        Py_ssize_t a = bisect_left_i(pre, pre[end] - t, 0, end), r = bisect_left_i(reach, end, 0, end);
        fits[k] = a > r ? a : r;
    }
    int descending = !larger_last;
    chain_cut(&c, t, fits, NULL, 0, descending, even);
    int ordered = 1;
    for (Py_ssize_t k = 0; k < parts; k++) sizes[k] = pre[even[k]] - pre[k ? even[k - 1] : 0];
    for (Py_ssize_t k = 1; k < parts; k++)
        if (descending ? sizes[k] > sizes[k - 1] : sizes[k] < sizes[k - 1]) ordered = 0;
    const i64 *ends = even;
    if (!ordered) { /* the same sizes again, in order: largest first (or last) */
        qsort(sizes, parts, sizeof(i64), compare_i64);
        if (descending)
            for (Py_ssize_t k = 0; k < parts / 2; k++) {
                i64 x = sizes[k];
                sizes[k] = sizes[parts - 1 - k];
                sizes[parts - 1 - k] = x;
            }
        chain_cut(&c, t, fits, sizes, parts, descending, again);
        ends = again;
    }
    out = PyList_New(parts);
    for (Py_ssize_t k = 0; out && k < parts; k++) {
        PyObject *end = PyLong_FromLongLong(ends[k]);
        if (!end) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, k, end);
    }
done:
    free(fits);
    free(even);
    free(sizes);
    free(again);
    release(b, 2);
    return out;
}

/* ---- busiest_share: `dispatch.busiest_device_share` ------------------------------------- */

/* Slot times (a sequence of floats), the device count and the round sizes (ints): the busiest
   device's compute per iteration over the iterations after which dispatch is back at device 0,
   the loads added up in the Python loop's order. */
static PyObject *busiest_share(PyObject *self, PyObject *args) {
    PyObject *o_ms, *o_rounds;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "OnO", &o_ms, &n, &o_rounds)) return NULL;
    if (n < 1) {
        PyErr_SetString(PyExc_ValueError, "busiest_share: at least one device");
        return NULL;
    }
    PyObject *ms = PySequence_Fast(o_ms, "busiest_share: slot times must be a sequence");
    if (ms == NULL) return NULL;
    PyObject *rounds = PySequence_Fast(o_rounds, "busiest_share: round sizes must be a sequence");
    if (rounds == NULL) {
        Py_DECREF(ms);
        return NULL;
    }
    Py_ssize_t s_count = PySequence_Fast_GET_SIZE(ms), r_count = PySequence_Fast_GET_SIZE(rounds);
    double *by_offset = calloc((size_t)n, sizeof(double)), *load = calloc((size_t)n, sizeof(double));
    double *sizes = malloc(sizeof(double) * (size_t)(r_count ? r_count : 1));
    PyObject *out = NULL;
    if (!by_offset || !load || !sizes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < s_count; i++) {
        double x = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(ms, i));
        if (x == -1.0 && PyErr_Occurred()) goto done;
        by_offset[i % n] += x;
    }
    for (Py_ssize_t r = 0; r < r_count; r++) {
        long long size = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(rounds, r));
        if (size == -1 && PyErr_Occurred()) goto done;
        sizes[r] = (double)size; /* int * float in Python: the int as a double, exactly */
    }
    Py_ssize_t g0 = 0, iterations = 0;
    do {
        for (Py_ssize_t r = 0; r < r_count; r++) {
            for (Py_ssize_t offset = 0; offset < n; offset++) load[(g0 + offset) % n] += sizes[r] * by_offset[offset];
            g0 = (g0 + s_count) % n;
        }
        iterations++;
    } while (g0 != 0);
    double most = load[0];
    for (Py_ssize_t d = 1; d < n; d++)
        if (load[d] > most) most = load[d];
    out = PyFloat_FromDouble(most / (double)iterations);
done:
    free(by_offset);
    free(load);
    free(sizes);
    Py_DECREF(ms);
    Py_DECREF(rounds);
    return out;
}

/* ---- sharers: `_sharing.sharers` and `_sharing.weight_waits` ------------------------------ */

/* The stages in dispatch order (a sequence of ranges) and the forward stage count: per stage the
   stages that overlap it, itself included, ascending (`_sharing.sharers`: its chain walk finds the
   same pairs), and of those the ones from the fused stage on (`weight_waits`), as tuples. */
static int range_bounds(PyObject *r, i64 *start, i64 *stop) {
    PyObject *a = PyObject_GetAttrString(r, "start");
    PyObject *b = a ? PyObject_GetAttrString(r, "stop") : NULL;
    int bad = a == NULL || b == NULL;
    if (!bad) {
        *start = PyLong_AsLongLong(a);
        *stop = PyLong_AsLongLong(b);
        bad = PyErr_Occurred() != NULL;
    }
    Py_XDECREF(a);
    Py_XDECREF(b);
    return bad ? -1 : 0;
}

static PyObject *sharers(PyObject *self, PyObject *args) {
    PyObject *o_stages;
    Py_ssize_t f_count;
    if (!PyArg_ParseTuple(args, "On", &o_stages, &f_count)) return NULL;
    PyObject *stages = PySequence_Fast(o_stages, "sharers: stages must be a sequence of ranges");
    if (stages == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(stages);
    i64 *bounds = malloc(sizeof(i64) * 2 * (size_t)(count ? count : 1));
    Py_ssize_t *row = malloc(sizeof(Py_ssize_t) * (size_t)(count ? count : 1));
    PyObject *shares = NULL, *waits = NULL, *out = NULL;
    if (!bounds || !row) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++)
        if (range_bounds(PySequence_Fast_GET_ITEM(stages, i), &bounds[2 * i], &bounds[2 * i + 1])) goto done;
    shares = PyTuple_New(count);
    waits = shares ? PyTuple_New(count) : NULL;
    for (Py_ssize_t i = 0; waits && i < count; i++) {
        Py_ssize_t held = 0, from = 0;
        for (Py_ssize_t j = 0; j < count; j++)
            if (bounds[2 * j] < bounds[2 * i + 1] && bounds[2 * i] < bounds[2 * j + 1]) {
                if (j < f_count) from++;
                row[held++] = j;
            }
        PyObject *all = PyTuple_New(held), *late = all ? PyTuple_New(held - from) : NULL;
        if (late == NULL) {
            Py_XDECREF(all);
            goto done;
        }
        for (Py_ssize_t k = 0; k < held; k++) {
            PyObject *v = PyLong_FromSsize_t(row[k]);
            if (v == NULL) {
                Py_DECREF(all);
                Py_DECREF(late);
                goto done;
            }
            if (k >= from) {
                Py_INCREF(v);
                PyTuple_SET_ITEM(late, k - from, v);
            }
            PyTuple_SET_ITEM(all, k, v);
        }
        PyTuple_SET_ITEM(shares, i, all);
        PyTuple_SET_ITEM(waits, i, late);
    }
    if (waits) out = PyTuple_Pack(2, shares, waits);
done:
    Py_XDECREF(shares);
    Py_XDECREF(waits);
    free(bounds);
    free(row);
    Py_DECREF(stages);
    return out;
}

static PyMethodDef methods[] = {
    {"build", build, METH_VARARGS, "`GraphBuilder`'s graph for plan evaluation, packed."},
    {"stream_extras", stream_extras, METH_VARARGS, "`_stream_graph._structure`'s extra dependents."},
    {"split_layout", split_layout, METH_VARARGS, "`SplitGraph.layout`, packed."},
    {"stream_base", stream_base, METH_VARARGS, "`_stream_graph._runs_structure`, packed."},
    {"span", span, METH_VARARGS, "The makespan of a replay: max(start + dur) - min(start)."},
    {"balanced_split", balanced_split, METH_VARARGS, "`_candidates.balanced_split`: the part ends."},
    {"invert", invert, METH_VARARGS, "Dependencies (CSR) to dependents (CSR) and unmet counts."},
    {"list_schedule", list_schedule, METH_VARARGS, "`_stream._list_schedule` on packed arrays."},
    {"split_schedule", split_schedule, METH_VARARGS, "`_split_stream.split_ms`'s `event_loop` on packed arrays."},
    {"replay", replay, METH_VARARGS, "`planning.replay_rule.replay_starts` on packed arrays."},
    {"first_starts", first_starts, METH_VARARGS, "Per group of tasks, the least start not negative."},
    {"busiest_share", busiest_share, METH_VARARGS, "`dispatch.busiest_device_share`."},
    {"steady_period_of", steady_period_of, METH_VARARGS, "`_steady.steady_period`, graph and all."},
    {"steady_bound_ticks", steady_bound_ticks, METH_VARARGS, "`_steady.steady_bound` on integer slots."},
    {"sharers", sharers, METH_VARARGS, "`_sharing.sharers` and `_sharing.weight_waits`, as tuples."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kernels",
                                    "Compiled inner loops of plan evaluation (see the source).", -1,
                                    methods};

/* INTERFACE: `native.INTERFACE`, raised whenever a function's arguments change, so that an
   extension built from an older source is set aside rather than called with the wrong ones. */
PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "INTERFACE", 4) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
