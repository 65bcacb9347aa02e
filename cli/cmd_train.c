/* loom train: a model directory and a token file in, steps printed, an HF
 * directory out. Built on the public model API, with the model created on
 * the CLI's world group (src/loom_cli.h). */
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "ckpt.h"
#include "cli.h"

/* The profile table's room (loom_model_profile). */
#define PROFILE_REPORT 16384

/* Optimizer and schedule from the settings. */
static loom_status setup_optimizer(loom_ctx *ctx, loom_model *m, const loom_settings *s) {
    loom_optimizer_config oc = {.lr = s->lr, .beta1 = s->adam_beta1, .beta2 = s->adam_beta2,
                                .eps = s->adam_eps, .weight_decay = s->weight_decay};
    loom_status st = loom_model_set_optimizer(m, &oc);
    if (st) return st;
    loom_sched_config sc = loom_sched_config_default();
    sc.init_lr = 0.0;
    sc.max_lr = s->lr;
    sc.min_lr = s->min_lr;
    sc.lr_warmup_steps = s->lr_warmup_steps;
    sc.lr_decay_steps = s->lr_decay_steps ? s->lr_decay_steps : s->train_steps;
    if ((st = loom_lr_decay_style_parse(ctx, s->lr_decay_style, &sc.lr_decay_style))) return st;
    if (sc.lr_decay_style == LOOM_LR_WSD) sc.wsd_decay_steps = sc.lr_decay_steps / 10 + 1;
    if (sc.lr_decay_steps <= sc.lr_warmup_steps) sc.lr_decay_steps = sc.lr_warmup_steps + 1;
    sc.start_wd = sc.end_wd = s->weight_decay;
    return loom_model_set_lr_scheduler(m, &sc);
}

/* JSONL data: rank 0 tokenizes it into the token cache beside it (or finds
 * the cache), the other ranks wait at a barrier and open that cache. */
static loom_status open_jsonl(loom_ctx *ctx, const loom_settings *s, loom_comm *world,
                              loom_tokfile **tf) {
    loom_dataset_config dc = loom_dataset_config_default();
    dc.seq_len = s->seq_len;
    dc.append_eos = s->append_eos;
    loom_status st = loom_truncation_parse(ctx, s->truncation, &dc.truncation);
    if (!st) st = loom_bad_lines_parse(ctx, s->bad_lines, &dc.bad_lines);
    if (st) return st;
    loom_dataset_encoder *enc = NULL;
    if ((st = loom_dataset_encoder_load(ctx, s->model, &enc)))
        return loom_err_prefix(ctx, "%s: JSONL data is tokenized with the model's tokenizer",
                               s->data);
    int rank = loom_comm_rank(world), size = loom_comm_size(world);
    loom_dataset_report rep;
    if (rank == 0) st = loom_dataset_open(ctx, s->data, enc, &dc, tf, &rep);
    if (!st && size > 1) st = loom_comm_barrier(world);
    if (!st && rank != 0) {
        dc.reuse_only = true;
        st = loom_dataset_open(ctx, s->data, enc, &dc, tf, &rep);
    }
    if (!st && rank == 0) loom_dataset_report_log(ctx, s->data, &rep);
    loom_dataset_encoder_free(enc);
    return st;
}

/* --save-hf and --save-adapter are checked before the model is loaded:
 * a destination that cannot take the output fails now, not after training. */
