"""The byte floor of one decode step on an H200 (docs/PERFORMANCE.md): every weight read once plus
the batch's KV cache, at the measured device-to-device copy bandwidth."""

WEIGHT_BYTES = 7.31e9  # read by one audio decode step
KV_BYTES_PER_TOKEN = 147_456  # 36 layers x 2 x 8 heads x 128 x 2 bytes
BANDWIDTH = 4.13e12  # bytes per second


def floor_ms(batch: int, context: int) -> float:
    return (WEIGHT_BYTES + batch * context * KV_BYTES_PER_TOKEN) / BANDWIDTH * 1e3
