/* The library's internal interface for its own command-line tool, cli/.
 *
 * Not the published API (include/loom.h is) and not stable: it changes
 * with the CLI, in the same commit. Nothing here is exported from
 * libloom.so (the library is built with hidden visibility; the loom command
 * links libloom.a). cli/ includes include/loom.h, this header and system
 * headers, and nothing else of src/.
 *
 * What the CLI takes beyond loom.h, by module. The headers below are each
 * a module's own interface; what is not in them stays out of the CLI's
 * reach: the model object's insides (model/model.h, model/kern.h), the
 * backends (cuda_backend.h comes in for loom_cuda_query alone), the
 * training step, the checkpoint format. A live model is read through
 * loom.h. */
#ifndef LOOM_CLI_INTERNAL_H
#define LOOM_CLI_INTERNAL_H

#include "loom.h"

/* errors and logging, allocation, string buffers, paths and files,
 * number formats; the progress line's flag (loom_ctx_line_open) */
#include "core/core.h"
/* JSON values: config files, meta.json, metrics files */
#include "core/json.h"
/* the option table and loom_settings: every flag of every command */
#include "core/options.h"
/* the job's world group (loom_comm_world) and the collectives the CLI
 * itself runs: barriers, broadcasts, agreeing on a verdict, abort */
#include "comm/comm.h"
/* safetensors reading and writing (init, inspect, golden, convert); a HF
 * model directory's weights with its experts in the hub layout (export.h) */
#include "io/export.h"
#include "io/safetensors.h"
/* output directories written whole (loom_out_*), checkpoint directories
 * (loom_ckpt_*: iter_ names, the tracker, pruning) */
#include "io/outdir.h"
#include "io/ckpt_dir.h"
/* mesh sizes: resolved, checked against a batch, described */
#include "parallel/mesh.h"
/* config.json (io/hf_config.h), the parameter plan, presets, random
 * models, the size of a saved HF directory */
#include "model/params.h"
/* without a model object: config loading, LoRA targets, the memory a run
 * will need (loom_memory_predict / loom_memory_print) */
#include "model/meta.h"
/* token files and their packer, JSONL datasets, the sample loader */
#include "data/tokens.h"
#include "data/loader.h"
#include "data/dataset.h"
/* metrics files and TensorBoard events, MFU, the progress line's text */
#include "train/metrics.h"
/* the names of the learning-rate decay styles */
#include "train/scheduler.h"
#ifdef LOOM_HAVE_CUDA
/* loom_cuda_query: the GPUs (loom version, --device auto,
 * --nproc-per-node, the MFU's peak FLOP/s) */
#include "backend/cuda/cuda_backend.h"
#endif

/* ---- The model object, beyond loom.h (defined in src/model/; model.h
 * declares them too, and src/model/info.c includes both headers, so the
 * compiler holds the two to each other) ---- */

/* loom_model_create on the CLI's world group (borrowed: the CLI keeps it to
 * end the whole job when a rank fails). */
loom_status loom_model_create_in(loom_ctx *ctx, const char *dir, const loom_model_options *opts,
                                 loom_comm *world, loom_model **out);
/* The model's config (config.json with the overrides), valid while the
 * model lives: its FLOPs per token (loom_flops_per_token). */
const loom_model_config *loom_model_get_config(const loom_model *m);
/* Which kernels ran the GPU attention, in words (model/kern.h). */
void loom_dev_attn_note(const loom_model *m, char *buf, size_t n);

#endif /* LOOM_CLI_INTERNAL_H */
