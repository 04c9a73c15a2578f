// The "ws3" library: ws2 (decode_mla_sm90_ws2.cu) with the next page's combination split by group into the overlap
// too (QMLA_WS_PIPE=2, mla_ws_score_pipe.cuh): each content group's scaled scores are folded in as soon as its
// accumulator is complete, between the later groups' wgmma batches; only group 3 and RoPE after the product.
// Everything else is the ws kernel's; kernel="ws" stays the measured baseline (QMLA_WS_PIPE=0).
#define QMLA_WS_PIPE 2
#include "decode_mla_sm90_ws.cu"
