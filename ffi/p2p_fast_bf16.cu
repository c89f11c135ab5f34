// The fast stages' kernel instances for __nv_bfloat16 contributions (p2p_instances.cuh).
#define ECHO_P2P_FAST_UNIT
#include "p2p_instances.cuh"

ECHO_P2P_FAST_INSTANCES(__nv_bfloat16, bf16)
