"""The quantization scheme both benchmark runners use (they run in different venvs, so no seqcal import)."""

import os

# W4A16 symmetric, group size 64 by default (SmolLM2's hidden size 576 is not a multiple of 128), as
# compressed-tensors config_groups. SEQCAL_BENCH_GROUP_SIZE changes the group size for both runners at once.
# SEQCAL_BENCH_SYMMETRIC=0 makes it asymmetric (W4A16_ASYM-like, as AWQ is usually run).
GROUP_SIZE = int(os.environ.get("SEQCAL_BENCH_GROUP_SIZE", "64"))
SYMMETRIC = os.environ.get("SEQCAL_BENCH_SYMMETRIC", "1") != "0"
SCHEME = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": SYMMETRIC,
                                                         "strategy": "group", "group_size": GROUP_SIZE}}}  # fmt: skip
# SEQCAL_BENCH_OBSERVER sets the weight observer (mse, imatrix_mse, ...) for both runners; unset: the default.
if os.environ.get("SEQCAL_BENCH_OBSERVER"):
    SCHEME["group_0"]["weights"]["observer"] = os.environ["SEQCAL_BENCH_OBSERVER"]
