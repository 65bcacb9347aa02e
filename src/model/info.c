/* A live model as callers outside model/ see it: include/loom.h's device
 * and peak memory, and what src/loom_cli.h declares for the loom command.
 * (Its shapes are loom_model_get_info, in model.c; its mesh and parameter
 * table are in meta.c.) */
#include "../loom_cli.h"
#include "model.h"

loom_device loom_model_device(const loom_model *m, int *gpu) {
    if (gpu) *gpu = m->dev.cuda ? m->dev.device : -1;
    return m->dev.cuda ? LOOM_DEVICE_CUDA : LOOM_DEVICE_CPU;
}

uint64_t loom_model_peak_memory(const loom_model *m) {
    return m->dev.cuda ? (uint64_t)m->dev.peak : 0;
}

uint64_t loom_model_buffer_memory(const loom_model *m) {
    return m->dev.cuda ? (uint64_t)m->dev.own_peak : 0;
}

uint64_t loom_model_device_memory(const loom_model *m) {
    return m->dev.cuda ? (uint64_t)(m->dev.used0 + m->dev.peak) : 0;
}

const loom_model_config *loom_model_get_config(const loom_model *m) { return &m->cfg; }
