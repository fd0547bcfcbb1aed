#!/usr/bin/env bash
# Regenerates the demo's bundled sample voice (voice.wav) from text with eSpeak NG, so the
# demo works without a recording of anyone. Debian: apt-get install espeak-ng.
set -euo pipefail
cd "$(dirname "$0")"
TEXT="Hello, this is a synthetic sample voice, made with eSpeak for trying clonecast."
espeak-ng -v en-us -s 155 -p 45 -w voice.wav "$TEXT"
echo "$TEXT" > voice.txt
