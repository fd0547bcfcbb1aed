"""The Higgs audio codec (24 kHz, hop 960, 8 x 1024 RVQ): our decoder for streaming, the
reference encoder, audio-file decoding and the voice cache. Internal to the engine."""
