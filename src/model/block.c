/* The layer table (block.h): which kinds make each layer, and the LoRA
 * hooks the kinds call around their linears. */
#include "block.h"

#include "model.h"

const loom_block_kind *const loom_block_kinds[LOOM_NKINDS] = {
    [LOOM_KIND_ATTN] = &loom_block_attn,
    [LOOM_KIND_MLP] = &loom_block_mlp,
};

int loom_layer_kinds(const loom_model_config *c, int64_t l, const loom_block_kind **k) {
    (void)c;
    (void)l;
    k[0] = &loom_block_attn;
    k[1] = &loom_block_mlp;
    return 2;
}

loom_status loom_blk_lin(const loom_blk *b, int mod, const void *x, int64_t T, int64_t in,
                         const void *W, int64_t out, void *y) {
    loom_model *m = b->m;
    const bool lo = loom_lora_covers(m, b->l, mod);
    bool both = false;
    if (lo) CK(loom_lora_fwd(m, b->lora_u, b->l, mod, x, T, y, 0.0f, W, &both));
    if (both) return LOOM_OK;
    return loom_k_lin_fwd(m, x, T, in, W, out, 1.0f, lo ? 1.0f : 0.0f, y);
}

loom_status loom_blk_lora_fwd(const loom_blk *b, int mod, const void *x, int64_t T, void *y) {
    return loom_lora_fwd(b->m, b->lora_u, b->l, mod, x, T, y, 0.0f, NULL, NULL);
}

loom_status loom_blk_lora_bwd(const loom_blk *b, int mod, const void *x, int64_t T,
                              const void *dy, void *dx, bool *acc, loom_dx_term *t, int *n) {
    bool wrote = false;
    CK(loom_lora_bwd(b->m, b->lora_u, b->l, mod, x, T, dy, dx, *acc ? 1.0f : 0.0f, &wrote,
                     t ? &t[*n] : NULL));
    if (wrote) *acc = true;
    if (t && t[*n].dy) (*n)++;
    return LOOM_OK;
}