static loom_status check_outputs(loom_ctx *ctx, const loom_settings *s) {
    if (!s->save_hf && !s->save_adapter) return LOOM_OK;
    if (s->save_hf && s->save_adapter) { /* each replaces its directory whole */
        size_t a = strlen(s->save_hf), b = strlen(s->save_adapter);
        while (a > 1 && s->save_hf[a - 1] == '/') a--;
        while (b > 1 && s->save_adapter[b - 1] == '/') b--;
        if (a == b && !strncmp(s->save_hf, s->save_adapter, a))
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "--save-hf and --save-adapter name the same directory (%s): the "
                             "model would replace the adapter; give them different directories",
                             s->save_hf);
    }
    loom_model_config cfg;
    loom_status st = loom_model_load_config(ctx, s->model, s->config_override, &cfg);
    if (st) return st;
    uint64_t est = 0;
    if (s->save_hf) {
        st = loom_hf_save_estimate(ctx, &cfg, s->model, loom_cli_save_dtype(s, LOOM_DTYPE_COUNT),
                                   &est);
        if (!st) st = loom_out_check(ctx, "--save-hf", s->save_hf, LOOM_OUT_DIR, est);
    }
    if (!st && s->save_adapter) {
        bool target[LOOM_LORA_NMOD] = {0};
        est = 0;
        if (s->lora_r && !loom_lora_parse_targets(ctx, s->lora_target, target))
            est = loom_lora_save_estimate(&cfg, (int)s->lora_r, target);
        /* bad targets are reported when the adapter is made; a continued
         * adapter is saved in F32: at most twice its file */
        char *ap = s->adapter ? loom_path_join(ctx, s->adapter, "adapter_model.safetensors") : NULL;
        struct stat sb;
        if (ap && stat(ap, &sb) == 0) est = 2 * (uint64_t)sb.st_size;
        free(ap);
        st = loom_out_check(ctx, "--save-adapter", s->save_adapter, LOOM_OUT_DIR, est);
    }
    loom_config_free(&cfg);
    return st;
}

/* The live progress line (rank 0, stderr a terminal, --progress): one line
 * redrawn with \r at most 10 times a second; loom_log erases it before a log
 * line (loom_ctx_line_open) and the next draw puts it back. */
typedef struct progress {
    bool on;
    double last_draw;
} progress;

static void progress_draw(loom_ctx *ctx, progress *p, int64_t step, int64_t total, double loss,
                          double tokens_per_s, double eta_s, double now) {
    if (!p->on || (now - p->last_draw < 0.1 && step != total && step != 1)) return;
    struct winsize ws;
    int width = ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 1 ? ws.ws_col - 1 : 79;
    char line[512];
    loom_progress_line(line, sizeof line, step, total, loss, tokens_per_s, eta_s, width);
    fprintf(stderr, "\r\033[K%s", line);
    fflush(stderr);
    loom_ctx_set_line_open(ctx, true);
    p->last_draw = now;
}

static void progress_clear(loom_ctx *ctx) {
    if (!loom_ctx_line_open(ctx)) return;
    fputs("\r\033[K", stderr);
    fflush(stderr);
    loom_ctx_set_line_open(ctx, false);
}

/* Peak dense bf16 FLOP/s of this rank's GPU (0: CPU, or a GPU loom does not know). */
static double gpu_peak_flops(loom_ctx *ctx, const loom_model *m) {
#ifdef LOOM_HAVE_CUDA
    loom_cuda_info gi;
    int gpu;
    if (loom_model_device(m, &gpu) == LOOM_DEVICE_CUDA &&
        loom_cuda_query(ctx, gpu, &gi) == LOOM_OK) {
        double peak = loom_gpu_peak_flops(gi.name);
        if (peak <= 0)
            LOOM_LOG_I(ctx, "MFU: the peak FLOP/s of '%s' is unknown to loom; mfu is left out",
                       gi.name);
        return peak;
    }
#endif
    (void)ctx;
    (void)m;
    return 0;
}

