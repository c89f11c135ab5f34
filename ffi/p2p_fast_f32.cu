// The fast stages' kernel instances for float contributions (p2p_instances.cuh).
#define ECHO_P2P_FAST_UNIT
#include "p2p_instances.cuh"

ECHO_P2P_FAST_INSTANCES(float, f32)
