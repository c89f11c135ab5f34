// The fast stages' kernel instances for __half contributions (p2p_instances.cuh).
#define ECHO_P2P_FAST_UNIT
#include "p2p_instances.cuh"

ECHO_P2P_FAST_INSTANCES(__half, f16)
