/* loom inspect: architecture, parameter counts, tensors found vs expected. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

typedef struct {
    const char *name;
    const int64_t *want; /* plan shape */
    int want_ndim;
    const loom_st_tensor *got;
} mismatch;

typedef struct {
    size_t expected, found, n_missing, n_mismatch, n_unexpected, n_carried;
    const char **missing;   /* plan names absent from the checkpoint */
    mismatch *mismatches;
    const char **unexpected; /* checkpoint names not in the plan */
    const char **carried;    /* ... that loom carries through its exports (loom_hf_carried) */
    int64_t ckpt_params;
    uint64_t ckpt_bytes;
    int64_t by_dtype[LOOM_DTYPE_COUNT];
} match;

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static bool same_shape(const loom_param_spec *p, const loom_st_tensor *t) {
    if (p->ndim != t->ndim) return false;
    for (int d = 0; d < p->ndim; d++)
        if (p->shape[d] != t->shape[d]) return false;
    return true;
}

static loom_status compare(loom_ctx *ctx, const loom_model_config *c, const loom_param_plan *plan,
                           const loom_safetensors *st, match *m) {
    memset(m, 0, sizeof *m);
    size_t nt = loom_st_count(st);
    m->missing = loom_calloc(ctx, plan->n, sizeof *m->missing, "inspect");
    m->mismatches = loom_calloc(ctx, plan->n, sizeof *m->mismatches, "inspect");
    m->unexpected = loom_calloc(ctx, nt, sizeof *m->unexpected, "inspect");
    m->carried = loom_calloc(ctx, nt, sizeof *m->carried, "inspect");
    const char **names = loom_calloc(ctx, plan->n, sizeof *names, "inspect");
    if (!m->missing || !m->mismatches || !m->unexpected || !m->carried || !names) {
        free(names);
        return LOOM_ERR_OOM;
    }
    m->expected = plan->n;
    for (size_t i = 0; i < plan->n; i++) {
        const loom_param_spec *p = &plan->p[i];
        names[i] = p->name;
        const loom_st_tensor *t = loom_st_find(st, p->name);
        if (!t) {
            m->missing[m->n_missing++] = p->name;
        } else if (!same_shape(p, t)) {
            m->mismatches[m->n_mismatch++] = (mismatch){p->name, p->shape, p->ndim, t};
        } else {
            m->found++;
        }
    }
    qsort(names, plan->n, sizeof *names, cmp_str);
    for (size_t i = 0; i < nt; i++) {
        const loom_st_tensor *t = loom_st_at(st, i);
        m->ckpt_params += (int64_t)t->numel;
        m->ckpt_bytes += t->nbytes;
        m->by_dtype[t->dtype] += (int64_t)t->numel;
        if (bsearch(&t->name, names, plan->n, sizeof *names, cmp_str)) continue;
        if (loom_hf_carried(c, t->name))
            m->carried[m->n_carried++] = t->name;
        else
            m->unexpected[m->n_unexpected++] = t->name;
    }
    free(names);
    return LOOM_OK;
}

static void free_match(match *m) {
    free(m->missing);
    free(m->mismatches);
    free(m->unexpected);
    free(m->carried);
}

static void shape_str(char *buf, size_t n, int ndim, const int64_t *shape) {
    size_t o = (size_t)snprintf(buf, n, "[");
    for (int d = 0; d < ndim && o < n; d++)
        o += (size_t)snprintf(buf + o, n - o, "%s%" PRId64, d ? ", " : "", shape[d]);
    if (o < n) snprintf(buf + o, n - o, "]");
}

