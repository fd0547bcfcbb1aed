"""Compressed containers for HTTP speech: FLAC, MP3 and Ogg Opus, encoded by libsndfile
(through soundfile) from the PCM16 an utterance produces, as it is produced.

libsndfile writes forward and, at the end, may seek back to fill in what it only then knows
(FLAC's total sample count, MP3's VBR header). `ContainerEncoder` keeps the whole file: a
complete response gets those final bytes; a streamed one gets every byte as soon as it is
written, and the header fields left as written first ("length unknown", which decoders
accept)."""

from __future__ import annotations

import io

import numpy as np
import soundfile as sf

# response_format -> (libsndfile format, subtype, the media type)
CONTAINERS = {
    "flac": ("FLAC", "PCM_16", "audio/flac"),
    "mp3": ("MP3", "MPEG_LAYER_III", "audio/mpeg"),
    "opus": ("OGG", "OPUS", "audio/ogg"),
}
# Opus codes these rates only; MPEG audio these (MPEG-1, -2 and 2.5 rates)
RATES = {
    "opus": (8000, 12000, 16000, 24000, 48000),
    "mp3": (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000),
}


def check_rate(container: str, rate: int) -> None:
    """ValueError when the container cannot carry audio at `rate`."""
    allowed = RATES.get(container)
    if allowed is not None and rate not in allowed:
        raise ValueError(f"{container} cannot carry {rate} Hz audio; use one of {list(allowed)}")


class ContainerEncoder:
    def __init__(self, container: str, rate: int):
        check_rate(container, rate)
        fmt, subtype, self.media_type = CONTAINERS[container]
        self._file = io.BytesIO()
        self._sent = 0  # bytes already handed out by `encode`
        self._sound = sf.SoundFile(self._file, "w", rate, 1, subtype, format=fmt)

    def encode(self, pcm16: bytes) -> bytes:
        """PCM16 in; the bytes of the file that are new since the last call out."""
        if pcm16:
            self._sound.write(np.frombuffer(pcm16, "<i2"))
        return self._new()

    def finish(self) -> bytes:
        """The last bytes for a stream (after this, `whole()` is the complete file)."""
        self._sound.close()
        return self._new()

    def whole(self) -> bytes:
        """The complete file, with what libsndfile filled in at the end (after `finish`)."""
        return self._file.getvalue()

    def _new(self) -> bytes:
        data = self._file.getbuffer()
        out = bytes(data[self._sent :])
        del data  # a live view would keep the buffer from growing
        self._sent += len(out)
        return out
