"""The quantization scheme both benchmark runners use (they run in different venvs, so no seqcal import)."""

# W4A16 symmetric, group size 64 (SmolLM2's hidden size 576 is not a multiple of 128), as compressed-tensors
# config_groups.
SCHEME = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                         "strategy": "group", "group_size": 64}}}  # fmt: skip
