/*
 * A stand-in for Rockchip's librknnrt, for machines without an RK NPU (this project's CI).
 * It implements the few runtime calls rknn-rs makes, with the structures of rknn_api.h, and
 * "runs" a deterministic toy vision encoder described by a small text file instead of a real
 * .rknn model:
 *
 *     RKNN-STANDIN width=64 height=64 rows=36 dim=576 seed=7
 *
 * input 0: uint8 NHWC [1, height, width, 3]; output 0: float [1, rows, dim], row r = the mean
 * colour of patch r (of a sqrt(rows) x sqrt(rows) grid) times a fixed random matrix, plus a
 * fixed random position vector. Only for testing gst-vlm's RKNN glue: NPU execution itself is
 * unverified on hardware.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RKNN_MAX_DIMS 16
#define RKNN_MAX_NAME_LEN 256

typedef uint64_t rknn_context;

typedef struct { uint32_t n_input, n_output; } rknn_input_output_num;

typedef struct {
    uint32_t index, n_dims, dims[RKNN_MAX_DIMS];
    char name[RKNN_MAX_NAME_LEN];
    uint32_t n_elems, size;
    int fmt, type, qnt_type;
    int8_t fl;
    int32_t zp;
    float scale;
    uint32_t w_stride, size_with_stride;
    uint8_t pass_through;
    uint32_t h_stride;
} rknn_tensor_attr;

typedef struct {
    uint32_t index;
    void *buf;
    uint32_t size;
    uint8_t pass_through;
    int type, fmt;
} rknn_input;

typedef struct {
    uint8_t want_float, is_prealloc;
    uint32_t index;
    void *buf;
    uint32_t size;
} rknn_output;

enum { QUERY_IN_OUT_NUM = 0, QUERY_INPUT_ATTR = 1, QUERY_OUTPUT_ATTR = 2 };
enum { FMT_NCHW = 0, FMT_NHWC = 1 };
enum { TYPE_FLOAT32 = 0, TYPE_UINT8 = 3 };
enum { SUCC = 0, ERR_FAIL = -1, ERR_MODEL_INVALID = -6, ERR_PARAM_INVALID = -5, ERR_CTX_INVALID = -7 };

typedef struct {
    uint32_t width, height, rows, dim;
    float *weights;   /* 3 x dim */
    float *positions; /* rows x dim */
    uint8_t *input;
    float *output;
} model;

static uint64_t next(uint64_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static float gaussian(uint64_t *s) {
    double u = (next(s) >> 11) * (1.0 / 9007199254740992.0) + 1e-12;
    double v = (next(s) >> 11) * (1.0 / 9007199254740992.0);
    return (float)(sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v));
}

int rknn_init(rknn_context *context, void *model_path, uint32_t size, uint32_t flag, void *extend) {
    (void)flag;
    (void)extend;
    if (!context || !model_path || size != 0) return ERR_PARAM_INVALID;
    FILE *f = fopen((const char *)model_path, "r");
    if (!f) return ERR_MODEL_INVALID;
    unsigned w, h, rows, dim;
    unsigned long long seed;
    int n = fscanf(f, "RKNN-STANDIN width=%u height=%u rows=%u dim=%u seed=%llu", &w, &h, &rows, &dim, &seed);
    fclose(f);
    unsigned grid = (unsigned)lround(sqrt((double)rows));
    if (n != 5 || !w || !h || !dim || grid * grid != rows || grid > w || grid > h) return ERR_MODEL_INVALID;
    model *m = calloc(1, sizeof *m);
    m->width = w, m->height = h, m->rows = rows, m->dim = dim;
    m->weights = malloc(sizeof(float) * 3 * dim);
    m->positions = malloc(sizeof(float) * rows * dim);
    m->input = calloc((size_t)w * h * 3, 1);
    m->output = malloc(sizeof(float) * rows * dim);
    uint64_t s = seed * 2654435761u + 1;
    for (unsigned i = 0; i < 3 * dim; i++) m->weights[i] = 0.02f * gaussian(&s);
    for (unsigned i = 0; i < rows * dim; i++) m->positions[i] = 0.02f * gaussian(&s);
    *context = (rknn_context)(uintptr_t)m;
    return SUCC;
}

int rknn_destroy(rknn_context context) {
    model *m = (model *)(uintptr_t)context;
    if (!m) return ERR_CTX_INVALID;
    free(m->weights), free(m->positions), free(m->input), free(m->output), free(m);
    return SUCC;
}

