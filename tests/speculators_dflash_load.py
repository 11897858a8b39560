"""Run in speculators' own venv (tests/test_dflash_head.py starts it): load draftkit's `--format
speculators` DFlash export with speculators 0.9's own classes (SpeculatorModelConfig /
SpeculatorModel.from_pretrained, which also reads the verifier's embed_tokens and lm_head), report
the classes and which file tensors it holds bit-for-bit, then run its training forward
(DFlashDraftModel._backbone_forward, eager attention) over every block start of INPUTS.pt and save
the draft logits to OUT.pt for the test to compare with draftkit's head."""
import json
import sys

import torch
from importlib.metadata import version
from safetensors.torch import load_file
from speculators import SpeculatorModel, SpeculatorModelConfig


def main(path: str, inputs: str, out: str) -> None:
    cfg = SpeculatorModelConfig.from_pretrained(path)
    cfg.transformer_layer_config._attn_implementation = "eager"  # no flex-attention compile on CPU
    model = SpeculatorModel.from_pretrained(path, config=cfg).eval()
    state, file = model.state_dict(), load_file(path + "/model.safetensors")
    x = torch.load(inputs, weights_only=True)  # hidden (1, T, G*H), input_ids (1, T)
    T, B = x["input_ids"].shape[1], cfg.block_size
    loss_mask = torch.ones(1, T, dtype=torch.long)
    with torch.no_grad():  # every start a < T - B: select_anchors takes all of them, sorted
        _, logits, _, _, idx = model._backbone_forward(
            x["hidden"], x["input_ids"], loss_mask, torch.zeros(1, T, cfg.transformer_layer_config.hidden_size),
            torch.zeros(1, T, dtype=torch.long), max_anchors=T - B)
    torch.save({"logits": logits[0].float(), "block_positions": idx}, out)
    print(json.dumps({
        "speculators_version": version("speculators"), "config_class": type(cfg).__name__,
        "model_class": type(model).__name__, "block_size": B, "mask_token_id": cfg.mask_token_id,
        "aux_layer_ids": list(cfg.aux_hidden_state_layer_ids), "draft_vocab_size": cfg.draft_vocab_size,
        "unloaded_file_tensors": sorted(set(file) - set(state)), "not_in_file": sorted(set(state) - set(file)),
        "mismatched": sorted(k for k in file if k in state and not torch.equal(state[k].to(file[k].dtype), file[k])),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:4])
