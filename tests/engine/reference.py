"""Independent references for parity tests: transformers' Qwen3Model loaded with the same
checkpoint weights, full recompute (no KV cache), and a plain-Python delayed-codebook loop.
Shares no code with the engine beyond reading the checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import Qwen3Config, Qwen3Model

BOC, EOC, Q, V = 1024, 1025, 8, 1026


def load_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


class ReferenceModel:
    def __init__(self, ckpt: Path, dtype=torch.float32, device="cpu"):
        raw = json.loads((ckpt / "config.json").read_text())
        text = dict(raw["text_config"])
        text.pop("model_type", None)
        cfg = Qwen3Config(**text)
        cfg._attn_implementation = "eager"
        tensors = load_tensors(ckpt)
        state = {}
        for key, t in tensors.items():
            if key == "tied.embedding.text_embedding.weight":
                state["embed_tokens.weight"] = t
            elif key == "body.norm.weight":
                state["norm.weight"] = t
            elif key.startswith("body.layers."):
                state[key[len("body.") :]] = t
        with torch.device(device):  # initialise on the device: fast for the full-size model
            self.model = Qwen3Model(cfg).to(dtype=dtype).eval()
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
        self.table = tensors["tied.embedding.modality_embeddings.0.embedding.weight"].to(
            device, dtype
        )
        self.embed_tokens = self.model.embed_tokens.weight
        self.device, self.dtype = device, dtype

    def embeds(self, token_ids, rows):
        """token_ids: list[int]; rows: list[None | 8-tuple] (audio input where not None)."""
        out = []
        for tok, row in zip(token_ids, rows, strict=True):
            if row is None:
                out.append(self.embed_tokens[tok])
            else:
                acc = torch.zeros(self.table.shape[1], dtype=torch.float32, device=self.device)
                for q, c in enumerate(row):
                    acc += self.table[q * V + c].float()
                out.append(acc.to(self.dtype))
        return torch.stack(out)

    @torch.no_grad()
    def hidden(self, token_ids, rows):
        e = self.embeds(token_ids, rows)[None]
        return self.model(inputs_embeds=e).last_hidden_state[0]

    def audio_logits(self, hidden):
        return (hidden @ self.table.t()).float().view(-1, Q, V)


def allowed_codes(q: int, delay: int, countdown: int) -> list[int]:
    """Spec section 3 rule 2, written out plainly for one codebook."""
    if countdown >= 0:
        return [EOC] if q < 8 - countdown else list(range(1024))
    if q >= min(delay + 1, 8):
        return [BOC]
    return list(range(1024)) + ([EOC] if q == 0 else [])


def greedy_reference(ref: ReferenceModel, token_ids, rows, max_rows: int):
    """Full-recompute greedy generation with the plain state machine."""
    ids, inputs = list(token_ids), list(rows)
    delay, countdown, out = 0, -1, []
    while len(out) < max_rows:
        logits = ref.audio_logits(ref.hidden(ids, inputs)[-1:])[0]
        row = []
        for q in range(Q):
            allowed = torch.tensor(allowed_codes(q, delay, countdown))
            row.append(int(allowed[logits[q, allowed].argmax()]))
        out.append(tuple(row))
        ending = countdown >= 0
        if not ending and delay + 1 < 8:
            delay += 1
        if ending:
            countdown -= 1
        if not ending and row[0] == EOC:
            countdown = 7
        if ending and countdown == 0:
            break
        ids.append(0)
        inputs.append(tuple(row))
    return out
