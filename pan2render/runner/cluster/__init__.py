"""Where workers run: the executors (Ray placement groups, in-process workers for tests), the Ray
cluster seen from outside, the node kept up on a machine, the GPUs it counts."""
