// The "ws2" library: the warp-specialized decode kernel (decode_mla_sm90_ws.cu) with its score warpgroup
// software-pipelined across pages (QMLA_WS_PIPE=1, mla_ws_score_pipe.cuh): page i's softmax and probability stores
// interleaved with page i + 1's score product. Everything else -- roles, ring, mbarriers, output warpgroups, host
// side -- is the ws kernel's; kernel="ws" stays the measured baseline (QMLA_WS_PIPE=0).
#define QMLA_WS_PIPE 1
#include "decode_mla_sm90_ws.cu"