static void print_text(const char *src, const loom_model_config *c, const loom_param_plan *plan,
                       const loom_safetensors *st, const match *m) {
    char b1[32], b2[32];
    printf("model: %s\n", src);
    printf("  type %s (config layout: %s)%s%s\n", c->model_type,
           c->v5_layout ? "transformers v5" : "classic hub", c->dtype[0] ? ", dtype " : "",
           c->dtype);
    printf("  layers %" PRId64 ", hidden %" PRId64 ", heads %" PRId64 " (kv %" PRId64
           ", head_dim %" PRId64 "%s), vocab %" PRId64 "\n",
           c->num_layers, c->hidden_size, c->num_heads, c->num_kv_heads, c->head_dim,
           c->head_dim_given ? "" : ", derived", c->vocab_size);
    if (c->num_experts > 0) {
        int64_t moe_layers = 0;
        for (int64_t l = 0; l < c->num_layers; l++) moe_layers += loom_config_layer_is_moe(c, l);
        printf("  mlp: %" PRId64 " experts, top-%" PRId64 ", expert width %" PRId64
               "%s; %" PRId64 " MoE layers",
               c->num_experts, c->num_experts_per_tok, c->moe_intermediate_size,
               c->norm_topk_prob ? ", top-k renormalised" : "", moe_layers);
        if (c->shared_expert_intermediate_size > 0)
            printf(" (and a gated shared expert, width %" PRId64 ")",
                   c->shared_expert_intermediate_size);
        if (moe_layers < c->num_layers)
            printf(", %" PRId64 " dense (width %" PRId64 ")", c->num_layers - moe_layers,
                   c->intermediate_size);
        printf("\n");
    } else {
        printf("  mlp: SwiGLU, width %" PRId64 "%s\n", c->intermediate_size,
               c->mlp_bias ? ", with biases" : "");
    }
    const int64_t nlin = loom_config_linear_layers(c);
    if (nlin > 0 || c->attn_gate) {
        printf("  layers: ");
        if (nlin > 0)
            printf("%" PRId64 " Gated DeltaNet (key heads %" PRId64 " of %" PRId64
                   ", value heads %" PRId64 " of %" PRId64 ", conv %" PRId64 "), ",
                   nlin, c->lin_k_heads, c->lin_k_dim, c->lin_v_heads, c->lin_v_dim,
                   c->lin_conv_kernel);
        printf("%" PRId64 " full attention (output gate, %" PRId64 " of %" PRId64
               " dimensions rotated); zero-centred norms; text model under %s\n",
               c->num_layers - nlin, c->rotary_dim, c->head_dim, loom_config_text_prefix(c));
    }
    printf("  rope %s, theta %.10g", loom_rope_type_name(c->rope_type), c->rope_theta);
    if (c->rope_type != LOOM_ROPE_DEFAULT) printf(", factor %g", c->rope_factor);
    printf("; rms_norm_eps %g; qk-norm %s; qkv bias %s; tied embeddings %s\n", c->rms_norm_eps,
           c->qk_norm ? "yes" : "no", c->qkv_bias ? "yes" : "no",
           c->tie_word_embeddings ? "yes" : "no");
    int64_t counts[LOOM_COMP_COUNT];
    int64_t total = loom_param_plan_count(plan, counts);
    printf("parameters:\n");
    for (int k = 0; k < LOOM_COMP_COUNT; k++) {
        if (k == LOOM_COMP_HEAD && c->tie_word_embeddings) {
            printf("  %-10s %22s\n", "lm_head", "(tied to embedding)");
            continue;
        }
        if (counts[k] == 0 && (k == LOOM_COMP_ROUTER || k == LOOM_COMP_EXPERTS ||
                               (k == LOOM_COMP_MLP && c->num_experts > 0)))
            continue;
        printf("  %-10s %22s\n", loom_component_name((loom_component)k), loom_fmt_int(b1, counts[k]));
    }
    printf("  %-10s %22s\n", "total", loom_fmt_int(b1, total));
    if (c->num_experts > 0) {
        /* active per token: everything but the experts not chosen */
        int64_t active = total - counts[LOOM_COMP_EXPERTS] +
                         counts[LOOM_COMP_EXPERTS] / c->num_experts * c->num_experts_per_tok;
        printf("  %-10s %22s\n", "active", loom_fmt_int(b1, active));
    }
    if (!st) return;
    printf("checkpoint: %zu file%s, %zu tensors, %s parameters, %s\n", loom_st_file_count(st),
           loom_st_file_count(st) == 1 ? "" : "s", loom_st_count(st),
           loom_fmt_int(b1, m->ckpt_params), loom_fmt_bytes(b2, m->ckpt_bytes));
    printf("  dtypes:");
    for (int d = 0; d < LOOM_DTYPE_COUNT; d++)
        if (m->by_dtype[d]) printf(" %s %s", loom_dtype_name((loom_dtype)d), loom_fmt_int(b1, m->by_dtype[d]));
    printf("\n");
    printf("tensors: %zu expected, %zu found, %zu missing, %zu with another shape, %zu unexpected\n",
           m->expected, m->found, m->n_missing, m->n_mismatch, m->n_unexpected);
    if (m->n_carried)
        printf("  and %zu outside the text model (the vision tower, the mtp head), carried "
               "through every export as read\n",
               m->n_carried);
    const size_t show = 20;
    for (size_t i = 0; i < m->n_missing && i < show; i++) printf("  missing    %s\n", m->missing[i]);
    for (size_t i = 0; i < m->n_mismatch && i < show; i++) {
        char w[96], g[96];
        shape_str(w, sizeof w, m->mismatches[i].want_ndim, m->mismatches[i].want);
        shape_str(g, sizeof g, m->mismatches[i].got->ndim, m->mismatches[i].got->shape);
        printf("  shape      %s: expected %s, found %s\n", m->mismatches[i].name, w, g);
    }
    for (size_t i = 0; i < m->n_unexpected && i < show; i++)
        printf("  unexpected %s\n", m->unexpected[i]);
    if (m->n_missing > show || m->n_mismatch > show || m->n_unexpected > show)
        printf("  (lists cut at %zu; --format json lists all)\n", show);
}