int loom_cmd_train(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    if (!s->model || !s->data) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "loom train needs --model DIR (an HF model directory; `loom init` makes one) "
                  "and --data FILE.tokens (`loom data` makes one) or --data FILE.jsonl");
        return loom_cli_fail(ctx);
    }
    if (s->global_batch_size % s->micro_batch_size) {
        loom_errf(ctx, LOOM_ERR_CONFIG,
                  "global_batch_size=%" PRId64 " is not a multiple of micro_batch_size=%" PRId64,
                  s->global_batch_size, s->micro_batch_size);
        return loom_cli_fail(ctx);
    }
    bool launched; /* --nproc-per-node: this process starts the workers and waits */
    int launch_rc = loom_cli_maybe_launch(ctx, s, &launched);
    if (launched) return launch_rc;
    loom_comm *world = NULL;
    if (loom_cli_world(ctx, s, &world)) return loom_cli_fail(ctx);
    loom_settings_print(ctx, s, LOOM_CMD_TRAIN);
    /* rank 0 writes the outputs, so rank 0 checks them, for the whole job */
    if (loom_comm_rank(world) == 0 && check_outputs(ctx, s)) {
        int rc = loom_cli_fail_job(ctx, world);
        loom_comm_free(world);
        return rc;
    }
    /* the metrics outputs are opened now (rank 0 writes them): a bad path
     * fails before the model is loaded */
    loom_metrics *mw = NULL;
    double *etok = NULL; /* MoE: the step's tokens per (layer, expert), for the metrics */
    if ((s->metrics_file || s->tensorboard_dir) && loom_comm_rank(world) == 0 &&
        loom_metrics_open(ctx, s->metrics_file, s->tensorboard_dir, &mw)) {
        loom_cli_fail_job(ctx, world);
        loom_comm_free(world);
        return 1;
    }

    loom_model_options mo;
    loom_cli_model_options(s, &mo);
    /* the memory each rank will need, from the shapes alone: printed now,
     * and again with what to change when an allocation fails */
    loom_mem_report mem = {0};
    bool have_mem = false;
    {
        loom_model_config cfg;
        loom_mesh_sizes want = {.tp = mo.tp, .cp = mo.cp, .dp = mo.dp, .pp = mo.pp, .vpp = mo.vpp,
                                .ep = mo.ep, .etp = mo.etp, .vpp_group = mo.microbatch_group,
                                .sequence_parallel = mo.sequence_parallel != 0}, n;
        loom_ctx *q = NULL; /* a failed prediction is not the run's error */
        if (!loom_ctx_create(&q) &&
            !loom_model_load_config(q, s->model, s->config_override, &cfg)) {
            if (!loom_mesh_sizes_resolve(q, &want, loom_comm_size(world), &n) &&
                s->global_batch_size % (s->micro_batch_size * n.dp) == 0) {
                int n_micro = (int)(s->global_batch_size / (s->micro_batch_size * n.dp));
                have_mem = !loom_cli_predict_memory(q, s, &cfg, &n,
                                                    mo.device == LOOM_DEVICE_CUDA, n_micro, &mem);
            }
            loom_config_free(&cfg);
        }
        loom_ctx_free(q);
        if (have_mem) loom_memory_print(ctx, &mem, LOOM_LOG_INFO);
    }
    loom_model *m = NULL;
    loom_cli_saver *saver = NULL;
    loom_tokfile *tf = NULL;
    loom_packer *pk = NULL;
    loom_loader *ld = NULL;
    int rc = 1;
    loom_status st = loom_model_create_in(ctx, s->model, &mo, world, &m);
    if (st) goto done;
    loom_mesh_info mi;
    loom_model_get_mesh(m, &mi);
    if (s->global_batch_size % (s->micro_batch_size * mi.dp)) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG,
                       "global_batch_size=%" PRId64 " must be a multiple of micro_batch_size=%"
                       PRId64 " x dp=%d",
                       s->global_batch_size, s->micro_batch_size, mi.dp);
        goto done;
    }
    char mesh[128];
    LOOM_LOG_I(ctx, "mesh: %s on %d process%s", loom_cli_mesh_describe(m, mesh, sizeof mesh),
               loom_model_world_size(m), loom_model_world_size(m) == 1 ? "" : "es");
    loom_model_info info;
    loom_model_get_info(m, &info);
    char nb[32];
    LOOM_LOG_I(ctx, "model %s: %s, %" PRId64 " layers, hidden %" PRId64 ", vocab %" PRId64
               ", %s parameters", s->model, info.model_type, info.num_layers, info.hidden_size,
               info.vocab_size, loom_fmt_int(nb, info.num_params));
    if (mw && info.num_experts > 0 &&
        !(etok = loom_calloc(ctx, (size_t)(info.num_layers * info.num_experts), sizeof *etok,
                             "tokens per expert"))) {
        st = LOOM_ERR_OOM;
        goto done;
    }
    const int64_t max_pos = info.max_position_embeddings; /* 0: config.json has none */
    if (max_pos > 0 && s->seq_len > max_pos && loom_model_rank(m) == 0)
        LOOM_LOG_W(ctx, "--seq-len %" PRId64 " exceeds the model's max_position_embeddings %" PRId64
                   " (%s/config.json): positions past it were not trained and may behave badly",
                   s->seq_len, max_pos, s->model);
    if (s->adapter && s->lora_r) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG,
                       "give --adapter DIR (continue an adapter) or --lora-r R (a fresh one), "
                       "not both");
        goto done;
    }
    if (s->adapter) {
        if ((st = loom_model_load_adapter(m, "default", s->adapter))) goto done;
        LOOM_LOG_I(ctx, "LoRA adapter %s loaded; the base model is frozen", s->adapter);
    } else if (s->lora_r) {
        loom_lora_config lc = {.r = (int)s->lora_r, .lora_alpha = s->lora_alpha,
                               .target_modules = s->lora_target, .use_rslora = s->use_rslora,
                               .seed = (uint64_t)s->seed};
        if ((st = loom_model_add_adapter(m, "default", &lc))) goto done;
        LOOM_LOG_I(ctx, "LoRA r=%d alpha=%g on %s; the base model is frozen", lc.r,
                   lc.lora_alpha > 0 ? lc.lora_alpha : lc.r, s->lora_target);
    } else if (s->save_adapter || s->merge_lora) {
        st = loom_errf(ctx, LOOM_ERR_CONFIG,
                       "--save-adapter and --merge-lora need an adapter (--lora-r or --adapter)");
        goto done;
    }
    const bool jsonl = loom_dataset_is_jsonl(s->data);
    if ((st = jsonl ? open_jsonl(ctx, s, world, &tf) : loom_tokfile_open(ctx, s->data, &tf)))
        goto done;
    if ((int64_t)loom_tokfile_max_id(tf) >= info.vocab_size) {
        st = loom_errf(ctx, LOOM_ERR_INVALID_ARG,
                       "%s holds token id %" PRIu32 ", outside the vocabulary [0, %" PRId64
                       ") of %s; the data was made for another tokenizer",
                       s->data, loom_tokfile_max_id(tf), info.vocab_size, s->model);
        goto done;
    }
    LOOM_LOG_I(ctx, "data %s: %s tokens in %" PRId64 " documents", s->data,
               loom_fmt_int(nb, loom_tokfile_n_tokens(tf)), loom_tokfile_n_docs(tf));
    const int64_t n_micro = s->global_batch_size / (s->micro_batch_size * mi.dp);
    if (jsonl) { /* shuffled whole samples, packed padding-free (src/data/loader.h) */
        loom_loader_config lc = {.seq_len = s->seq_len, .micro_batch_size = s->micro_batch_size,
                                 .num_micro_batches = n_micro, .dp = mi.dp,
                                 .seed = (uint64_t)s->data_seed, .truncation = LOOM_TRUNC_ERROR};
        if ((st = loom_loader_create(ctx, tf, &lc, &ld))) {
            loom_err_prefix(ctx, "%s", s->data);
            goto done;
        }
    } else if ((st = loom_packer_create(ctx, tf, s->seq_len, s->global_batch_size, &pk))) {
        goto done;
    }
    if ((st = setup_optimizer(ctx, m, s))) goto done;
    loom_train_progress resume = {0};
    if (s->load) {
        if ((st = loom_cli_ckpt_load(ctx, m, s, &resume))) goto done;
        if (resume.step >= s->train_steps) {
            st = loom_errf(ctx, LOOM_ERR_CONFIG,
                           "%s is at step %lld already; --train-steps %lld leaves nothing to "
                           "train (raise it)", s->load, (long long)resume.step,
                           (long long)s->train_steps);
            goto done;
        }
        if (resume.step > 0 && ld)
            st = loom_loader_set_state(ctx, ld, (loom_loader_pos){.epoch = resume.data_epoch,
                                                                  .index = resume.data_index});
        else if (resume.step > 0)
            st = loom_packer_set_state(ctx, pk, (loom_packer_pos){.doc = resume.data_index,
                                                                  .offset = resume.data_offset,
                                                                  .epoch = resume.data_epoch});
        if (st) goto done;
    }
    if (s->save) {
        loom_cli_ckpt_signals(true);
        if (!(saver = loom_cli_saver_new())) {
            st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory");
            goto done;
        }
    }

    /* MFU: model FLOPs per token over every GPU's peak */
    const double peak_flops = gpu_peak_flops(ctx, m) * loom_model_world_size(m);
    const double flops_tok =
        loom_flops_per_token(loom_model_get_config(m), s->seq_len, s->adapter || s->lora_r);
    int gpu; /* this rank's GPU, -1 on the CPU */
    const bool cuda = loom_model_device(m, &gpu) == LOOM_DEVICE_CUDA;
    progress pg = {.on = s->progress && loom_model_rank(m) == 0 && isatty(STDERR_FILENO) &&
                         loom_ctx_log_level(ctx) >= LOOM_LOG_INFO};
    if (mw) {
        if (s->metrics_file) LOOM_LOG_I(ctx, "metrics: appending to %s", s->metrics_file);
        if (s->tensorboard_dir)
            LOOM_LOG_I(ctx, "metrics: TensorBoard events to %s (tensorboard --logdir %s)",
                       loom_metrics_tb_path(mw), s->tensorboard_dir);
    }
    int64_t epoch = resume.data_epoch, samples_total = resume.consumed_samples, skipped = 0;
    int64_t tokens_total = resume.consumed_tokens, tokens_at_log = tokens_total, tokens_first = 0;
    double first_loss = NAN, last_loss = NAN, t_start = loom_now_s(), t_log = t_start;
    double t_first = NAN; /* end of the first step (the ETA leaves out its start-up costs) */
    const int64_t step0 = resume.step + 1;
    int64_t trained = 0;
    bool stopped = false;
    for (int64_t step = step0; step <= s->train_steps; step++) {
        loom_packed_batch pb;
        loom_loader_batch lb;
        const loom_batch *b = ld ? &lb.b : &pb.b; /* what the loader or packer made */
        if (ld) {
            if ((st = loom_loader_next(ctx, ld, &lb))) goto done;
            if (loom_loader_state(ld).epoch > epoch) {
                epoch = loom_loader_state(ld).epoch;
                LOOM_LOG_I(ctx, "data: epoch %" PRId64 " done at step %" PRId64
                           "; the samples are reshuffled for epoch %" PRId64, epoch - 1, step,
                           epoch);
            }
        } else if ((st = loom_packer_next(ctx, pk, &pb))) {
            goto done;
        }
        loom_fb_result fr;
        loom_step_result sr;
        if ((st = loom_model_forward_backward(m, b, n_micro, &fr))) goto done;
        if ((st = loom_model_clip_grad_and_step(m, s->clip_grad, 1, &sr))) goto done;
        const double now = loom_now_s();
        tokens_total += b->rows * b->seq_len;
        samples_total += b->rows;
        skipped += sr.skipped != 0;
        trained++;
        if (step == step0) {
            first_loss = fr.loss;
            t_first = now;
        }
        last_loss = fr.loss;
        /* tokens/s over the steps since the last logged one */
        const double tps = (double)(tokens_total - tokens_at_log) / (now - t_log);
        if (step % s->log_interval == 0 || step == s->train_steps || step == step0) {
            char moe[200] = "", zs[48] = "", pf[160] = "";
            loom_step_breakdown br; /* --profile: the steps since the last log line */
            loom_model_profile_interval(m, &br);
            if (br.steps > 0)
                snprintf(pf, sizeof pf,
                         " | ms/step: compute %.1f, comm %.1f, bubble %.1f, idle %.1f", br.compute_ms,
                         br.comm_ms, br.bubble_ms, br.idle_ms);
            const bool zl = s->moe_z_loss_coeff > 0;
            if (zl) snprintf(zs, sizeof zs, " | z-loss %.4f", sr.z_loss);
            if (sr.expert_tokens_max > 0)
                snprintf(moe, sizeof moe,
                         " | aux %.4f%s | tokens/expert %.0f/%.1f/%.0f (imbalance %.2f, layer %" PRId64
                         ")",
                         sr.aux_loss, zs, sr.expert_tokens_min, sr.expert_tokens_mean,
                         sr.expert_tokens_max, sr.expert_imbalance, sr.expert_imbalance_layer);
            LOOM_LOG_I(ctx,
                       "step %" PRId64 "/%" PRId64 " | loss %.4f | grad norm %.3f | lr %.3e | "
                       "%.0f tokens/s%s%s%s",
                       step, s->train_steps, fr.loss, sr.grad_norm, sr.lr, tps, moe, pf,
                       sr.stepped ? "" : " | step skipped");
            if (mw) {
                loom_metrics_record r = {
                    .step = step, .consumed_samples = samples_total,
                    .consumed_tokens = tokens_total, .loss = fr.loss, .grad_norm = sr.grad_norm,
                    .lr = sr.lr, .tokens_per_s = tps,
                    .mfu = peak_flops > 0 ? tps * flops_tok / peak_flops : NAN,
                    .peak_mem_bytes = cuda ? (int64_t)loom_model_peak_memory(m)
                                           : loom_max_rss_bytes(),
                    .skipped_steps = skipped, .elapsed_s = now - t_start,
                    .moe = sr.expert_tokens_max > 0, .aux_loss = sr.aux_loss,
                    .expert_tokens_min = sr.expert_tokens_min,
                    .expert_tokens_mean = sr.expert_tokens_mean,
                    .expert_tokens_max = sr.expert_tokens_max,
                    .expert_imbalance = sr.expert_imbalance,
                    .z = zl, .z_loss = sr.z_loss, .prof = br};
                if (etok && sr.expert_tokens_max > 0 &&
                    !(st = loom_model_expert_tokens(m, etok, info.num_layers * info.num_experts)))
                    r.expert_tokens = etok, r.layers = info.num_layers, r.experts = info.num_experts;
                if (st || (st = loom_metrics_write(ctx, mw, &r))) goto done;
            }
            tokens_at_log = tokens_total;
            t_log = now;
        }
        /* the progress line's rate: the mean since the first step, as its ETA */
        if (step == step0) tokens_first = tokens_total;
        const double rate = step > step0 ? (double)(tokens_total - tokens_first) / (now - t_first)
                                         : tps;
        progress_draw(ctx, &pg, step - step0 + 1, s->train_steps - step0 + 1, fr.loss, rate,
                      loom_eta_s(step - step0 + 1, s->train_steps - step0 + 1, t_first, now), now);
        if (s->save) {
            int sig = 0;
            if ((st = loom_cli_ckpt_poll(ctx, m, world, saver, &sig))) goto done;
            if (sig || step == s->train_steps || (s->save_interval && step % s->save_interval == 0)) {
                progress_clear(ctx);
                loom_train_progress p = {.consumed_samples = samples_total,
                                         .consumed_tokens = tokens_total};
                if (ld) {
                    loom_loader_pos lp = loom_loader_state(ld);
                    p.data_epoch = lp.epoch, p.data_index = lp.index;
                } else {
                    loom_packer_pos pp = loom_packer_state(pk);
                    p.data_epoch = pp.epoch, p.data_index = pp.doc, p.data_offset = pp.offset;
                }
                if ((st = loom_cli_ckpt_save(ctx, m, world, s, saver, step, &p))) goto done;
            }
            if (sig) {
                LOOM_LOG_I(ctx, "stopped by %s after step %" PRId64 " (saved; resume with --load %s)",
                           sig == SIGTERM ? "SIGTERM" : "SIGINT", step, s->save);
                stopped = true;
                break;
            }
        }
    }
    loom_cli_ckpt_signals(false);
    progress_clear(ctx);
    if (saver && (st = loom_cli_saver_finish(ctx, m, world, saver))) goto done;
    double total = loom_now_s() - t_start;
    if (cuda) {
        /* every GPU rank reports its own peak (the other lines are rank 0's):
         * ranks other than 0 were lowered to warnings by loom_cli_world, so
         * they are let through at info for this line unless the user asked
         * for less (--log-level warn|error) */
        char pkb[32], pr[32], own[32], where[96] = "";
        const uint64_t peak = loom_model_peak_memory(m);
        const loom_log_level lv = loom_ctx_log_level(ctx);
        const bool say = !strcmp(s->log_level, "info") || !strcmp(s->log_level, "debug");
        if (say && lv < LOOM_LOG_INFO) loom_ctx_set_log_level(ctx, LOOM_LOG_INFO);
        if (loom_model_world_size(m) > 1)
            snprintf(where, sizeof where, ", pipeline stage %d, tp rank %d, dp rank %d",
                     mi.pp_rank, mi.tp_rank, mi.dp_rank);
        LOOM_LOG_I(ctx,
                   "peak GPU memory %.2f GiB (%s above the CUDA context on GPU %d%s: loom's "
                   "buffers %s, predicted %s%s, and the libraries' workspaces and kernels; "
                   "%.2f GiB on the device with the CUDA context and libraries)",
                   (double)peak / (1u << 30), loom_fmt_bytes(pkb, peak), gpu, where,
                   loom_fmt_bytes(own, loom_model_buffer_memory(m)),
                   have_mem ? loom_fmt_bytes(pr, mem.total) : "n/a",
                   have_mem && mi.pp > 1 ? " for the largest stage" : "",
                   (double)loom_model_device_memory(m) / (1u << 30));
        loom_ctx_set_log_level(ctx, lv);
        char an[400];
        loom_dev_attn_note(m, an, sizeof an);
        LOOM_LOG_I(ctx, "attention: %s", an);
    }
    if (s->profile) { /* each rank its own, as the peak memory */
        char *rep = malloc(PROFILE_REPORT);
        if (!rep) {
            st = loom_errf(ctx, LOOM_ERR_OOM, "out of memory for the profile");
            goto done;
        }
        loom_model_profile(m, rep, PROFILE_REPORT);
        const loom_log_level lv = loom_ctx_log_level(ctx);
        const bool say = !strcmp(s->log_level, "info") || !strcmp(s->log_level, "debug");
        if (say && lv < LOOM_LOG_INFO) loom_ctx_set_log_level(ctx, LOOM_LOG_INFO);
        /* a line at a time (the log's lines are bounded) */
        for (char *line = rep, *nl; line && *line; line = nl ? nl + 1 : NULL) {
            if ((nl = strchr(line, '\n'))) *nl = '\0';
            if (line == rep)
                LOOM_LOG_I(ctx, "profile of rank %d%s: %s", loom_model_rank(m),
                           cuda ? "" : " (CPU: the host's clock)", line);
            else
                LOOM_LOG_I(ctx, "%s", line);
        }
        loom_ctx_set_log_level(ctx, lv);
        free(rep);
    }
    LOOM_LOG_I(ctx, "trained %" PRId64 " steps in %.1f s (%.0f tokens/s): loss %.4f -> %.4f",
               trained, total, (double)(tokens_total - resume.consumed_tokens) / total, first_loss,
               last_loss);
    bool lora = s->adapter || s->lora_r;
    if (stopped && (s->save_adapter || s->save_hf))
        LOOM_LOG_W(ctx, "stopped early: --save-adapter and --save-hf were not written (the run "
                        "did not finish; resume it with --load %s)", s->save);
    if (!stopped && s->save_adapter) {
        if ((st = loom_model_save_adapter(m, "default", s->save_adapter, LOOM_F32))) goto done;
        LOOM_LOG_I(ctx, "wrote adapter %s", s->save_adapter);
    }
    if (!stopped && lora && s->merge_lora && (st = loom_model_merge_adapter(m, "default")))
        goto done;
    if (!stopped && lora && s->save_hf && !s->merge_lora)
        LOOM_LOG_W(ctx, "--save-hf writes the frozen base model; add --merge-lora to fold the "
                        "adapter in, or use --save-adapter");
    if (!stopped && s->save_hf) {
        loom_dtype dt = loom_cli_save_dtype(s, LOOM_DTYPE_COUNT);
        /* with the tokenizer files of --model */
        if ((st = loom_model_save_hf(m, s->save_hf, dt, (uint64_t)s->max_shard_size))) goto done;
        LOOM_LOG_I(ctx, "wrote %s", s->save_hf);
    }
    if ((st = loom_metrics_close(ctx, mw))) {
        mw = NULL;
        goto done;
    }
    mw = NULL;
    rc = 0;
done:
    loom_cli_ckpt_signals(false);
    progress_clear(ctx);
    loom_metrics_close(NULL, mw);
    free(etok);
    if (rc && st == LOOM_ERR_OOM && have_mem && mo.device == LOOM_DEVICE_CUDA) {
        /* out of GPU memory: the table, and what to change */
        loom_memory_print(ctx, &mem, LOOM_LOG_ERROR);
        loom_err_prefix(ctx, "out of GPU memory; lower --micro-batch-size or --seq-len (the "
                             "activations), add pipeline or tensor parallelism (--pp, --tp: "
                             "weights and activations per GPU), data parallelism (--dp: the "
                             "optimizer is sharded over it), or train a LoRA adapter (--lora-r)");
    }
    loom_cli_saver_free(saver); /* a write in flight is finished first */
    if (rc) loom_cli_fail_job(ctx, world);
    loom_packer_free(pk);
    loom_loader_free(ld);
    loom_tokfile_free(tf);
    loom_model_free(m);
    loom_comm_free(world);
    return rc;
}
