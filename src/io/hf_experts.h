/* The two layouts of a mixture of experts' weights in a Hugging Face
 * checkpoint, and loom's view of one as the other.
 *
 * hub (one tensor per expert), as the Qwen3-MoE checkpoints on the hub and
 * loom's parameter plan name them:
 *   <P>experts.<e>.gate_proj.weight [I, H], <P>experts.<e>.up_proj.weight
 *   [I, H], <P>experts.<e>.down_proj.weight [H, I];
 * fused, as transformers v5 holds them in memory and writes them:
 *   <P>experts.gate_up_proj [E, 2I, H] (expert e's gate rows are [e, 0:I),
 *   its up rows [e, I:2I)) and <P>experts.down_proj [E, H, I].
 * P is the layer's module path ("model.layers.<l>.mlp."). Each per-expert
 * tensor is a contiguous slice of a fused one, so reading is a view and
 * writing is the per-expert tensors in the fused tensors' order. The fused
 * layout has no per-expert biases. */
#ifndef LOOM_IO_HF_EXPERTS_H
#define LOOM_IO_HF_EXPERTS_H

#include "export.h"
#include "safetensors.h"

/* Replaces every pair of fused tensors in st by the hub layout's per-expert
 * tensors, views of them (loom_st_splice): dtype, shape, data and file as
 * real entries have. Refused, naming the file, the tensor, its shape and
 * what was expected: a fused tensor without its partner, one that is not
 * 3-D or has a dimension of 0, an odd second dimension of gate_up_proj,
 * gate_up_proj [E, 2I, H] and down_proj [E', H', I'] that disagree (E' == E,
 * H' == H, I' == I), and a layer with tensors of both layouts. On an error
 * the handle may only be closed. */
loom_status loom_hf_experts_unfuse(loom_ctx *ctx, loom_safetensors *st);

/* The tensors of the file loom_hf_dir_write writes for a source: when
 * fused, each layer's per-expert tensors become its two fused
 * tensors, at the place of its first expert tensor; every other tensor is
 * its own. The parts of tensor k are the source tensors idx[t[k].first ..
 * t[k].first + t[k].n), in the order their values follow each other in it
 * (a fused gate_up_proj: gate 0, up 0, gate 1, ...). */
typedef struct loom_hf_out {
    char *name;
    int ndim;
    int64_t shape[3];
    size_t first, n;
} loom_hf_out;

typedef struct loom_hf_layout {
    loom_hf_out *t;
    size_t n;
    size_t *idx; /* (src->n) */
} loom_hf_layout;

/* Refused, naming the tensor: when fused, a per-expert bias (the
 * fused layout has none), a missing expert tensor or shapes that differ
 * between experts. */
loom_status loom_hf_layout_build(loom_ctx *ctx, const loom_tensor_source *src, bool fused,
                                 loom_hf_layout *out);
void loom_hf_layout_free(loom_hf_layout *l);

#endif /* LOOM_IO_HF_EXPERTS_H */