static loom_status print_json(loom_ctx *ctx, const char *src, const loom_model_config *c,
                              const loom_param_plan *plan, const loom_safetensors *st,
                              const match *m) {
    loom_sb sb;
    loom_sb_init(&sb);
    int64_t counts[LOOM_COMP_COUNT];
    int64_t total = loom_param_plan_count(plan, counts);
    loom_sb_puts(&sb, "{\"source\": ");
    loom_json_write_string(&sb, src, strlen(src));
    loom_sb_printf(&sb,
                   ", \"model_type\": \"%s\", \"layout\": \"%s\", \"num_layers\": %" PRId64
                   ", \"hidden_size\": %" PRId64 ", \"num_heads\": %" PRId64
                   ", \"num_kv_heads\": %" PRId64 ", \"head_dim\": %" PRId64
                   ", \"vocab_size\": %" PRId64 ", \"num_experts\": %" PRId64
                   ", \"tie_word_embeddings\": %s, \"rope_type\": \"%s\", \"rope_theta\": ",
                   c->model_type, c->v5_layout ? "v5" : "classic", c->num_layers, c->hidden_size,
                   c->num_heads, c->num_kv_heads, c->head_dim, c->vocab_size, c->num_experts,
                   c->tie_word_embeddings ? "true" : "false", loom_rope_type_name(c->rope_type));
    loom_json_write_double(&sb, c->rope_theta);
    loom_sb_puts(&sb, ", \"parameters\": {");
    for (int k = 0; k < LOOM_COMP_COUNT; k++)
        loom_sb_printf(&sb, "\"%s\": %" PRId64 ", ", loom_component_name((loom_component)k), counts[k]);
    loom_sb_printf(&sb, "\"total\": %" PRId64 "}", total);
    if (st) {
        loom_sb_printf(&sb,
                       ", \"checkpoint\": {\"files\": %zu, \"tensors\": %zu, \"parameters\": %" PRId64
                       ", \"bytes\": %" PRIu64 "}, \"expected\": %zu, \"found\": %zu",
                       loom_st_file_count(st), loom_st_count(st), m->ckpt_params, m->ckpt_bytes,
                       m->expected, m->found);
        const char *const *lists[3] = {m->missing, m->unexpected, m->carried};
        const size_t ns[3] = {m->n_missing, m->n_unexpected, m->n_carried};
        const char *keys[3] = {"missing", "unexpected", "carried"};
        for (int l = 0; l < 3; l++) {
            loom_sb_printf(&sb, ", \"%s\": [", keys[l]);
            for (size_t i = 0; i < ns[l]; i++) {
                if (i) loom_sb_puts(&sb, ", ");
                loom_json_write_string(&sb, lists[l][i], strlen(lists[l][i]));
            }
            loom_sb_puts(&sb, "]");
        }
        loom_sb_puts(&sb, ", \"shape_mismatches\": [");
        for (size_t i = 0; i < m->n_mismatch; i++) {
            if (i) loom_sb_puts(&sb, ", ");
            loom_json_write_string(&sb, m->mismatches[i].name, strlen(m->mismatches[i].name));
        }
        loom_sb_puts(&sb, "]");
    }
    loom_sb_puts(&sb, "}\n");
    if (sb.failed) {
        loom_sb_free(&sb);
        return loom_errf(ctx, LOOM_ERR_OOM, "out of memory");
    }
    fputs(sb.buf, stdout);
    loom_sb_free(&sb);
    return LOOM_OK;
}

/* "tp=2,pp=2,dp=2,cp=1,vpp=1,ep=2,etp=1,sp" -> sizes (unnamed ones 1; etp
 * unnamed: tp). */
