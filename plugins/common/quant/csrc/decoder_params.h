/* Part of qkernels.c's single translation unit (included from it, in order; not compiled alone):
 * the native decoder's parameters, the one definition of their layout.
 *
 * Each struct is a list of F(type, name) entries. The C structs are generated from the lists
 * below; native_decoder.py builds its ctypes mirror from the same lists (it reads this file,
 * one entry per line), and at load checks it against what this build reports
 * (ifb_decoder_layout_names, ifb_decoder_layout: every struct's size and field offsets). */

#include <stddef.h>

#define IFB_WEIGHT_FIELDS(F)                                                                \
    F(long, kind)                   /* Q4_0, Q4_1, Q8_0, K4, K6 or K5 */                    \
    F(long, passes)                 /* integer activations (see ifb_block_matmul) */        \
    F(const uint8_t *, blocks)      /* interleaved, as ifb_block_matmul reads them */       \
    F(const float *, bias)          /* or NULL */                                           \
    F(long, n)                      /* output features */                                   \
    F(long, k)                      /* input features */

#define IFB_LAYER_FIELDS(F)                                                                 \
    F(const float *, attn_norm)     /* [hidden] */                                          \
    F(const float *, mlp_norm)      /* [hidden] */                                          \
    F(const float *, q_norm)        /* [head_dim] (Qwen3), or NULL */                       \
    F(const float *, k_norm)        /* [head_dim] (Qwen3), or NULL */                       \
    F(weight_t, qkv)                /* q | k | v rows, or q's (k_rows, v_rows: the rest) */ \
    F(weight_t, k_rows)             /* n = 0 when qkv holds them */                         \
    F(weight_t, v_rows)                                                                     \
    F(weight_t, o)                                                                          \
    F(weight_t, gate_up)            /* gate | up rows (a dense MLP) */                      \
    F(weight_t, down)                                                                       \
    F(long, num_experts)            /* 0: the dense MLP above; else a mixture of experts */ \
    F(long, top_k)                                                                          \
    F(long, router_kind)            /* 0: softmax, top k (renormalized: norm_topk); 1: top k, softmax */ \
    F(long, norm_topk)                                                                      \
    F(long, expert_inter)           /* an expert's intermediate size */                     \
    F(const float *, router)        /* [num_experts, hidden] */                             \
    F(const weight_t *, experts_gate_up) /* [num_experts]: gate | up rows */                \
    F(const weight_t *, experts_down) /* [num_experts] */                                   \
    F(weight_t, shared_gate_up)     /* n = 0: no shared expert */                           \
    F(weight_t, shared_down)                                                                \
    F(const float *, shared_gate)   /* [hidden]: the shared expert's gate logit */

#define IFB_DECODER_FIELDS(F)                                                               \
    F(long, num_layers)                                                                     \
    F(long, hidden)                                                                         \
    F(long, intermediate)                                                                   \
    F(long, hq)                                                                             \
    F(long, hkv)                                                                            \
    F(long, d)                                                                              \
    F(float, eps)                                                                           \
    F(const layer_t *, layers)      /* [num_layers] */

#define IFB_STEP_FIELDS(F)                                                                  \
    F(long, t)                      /* tokens in the step */                                \
    F(const float *, rope)          /* [t, 2, d]: cos, then signed sin (-sin | sin) */      \
    F(const int64_t *, slot_mapping) /* [t] */                                              \
    F(const int64_t *, block_tables) /* [seqs, width] */                                    \
    F(long, width)                                                                          \
    F(const int64_t *, query_start_loc) /* [seqs + 1] */                                    \
    F(const int64_t *, seq_lens)    /* [seqs] */                                            \
    F(long, num_seqs)                                                                       \
    F(long, block_size)                                                                     \
    F(void *const *, k_caches)      /* [num_layers] of [blocks, block_size, hkv, d] */      \
    F(void *const *, v_caches)                                                              \
    F(long, kv_half)                /* the caches hold float16 (else float32) */            \
    F(const uint8_t *, row_passes)  /* [t]: each row's passes (1, 2), or NULL (see below) */

/* row_passes: the dense layers' integer matmuls quantize row r to row_passes[r]'s codes instead of
 * their weights' passes (the prompt's rows 8-bit, generated ones 15-bit: NativeDecoder); the
 * mixture-of-experts layers' matmuls keep their weights' passes. */

/* Every struct, in the order the layout report lists them. */
#define IFB_DECODER_STRUCTS(S)                                                              \
    S(weight_t, IFB_WEIGHT_FIELDS)                                                          \
    S(layer_t, IFB_LAYER_FIELDS)                                                            \
    S(decoder_t, IFB_DECODER_FIELDS)                                                        \
    S(step_t, IFB_STEP_FIELDS)

#define IFB_DECLARE_FIELD(type, name) type name;
typedef struct { IFB_WEIGHT_FIELDS(IFB_DECLARE_FIELD) } weight_t;
typedef struct { IFB_LAYER_FIELDS(IFB_DECLARE_FIELD) } layer_t;
typedef struct { IFB_DECODER_FIELDS(IFB_DECLARE_FIELD) } decoder_t;
typedef struct { IFB_STEP_FIELDS(IFB_DECLARE_FIELD) } step_t;
#undef IFB_DECLARE_FIELD

/* "weight_t:kind,passes,...;layer_t:...;": the structs and their fields, in layout-report order. */
#define IFB_FIELD_NAME(type, name) #name ","
#define IFB_STRUCT_NAMES(s, FIELDS) #s ":" FIELDS(IFB_FIELD_NAME) ";"
const char *ifb_decoder_layout_names(void) { return IFB_DECODER_STRUCTS(IFB_STRUCT_NAMES); }
#undef IFB_STRUCT_NAMES
#undef IFB_FIELD_NAME

/* For each struct in that order: its size, then its fields' offsets, into out[0..cap); returns how
 * many numbers the whole layout takes (more than cap: only the first cap were written). */
long ifb_decoder_layout(long *out, long cap) {
    long n = 0;
#define IFB_PUT(v) (n < cap ? (void)(out[n] = (long)(v)) : (void)0, n++);
#define IFB_FIELD_OFFSET(type, name) IFB_PUT(offsetof(ifb_layout_t, name))
#define IFB_STRUCT_LAYOUT(s, FIELDS) { typedef s ifb_layout_t; IFB_PUT(sizeof(s)) FIELDS(IFB_FIELD_OFFSET) }
    IFB_DECODER_STRUCTS(IFB_STRUCT_LAYOUT)
#undef IFB_STRUCT_LAYOUT
#undef IFB_FIELD_OFFSET
#undef IFB_PUT
    return n;
}