static void fill_attr(model *m, rknn_tensor_attr *a, int output) {
    uint32_t index = a->index;
    memset(a, 0, sizeof *a);
    a->index = index;
    a->n_dims = output ? 3 : 4;
    if (output) {
        a->dims[0] = 1, a->dims[1] = m->rows, a->dims[2] = m->dim;
        a->n_elems = m->rows * m->dim, a->size = a->n_elems * 4, a->type = TYPE_FLOAT32, a->fmt = FMT_NCHW;
        strcpy(a->name, "embeddings");
    } else {
        a->dims[0] = 1, a->dims[1] = m->height, a->dims[2] = m->width, a->dims[3] = 3;
        a->n_elems = m->width * m->height * 3, a->size = a->n_elems, a->type = TYPE_UINT8, a->fmt = FMT_NHWC;
        strcpy(a->name, "pixels");
    }
    a->size_with_stride = a->size;
    a->scale = 1.0f;
}

int rknn_query(rknn_context context, int cmd, void *info, uint32_t size) {
    model *m = (model *)(uintptr_t)context;
    if (!m || !info) return ERR_CTX_INVALID;
    switch (cmd) {
    case QUERY_IN_OUT_NUM:
        if (size < sizeof(rknn_input_output_num)) return ERR_PARAM_INVALID;
        ((rknn_input_output_num *)info)->n_input = 1;
        ((rknn_input_output_num *)info)->n_output = 1;
        return SUCC;
    case QUERY_INPUT_ATTR:
    case QUERY_OUTPUT_ATTR:
        if (size < sizeof(rknn_tensor_attr) || ((rknn_tensor_attr *)info)->index != 0) return ERR_PARAM_INVALID;
        fill_attr(m, info, cmd == QUERY_OUTPUT_ATTR);
        return SUCC;
    default:
        return ERR_FAIL;
    }
}

int rknn_inputs_set(rknn_context context, uint32_t n_inputs, rknn_input inputs[]) {
    model *m = (model *)(uintptr_t)context;
    if (!m) return ERR_CTX_INVALID;
    if (n_inputs != 1 || inputs[0].index != 0 || inputs[0].type != TYPE_UINT8 || inputs[0].fmt != FMT_NHWC ||
        inputs[0].size != m->width * m->height * 3)
        return ERR_PARAM_INVALID;
    memcpy(m->input, inputs[0].buf, inputs[0].size);
    return SUCC;
}

int rknn_run(rknn_context context, void *extend) {
    (void)extend;
    model *m = (model *)(uintptr_t)context;
    if (!m) return ERR_CTX_INVALID;
    unsigned grid = (unsigned)lround(sqrt((double)m->rows));
    for (unsigned r = 0; r < m->rows; r++) {
        unsigned gx = r % grid, gy = r / grid;
        unsigned x0 = gx * m->width / grid, x1 = (gx + 1) * m->width / grid;
        unsigned y0 = gy * m->height / grid, y1 = (gy + 1) * m->height / grid;
        double mean[3] = {0, 0, 0};
        for (unsigned y = y0; y < y1; y++)
            for (unsigned x = x0; x < x1; x++)
                for (unsigned c = 0; c < 3; c++) mean[c] += m->input[(y * m->width + x) * 3 + c];
        double count = (double)(x1 - x0) * (y1 - y0);
        for (unsigned d = 0; d < m->dim; d++) {
            double v = m->positions[r * m->dim + d];
            for (unsigned c = 0; c < 3; c++) v += (mean[c] / count / 127.5 - 1.0) * m->weights[c * m->dim + d];
            m->output[r * m->dim + d] = (float)v;
        }
    }
    return SUCC;
}

int rknn_outputs_get(rknn_context context, uint32_t n_outputs, rknn_output outputs[], void *extend) {
    (void)extend;
    model *m = (model *)(uintptr_t)context;
    if (!m) return ERR_CTX_INVALID;
    for (uint32_t i = 0; i < n_outputs; i++) {
        if (outputs[i].index != 0) return ERR_PARAM_INVALID;
        uint32_t bytes = m->rows * m->dim * 4;
        outputs[i].buf = malloc(bytes);
        memcpy(outputs[i].buf, m->output, bytes);
        outputs[i].size = bytes;
    }
    return SUCC;
}

int rknn_outputs_release(rknn_context context, uint32_t n_outputs, rknn_output outputs[]) {
    (void)context;
    for (uint32_t i = 0; i < n_outputs; i++) free(outputs[i].buf), outputs[i].buf = NULL;
    return SUCC;
}

/* Declared by rknn-rs but unused by gst-vlm: present so that linking never fails. */
int rknn_set_core_mask(rknn_context c, int mask) { (void)c, (void)mask; return SUCC; }
int rknn_set_batch_core_num(rknn_context c, int n) { (void)c, (void)n; return SUCC; }
void *rknn_create_mem(rknn_context c, uint32_t size) { (void)c, (void)size; return NULL; }
void *rknn_create_mem2(rknn_context c, uint64_t size, uint64_t flags) { (void)c, (void)size, (void)flags; return NULL; }
int rknn_destroy_mem(rknn_context c, void *mem) { (void)c, (void)mem; return ERR_FAIL; }
int rknn_mem_sync(rknn_context c, void *mem, int mode) { (void)c, (void)mem, (void)mode; return ERR_FAIL; }