static loom_status parse_mesh(loom_ctx *ctx, const char *spec, loom_mesh_sizes *n) {
    memset(n, 0, sizeof *n);
    n->tp = n->cp = n->dp = n->pp = n->vpp = 1;
    const char *p = spec;
    while (*p) {
        char key[24];
        size_t k = 0;
        while (*p && *p != '=' && *p != ',' && k + 1 < sizeof key) key[k++] = *p++;
        key[k] = 0;
        long v = 1;
        if (*p == '=') {
            char *end;
            v = strtol(p + 1, &end, 10);
            if (end == p + 1 || v < 1 || v > 65536)
                return loom_errf(ctx, LOOM_ERR_CONFIG, "--mesh %s: %s needs a size >= 1", spec,
                                 key);
            p = end;
        }
        if (!strcmp(key, "sp") || !strcmp(key, "sequence_parallel"))
            n->sequence_parallel = v != 0;
        else if (!strcmp(key, "tp")) n->tp = (int)v;
        else if (!strcmp(key, "cp")) n->cp = (int)v;
        else if (!strcmp(key, "dp")) n->dp = (int)v;
        else if (!strcmp(key, "pp")) n->pp = (int)v;
        else if (!strcmp(key, "vpp")) n->vpp = (int)v;
        else if (!strcmp(key, "ep")) n->ep = (int)v;
        else if (!strcmp(key, "etp")) n->etp = (int)v;
        else
            return loom_errf(ctx, LOOM_ERR_CONFIG,
                             "--mesh %s: unknown size '%s'; use tp, cp, dp, pp, vpp, ep, etp and "
                             "sp, e.g. --mesh tp=2,pp=2,dp=2",
                             spec, key);
        if (*p == ',') p++;
        else if (*p)
            return loom_errf(ctx, LOOM_ERR_CONFIG, "--mesh %s: expected ',' after %s", spec, key);
    }
    return LOOM_OK;
}

/* The expert layers' fold of --mesh and what of the memory is the experts'. */
static void print_experts(const loom_model_config *c, const loom_mesh_sizes *n,
                          const loom_mem_report *r) {
    char w[32], g[32], o[32], a[32];
    const int stage = n->tp * n->cp * n->dp;
    printf("expert layers: each stage's tp*cp*dp = %d ranks folded as etp=%d x ep=%d x edp=%d "
           "(etp fastest)\n",
           stage, n->etp, n->ep, loom_mesh_edp(n));
    printf("  per rank: %" PRId64 " of %" PRId64 " experts per MoE layer (ep=%d), each of width "
           "%" PRId64 " of %" PRId64 " (etp=%d); the router replicated\n",
           c->num_experts / n->ep, c->num_experts, n->ep, c->moe_intermediate_size / n->etp,
           c->moe_intermediate_size, n->etp);
    if (c->shared_expert_intermediate_size > 0)
        printf("  the shared expert: width %" PRId64 " of %" PRId64 " per rank (tp=%d, as the "
               "dense MLP), its gate replicated\n",
               c->shared_expert_intermediate_size / n->tp, c->shared_expert_intermediate_size, n->tp);
    printf("  experts' share: weights %s, gradients %s, optimizer %s (sharded over edp=%d); "
           "MoE activations %s (sized for dropless routing's worst case)\n",
           loom_fmt_bytes(w, r->expert_weights), loom_fmt_bytes(g, r->expert_grads),
           loom_fmt_bytes(o, r->expert_optim), loom_mesh_edp(n), loom_fmt_bytes(a, r->moe_acts));
}

/* The memory table of --mesh. */
static loom_status print_memory(loom_ctx *ctx, const loom_settings *s,
                                const loom_model_config *cfg) {
    loom_mesh_sizes want, n;
    loom_status st = parse_mesh(ctx, s->mesh, &want);
    if (st) return st;
    int world = want.tp * want.cp * want.dp * want.pp;
    if ((st = loom_mesh_sizes_resolve(ctx, &want, world, &n))) return st;
    const bool cuda = strcmp(s->device, "cpu") != 0;
    int64_t per = s->micro_batch_size * n.dp;
    if (s->global_batch_size % per)
        return loom_errf(ctx, LOOM_ERR_CONFIG,
                         "global_batch_size=%lld is not a multiple of micro_batch_size=%lld x "
                         "dp=%d",
                         (long long)s->global_batch_size, (long long)s->micro_batch_size, n.dp);
    int n_micro = (int)(s->global_batch_size / per);
    if ((st = loom_mesh_check_model(ctx, &n, cfg)) ||
        (st = loom_mesh_check_batch(ctx, &n, s->global_batch_size, s->seq_len, n_micro)))
        return st;
    loom_mem_report r;
    if ((st = loom_cli_predict_memory(ctx, s, cfg, &n, cuda, n_micro, &r))) return st;
    char b[32], mesh[128];
    printf("\nmemory per %s on mesh %s (%d ranks), %s compute, micro-batch %lld x %lld, "
           "%d micro-batch%s per step%s%s%s:\n",
           cuda ? "GPU" : "process", loom_mesh_describe(&n, mesh, sizeof mesh), world,
           !strcmp(s->dtype, "auto") ? (cuda ? "bf16" : "fp32") : s->dtype,
           (long long)s->micro_batch_size, (long long)s->seq_len, n_micro, n_micro == 1 ? "" : "es",
           s->lora_r ? " (LoRA: base frozen)" : "", strcmp(s->recompute, "none") ? ", recompute " : "",
           strcmp(s->recompute, "none") ? s->recompute : "");
    printf("  %-13s %12s\n", "weights", loom_fmt_bytes(b, r.weights));
    printf("  %-13s %12s\n", "gradients", loom_fmt_bytes(b, r.grads));
    printf("  %-13s %12s   (AdamW moments%s, over dp*cp=%d%s)\n", "optimizer",
           loom_fmt_bytes(b, r.optim),
           n.dp * n.cp > 1 ? " and the gradient shard" : "; the gradients serve as the shard",
           n.dp * n.cp, cfg->num_experts > 0 ? "; the experts' over edp" : "");
    printf("  %-13s %12s   (%d micro-batch%s in flight on pipeline stage %d)\n", "activations",
           loom_fmt_bytes(b, r.acts), r.in_flight, r.in_flight == 1 ? "" : "es", r.pp_rank);
    printf("  %-13s %12s\n", "workspace", loom_fmt_bytes(b, r.work));
    printf("  %-13s %12s   (plus the CUDA context, ~0.5 GiB, NCCL's buffers and the CUDA "
           "libraries' workspaces and kernels, a few GiB)\n",
           "total", loom_fmt_bytes(b, r.total));
    if (cfg->num_experts > 0) print_experts(cfg, &n, &r);
    return LOOM_OK;
}

int loom_cmd_inspect(loom_ctx *ctx, loom_settings *s, int npos, const char **pos) {
    const char *dir = npos > 0 ? pos[0] : s->model;
    if (npos > 0 && s->model && strcmp(s->model, pos[0]) != 0) {
        loom_errf(ctx, LOOM_ERR_CONFIG, "give the model directory once (got %s and --model %s)",
                  pos[0], s->model);
        return loom_cli_fail(ctx);
    }
    loom_model_config cfg;
    loom_status st;
    const char *src = dir;
    if (dir) {
        st = loom_model_load_config(ctx, dir, s->config_override, &cfg);
    } else {
        const char *text = loom_preset_config(s->preset);
        loom_json *doc = NULL;
        st = loom_json_parse(ctx, text, strlen(text), s->preset, &doc);
        if (!st) st = loom_config_parse(ctx, doc, s->preset, &cfg);
        loom_json_free(doc);
        src = s->preset;
    }
    if (st) return loom_cli_fail(ctx);
    int rc = 0;
    loom_param_plan plan = {0};
    loom_safetensors *ckpt = NULL;
    match m = {0};
    if ((st = loom_param_plan_build(ctx, &cfg, &plan))) goto fail;
    if (dir) {
        if ((st = loom_hf_dir_open(ctx, dir, &ckpt))) goto fail;
        if ((st = compare(ctx, &cfg, &plan, ckpt, &m))) goto fail;
    }
    if (!strcmp(s->format, "json")) {
        if ((st = print_json(ctx, src, &cfg, &plan, ckpt, &m))) goto fail;
    } else {
        print_text(src, &cfg, &plan, ckpt, &m);
    }
    if (s->mesh && (st = print_memory(ctx, s, &cfg))) goto fail;
    if (ckpt && (m.n_missing || m.n_mismatch)) {
        loom_errf(ctx, LOOM_ERR_SHAPE,
                  "%s: the checkpoint does not match config.json (%zu missing, %zu with another "
                  "shape)",
                  dir, m.n_missing, m.n_mismatch);
        rc = loom_cli_fail(ctx);
    }
    goto done;
fail:
    rc = loom_cli_fail(ctx);
done:
    free_match(&m);
    loom_st_close(ckpt);
    loom_param_plan_free(&plan);
    loom_config_free(&cfg);
    return rc;
}
